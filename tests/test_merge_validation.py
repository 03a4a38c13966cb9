"""Bad input to merge_maxsum / merge_lse: an error naming the argument, nothing written.

Every case starts from a valid call on the CPU (a
"meta" tensor serves as a cheap second device) and breaks one thing; the
caller's ``out`` is filled with a sentinel and must come back untouched, and
no input may change.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import kvsplit
from kvsplit.reference import merge_lse_reference

FORMATS = ["maxsum", "lse"]
SENTINEL = 7.0
NUM_SPLITS, ROWS, HEAD_DIM = 4, 8, 64

pytestmark = pytest.mark.usefixtures("dispatch_sandbox")


def stats_name(fmt):
    return "partial_stats" if fmt == "maxsum" else "partial_lse"


def valid_args(fmt, *, num_splits=NUM_SPLITS, rows=ROWS, head_dim=HEAD_DIM,
               dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(1234)
    args = {"partial_o": torch.randn(num_splits, rows, head_dim, generator=gen).to(dtype)}
    maxima = torch.randn(num_splits, rows, generator=gen)
    if fmt == "maxsum":
        sums = 1.0 + torch.rand(num_splits, rows, generator=gen)
        args["stats"] = torch.stack([maxima, sums], dim=-1)
    else:
        args["stats"] = maxima
    out_dtype = dtype if dtype != torch.float32 else torch.bfloat16
    args["out"] = torch.full((rows, head_dim), SENTINEL, dtype=out_dtype)
    return args


def call(fmt, partial_o, stats, **kwargs):
    if fmt == "maxsum":
        scale_log2 = kwargs.pop("scale_log2", 1.0)
        return kvsplit.merge_maxsum(partial_o, stats, scale_log2, **kwargs)
    return kvsplit.merge_lse(partial_o, stats, **kwargs)


def snapshot(args):
    return {name: value.clone() for name, value in args.items()
            if isinstance(value, torch.Tensor) and value.device.type != "meta"}


def assert_rejected(fmt, args, error, name, **kwargs):
    """Calls with ``args`` (+ ``kwargs``); expects ``error`` naming ``name``; checks no writes."""
    before = snapshot(args)
    with pytest.raises(error) as caught:
        call(fmt, **args, **kwargs)
    message = str(caught.value)
    assert re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", message), message
    for key, value in before.items():
        assert torch.equal(args[key], value), f"{key} was modified"
    out = args.get("out")
    if isinstance(out, torch.Tensor) and out.device.type != "meta" and out.is_floating_point():
        assert (out == SENTINEL).all(), "out was written"
    return message


# --- dtypes ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int8, torch.bool])
@pytest.mark.parametrize("fmt", FORMATS)
def test_partial_o_dtype(fmt, dtype):
    args = valid_args(fmt)
    args["partial_o"] = args["partial_o"].to(dtype)
    assert_rejected(fmt, args, TypeError, "partial_o")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16, torch.int32])
@pytest.mark.parametrize("fmt", FORMATS)
def test_stats_dtype(fmt, dtype):
    args = valid_args(fmt)
    args["stats"] = args["stats"].to(dtype)
    assert_rejected(fmt, args, TypeError, stats_name(fmt))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("fmt", FORMATS)
def test_sinks_dtype(fmt, dtype):
    assert_rejected(fmt, valid_args(fmt), TypeError, "sinks", sinks=torch.ones(2, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int16, torch.float32, torch.uint8])
@pytest.mark.parametrize("fmt", FORMATS)
def test_split_counts_dtype(fmt, dtype):
    assert_rejected(fmt, valid_args(fmt), TypeError, "split_counts",
                    split_counts=torch.ones(ROWS, dtype=dtype))


@pytest.mark.parametrize("partial_dtype, out_dtype", [
    (torch.float32, torch.float64), (torch.float16, torch.int16),
    (torch.bfloat16, torch.float8_e5m2), (torch.bfloat16, torch.uint8)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_out_dtype(fmt, partial_dtype, out_dtype):
    args = valid_args(fmt, dtype=partial_dtype)
    args["out"] = torch.full((ROWS, HEAD_DIM), SENTINEL).to(out_dtype)
    assert_rejected(fmt, args, TypeError, "out")


@pytest.mark.parametrize("name", ["partial_o", "stats", "sinks", "split_counts", "out"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_not_a_tensor(fmt, name):
    args = valid_args(fmt)
    kwargs = {}
    value = [[1.0] * HEAD_DIM] * ROWS
    if name in ("partial_o", "stats", "out"):
        args[name] = value
    else:
        kwargs[name] = value
    assert_rejected(fmt, args, TypeError, stats_name(fmt) if name == "stats" else name,
                    **kwargs)


# --- devices ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["stats", "sinks", "split_counts", "out"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_tensor_on_another_device(fmt, name):
    args = valid_args(fmt)
    kwargs = {"sinks": torch.ones(2), "split_counts": torch.full((ROWS,), 2, dtype=torch.int32)}
    if name in args:
        args[name] = args[name].to("meta")
    else:
        kwargs[name] = kwargs[name].to("meta")
    assert_rejected(fmt, args, ValueError, stats_name(fmt) if name == "stats" else name,
                    **kwargs)


@pytest.mark.parametrize("fmt", FORMATS)
def test_partial_o_on_another_device(fmt):
    args = valid_args(fmt)
    args["partial_o"] = args["partial_o"].to("meta")
    message = assert_rejected(fmt, args, ValueError, "partial_o")
    assert "meta" in message


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_input_with_cuda_partials(fmt, cuda_device):
    args = valid_args(fmt)
    args["partial_o"] = args["partial_o"].to(cuda_device)
    args["out"] = args["out"].to(cuda_device)
    assert_rejected(fmt, args, ValueError, stats_name(fmt))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_tensors_on_different_gpus(fmt, cuda_device):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    args = valid_args(fmt)
    args["partial_o"] = args["partial_o"].to("cuda:0")
    args["stats"] = args["stats"].to("cuda:1")
    args["out"] = args["out"].to("cuda:0")
    assert_rejected(fmt, args, ValueError, stats_name(fmt))


# --- shapes ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(ROWS, HEAD_DIM), (1, 1, NUM_SPLITS, ROWS, HEAD_DIM), (HEAD_DIM,)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_partial_o_not_3d(fmt, shape):
    args = valid_args(fmt)
    args["partial_o"] = torch.ones(shape, dtype=torch.bfloat16)
    assert_rejected(fmt, args, ValueError, "partial_o")


@pytest.mark.parametrize("head_dim", [4, 12, 100, 1032, 2048])
@pytest.mark.parametrize("fmt", FORMATS)
def test_unsupported_head_dim(fmt, head_dim):
    args = valid_args(fmt, head_dim=head_dim)
    del args["out"]
    message = assert_rejected(fmt, args, ValueError, "partial_o")
    assert re.search(rf"\b{head_dim}\b", message), message


@pytest.mark.parametrize("fmt", FORMATS)
def test_no_splits_but_rows(fmt):
    args = valid_args(fmt)
    args["partial_o"] = args["partial_o"][:0]
    args["stats"] = args["stats"][:0]
    assert_rejected(fmt, args, ValueError, "partial_o")


STATS_SHAPES = {
    "maxsum": [(NUM_SPLITS + 1, ROWS, 2), (NUM_SPLITS, ROWS - 1, 2), (NUM_SPLITS, ROWS, 1),
               (NUM_SPLITS, ROWS, 3), (NUM_SPLITS, ROWS), (NUM_SPLITS * ROWS * 2,)],
    "lse": [(NUM_SPLITS + 1, ROWS), (NUM_SPLITS, ROWS + 1), (NUM_SPLITS, ROWS, 1),
            (NUM_SPLITS, ROWS, 2), (ROWS,)],
}


@pytest.mark.parametrize("fmt, shape", [(fmt, shape) for fmt in FORMATS
                                        for shape in STATS_SHAPES[fmt]])
def test_stats_shape(fmt, shape):
    args = valid_args(fmt)
    args["stats"] = torch.zeros(shape)
    assert_rejected(fmt, args, ValueError, stats_name(fmt))


@pytest.mark.parametrize("sinks_shape", [(0,), (1, 2), (2, 1)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_sinks_shape(fmt, sinks_shape):
    assert_rejected(fmt, valid_args(fmt), ValueError, "sinks", sinks=torch.zeros(sinks_shape))


@pytest.mark.parametrize("heads", [3, 5, 16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_sinks_do_not_divide_rows(fmt, heads):
    assert_rejected(fmt, valid_args(fmt), ValueError, "sinks", sinks=torch.zeros(heads))


@pytest.mark.parametrize("shape", [(ROWS + 1,), (ROWS - 1,), (ROWS, 1), (1, ROWS), ()])
@pytest.mark.parametrize("fmt", FORMATS)
def test_split_counts_shape(fmt, shape):
    assert_rejected(fmt, valid_args(fmt), ValueError, "split_counts",
                    split_counts=torch.ones(shape, dtype=torch.int32))


@pytest.mark.parametrize("shape", [(ROWS + 1, HEAD_DIM), (ROWS - 1, HEAD_DIM),
                                   (ROWS, HEAD_DIM * 2), (ROWS, HEAD_DIM // 2),
                                   (ROWS * HEAD_DIM,), (1, ROWS, HEAD_DIM)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_out_shape(fmt, shape):
    args = valid_args(fmt)
    args["out"] = torch.full(shape, SENTINEL, dtype=torch.bfloat16)
    assert_rejected(fmt, args, ValueError, "out")


# --- strides and alignment -------------------------------------------------------------


@pytest.mark.parametrize("fmt, name", [  # lse stats (num_splits, rows) have no last dim
    (fmt, name) for fmt in FORMATS
    for name in ("partial_o", "stats", "sinks", "split_counts", "out")
    if (fmt, name) != ("lse", "stats")])
def test_non_unit_last_stride(fmt, name):
    args = valid_args(fmt)
    kwargs = {}
    if name == "partial_o":
        args[name] = torch.ones(NUM_SPLITS, ROWS, 2 * HEAD_DIM, dtype=torch.bfloat16)[..., ::2]
    elif name == "stats":
        args[name] = torch.ones(NUM_SPLITS, ROWS, 4)[..., ::2]
    elif name == "out":
        args[name] = torch.full((ROWS, 2 * HEAD_DIM), SENTINEL, dtype=torch.bfloat16)[:, ::2]
    elif name == "sinks":
        kwargs[name] = torch.zeros(4)[::2]
    else:
        kwargs[name] = torch.ones(2 * ROWS, dtype=torch.int32)[::2]
    assert_rejected(fmt, args, ValueError, stats_name(fmt) if name == "stats" else name,
                    **kwargs)


def offset_view(shape, dtype, offset, fill=1.0):
    """A contiguous view starting ``offset`` elements into a fresh (aligned) buffer."""
    numel = math.prod(shape)
    return torch.full((numel + 64,), fill, dtype=dtype)[offset:offset + numel].view(shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", FORMATS)
def test_partial_o_misaligned(fmt, dtype):
    args = valid_args(fmt, dtype=dtype)
    args["partial_o"] = offset_view((NUM_SPLITS, ROWS, HEAD_DIM), dtype, 1)
    assert_rejected(fmt, args, ValueError, "partial_o")


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("fmt", FORMATS)
def test_partial_o_stride_not_16_bytes(fmt, dim):
    args = valid_args(fmt)
    # One extra bfloat16 element makes the stride of ``dim`` 2 bytes off 16.
    buffer = torch.ones(NUM_SPLITS * ROWS * HEAD_DIM + ROWS * HEAD_DIM + HEAD_DIM,
                        dtype=torch.bfloat16)
    strides = (ROWS * HEAD_DIM + (1 if dim == 0 else 0), HEAD_DIM + (1 if dim == 1 else 0), 1)
    args["partial_o"] = buffer.as_strided((NUM_SPLITS, ROWS, HEAD_DIM), strides)
    assert_rejected(fmt, args, ValueError, "partial_o")


@pytest.mark.parametrize("partial_dtype, offset", [(torch.bfloat16, 1), (torch.bfloat16, 4),
                                                   (torch.float32, 1), (torch.float32, 3)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_out_misaligned(fmt, partial_dtype, offset):
    args = valid_args(fmt, dtype=partial_dtype)
    args["out"] = offset_view((ROWS, HEAD_DIM), torch.bfloat16, offset, SENTINEL)
    assert_rejected(fmt, args, ValueError, "out")


@pytest.mark.parametrize("fmt", FORMATS)
def test_out_row_stride_not_aligned(fmt):
    args = valid_args(fmt)
    args["out"] = torch.full((ROWS, HEAD_DIM + 1), SENTINEL, dtype=torch.bfloat16)[:, :HEAD_DIM]
    assert_rejected(fmt, args, ValueError, "out")


# --- aliasing --------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", ["whole", "partial"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_out_aliases_partial_o(fmt, overlap):
    args = valid_args(fmt)
    start = 0 if overlap == "whole" else (NUM_SPLITS * ROWS - ROWS // 2) * HEAD_DIM
    flat = torch.cat([args["partial_o"].flatten(), torch.ones(ROWS * HEAD_DIM,
                                                              dtype=torch.bfloat16)])
    args["partial_o"] = flat[:NUM_SPLITS * ROWS * HEAD_DIM].view(NUM_SPLITS, ROWS, HEAD_DIM)
    args["out"] = flat[start:start + ROWS * HEAD_DIM].view(ROWS, HEAD_DIM)
    before = flat.clone()
    with pytest.raises(ValueError, match=r"^out\b.*partial_o"):
        call(fmt, **args)
    assert torch.equal(flat, before)


@pytest.mark.parametrize("name", ["stats", "sinks", "split_counts"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_out_aliases_another_input(fmt, name):
    """``out`` sharing bytes with any input is refused; the message names both."""
    args = valid_args(fmt)
    buffer = torch.full((ROWS * HEAD_DIM,), SENTINEL, dtype=torch.bfloat16)
    args["out"] = buffer.view(ROWS, HEAD_DIM)
    words = buffer.view(torch.float32)  # ROWS * HEAD_DIM / 2 four-byte words
    before = buffer.clone()
    kwargs = {}
    if name == "stats":
        args["stats"] = words[-args["stats"].numel():].view(args["stats"].shape)
        expected = stats_name(fmt)
    elif name == "sinks":
        kwargs["sinks"] = words[:2]
        expected = "sinks"
    else:
        kwargs["split_counts"] = buffer.view(torch.int32)[ROWS:2 * ROWS]
        expected = "split_counts"
    with pytest.raises(ValueError, match=r"^out\b") as caught:
        call(fmt, **args, **kwargs)
    assert torch.equal(buffer, before)
    assert re.search(rf"\b{expected}\b", str(caught.value)), str(caught.value)


@pytest.mark.parametrize("fmt", FORMATS)
def test_out_right_after_partial_o_is_not_aliasing(fmt):
    args = valid_args(fmt)
    size = NUM_SPLITS * ROWS * HEAD_DIM
    flat = torch.cat([args["partial_o"].flatten(), torch.ones(ROWS * HEAD_DIM,
                                                              dtype=torch.bfloat16)])
    args["partial_o"] = flat[:size].view(NUM_SPLITS, ROWS, HEAD_DIM)
    args["out"] = flat[size:].view(ROWS, HEAD_DIM)
    expected = call(fmt, args["partial_o"].clone(), args["stats"])
    assert torch.equal(call(fmt, **args), expected)
    assert torch.equal(args["out"], expected)


# --- scalars ---------------------------------------------------------------------------


@pytest.mark.parametrize("kv_split, error", [(3, ValueError), (0, ValueError), (-1, ValueError),
                                             (32, ValueError), (6, ValueError),
                                             (True, TypeError), (2.0, TypeError),
                                             ("8", TypeError), ([4], TypeError)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_bad_kv_split(fmt, kv_split, error):
    assert_rejected(fmt, valid_args(fmt), error, "kv_split", kv_split=kv_split)


@pytest.mark.parametrize("fmt", FORMATS)
def test_kv_split_numpy_integer(fmt):
    """A NumPy integer is an int to the API: np.int64(4) forces K = 4 like 4 does."""
    numpy = pytest.importorskip("numpy")
    args = valid_args(fmt)
    expected = call(fmt, **args, kv_split=4)
    assert torch.equal(call(fmt, **args, kv_split=numpy.int64(4)), expected)
    assert_rejected(fmt, valid_args(fmt), ValueError, "kv_split", kv_split=numpy.int32(3))


@pytest.mark.parametrize("scale_log2, error", [
    (0, ValueError), (0.0, ValueError), (-1, ValueError), (-0.5, ValueError),
    (math.nan, ValueError), (math.inf, ValueError), (-math.inf, ValueError),
    ("x", TypeError), (None, TypeError), (True, TypeError), (torch.tensor(1.0), TypeError)])
def test_bad_scale_log2(scale_log2, error):
    assert_rejected("maxsum", valid_args("maxsum"), error, "scale_log2", scale_log2=scale_log2)


def test_scale_log2_beyond_float32():
    """The kernel computes in float32: a scale that overflows it would give NaN rows."""
    assert_rejected("maxsum", valid_args("maxsum"), ValueError, "scale_log2", scale_log2=1e39)


@pytest.mark.parametrize("scale_log2", [1e-39, 1e-45, 1e-46])
def test_scale_log2_below_normal_float32(scale_log2):
    """A scale that float32 holds only as a subnormal (or not at all) flushes to 0 in the
    kernels: every row would be NaN."""
    assert_rejected("maxsum", valid_args("maxsum"), ValueError, "scale_log2",
                    scale_log2=scale_log2)


@pytest.mark.parametrize("scale_log2", [math.nan, -1.0, 0.0, math.inf, 1e-46, 1e300])
def test_custom_op_checks_the_scale_of_a_known_layout(scale_log2):
    """The op's first call makes the layout; a later call of it with a bad scale is refused
    all the same (the layout's key leaves the maxsum scale out)."""
    args = valid_args("maxsum")
    torch.ops.kvsplit.merge_maxsum_out(args["partial_o"], args["stats"], 0.5, None, None,
                                       args["out"], None, 0)
    args["out"].fill_(SENTINEL)
    with pytest.raises(ValueError, match="scale_log2"):
        torch.ops.kvsplit.merge_maxsum_out(args["partial_o"], args["stats"], scale_log2, None,
                                           None, args["out"], None, 0)
    assert (args["out"] == SENTINEL).all()


def bad_stats_outputs(fmt):
    rows = ROWS
    tail = (2,) if fmt == "maxsum" else ()
    return [
        ("expanded", torch.full((1,) + tail, SENTINEL).expand((rows,) + tail), ValueError),
        ("float16", torch.full((rows,) + tail, SENTINEL, dtype=torch.float16), TypeError),
        ("short", torch.full((rows // 2,) + tail, SENTINEL), ValueError),
        ("flat", torch.full((rows * 2,), SENTINEL), ValueError),
    ]


@pytest.mark.parametrize("case", range(4), ids=["expanded", "float16", "short", "flat"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_custom_op_checks_its_stats_output(fmt, case):
    """The ops' exported stats output (out_stats, out_lse) has the checks of the public
    call's: before, a wrong one was written as if it were right (past its end)."""
    _, target, error = bad_stats_outputs(fmt)[case]
    if fmt == "maxsum" and case == 3:  # (16,) is maxsum's flat (8, 2): a shape error still
        target = torch.full((ROWS,), SENTINEL)
    args = valid_args(fmt)
    name = "out_stats" if fmt == "maxsum" else "out_lse"
    op = (torch.ops.kvsplit.merge_maxsum_out if fmt == "maxsum"
          else torch.ops.kvsplit.merge_lse_out)
    scalar = 1.0 if fmt == "maxsum" else 2.0
    with pytest.raises(error, match=name):
        op(args["partial_o"], args["stats"], scalar, None, None, args["out"], target, 0)
    assert (args["out"] == SENTINEL).all() and (target == SENTINEL).all()
    good = torch.empty((ROWS, 2) if fmt == "maxsum" else (ROWS,))
    op(args["partial_o"], args["stats"], scalar, None, None, args["out"], good, 0)
    _, expected = call(fmt, args["partial_o"], args["stats"],
                       **({"return_stats": True} if fmt == "maxsum" else {"return_lse": True}))
    torch.testing.assert_close(good, expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["out", "stats", "out_stats"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_custom_op_with_one_tensor_on_meta(fmt, name):
    """The dispatcher sends a call with any meta tensor to the op's fake implementation:
    a meta tensor beside CPU ones is refused there, as a call on two devices is."""
    args = valid_args(fmt)
    out_stats = torch.empty((ROWS, 2) if fmt == "maxsum" else (ROWS,))
    tensors = {"stats": args["stats"], "out": args["out"], "out_stats": out_stats}
    tensors[name] = tensors[name].to("meta")
    op = (torch.ops.kvsplit.merge_maxsum_out if fmt == "maxsum"
          else torch.ops.kvsplit.merge_lse_out)
    shown = {"stats": stats_name(fmt), "out": "out",
             "out_stats": "out_stats" if fmt == "maxsum" else "out_lse"}[name]
    with pytest.raises(ValueError, match=f"^{shown} is on meta but partial_o is on cpu"):
        op(args["partial_o"], tensors["stats"], 1.0 if fmt == "maxsum" else 2.0, None, None,
           tensors["out"], tensors["out_stats"], 0)
    meta = {key: value.to("meta") for key, value in tensors.items()}  # all on meta: no error
    op(args["partial_o"].to("meta"), meta["stats"], 1.0 if fmt == "maxsum" else 2.0, None, None,
       meta["out"], meta["out_stats"], 0)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", ["rows closer than a row", "expanded"])
def test_out_whose_elements_share_memory(fmt, layout):
    args = valid_args(fmt)
    buffer = torch.full((ROWS * HEAD_DIM,), SENTINEL, dtype=torch.bfloat16)
    args["out"] = (torch.as_strided(buffer, (ROWS, HEAD_DIM), (HEAD_DIM // 2, 1))
                   if layout != "expanded" else buffer[:HEAD_DIM].expand(ROWS, HEAD_DIM))
    assert_rejected(fmt, args, ValueError, "out")


def _not_dense(value, kind):
    if kind == "sparse":
        return value.to_sparse()
    return torch.nested.nested_tensor(list(value))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("kind", ["sparse", "nested"])
@pytest.mark.parametrize("name", ["partial_o", "stats", "sinks", "split_counts", "out",
                                  "partial_o[0]", "partial_o[1]", "indptr"])
@pytest.mark.parametrize("given_out", [True, False])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_tensor_that_is_not_dense(fmt, name, kind, given_out):
    """Sparse and nested tensors have no strided memory to read or write: a TypeError
    naming the argument, in the stacked, list-of-parts and variable-length calls, with
    ``out`` given or allocated."""
    if name == "out" and not given_out:
        pytest.skip("out is the argument")
    args = valid_args(fmt)
    if not given_out:
        del args["out"]
    kwargs = {}
    if name in ("partial_o[0]", "partial_o[1]"):
        parts = [args["partial_o"][0], args["partial_o"][1]]
        index = int(name[-2])
        parts[index] = _not_dense(parts[index], kind)
        args["partial_o"], args["stats"] = parts, [args["stats"][0], args["stats"][1]]
    elif name == "indptr":
        args["partial_o"], args["stats"] = args["partial_o"][0], args["stats"][0]
        args.pop("out", None)
        offsets = torch.arange(ROWS + 1, dtype=torch.int32)
        kwargs["indptr"] = offsets.to_sparse() if kind == "sparse" else _not_dense(
            offsets.view(3, 3), kind)
    elif name in ("sinks", "split_counts"):
        value = (torch.zeros(2, 4) if name == "sinks"
                 else torch.full((2, ROWS // 2), NUM_SPLITS, dtype=torch.int32))
        kwargs[name] = value.view(-1).to_sparse() if kind == "sparse" else _not_dense(value, kind)
    else:
        args[name] = _not_dense(args[name], kind)
    with pytest.raises(TypeError, match="must be a dense \\(strided\\) tensor") as caught:
        call(fmt, **args, **kwargs)
    shown = stats_name(fmt) if name == "stats" else name
    assert str(caught.value).startswith(shown + " "), caught.value


@pytest.mark.parametrize("flag", ["no", 1, 0, None])
@pytest.mark.parametrize("given_out", [True, False])
@pytest.mark.parametrize("fmt", FORMATS)
def test_return_stats_takes_a_bool(fmt, flag, given_out):
    """A string such as "no" is truthy: return_lse / return_stats must be True or False."""
    args = valid_args(fmt)
    if not given_out:
        del args["out"]
    name = "return_stats" if fmt == "maxsum" else "return_lse"
    assert_rejected(fmt, args, TypeError, name, **{name: flag})
    assert_rejected(fmt, valid_args(fmt), TypeError, name, **{name: flag, "out_dtype": None,
                                                              "pass_through_from": 2})


@pytest.mark.parametrize("fmt", FORMATS)
def test_indptr_over_no_states_gives_empty_rows(fmt):
    """nnz = 0: every token's range is empty, so every row is 0 with empty stats."""
    tail = (2,) if fmt == "maxsum" else ()
    partial_o = torch.empty(0, 3, HEAD_DIM, dtype=torch.bfloat16)
    stats = torch.empty((0, 3) + tail)
    indptr = torch.zeros(5, dtype=torch.int32)
    out, out_stats = call(fmt, partial_o, stats, indptr=indptr,
                          **({"return_stats": True} if fmt == "maxsum" else {"return_lse": True}))
    assert out.shape == (4, 3, HEAD_DIM) and (out == 0).all()
    if fmt == "maxsum":
        assert (out_stats[..., 0] == -math.inf).all() and (out_stats[..., 1] == 0).all()
    else:
        assert (out_stats == -math.inf).all()
    with pytest.raises(ValueError, match="past the 0 states"):
        call(fmt, partial_o, stats, indptr=torch.tensor([0, 1], dtype=torch.int32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_split_counts_with_indptr(fmt):
    args = valid_args(fmt)
    indptr = torch.tensor([0, 2, 4] + [4] * (ROWS - 2), dtype=torch.int32)
    assert_rejected(fmt, args, ValueError, "split_counts", indptr=indptr,
                    split_counts=torch.ones(ROWS, dtype=torch.int32))


@pytest.mark.parametrize("base, error", [
    (10.0, ValueError), (1.0, ValueError), (0, ValueError), (-2.0, ValueError),
    (2.718, ValueError), (math.nan, ValueError), (math.inf, ValueError), ("2", TypeError),
    (None, TypeError), (True, TypeError)])
def test_bad_base(base, error):
    assert_rejected("lse", valid_args("lse"), error, "base", base=base)


@pytest.mark.parametrize("base", [2, 2.0, math.e])
def test_accepted_bases(base):
    args = valid_args("lse")
    out = call("lse", **args, base=base)
    assert out.data_ptr() == args["out"].data_ptr() and not (out == SENTINEL).any()
    expected, _ = merge_lse_reference(args["partial_o"], args["stats"], base=float(base))
    torch.testing.assert_close(out.double(), expected, rtol=2**-7, atol=1e-5)


# --- zero rows -------------------------------------------------------------------------


@pytest.mark.parametrize("num_splits", [0, 3])
@pytest.mark.parametrize("with_out", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_rows(fmt, dtype, with_out, num_splits):
    args = valid_args(fmt, rows=0, num_splits=num_splits, dtype=dtype)
    if not with_out:
        del args["out"]
    kwargs = {"return_stats": True} if fmt == "maxsum" else {"return_lse": True}
    out, stats = call(fmt, **args, kv_split=4, **kwargs)
    assert out.shape == (0, HEAD_DIM) and stats.shape == ((0, 2) if fmt == "maxsum" else (0,))
    assert out.dtype == (torch.bfloat16 if dtype == torch.float32 else dtype)
    assert stats.dtype == torch.float32
    if with_out:
        assert out.data_ptr() == args["out"].data_ptr()
