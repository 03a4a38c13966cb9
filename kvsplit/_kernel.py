"""Launches the merge kernels: the one module that the public API and the tuner call.

A :class:`Launch` is everything a launch needs that does not change from one
call of a layout to the next (sizes, strides, dtypes, the kernel config, the
device): built once, it launches with six addresses and a scale. The kernel
layer checks the config again at every launch and reports a bad one as a
``ValueError`` (see csrc/binding.cpp); nothing here restates its rules.
"""

from __future__ import annotations

import functools
import math

import torch

from . import _native
from .config import DTYPE_CODES, NO_CUDA_KERNELS, KernelConfig, has_cuda_kernels

_ext = _native.ext()
#: torch dtype -> the kernel layer's code.
TORCH_DTYPE_CODES: dict[torch.dtype, int] = {getattr(torch, name): code
                                             for name, code in DTYPE_CODES.items()}
#: The launchers: ``(launch, partial_o, stats, split_counts, sinks, out, out_stats,
#: log2_scale[, stream])`` with addresses as ints (0: absent).
merge_cpu, merge_cuda = _ext.merge_cpu, _ext.merge_cuda


def _no_cuda(device_index: int) -> int:
    raise RuntimeError("torch has no CUDA support here")


#: The one per-call path of every eager merge (csrc/fast_call.cpp): ``call_form(roles,
#: in_place)`` registers an entry point's argument roles (:data:`ROLES`) and returns its
#: form; ``call_fast(form, *args)`` launches a call whose layout ``call_add(call_plan,
#: reversed, form, *args)`` registered and returns True, else False (take the Python path,
#: which launches through the same :class:`CallPlan`).
call_form, call_fast, call_add = _ext.call_form, _ext.call_fast, _ext.call_add
fast_clear, fast_info = _ext.fast_clear, _ext.fast_info
#: The binding's name (csrc/fast_call.cpp) for a layout's launch with what its per-call
#: checks read; ``call_plan(o, stats, others, scale, stream)`` checks the addresses
#: (alignment, parts, in place, aliasing) and launches. The only "plan" of the project.
CallPlan = _ext.CallPlan
ROLES = _ext.call_roles
#: Whether this torch publishes the DLPack exchange table that fast_merge reads
#: tensors through (torch >= 2.10); without it call_fast always returns False.
FAST_CALL = _ext.fast_init(getattr(torch.Tensor, "__dlpack_c_exchange_api__", None)
                           or getattr(torch.Tensor, "__c_dlpack_exchange_api__", None),
                           torch.Tensor, torch.is_grad_enabled)

#: ``current_stream(device_index)``: the raw handle of ``device_index``'s current
#: CUDA stream (not the current device's).
current_stream = (torch._C._cuda_getCurrentRawStream if torch.cuda.is_available() else _no_cuda)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _l2_bytes(device_index: int) -> int:
    # 0 where torch cannot tell (a CPU build of torch): unknown, the Few kernel keeps token order.
    if not torch.cuda.is_available():
        return 0
    return torch.cuda.get_device_properties(device_index).L2_cache_size


#: The CUDA devices that check_device passed.
_RUNNABLE: set[int] = set()


def check_device(device_index: int) -> None:
    """Raises RuntimeError, naming the cause and the remedy, unless this build's kernels run
    on CUDA device ``device_index``: a build without CUDA kernels, a driver older than the
    build's CUDA runtime, or no machine code or PTX for the device. Checked once per device."""
    if device_index in _RUNNABLE:
        return
    if not has_cuda_kernels():
        raise RuntimeError(NO_CUDA_KERNELS)
    _ext.check_device(device_index)
    _RUNNABLE.add(device_index)


@functools.cache
def pdl_supported(device_index: int) -> bool:
    """Whether the device has programmatic dependent launch (compute capability 9.0 and
    later); on older ones a requested PDL is dropped (the kernels' griddepcontrol is
    compiled for sm_90 and later only)."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def row_strides(row_shape, strides, heads: int) -> tuple[int, int, int]:
    """(batch, token, head) strides of a tensor's row dims (see params.h's RowIndex).

    ``row_shape`` is (rows,), (tokens, heads) or (batch, seqlen, heads) and
    ``strides`` the strides of those dims; a flat (rows,) is ``heads`` rows a token.
    """
    if len(row_shape) == 1:
        return (heads * strides[0], 0, strides[0])
    if len(row_shape) == 2:
        return (strides[0], 0, strides[1])
    return tuple(strides)


class Launch:
    """A launch of one call layout: ``Launch(...).launch(addresses..., log2_scale)``
    (the binding's ``Launch`` and the device it runs on).

    ``partial_o`` (num_splits, *rows, head_dim), ``stats`` (num_splits, *rows[, 2]),
    ``out`` (*rows, head_dim) and ``sinks`` (heads,) give the sizes, strides and
    dtypes, where ``rows`` is (rows,), (tokens, heads) or (batch, seqlen, heads);
    ``out_stats`` gives the exported stats' strides (contiguous if None). Their
    addresses are not kept. CUDA launches go to the tensors' device and to that
    device's current stream at launch time.
    """

    __slots__ = ("config", "native", "is_cuda", "device_index")

    def __init__(self, config: KernelConfig, stats_format: int, partial_o: torch.Tensor,
                 stats: torch.Tensor, out: torch.Tensor, sinks: torch.Tensor | None,
                 export_scale: float, *, sm_count: int | None = None, pdl: bool = False,
                 out_stats: torch.Tensor | None = None, empty_stat: float | None = None,
                 stats_in_place: bool = False, row_mask_stride: int = 1,
                 pass_through_tokens: int | None = None, group_scales: torch.Tensor | None = None,
                 quant_group: int = 0, ue8m0: bool = False,
                 indptr_dtype: torch.dtype | None = None, num_requests: int = 0,
                 pair_stats: bool = False):
        params = _ext.MergeParams()
        row_shape = tuple(partial_o.shape[1:-1])
        rank = len(row_shape)
        params.num_splits, params.head_dim = partial_o.shape[0], partial_o.shape[-1]
        params.rows = math.prod(row_shape)
        params.partial_dtype = TORCH_DTYPE_CODES[partial_o.dtype]
        params.out_dtype = TORCH_DTYPE_CODES[out.dtype]
        params.stats_format = stats_format
        if rank == 1:
            heads = sinks.numel() if sinks is not None else 1
        else:
            heads = row_shape[-1]
        params.heads = heads
        params.seqlen = row_shape[1] if rank == 3 else 1
        params.o_stride_split = partial_o.stride(0)
        params.o_row = row_strides(row_shape, partial_o.stride()[1:1 + rank], heads)
        params.stats_stride_split = stats.stride(0)
        params.stats_row = row_strides(row_shape, stats.stride()[1:1 + rank], heads)
        params.out_row = row_strides(row_shape, out.stride()[:rank], heads)
        exported = (out_stats.stride() if out_stats is not None
                    else _contiguous_strides(stats.shape[1:]))
        params.out_stats_row = row_strides(row_shape, exported[:rank], heads)
        params.export_scale = export_scale
        if empty_stat is not None:
            params.empty_stat = empty_stat
        params.stats_in_place = stats_in_place
        params.row_mask_stride = row_mask_stride
        if pass_through_tokens is not None:  # later tokens take the last split as it is
            params.pass_through_tokens = pass_through_tokens
            params.pass_through_split = partial_o.shape[0] - 1
        if group_scales is not None:
            params.quant_group, params.scale_ue8m0 = quant_group, ue8m0
            params.group_scales_dtype = TORCH_DTYPE_CODES[group_scales.dtype]
            params.group_scales_row = row_strides(row_shape, group_scales.stride()[:rank], heads)
            params.group_scales_stride = group_scales.stride(-1)
        params.indptr_int64 = indptr_dtype == torch.int64
        params.num_requests, params.pair_stats = num_requests, pair_stats
        target = _ext.CudaTarget()
        device = partial_o.device
        self.is_cuda = device.type == "cuda"
        self.device_index = device.index if self.is_cuda else -1
        if self.is_cuda:
            target.device, target.pdl = device.index, pdl and pdl_supported(device.index)
            target.sm_count = sm_count or _sm_count(device.index)
            target.l2_bytes = _l2_bytes(device.index)
        self.config = config
        self.native = _ext.Launch(params, config.native(), target)

    def launch(self, partial_o: int, stats: int, split_counts: int, sinks: int, out: int,
               out_stats: int, log2_scale: float) -> None:
        """Launches with these addresses (0: absent) and ``log2_scale`` (see params.h)."""
        if self.is_cuda:
            merge_cuda(self.native, partial_o, stats, split_counts, sinks, out, out_stats,
                       log2_scale, current_stream(self.device_index))
        else:
            merge_cpu(self.native, partial_o, stats, split_counts, sinks, out, out_stats,
                      log2_scale)


def address(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()


def run(launch: Launch, partial_o: torch.Tensor, stats: torch.Tensor, out: torch.Tensor,
        log2_scale: float, *, split_counts: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None, out_stats: torch.Tensor | None = None) -> torch.Tensor:
    """Launches ``launch`` on these tensors (of its layout); returns ``out``."""
    launch.launch(partial_o.data_ptr(), stats.data_ptr(), address(split_counts), address(sinks),
                out.data_ptr(), address(out_stats), log2_scale)
    return out


def launch(config: KernelConfig, stats_format: int, partial_o: torch.Tensor, stats: torch.Tensor,
           out: torch.Tensor, log2_scale: float, export_scale: float, *, pdl: bool = False,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One launch of ``config``, whatever the dispatcher would choose (benchmarks and tests)."""
    made = Launch(config, stats_format, partial_o, stats, out, sinks, export_scale, pdl=pdl)
    return run(made, partial_o, stats, out, log2_scale, sinks=sinks)
