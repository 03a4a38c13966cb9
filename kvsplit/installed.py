"""Facts about the installed kernel build that commands need, each read in one place.

The kernel layer owns them; commands ask here so that when a fact moves (the
build hash may split into a GPU and a CPU hash) one function changes.
"""

from __future__ import annotations


def build_hash() -> str:
    """Hash of the installed kernel build: the build whose tuning results this install uses."""
    from . import _native

    return _native.ext().build_hash


def head_dims() -> tuple[int, ...]:
    """The head dims the installed kernels support."""
    from .merge import HEAD_DIMS  # imports torch: only commands that need the fact pay for it

    return tuple(HEAD_DIMS)
