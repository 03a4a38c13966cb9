"""Launches the merge kernels: the one module that the public API and the tuner call.

A :class:`Plan` is everything a launch needs that does not change from one
call of a layout to the next (sizes, strides, dtypes, the kernel config, the
device): built once, it launches with six addresses and a scale. The kernel
layer checks the config again at every launch and reports a bad one as a
``ValueError`` (see csrc/binding.cpp); nothing here restates its rules.
"""

from __future__ import annotations

import functools

import torch

from . import _native
from .config import DTYPE_CODES, KernelConfig

_ext = _native.ext()
#: torch dtype -> the kernel layer's code.
TORCH_DTYPE_CODES: dict[torch.dtype, int] = {getattr(torch, name): code
                                             for name, code in DTYPE_CODES.items()}
#: The launchers: ``(launch, partial_o, stats, split_counts, sinks, out, out_stats,
#: log2_scale[, stream])`` with addresses as ints (0: absent).
merge_cpu, merge_cuda = _ext.merge_cpu, _ext.merge_cuda


def _no_cuda(device_index: int) -> int:
    raise RuntimeError("torch has no CUDA support here")


#: ``current_stream(device_index)``: the raw handle of ``device_index``'s current
#: CUDA stream (not the current device's).
current_stream = (torch._C._cuda_getCurrentRawStream if torch.cuda.is_available() else _no_cuda)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


class Plan:
    """A launch of one call layout: ``Plan(...).launch(addresses..., log2_scale)``.

    ``partial_o`` (num_splits, rows, head_dim), ``stats`` (num_splits, rows[, 2]),
    ``out`` (rows, head_dim) and ``sinks`` (heads,) give the sizes, strides and
    dtypes; their addresses are not kept. CUDA launches go to the tensors'
    device and to that device's current stream at launch time.
    """

    __slots__ = ("config", "native", "is_cuda", "device_index")

    def __init__(self, config: KernelConfig, stats_format: int, partial_o: torch.Tensor,
                 stats: torch.Tensor, out: torch.Tensor, sinks: torch.Tensor | None,
                 export_scale: float, *, sm_count: int | None = None, pdl: bool = False):
        params = _ext.MergeParams()
        params.num_splits, params.rows, params.head_dim = partial_o.shape
        params.partial_dtype = TORCH_DTYPE_CODES[partial_o.dtype]
        params.out_dtype = TORCH_DTYPE_CODES[out.dtype]
        params.stats_format = stats_format
        params.heads = sinks.numel() if sinks is not None else 1
        params.o_stride_split, params.o_stride_row = partial_o.stride()[:2]
        params.stats_stride_split, params.stats_stride_row = stats.stride()[:2]
        params.out_stride_row = out.stride(0)
        params.export_scale = export_scale
        target = _ext.CudaTarget()
        device = partial_o.device
        self.is_cuda = device.type == "cuda"
        self.device_index = device.index if self.is_cuda else -1
        if self.is_cuda:
            target.device, target.pdl = device.index, pdl
            target.sm_count = sm_count or _sm_count(device.index)
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


def run(plan: Plan, partial_o: torch.Tensor, stats: torch.Tensor, out: torch.Tensor,
        log2_scale: float, *, split_counts: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None, out_stats: torch.Tensor | None = None) -> torch.Tensor:
    """Launches ``plan`` on these tensors (of the plan's layout); returns ``out``."""
    plan.launch(partial_o.data_ptr(), stats.data_ptr(), address(split_counts), address(sinks),
                out.data_ptr(), address(out_stats), log2_scale)
    return out


def launch(config: KernelConfig, stats_format: int, partial_o: torch.Tensor, stats: torch.Tensor,
           out: torch.Tensor, log2_scale: float, export_scale: float, *, pdl: bool = False,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One launch of ``config``, whatever the dispatcher would choose (benchmarks and tests)."""
    plan = Plan(config, stats_format, partial_o, stats, out, sinks, export_scale, pdl=pdl)
    return run(plan, partial_o, stats, out, log2_scale, sinks=sinks)
