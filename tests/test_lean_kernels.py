"""The lean DSplit and KvSplit kernels against the general ones: a call without sinks,
pass-through rows or group scales takes a lean kernel (DSplit: one per output dtype but
e4m3fnuz; KvSplit: the partials' dtype), and the same call with ``pass_through_from`` at
the token count (no row passes through) takes the general one. Both must write the same
bits, output and exported stats, and match the float64 reference; each config is pinned
through ``KVSPLIT_MODE``. CUDA only: the CPU twin has one path."""

from __future__ import annotations

import math

import pytest
import torch

import kvsplit
from kvsplit import reference

pytestmark = pytest.mark.usefixtures("dispatch_sandbox")

# (mode, head dim): DSplit at each depth and a multi-warp item, KvSplit at K = 1 and 4.
CONFIGS = [("dsplit:2:8:4", 128), ("dsplit:4:4:8", 256), ("dsplit:1:16:16", 96),
           ("dsplit:8:16:8", 512), ("1", 128), ("4", 80)]
OUTPUTS = [(torch.bfloat16, torch.bfloat16, False), (torch.bfloat16, torch.float32, False),
           (torch.bfloat16, torch.float16, False), (torch.bfloat16, torch.float8_e4m3fn, True),
           (torch.float16, torch.float16, False), (torch.float32, torch.float32, False),
           (torch.float32, torch.float8_e4m3fn, False)]


@pytest.mark.parametrize("mode, head_dim", CONFIGS, ids=[m for m, _ in CONFIGS])
@pytest.mark.parametrize("partial_dtype, out_dtype, scaled", OUTPUTS,
                         ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("fmt", ["maxsum", "lse"])
@pytest.mark.gpu
def test_lean_and_general_kernels_write_the_same_bits(cuda_device, fmt, mode, head_dim,
                                                      partial_dtype, out_dtype, scaled,
                                                      merge_kit, monkeypatch):
    device = cuda_device
    monkeypatch.setenv("KVSPLIT_MODE", mode)
    gen = merge_kit.generator("lean", fmt, mode, str(partial_dtype), str(out_dtype))
    # At least 16 splits: every pinned config's groups have a split each.
    num_splits, tokens, heads = int(torch.randint(16, 40, (), generator=gen)), 6, 5
    o = torch.randn(num_splits, tokens, heads, head_dim, generator=gen).to(partial_dtype)
    scale = torch.tensor([0.6]) if scaled else None
    extra = dict(out_dtype=out_dtype, out_scale=None if scale is None else scale.to(device))
    if fmt == "lse":
        stats = 3 * torch.randn(num_splits, tokens, heads, generator=gen)
        stats[torch.rand(stats.shape, generator=gen) < 0.2] = -math.inf
        ref, ref_stats = reference.merge_lse_reference(
            o.reshape(num_splits, -1, head_dim), stats.reshape(num_splits, -1), base=math.e)
        runs = [kvsplit.merge_lse(o.to(device), stats.to(device), base=math.e, return_lse=True,
                                  pass_through_from=p, **extra) for p in (None, tokens)]
    else:
        stats = torch.stack([3 * torch.randn(num_splits, tokens, heads, generator=gen),
                             torch.rand(num_splits, tokens, heads, generator=gen) + 0.5], -1)
        ref, ref_stats = reference.merge_maxsum_reference(
            o.reshape(num_splits, -1, head_dim), stats.reshape(num_splits, -1, 2), 0.7)
        runs = [kvsplit.merge_maxsum(o.to(device), stats.to(device), 0.7, return_stats=True,
                                     pass_through_from=p, **extra) for p in (None, tokens)]
    (lean, lean_stats), (general, general_stats) = ((a.cpu(), b.cpu()) for a, b in runs)
    assert lean.dtype == out_dtype
    assert torch.equal(lean.view(torch.uint8), general.view(torch.uint8))
    assert torch.equal(lean_stats, general_stats)
    if fmt == "lse":
        torch.testing.assert_close(lean_stats.double().reshape(-1), ref_stats.float().double(),
                                   rtol=1e-5, atol=1e-6)
    expected = ref / scale.double() if scaled else ref
    if out_dtype == torch.float8_e4m3fn:
        expected = expected.clamp(-448, 448).to(out_dtype).double()
        tolerance = dict(rtol=2 ** -3, atol=2 ** -9)
    else:
        tolerance = dict(rtol={torch.float32: 1e-5}.get(out_dtype, 2 ** -7), atol=1e-5)
    torch.testing.assert_close(lean.double().reshape(-1, head_dim), expected, **tolerance)
