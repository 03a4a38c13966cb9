"""The general merge call: what kvsplit.compat's adapters and list-of-parts calls need.

Beyond :func:`kvsplit.merge_lse`'s call it takes partials held in separate
tensors (the split stride is their distance in memory, so it is passed at
launch, never cached), a given exported-stats tensor of any strides, a row
mask, a stat value read as an empty split and an in-place export. One launch,
no copy; launches are kept per layout in the same table as the public calls'.
"""

from __future__ import annotations

import math

import torch

from ._kernel import address as _address
from ._kernel import call_add, current_stream
from .dispatch.dispatcher import config_for_layout, read_environment as _read_environment
from .launches import LayoutLaunch
from .launches import table as _launches
from .validation import (_INDPTR_DTYPES, _PUBLIC_ROW_DIMS, NO_EXTRAS, Extras, _check_grad,
                         _extent, _stats_name, _type_error)


def _meta(tensor) -> tuple:
    return (tensor.dtype, tensor.shape, tensor.stride(), tensor.device)


def _metas(value) -> tuple:
    if isinstance(value, (list, tuple)):
        return tuple(_meta(t) for t in value)
    return _meta(value)


def _stack_view(name: str, parts) -> torch.Tensor:
    """A (num_splits, ...) view of part 0 with split stride 0, standing for the parts in
    validation (the real split stride is the parts' distance, known per call)."""
    if not parts:
        raise ValueError(f"{name} is an empty list: nothing to merge")
    first = parts[0]
    for i, part in enumerate(parts):
        if not isinstance(part, torch.Tensor):
            raise _type_error(f"{name}[{i}]", part)
        if _meta(part) != _meta(first):
            raise ValueError(f"{name}[{i}] must have the dtype, shape, strides and device of "
                             f"{name}[0]")
    return first.as_strided((len(parts),) + tuple(first.shape), (0,) + first.stride())


def varlen_view(fmt, partial_o, stats, indptr):
    """Variable-length states as a layout: ``partial_o`` (nnz, [heads,] head_dim) and
    ``stats`` (nnz, [heads][, 2]) become (nnz, tokens, ...) views whose token stride is 0
    (a row's states are found through ``indptr``, tokens = len(indptr) - 1)."""
    if not isinstance(indptr, torch.Tensor):
        raise _type_error("indptr", indptr)
    if indptr.dtype not in _INDPTR_DTYPES or indptr.dim() != 1 or indptr.shape[0] < 1:
        raise ValueError(f"indptr must be a 1-D int32 or int64 tensor of tokens + 1 offsets, got "
                         f"{indptr.dtype} {tuple(indptr.shape)}")
    for name, value in (("partial_o", partial_o), (_stats_name(fmt), stats)):
        if not isinstance(value, torch.Tensor):
            raise _type_error(name, value)
    if partial_o.dim() not in (2, 3):
        raise ValueError(f"with indptr, partial_o must be (nnz, head_dim) or (nnz, heads, "
                         f"head_dim), got {partial_o.dim()}-D")
    if indptr.device != partial_o.device:
        raise ValueError(f"indptr is on {indptr.device} but partial_o is on {partial_o.device}")
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
            raise ValueError(f"indptr ends at {offsets[-1]}, past the {nnz} states of partial_o")

    def view(t):
        return t.as_strided((t.shape[0], tokens) + tuple(t.shape[1:]),
                            (t.stride(0), 0) + tuple(t.stride()[1:]))

    return view(partial_o), view(stats), max(1, round(nnz / max(tokens, 1)))


class _GeneralLaunch:
    """A general call's layout launch, the parts' count and the in-place rule."""

    __slots__ = ("layout", "parts", "in_place", "call")

    def __init__(self, fmt, partial_o, stats, scalar, sinks, split_counts, out, out_stats,
                 row_mask, empty_stat, stats_in_place, kv_split, row_dims,
                 out_dtype=None, extras: Extras = NO_EXTRAS, key_splits=None, names=None):
        self.parts = len(partial_o) if isinstance(partial_o, (list, tuple)) else 0
        if self.parts:
            partial_o = _stack_view("partial_o", partial_o)
            if not isinstance(stats, (list, tuple)) or len(stats) != self.parts:
                raise ValueError(f"{_stats_name(fmt)} must be a list of {self.parts} tensors, "
                                 "one per part of partial_o")
            stats = _stack_view(_stats_name(fmt), stats)
        elif isinstance(stats, (list, tuple)):
            raise _type_error(_stats_name(fmt), stats)
        mask_stride = 1
        if row_mask is not None:
            if not isinstance(row_mask, torch.Tensor):
                raise _type_error("mask", row_mask)
            tokens = math.prod(partial_o.shape[1:-2]) if partial_o.dim() > 3 else None
            if row_mask.dtype not in (torch.bool, torch.uint8) or row_mask.dim() != 1 or (
                    tokens is not None and row_mask.shape[0] != tokens):
                raise ValueError(f"mask must be a bool tensor of shape ({tokens},), got "
                                 f"{row_mask.dtype} {tuple(row_mask.shape)}")
            if row_mask.device != partial_o.device:
                raise ValueError(f"mask is on {row_mask.device} but partial_o is on "
                                 f"{partial_o.device}")
            mask_stride = row_mask.stride(0)
        self.in_place = stats_in_place
        if stats_in_place and not (self.parts and out is not None and out_stats is not None
                                   and _meta(out) == _meta(partial_o[0])
                                   and _meta(out_stats) == _meta(stats[0])):
            raise ValueError("an in-place merge writes out and out_lse over part 0, which they "
                             "must match in dtype, shape and strides")
        self.layout = LayoutLaunch(config_for_layout, fmt, partial_o, stats, scalar, sinks,
                                   split_counts, out, kv_split, out_stats=out_stats,
                                   empty_stat=empty_stat, stats_in_place=stats_in_place,
                                   row_dims=row_dims, row_mask_stride=mask_stride,
                                   out_dtype=out_dtype, extras=extras, key_splits=key_splits)
        self.call = self.layout.bind(parts=self.parts, in_place=stats_in_place,
                                     more_extents=(_extent(row_mask), _extent(extras.indptr),
                                                   _extent(extras.out_scale),
                                                   _extent(extras.group_scales)),
                                     names=dict(names) if names else None)


def merge_call(fmt, partial_o, stats, scalar, *, sinks=None, split_counts=None, out=None,
               out_stats=None, return_stats=False, row_mask=None, empty_stat=None,
               stats_in_place=False, kv_split=None, row_dims=_PUBLIC_ROW_DIMS, out_dtype=None,
               extras: Extras = NO_EXTRAS, names=None, register=None):
    """One merge launch of the general call: what :mod:`kvsplit.compat` adapters need.

    ``partial_o``/``stats`` are tensors (num_splits, *rows, ...) or lists of parts
    (*rows, ...); ``out_stats`` a given exported-stats tensor of any strides
    (``return_stats`` allocates one instead); ``row_mask`` a bool (tokens,)
    tensor whose False rows are neither read nor written; ``empty_stat`` a raw
    stat read as an empty split (vLLM: +inf); ``stats_in_place`` lets ``out``
    and ``out_stats`` be part 0 itself; ``out_dtype`` the output's dtype when
    ``out`` is not given; ``extras`` FP8 scales, pass-through rows and
    variable-length states (:class:`kvsplit.validation.Extras`); ``names`` the
    arguments' names in errors, as ``(name, caller's name)`` pairs (see
    :meth:`kvsplit.launches.LayoutLaunch.bind`). Launches are kept per layout like
    :func:`merge_lse`'s. ``register``, ``(form, reversed, *args)``: the entry point's
    own call, whose layout the binding's per-call path then serves
    (csrc/fast_call.cpp; ``reversed``: its two parts are merged in reverse order).
    Returns ``out``, or ``(out, out_stats)`` when stats are exported.
    """
    key_splits = None
    generation = _launches.generation
    if extras.indptr is not None:
        if isinstance(partial_o, (list, tuple)):
            raise ValueError("indptr addresses the states of one tensor, not a list of parts")
        partial_o, stats, key_splits = varlen_view(fmt, partial_o, stats, extras.indptr)
    try:
        key = ("call", fmt, _metas(partial_o), _metas(stats),
               None if out is None else _meta(out), None if out_stats is None else _meta(out_stats),
               None if sinks is None else _meta(sinks),
               None if split_counts is None else _meta(split_counts),
               None if row_mask is None else _meta(row_mask), scalar, empty_stat,
               bool(stats_in_place), bool(return_stats), kv_split, type(kv_split), row_dims,
               out_dtype, extras.meta(), key_splits, names, _read_environment())
        general = _launches.get(key)
    except (AttributeError, TypeError):  # not tensors: validation says what is wrong
        key = general = None
    if general is None:
        general = _GeneralLaunch(fmt, partial_o, stats, scalar, sinks, split_counts, out,
                                 out_stats, row_mask, empty_stat, stats_in_place, kv_split,
                                 row_dims, out_dtype, extras, key_splits, names)
        if key is not None and general.layout.cacheable:
            _launches[key] = general
    layout = general.layout
    if general.parts:
        o_addresses = [t.data_ptr() for t in partial_o]
        s_addresses = [t.data_ptr() for t in stats]
        first = partial_o[0]
    else:
        o_addresses, s_addresses, first = [partial_o.data_ptr()], [stats.data_ptr()], partial_o
    if first.requires_grad:
        _check_grad(first)
    if out is None:
        out = torch.empty(layout.out_shape, dtype=layout.out_dtype, device=layout.device)
    if out_stats is None and return_stats:
        out_stats = torch.empty(layout.stats_shape, dtype=torch.float32, device=layout.device)
    if general.call is not None:
        stream = current_stream(layout.device_index) if layout.device_index >= 0 else 0
        general.call(o_addresses, s_addresses,
                  (_address(split_counts), _address(sinks), out.data_ptr(), _address(out_stats),
                   _address(row_mask), _address(extras.indptr), _address(extras.out_scale),
                   _address(extras.group_scales)), layout.log2_scale or float(scalar), stream)
        if register is not None and layout.cacheable and _launches.generation == generation:
            form, reverse, *args = register
            call_add(general.call, reverse, form, *args)
    return (out, out_stats) if out_stats is not None else out
