"""The public merge functions: validate once per layout, allocate, launch.

The first call of a layout (every tensor's dtype, shape, strides and device,
the scalars and the ``KVSPLIT_*`` variables) validates it in full
(:mod:`kvsplit.validation`), asks the dispatcher for the kernel config and keeps
its launch in the launch table (:mod:`kvsplit.launches`). Every later call of
that layout reads the same metadata again to find the launch, so a call whose tensors changed in any way is
validated again; what depends on addresses (alignment, aliasing) is checked on
every call. A call without options (no ``out_dtype``, FP8 scales, pass-through
rows or ``indptr``) whose layout was seen before, stacked or in two parts,
with ``out`` given or allocated, exporting its stats or not, takes the
binding's per-call path (csrc/fast_call.cpp), which reads the same metadata in
C through torch's DLPack exchange table, makes the same per-call checks and
launches; any call it does not serve comes back here. Parts held in separate
tensors (a list) and calls with options go through
:func:`kvsplit._call.merge_call`, the adapters' entry.

Both functions are also registered as ``torch.library`` custom ops
(``kvsplit::merge_maxsum_out`` and ``kvsplit::merge_lse_out``, which write
into preallocated outputs), so they trace under ``torch.compile`` and capture
into CUDA graphs. Eager calls skip the op dispatcher.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor

from . import _kernel
from ._call import merge_call
from .dispatch.dispatcher import config_for_layout, read_environment as _read_environment
from .launches import LayoutLaunch
from .launches import table as _launches
from .validation import (_FLOAT32_MAX, _FLOAT32_TINY, _LN2, _OUT_DTYPES, LSE, MAXSUM, NO_EXTRAS,
                         Extras, _check_grad, _check_scalar, _validate)

_current_stream = _kernel.current_stream
_call_fast, _call_add = _kernel.call_fast, _kernel.call_add
_is_compiling = torch.compiler.is_compiling

# The public calls' forms: stacked partials (partial_o, stats, scalar, sinks, split_counts,
# out, out_stats, kv_split) and two parts held apart (o_0, o_1, stats_0, stats_1, scalar,
# ...); out_stats is the exported stats that return_stats allocates (None without). The
# maxsum scale is per call, the LSE base keys the layout.
_R = _kernel.ROLES
_DEFAULT_OUT = {dtype: outs[0] for dtype, outs in _OUT_DTYPES.items()}
_TAIL = [_R.SINKS, _R.SPLIT_COUNTS, _R.OUT, _R.OUT_STATS, _R.KEY]
_SCALARS = ((MAXSUM, _R.SCALE), (LSE, _R.KEY))
_FORMS = {fmt: _kernel.call_form([_R.PARTIAL_O, _R.STATS, scalar, *_TAIL])
          for fmt, scalar in _SCALARS}
_PART_FORMS = {fmt: _kernel.call_form([_R.PARTIAL_O, _R.PARTIAL_O, _R.STATS, _R.STATS, scalar,
                                       *_TAIL])
               for fmt, scalar in _SCALARS}


def _two_parts(partial_o, stats) -> bool:
    return (type(partial_o) in (list, tuple) and len(partial_o) == 2
            and type(stats) in (list, tuple) and len(stats) == 2)


def _check_return(fmt, value) -> None:
    """``return_lse`` / ``return_stats`` is a bool (a string such as "no" is truthy)."""
    if value is not True and value is not False:
        name = "return_stats" if fmt == MAXSUM else "return_lse"
        raise TypeError(f"{name} must be True or False, got {type(value).__name__}")


def _outputs(fmt, partial_o, stats, out, out_dtype, return_stats):
    """``(out, out_stats)`` of a call without options that the per-call path may serve:
    ``out`` as given or allocated (``out_dtype``, else the partials' default), the exported
    stats allocated when asked for; None when ``partial_o`` is neither a tensor nor two
    parts of a partial dtype, or ``out_dtype`` is not one of its outputs (the Python path
    validates). Two parts' outputs are made like their first part's (``empty_like``: the
    cheapest allocation)."""
    if type(partial_o) is torch.Tensor:
        first = None
        dtype = partial_o.dtype
    elif (_two_parts(partial_o, stats) and type(partial_o[0]) is torch.Tensor
          and type(stats[0]) is torch.Tensor):
        first = partial_o[0]
        dtype = first.dtype
    else:
        return None
    if out is None:
        allowed = _OUT_DTYPES.get(dtype, ())
        if out_dtype is None and allowed:
            out_dtype = allowed[0]
        elif out_dtype not in allowed:
            return None
        # Sizes as integers: torch.empty parses a torch.Size about a microsecond slower.
        out = (torch.empty(*partial_o.shape[1:], dtype=out_dtype, device=partial_o.device)
               if first is None else
               torch.empty_like(first, dtype=out_dtype, memory_format=torch.contiguous_format))
    if not return_stats:
        return out, None
    if first is not None:
        return out, torch.empty_like(stats[0], dtype=torch.float32,
                                     memory_format=torch.contiguous_format)
    if partial_o.dim() < 3:  # no rows: validation refuses it
        return None
    rows = (*partial_o.shape[1:-1], 2) if fmt == MAXSUM else partial_o.shape[1:-1]
    return out, torch.empty(*rows, dtype=torch.float32, device=partial_o.device)


def _public(fmt, partial_o, stats, scalar, sinks, split_counts, out, out_dtype, return_stats,
            kv_split):
    """A public call without options but ``out_dtype`` (no FP8 scales, pass-through rows or
    indptr; ``out_dtype`` only without ``out``): served by the binding's per-call path, else
    stacked partials through :func:`_merge` and two parts through the general call, both
    registered for it; None for the others (the caller validates)."""
    if return_stats is not False and return_stats is not True:
        _check_return(fmt, return_stats)
    out_stats = None
    if out is None or return_stats:
        try:
            outputs = _outputs(fmt, partial_o, stats, out, out_dtype, return_stats)
        except RuntimeError:  # a nested tensor's shape raises: validation says what is wrong
            return None
        if outputs is None:
            return None
        out, out_stats = outputs
    if type(partial_o) is torch.Tensor:
        if _call_fast(_FORMS[fmt], partial_o, stats, scalar, sinks, split_counts, out, out_stats,
                      kv_split):
            return (out, out_stats) if return_stats else out
        return _merge(fmt, partial_o, stats, scalar, sinks, split_counts, out, return_stats,
                      kv_split)
    if not _two_parts(partial_o, stats):
        return None
    if _call_fast(_PART_FORMS[fmt], *partial_o, *stats, scalar, sinks, split_counts, out,
                  out_stats, kv_split):
        return (out, out_stats) if return_stats else out
    return merge_call(fmt, partial_o, stats, scalar, sinks=sinks, split_counts=split_counts,
                      out=out, out_stats=out_stats, kv_split=kv_split,
                      register=(_PART_FORMS[fmt], False, *partial_o, *stats, scalar, sinks,
                                split_counts, out, out_stats, kv_split))


def _layout_launch(fmt, partial_o, stats, scalar, sinks, split_counts, out, return_stats,
                   kv_split) -> LayoutLaunch:
    """The layout's launch, from a key of everything that validation and the launch depend
    on (every tensor's dtype, shape, strides and device, the scalars, the environment),
    except addresses and the maxsum scale.

    The key is built on every call and is most of the host time of a cached call,
    so it is one expression that reads each attribute once and calls nothing else.
    """
    try:
        key = (fmt, partial_o.dtype, partial_o.shape, partial_o.stride(), partial_o.device,
               stats.dtype, stats.shape, stats.stride(), stats.device,
               None if out is None else (out.dtype, out.shape, out.stride(), out.device),
               None if sinks is None else (sinks.dtype, sinks.shape, sinks.stride(),
                                           sinks.device),
               None if split_counts is None else (split_counts.dtype, split_counts.shape,
                                                  split_counts.stride(), split_counts.device),
               None if fmt == MAXSUM else scalar, return_stats, kv_split, type(kv_split),
               _read_environment())
        layout = _launches.get(key)
    except (AttributeError, TypeError, RuntimeError):  # not tensors (or nested ones, whose
        # shape raises), or an unhashable scalar: validation says what is wrong
        key = layout = None
    if layout is None:
        layout = LayoutLaunch(config_for_layout, fmt, partial_o, stats, scalar, sinks,
                              split_counts, out, kv_split)
        layout.call = layout.bind()
        if key is not None and layout.cacheable:
            _launches[key] = layout
    return layout


def _launch(layout: LayoutLaunch, fmt, partial_o, stats, scalar, sinks, split_counts, out,
            out_stats, fresh_out: bool) -> None:
    """The eager merge into ``out`` (and ``out_stats``) with the layout's launch: the
    binding checks the addresses (alignment, aliasing) and launches."""
    call = layout.call
    if call is None:  # rows = 0: nothing to launch
        return
    stream = _current_stream(layout.device_index) if layout.device_index >= 0 else 0
    address = _kernel.address
    call((partial_o.data_ptr(),), (stats.data_ptr(),),
         (address(split_counts), address(sinks), out.data_ptr(), address(out_stats)),
         layout.log2_scale or scalar, stream)


def _fake(tensor) -> bool:
    """A FakeTensor (torch.compile's tracing, FakeTensorMode): no memory to launch on."""
    return type(tensor) is not torch.Tensor and isinstance(tensor, FakeTensor)


def _merge(fmt, partial_o, stats, scalar, sinks, split_counts, out, return_stats, kv_split):
    # Traced, or fake tensors: the custom op (its fake implementation, or the eager path
    # with real tensors when the graph runs). Fake CUDA tensors outside a trace are checked
    # against the device first, as a launch would be (cause and remedy where it cannot run).
    if _is_compiling() or _fake(partial_o):
        if not _is_compiling() and partial_o.device.type == "cuda":
            _kernel.check_device(partial_o.device.index or 0)
        # A maxsum scale may be a traced value: the op checks it when it runs.
        checked = 1.0 if fmt == MAXSUM else scalar
        out_dtype = _validate(fmt, partial_o, stats, checked, sinks, split_counts, out, kv_split)
        row_shape = tuple(partial_o.shape[1:-1])
        if out is None:
            out = partial_o.new_empty(tuple(partial_o.shape[1:]), dtype=out_dtype)
        out_stats = (partial_o.new_empty(row_shape + ((2,) if fmt == MAXSUM else ()),
                                         dtype=torch.float32) if return_stats else None)
        op = merge_maxsum_out if fmt == MAXSUM else merge_lse_out
        op(partial_o, stats, float(scalar), sinks, split_counts, out, out_stats, kv_split or 0)
        return (out, out_stats) if return_stats else out
    if fmt == MAXSUM and not (type(scalar) is float and _FLOAT32_TINY <= scalar <= _FLOAT32_MAX):
        _check_scalar(fmt, scalar)
        scalar = float(scalar)
    generation = _launches.generation
    layout = _layout_launch(fmt, partial_o, stats, scalar, sinks, split_counts, out,
                            return_stats, kv_split)
    if partial_o.requires_grad or stats.requires_grad or (sinks is not None and sinks.requires_grad):
        _check_grad(partial_o, stats, sinks)
    fresh_out = out is None
    if fresh_out:
        out = torch.empty(layout.out_shape, dtype=layout.out_dtype, device=layout.device)
    out_stats = (torch.empty(layout.stats_shape, dtype=torch.float32, device=layout.device)
                 if return_stats else None)
    _launch(layout, fmt, partial_o, stats, scalar, sinks, split_counts, out, out_stats,
            fresh_out)
    if not fresh_out or _DEFAULT_OUT.get(partial_o.dtype) == out.dtype:
        # Allocated outputs register as given: the next call allocates the same (_outputs).
        _remember(layout, generation, fmt, partial_o, stats, scalar, sinks, split_counts, out,
                  out_stats, kv_split)
    return (out, out_stats) if return_stats else out


def _remember(layout: LayoutLaunch, generation: int, fmt, partial_o, stats, scalar, sinks,
              split_counts, out, out_stats, kv_split) -> None:
    """Hands a cached layout launch that just ran to the binding's per-call path, which
    serves the layout's later calls (csrc/fast_call.cpp).

    Not when the launch table was cleared meanwhile (a refresh from another thread:
    the launch may be stale), and not for a launch that was not kept.
    """
    if layout.call is not None and layout.cacheable and _launches.generation == generation:
        _call_add(layout.call, False, _FORMS[fmt], partial_o, stats, scalar, sinks, split_counts,
                  out, out_stats, kv_split)


def _merge_into(fmt, partial_o, stats, scalar, sinks, split_counts, out, out_stats,
                kv_split) -> None:
    """The custom ops' eager body: ``out`` (and ``out_stats``) given; ``kv_split`` 0 = choose.
    Given exported stats take the general call, which checks them."""
    kv_split = kv_split or None
    if out_stats is None and _call_fast(_FORMS[fmt], partial_o, stats, scalar, sinks, split_counts,
                                        out, None, kv_split):
        return
    if fmt == MAXSUM and not (type(scalar) is float and _FLOAT32_TINY <= scalar <= _FLOAT32_MAX):
        _check_scalar(fmt, scalar)  # the layout's key leaves the maxsum scale out
    if out_stats is not None:
        merge_call(fmt, partial_o, stats, scalar, sinks=sinks, split_counts=split_counts,
                   out=out, out_stats=out_stats, kv_split=kv_split,
                   names=(("out_stats", "out_stats" if fmt == MAXSUM else "out_lse"),))
        return
    generation = _launches.generation
    layout = _layout_launch(fmt, partial_o, stats, scalar, sinks, split_counts, out, False,
                            kv_split)
    _launch(layout, fmt, partial_o, stats, scalar, sinks, split_counts, out, None, False)
    _remember(layout, generation, fmt, partial_o, stats, scalar, sinks, split_counts, out, None,
              kv_split)


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


def _one_device(partial_o, **tensors) -> None:
    """The fake implementations' check: the dispatcher takes a call with any tensor on
    "meta" there, so a meta ``out`` beside CPU partials would otherwise pass unwritten."""
    for name, value in tensors.items():
        if value is not None and value.device != partial_o.device:
            raise ValueError(f"{name} is on {value.device} but partial_o is on {partial_o.device}")


@merge_maxsum_out.register_fake
def _(partial_o, partial_stats, scale_log2, sinks, split_counts, out, out_stats, kv_split):
    _one_device(partial_o, partial_stats=partial_stats, sinks=sinks, split_counts=split_counts,
                out=out, out_stats=out_stats)


@merge_lse_out.register_fake
def _(partial_o, partial_lse, base, sinks, split_counts, out, out_lse, kv_split):
    _one_device(partial_o, partial_lse=partial_lse, sinks=sinks, split_counts=split_counts,
                out=out, out_lse=out_lse)


def _general(out_dtype, out_scale, group_scales, quant_group, ue8m0, pass_through_from,
             indptr) -> Extras | None:
    """The general call's options of a public call, or None when it has none."""
    if (out_dtype is None and out_scale is None and group_scales is None and quant_group is None
            and ue8m0 is False and pass_through_from is None and indptr is None):
        return None
    return Extras(out_scale, group_scales, quant_group, ue8m0, pass_through_from, indptr)


def merge_maxsum(partial_o, partial_stats, scale_log2, *, sinks=None, split_counts=None,
                 out=None, return_stats=False, kv_split=None, out_dtype=None, out_scale=None,
                 group_scales=None, quant_group=None, ue8m0=False, pass_through_from=None,
                 indptr=None):
    """Merge split-KV partials whose stats are (max, sum) pairs (TensorRT-LLM layout).

    Parameters
    ----------
    partial_o : Tensor (num_splits, rows, head_dim) or (num_splits, tokens, heads, head_dim),
                or a list/tuple of num_splits tensors (rows, head_dim) / (tokens, heads, head_dim)
        Unnormalised partial outputs O_i, bfloat16, float16 or float32. Any
        strides on every dim but head_dim (multiples of 16 bytes), unit stride
        on head_dim, 16-byte aligned. head_dim is any whole number of 16-byte
        vectors up to 1024 elements (a multiple of 8 for 16-bit partials, of 4
        for float32).
        rows = tokens * heads, heads fastest. Parts in separate tensors merge
        without stacking: they must share dtype, shape and strides and lie
        equally far apart in memory (always so for two).
    partial_stats : Tensor (num_splits, *rows, 2), float32, or a list/tuple like partial_o
        (m_i, l_i): m_i the raw (unscaled) logit max of split i, and
        l_i = sum_j 2^(scale_log2 * (x_j - m_i)).
    scale_log2 : float
        Softmax scale times log2(e) (positive, finite).
    sinks : Tensor (heads,), float32, optional
        Per-head attention-sink logits in natural-log units; the sink of a row
        is sinks[head] (3-D calls: row r is head r % heads).
    split_counts : Tensor (*rows), int32, contiguous, optional
        Partials per row; splits at or past the count are never read.
    out : Tensor (*rows, head_dim), any strides but unit on head_dim, optional
        Output: bfloat16, float16, float32, float8_e4m3fn or float8_e4m3fnuz, from
        any partial dtype (default: the partials' dtype, bfloat16 for float32).
    return_stats : bool
        Also return float32 (*rows, 2) stats (M * scale_log2 / log2(e), L).
    kv_split : int, optional
        Force the KvSplit family with K in {1, 2, 4, 8, 16} (still halved to
        satisfy the kernel's constraints); None lets the dispatcher choose a
        config of either family.
    out_dtype : torch.dtype, optional
        The output dtype when ``out`` is not given.
    out_scale : Tensor (1,), float32, optional
        FP8 outputs: out = fp8(clamp(value / out_scale)), one scale for the tensor.
    group_scales : Tensor (*rows, head_dim // quant_group), float32 or float8_e8m0fnu
        FP8 outputs with a scale per group of ``quant_group`` (64 or 128) head-dim
        elements, which the merge computes (max(amax, 1e-10) / the FP8 maximum,
        rounded up to a power of two with ``ue8m0`` or an e8m0 tensor) and writes
        here; any strides (row- or column-major).
    pass_through_from : int, optional
        Tokens from this index on take the last split as it is (output and stats);
        only earlier tokens merge (vLLM's ``prefill_tokens_with_context``).
    indptr : Tensor (tokens + 1,), int32 or int64, optional
        Variable-length states: ``partial_o`` is (nnz, [heads,] head_dim), the stats
        (nnz, [heads,] 2), and token t merges states indptr[t] .. indptr[t+1] - 1
        (an empty range gives 0 and empty stats). Read by the kernel on the device;
        checked on the host first, except during a CUDA-graph capture (where the
        kernel clamps the ranges into the states).

    Returns
    -------
    Tensor, or (Tensor, Tensor) with ``return_stats``. A row with no
    non-empty split is 0 with stats (-inf, 0). No input may require grad
    while grad mode is on (there is no backward).
    """
    if (out_scale is None and group_scales is None and quant_group is None and ue8m0 is False
            and pass_through_from is None and indptr is None
            and (out is None or out_dtype is None) and not _is_compiling()):
        if out is not None and return_stats is False and type(partial_o) is torch.Tensor:
            # The commonest call, without a frame more: the per-call path, else validation.
            if _call_fast(_FORMS[MAXSUM], partial_o, partial_stats, scale_log2, sinks,
                          split_counts, out, None, kv_split):
                return out
            return _merge(MAXSUM, partial_o, partial_stats, scale_log2, sinks, split_counts, out,
                          False, kv_split)
        served = _public(MAXSUM, partial_o, partial_stats, scale_log2, sinks, split_counts, out,
                         out_dtype, return_stats, kv_split)
        if served is not None:
            return served
    _check_return(MAXSUM, return_stats)
    extras = _general(out_dtype, out_scale, group_scales, quant_group, ue8m0, pass_through_from,
                      indptr)
    if extras is not None or isinstance(partial_o, (list, tuple)):
        return merge_call(MAXSUM, partial_o, partial_stats, scale_log2, sinks=sinks,
                          split_counts=split_counts, out=out, return_stats=return_stats,
                          kv_split=kv_split, out_dtype=out_dtype, extras=extras or NO_EXTRAS)
    return _merge(MAXSUM, partial_o, partial_stats, scale_log2, sinks, split_counts, out,
                  return_stats, kv_split)


def merge_lse(partial_o, partial_lse, *, base=2.0, sinks=None, split_counts=None, out=None,
              return_lse=False, kv_split=None, out_dtype=None, out_scale=None, group_scales=None,
              quant_group=None, ue8m0=False, pass_through_from=None, indptr=None):
    """Merge split-KV partials whose stats are log-sum-exps (FlashInfer/FlashAttention layout).

    Parameters
    ----------
    partial_o : Tensor (num_splits, *rows, head_dim), or a list/tuple of parts
        Normalised partial outputs O_i (layout rules as in :func:`merge_maxsum`).
    partial_lse : Tensor (num_splits, *rows), float32, any strides (a
        head-major LSE is a view), or a list/tuple like partial_o
        lse_i of each split, in ``base``; -inf marks an empty split.
    base : float
        2.0 (FlashInfer, FlashMLA) or math.e (FlashAttention, vLLM).
    sinks : Tensor (heads,), float32, optional
        Per-head sink logits in natural-log units, joining the sum as a state
        with zero output.
    split_counts, out, kv_split, out_dtype, out_scale, group_scales, quant_group, ue8m0,
    pass_through_from, indptr
        As in :func:`merge_maxsum` (with indptr the LSE is (nnz, [heads])).
    return_lse : bool
        Also return the merged float32 (*rows) LSE, in ``base``.

    Returns
    -------
    Tensor, or (Tensor, Tensor) with ``return_lse``. A row with no non-empty
    split is 0 with LSE -inf.
    """
    if (out_scale is None and group_scales is None and quant_group is None and ue8m0 is False
            and pass_through_from is None and indptr is None
            and (out is None or out_dtype is None) and not _is_compiling()):
        if out is not None and return_lse is False and type(partial_o) is torch.Tensor:
            # The commonest call, without a frame more: the per-call path, else validation.
            if _call_fast(_FORMS[LSE], partial_o, partial_lse, base, sinks, split_counts, out,
                          None, kv_split):
                return out
            return _merge(LSE, partial_o, partial_lse, base, sinks, split_counts, out, False,
                          kv_split)
        served = _public(LSE, partial_o, partial_lse, base, sinks, split_counts, out, out_dtype,
                         return_lse, kv_split)
        if served is not None:
            return served
    _check_return(LSE, return_lse)
    extras = _general(out_dtype, out_scale, group_scales, quant_group, ue8m0, pass_through_from,
                      indptr)
    if extras is not None or isinstance(partial_o, (list, tuple)):
        return merge_call(LSE, partial_o, partial_lse, base, sinks=sinks,
                          split_counts=split_counts, out=out, return_stats=return_lse,
                          kv_split=kv_split, out_dtype=out_dtype, extras=extras or NO_EXTRAS)
    return _merge(LSE, partial_o, partial_lse, base, sinks, split_counts, out, return_lse,
                  kv_split)

