"""Numerics of kvsplit.merge_maxsum / merge_lse against the float64 reference.

Every test runs on the CPU (the C++ twin of the
kernel, the same group merge) and on CUDA where it can (``device`` fixture,
tests/conftest.py). Data is fresh random data from a generator seeded per
test; the helpers and tolerances live in ``merge_kit``.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvsplit
from merge_grid import DTYPES, FORMATS, HEAD_DIMS, out_kwargs

KV_SPLITS = [1, 2, 4, 8, 16]

pytestmark = pytest.mark.usefixtures("dispatch_sandbox")


def sm_count(device: str) -> int | None:
    if device != "cuda":
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def to(device, *tensors):
    return tuple(None if t is None else t.to(device) for t in tensors)


def empty_stats(fmt, stats, mask):
    """Marks the (split, row) entries under ``mask`` empty."""
    stats = stats.clone()
    if fmt == "maxsum":
        stats[..., 0][mask] = -math.inf
        stats[..., 1][mask] = 0.0
    else:
        stats[mask] = -math.inf
    return stats


def assert_empty_rows(fmt, out, out_stats, rows):
    assert torch.equal(out[rows].cpu(), torch.zeros_like(out[rows].cpu()))
    exported = out_stats[rows].cpu()
    if fmt == "maxsum":
        assert torch.equal(exported[:, 0], torch.full_like(exported[:, 0], -math.inf))
        assert torch.equal(exported[:, 1], torch.zeros_like(exported[:, 1]))
    else:
        assert torch.equal(exported, torch.full_like(exported, -math.inf))


# --- the grid --------------------------------------------------------------------------


@pytest.mark.parametrize("kv_split", KV_SPLITS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_matches_reference(device, fmt, dtypes, head_dim, kv_split, merge_kit, chosen_kv_split):
    partial_dtype, out_dtype = dtypes
    gen = merge_kit.generator("grid", fmt, str(dtypes), head_dim, kv_split)
    rows = int(torch.randint(8, 49, (), generator=gen))
    # More splits than K (so num_splits does not cut K), in random counts that
    # often leave the last unrolled batch of 4 partly empty.
    num_splits = int(torch.randint(max(5, kv_split + 1), 41, (), generator=gen))
    partial_o, stats = merge_kit.partials(fmt, num_splits, rows, head_dim, partial_dtype, gen)
    scale = merge_kit.scale_log2(gen)

    out, out_stats = merge_kit.merge(fmt, *to(device, partial_o, stats), scale=scale,
                                     kv_split=kv_split,
                                     **out_kwargs(rows, head_dim, out_dtype, partial_dtype, device))

    assert out.dtype == out_dtype and out.shape == (rows, head_dim)
    assert out.device.type == device and out_stats.device.type == device
    assert out_stats.dtype == torch.float32
    assert out_stats.shape == ((rows, 2) if fmt == "maxsum" else (rows,))
    merge_kit.assert_matches_reference(out, out_stats,
                                       *merge_kit.reference(fmt, partial_o, stats, scale=scale))
    assert chosen_kv_split == [merge_kit.expected_kv_split(
        kv_split, head_dim=head_dim, elem_bytes=partial_dtype.itemsize, rows=rows,
        num_splits=num_splits, sm_count=sm_count(device))]


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_kv_split_agrees_with_one(device, fmt, dtypes, head_dim, merge_kit,
                                        chosen_kv_split):
    """Changing K regroups the same float32 sums: results agree to rounding."""
    partial_dtype, out_dtype = dtypes
    gen = merge_kit.generator("agree", fmt, str(dtypes), head_dim)
    num_splits, rows, heads = 37, 40, 4
    partial_o, stats = merge_kit.partials(fmt, num_splits, rows, head_dim, partial_dtype, gen,
                                          empty_fraction=0.3)
    split_counts = torch.randint(0, num_splits + 3, (rows,), generator=gen, dtype=torch.int32)
    sinks = torch.randn(heads, generator=gen) + 2.0
    scale = merge_kit.scale_log2(gen)
    inputs = to(device, partial_o, stats, sinks, split_counts)

    def run(kv_split):
        return merge_kit.merge(fmt, *inputs[:2], scale=scale, sinks=inputs[2],
                               split_counts=inputs[3], kv_split=kv_split,
                               **out_kwargs(rows, head_dim, out_dtype, partial_dtype, device))

    base_out, base_stats = run(1)
    merge_kit.assert_matches_reference(base_out, base_stats, *merge_kit.reference(
        fmt, partial_o, stats, scale=scale, sinks=sinks, split_counts=split_counts))
    for kv_split in KV_SPLITS[1:]:
        merge_kit.assert_same_function(fmt, *run(kv_split), base_out, base_stats)
    expected = [merge_kit.expected_kv_split(k, head_dim=head_dim,
                                            elem_bytes=partial_dtype.itemsize, rows=rows,
                                            num_splits=num_splits, sm_count=sm_count(device))
                for k in KV_SPLITS]
    assert chosen_kv_split == expected
    assert expected[-1] >= 4  # the comparison really covered grouped merges


# --- sinks, exported stats, split counts, empty rows, NaN ------------------------------


@pytest.mark.parametrize("kv_split", [None, 1, 4])
@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("fmt", FORMATS)
def test_sinks(device, fmt, heads, kv_split, merge_kit):
    gen = merge_kit.generator("sinks", fmt, heads, kv_split)
    num_splits, rows, head_dim = 9, 6 * heads, 128
    partial_o, stats = merge_kit.partials(fmt, num_splits, rows, head_dim, torch.bfloat16, gen,
                                          empty_fraction=0.1)
    scale = merge_kit.scale_log2(gen)
    # Sink logits near the rows' own log-totals (natural log), distinct per
    # head, so that a sink ignored or taken from the wrong head shows.
    plain_out, plain_stats = merge_kit.reference(fmt, partial_o, stats, scale=scale)
    log_totals = merge_kit.log_totals(fmt, plain_stats)
    log_totals = log_totals[log_totals.isfinite()]
    sinks = (log_totals.median() + 2.0 * torch.rand(heads, generator=gen) - 1.0).float()

    out, out_stats = merge_kit.merge(fmt, *to(device, partial_o, stats), scale=scale,
                                     sinks=sinks.to(device), kv_split=kv_split)

    ref_out, ref_stats = merge_kit.reference(fmt, partial_o, stats, scale=scale, sinks=sinks)
    merge_kit.assert_matches_reference(out, out_stats, ref_out, ref_stats)
    assert (ref_out - plain_out).norm() > 0.1 * plain_out.norm()
    if heads > 1:
        rolled, _ = merge_kit.reference(fmt, partial_o, stats, scale=scale,
                                        sinks=sinks.roll(1))
        assert (ref_out - rolled).norm() > 0.01 * rolled.norm()


@pytest.mark.parametrize("kv_split", [1, 4])
@pytest.mark.parametrize("fmt", FORMATS)
def test_sink_far_above_every_split(device, fmt, kv_split, merge_kit):
    """A sink e^100 times a row's total: the LSE is about the sink's, not inf.

    In base 2 the sink's weight relative to the row maximum is 2^144, past
    float32; the merged LSE (sink included) is an ordinary number. (A maxsum
    total L, relative to the split maximum, is past float32 and inf there.)
    """
    gen = merge_kit.generator("far-sink", fmt, kv_split)
    num_splits, rows, head_dim = 6, 4, 64
    partial_o, stats = merge_kit.partials(fmt, num_splits, rows, head_dim, torch.bfloat16, gen,
                                          empty_fraction=0.0)
    scale = merge_kit.scale_log2(gen)
    _, plain_stats = merge_kit.reference(fmt, partial_o, stats, scale=scale)
    log_totals = merge_kit.log_totals(fmt, plain_stats)
    sinks = (log_totals.max() + 100.0).float().reshape(1)

    out, out_stats = merge_kit.merge(fmt, *to(device, partial_o, stats, sinks)[:2], scale=scale,
                                     sinks=sinks.to(device), kv_split=kv_split)

    ref_out, ref_stats = merge_kit.reference(fmt, partial_o, stats, scale=scale, sinks=sinks)
    if fmt != "maxsum":
        assert ref_stats.isfinite().all()
    merge_kit.assert_matches_reference(out, out_stats, ref_out, ref_stats)


@pytest.mark.parametrize("kv_split", [1, 2, 4, 16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_split_counts(device, fmt, kv_split, merge_kit):
    """Splits at or past a row's count are never read: NaN there changes nothing."""
    gen = merge_kit.generator("counts", fmt, kv_split)
    num_splits, rows, head_dim = 11, 24, 64
    partial_o, stats = merge_kit.partials(fmt, num_splits, rows, head_dim, torch.bfloat16, gen,
                                          empty_fraction=0.1)
    split_counts = torch.randint(1, num_splits, (rows,), generator=gen, dtype=torch.int32)
    split_counts[:7] = torch.tensor([0, -1, 1, num_splits, num_splits + 1, 1000, 2],
                                    dtype=torch.int32)
    unread = torch.arange(num_splits).unsqueeze(1) >= split_counts.clamp_min(0).unsqueeze(0)
    poisoned_o = partial_o.masked_fill(unread.unsqueeze(-1), math.nan)
    poisoned_stats = stats.masked_fill(unread.unsqueeze(-1) if fmt == "maxsum" else unread,
                                       math.nan)
    scale = merge_kit.scale_log2(gen)

    out, out_stats = merge_kit.merge(fmt, *to(device, poisoned_o, poisoned_stats), scale=scale,
                                     split_counts=split_counts.to(device), kv_split=kv_split)

    merge_kit.assert_matches_reference(out, out_stats, *merge_kit.reference(
        fmt, partial_o, stats, scale=scale, split_counts=split_counts))
    assert_empty_rows(fmt, out, out_stats, [0, 1])
    # Counts of num_splits and more read everything.
    full_out, full_stats = merge_kit.merge(fmt, *to(device, partial_o, stats), scale=scale,
                                           kv_split=kv_split)
    assert torch.equal(out[3:6], full_out[3:6]) and torch.equal(out_stats[3:6], full_stats[3:6])


@pytest.mark.parametrize("kv_split", [1, 4, 16])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no_sinks", "sinks"])
@pytest.mark.parametrize("which", ["some", "all"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_rows(device, fmt, which, with_sinks, kv_split, merge_kit):
    """A row whose splits are all empty is exactly 0, stats (-inf, 0) / LSE -inf."""
    gen = merge_kit.generator("empty", fmt, which, with_sinks, kv_split)
    num_splits, rows, head_dim = 21, 10, 128
    partial_o, stats = merge_kit.partials(fmt, num_splits, rows, head_dim, torch.float16, gen,
                                          empty_fraction=0.2)
    empty = [0, 3, 9] if which == "some" else list(range(rows))
    row_mask = torch.zeros(rows, dtype=torch.bool)
    row_mask[empty] = True
    stats = empty_stats(fmt, stats, row_mask.expand(num_splits, rows))
    # Whatever an empty split's output holds (finite) must not leak out.
    partial_o[:, empty] = (1000.0 * torch.randn(num_splits, len(empty), head_dim,
                                                generator=gen)).half()
    sinks = torch.tensor([0.5, -1.0]) if with_sinks else None
    scale = merge_kit.scale_log2(gen)

    out, out_stats = merge_kit.merge(fmt, *to(device, partial_o, stats, sinks)[:2], scale=scale,
                                     sinks=None if sinks is None else sinks.to(device),
                                     kv_split=kv_split)

    assert not out.isnan().any() and not out_stats.isnan().any()
    assert_empty_rows(fmt, out, out_stats, empty)
    merge_kit.assert_matches_reference(out, out_stats, *merge_kit.reference(
        fmt, partial_o, stats, scale=scale, sinks=sinks))


@pytest.mark.parametrize("kv_split", [1, 4, 16])
@pytest.mark.parametrize("fmt, where", [("maxsum", "partial_o"), ("maxsum", "max"),
                                        ("maxsum", "sum"), ("lse2", "partial_o"),
                                        ("lse2", "lse"), ("lsee", "lse")])
@pytest.mark.parametrize("split", ["first", "last"])
def test_nan_stays_in_its_row(device, fmt, where, split, kv_split, merge_kit):
    gen = merge_kit.generator("nan", fmt, where, split, kv_split)
    num_splits, rows, head_dim, row, col = 37, 12, 64, 5, 3
    j = 0 if split == "first" else num_splits - 1  # the last is re-read by padded slots
    partial_o, stats = merge_kit.partials(fmt, num_splits, rows, head_dim, torch.bfloat16, gen,
                                          empty_fraction=0.0)
    poisoned_o, poisoned_stats = partial_o.clone(), stats.clone()
    if where == "partial_o":
        poisoned_o[j, row, col] = math.nan
    elif fmt == "maxsum":
        poisoned_stats[j, row, 0 if where == "max" else 1] = math.nan
    else:
        poisoned_stats[j, row] = math.nan
    scale = merge_kit.scale_log2(gen)

    clean_out, clean_stats = (t.cpu() for t in merge_kit.merge(
        fmt, *to(device, partial_o, stats), scale=scale, kv_split=kv_split))
    out, out_stats = (t.cpu() for t in merge_kit.merge(
        fmt, *to(device, poisoned_o, poisoned_stats), scale=scale, kv_split=kv_split))

    others = torch.arange(rows) != row
    assert torch.equal(out[others], clean_out[others])
    assert torch.equal(out_stats[others], clean_stats[others])
    if where == "partial_o":
        assert out[row, col].isnan()
        assert torch.equal(out_stats[row], clean_stats[row])
    else:
        assert out[row].isnan().all()
        assert out_stats[row].isnan().any()


# --- layouts and strides ---------------------------------------------------------------


@pytest.mark.parametrize("kv_split", [1, 4])
@pytest.mark.parametrize("fmt", FORMATS)
def test_row_major_views(device, fmt, kv_split, merge_kit):
    """[rows, N, D] buffers seen as (N, rows, D) give what split-major buffers give."""
    gen = merge_kit.generator("row-major", fmt, kv_split)
    num_splits, rows, head_dim = 13, 20, 256
    partial_o, stats = merge_kit.partials(fmt, num_splits, rows, head_dim, torch.bfloat16, gen)
    partial_o_d, stats_d = to(device, partial_o, stats)
    row_major_o = partial_o_d.transpose(0, 1).contiguous().transpose(0, 1)
    row_major_stats = stats_d.transpose(0, 1).contiguous().transpose(0, 1)
    assert row_major_o.stride()[:2] == (head_dim, num_splits * head_dim)
    scale = merge_kit.scale_log2(gen)

    split_major = merge_kit.merge(fmt, partial_o_d, stats_d, scale=scale, kv_split=kv_split)
    row_major = merge_kit.merge(fmt, row_major_o, row_major_stats, scale=scale,
                                kv_split=kv_split)

    assert torch.equal(row_major[0], split_major[0]) and torch.equal(row_major[1], split_major[1])
    merge_kit.assert_matches_reference(*row_major,
                                       *merge_kit.reference(fmt, partial_o, stats, scale=scale))


def widened(tensor, dim, pad_front, pad_back):
    """``tensor`` copied into the middle of a NaN buffer wider along ``dim``: a strided view."""
    shape = list(tensor.shape)
    shape[dim] += pad_front + pad_back
    buffer = torch.full(shape, math.nan, dtype=tensor.dtype, device=tensor.device)
    view = buffer.narrow(dim, pad_front, tensor.shape[dim])
    view.copy_(tensor)
    return view, buffer


@pytest.mark.parametrize("kv_split", [1, 4])
@pytest.mark.parametrize("kind", ["padded_rows", "every_other_row", "every_other_split"])
@pytest.mark.parametrize("dtypes", [DTYPES[0], DTYPES[3]])
@pytest.mark.parametrize("fmt", FORMATS)
def test_strided_inputs_and_out(device, fmt, dtypes, kind, kv_split, merge_kit):
    """Non-contiguous partials, stats and out: only the viewed elements count or change."""
    partial_dtype, out_dtype = dtypes
    gen = merge_kit.generator("strided", fmt, str(dtypes), kind, kv_split)
    num_splits, rows, head_dim = 9, 14, 128
    partial_o, stats = merge_kit.partials(fmt, num_splits, rows, head_dim, partial_dtype, gen)
    scale = merge_kit.scale_log2(gen)
    partial_o_d, stats_d = to(device, partial_o, stats)
    pad = 32 // partial_dtype.itemsize  # keeps every stride a multiple of 16 bytes
    if kind == "padded_rows":
        strided_o, _ = widened(partial_o_d, 2, 0, pad)
        strided_stats, _ = widened(stats_d, stats.dim() - 1, 2, 2)
    elif kind == "every_other_row":
        strided_o = torch.stack([partial_o_d, torch.full_like(partial_o_d, math.nan)], 2)
        strided_o = strided_o.flatten(1, 2)[:, ::2]
        strided_stats = torch.stack([stats_d, torch.full_like(stats_d, math.nan)], 2)
        strided_stats = strided_stats.flatten(1, 2)[:, ::2]
    else:
        strided_o = torch.stack([torch.full_like(partial_o_d, math.nan), partial_o_d], 1)
        strided_o = strided_o.flatten(0, 1)[1::2]
        strided_stats = torch.stack([torch.full_like(stats_d, math.nan), stats_d], 1)
        strided_stats = strided_stats.flatten(0, 1)[1::2]
    assert not strided_o.is_contiguous() and not strided_stats.is_contiguous()
    out, out_buffer = widened(torch.full((rows, head_dim), math.nan, dtype=out_dtype,
                                         device=device), 1, 64, 32)

    result, result_stats = merge_kit.merge(fmt, strided_o, strided_stats, scale=scale, out=out,
                                           kv_split=kv_split)

    assert result.data_ptr() == out.data_ptr()
    assert out_buffer[:, :64].isnan().all() and out_buffer[:, 64 + head_dim:].isnan().all()
    contiguous = merge_kit.merge(fmt, partial_o_d, stats_d, scale=scale, kv_split=kv_split,
                                 out=torch.empty(rows, head_dim, dtype=out_dtype, device=device))
    assert torch.equal(out, contiguous[0]) and torch.equal(result_stats, contiguous[1])
    merge_kit.assert_matches_reference(out, result_stats,
                                       *merge_kit.reference(fmt, partial_o, stats, scale=scale))


@pytest.mark.parametrize("layout", ["odd_row_stride", "odd_split_stride", "odd_offset"])
def test_maxsum_stats_with_any_strides(device, layout, merge_kit):
    """Maxsum stats are (N, rows, 2) float32 with *any* strides.

    So a (max, sum) pair need not start on 8 bytes (a kernel loading it as
    one float2 would fault on such a view).
    """
    gen = merge_kit.generator("stats-strides", layout)
    num_splits, rows, head_dim = 7, 12, 64
    partial_o, stats = merge_kit.partials("maxsum", num_splits, rows, head_dim, torch.bfloat16,
                                          gen)
    scale = merge_kit.scale_log2(gen)
    if layout == "odd_row_stride":
        view, _ = widened(stats, 2, 0, 1)  # (N, rows, 3)[..., :2]
    elif layout == "odd_split_stride":
        flat = torch.full((num_splits * (rows * 2 + 1),), math.nan)
        view = flat.as_strided(stats.shape, (rows * 2 + 1, 2, 1))
        view.copy_(stats)
    else:
        view, _ = widened(stats, 2, 1, 0)  # (N, rows, 3)[..., 1:]
    assert view.data_ptr() % 8 or any(stride % 2 for stride in view.stride()[:2])

    out, out_stats = merge_kit.merge("maxsum", partial_o.to(device), same_view_on(device, view),
                                     scale=scale)

    merge_kit.assert_matches_reference(out, out_stats, *merge_kit.reference(
        "maxsum", partial_o, stats, scale=scale))


def same_view_on(device, view):
    """``view``'s whole storage copied to ``device``, viewed with the same strides and offset."""
    storage = torch.tensor([], dtype=view.dtype).set_(view.untyped_storage())
    return storage.to(device).as_strided(view.shape, view.stride(), view.storage_offset())


@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_caller_out_is_written(device, fmt, dtypes, merge_kit):
    partial_dtype, out_dtype = dtypes
    gen = merge_kit.generator("out", fmt, str(dtypes))
    num_splits, rows, head_dim = 7, 33, 512
    partial_o, stats = merge_kit.partials(fmt, num_splits, rows, head_dim, partial_dtype, gen)
    scale = merge_kit.scale_log2(gen)
    out = torch.full((rows, head_dim), math.nan, dtype=out_dtype, device=device)

    result, result_stats = merge_kit.merge(fmt, *to(device, partial_o, stats), scale=scale,
                                           out=out)

    assert result.data_ptr() == out.data_ptr()
    assert not out.isnan().any()  # every element was written
    merge_kit.assert_matches_reference(out, result_stats,
                                       *merge_kit.reference(fmt, partial_o, stats, scale=scale))


# --- sizes -----------------------------------------------------------------------------


@pytest.mark.parametrize("kv_split", [None, 1, 16])
@pytest.mark.parametrize("head_dim", [64, 512])
@pytest.mark.parametrize("fmt", FORMATS)
def test_one_split(device, fmt, head_dim, kv_split, merge_kit, chosen_kv_split):
    gen = merge_kit.generator("n1", fmt, head_dim, kv_split)
    partial_o, stats = merge_kit.partials(fmt, 1, 17, head_dim, torch.bfloat16, gen,
                                          empty_fraction=0.2)
    scale = merge_kit.scale_log2(gen)
    out, out_stats = merge_kit.merge(fmt, *to(device, partial_o, stats), scale=scale,
                                     kv_split=kv_split)
    merge_kit.assert_matches_reference(out, out_stats,
                                       *merge_kit.reference(fmt, partial_o, stats, scale=scale))
    assert chosen_kv_split == [1]


@pytest.mark.parametrize("kv_split", [None, 16])
@pytest.mark.parametrize("head_dim, dtypes", [
    pytest.param(512, (torch.bfloat16, torch.bfloat16), id="512-bf16-bf16"),
    pytest.param(128, (torch.float32, torch.float16), id="128-fp32-fp16")])
@pytest.mark.parametrize("fmt", ["maxsum", "lse2"])
def test_1024_splits(device, fmt, head_dim, dtypes, kv_split, merge_kit):
    partial_dtype, out_dtype = dtypes
    gen = merge_kit.generator("n1024", fmt, head_dim, kv_split)
    num_splits, rows = 1024, 16
    partial_o, stats = merge_kit.partials(fmt, num_splits, rows, head_dim, partial_dtype, gen,
                                          empty_fraction=0.3)
    scale = merge_kit.scale_log2(gen)
    out, out_stats = merge_kit.merge(fmt, *to(device, partial_o, stats), scale=scale,
                                     kv_split=kv_split,
                                     **out_kwargs(rows, head_dim, out_dtype, partial_dtype, device))
    merge_kit.assert_matches_reference(out, out_stats,
                                       *merge_kit.reference(fmt, partial_o, stats, scale=scale),
                                       stats_rtol=1e-4)


@pytest.mark.parametrize("kv_split", [1, 16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_one_row(device, fmt, kv_split, merge_kit):
    gen = merge_kit.generator("rows1", fmt, kv_split)
    partial_o, stats = merge_kit.partials(fmt, 23, 1, 512, torch.bfloat16, gen)
    scale = merge_kit.scale_log2(gen)
    out, out_stats = merge_kit.merge(fmt, *to(device, partial_o, stats), scale=scale,
                                     kv_split=kv_split)
    assert out.shape == (1, 512)
    merge_kit.assert_matches_reference(out, out_stats,
                                       *merge_kit.reference(fmt, partial_o, stats, scale=scale))


@pytest.mark.parametrize("kv_split", [None, 1])
def test_more_rows_than_one_grid(device, kv_split, merge_kit):
    """On CUDA 40000 rows of D = 64 need more slices than 2 CTAs per SM: CTAs loop."""
    gen = merge_kit.generator("many-rows", kv_split)
    partial_o, stats = merge_kit.partials("maxsum", 2, 40000, 64, torch.bfloat16, gen)
    out, out_stats = merge_kit.merge("maxsum", *to(device, partial_o, stats), scale=0.8,
                                     kv_split=kv_split)
    merge_kit.assert_matches_reference(out, out_stats,
                                       *merge_kit.reference("maxsum", partial_o, stats, scale=0.8))


# --- torch.compile, CUDA graphs, streams -----------------------------------------------


def test_fake_tensors_take_the_ops_fake_path():
    """Under FakeTensorMode (as torch.compile's tracing and shape propagation run) the plain
    calls return fake outputs of the right shapes and launch nothing (there is no memory
    behind a fake tensor: a launch on it crashed the process); the general call refuses."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    with FakeTensorMode():
        partial_o, lse = torch.randn(3, 4, 2, 64), torch.randn(3, 4, 2)
        out, out_lse = kvsplit.merge_lse(partial_o, lse, return_lse=True)
        stats = torch.randn(3, 4, 2, 2)
        m_out, m_stats = kvsplit.merge_maxsum(partial_o, stats, 0.5, return_stats=True)
        with pytest.raises(TypeError, match="FakeTensor"):
            kvsplit.merge_lse(partial_o, lse, pass_through_from=1)
    assert all(isinstance(t, FakeTensor) for t in (out, out_lse, m_out, m_stats))
    assert out.shape == (4, 2, 64) and out_lse.shape == (4, 2)
    assert m_out.shape == (4, 2, 64) and m_stats.shape == (4, 2, 2)


def test_torch_compile_fullgraph_takes_the_scale_as_a_value(merge_kit):
    """A maxsum scale passed in is traced as a value (a second scale recompiles or not, but
    never breaks the graph); the op checks it when it runs."""
    gen = merge_kit.generator("compile-scale")
    partial_o, stats = merge_kit.partials("maxsum", 4, 8, 64, torch.bfloat16, gen)
    compiled = torch.compile(
        lambda o, s, scale: kvsplit.merge_maxsum(o, s, scale, return_stats=True),
        fullgraph=True, backend="eager")
    for scale in (0.5, 0.7, 1.3):
        merge_kit.assert_matches_reference(*compiled(partial_o, stats, scale),
                                           *merge_kit.reference("maxsum", partial_o, stats,
                                                                scale=scale))
    with pytest.raises(ValueError, match="scale_log2"):
        compiled(partial_o, stats, math.nan)


# Raised inside torch's own compile stack, not by kvsplit.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_torch_compile_fullgraph(device, merge_kit):
    gen = merge_kit.generator("compile", device)
    rows, head_dim = 16, 128
    maxsum = to(device, *merge_kit.partials("maxsum", 6, rows, head_dim, torch.bfloat16, gen))
    lse = to(device, *merge_kit.partials("lsee", 5, rows, head_dim, torch.float16, gen))
    sinks = torch.randn(4, generator=gen).to(device)

    def step(partial_o, partial_stats, partial_v, partial_lse, sinks, out):
        a, a_stats = kvsplit.merge_maxsum(partial_o, partial_stats, 0.7, sinks=sinks,
                                          return_stats=True)
        kvsplit.merge_lse(partial_v, partial_lse, base=math.e, kv_split=4, out=out)
        c, c_lse = kvsplit.merge_lse(partial_v, partial_lse, return_lse=True)
        return a, a_stats, c, c_lse

    compiled = torch.compile(step, fullgraph=True)
    for trial in range(2):  # the second call must see the new data, not a stale graph
        if trial:
            maxsum = to(device, *merge_kit.partials("maxsum", 6, rows, head_dim, torch.bfloat16,
                                                    gen))
        eager_out = torch.full((rows, head_dim), math.nan, dtype=torch.float16, device=device)
        compiled_out = eager_out.clone()
        eager = step(*maxsum, *lse, sinks, eager_out)
        got = compiled(*maxsum, *lse, sinks, compiled_out)
        for expected, actual in zip(eager, got):
            assert torch.equal(actual, expected)
        assert not compiled_out.isnan().any() and torch.equal(compiled_out, eager_out)
        merge_kit.assert_matches_reference(got[0], got[1], *merge_kit.reference(
            "maxsum", *maxsum, scale=0.7, sinks=sinks))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_split, mode", [(None, None), (4, None), (None, "dsplit:4:16"),
                                           (None, "few:2")])
def test_cuda_graph_capture_and_replay(cuda_device, kv_split, mode, merge_kit, monkeypatch):
    if mode:
        monkeypatch.setenv("KVSPLIT_MODE", mode)
    gen = merge_kit.generator("graph", kv_split, mode)
    num_splits, rows, head_dim = 24, 64, 512
    static_o, static_stats = to("cuda", *merge_kit.partials("maxsum", num_splits, rows, head_dim,
                                                            torch.bfloat16, gen))
    static_v, static_lse = to("cuda", *merge_kit.partials("lse2", num_splits, rows, head_dim,
                                                          torch.bfloat16, gen))

    def step():
        a = kvsplit.merge_maxsum(static_o, static_stats, 0.9, return_stats=True,
                                 kv_split=kv_split)
        b = kvsplit.merge_lse(static_v, static_lse, return_lse=True, kv_split=kv_split)
        return a, b

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (out, out_stats), (out_v, out_lse) = step()

    for trial in range(2):
        new_o, new_stats = merge_kit.partials("maxsum", num_splits, rows, head_dim,
                                              torch.bfloat16, gen)
        new_v, new_lse = merge_kit.partials("lse2", num_splits, rows, head_dim, torch.bfloat16,
                                            gen)
        for static, new in ((static_o, new_o), (static_stats, new_stats), (static_v, new_v),
                            (static_lse, new_lse)):
            static.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        merge_kit.assert_matches_reference(out, out_stats, *merge_kit.reference(
            "maxsum", new_o, new_stats, scale=0.9))
        merge_kit.assert_matches_reference(out_v, out_lse,
                                           *merge_kit.reference("lse2", new_v, new_lse))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_split", [None, 1, 4])
def test_runs_on_the_current_stream(cuda_device, kv_split, merge_kit):
    """The kernel is ordered after earlier work on the caller's (non-default) stream."""
    gen = merge_kit.generator("stream", kv_split)
    num_splits, rows, head_dim = 16, 256, 128
    old_o, old_stats = merge_kit.partials("maxsum", num_splits, rows, head_dim, torch.bfloat16,
                                          gen)
    new_o, new_stats = merge_kit.partials("maxsum", num_splits, rows, head_dim, torch.bfloat16,
                                          gen)
    partial_o, stats, source_o, source_stats = to("cuda", old_o, old_stats, new_o, new_stats)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        # Keep the stream busy, then overwrite the inputs: a launch on any other
        # stream would run first and merge the old data.
        torch.cuda._sleep(50_000_000)
        partial_o.copy_(source_o)
        stats.copy_(source_stats)
        out, out_stats = kvsplit.merge_maxsum(partial_o, stats, 0.6, return_stats=True,
                                              kv_split=kv_split)
    stream.synchronize()
    merge_kit.assert_matches_reference(out, out_stats, *merge_kit.reference(
        "maxsum", new_o, new_stats, scale=0.6))
