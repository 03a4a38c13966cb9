"""Numerics of the DSplit family (a row's head dim split across CTAs).

Each config is pinned with ``KVSPLIT_MODE=dsplit:SLICES:KV_SPLIT`` and run
through the public merge functions, on the CPU twin and on CUDA where it can,
against the float64 reference and against KvSplit K = 1 on fresh random data.
The valid configs are written out here from the family's rules, independently
of dispatch/: a slice is 4..32 vectors of 16 bytes (a power of two), a CTA has
32..512 threads, kv_split <= num_splits, and a round loads 4, 8 or 16 partials.
"""

from __future__ import annotations


import pytest
import torch

from kvsplit import _kernel, _native, merge
from kvsplit.config import FAMILY_CODES, KernelConfig
from merge_grid import DTYPES, FORMATS, HEAD_DIMS, out_kwargs

pytestmark = pytest.mark.usefixtures("dispatch_sandbox")


def spec_configs(head_dim: int, elem_bytes: int, num_splits: int) -> list[KernelConfig]:
    configs = []
    for slices in (1, 2, 4, 8, 16):
        vectors, rest = divmod(head_dim * elem_bytes, 16 * slices)
        if rest or vectors not in (4, 8, 16, 32):
            continue
        for kv_split in (1, 2, 4, 8, 16, 32, 64, 128):
            if 32 <= vectors * kv_split <= 512 and kv_split <= num_splits:
                configs += [KernelConfig.dsplit(slices, kv_split, depth) for depth in (4, 8, 16)]
    return configs


def pin(monkeypatch, config: KernelConfig) -> None:
    monkeypatch.setenv("KVSPLIT_MODE",
                       f"dsplit:{config.slices}:{config.kv_split}:{config.depth}")


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_config_matches_reference_and_k1(device, fmt, dtypes, head_dim, merge_kit,
                                                chosen_kv_split, monkeypatch):
    """Sinks, split counts, empty splits and exported stats; split-major and row-major layouts."""
    partial_dtype = dtypes[0]
    gen = merge_kit.generator("dsplit", fmt, str(dtypes), head_dim)
    num_splits = int(torch.randint(33, 61, (), generator=gen))  # every kv_split <= 32 fits
    rows, heads = 4 * int(torch.randint(1, 5, (), generator=gen)), 4
    partial_o, stats = merge_kit.partials(fmt, num_splits, rows, head_dim, partial_dtype, gen,
                                          empty_fraction=0.3)
    split_counts = torch.randint(0, num_splits + 3, (rows,), generator=gen, dtype=torch.int32)
    sinks = torch.randn(heads, generator=gen) + 2.0
    scale = merge_kit.scale_log2(gen)
    expected_ref = merge_kit.reference(fmt, partial_o, stats, scale=scale, sinks=sinks,
                                       split_counts=split_counts)
    # The same values stored row-major: (rows, num_splits, head_dim) seen as split-major.
    row_major_o = partial_o.transpose(0, 1).contiguous().transpose(0, 1)
    layouts = {"split-major": partial_o, "row-major": row_major_o}

    def run(o):
        inputs = [t.to(device) for t in (o, stats, sinks, split_counts)]
        return merge_kit.merge(fmt, *inputs[:2], scale=scale, sinks=inputs[2],
                               split_counts=inputs[3], kv_split=None,
                               **out_kwargs(rows, head_dim, dtypes[1], dtypes[0], device))

    monkeypatch.setenv("KVSPLIT_MODE", "off")
    base_out, base_stats = run(partial_o)
    configs = spec_configs(head_dim, partial_dtype.itemsize, num_splits)
    assert len(configs) >= 14  # every head dim has several slice widths and group counts
    for i, config in enumerate(configs):
        pin(monkeypatch, config)
        out, out_stats = run(list(layouts.values())[i % 2])
        merge_kit.assert_matches_reference(out, out_stats, *expected_ref)
        merge_kit.assert_same_function(fmt, out, out_stats, base_out, base_stats)
    assert chosen_kv_split == [1] + configs


@pytest.mark.parametrize("dtypes, head_dim, slices", [
    pytest.param((torch.bfloat16, torch.bfloat16), 128, 4, id="bf16-128-4lanes"),
    pytest.param((torch.bfloat16, torch.bfloat16), 128, 2, id="bf16-128-8lanes"),
    pytest.param((torch.float32, torch.float16), 64, 4, id="fp32-64-4lanes"),
])
@pytest.mark.parametrize("fmt", ["maxsum", "lsee"])
def test_many_groups_per_cta(device, fmt, dtypes, head_dim, slices, merge_kit, chosen_kv_split,
                             monkeypatch):
    """kv_split 64 and 128: up to 16 warps per CTA, folded across warps by warp 0."""
    gen = merge_kit.generator("many", fmt, str(dtypes), head_dim, slices)
    num_splits, rows = 150, 4
    partial_o, stats = merge_kit.partials(fmt, num_splits, rows, head_dim, dtypes[0], gen,
                                          empty_fraction=0.3)
    split_counts = torch.randint(0, num_splits + 3, (rows,), generator=gen, dtype=torch.int32)
    scale = merge_kit.scale_log2(gen)
    lanes = head_dim * dtypes[0].itemsize // 16 // slices
    configs = [KernelConfig.dsplit(slices, k, depth) for k in (64, 128) if lanes * k <= 512
               for depth in (4, 8, 16)]
    for config in configs:
        pin(monkeypatch, config)
        out, out_stats = merge_kit.merge(fmt, partial_o.to(device), stats.to(device), scale=scale,
                                         split_counts=split_counts.to(device),
                                         **out_kwargs(rows, head_dim, dtypes[1], dtypes[0], device))
        merge_kit.assert_matches_reference(out, out_stats, *merge_kit.reference(
            fmt, partial_o, stats, scale=scale, split_counts=split_counts))
    assert configs and chosen_kv_split == configs


@pytest.mark.parametrize("with_counts", [True, False], ids=["split-counts", "plain"])
@pytest.mark.parametrize("depth", [4, 8, 16])
@pytest.mark.parametrize("kv_split", [4, 8])
def test_exact_trip_counts_cover_every_remainder(device, kv_split, depth, with_counts, merge_kit,
                                                 chosen_kv_split, monkeypatch):
    """Groups of 1..depth + 2 partials (a first round of every size 1..depth, then full
    rounds), some rows empty; with split counts, and without them (the plain kernel with
    32-bit offsets)."""
    head_dim, config = 128, KernelConfig.dsplit(2, kv_split, depth)
    counts = range(kv_split, kv_split * (depth + 1) + 2)
    for num_splits in counts:
        gen = merge_kit.generator("trip", kv_split, num_splits)
        partial_o, stats = merge_kit.partials("maxsum", num_splits, 12, head_dim, torch.bfloat16,
                                              gen)
        split_counts = torch.randint(0, num_splits + 1, (12,), generator=gen, dtype=torch.int32)
        split_counts[0] = 0
        if not with_counts:
            split_counts = None
        scale = merge_kit.scale_log2(gen)
        pin(monkeypatch, config)
        out, out_stats = merge_kit.merge(
            "maxsum", partial_o.to(device), stats.to(device), scale=scale,
            split_counts=None if split_counts is None else split_counts.to(device))
        merge_kit.assert_matches_reference(out, out_stats, *merge_kit.reference(
            "maxsum", partial_o, stats, scale=scale, split_counts=split_counts))
        if with_counts:
            assert torch.equal(out[0].cpu(), torch.zeros(head_dim, dtype=out.dtype))
    assert chosen_kv_split == [config] * len(counts)


@pytest.mark.parametrize("depth", [4, 8, 16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_plain_kernel_scales_raw_stats(device, fmt, depth, merge_kit, chosen_kv_split,
                                           monkeypatch):
    """Flat rows, no split counts and no empty-split sentinel: the plain kernel, which takes the
    stats as loaded and applies the scale inside the merge (one FFMA a weight). Random scales
    and the base-e LSE (scale log2 e), empty splits (-inf stats) and whole empty rows, and a NaN
    stat that must poison its own row and no other; one-warp and multi-warp items."""
    head_dim, rows, poisoned_row = 128, 9, 4
    configs = [KernelConfig.dsplit(2, 4, depth), KernelConfig.dsplit(1, 8, depth)]
    for config in configs:
        gen = merge_kit.generator("plain", fmt, depth, config.kv_split)
        num_splits = int(torch.randint(config.kv_split, 3 * depth * config.kv_split, (),
                                       generator=gen))
        pin(monkeypatch, config)
        merge_kit.assert_empty_rows_and_nan_row(fmt, gen, num_splits, rows, head_dim, device,
                                                poisoned_row)
    assert chosen_kv_split == [c for c in configs for _ in range(2)]


@pytest.mark.gpu
@pytest.mark.parametrize("config", [KernelConfig.dsplit(2, 4, 16), KernelConfig.dsplit(1, 2, 8)],
                         ids=["8lanes-16deep", "16lanes-8deep"])
def test_offsets_past_2_to_the_30_take_64_bit_addressing(cuda_device, config, merge_kit,
                                                         chosen_kv_split, monkeypatch):
    """Partials 2^29 elements apart (4 GiB of bf16 in all): the last split's offset, 2^31,
    would wrap in the plain kernel's 32 bits, so the call takes the 64-bit kernel."""
    num_splits, rows, head_dim = 5, 8, 128
    gen = merge_kit.generator("offsets", str(config))
    partial_o, stats = merge_kit.partials("lse2", num_splits, rows, head_dim, torch.bfloat16,
                                          gen)
    split_stride = 1 << 29
    storage = torch.empty((num_splits - 1) * split_stride + rows * head_dim,
                          dtype=torch.bfloat16, device=cuda_device)
    spread = storage.as_strided((num_splits, rows, head_dim), (split_stride, head_dim, 1))
    spread.copy_(partial_o)
    pin(monkeypatch, config)
    out, lse = merge_kit.merge("lse2", spread, stats.to(cuda_device))
    merge_kit.assert_matches_reference(out, lse, *merge_kit.reference("lse2", partial_o, stats))
    assert chosen_kv_split == [config]


def test_a_pinned_config_is_still_constrained(device, merge_kit, chosen_kv_split, monkeypatch):
    """Too many groups for the partials are halved; an impossible slice falls back to KvSplit."""
    gen = merge_kit.generator("pinned")
    partial_o, stats = merge_kit.partials("maxsum", 12, 8, 512, torch.bfloat16, gen)
    for mode in ("dsplit:4:32", "dsplit:1:16"):
        monkeypatch.setenv("KVSPLIT_MODE", mode)
        out, out_stats = merge_kit.merge("maxsum", partial_o.to(device), stats.to(device))
        merge_kit.assert_matches_reference(out, out_stats,
                                           *merge_kit.reference("maxsum", partial_o, stats))
    # 4 slices of 512 bf16 are 16 lanes: 32 groups > 12 partials -> 8. One slice
    # would be 64 lanes, more than a warp: KvSplit K = 16, which a 1 KiB row cuts to 8.
    assert chosen_kv_split == [KernelConfig.dsplit(4, 8), 8]


@pytest.mark.parametrize("mode", ["dsplit:3:4", "dsplit:4", "dsplit:4:256", "dsplit:4:16:6",
                                  "dsplit:4:16:8:1", "split:4:4"])
def test_a_bad_mode_is_refused_naming_the_variable(mode, merge_kit, monkeypatch):
    partial_o, stats = merge_kit.partials("maxsum", 8, 4, 128, torch.bfloat16,
                                          merge_kit.generator("mode", mode))
    monkeypatch.setenv("KVSPLIT_MODE", mode)
    with pytest.raises(ValueError, match="KVSPLIT_MODE"):
        merge_kit.merge("maxsum", partial_o, stats)


@pytest.mark.parametrize("family, slices, kv_split, depth, head_dim", [
    ("dsplit", 3, 8, 4, 128), ("dsplit", 16, 8, 4, 128), ("dsplit", 1, 64, 4, 128),
    ("dsplit", 2, 1, 4, 128), ("dsplit", 2, 8, 6, 128), ("dsplit", 8, 16, 4, 64),
    ("kvsplit", 1, 16, 4, 512), ("kvsplit", 1, 3, 4, 128), ("kvsplit", 2, 4, 4, 128)])
def test_the_kernels_refuse_an_impossible_geometry(device, family, slices, kv_split, depth,
                                                   head_dim, merge_kit):
    """The launchers' own check, CUDA and CPU twin alike (the dispatcher never sends these,
    and a KernelConfig cannot hold them): nothing is written."""
    partial_o, stats = merge_kit.partials("maxsum", 8, 4, head_dim, torch.bfloat16,
                                          merge_kit.generator("geometry", slices, kv_split, depth))
    partial_o, stats = partial_o.to(device), stats.to(device)
    out = torch.full((4, head_dim), 7.0, dtype=torch.bfloat16, device=device)
    kernel_launch = _kernel.Launch(KernelConfig.kvsplit(1), merge.MAXSUM, partial_o, stats, out, None, 1.0)
    ext = _native.ext()
    bad = ext.KernelConfig(FAMILY_CODES[family], slices, kv_split, depth)
    object.__setattr__(kernel_launch, "native", ext.Launch(kernel_launch.native.params, bad, kernel_launch.native.target))
    with pytest.raises(ValueError, match="unsupported (slices|kv_split|depth)"):
        _kernel.run(kernel_launch, partial_o, stats, out, 1.0)
    assert torch.equal(out.cpu(), torch.full((4, head_dim), 7.0, dtype=torch.bfloat16))


@pytest.mark.parametrize("fmt", ["maxsum", "lse2"])
def test_one_warp_items_share_ctas(device, fmt, merge_kit, chosen_kv_split, monkeypatch):
    """Items of one warp (lanes x K = 32) share CTAs four at a time, eight in calls of 1024
    items or more: row counts that leave the last CTA partly idle, sinks, split counts, empty
    splits and exported stats."""
    head_dim = 128  # 16 vectors of bf16: slices 1, 2, 4 give 16, 8, 4 lanes
    configs = [KernelConfig.dsplit(slices, 32 // (16 // slices), depth)
               for slices in (1, 2, 4) for depth in (4, 8, 16)]
    for rows in (1, 3, 6, 7, 1029):  # 1029 rows: 1029-4116 items, eight to a CTA
        gen = merge_kit.generator("one-warp", fmt, rows)
        num_splits = int(torch.randint(9, 40, (), generator=gen))
        partial_o, stats = merge_kit.partials(fmt, num_splits, rows, head_dim, torch.bfloat16,
                                              gen, empty_fraction=0.3)
        split_counts = torch.randint(0, num_splits + 2, (rows,), generator=gen, dtype=torch.int32)
        sinks = torch.randn(1, generator=gen)
        scale = merge_kit.scale_log2(gen)
        expected = merge_kit.reference(fmt, partial_o, stats, scale=scale, sinks=sinks,
                                       split_counts=split_counts)
        for config in configs:
            pin(monkeypatch, config)
            out, out_stats = merge_kit.merge(fmt, partial_o.to(device), stats.to(device),
                                             scale=scale, sinks=sinks.to(device),
                                             split_counts=split_counts.to(device))
            merge_kit.assert_matches_reference(out, out_stats, *expected)
    assert chosen_kv_split == configs * 5


@pytest.mark.parametrize("heads", [1, 3])
def test_one_warp_items_merge_in_place(device, heads, monkeypatch):
    """FlashInfer's in-place merge (stats exported over split 0's, a row mask) with one-warp
    items: each warp finishes reading its row's stats before it overwrites them."""
    from kvsplit.compat import flashinfer

    gen = torch.Generator().manual_seed(heads)
    seq, head_dim = 7, 128
    v, v_other = (torch.randn(seq, heads, head_dim, generator=gen).bfloat16() for _ in range(2))
    s, s_other = (4 * torch.randn(seq, heads, generator=gen) for _ in range(2))
    mask = torch.rand(seq, generator=gen) < 0.7
    # float64 reference of two base-2 LSE states
    top = torch.maximum(s, s_other).double()
    w, w_other = torch.exp2(s.double() - top), torch.exp2(s_other.double() - top)
    expected_v = ((w.unsqueeze(-1) * v.double() + w_other.unsqueeze(-1) * v_other.double())
                  / (w + w_other).unsqueeze(-1))
    expected_s = (top + torch.log2(w + w_other)).float()
    config = KernelConfig.dsplit(1, 2, 4)  # 16 lanes x 2 groups: one warp
    pin(monkeypatch, config)
    launched = []
    launch_init = _kernel.Launch.__init__
    monkeypatch.setattr(_kernel.Launch, "__init__",
                        lambda made, config, *args, **kwargs: (launched.append(config),
                                                               launch_init(made, config, *args,
                                                                         **kwargs))[-1])
    v_dev, s_dev = v.to(device), s.to(device)
    flashinfer.merge_state_in_place(v_dev, s_dev, v_other.to(device), s_other.to(device),
                                    mask=mask.to(device))
    keep = mask.view(seq, 1)
    want_v = torch.where(keep.unsqueeze(-1), expected_v, v.double())
    want_s = torch.where(keep, expected_s, s)
    torch.testing.assert_close(v_dev.cpu().double(), want_v, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(s_dev.cpu(), want_s, atol=1e-4, rtol=1e-4)
    assert launched == [config]
