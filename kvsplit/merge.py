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


def _require_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _require_dtype(name: str, tensor: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}; got {str(tensor.dtype)[6:]}")


def _require_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")


def _require_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but partial_o is on {device}")


def _require_unit_stride(name: str, tensor: torch.Tensor, dim: int) -> None:
    if tensor.shape[dim] > 1 and tensor.stride(dim) != 1:
        raise ValueError(f"{name} must have unit stride on dim {dim}, got strides {tensor.stride()}")


def _validate_common(partial_o, stats, stats_tail, sinks, split_counts, out, kv_split):
    """Checks what needs no memory address; returns (num_splits, rows, head_dim, out dtype)."""
    partial_o = _require_tensor("partial_o", partial_o)
    _require_dtype("partial_o", partial_o, tuple(_DTYPE_CODES))
    if partial_o.dim() != 3:
        raise ValueError(f"partial_o must be 3-D (num_splits, rows, head_dim), got {partial_o.dim()}-D")
    num_splits, rows, head_dim = partial_o.shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"partial_o: head_dim {head_dim} is not supported; use one of {HEAD_DIMS}")
    if num_splits == 0 and rows > 0:
        raise ValueError("partial_o has num_splits = 0 but rows > 0: nothing to merge")
    _require_unit_stride("partial_o", partial_o, 2)
    device = partial_o.device

    stats = _require_tensor(stats[0], stats[1])
    name = "partial_stats" if stats_tail else "partial_lse"
    _require_dtype(name, stats, (torch.float32,))
    _require_shape(name, stats, (num_splits, rows) + stats_tail)
    _require_device(name, stats, device)
    if stats_tail:
        _require_unit_stride(name, stats, 2)

    if sinks is not None:
        sinks = _require_tensor("sinks", sinks)
        _require_dtype("sinks", sinks, (torch.float32,))
        if sinks.dim() != 1 or sinks.numel() == 0:
            raise ValueError(f"sinks must be 1-D (heads,) with heads >= 1, got shape {tuple(sinks.shape)}")
        if rows % sinks.numel():
            raise ValueError(f"sinks: rows ({rows}) must be a multiple of heads ({sinks.numel()})")
        _require_device("sinks", sinks, device)
        _require_unit_stride("sinks", sinks, 0)
    if split_counts is not None:
        split_counts = _require_tensor("split_counts", split_counts)
        _require_dtype("split_counts", split_counts, (torch.int32,))
        _require_shape("split_counts", split_counts, (rows,))
        _require_device("split_counts", split_counts, device)
        _require_unit_stride("split_counts", split_counts, 0)

    out_dtype = partial_o.dtype if partial_o.dtype in _OUT_DTYPES else torch.bfloat16
    if out is not None:
        out = _require_tensor("out", out)
        allowed = (partial_o.dtype,) if partial_o.dtype in _OUT_DTYPES else _OUT_DTYPES
        _require_dtype("out", out, allowed)
        _require_shape("out", out, (rows, head_dim))
        _require_device("out", out, device)
        _require_unit_stride("out", out, 1)
        out_dtype = out.dtype

    if kv_split is not None:
        if isinstance(kv_split, bool) or not isinstance(kv_split, numbers.Integral):
            raise TypeError(f"kv_split must be an int or None, got {type(kv_split).__name__}")
        if kv_split not in dispatcher.KV_SPLITS:
            raise ValueError(f"kv_split must be one of {dispatcher.KV_SPLITS} or None, got {kv_split}")
    return num_splits, rows, head_dim, out_dtype


def _byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    start = tensor.data_ptr()
    extent = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return start, start + (extent + 1) * tensor.element_size()


def _check_alignment(partial_o, stats, out) -> None:
    """Checks alignment, which needs real addresses (not fake tensors)."""
    elem = partial_o.element_size()
    if partial_o.data_ptr() % 16:
        raise ValueError("partial_o must be 16-byte aligned")
    for dim in (0, 1):
        if partial_o.shape[dim] > 1 and (partial_o.stride(dim) * elem) % 16:
            raise ValueError(f"partial_o: stride {partial_o.stride(dim)} of dim {dim} is not a "
                             "multiple of 16 bytes")
    # Each thread stores the outputs of 16 bytes of partials in one access.
    store_bytes = 16 // elem * out.element_size()
    if out.data_ptr() % store_bytes or (out.shape[0] > 1 and (out.stride(0) * out.element_size()) % store_bytes):
        raise ValueError(f"out and each of its rows must be {store_bytes}-byte aligned")


def _check_aliasing(partial_o, stats, sinks, split_counts, out, out_stats) -> None:
    """Raises if an output overlaps an input (or the other output)."""
    stats_name = "partial_stats" if stats.dim() == 3 else "partial_lse"
    inputs = {"partial_o": partial_o, stats_name: stats, "sinks": sinks,
              "split_counts": split_counts}
    written = {"out": out, "out_stats": out_stats}
    for out_name, target in written.items():
        if target is None or target.numel() == 0:
            continue
        lo, hi = _byte_span(target)
        storage = target.untyped_storage().data_ptr()
        for in_name, source in list(inputs.items()):
            # Only views of one allocation can overlap: compare storages first.
            if (source is None or source.numel() == 0
                    or source.untyped_storage().data_ptr() != storage):
                continue
            src_lo, src_hi = _byte_span(source)
            if lo < src_hi and src_lo < hi:
                raise ValueError(f"{out_name} overlaps {in_name}: outputs must not alias inputs")
        inputs[out_name] = target


def _launch(stats_format: int, partial_o, stats, sinks, split_counts, out, out_stats,
            log2_scale: float, export_scale: float, kv_split: int, fresh_out: bool = False,
            config: Optional[Config] = None) -> None:
    """Validates addresses, chooses the kernel config and launches.

    ``kv_split`` (0: none) is the caller's request, which the dispatcher
    constrains; a ``config`` (the tuner's candidates, already valid) runs as given.
    """
    _check_alignment(partial_o, stats, out)
    if not fresh_out:  # outputs allocated by the wrapper cannot alias anything
        _check_aliasing(partial_o, stats, sinks, split_counts, out, out_stats)
    num_splits, rows, head_dim = partial_o.shape
    if rows == 0:
        return
    facts = device_facts(partial_o.device)
    family, slices, k, depth = config if config is not None else dispatcher.choose(
        facts, partial_o.device, head_dim, partial_o.dtype, out.dtype, stats_format,
        num_splits, rows, kv_split or None)
    args = (
        partial_o.data_ptr(), stats.data_ptr(),
        split_counts.data_ptr() if split_counts is not None else 0,
        sinks.data_ptr() if sinks is not None else 0,
        out.data_ptr(), out_stats.data_ptr() if out_stats is not None else 0,
        num_splits, rows, sinks.numel() if sinks is not None else 1,
        partial_o.stride(0), partial_o.stride(1), stats.stride(0), stats.stride(1), out.stride(0),
        log2_scale, export_scale, head_dim, _DTYPE_CODES[partial_o.dtype],
        _DTYPE_CODES[out.dtype], stats_format, family, slices, k, depth,
    )
    if facts.is_cuda:
        if not _native.has_cuda_kernels():
            raise RuntimeError("this kvsplit build has no CUDA kernels (no CUDA compiler at build time)")
        stream = torch._C._cuda_getCurrentRawStream(partial_o.get_device())
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
    if isinstance(scale_log2, bool) or not isinstance(scale_log2, numbers.Real):
        raise TypeError(f"scale_log2 must be a real number, got {type(scale_log2).__name__}")
    if not (math.isfinite(scale_log2) and 0 < scale_log2 <= _FLOAT32_MAX):
        raise ValueError(f"scale_log2 must be positive and finite in float32, got {scale_log2}")
    _, rows, head_dim, out_dtype = _validate_common(
        partial_o, ("partial_stats", partial_stats), (2,), sinks, split_counts, out, kv_split)
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
    if isinstance(base, bool) or not isinstance(base, numbers.Real):
        raise TypeError(f"base must be 2.0 or math.e, got {type(base).__name__}")
    if base not in (2.0, math.e):
        raise ValueError(f"base must be 2.0 or math.e, got {base}")
    _, rows, head_dim, out_dtype = _validate_common(
        partial_o, ("partial_lse", partial_lse), (), sinks, split_counts, out, kv_split)
    fresh_out = out is None
    if fresh_out:
        out = partial_o.new_empty((rows, head_dim), dtype=out_dtype)
    out_lse = partial_o.new_empty((rows,), dtype=torch.float32) if return_lse else None
    _call(merge_lse_out, _merge_lse_impl, fresh_out, partial_o, partial_lse, float(base),
          sinks, split_counts, out, out_lse, kv_split or 0)
    return (out, out_lse) if return_lse else out
