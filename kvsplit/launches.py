"""A call layout's launch, and the table of them that every eager merge looks up.

:class:`LayoutLaunch` validates a layout (:mod:`kvsplit.validation`), takes
its kernel config from the layer above (a ``choose`` function: the
dispatcher's, handed in by :mod:`kvsplit.merge` and :mod:`kvsplit._call`) and
makes the launch. :data:`table` keeps one per layout; the binding's per-call
path (csrc/fast_call.cpp) keeps copies of those it serves, which
:class:`LaunchTable` clears with its own entries.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, Optional

import torch

from . import _kernel
from .config import KernelConfig
from .validation import (_LN2, _LOG2E, _PUBLIC_ROW_DIMS, _STATS_DTYPES, MAXSUM, NO_EXTRAS,
                         Extras, _check_extras, _check_strides, _check_tensor, _extent, _heads,
                         _stats_name, _store_bytes, _validate)


class ConfigRequest(NamedTuple):
    """What a layout's kernel config is chosen by (no addresses)."""

    device: torch.device
    head_dim: int
    partial_dtype: torch.dtype
    out_dtype: torch.dtype
    stats_format: int
    num_splits: int  # the split count to choose for (variable-length states: their mean per row)
    rows: int
    kv_split: Optional[int]  # forced by the caller (KvSplit family), else None
    row_shape: tuple
    stats_row_strides: tuple
    stats_in_place: bool  # an export into split 0's stats
    quant_group: int  # elements per FP8 scale of per-group scales; 0: none
    few_only: bool = False  # per-request ops or pair stats: the Few family alone runs them


#: ``choose(request) -> (config, cacheable, pdl)``: the kernel config, whether a launch
#: holding it may be kept in the table, and whether launches use programmatic dependent
#: launch.
Choose = Callable[[ConfigRequest], "tuple[KernelConfig, bool, bool]"]


class LayoutLaunch:
    """What a layout's calls share: its kernel launch (:class:`kvsplit._kernel.Launch`),
    the binding's :class:`CallPlan` of it (``call``, see :meth:`bind`), and the byte
    extents and alignments that the per-call checks read."""

    __slots__ = ("kernel", "native", "device_index", "rows", "fmt", "o_bytes", "call", "out_shape", "out_dtype", "stats_shape", "device",
                 "store_bytes", "extents", "log2_scale", "cacheable")

    def __init__(self, choose: Choose, fmt, partial_o, stats, scalar, sinks, split_counts, out,
                 kv_split, *, out_stats=None, empty_stat=None, stats_in_place=False,
                 row_dims=_PUBLIC_ROW_DIMS, row_mask_stride=1, out_dtype=None,
                 extras: Extras = NO_EXTRAS, key_splits: Optional[int] = None):
        """Validates the layout in full, then asks ``choose`` (the layer above: the
        dispatcher) for the kernel config of a layout with rows, and makes its launch.

        ``out_stats``, ``empty_stat`` and ``stats_in_place`` are kvsplit.compat's: a given
        exported-stats tensor (any strides), a stat that reads as empty, and an export
        into split 0's stats (see params.h). ``out_dtype``: the output's, when ``out`` is
        not given; ``extras``: the general call's options; ``key_splits``: the split count
        the config is chosen for (variable-length states: their mean per row)."""
        out_dtype = _validate(fmt, partial_o, stats, scalar, sinks, split_counts, out, kv_split,
                              row_dims=row_dims, out_dtype=out_dtype)
        if kv_split is not None:
            kv_split = int(kv_split)  # numpy and other Integral scalars, validated above
        if partial_o.device.type == "cuda":  # the driver and the build fit this GPU
            _kernel.check_device(partial_o.device.index)
        num_splits, *row_list, head_dim = partial_o.shape
        row_shape = tuple(row_list)
        rows = math.prod(row_shape)
        heads = _heads(row_shape, sinks)
        _check_extras(extras, fmt, out_dtype, row_shape, head_dim, num_splits, heads,
                      partial_o.device)
        _check_strides(partial_o, out, out_dtype)
        device = partial_o.device
        self.rows, self.device, self.out_dtype = rows, device, out_dtype
        self.fmt, self.o_bytes = fmt, partial_o.dtype.itemsize
        self.call = None  # the binding's CallPlan, made by the caller (see bind)
        self.out_shape = row_shape + (head_dim,)
        self.stats_shape = row_shape + ((2,) if fmt == MAXSUM else ())
        if out_stats is not None:
            _check_tensor("out_stats" if fmt == MAXSUM else "out_lse", out_stats, _STATS_DTYPES,
                          self.stats_shape, device, len(row_shape) if fmt == MAXSUM else None)
        self.store_bytes = _store_bytes(partial_o.dtype, out_dtype)
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
        # native and device_index repeat kernel's, one attribute away for the per-call launch.
        self.kernel, self.native, self.device_index, self.cacheable = None, None, -1, True
        if rows:
            config, self.cacheable, pdl = choose(ConfigRequest(
                device, head_dim, partial_o.dtype, out_dtype, fmt, key_splits or num_splits,
                rows, kv_split or None, row_shape, tuple(stats.stride()[1:1 + len(row_shape)]),
                stats_in_place, extras.quant_group if extras.group_scales is not None else 0,
                extras.request_starts is not None or extras.pair_stats))
            self.kernel = _kernel.Launch(
                config, fmt, partial_o, stats, out_like, sinks, export_scale, pdl=pdl,
                out_stats=out_stats, empty_stat=empty_stat, stats_in_place=stats_in_place,
                row_mask_stride=row_mask_stride, pass_through_tokens=extras.pass_through_from,
                group_scales=extras.group_scales, quant_group=extras.quant_group or 0,
                ue8m0=extras.ue8m0,
                indptr_dtype=None if extras.indptr is None else extras.indptr.dtype,
                num_requests=0 if extras.request_ops is None else extras.request_ops.numel(),
                pair_stats=extras.pair_stats)
            self.native, self.device_index = self.kernel.native, self.kernel.device_index

    def bind(self, *, parts: int = 0, in_place: bool = False,
             more_extents: tuple = (0,) * 6, names: Optional[dict] = None):
        """The binding's CallPlan of this layout (None when there is nothing to launch):
        the launch and what the per-call checks read (csrc/fast_call.cpp), for partials
        stacked (``parts`` 0) or held in ``parts`` tensors. ``more_extents``: the bytes of
        (row_mask, indptr, out_scale, group_scales, request_starts, request_ops); ``names``
        the arguments' names as the caller's users know them (partial_o, stats,
        split_counts, sinks, out, out_stats, mask, indptr, out_scale, group_scales,
        request_starts, request_ops; a part ``i`` of partial_o
        is ``partial_o[i]`` unless ``names['o_parts']`` and ``names['s_parts']`` name
        the parts)."""
        if self.native is None:
            return None
        given = dict(names or {})
        stats_name = _stats_name(self.fmt)
        known = {"partial_o": "partial_o", "stats": stats_name, "split_counts": "split_counts",
                 "sinks": "sinks", "out": "out",
                 "out_stats": "out_stats" if self.fmt == MAXSUM else "out_lse",
                 "mask": "mask", "indptr": "indptr", "out_scale": "out_scale",
                 "group_scales": "group_scales", "request_starts": "request_starts",
                 "request_ops": "request_ops"}
        known.update({k: v for k, v in given.items() if k in known})
        if parts:
            o_names = given.get("o_parts") or [f"{known['partial_o']}[{i}]" for i in range(parts)]
            s_names = given.get("s_parts") or [f"{known['stats']}[{i}]" for i in range(parts)]
        else:
            o_names, s_names = [known["partial_o"]], [known["stats"]]
        return _kernel.CallPlan(self.native, self.device_index, self.store_bytes,
                                self.o_bytes, parts, in_place, self.log2_scale,
                                list(self.extents) + list(more_extents), list(o_names),
                                list(s_names), list(known.values()))


class LaunchTable(dict):
    """The layouts' launches, keyed by layout: a dict whose removals also clear the
    copies that :meth:`mirror` registered (the binding's per-call path keeps the
    launches it serves there), and that counts its clears in :attr:`generation`."""

    __slots__ = ("_mirrors", "generation")

    def __init__(self) -> None:
        super().__init__()
        self._mirrors: list = []
        self.generation = 0

    def mirror(self, clear) -> None:
        """``clear()`` runs whenever a launch leaves this table."""
        self._mirrors.append(clear)

    def _dropped(self) -> None:
        self.generation += 1
        for clear in self._mirrors:
            clear()

    def clear(self) -> None:
        super().clear()
        self._dropped()

    def __setitem__(self, key, launch) -> None:
        replaced = key in self
        super().__setitem__(key, launch)
        if replaced:
            self._dropped()

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        self._dropped()

    def pop(self, *args):
        try:
            return super().pop(*args)
        finally:
            self._dropped()

    def popitem(self):
        try:
            return super().popitem()
        finally:
            self._dropped()


#: The eager merges' launches per layout (each holds a choice of the dispatcher, which
#: clears this table when its choices change).
table = LaunchTable()
table.mirror(_kernel.fast_clear)
