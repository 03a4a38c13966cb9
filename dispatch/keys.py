"""Tuning keys and the bucketing policy for rows and num_splits.

Policy: rows and num_splits are each rounded *up* to the nearest half-octave,
i.e. the smallest value of the form 2^e or 3 * 2^(e-1) that is >= the value
(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, ...). A bucket
spans at most a factor 1.5, so the shapes that share a key share their grid
size and merge depth to within that factor; the tuner profiles the bucket's
own value (its upper end), and the constraints are always re-applied with the
caller's exact shape.
"""

from __future__ import annotations

import torch

from .device import DeviceFacts

STATS_FORMATS = {0: "maxsum", 1: "lse"}


def bucket(value: int) -> int:
    """Half-octave bucket (upper end) of a positive integer."""
    if value <= 2:
        return max(value, 1)
    power = 1 << (value - 1).bit_length()  # smallest power of two >= value
    three_quarters = power * 3 // 4
    return three_quarters if value <= three_quarters else power


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the database's spelling)."""
    return str(dtype).removeprefix("torch.")


def device_info(facts: DeviceFacts):
    """The database's DeviceInfo for a device."""
    from ..db import DeviceInfo

    return DeviceInfo(name=facts.name[:128], cc_major=facts.cc_major, cc_minor=facts.cc_minor,
                      sm_count=facts.sm_count)


def tuning_key(facts: DeviceFacts, build_hash: str, head_dim: int, partial_dtype: str,
               out_dtype: str, stats_format: str, num_splits: int, rows: int):
    """The database key of a call, with rows and num_splits bucketed."""
    from ..db import TuningKey

    return TuningKey(device=device_info(facts), build_hash=build_hash, head_dim=head_dim,
                     partial_dtype=partial_dtype, out_dtype=out_dtype, stats_format=stats_format,
                     num_splits=bucket(num_splits), rows=bucket(rows))
