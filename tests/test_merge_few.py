"""Numerics of the Few family (every state of a few vectors of a row merged by one thread).

Each config is pinned with ``KVSPLIT_MODE=few:VECTORS`` and run through the public merge
functions and the engines' adapters, on the CPU twin and on CUDA where it can, against the
float64 reference and against KvSplit K = 1 on fresh random data. The family's rules are
written out here, independently of dispatch/: a thread holds 1, 2 or 4 of a row's V
16-byte vectors, on L = ceil(V / vectors) threads a row, and no step of a row may be empty
((vectors - 1) * L < V); a round loads the fewest of 2, 4, 8, 16 states that hold the
call's, at most 8 loads a thread with more than one vector (the call's order of
combination: the CPU twin's rounds are the kernel's).
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import kvsplit
from kvsplit import _kernel, _native, merge, reference
from kvsplit.config import FAMILY_CODES, KernelConfig, few_depth, few_launch, few_threads_per_row
from cuda_profile import profiled_kernels
from merge_grid import DTYPES, FORMATS, out_kwargs

pytestmark = pytest.mark.usefixtures("dispatch_sandbox")

HEAD_DIMS = [64, 80, 128, 192, 256, 512, 576]


def spec_vectors(head_dim: int, elem_bytes: int) -> list[int]:
    row = head_dim * elem_bytes // 16
    return [v for v in (1, 2, 4) if (v - 1) * -(-row // v) < row]


def spec_depth(num_splits: int, vectors: int) -> int:
    fitting = [d for d in (2, 4, 8, 16) if vectors == 1 or d * vectors <= 8]
    return next((d for d in fitting if d >= num_splits), fitting[-1])


def few_configs(head_dim: int, elem_bytes: int) -> list[KernelConfig]:
    return [KernelConfig.few(v) for v in spec_vectors(head_dim, elem_bytes)]


def pin(monkeypatch, config: KernelConfig) -> None:
    monkeypatch.setenv("KVSPLIT_MODE", f"few:{config.vectors}")


# -- the family's rules, as the kernel layer states them ------------------------------------

@pytest.mark.parametrize("elem_bytes", [2, 4])
def test_the_rules_are_the_written_ones(elem_bytes):
    for head_dim in range(16 // elem_bytes, 1025, 16 // elem_bytes):
        row = head_dim * elem_bytes // 16
        legal = spec_vectors(head_dim, elem_bytes)
        for vectors in (1, 2, 4):
            lanes = few_threads_per_row(head_dim, elem_bytes, vectors)
            assert (lanes > 0) == (vectors in legal)
            if lanes:
                assert lanes == -(-row // vectors)
    for num_splits in range(40):
        for vectors in (1, 2, 4):
            assert few_depth(num_splits, vectors) == spec_depth(num_splits, vectors)


@pytest.mark.parametrize("lanes", [1, 3, 8, 24, 72, 128, 256])
@pytest.mark.parametrize("rows", [1, 7, 32, 1029, 1 << 20, (1 << 30) // 3, 1 << 31, 1 << 40])
@pytest.mark.parametrize("sm_count", [1, 132])
def test_the_grid_covers_every_row_in_whole_passes(lanes, rows, sm_count):
    """One pass when the call's threads fit 2^30; else passes of whole rows (the grid's
    threads a multiple of the row's) on thread indices below 2^31. Up to 1024 threads an
    SM, CTAs of whole warps (128..256 threads) whose busiest SM gets the fewest threads, the
    largest CTA of equals, never more than CTAs of the smallest power of two from 128 that
    holds an SM's share would give it; past that, CTAs of 256."""
    low = 128
    cta, ctas, rows_per_pass = few_launch(lanes, rows, sm_count)
    threads = rows * lanes
    assert ctas * cta < 1 << 31
    if threads <= 1 << 30:
        assert cta % 32 == 0 and low <= cta <= 256
        assert rows_per_pass == rows and (ctas - 1) * cta < threads <= ctas * cta
        if -(-threads // sm_count) > 1024:
            assert cta == 256
            return

        def busiest(size):
            return -(-(-(-threads // size)) // sm_count) * size

        loads = {size: busiest(size) for size in range(low, 257, 32)}
        assert busiest(cta) == min(loads.values())
        assert cta == max(size for size, load in loads.items() if load == busiest(cta))
        power = low
        while power < -(-threads // sm_count) and power < 256:
            power *= 2
        assert busiest(cta) <= busiest(power)
    else:
        assert cta in (128, 256)
        assert ctas * cta == rows_per_pass * lanes and rows_per_pass % cta == 0


@pytest.mark.parametrize("family, slices, kv_split, depth, vectors, head_dim, words", [
    ("few", 2, 1, 4, 1, 128, "slices"), ("few", 1, 2, 4, 1, 128, "kv_split"),
    ("few", 1, 1, 8, 1, 128, "depth"), ("few", 1, 1, 4, 3, 128, "vectors"),
    ("few", 1, 1, 4, 4, 16, "vectors"),   # 2 vectors a row: the 4-vector thread's steps 2, 3 empty
    ("few", 1, 1, 4, 4, 40, "vectors"),   # 5 vectors: (4 - 1) * 2 >= 5
    ("kvsplit", 1, 1, 4, 2, 128, "vectors"), ("dsplit", 2, 8, 4, 2, 128, "vectors")])
def test_the_kernels_refuse_an_impossible_config(device, family, slices, kv_split, depth,
                                                 vectors, head_dim, words, merge_kit):
    """The launchers' own check, CUDA and CPU twin alike (the dispatcher never sends these):
    nothing is written."""
    partial_o, stats = merge_kit.partials("maxsum", 8, 4, head_dim, torch.bfloat16,
                                          merge_kit.generator("few-geometry", vectors, head_dim))
    partial_o, stats = partial_o.to(device), stats.to(device)
    out = torch.full((4, head_dim), 7.0, dtype=torch.bfloat16, device=device)
    kernel_launch = _kernel.Launch(KernelConfig.kvsplit(1), merge.MAXSUM, partial_o, stats, out, None, 1.0)
    ext = _native.ext()
    bad = ext.KernelConfig(FAMILY_CODES[family], slices, kv_split, depth, vectors)
    object.__setattr__(kernel_launch, "native", ext.Launch(kernel_launch.native.params, bad, kernel_launch.native.target))
    with pytest.raises(ValueError, match=f"unsupported {words}"):
        _kernel.run(kernel_launch, partial_o, stats, out, 1.0)
    assert torch.equal(out.cpu(), torch.full((4, head_dim), 7.0, dtype=torch.bfloat16))


# -- numerics -------------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_config_matches_reference_and_k1(device, fmt, dtypes, head_dim, merge_kit,
                                                chosen_kv_split, monkeypatch):
    """Sinks, split counts, empty splits and exported stats at 2..16 states; split-major and
    row-major layouts; rows that end mid-CTA."""
    partial_dtype = dtypes[0]
    gen = merge_kit.generator("few", fmt, str(dtypes), head_dim)
    configs = few_configs(head_dim, partial_dtype.itemsize)
    assert configs
    for num_splits in (2, 3, 5, 16):
        rows, heads = 4 * int(torch.randint(1, 9, (), generator=gen)) + 3, 1
        partial_o, stats = merge_kit.partials(fmt, num_splits, rows, head_dim, partial_dtype, gen,
                                              empty_fraction=0.3)
        split_counts = torch.randint(0, num_splits + 3, (rows,), generator=gen, dtype=torch.int32)
        sinks = torch.randn(heads, generator=gen) + 2.0
        scale = merge_kit.scale_log2(gen)
        expected = merge_kit.reference(fmt, partial_o, stats, scale=scale, sinks=sinks,
                                       split_counts=split_counts)
        row_major_o = partial_o.transpose(0, 1).contiguous().transpose(0, 1)

        def run(o, counts):
            inputs = [t.to(device) for t in (o, stats, sinks)]
            return merge_kit.merge(fmt, *inputs[:2], scale=scale, sinks=inputs[2],
                                   split_counts=None if counts is None else counts.to(device),
                                   **out_kwargs(rows, head_dim, dtypes[1], dtypes[0], device))

        monkeypatch.setenv("KVSPLIT_MODE", "off")
        base_out, base_stats = run(partial_o, split_counts)
        for i, config in enumerate(configs):
            pin(monkeypatch, config)
            out, out_stats = run((partial_o, row_major_o)[i % 2], split_counts)
            merge_kit.assert_matches_reference(out, out_stats, *expected)
            merge_kit.assert_same_function(fmt, out, out_stats, base_out, base_stats)
            # Every row merging every state: the kernel's plain path.
            plain, plain_stats = run(partial_o, None)
            merge_kit.assert_matches_reference(plain, plain_stats, *merge_kit.reference(
                fmt, partial_o, stats, scale=scale, sinks=sinks))
    assert chosen_kv_split == ([1] + [c for c in configs for _ in range(2)]) * 4


@pytest.mark.parametrize("vectors", [1, 2, 4])
@pytest.mark.parametrize("with_counts", [True, False], ids=["split-counts", "plain"])
def test_every_count_of_states_and_rounds(device, vectors, with_counts, merge_kit,
                                          chosen_kv_split, monkeypatch):
    """1..20 states: one round of each depth (2, 4, 8, 16; at most 8 loads a thread of
    several vectors), and several rounds past it; split counts give rows of every count up
    to the call's, some empty."""
    head_dim, rows = 128, 13
    config = KernelConfig.few(vectors)
    for num_splits in range(1, 21):
        gen = merge_kit.generator("few-rounds", vectors, num_splits)
        partial_o, stats = merge_kit.partials("maxsum", num_splits, rows, head_dim,
                                              torch.bfloat16, gen)
        split_counts = None
        if with_counts:
            split_counts = torch.arange(rows, dtype=torch.int32) % (num_splits + 2)
        scale = merge_kit.scale_log2(gen)
        pin(monkeypatch, config)
        out, out_stats = merge_kit.merge(
            "maxsum", partial_o.to(device), stats.to(device), scale=scale,
            split_counts=None if split_counts is None else split_counts.to(device))
        merge_kit.assert_matches_reference(out, out_stats, *merge_kit.reference(
            "maxsum", partial_o, stats, scale=scale, split_counts=split_counts))
        if with_counts:
            assert torch.equal(out[0].cpu(), torch.zeros(head_dim, dtype=out.dtype))
    assert chosen_kv_split == [config] * 20


@pytest.mark.parametrize("fmt", FORMATS)
def test_raw_stats_empty_rows_and_nan(device, fmt, merge_kit, chosen_kv_split, monkeypatch):
    """Random scales and the base-e LSE, empty splits (-inf) and whole empty rows, and a NaN
    stat that must poison its own row and no other."""
    head_dim, rows, poisoned_row = 128, 9, 4
    configs = few_configs(head_dim, 2)
    for config in configs:
        gen = merge_kit.generator("few-nan", fmt, config.vectors)
        num_splits = int(torch.randint(2, 17, (), generator=gen))
        pin(monkeypatch, config)
        merge_kit.assert_empty_rows_and_nan_row(fmt, gen, num_splits, rows, head_dim, device,
                                                poisoned_row)
    assert chosen_kv_split == [c for c in configs for _ in range(2)]


@pytest.mark.parametrize("rows", [1, 5, 33, 1029])
def test_structured_rows_of_any_strides(device, rows, monkeypatch):
    """(tokens, heads) rows with token-major partials, a head-major LSE (scattered stats),
    a strided output and sinks: every row found through its (token, head)."""
    heads, head_dim, num_splits = 3, 192, 4
    tokens = -(-rows // heads)
    g = torch.Generator().manual_seed(rows)
    o = torch.randn(num_splits, tokens, heads, head_dim, generator=g).bfloat16()
    lse = 3 * torch.randn(num_splits, tokens, heads, generator=g)
    sinks = torch.randn(heads, generator=g)
    ref, ref_lse = reference.merge_lse_reference(
        o.reshape(num_splits, -1, head_dim), lse.reshape(num_splits, -1), base=math.e,
        sinks=sinks)
    o_view = o.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3).to(device)
    lse_view = lse.permute(0, 2, 1).contiguous().permute(0, 2, 1).to(device)
    for config in few_configs(head_dim, 2):
        pin(monkeypatch, config)
        out = torch.full((tokens, heads, head_dim + 16), 7.0, dtype=torch.bfloat16,
                         device=device)[..., :head_dim]
        _, out_lse = kvsplit.merge_lse(o_view, lse_view, base=math.e, sinks=sinks.to(device),
                                       out=out, return_lse=True)
        torch.testing.assert_close(out.cpu().double().reshape(-1, head_dim), ref,
                                   rtol=2 ** -8, atol=1e-5)
        torch.testing.assert_close(out_lse.cpu().double().reshape(-1), ref_lse.float().double(),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128, 512])
def test_in_place_merges_keep_a_row_in_one_warp(device, heads, head_dim, monkeypatch):
    """FlashInfer's in-place merge (stats exported over split 0's, a row mask): a Few row's
    threads must share a warp, so a config whose rows would not (D = 512 at one vector a
    thread: 64 threads) runs with more vectors a thread."""
    from kvsplit.compat import flashinfer

    gen = torch.Generator().manual_seed(heads * head_dim)
    seq = 7
    v, v_other = (torch.randn(seq, heads, head_dim, generator=gen).bfloat16() for _ in range(2))
    s, s_other = (4 * torch.randn(seq, heads, generator=gen) for _ in range(2))
    mask = torch.rand(seq, generator=gen) < 0.7
    top = torch.maximum(s, s_other).double()
    w, w_other = torch.exp2(s.double() - top), torch.exp2(s_other.double() - top)
    expected_v = ((w.unsqueeze(-1) * v.double() + w_other.unsqueeze(-1) * v_other.double())
                  / (w + w_other).unsqueeze(-1))
    expected_s = (top + torch.log2(w + w_other)).float()
    keep = mask.view(seq, 1)
    want_v = torch.where(keep.unsqueeze(-1), expected_v, v.double())
    want_s = torch.where(keep, expected_s, s)
    launched = []
    launch_init = _kernel.Launch.__init__
    monkeypatch.setattr(_kernel.Launch, "__init__",
                        lambda made, config, *args, **kwargs: (launched.append(config),
                                                               launch_init(made, config, *args,
                                                                         **kwargs))[-1])
    for config in few_configs(head_dim, 2):
        pin(monkeypatch, config)
        v_dev, s_dev = v.to(device, copy=True), s.to(device, copy=True)
        flashinfer.merge_state_in_place(v_dev, s_dev, v_other.to(device), s_other.to(device),
                                        mask=mask.to(device))
        torch.testing.assert_close(v_dev.cpu().double(), want_v, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(s_dev.cpu(), want_s, atol=1e-4, rtol=1e-4)
    lanes = [few_threads_per_row(head_dim, 2, c.vectors) for c in launched]
    assert all(c.family == "few" and 32 % n == 0 for c, n in zip(launched, lanes))
    if head_dim == 512:  # one vector a thread is 64 threads a row: two vectors run instead
        assert launched[0] == KernelConfig.few(2)


@pytest.mark.parametrize("vectors", [1, 2, 4])
def test_two_states_in_separate_tensors(device, vectors, monkeypatch):
    """vLLM's and FlashInfer's two-state merges: parts held apart (the split stride is their
    distance, per call), the output and LSE of each adapter."""
    from kvsplit.compat import flashinfer

    g = torch.Generator().manual_seed(vectors)
    tokens, heads, head_dim = 9, 5, 128
    pin(monkeypatch, KernelConfig.few(vectors))
    for _ in range(2):  # new tensors: another distance between the parts
        v_a, v_b = (torch.randn(tokens, heads, head_dim, generator=g).bfloat16()
                    for _ in range(2))
        s_a, s_b = (3 * torch.randn(tokens, heads, generator=g) for _ in range(2))
        ref, ref_lse = reference.merge_lse_reference(
            torch.stack([v_a, v_b]).reshape(2, -1, head_dim), torch.stack([s_a, s_b]).reshape(2, -1),
            base=2.0)
        out, lse = flashinfer.merge_state(v_a.to(device), s_a.to(device), v_b.to(device),
                                          s_b.to(device))
        torch.testing.assert_close(out.cpu().double().reshape(-1, head_dim), ref, rtol=2 ** -8,
                                   atol=1e-5)
        torch.testing.assert_close(lse.cpu().double().reshape(-1), ref_lse.float().double(),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtypes", DTYPES)
def test_cuda_agrees_with_the_cpu_twin(cuda_device, fmt, dtypes, merge_kit, monkeypatch):
    """The twin merges in the kernel's rounds: the two agree to float32 rounding (the GPU's
    approximate exp2 and fused multiply-adds), outputs within one ulp, stats to 2e-6."""
    head_dim = 192
    for config in few_configs(head_dim, dtypes[0].itemsize):
        for num_splits in (2, 4, 7, 16, 19):
            gen = merge_kit.generator("few-twin", fmt, str(dtypes), config.vectors, num_splits)
            rows = 300
            partial_o, stats = merge_kit.partials(fmt, num_splits, rows, head_dim, dtypes[0], gen,
                                                  empty_fraction=0.2)
            split_counts = torch.randint(0, num_splits + 1, (rows,), generator=gen,
                                         dtype=torch.int32)
            scale = merge_kit.scale_log2(gen)
            pin(monkeypatch, config)
            results = [merge_kit.merge(fmt, partial_o.to(device), stats.to(device), scale=scale,
                                       split_counts=split_counts.to(device),
                                       **out_kwargs(rows, head_dim, dtypes[1], dtypes[0], device))
                       for device in ("cpu", cuda_device)]
            merge_kit.assert_same_function(fmt, *results[1], *results[0])


@pytest.mark.gpu
@pytest.mark.parametrize("vectors", [1, 2])
def test_offsets_past_2_to_the_31(cuda_device, vectors, merge_kit, chosen_kv_split, monkeypatch):
    """Partials 2^29 elements apart (4 GiB of bf16 in all): the last state's offset, 2^31
    elements, takes 64-bit addressing."""
    num_splits, rows, head_dim = 5, 8, 128
    gen = merge_kit.generator("few-offsets", vectors)
    partial_o, stats = merge_kit.partials("lse2", num_splits, rows, head_dim, torch.bfloat16,
                                          gen)
    split_stride = 1 << 29
    storage = torch.empty((num_splits - 1) * split_stride + rows * head_dim,
                          dtype=torch.bfloat16, device=cuda_device)
    spread = storage.as_strided((num_splits, rows, head_dim), (split_stride, head_dim, 1))
    spread.copy_(partial_o)
    config = KernelConfig.few(vectors)
    pin(monkeypatch, config)
    out, lse = merge_kit.merge("lse2", spread, stats.to(cuda_device))
    merge_kit.assert_matches_reference(out, lse, *merge_kit.reference("lse2", partial_o, stats))
    assert chosen_kv_split == [config]


def on(t, device):
    """``t`` on ``device`` with its strides: ``Tensor.to`` gives a tensor with gaps between its
    rows (the sliced layout below) contiguous strides."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device).copy_(t)


def layouts(num_splits, tokens, heads, head_dim, gen, dtype=torch.bfloat16):
    """(name, partials, LSE) of one problem, (num_splits, tokens, heads, D), in the layouts
    the kernels address differently: split-major (flat rows), token-major partials with a
    head-major LSE, and heads sliced out of more (a token stride that is not heads head
    strides): the last two (token, head) rows."""
    o = torch.randn(num_splits, tokens, heads, head_dim, generator=gen).to(dtype)
    lse = 3 * torch.randn(num_splits, tokens, heads, generator=gen)
    lse[torch.rand(lse.shape, generator=gen) < 0.2] = -math.inf
    token_major = o.permute(1, 2, 0, 3).contiguous().permute(2, 0, 1, 3)
    head_major = lse.permute(0, 2, 1).contiguous().permute(0, 2, 1)
    more = torch.zeros(num_splits, tokens, heads + 3, head_dim, dtype=o.dtype)
    more[:, :, 1:heads + 1] = o
    return [("split-major", o, lse), ("token-major", token_major, head_major),
            ("sliced", more[:, :, 1:heads + 1], lse)]


@pytest.mark.parametrize("vectors", [1, 2, 4])
def test_the_lean_kernel_and_the_general_one_agree(device, vectors, monkeypatch):
    """A call with nothing but states to merge, all in one round, takes the lean kernel; the
    same call with every row's split count at the call's takes the general one, which also
    takes the calls of several rounds (5, 16 and 19 states with 2 or 4 vectors, 19 with 1). Both
    merge the same rounds in the same order: the same bits, output and exported LSE, in
    every layout, against the float64 reference."""
    config = KernelConfig.few(vectors)
    pin(monkeypatch, config)
    for num_splits in (2, 5, 16, 19):
        gen = torch.Generator().manual_seed(100 * vectors + num_splits)
        tokens, heads, head_dim = 7, 5, 128
        for name, o, lse in layouts(num_splits, tokens, heads, head_dim, gen):
            ref, ref_lse = reference.merge_lse_reference(
                o.reshape(num_splits, -1, head_dim), lse.reshape(num_splits, -1), base=math.e)
            counts = torch.full((tokens, heads), num_splits, dtype=torch.int32)
            runs = [kvsplit.merge_lse(on(o, device), lse.to(device), base=math.e, return_lse=True,
                                      split_counts=c) for c in (None, counts.to(device))]
            (lean, lean_lse), (general, general_lse) = runs
            assert torch.equal(lean, general) and torch.equal(lean_lse, general_lse), name
            torch.testing.assert_close(lean.cpu().double().reshape(-1, head_dim), ref,
                                       rtol=2 ** -8, atol=1e-5)
            torch.testing.assert_close(lean_lse.cpu().double().reshape(-1),
                                       ref_lse.float().double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", ["lse", "maxsum"])
@pytest.mark.parametrize("partial_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_two_states_take_the_pair_instance_with_the_general_bits(device, fmt, partial_dtype,
                                                                  monkeypatch):
    """Exactly two states a row at one vector a thread take the lean kernel's pair instance
    (its threads past the rows leave first, its round written out for two states); the same
    call with ``pass_through_from`` at the token count (no row passes through) takes the
    general kernel. The same bits, output and exported stats, in every layout, with empty
    states, a whole empty row, a NaN stat and a row count that leaves the last warp part
    empty; and the float64 reference on the rows without NaN."""
    pin(monkeypatch, KernelConfig.few(1))
    gen = torch.Generator().manual_seed(31 + len(fmt) + partial_dtype.itemsize)
    tokens, heads, head_dim = 7, 5, 96
    for name, o, lse in layouts(2, tokens, heads, head_dim, gen, partial_dtype):
        lse = lse.clone()
        lse[:, 3, 1] = -math.inf  # an empty row
        lse[1, 6, 4] = math.nan  # a NaN row
        clean = torch.ones(tokens, heads, dtype=torch.bool)
        clean[6, 4] = False
        if fmt == "lse":
            stats = lse
            ref, ref_stats = reference.merge_lse_reference(
                o.reshape(2, -1, head_dim), stats.reshape(2, -1), base=math.e)
            runs = [kvsplit.merge_lse(on(o, device), stats.to(device), base=math.e,
                                      return_lse=True, pass_through_from=p)
                    for p in (None, tokens)]
        else:
            sums = torch.rand(2, tokens, heads, generator=gen) + 0.5
            stats = torch.stack([lse, sums], -1)
            ref, ref_stats = reference.merge_maxsum_reference(
                o.reshape(2, -1, head_dim), stats.reshape(2, -1, 2), 0.7)
            runs = [kvsplit.merge_maxsum(on(o, device), stats.to(device), 0.7, return_stats=True,
                                         pass_through_from=p) for p in (None, tokens)]
        (pair, pair_stats), (general, general_stats) = ((a.cpu(), b.cpu()) for a, b in runs)
        assert torch.equal(pair.view(torch.uint8), general.view(torch.uint8)), name
        assert torch.equal(pair_stats.view(torch.int32), general_stats.view(torch.int32)), name
        assert pair[6, 4].isnan().all() and pair_stats[6, 4].isnan().any(), name
        assert torch.equal(pair[3, 1], torch.zeros(head_dim, dtype=pair.dtype)), name
        rows = clean.reshape(-1)
        tolerance = {torch.float32: 1e-5}.get(pair.dtype, 2 ** -7)
        torch.testing.assert_close(pair.double().reshape(-1, head_dim)[rows], ref[rows],
                                   rtol=tolerance, atol=1e-5)
        if fmt == "lse":
            torch.testing.assert_close(pair_stats.double().reshape(-1)[rows],
                                       ref_stats.float().double()[rows], rtol=1e-5, atol=1e-6)


def launched_kernel(call):
    """(name, trailing bool template arguments, result) of the one kernel ``call`` launches,
    from the CUDA profiler's name of it, demangled (``few_lean_kernel<(kvsplit::DType)0, ...,
    true, false>(...)``) or not (``_ZN7kvsplit15few_lean_kernelIL...Lb1ELb0EEEv...``)."""
    names, result = profiled_kernels(call)
    assert len(names) == 1, names
    name = names[0]
    if name.startswith("_Z"):
        kernel = re.search(r"kvsplit\d+(\w+?)I", name).group(1)
        flags = [f == "1" for f in re.findall(r"Lb([01])E", name)]
    else:
        start = name.index("<")
        kernel = name[:start].split("::")[-1]
        args = name[start + 1:name.rindex(">")].split(", ")
        flags = [a == "true" for a in args if a in ("true", "false")]
    return kernel, flags, result


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, partial_dtype, out_dtype", [
    ("lse", torch.bfloat16, None), ("lse", torch.float16, None), ("lse", torch.float32, None),
    ("lse", torch.bfloat16, torch.float32), ("lse", torch.bfloat16, torch.float8_e4m3fn),
    ("maxsum", torch.bfloat16, None), ("maxsum", torch.float32, None)])
def test_packed_rows_take_the_packed_instance_with_the_general_bits(
        cuda_device, fmt, partial_dtype, out_dtype, monkeypatch):
    """Two to four states whose partials and output lie row after row (split-major
    (token, head) rows, any split stride) at a power-of-two count of threads a row take the
    lean kernel's packed instances (rows by a shift, offsets the thread's index; three or
    four states at decode sizes on the pair's parameter block, larger calls on the lean
    one: test_large_packed_calls_of_four_states_keep_the_lean_block), and two such states
    at any other count (D 80) the packed pair with its rows by a divisor (35 rows: a
    decode-sized call); the same call with heads sliced out of more takes the instance for
    (token, head) strides,
    and with ``pass_through_from`` at the token count the general kernel. The same bits,
    output and exported stats, with empty states, a whole empty row, a NaN stat and 35 rows
    (the last warp part empty); the float64 reference on the rows without NaN."""
    pin(monkeypatch, KernelConfig.few(1))
    tokens, heads = 5, 7
    for num_splits in (2, 3, 4):
        for head_dim in (64, 80, 512):
            power_of_two = head_dim != 80  # a row's 16-byte vectors, or 8-byte ones
            gen = torch.Generator().manual_seed(num_splits * head_dim + len(fmt)
                                                + partial_dtype.itemsize)
            for name, o, lse in layouts(num_splits, tokens, heads, head_dim, gen,
                                        partial_dtype)[::2]:  # split-major, sliced
                lse = lse.clone()
                lse[:, 3, 1] = -math.inf  # an empty row
                lse[1, 4, 6] = math.nan  # a NaN row
                clean = torch.ones(tokens, heads, dtype=torch.bool)
                clean[4, 6] = False
                o_gpu = on(o, cuda_device)
                if fmt == "lse":
                    stats = lse.to(cuda_device)
                    ref, ref_stats = reference.merge_lse_reference(
                        o.reshape(num_splits, -1, head_dim), lse.reshape(num_splits, -1),
                        base=math.e)

                    def run(p):
                        return kvsplit.merge_lse(o_gpu, stats, base=math.e, return_lse=True,
                                                 out_dtype=out_dtype, pass_through_from=p)
                else:
                    sums = torch.rand(num_splits, tokens, heads, generator=gen) + 0.5
                    host_stats = torch.stack([lse, sums], -1)
                    stats = host_stats.to(cuda_device)
                    ref, ref_stats = reference.merge_maxsum_reference(
                        o.reshape(num_splits, -1, head_dim),
                        host_stats.reshape(num_splits, -1, 2), 0.7)

                    def run(p):
                        return kvsplit.merge_maxsum(o_gpu, stats, 0.7, return_stats=True,
                                                    out_dtype=out_dtype, pass_through_from=p)
                run(None)  # tuned or not, the next call launches one kernel
                kernel, flags, (packed, packed_stats) = launched_kernel(lambda: run(None))
                if name == "split-major" and num_splits == 2:
                    instance = ("few_packed_pair_kernel" if power_of_two
                                else "few_packed_pair_div_kernel")
                    assert kernel == instance, (name, head_dim, kernel)
                elif name == "split-major" and power_of_two:  # 35 rows: a decode-sized call
                    assert kernel == "few_packed_quad_kernel", (name, head_dim, kernel)
                else:
                    assert kernel == "few_lean_kernel", (name, kernel)
                    # few_lean_kernel<..., kPair, kPacked>
                    packed_rows = name == "split-major" and power_of_two
                    assert flags[-2:] == [num_splits == 2, packed_rows], (name, head_dim, flags)
                general, general_stats = run(tokens)
                packed, general = packed.cpu(), general.cpu()
                assert torch.equal(packed.view(torch.uint8), general.view(torch.uint8)), name
                assert torch.equal(packed_stats.cpu().view(torch.int32),
                                   general_stats.cpu().view(torch.int32)), name
                assert packed[4, 6].float().isnan().all(), name
                assert torch.equal(packed[3, 1].float(), torch.zeros(head_dim)), name
                rows = clean.reshape(-1)
                expected = ref[rows]
                if out_dtype == torch.float8_e4m3fn:
                    expected = expected.to(out_dtype).double()
                tolerance = (dict(rtol=2 ** -3, atol=2 ** -9) if out_dtype == torch.float8_e4m3fn
                             else dict(rtol=2 ** -7, atol=1e-5))
                torch.testing.assert_close(packed.double().reshape(-1, head_dim)[rows],
                                           expected, **tolerance)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [3, 4])
def test_large_packed_calls_of_four_states_keep_the_lean_block(cuda_device, num_splits,
                                                               monkeypatch):
    """Three or four split-major states take the packed depth-4 instance on the pair's
    parameter block up to one smallest CTA (128 threads) an SM, and on the lean block from
    one row more: the same bits either way as the general kernel, and the float64
    reference's values, with an empty row among them."""
    pin(monkeypatch, KernelConfig.few(1))
    head_dim = 64  # 8 threads a row of bf16
    sms = torch.cuda.get_device_properties(cuda_device).multi_processor_count
    limit = sms * 128 // 8
    gen = torch.Generator().manual_seed(num_splits + sms)
    for rows, instance, flags in ((limit, "few_packed_quad_kernel", []),
                                  (limit + 1, "few_lean_kernel", [False, True])):
        o = torch.randn(num_splits, rows, head_dim, generator=gen).bfloat16()
        lse = torch.randn(num_splits, rows, generator=gen) * 4
        lse[:, rows // 2] = -math.inf  # an empty row
        o_gpu, lse_gpu = o.to(cuda_device), lse.to(cuda_device)

        def run(p):
            return kvsplit.merge_lse(o_gpu, lse_gpu, base=math.e, return_lse=True,
                                     pass_through_from=p)
        run(None)
        kernel, kernel_flags, (out, out_lse) = launched_kernel(lambda: run(None))
        assert (kernel, kernel_flags[-2:]) == (instance, flags), (rows, kernel, kernel_flags)
        general, general_lse = run(rows)
        assert torch.equal(out.cpu().view(torch.uint8), general.cpu().view(torch.uint8)), rows
        assert torch.equal(out_lse.cpu().view(torch.int32), general_lse.cpu().view(torch.int32))
        ref, ref_lse = reference.merge_lse_reference(o, lse, base=math.e)
        assert torch.equal(out[rows // 2].cpu().float(), torch.zeros(head_dim)), rows
        torch.testing.assert_close(out.cpu().double(), ref, rtol=2 ** -7, atol=1e-5)
        torch.testing.assert_close(out_lse.cpu().double(), ref_lse.float().double(),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("vectors", [1, 2, 4])
@pytest.mark.parametrize("partial_dtype, out_dtype, scaled", [
    (torch.bfloat16, torch.float32, False), (torch.bfloat16, torch.float16, False),
    (torch.bfloat16, torch.float8_e4m3fn, True), (torch.bfloat16, torch.float8_e4m3fn, False),
    (torch.bfloat16, torch.float8_e4m3fnuz, True), (torch.float16, torch.bfloat16, False),
    (torch.float32, torch.bfloat16, False), (torch.float32, torch.float16, False),
    (torch.float32, torch.float8_e4m3fn, True)])
def test_other_output_dtypes_take_the_lean_kernel_with_the_general_ones_bits(
        device, partial_dtype, out_dtype, scaled, vectors, monkeypatch):
    """An output dtype other than the partials' takes the lean kernel's instance for that
    dtype (FP8 with a per-tensor scale or none; e4m3fnuz takes the general kernel both
    times); with every row's split count given, the same call takes the general kernel. The same bits in every layout, and the float64
    reference (FP8: divided by the scale, if any, and quantized the same way) within one
    step of the output format. Head dims 80 and 96 with 1, 2 and 4 vectors a thread give
    rows of an even number of threads (float32 outputs of 16-bit partials stored in lane
    pairs) and of an odd one (10 / 2 = 5, 10 / 4 -> 3), and 35 rows leave the last warp
    part empty."""
    pin(monkeypatch, KernelConfig.few(vectors))
    for num_splits, head_dim in ((2, 96), (5, 96), (2, 80), (3, 80)):
        gen = torch.Generator().manual_seed(7 * num_splits + head_dim + len(str(out_dtype)))
        tokens, heads = 7, 5
        scale = torch.tensor([0.37]) if scaled else None
        for name, o, lse in layouts(num_splits, tokens, heads, head_dim, gen, partial_dtype):
            ref, ref_lse = reference.merge_lse_reference(
                o.reshape(num_splits, -1, head_dim), lse.reshape(num_splits, -1), base=math.e)
            counts = torch.full((tokens, heads), num_splits, dtype=torch.int32)
            runs = [kvsplit.merge_lse(on(o, device), lse.to(device), base=math.e, out_dtype=out_dtype,
                                      out_scale=None if scale is None else scale.to(device),
                                      split_counts=c, return_lse=True)
                    for c in (None, counts.to(device))]
            (lean, lean_lse), (general, general_lse) = ((a.cpu(), b.cpu()) for a, b in runs)
            assert lean.dtype == out_dtype
            assert torch.equal(lean.view(torch.uint8), general.view(torch.uint8)), name
            assert torch.equal(lean_lse, general_lse), name
            torch.testing.assert_close(lean_lse.double().reshape(-1), ref_lse.float().double(),
                                       rtol=1e-5, atol=1e-6)
            expected = ref / scale.double() if scaled else ref
            fp8 = out_dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
            if fp8:
                expected = expected.to(out_dtype).double()
            ulp = {torch.float32: 2 ** -10, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}
            tolerance = (dict(rtol=2 ** -3, atol=2 ** -9) if fp8
                         else dict(rtol=ulp.get(out_dtype, 2 ** -10), atol=1e-5))
            torch.testing.assert_close(lean.double().reshape(-1, head_dim), expected, **tolerance)


@pytest.mark.parametrize("mode", ["few:3", "few", "few:", "few:1:2", "few:8", "few:-1"])
def test_a_bad_mode_is_refused_naming_the_variable(mode, merge_kit, monkeypatch):
    partial_o, stats = merge_kit.partials("maxsum", 4, 4, 128, torch.bfloat16,
                                          merge_kit.generator("few-mode", mode))
    monkeypatch.setenv("KVSPLIT_MODE", mode)
    with pytest.raises(ValueError, match="KVSPLIT_MODE"):
        merge_kit.merge("maxsum", partial_o, stats)


def test_a_pinned_config_is_still_constrained(device, merge_kit, chosen_kv_split, monkeypatch):
    """Four vectors a thread of a 2-vector row would leave its last two steps empty: halved
    to two (one thread a row)."""
    gen = merge_kit.generator("few-pinned")
    partial_o, stats = merge_kit.partials("maxsum", 3, 8, 16, torch.bfloat16, gen)
    pin(monkeypatch, KernelConfig.few(4))
    out, out_stats = merge_kit.merge("maxsum", partial_o.to(device), stats.to(device))
    merge_kit.assert_matches_reference(out, out_stats,
                                       *merge_kit.reference("maxsum", partial_o, stats))
    assert chosen_kv_split == [KernelConfig.few(2)]


@pytest.mark.parametrize("num_splits", [2, 3, 16])
def test_empty_rows_write_zeros_whatever_their_partials_hold(device, num_splits, monkeypatch):
    """A row whose every LSE is -inf merges to zeros and exports -inf, even where its partials
    hold NaN or inf (the lean kernel's LSE epilogue selects instead of branching); the other
    rows match the float64 reference."""
    pin(monkeypatch, KernelConfig.few(1))
    gen = torch.Generator().manual_seed(num_splits)
    rows, head_dim = 9, 128
    o = torch.randn(num_splits, rows, head_dim, generator=gen).bfloat16()
    lse = torch.randn(num_splits, rows, generator=gen) * 3
    empty = [1, 4, 8]
    lse[:, empty] = -math.inf
    o[0, 1], o[-1, 4, :3] = math.nan, math.inf
    out, out_lse = kvsplit.merge_lse(on(o, device), lse.to(device), base=math.e, return_lse=True)
    out, out_lse = out.cpu(), out_lse.cpu()
    assert torch.equal(out[empty], torch.zeros(len(empty), head_dim, dtype=out.dtype))
    assert torch.equal(out_lse[empty], torch.full((len(empty),), -math.inf))
    kept = [r for r in range(rows) if r not in empty]
    ref, ref_lse = reference.merge_lse_reference(o[:, kept], lse[:, kept], base=math.e)
    torch.testing.assert_close(out[kept].double(), ref, rtol=2 ** -8, atol=1e-5)
    torch.testing.assert_close(out_lse[kept].double(), ref_lse.double(), rtol=1e-5, atol=1e-6)
