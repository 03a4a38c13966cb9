"""Facts about the installed kernel build that commands need, each read in one place.

The kernel layer owns them (:mod:`kvsplit.config`); commands ask here so that
when a fact moves only these functions change.
"""

from __future__ import annotations


def build_hashes() -> tuple[str, ...]:
    """The hashes whose tuning results this install uses: its CUDA kernels' (if built) and its CPU twin's."""
    from .config import build_hash, has_cuda_kernels

    hashes = [build_hash(True)] if has_cuda_kernels() else []
    return tuple(dict.fromkeys([*hashes, build_hash(False)]))


def head_dims() -> tuple[int, ...]:
    """The head dims the installed kernels support."""
    from .config import HEAD_DIMS

    return tuple(HEAD_DIMS)
