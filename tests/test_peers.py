"""The benchmark peers (benchmarks/peers.py) against the float64 reference, on the GPU.

The serial Triton merge and the torch.compile'd merge are only timed next to
kvsplit, but a peer that computes something else would make the timing
meaningless: both are held here to kvsplit's CPU float64 reference, on fresh
random partials with empty splits and an empty row.
"""

from __future__ import annotations

import importlib.util
import zlib
import math
from pathlib import Path

import pytest
import torch

from kvsplit import reference

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)
pytest.importorskip("triton")

_spec = importlib.util.spec_from_file_location(
    "kvsplit_bench_peers", Path(__file__).resolve().parents[1] / "benchmarks" / "peers.py")
peers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peers)

FORMATS = {"maxsum": ("maxsum", 2.0), "lse2": ("lse", 2.0), "lsee": ("lse", math.e)}
# ||out - ref|| / ||ref|| per output dtype (the 16-bit rounding is about eps / 2 / sqrt(3)).
REL_NORM_TOL = {torch.bfloat16: 4e-3, torch.float16: 1e-3}
ATOL = 1e-5


def case(fmt, num_splits, rows, head_dim, dtype, seed):
    """Fresh partials (CPU float32 and their CUDA copies) and the float64 reference."""
    stats_format, base = FORMATS[fmt]
    g = torch.Generator().manual_seed(seed)
    partial_o, stats = reference.random_partials(num_splits, rows, head_dim,
                                                 stats_format=stats_format, generator=g,
                                                 empty_fraction=0.2)
    # Row 0 has no non-empty split (its output is 0).
    if stats_format == "maxsum":
        stats[:, 0, 0], stats[:, 0, 1] = -math.inf, 0.0
    else:
        stats[:, 0] = -math.inf
    partial_o = partial_o.to(dtype)
    scale = float(0.25 + 1.75 * torch.rand((), generator=g))
    if stats_format == "maxsum":
        ref, _ = reference.merge_maxsum_reference(partial_o, stats, scale)
    else:
        ref, _ = reference.merge_lse_reference(partial_o, stats, base=base)
    kwargs = {"stats_format": stats_format, "scale_log2": scale, "base": base}
    out = torch.full((rows, head_dim), float("nan"), dtype=dtype, device="cuda")
    return partial_o.cuda(), stats.cuda(), out, ref, kwargs


def check(out, ref):
    out = out.cpu()
    assert not out.isnan().any()
    eps = torch.finfo(out.dtype).eps
    got = out.double()
    error = float((got - ref).norm())
    bound = REL_NORM_TOL[out.dtype] * float(ref.norm()) + ATOL * math.sqrt(ref.numel())
    assert error <= bound, f"||out - ref|| = {error:.3g} > {bound:.3g}"
    torch.testing.assert_close(got, ref, rtol=2 * eps, atol=ATOL)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


SHAPES = [(16, 37, 128), (132, 5, 512), (3, 64, 64), (264, 2, 256), (1, 9, 128)]


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "N%d-r%d-D%d" % s)
def test_serial_triton_matches_reference(fmt, dtype, shape):
    seed = zlib.crc32(repr((fmt, shape)).encode())
    o, stats, out, ref, kwargs = case(fmt, *shape, dtype, seed=seed)
    peers.triton_merge(o, stats, out, **kwargs)
    check(out, ref)


def test_serial_triton_num_warps():
    """Every warp count the benchmark tries computes the same merge."""
    o, stats, out, ref, kwargs = case("lse2", 64, 33, 512, torch.bfloat16, seed=7)
    for num_warps in (1, 2, 4, 8):
        out.fill_(float("nan"))
        peers.triton_merge(o, stats, out, num_warps=num_warps, **kwargs)
        check(out, ref)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_compiled_matches_reference(fmt):
    o, stats, out, ref, kwargs = case(fmt, 32, 20, 128, torch.bfloat16, seed=11)
    peers.compiled_merge(o, stats, out, **kwargs)
    check(out, ref)


def test_compiled_in_cuda_graph():
    """The compiled merge replays in a CUDA graph on new data in the same buffers."""
    o, stats, out, _, kwargs = case("lse2", 16, 24, 256, torch.bfloat16, seed=3)
    peers.compiled_merge(o, stats, out, **kwargs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        peers.compiled_merge(o, stats, out, **kwargs)
    fresh_o, fresh_stats, _, ref, _ = case("lse2", 16, 24, 256, torch.bfloat16, seed=4)
    o.copy_(fresh_o)
    stats.copy_(fresh_stats)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check(out, ref)
