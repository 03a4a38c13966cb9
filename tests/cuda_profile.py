"""The CUDA kernels one call launches, as the CUDA profiler names them."""

from __future__ import annotations

import torch


def profiled_kernels(call, *, ignore: tuple[str, ...] = ()):
    """(names of the CUDA kernels ``call()`` launches, its result); ``ignore``: prefixes of
    names left out (copies and fills the call makes beside its kernels)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = call()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
             and not (ignore and e.name.startswith(ignore))]
    return names, result
