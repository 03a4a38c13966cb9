"""Tuning keys and the bucketing policy for rows and num_splits.

Policy:
- rows are rounded *up* to the nearest half-octave, i.e. the smallest value
  of the form 2^e or 3 * 2^(e-1) that is >= rows (1, 2, 3, 4, 6, 8, 12, 16,
  24, 32, 48, 64, 96, 128, 192, 256, ...): a bucket spans at most a factor
  1.5 of grid size;
- num_splits up to 64 is rounded up to a multiple of 4 (one batch of the
  kernel's 4-deep loads): there, one batch more or less per group decides
  between neighbouring K (on an H200, half-octave buckets cost up to 6 % at
  N = 20, tuned as 24); above 64 it takes half-octaves like rows.
The tuner profiles the bucket's own value (its upper end), and the
constraints are always re-applied with the caller's exact shape.
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


def bucket_num_splits(value: int) -> int:
    """num_splits bucket: a multiple of 4 up to 64, then half-octaves."""
    return -(-max(value, 1) // 4) * 4 if value <= 64 else bucket(value)


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
                     num_splits=bucket_num_splits(num_splits), rows=bucket(rows))
