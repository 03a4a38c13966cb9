"""The public merge functions: validate once, allocate, forward.

Both functions are also registered as ``torch.library`` custom ops
(``kvsplit::merge_maxsum_out`` and ``kvsplit::merge_lse_out``, which write
into preallocated outputs), so they trace under ``torch.compile`` and capture
into CUDA graphs. Eager calls skip the op dispatcher and call the same
implementation directly.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from . import _native
from .dispatch import dispatcher
from .dispatch.constraints import Config
from .dispatch.device import device_facts

HEAD_DIMS = (64, 128, 256, 512)
MAXSUM, LSE = 0, 1
_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2
_DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_OUT_DTYPES = (torch.bfloat16, torch.float16)
_FLOAT32_MAX = torch.finfo(torch.float32).max
_STATS_DTYPES = (torch.float32,)
_COUNT_DTYPES = (torch.int32,)


def _is_real(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def _type_error(name: str, value: object) -> TypeError:
    return TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _dtype_error(name: str, dtype: torch.dtype, dtypes: tuple[torch.dtype, ...]) -> TypeError:
    allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    return TypeError(f"{name} must have dtype {allowed}; got {str(dtype).removeprefix('torch.')}")


def _check_tensor(name: str, value: object, dtypes: tuple[torch.dtype, ...],
                  shape: tuple[int, ...], device: torch.device, unit_dim: Optional[int]) -> None:
    """Type, dtype, shape, device and unit stride of one argument, each read once.

    The tests run on every call, so they are plain comparisons; messages are
    only built for a failure.
    """
    if not isinstance(value, torch.Tensor):
        raise _type_error(name, value)
    if value.dtype not in dtypes:
        raise _dtype_error(name, value.dtype, dtypes)
    if value.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but partial_o is on {device}")
    if unit_dim is not None and shape[unit_dim] > 1 and value.stride(unit_dim) != 1:
        raise ValueError(f"{name} must have unit stride on dim {unit_dim}, "
                         f"got strides {value.stride()}")


def _validate_common(partial_o, stats_name, stats, stats_tail, sinks, split_counts, out,
                     kv_split):
    """Checks what needs no memory address; returns (num_splits, rows, head_dim, out dtype)."""
    if not isinstance(partial_o, torch.Tensor):
        raise _type_error("partial_o", partial_o)
    dtype = partial_o.dtype
    if dtype not in _DTYPE_CODES:
        raise _dtype_error("partial_o", dtype, tuple(_DTYPE_CODES))
    shape = partial_o.shape
    if len(shape) != 3:
        raise ValueError(f"partial_o must be 3-D (num_splits, rows, head_dim), got {len(shape)}-D")
    num_splits, rows, head_dim = shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"partial_o: head_dim {head_dim} is not supported; use one of {HEAD_DIMS}")
    if num_splits == 0 and rows > 0:
        raise ValueError("partial_o has num_splits = 0 but rows > 0: nothing to merge")
    if partial_o.stride(2) != 1:
        raise ValueError(f"partial_o must have unit stride on dim 2, got strides {partial_o.stride()}")
    device = partial_o.device

    _check_tensor(stats_name, stats, _STATS_DTYPES, (num_splits, rows) + stats_tail, device,
                  2 if stats_tail else None)
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            raise _type_error("sinks", sinks)
        if sinks.dtype != torch.float32:
            raise _dtype_error("sinks", sinks.dtype, _STATS_DTYPES)
        if sinks.dim() != 1 or sinks.numel() == 0:
            raise ValueError(f"sinks must be 1-D (heads,) with heads >= 1, got shape {tuple(sinks.shape)}")
        if rows % sinks.numel():
            raise ValueError(f"sinks: rows ({rows}) must be a multiple of heads ({sinks.numel()})")
        _check_tensor("sinks", sinks, _STATS_DTYPES, tuple(sinks.shape), device, 0)
    if split_counts is not None:
        _check_tensor("split_counts", split_counts, _COUNT_DTYPES, (rows,), device, 0)

    if out is None:
        out_dtype = dtype if dtype in _OUT_DTYPES else torch.bfloat16
    else:
        allowed = (dtype,) if dtype in _OUT_DTYPES else _OUT_DTYPES
        _check_tensor("out", out, allowed, (rows, head_dim), device, 1)
        out_dtype = out.dtype

    if kv_split is not None:
        if isinstance(kv_split, bool) or not isinstance(kv_split, numbers.Integral):
            raise TypeError(f"kv_split must be an int or None, got {type(kv_split).__name__}")
        if kv_split not in dispatcher.KV_SPLITS:
            raise ValueError(f"kv_split must be one of {dispatcher.KV_SPLITS} or None, got {kv_split}")
    return num_splits, rows, head_dim, out_dtype


def _byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte addresses that ``tensor`` can touch (non-negative strides)."""
    start = tensor.data_ptr()
    extent = 0
    for size, stride in zip(tensor.shape, tensor.stride()):
        extent += (size - 1) * stride
    return start, start + (extent + 1) * tensor.dtype.itemsize


def _check_alignment(partial_o: torch.Tensor, out: torch.Tensor) -> None:
    """Checks alignment, which needs real addresses (not fake tensors)."""
    elem = partial_o.dtype.itemsize
    num_splits, rows, _ = partial_o.shape
    split_stride, row_stride, _ = partial_o.stride()
    if partial_o.data_ptr() % 16:
        raise ValueError("partial_o must be 16-byte aligned")
    for dim, size, stride in ((0, num_splits, split_stride), (1, rows, row_stride)):
        if size > 1 and (stride * elem) % 16:
            raise ValueError(f"partial_o: stride {stride} of dim {dim} is not a "
                             "multiple of 16 bytes")
    # Each thread stores the outputs of 16 bytes of partials in one access.
    out_elem = out.dtype.itemsize
    store_bytes = 16 // elem * out_elem
    if out.data_ptr() % store_bytes or (rows > 1 and (out.stride(0) * out_elem) % store_bytes):
        raise ValueError(f"out and each of its rows must be {store_bytes}-byte aligned")


def _check_aliasing(partial_o, stats, sinks, split_counts, out, out_stats) -> None:
    """Raises if an output overlaps an input (or the other output).

    Only views of one allocation can overlap, so byte spans are compared only
    for tensors that share a storage (the common call has none and costs one
    storage lookup per pair).
    """
    stats_name = "partial_stats" if stats.dim() == 3 else "partial_lse"
    sources = [("partial_o", partial_o), (stats_name, stats), ("sinks", sinks),
               ("split_counts", split_counts)]
    for out_name, target in (("out", out), ("out_stats", out_stats)):
        if target is None:
            continue
        storage = target.untyped_storage().data_ptr()
        for in_name, source in sources:
            if (source is not None and source.untyped_storage().data_ptr() == storage
                    and _spans_overlap(target, source)):
                raise ValueError(f"{out_name} overlaps {in_name}: outputs must not alias inputs")
        sources.append((out_name, target))


def _spans_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not a.numel() or not b.numel():
        return False
    a_lo, a_hi = _byte_span(a)
    b_lo, b_hi = _byte_span(b)
    return a_lo < b_hi and b_lo < a_hi


def _launch(stats_format: int, partial_o, stats, sinks, split_counts, out, out_stats,
            log2_scale: float, export_scale: float, kv_split: int, fresh_out: bool = False,
            config: Optional[Config] = None) -> None:
    """Validates addresses, chooses the kernel config and launches.

    ``kv_split`` (0: none) is the caller's request, which the dispatcher
    constrains; a ``config`` (the tuner's candidates, already valid) runs as given.
    """
    _check_alignment(partial_o, out)
    if not fresh_out:  # outputs allocated by the wrapper cannot alias anything
        _check_aliasing(partial_o, stats, sinks, split_counts, out, out_stats)
    num_splits, rows, head_dim = partial_o.shape
    if rows == 0:
        return
    device = partial_o.device
    facts = device_facts(device)
    family, slices, k, depth = config if config is not None else dispatcher.choose(
        facts, device, head_dim, partial_o.dtype, out.dtype, stats_format,
        num_splits, rows, kv_split or None)
    o_stride_split, o_stride_row, _ = partial_o.stride()
    stats_strides = stats.stride()
    args = (
        partial_o.data_ptr(), stats.data_ptr(),
        split_counts.data_ptr() if split_counts is not None else 0,
        sinks.data_ptr() if sinks is not None else 0,
        out.data_ptr(), out_stats.data_ptr() if out_stats is not None else 0,
        num_splits, rows, sinks.numel() if sinks is not None else 1,
        o_stride_split, o_stride_row, stats_strides[0], stats_strides[1], out.stride(0),
        log2_scale, export_scale, head_dim, _DTYPE_CODES[partial_o.dtype],
        _DTYPE_CODES[out.dtype], stats_format, family, slices, k, depth,
    )
    if facts.is_cuda:
        if not _native.has_cuda_kernels():
            raise RuntimeError("this kvsplit build has no CUDA kernels (no CUDA compiler at build time)")
        stream = torch._C._cuda_getCurrentRawStream(device.index)
        _native.ext().merge_cuda(*args, facts.sm_count, dispatcher.pdl_enabled(), stream)
    else:
        _native.ext().merge_cpu(*args)


def _merge_maxsum_impl(partial_o: torch.Tensor, partial_stats: torch.Tensor, scale_log2: float,
                       sinks: Optional[torch.Tensor], split_counts: Optional[torch.Tensor],
                       out: torch.Tensor, out_stats: Optional[torch.Tensor], kv_split: int,
                       fresh_out: bool = False) -> None:
    """Writes the merge into ``out`` (and ``out_stats``); ``kv_split`` 0 lets the dispatcher choose."""
    _launch(MAXSUM, partial_o, partial_stats, sinks, split_counts, out, out_stats,
            scale_log2, _LN2, kv_split, fresh_out)


def _merge_lse_impl(partial_o: torch.Tensor, partial_lse: torch.Tensor, base: float,
                    sinks: Optional[torch.Tensor], split_counts: Optional[torch.Tensor],
                    out: torch.Tensor, out_lse: Optional[torch.Tensor], kv_split: int,
                    fresh_out: bool = False) -> None:
    """Writes the merge into ``out`` (and ``out_lse``); ``kv_split`` 0 lets the dispatcher choose."""
    to_log2 = 1.0 if base == 2.0 else _LOG2E
    _launch(LSE, partial_o, partial_lse, sinks, split_counts, out, out_lse,
            to_log2, 1.0 if base == 2.0 else _LN2, kv_split, fresh_out)


@torch.library.custom_op("kvsplit::merge_maxsum_out", mutates_args=("out", "out_stats"))
def merge_maxsum_out(partial_o: torch.Tensor, partial_stats: torch.Tensor, scale_log2: float,
                     sinks: Optional[torch.Tensor], split_counts: Optional[torch.Tensor],
                     out: torch.Tensor, out_stats: Optional[torch.Tensor], kv_split: int) -> None:
    """Custom op behind :func:`merge_maxsum` (writes into ``out``; ``kv_split`` 0 = choose)."""
    _merge_maxsum_impl(partial_o, partial_stats, scale_log2, sinks, split_counts, out, out_stats,
                       kv_split)


@torch.library.custom_op("kvsplit::merge_lse_out", mutates_args=("out", "out_lse"))
def merge_lse_out(partial_o: torch.Tensor, partial_lse: torch.Tensor, base: float,
                  sinks: Optional[torch.Tensor], split_counts: Optional[torch.Tensor],
                  out: torch.Tensor, out_lse: Optional[torch.Tensor], kv_split: int) -> None:
    """Custom op behind :func:`merge_lse` (writes into ``out``; ``kv_split`` 0 = choose)."""
    _merge_lse_impl(partial_o, partial_lse, base, sinks, split_counts, out, out_lse, kv_split)


@merge_maxsum_out.register_fake
def _(partial_o, partial_stats, scale_log2, sinks, split_counts, out, out_stats, kv_split):
    return None


@merge_lse_out.register_fake
def _(partial_o, partial_lse, base, sinks, split_counts, out, out_lse, kv_split):
    return None


def _call(op, impl, fresh_out: bool, *args) -> None:
    # Eager calls skip the op dispatcher's overhead; traced calls need the op.
    if torch.compiler.is_compiling():
        op(*args)
    else:
        impl(*args, fresh_out=fresh_out)


def merge_maxsum(partial_o, partial_stats, scale_log2, *, sinks=None, split_counts=None,
                 out=None, return_stats=False, kv_split=None):
    """Merge split-KV partials whose stats are (max, sum) pairs (TensorRT-LLM layout).

    Parameters
    ----------
    partial_o : Tensor (num_splits, rows, head_dim), bfloat16, float16 or float32
        Unnormalised partial outputs O_i. Any strides on the first two dims
        (multiples of 16 bytes), unit stride on head_dim, 16-byte aligned.
        head_dim is 64, 128, 256 or 512. rows = tokens * heads, heads fastest.
    partial_stats : Tensor (num_splits, rows, 2), float32
        (m_i, l_i): m_i the raw (unscaled) logit max of split i, and
        l_i = sum_j 2^(scale_log2 * (x_j - m_i)).
    scale_log2 : float
        Softmax scale times log2(e) (positive, finite).
    sinks : Tensor (heads,), float32, optional
        Per-head attention-sink logits in natural-log units; the sink of row r
        is sinks[r % heads].
    split_counts : Tensor (rows,), int32, optional
        Partials per row; splits at or past the count are never read.
    out : Tensor (rows, head_dim), optional
        Output; bfloat16/float16 (the partials' dtype when they are 16-bit).
    return_stats : bool
        Also return float32 (rows, 2) stats (M * scale_log2 / log2(e), L).
    kv_split : int, optional
        Force the KvSplit family with K in {1, 2, 4, 8, 16} (still halved to
        satisfy the kernel's constraints); None lets the dispatcher choose a
        config of either family.

    Returns
    -------
    Tensor, or (Tensor, Tensor) with ``return_stats``. A row with no
    non-empty split is 0 with stats (-inf, 0).
    """
    if type(scale_log2) is not float and not _is_real(scale_log2):
        raise TypeError(f"scale_log2 must be a real number, got {type(scale_log2).__name__}")
    if not (math.isfinite(scale_log2) and 0 < scale_log2 <= _FLOAT32_MAX):
        raise ValueError(f"scale_log2 must be positive and finite in float32, got {scale_log2}")
    _, rows, head_dim, out_dtype = _validate_common(
        partial_o, "partial_stats", partial_stats, (2,), sinks, split_counts, out, kv_split)
    fresh_out = out is None
    if fresh_out:
        out = partial_o.new_empty((rows, head_dim), dtype=out_dtype)
    out_stats = partial_o.new_empty((rows, 2), dtype=torch.float32) if return_stats else None
    _call(merge_maxsum_out, _merge_maxsum_impl, fresh_out, partial_o, partial_stats,
          float(scale_log2), sinks, split_counts, out, out_stats, kv_split or 0)
    return (out, out_stats) if return_stats else out


def merge_lse(partial_o, partial_lse, *, base=2.0, sinks=None, split_counts=None, out=None,
              return_lse=False, kv_split=None):
    """Merge split-KV partials whose stats are log-sum-exps (FlashInfer/FlashAttention layout).

    Parameters
    ----------
    partial_o : Tensor (num_splits, rows, head_dim), bfloat16, float16 or float32
        Normalised partial outputs O_i (layout rules as in :func:`merge_maxsum`).
    partial_lse : Tensor (num_splits, rows), float32
        lse_i of each split, in ``base``; -inf marks an empty split.
    base : float
        2.0 (FlashInfer, FlashMLA) or math.e (FlashAttention, vLLM).
    sinks : Tensor (heads,), float32, optional
        Per-head sink logits in natural-log units, joining the sum as a state
        with zero output.
    split_counts, out, kv_split
        As in :func:`merge_maxsum`.
    return_lse : bool
        Also return the merged float32 (rows,) LSE, in ``base``.

    Returns
    -------
    Tensor, or (Tensor, Tensor) with ``return_lse``. A row with no non-empty
    split is 0 with LSE -inf.
    """
    if type(base) is not float and not _is_real(base):
        raise TypeError(f"base must be 2.0 or math.e, got {type(base).__name__}")
    if base not in (2.0, math.e):
        raise ValueError(f"base must be 2.0 or math.e, got {base}")
    _, rows, head_dim, out_dtype = _validate_common(
        partial_o, "partial_lse", partial_lse, (), sinks, split_counts, out, kv_split)
    fresh_out = out is None
    if fresh_out:
        out = partial_o.new_empty((rows, head_dim), dtype=out_dtype)
    out_lse = partial_o.new_empty((rows,), dtype=torch.float32) if return_lse else None
    _call(merge_lse_out, _merge_lse_impl, fresh_out, partial_o, partial_lse, float(base),
          sinks, split_counts, out, out_lse, kv_split or 0)
    return (out, out_lse) if return_lse else out
