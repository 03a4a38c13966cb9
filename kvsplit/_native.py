"""Loads the compiled modules once and says clearly when one is missing."""

from __future__ import annotations

import functools
from types import ModuleType


@functools.cache
def ext() -> ModuleType:
    try:
        from . import _ext
    except ImportError as error:  # pragma: no cover - only without a build
        raise ImportError(
            "kvsplit's compiled module is missing: install the package "
            "(pip install .) rather than importing it from the source tree"
        ) from error
    return _ext


@functools.cache
def bench() -> ModuleType:
    """kvsplit._bench, the benchmarks' reference kernels (csrc/cuda/probe.cu)."""
    try:
        from . import _bench
    except ImportError as error:
        raise ImportError(
            "kvsplit._bench, the benchmarks' reference kernels, is not in this build: "
            "wheels leave it out; build from source with nvcc and "
            "-C cmake.define.KVSPLIT_BENCH_KERNELS=ON (the default)"
        ) from error
    return _bench
