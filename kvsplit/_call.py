"""The general merge call: what kvsplit.compat's adapters and list-of-parts calls need.

The API layer's second entry beside :mod:`kvsplit.merge`: its checks are the
op layer's (:mod:`kvsplit.validation`), its config the dispatcher's, its
launch :class:`kvsplit.launches.LayoutLaunch`.

Beyond :func:`kvsplit.merge_lse`'s call it takes partials held in separate
tensors (the split stride is their distance in memory, so it is passed at
launch, never cached), a given exported-stats tensor of any strides, a row
mask, a stat value read as an empty split and an in-place export. One launch,
no copy; launches are kept per layout in the same table as the public calls'.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ._kernel import address as _address
from ._kernel import call_add, current_stream
from .dispatch.dispatcher import config_for_layout, read_environment as _read_environment
from .launches import LayoutLaunch
from .launches import table as _launches
from .validation import (_PUBLIC_ROW_DIMS, NO_EXTRAS, Extras, _check_grad, _check_in_place,
                         _check_parts, _check_row_mask, _extent, _meta, check_own_memory,
                         varlen_view)


def _metas(value) -> tuple:
    if isinstance(value, (list, tuple)):
        return tuple(_meta(t) for t in value)
    return _meta(value)


class _GeneralLaunch:
    """A general call's layout launch, the parts' count and the in-place rule."""

    __slots__ = ("layout", "parts", "in_place", "call")

    def __init__(self, fmt, partial_o, stats, scalar, sinks, split_counts, out, out_stats,
                 row_mask, empty_stat, stats_in_place, kv_split, row_dims,
                 out_dtype=None, extras: Extras = NO_EXTRAS, key_splits=None, names=None):
        self.parts = len(partial_o) if isinstance(partial_o, (list, tuple)) else 0
        partial_o, stats = _check_parts(fmt, partial_o, stats, self.parts)
        known = dict(names or ())
        for role, value in (("out", out), ("out_stats", out_stats),
                            ("group_scales", extras.group_scales)):
            if isinstance(value, torch.Tensor):
                check_own_memory(known.get(role, role), value)
        mask_stride = _check_row_mask(row_mask, partial_o)
        self.in_place = stats_in_place
        if stats_in_place:
            _check_in_place(self.parts, partial_o, stats, out, out_stats)
        self.layout = LayoutLaunch(config_for_layout, fmt, partial_o, stats, scalar, sinks,
                                   split_counts, out, kv_split, out_stats=out_stats,
                                   empty_stat=empty_stat, stats_in_place=stats_in_place,
                                   row_dims=row_dims, row_mask_stride=mask_stride,
                                   out_dtype=out_dtype, extras=extras, key_splits=key_splits)
        self.call = self.layout.bind(parts=self.parts, in_place=stats_in_place,
                                     more_extents=(_extent(row_mask), _extent(extras.indptr),
                                                   _extent(extras.out_scale),
                                                   _extent(extras.group_scales),
                                                   _extent(extras.request_starts),
                                                   _extent(extras.request_ops)),
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
    first = partial_o[0] if isinstance(partial_o, (list, tuple)) and partial_o else partial_o
    if type(first) is not torch.Tensor and isinstance(first, FakeTensor):
        raise TypeError("the options and adapters launch on real memory, not FakeTensors "
                        "(torch.compile traces the plain merge_lse / merge_maxsum calls)")
    key_splits = None
    generation = _launches.generation
    if extras.indptr is not None:
        if isinstance(partial_o, (list, tuple)):
            raise ValueError("indptr addresses the states of one tensor, not a list of parts")
        if split_counts is not None:
            raise ValueError("split_counts cannot be combined with indptr (indptr gives each "
                             "token its states)")
        partial_o, stats, key_splits = varlen_view(fmt, partial_o, stats, extras.indptr, names)
    try:
        key = ("call", fmt, _metas(partial_o), _metas(stats),
               None if out is None else _meta(out), None if out_stats is None else _meta(out_stats),
               None if sinks is None else _meta(sinks),
               None if split_counts is None else _meta(split_counts),
               None if row_mask is None else _meta(row_mask), scalar, empty_stat,
               bool(stats_in_place), bool(return_stats), kv_split, type(kv_split), row_dims,
               out_dtype, extras.meta(), key_splits, names, _read_environment())
        general = _launches.get(key)
    except (AttributeError, TypeError, RuntimeError):  # not tensors (or nested ones, whose
        # shape raises): validation says what is wrong
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
        inputs = (*partial_o, *stats)
    else:
        o_addresses, s_addresses = [partial_o.data_ptr()], [stats.data_ptr()]
        inputs = (partial_o, stats)
    if torch.is_grad_enabled():  # every input the binding's path checks (csrc/fast_call.cpp)
        _check_grad(*inputs, sinks)
    if out is None:
        out = torch.empty(layout.out_shape, dtype=layout.out_dtype, device=layout.device)
    if out_stats is None and return_stats:
        out_stats = torch.empty(layout.stats_shape, dtype=torch.float32, device=layout.device)
    if general.call is not None:
        stream = current_stream(layout.device_index) if layout.device_index >= 0 else 0
        general.call(o_addresses, s_addresses,
                  (_address(split_counts), _address(sinks), out.data_ptr(), _address(out_stats),
                   _address(row_mask), _address(extras.indptr), _address(extras.out_scale),
                   _address(extras.group_scales), _address(extras.request_starts),
                   _address(extras.request_ops)), layout.log2_scale or float(scalar), stream)
        if register is not None and layout.cacheable and _launches.generation == generation:
            form, reverse, *args = register
            call_add(general.call, reverse, form, *args)
    return (out, out_stats) if out_stats is not None else out
