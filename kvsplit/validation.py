"""Validation of a merge call's layout: the checks that need no memory address.

A layout is every tensor's dtype, shape, strides and device plus the scalars:
validated once, in full, before any launch (:class:`kvsplit.launches.LayoutLaunch`
runs these checks, and the launch table keeps one launch per layout). Rows
may be (rows,), (tokens, heads) or, for FlashAttention's combine, (batch,
seqlen, heads), with any strides but on head_dim. The checks of addresses
(alignment, aliasing) run on every call, in the binding (csrc/fast_call.cpp).
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional

import torch

from .config import (DEFAULT_OUT_DTYPES, DTYPE_PAIRS, FAMILIES, FP8_DTYPES, KVSPLIT,
                     LSE_FORMAT, MAXSUM_FORMAT, NO_CUDA_KERNELS, QUANT_GROUPS,
                     STATS_FORMAT_CODES, has_cuda_kernels, head_dim_rule, head_dim_supported)

MAXSUM, LSE = STATS_FORMAT_CODES[MAXSUM_FORMAT], STATS_FORMAT_CODES[LSE_FORMAT]
_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2
_FLOAT32_MAX = torch.finfo(torch.float32).max
_FLOAT32_TINY = torch.finfo(torch.float32).tiny  # the smallest normal float32
_STATS_DTYPES = (torch.float32,)
_COUNT_DTYPES = (torch.int32,)
# partial dtype -> the output dtypes it merges into, the default (DEFAULT_OUT_DTYPES) first.
_OUT_DTYPES: dict[torch.dtype, tuple[torch.dtype, ...]] = {
    getattr(torch, partial): tuple(getattr(torch, out) for out in
                                   dict.fromkeys([default] + [b for a, b in DTYPE_PAIRS
                                                              if a == partial]))
    for partial, default in DEFAULT_OUT_DTYPES.items()}
_PARTIAL_DTYPES = tuple(_OUT_DTYPES)
_FP8_DTYPES = tuple(getattr(torch, name) for name in FP8_DTYPES)
_SCALE_DTYPES = (torch.float32, torch.float8_e8m0fnu)
_INDPTR_DTYPES = (torch.int32, torch.int64)
_KV_SPLITS = FAMILIES[KVSPLIT]["kv_split"]


def _is_real(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def _type_error(name: str, value: object) -> TypeError:
    return TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def check_dense(name: str, value: torch.Tensor) -> None:
    """Refuses sparse, MKL-DNN and nested tensors: a merge reads and writes strided memory."""
    if value.layout is not torch.strided or value.is_nested:
        kind = "nested" if value.is_nested else str(value.layout).removeprefix("torch.")
        raise TypeError(f"{name} must be a dense (strided) tensor, got a {kind} tensor")


def _dtype_error(name: str, dtype: torch.dtype, dtypes: tuple[torch.dtype, ...]) -> TypeError:
    allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    return TypeError(f"{name} must have dtype {allowed}; got {str(dtype).removeprefix('torch.')}")


def _check_tensor(name: str, value: object, dtypes: tuple[torch.dtype, ...],
                  shape: tuple[int, ...], device: torch.device, unit_dim: Optional[int]) -> None:
    """Type, dtype, shape, device and unit stride of one argument."""
    if not isinstance(value, torch.Tensor):
        raise _type_error(name, value)
    check_dense(name, value)
    if value.dtype not in dtypes:
        raise _dtype_error(name, value.dtype, dtypes)
    if value.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but partial_o is on {device}")
    if unit_dim is not None and shape[unit_dim] > 1 and value.stride(unit_dim) != 1:
        raise ValueError(f"{name} must have unit stride on dim {unit_dim}, "
                         f"got strides {value.stride()}")


def _check_scalar(fmt: int, scalar: object) -> None:
    if fmt == MAXSUM:
        if type(scalar) is not float and not _is_real(scalar):
            raise TypeError(f"scale_log2 must be a real number, got {type(scalar).__name__}")
        if not (math.isfinite(scalar) and _FLOAT32_TINY <= scalar <= _FLOAT32_MAX):
            raise ValueError(f"scale_log2 must be positive and finite in float32 (a normal "
                             f"float32, {_FLOAT32_TINY:.3g} to {_FLOAT32_MAX:.3g}), got {scalar}")
    else:
        if type(scalar) is not float and not _is_real(scalar):
            raise TypeError(f"base must be 2.0 or math.e, got {type(scalar).__name__}")
        if scalar not in (2.0, math.e):
            raise ValueError(f"base must be 2.0 or math.e, got {scalar}")


_RANK_WORDS = {1: "3-D (num_splits, rows, head_dim)", 2: "4-D (num_splits, tokens, heads, head_dim)",
               3: "5-D (num_splits, batch, seqlen, heads, head_dim)"}
_PUBLIC_ROW_DIMS = (1, 2)


def _validate(fmt, partial_o, stats, scalar, sinks, split_counts, out, kv_split, *,
              row_dims=_PUBLIC_ROW_DIMS, out_dtype=None) -> torch.dtype:
    """Checks what needs no memory address; returns the output dtype (``out``'s, else
    ``out_dtype``, else the partials' default).

    ``row_dims``: how many dims the rows may take (1: rows; 2: tokens, heads;
    3: batch, seqlen, heads, for FlashAttention's combine layout).
    """
    _check_scalar(fmt, scalar)
    if not isinstance(partial_o, torch.Tensor):
        raise _type_error("partial_o", partial_o)
    check_dense("partial_o", partial_o)
    dtype = partial_o.dtype
    if dtype not in _OUT_DTYPES:
        raise _dtype_error("partial_o", dtype, _PARTIAL_DTYPES)
    shape = partial_o.shape
    if len(shape) - 2 not in row_dims:
        ranks = " or ".join(_RANK_WORDS[r] for r in row_dims)
        raise ValueError(f"partial_o must be {ranks}, got {len(shape)}-D")
    num_splits, *row_list, head_dim = shape
    row_shape = tuple(row_list)
    rows = math.prod(row_shape)
    dtype_name = str(dtype).removeprefix("torch.")
    if not head_dim_supported(head_dim, dtype_name):
        raise ValueError(f"partial_o: head_dim {head_dim} is not supported with {dtype_name} "
                         f"partials; use {head_dim_rule(dtype_name)}")
    if num_splits == 0 and rows > 0:
        raise ValueError("partial_o has num_splits = 0 but rows > 0: nothing to merge")
    last = len(shape) - 1
    if partial_o.stride(last) != 1 and head_dim > 1:
        raise ValueError(f"partial_o must have unit stride on dim {last}, got strides {partial_o.stride()}")
    device = partial_o.device
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"partial_o must be on a CPU or CUDA device, got {device}")

    stats_tail = (2,) if fmt == MAXSUM else ()
    _check_tensor(_stats_name(fmt), stats, _STATS_DTYPES, (num_splits,) + row_shape + stats_tail,
                  device, len(shape) - 1 if stats_tail else None)
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            raise _type_error("sinks", sinks)
        check_dense("sinks", sinks)
        if sinks.dtype != torch.float32:
            raise _dtype_error("sinks", sinks.dtype, _STATS_DTYPES)
        if sinks.dim() != 1 or sinks.numel() == 0:
            raise ValueError(f"sinks must be 1-D (heads,) with heads >= 1, got shape {tuple(sinks.shape)}")
        if len(row_shape) == 1 and rows % sinks.numel():
            raise ValueError(f"sinks: rows ({rows}) must be a multiple of heads ({sinks.numel()})")
        if len(row_shape) > 1 and sinks.numel() != row_shape[-1]:
            raise ValueError(f"sinks has {sinks.numel()} heads but partial_o has {row_shape[-1]}")
        _check_tensor("sinks", sinks, _STATS_DTYPES, tuple(sinks.shape), device, 0)
    if split_counts is not None:
        _check_tensor("split_counts", split_counts, _COUNT_DTYPES, row_shape, device, None)
        if not split_counts.is_contiguous():
            raise ValueError(f"split_counts must be contiguous (rows in order), got strides "
                             f"{split_counts.stride()}")

    if out_dtype is not None and out_dtype not in _OUT_DTYPES[dtype]:
        raise _dtype_error("out_dtype", out_dtype, _OUT_DTYPES[dtype])
    if out is None:
        out_dtype = out_dtype or _OUT_DTYPES[dtype][0]
    else:
        _check_tensor("out", out, _OUT_DTYPES[dtype], row_shape + (head_dim,), device,
                      len(row_shape))
        check_own_memory("out", out)
        if out_dtype is not None and out.dtype != out_dtype:
            raise ValueError(f"out has dtype {out.dtype} but out_dtype is {out_dtype}")
        out_dtype = out.dtype

    if kv_split is not None:
        if isinstance(kv_split, bool) or not isinstance(kv_split, numbers.Integral):
            raise TypeError(f"kv_split must be an int or None, got {type(kv_split).__name__}")
        if kv_split not in _KV_SPLITS:
            raise ValueError(f"kv_split must be one of {_KV_SPLITS} or None, got {kv_split}")
    if device.type == "cuda" and not has_cuda_kernels():
        raise RuntimeError(NO_CUDA_KERNELS)
    return out_dtype


def _check_grad(*tensors) -> None:
    """Raises if grad mode is on and an input requires grad (a merge has no backward)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError("kvsplit merges have no backward: call them under torch.no_grad() "
                           "or on tensors that do not require grad (.detach())")


def _stats_name(fmt: int) -> str:
    return "partial_stats" if fmt == MAXSUM else "partial_lse"


def _extent(tensor: Optional[torch.Tensor]) -> int:
    """Bytes from a tensor's first to past its last element (0: empty or absent)."""
    if tensor is None or not tensor.numel():
        return 0
    return (sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
            + 1) * tensor.dtype.itemsize


class Extras(NamedTuple):
    """What a general call adds to a layout: FP8 output scales (``out_scale`` per tensor,
    or ``group_scales`` written per ``quant_group`` elements, powers of two with
    ``ue8m0``), pass-through rows (tokens from ``pass_through_from`` on take the last
    split as it is), variable-length states (``indptr``; see :func:`varlen_view`),
    per-request ops of two splits (``request_starts``: int64 token offsets, one more than
    ``request_ops``: int64, per request 0 leave its rows as they are, 2 take split 1 as
    it is, else merge) and LSE stats read as (max, sum) pairs of normalised partials
    (``pair_stats``: each stats tensor is the pairs' max, their sum the next float)."""

    out_scale: Optional[torch.Tensor] = None
    group_scales: Optional[torch.Tensor] = None
    quant_group: Optional[int] = None
    ue8m0: bool = False
    pass_through_from: Optional[int] = None
    indptr: Optional[torch.Tensor] = None
    request_starts: Optional[torch.Tensor] = None
    request_ops: Optional[torch.Tensor] = None
    pair_stats: bool = False

    def meta(self) -> tuple:
        """What a layout's launch depends on (no addresses)."""
        return tuple(None if t is None else (t.dtype, t.shape, t.stride(), t.device)
                     if isinstance(t, torch.Tensor) else (type(t), t) for t in self)


NO_EXTRAS = Extras()


def _is_int(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Integral)


def _check_extras(extras: Extras, fmt: int, out_dtype: torch.dtype, row_shape: tuple,
                  head_dim: int, num_splits: int, heads: int, device: torch.device) -> None:
    """The general call's options against the layout (see :class:`Extras`)."""
    fp8 = out_dtype in _FP8_DTYPES
    if extras.out_scale is not None:
        if not fp8:
            raise ValueError(f"out_scale is for FP8 outputs; the output dtype is {out_dtype}")
        _check_tensor("out_scale", extras.out_scale, _STATS_DTYPES, tuple(extras.out_scale.shape)
                      if isinstance(extras.out_scale, torch.Tensor) else (1,), device, None)
        if extras.out_scale.numel() != 1:
            raise ValueError(f"out_scale must hold one float32 scale, got shape "
                             f"{tuple(extras.out_scale.shape)}")
    if extras.quant_group is not None and extras.group_scales is None:
        raise ValueError("quant_group needs group_scales, the tensor the per-group scales go to")
    if extras.group_scales is not None:
        if not fp8:
            raise ValueError(f"group_scales are for FP8 outputs; the output dtype is {out_dtype}")
        if extras.out_scale is not None:
            raise ValueError("give out_scale (one scale) or group_scales (one per group), not both")
        group = extras.quant_group
        if not _is_int(group) or group not in QUANT_GROUPS:
            raise ValueError(f"quant_group must be one of {QUANT_GROUPS}, got {group!r}")
        if head_dim % group:
            raise ValueError(f"quant_group {group} does not divide head_dim {head_dim}")
        _check_tensor("group_scales", extras.group_scales, _SCALE_DTYPES,
                      row_shape + (head_dim // group,), device, None)
    if not isinstance(extras.ue8m0, bool):
        raise TypeError(f"ue8m0 must be a bool, got {type(extras.ue8m0).__name__}")
    if extras.ue8m0 and extras.group_scales is None:
        raise ValueError("ue8m0 rounds per-group scales (group_scales) to powers of two; "
                         "this call has none")
    if extras.pass_through_from is not None:
        # (tokens, heads) rows: the tokens even where there are no heads.
        tokens = math.prod(row_shape) // heads if heads else math.prod(row_shape[:-1])
        if not _is_int(extras.pass_through_from):
            raise TypeError(f"pass_through_from must be an int, got "
                            f"{type(extras.pass_through_from).__name__}")
        if not 0 <= extras.pass_through_from <= tokens:
            raise ValueError(f"pass_through_from must be 0..{tokens} (the tokens), got "
                             f"{extras.pass_through_from}")
        if extras.indptr is not None:
            raise ValueError("pass_through_from and indptr cannot be combined")
    if (extras.request_starts is None) != (extras.request_ops is None):
        raise ValueError("request_starts and request_ops go together")
    if not isinstance(extras.pair_stats, bool):
        raise TypeError(f"pair_stats must be a bool, got {type(extras.pair_stats).__name__}")
    # The kernel that reads them (the Few family's TensorRT-LLM instance) takes two LSE splits.
    if extras.request_starts is not None or extras.pair_stats:
        if num_splits != 2 or extras.indptr is not None or extras.pass_through_from is not None:
            raise ValueError("per-request ops and pair stats merge two splits, without indptr "
                             "or pass_through_from")
        if fmt != LSE:
            raise ValueError("per-request ops and pair stats take LSE stats")
    if extras.request_starts is not None:
        for name in ("request_starts", "request_ops"):
            value = getattr(extras, name)
            if not isinstance(value, torch.Tensor):
                raise _type_error(name, value)
            check_dense(name, value)
            if value.dtype != torch.int64 or value.dim() != 1 or value.stride(0) != 1:
                raise ValueError(f"{name} must be a contiguous 1-D int64 tensor, got "
                                 f"{value.dtype} {tuple(value.shape)}")
            if value.device != device:
                raise ValueError(f"{name} is on {value.device} but partial_o is on {device}")
        if extras.request_starts.shape[0] != extras.request_ops.shape[0] + 1:
            raise ValueError(f"request_starts needs one more entry than request_ops, got "
                             f"{extras.request_starts.shape[0]} and {extras.request_ops.shape[0]}")


def _heads(row_shape: tuple, sinks) -> int:
    """Rows per token: the last row dim of (tokens, heads) layouts, else the sinks' count."""
    if len(row_shape) > 1:
        return row_shape[-1]
    return sinks.numel() if isinstance(sinks, torch.Tensor) and sinks.numel() else 1


def _store_bytes(partial_dtype: torch.dtype, out_dtype: torch.dtype) -> int:
    """The alignment of a thread's output store: the outputs of 16 bytes of partials, in
    accesses of at most 16 bytes."""
    return min(16, 16 // partial_dtype.itemsize * out_dtype.itemsize)


def misaligned_dim(tensor: torch.Tensor, unit: int) -> Optional[int]:
    """The first dim but the last (of more than one element) whose stride is not a whole
    number of ``unit`` bytes, or None: the kernels load and store whole vectors of a row."""
    size_of = tensor.element_size()
    for dim, (size, stride) in enumerate(zip(tensor.shape[:-1], tensor.stride()[:-1])):
        if size > 1 and (stride * size_of) % unit:
            return dim
    return None


def _check_strides(partial_o: torch.Tensor, out: Optional[torch.Tensor], out_dtype) -> None:
    dim = misaligned_dim(partial_o, 16)
    if dim is not None:
        raise ValueError(f"partial_o: stride {partial_o.stride(dim)} of dim {dim} is not a "
                         "multiple of 16 bytes")
    store_bytes = _store_bytes(partial_o.dtype, out_dtype)
    if out is not None and misaligned_dim(out, store_bytes) is not None:
        raise ValueError(f"out and each of its rows must be {store_bytes}-byte aligned")


def _meta(tensor) -> tuple:
    return (tensor.dtype, tensor.shape, tensor.stride(), tensor.device)


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` has ``a``'s dtype, shape, device and strides (on the dims of more
    than one element: a dim of one is read at index 0 whatever its stride)."""
    return (a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
            and all(size == 1 or sa == sb for size, sa, sb in zip(a.shape, a.stride(), b.stride())))


def check_own_memory(name: str, value: Optional[torch.Tensor]) -> None:
    """Refuses an output whose elements may share memory, which would have its stores race:
    a dim of more than one element at stride 0 (an expanded tensor), or strides that do
    not each step past everything the smaller ones span (rows closer than a row is long).
    An empty output has nothing to share."""
    if value is None:
        return
    check_dense(name, value)
    if value.numel() == 0:
        return
    span = 0  # how far the dims of smaller stride reach
    for stride, size in sorted((st, sz) for sz, st in zip(value.shape, value.stride()) if sz > 1):
        if stride == 0:
            raise ValueError(f"{name} has stride 0 on a dim of more than one element (strides "
                             f"{value.stride()}, an expanded tensor): an output needs memory "
                             f"of its own for each element")
        if stride <= span:
            raise ValueError(f"{name} has elements that share memory (shape "
                             f"{tuple(value.shape)}, strides {value.stride()}): an output "
                             f"needs memory of its own for each element")
        span += stride * (size - 1)


def _stack_view(name: str, parts) -> torch.Tensor:
    """A (num_splits, ...) view of part 0 with split stride 0, standing for the parts in
    validation (the real split stride is the parts' distance, known per call)."""
    if not parts:
        raise ValueError(f"{name} is an empty list: nothing to merge")
    first = parts[0]
    for i, part in enumerate(parts):
        if not isinstance(part, torch.Tensor):
            raise _type_error(f"{name}[{i}]", part)
        check_dense(f"{name}[{i}]", part)
        if not same_layout(first, part):
            raise ValueError(f"{name}[{i}] must have the dtype, shape, strides and device of "
                             f"{name}[0]")
    return first.as_strided((len(parts),) + tuple(first.shape), (0,) + first.stride())


def varlen_view(fmt, partial_o, stats, indptr, names=None):
    """Variable-length states as a layout: ``partial_o`` (nnz, [heads,] head_dim) and
    ``stats`` (nnz, [heads][, 2]) become (nnz, tokens, ...) views whose token stride is 0
    (a row's states are found through ``indptr``, tokens = len(indptr) - 1). ``names``:
    the caller's names of partial_o and the stats in errors (``{"partial_o": ...,
    "stats": ...}``)."""
    given = dict(names or ())
    o_name = given.get("partial_o", "partial_o")
    s_name = given.get("stats", _stats_name(fmt))
    for name, value in (("indptr", indptr), (o_name, partial_o), (s_name, stats)):
        if not isinstance(value, torch.Tensor):
            raise _type_error(name, value)
        check_dense(name, value)
    if indptr.dtype not in _INDPTR_DTYPES or indptr.dim() != 1 or indptr.shape[0] < 1:
        raise ValueError(f"indptr must be a 1-D int32 or int64 tensor of tokens + 1 offsets, got "
                         f"{indptr.dtype} {tuple(indptr.shape)}")
    if partial_o.dim() not in (2, 3):
        raise ValueError(f"with indptr, {o_name} must be (nnz, head_dim) or (nnz, heads, "
                         f"head_dim), got {partial_o.dim()}-D")
    want = tuple(partial_o.shape[:-1]) + ((2,) if fmt == MAXSUM else ())
    if tuple(stats.shape) != want:
        dims = {(3, False): "(nnz, heads)", (2, False): "(nnz,)", (3, True): "(nnz, heads, 2)",
                (2, True): "(nnz, 2)"}[partial_o.dim(), fmt == MAXSUM]
        raise ValueError(f"with indptr, {s_name} must be {dims}, {want} for {o_name} "
                         f"{tuple(partial_o.shape)}, got {tuple(stats.shape)}")
    if indptr.device != partial_o.device:
        raise ValueError(f"indptr is on {indptr.device} but {o_name} is on {partial_o.device}")
    if indptr.stride(0) != 1:
        raise ValueError("indptr must be contiguous")
    tokens = indptr.shape[0] - 1
    nnz = partial_o.shape[0]
    if not (indptr.is_cuda and torch.cuda.is_current_stream_capturing()):
        # On the host (a copy for CUDA tensors); in a graph capture the kernel clamps instead.
        offsets = indptr.tolist()
        if offsets[0] < 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
            raise ValueError("indptr must be non-decreasing from 0 or more")
        if offsets[-1] > nnz:
            raise ValueError(f"indptr ends at {offsets[-1]}, past the {nnz} states of {o_name}")
    if nnz == 0:  # no states: every range is empty; one empty state stands in for them
        partial_o = partial_o.new_zeros((1,) + tuple(partial_o.shape[1:]))
        empty = stats.new_full((1,) + tuple(stats.shape[1:]), -math.inf)
        if fmt == MAXSUM and empty.dim() > 1:
            empty[..., 1] = 0  # (max, sum) = (-inf, 0)
        stats = empty

    def view(t):
        return t.as_strided((t.shape[0], tokens) + tuple(t.shape[1:]),
                            (t.stride(0), 0) + tuple(t.stride()[1:]))

    return view(partial_o), view(stats), max(1, round(nnz / max(tokens, 1)))


def _check_parts(fmt, partial_o, stats, parts: int):
    """Partials and stats held in ``parts`` tensors each (0: one stacked tensor each) as
    stacked views for validation (:func:`_stack_view`)."""
    if parts:
        partial_o = _stack_view("partial_o", partial_o)
        if not isinstance(stats, (list, tuple)) or len(stats) != parts:
            raise ValueError(f"{_stats_name(fmt)} must be a list of {parts} tensors, "
                             "one per part of partial_o")
        stats = _stack_view(_stats_name(fmt), stats)
    elif isinstance(stats, (list, tuple)):
        raise _type_error(_stats_name(fmt), stats)
    return partial_o, stats


def _check_row_mask(row_mask, partial_o: torch.Tensor) -> int:
    """A row mask's checks; returns its stride (1 when there is none)."""
    if row_mask is None:
        return 1
    if not isinstance(row_mask, torch.Tensor):
        raise _type_error("mask", row_mask)
    check_dense("mask", row_mask)
    tokens = math.prod(partial_o.shape[1:-2]) if partial_o.dim() > 3 else None
    if row_mask.dtype not in (torch.bool, torch.uint8) or row_mask.dim() != 1 or (
            tokens is not None and row_mask.shape[0] != tokens):
        raise ValueError(f"mask must be a bool tensor of shape ({tokens},), got "
                         f"{row_mask.dtype} {tuple(row_mask.shape)}")
    if row_mask.device != partial_o.device:
        raise ValueError(f"mask is on {row_mask.device} but partial_o is on "
                         f"{partial_o.device}")
    return row_mask.stride(0)


def _check_in_place(parts: int, partial_o, stats, out, out_stats) -> None:
    """An in-place export writes ``out`` and ``out_stats`` over part 0 of the parts."""
    if not (parts and out is not None and out_stats is not None
            and _meta(out) == _meta(partial_o[0]) and _meta(out_stats) == _meta(stats[0])):
        raise ValueError("an in-place merge writes out and out_lse over part 0, which they "
                         "must match in dtype, shape and strides")
