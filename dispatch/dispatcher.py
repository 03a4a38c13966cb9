"""Per-call choice of kv_split: a forced or heuristic K, then the constraints."""

from __future__ import annotations

import os

import torch

from .constraints import KV_SPLITS, constrain
from .device import DeviceFacts

__all__ = ["KV_SPLITS", "choose", "pdl_enabled"]


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def pdl_enabled() -> bool:
    """Whether launches use programmatic dependent launch (``KVSPLIT_PDL=1``)."""
    return os.environ.get("KVSPLIT_PDL", "0") == "1"


def choose(facts: DeviceFacts, head_dim: int, partial_dtype: torch.dtype, out_dtype: torch.dtype,
           stats_format: int, num_splits: int, rows: int, forced: int | None) -> int:
    """K for one call: ``forced`` (or the largest K) halved until the constraints hold."""
    return constrain(forced or KV_SPLITS[-1], head_dim=head_dim,
                     elem_bytes=partial_dtype.itemsize, rows=rows, num_splits=num_splits,
                     sm_count=facts.sm_count if facts.is_cuda else None,
                     max_split=_env_int("KVSPLIT_MAX_SPLIT"))
