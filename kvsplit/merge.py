"""The public merge functions: validate once per layout, allocate, launch.

The first call of a layout (every tensor's dtype, shape, strides and device,
the scalars and the ``KVSPLIT_*`` variables) validates it in full, asks the
dispatcher for the kernel config and keeps a launch plan for it. Every
later call of that layout reads the same metadata again to find the plan,
so a call whose tensors changed in any way is validated again; what depends
on addresses (alignment, aliasing) is checked on every call.

Both functions are also registered as ``torch.library`` custom ops
(``kvsplit::merge_maxsum_out`` and ``kvsplit::merge_lse_out``, which write
into preallocated outputs), so they trace under ``torch.compile`` and capture
into CUDA graphs. Eager calls skip the op dispatcher.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from . import _kernel
from .config import DTYPE_PAIRS, HEAD_DIMS, STATS_FORMAT_CODES, has_cuda_kernels
from .dispatch import dispatcher as _dispatch
from .dispatch.constraints import in_place_config
from .dispatch.device import device_facts
from .dispatch.keys import scattered_stats

MAXSUM, LSE = STATS_FORMAT_CODES["maxsum"], STATS_FORMAT_CODES["lse"]
_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2
_FLOAT32_MAX = torch.finfo(torch.float32).max
_STATS_DTYPES = (torch.float32,)
_COUNT_DTYPES = (torch.int32,)
# partial dtype -> the output dtypes compiled for it (the first is the default).
_OUT_DTYPES: dict[torch.dtype, tuple[torch.dtype, ...]] = {}
for _partial, _out in DTYPE_PAIRS:
    _OUT_DTYPES.setdefault(getattr(torch, _partial), ())
    _OUT_DTYPES[getattr(torch, _partial)] += (getattr(torch, _out),)
for _partial, _outs in _OUT_DTYPES.items():  # 16-bit partials produce their own dtype
    _OUT_DTYPES[_partial] = tuple(sorted(_outs, key=lambda d: (d != _partial, str(d))))
_PARTIAL_DTYPES = tuple(_OUT_DTYPES)
_KV_SPLITS = _dispatch.KV_SPLITS
_plans = _dispatch.dispatcher.plans
_read_environment = _dispatch.read_environment
_is_compiling = torch.compiler.is_compiling


def _is_real(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def _type_error(name: str, value: object) -> TypeError:
    return TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _dtype_error(name: str, dtype: torch.dtype, dtypes: tuple[torch.dtype, ...]) -> TypeError:
    allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    return TypeError(f"{name} must have dtype {allowed}; got {str(dtype).removeprefix('torch.')}")


def _check_tensor(name: str, value: object, dtypes: tuple[torch.dtype, ...],
                  shape: tuple[int, ...], device: torch.device, unit_dim: Optional[int]) -> None:
    """Type, dtype, shape, device and unit stride of one argument."""
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


def _check_scalar(fmt: int, scalar: object) -> None:
    if fmt == MAXSUM:
        if type(scalar) is not float and not _is_real(scalar):
            raise TypeError(f"scale_log2 must be a real number, got {type(scalar).__name__}")
        if not (math.isfinite(scalar) and 0 < scalar <= _FLOAT32_MAX):
            raise ValueError(f"scale_log2 must be positive and finite in float32, got {scalar}")
    else:
        if type(scalar) is not float and not _is_real(scalar):
            raise TypeError(f"base must be 2.0 or math.e, got {type(scalar).__name__}")
        if scalar not in (2.0, math.e):
            raise ValueError(f"base must be 2.0 or math.e, got {scalar}")


_RANK_WORDS = {1: "3-D (num_splits, rows, head_dim)", 2: "4-D (num_splits, tokens, heads, head_dim)",
               3: "5-D (num_splits, batch, seqlen, heads, head_dim)"}
_PUBLIC_ROW_DIMS = (1, 2)


def _validate(fmt, partial_o, stats, scalar, sinks, split_counts, out, kv_split, *,
              row_dims=_PUBLIC_ROW_DIMS) -> torch.dtype:
    """Checks what needs no memory address; returns the output dtype.

    ``row_dims``: how many dims the rows may take (1: rows; 2: tokens, heads;
    3: batch, seqlen, heads, for FlashAttention's combine layout).
    """
    _check_scalar(fmt, scalar)
    if not isinstance(partial_o, torch.Tensor):
        raise _type_error("partial_o", partial_o)
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
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"partial_o: head_dim {head_dim} is not supported; use one of {HEAD_DIMS}")
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
        _check_tensor("split_counts", split_counts, _COUNT_DTYPES, row_shape, device, 0)
        if not split_counts.is_contiguous():
            raise ValueError(f"split_counts must be contiguous (rows in order), got strides "
                             f"{split_counts.stride()}")

    if out is None:
        out_dtype = _OUT_DTYPES[dtype][0]
    else:
        _check_tensor("out", out, _OUT_DTYPES[dtype], row_shape + (head_dim,), device,
                      len(row_shape))
        out_dtype = out.dtype

    if kv_split is not None:
        if isinstance(kv_split, bool) or not isinstance(kv_split, numbers.Integral):
            raise TypeError(f"kv_split must be an int or None, got {type(kv_split).__name__}")
        if kv_split not in _KV_SPLITS:
            raise ValueError(f"kv_split must be one of {_KV_SPLITS} or None, got {kv_split}")
    if device.type == "cuda" and not has_cuda_kernels():
        raise RuntimeError("this kvsplit build has no CUDA kernels (no CUDA compiler at build time)")
    return out_dtype


def _stats_name(fmt: int) -> str:
    return "partial_stats" if fmt == MAXSUM else "partial_lse"


def _extent(tensor: Optional[torch.Tensor]) -> int:
    """Bytes from a tensor's first to past its last element (0: empty or absent)."""
    if tensor is None or not tensor.numel():
        return 0
    return (sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
            + 1) * tensor.dtype.itemsize


class _LayoutPlan:
    """What a layout's calls share: the launch plan and the byte extents and alignments."""

    __slots__ = ("kernel", "rows", "out_shape", "out_dtype", "stats_shape", "device",
                 "store_bytes", "extents", "log2_scale", "cacheable")

    def __init__(self, fmt, partial_o, stats, scalar, sinks, split_counts, out, return_stats,
                 kv_split, *, out_stats=None, empty_stat=None, stats_in_place=False,
                 row_dims=_PUBLIC_ROW_DIMS):
        """``out_stats``, ``empty_stat`` and ``stats_in_place`` are kvsplit.compat's: a given
        exported-stats tensor (any strides), a stat that reads as empty, and an export
        into split 0's stats (see params.h)."""
        out_dtype = _validate(fmt, partial_o, stats, scalar, sinks, split_counts, out, kv_split,
                              row_dims=row_dims)
        num_splits, *row_list, head_dim = partial_o.shape
        row_shape = tuple(row_list)
        rows = math.prod(row_shape)
        _check_strides(partial_o, out, out_dtype)
        device = partial_o.device
        self.rows, self.device, self.out_dtype = rows, device, out_dtype
        self.out_shape = row_shape + (head_dim,)
        self.stats_shape = row_shape + ((2,) if fmt == MAXSUM else ())
        if out_stats is not None:
            _check_tensor("out_stats" if fmt == MAXSUM else "out_lse", out_stats, _STATS_DTYPES,
                          self.stats_shape, device, len(row_shape) if fmt == MAXSUM else None)
        # Each thread stores the outputs of 16 bytes of partials in one access.
        self.store_bytes = 16 // partial_o.dtype.itemsize * out_dtype.itemsize
        out_like = out if out is not None else torch.empty(self.out_shape, dtype=out_dtype,
                                                           device="meta")
        self.extents = (_extent(partial_o), _extent(stats), _extent(split_counts), _extent(sinks),
                        _extent(out_like),
                        _extent(out_stats) if out_stats is not None
                        else 4 * math.prod(self.stats_shape))
        if fmt == MAXSUM:
            self.log2_scale, export_scale = None, _LN2
        else:
            self.log2_scale = 1.0 if scalar == 2.0 else _LOG2E
            export_scale = 1.0 if scalar == 2.0 else _LN2
        self.kernel, self.cacheable = None, True
        if rows:
            facts = device_facts(device)
            scattered = scattered_stats(fmt == MAXSUM, row_shape,
                                        stats.stride()[1:1 + len(row_shape)])
            config, self.cacheable = _dispatch.choose_for_plan(
                facts, device, head_dim, partial_o.dtype, out_dtype, fmt, num_splits, rows,
                kv_split or None, scattered)
            if stats_in_place:
                config = in_place_config(config, head_dim=head_dim,
                                         elem_bytes=partial_o.dtype.itemsize, rows=rows,
                                         num_splits=num_splits,
                                         sm_count=facts.sm_count if facts.is_cuda else None)
            self.kernel = _kernel.Plan(config, fmt, partial_o, stats, out_like, sinks,
                                       export_scale, sm_count=facts.sm_count,
                                       pdl=_dispatch.pdl_enabled(), out_stats=out_stats,
                                       empty_stat=empty_stat, stats_in_place=stats_in_place)


def _check_strides(partial_o: torch.Tensor, out: Optional[torch.Tensor], out_dtype) -> None:
    elem = partial_o.dtype.itemsize
    shape, strides = partial_o.shape, partial_o.stride()
    for dim in range(len(shape) - 1):
        if shape[dim] > 1 and (strides[dim] * elem) % 16:
            raise ValueError(f"partial_o: stride {strides[dim]} of dim {dim} is not a "
                             "multiple of 16 bytes")
    store_bytes = 16 // elem * out_dtype.itemsize
    if out is not None and any(size > 1 and (stride * out_dtype.itemsize) % store_bytes
                               for size, stride in zip(out.shape[:-1], out.stride()[:-1])):
        raise ValueError(f"out and each of its rows must be {store_bytes}-byte aligned")


def _layout_key(fmt, partial_o, stats, scalar, sinks, split_counts, out, return_stats, kv_split):
    """Everything that validation and the plan depend on, except addresses and the maxsum scale."""
    return (fmt, partial_o.dtype, partial_o.shape, partial_o.stride(), partial_o.device,
            stats.dtype, stats.shape, stats.stride(), stats.device,
            None if out is None else (out.dtype, out.shape, out.stride(), out.device),
            None if sinks is None else (sinks.dtype, sinks.shape, sinks.stride(), sinks.device),
            None if split_counts is None else (split_counts.dtype, split_counts.shape,
                                               split_counts.stride(), split_counts.device),
            None if fmt == MAXSUM else scalar, bool(return_stats), kv_split, type(kv_split),
            _read_environment())


def _plan(fmt, partial_o, stats, scalar, sinks, split_counts, out, return_stats, kv_split):
    try:
        key = _layout_key(fmt, partial_o, stats, scalar, sinks, split_counts, out, return_stats,
                          kv_split)
        plan = _plans.get(key)
    except (AttributeError, TypeError):  # not tensors, or an unhashable scalar: validation says
        key = plan = None
    if plan is None:
        plan = _LayoutPlan(fmt, partial_o, stats, scalar, sinks, split_counts, out, return_stats,
                           kv_split)
        if key is not None and plan.cacheable:
            _plans[key] = plan
    return plan


def _check_grad(*tensors) -> None:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError("kvsplit merges have no backward: call them under torch.no_grad() "
                           "or on tensors that do not require grad (.detach())")


# The order of the addresses of a launch (see _kernel.Plan.launch).
_NAMES = ("partial_o", None, "split_counts", "sinks", "out", "out_stats")


def _check_aliasing(fmt: int, plan: _LayoutPlan, addresses: list[int]) -> None:
    """Raises if an output (out, out_stats) overlaps an input or the other output."""
    extents = plan.extents
    for target in (4, 5):
        lo = addresses[target]
        if not lo or not extents[target]:
            continue
        hi = lo + extents[target]
        for source in range(target):
            start = addresses[source]
            if start and extents[source] and start < hi and lo < start + extents[source]:
                name = _NAMES[source] or _stats_name(fmt)
                raise ValueError(f"{_NAMES[target]} overlaps {name}: outputs must not alias inputs")


def _launch(plan: _LayoutPlan, fmt, partial_o, stats, scalar, sinks, split_counts, out,
            out_stats, fresh_out: bool) -> None:
    """The eager merge into ``out`` (and ``out_stats``) with the layout's plan."""
    o_addr, out_addr = partial_o.data_ptr(), out.data_ptr()
    if o_addr % 16:
        raise ValueError("partial_o must be 16-byte aligned")
    if out_addr % plan.store_bytes:
        raise ValueError(f"out and each of its rows must be {plan.store_bytes}-byte aligned")
    s_addr = stats.data_ptr()
    c_addr = 0 if split_counts is None else split_counts.data_ptr()
    k_addr = 0 if sinks is None else sinks.data_ptr()
    os_addr = 0 if out_stats is None else out_stats.data_ptr()
    if not fresh_out or os_addr:  # outputs allocated here cannot alias anything
        extents = plan.extents
        end = out_addr + extents[4]
        if (c_addr or k_addr or os_addr or (extents[4] and (
                (o_addr < end and out_addr < o_addr + extents[0])
                or (s_addr < end and out_addr < s_addr + extents[1])))):
            _check_aliasing(fmt, plan, [o_addr, s_addr, c_addr, k_addr, out_addr, os_addr])
    if plan.kernel is not None:
        plan.kernel.launch(o_addr, s_addr, c_addr, k_addr, out_addr, os_addr,
                           plan.log2_scale or scalar)


def _merge(fmt, partial_o, stats, scalar, sinks, split_counts, out, return_stats, kv_split):
    if _is_compiling():  # traced: the custom op runs the eager path with real tensors
        out_dtype = _validate(fmt, partial_o, stats, scalar, sinks, split_counts, out, kv_split)
        row_shape = tuple(partial_o.shape[1:-1])
        if out is None:
            out = partial_o.new_empty(tuple(partial_o.shape[1:]), dtype=out_dtype)
        out_stats = (partial_o.new_empty(row_shape + ((2,) if fmt == MAXSUM else ()),
                                         dtype=torch.float32) if return_stats else None)
        op = merge_maxsum_out if fmt == MAXSUM else merge_lse_out
        op(partial_o, stats, float(scalar), sinks, split_counts, out, out_stats, kv_split or 0)
        return (out, out_stats) if return_stats else out
    if fmt == MAXSUM and not (type(scalar) is float and 0 < scalar <= _FLOAT32_MAX):
        _check_scalar(fmt, scalar)
        scalar = float(scalar)
    plan = _plan(fmt, partial_o, stats, scalar, sinks, split_counts, out, return_stats, kv_split)
    if partial_o.requires_grad or stats.requires_grad or (sinks is not None and sinks.requires_grad):
        _check_grad(partial_o, stats, sinks)
    fresh_out = out is None
    if fresh_out:
        out = torch.empty(plan.out_shape, dtype=plan.out_dtype, device=plan.device)
    out_stats = (torch.empty(plan.stats_shape, dtype=torch.float32, device=plan.device)
                 if return_stats else None)
    _launch(plan, fmt, partial_o, stats, scalar, sinks, split_counts, out, out_stats, fresh_out)
    return (out, out_stats) if return_stats else out


def _merge_into(fmt, partial_o, stats, scalar, sinks, split_counts, out, out_stats,
                kv_split) -> None:
    """The custom ops' eager body: ``out`` (and ``out_stats``) given; ``kv_split`` 0 = choose."""
    kv_split = kv_split or None
    plan = _plan(fmt, partial_o, stats, scalar, sinks, split_counts, out, out_stats is not None,
                 kv_split)
    _launch(plan, fmt, partial_o, stats, scalar, sinks, split_counts, out, out_stats, False)


@torch.library.custom_op("kvsplit::merge_maxsum_out", mutates_args=("out", "out_stats"))
def merge_maxsum_out(partial_o: torch.Tensor, partial_stats: torch.Tensor, scale_log2: float,
                     sinks: Optional[torch.Tensor], split_counts: Optional[torch.Tensor],
                     out: torch.Tensor, out_stats: Optional[torch.Tensor], kv_split: int) -> None:
    """Custom op behind :func:`merge_maxsum` (writes into ``out``; ``kv_split`` 0 = choose)."""
    _merge_into(MAXSUM, partial_o, partial_stats, scale_log2, sinks, split_counts, out, out_stats,
                kv_split)


@torch.library.custom_op("kvsplit::merge_lse_out", mutates_args=("out", "out_lse"))
def merge_lse_out(partial_o: torch.Tensor, partial_lse: torch.Tensor, base: float,
                  sinks: Optional[torch.Tensor], split_counts: Optional[torch.Tensor],
                  out: torch.Tensor, out_lse: Optional[torch.Tensor], kv_split: int) -> None:
    """Custom op behind :func:`merge_lse` (writes into ``out``; ``kv_split`` 0 = choose)."""
    _merge_into(LSE, partial_o, partial_lse, base, sinks, split_counts, out, out_lse, kv_split)


@merge_maxsum_out.register_fake
def _(partial_o, partial_stats, scale_log2, sinks, split_counts, out, out_stats, kv_split):
    return None


@merge_lse_out.register_fake
def _(partial_o, partial_lse, base, sinks, split_counts, out, out_lse, kv_split):
    return None


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
    non-empty split is 0 with stats (-inf, 0). No input may require grad
    while grad mode is on (there is no backward).
    """
    return _merge(MAXSUM, partial_o, partial_stats, scale_log2, sinks, split_counts, out,
                  return_stats, kv_split)


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
    return _merge(LSE, partial_o, partial_lse, base, sinks, split_counts, out, return_lse,
                  kv_split)
