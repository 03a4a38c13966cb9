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


def head_dim_supported(head_dim: int, partial_dtype: str) -> bool:
    """Whether the installed kernels take ``head_dim`` with ``partial_dtype`` partials."""
    from .config import head_dim_supported as supported

    return supported(head_dim, partial_dtype)


def head_dim_rule(partial_dtype: str) -> str:
    """The installed kernels' head-dim rule for ``partial_dtype``, in words."""
    from .config import head_dim_rule as rule

    return rule(partial_dtype)


def partial_dtypes() -> tuple[str, ...]:
    """Partial dtype names the installed kernels read."""
    from .config import PARTIAL_DTYPES

    return PARTIAL_DTYPES


def out_dtypes() -> tuple[str, ...]:
    """Output dtype names the installed kernels write."""
    from .config import OUT_DTYPES

    return OUT_DTYPES


def stats_formats() -> tuple[str, ...]:
    """Stats formats a tuning key can hold: each kernel format, and it with ``:scattered``."""
    from .config import KEY_STATS_FORMATS

    return KEY_STATS_FORMATS


def default_out_dtype(partial_dtype: str) -> str:
    """The output dtype of a merge of ``partial_dtype`` partials that names none."""
    from .config import DEFAULT_OUT_DTYPES

    return DEFAULT_OUT_DTYPES[partial_dtype]
