"""Loads the compiled module once and says clearly when it is missing."""

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

