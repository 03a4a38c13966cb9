"""What the dispatcher and the tuner need to know about a device, read once."""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class DeviceFacts:
    """Identity of a device as it appears in tuning keys.

    ``sm_count`` is the multiprocessor count of a GPU; for the CPU it is the
    number of logical cores and ``cc`` is (0, 0). One instance per device
    (:func:`device_facts` caches them), compared and hashed by identity so
    that the dispatcher's per-call lookup stays cheap.
    """

    name: str
    cc_major: int
    cc_minor: int
    sm_count: int
    is_cuda: bool


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine() or "unknown")


@functools.cache
def _facts(device_type: str, index: int | None) -> DeviceFacts:
    if device_type == "cuda":
        props = torch.cuda.get_device_properties(index)
        return DeviceFacts(props.name, props.major, props.minor, props.multi_processor_count, True)
    return DeviceFacts(_cpu_name(), 0, 0, os.cpu_count() or 1, False)


_BY_DEVICE: dict[torch.device, DeviceFacts] = {}


def device_facts(device: torch.device) -> DeviceFacts:
    """Facts for ``device`` (cached per device; one dictionary lookup after the first call)."""
    facts = _BY_DEVICE.get(device)
    if facts is None:
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            facts = _facts("cuda", index)
            if device.index is None:  # "cuda" means the current device: not cacheable
                return facts
        else:
            facts = _facts("cpu", None)
        _BY_DEVICE[device] = facts
    return facts
