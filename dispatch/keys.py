"""Tuning keys and the bucketing policy for rows and num_splits.

Policy: a value is rounded *up* to a multiple of a step that is a fixed
fraction of the power of two at or above it:
- rows: step = that power / 8, at least 1 (exact up to 8; then 10, 12, ...
  16, 20, ... 32, 40, ... 64, 80, ... 128, 160, ...): four buckets per
  octave, at most 25 % above the value;
- num_splits: step = that power / 16, at least 4 (multiples of 4 up to 64,
  one batch of 4-deep loads; then 72, 80, ... 128, 144, ... 256, 288, ...):
  eight buckets per octave, at most 12.5 % above.
The DSplit family's best group count follows rows and num_splits closely
(groups of a few partials, ~64K threads in all), so buckets are narrow
(docs/history.md, "Pruning").
A key is profiled at the shape that asked for it: the first call of that
bucket at first use, the grid's own values in `kvsplit tune` (the buckets'
upper ends only for keys met during CUDA-graph capture, whose shapes are not
kept). The constraints are always re-applied with the caller's exact shape.

Layout class: a call whose stats of adjacent rows are not adjacent in memory
(a head-major LSE: vLLM, FlashAttention) reads one 32-byte sector per row
where a split-major call reads one per band of rows, so it is keyed apart,
as stats format ``"lse:scattered"`` (``"maxsum:scattered"``). How partials
or outputs are strided does not change what a thread group reads (16 bytes
of one row per thread either way), so it is not part of the key.
"""

from __future__ import annotations

import torch

from ..config import SCATTERED, STATS_FORMAT_NAMES
from .device import DeviceFacts

STATS_FORMATS = STATS_FORMAT_NAMES  # code -> name, the binding's


def scattered_stats(maxsum: bool, row_shape, row_strides) -> bool:
    """Whether the stats of adjacent rows (the innermost row dim of size > 1) are apart."""
    for size, stride in zip(reversed(tuple(row_shape)), reversed(tuple(row_strides))):
        if size > 1:
            return stride > (2 if maxsum else 1)
    return False


def key_stats_format(stats_format: str, scattered: bool) -> str:
    """The key's stats format field: ``"lse"`` or ``"lse:scattered"`` (likewise maxsum)."""
    return stats_format + SCATTERED if scattered else stats_format


def _round_up(value: int, per_octave: int, min_step: int) -> int:
    value = max(value, 1)
    power = 1 << (value - 1).bit_length()  # smallest power of two >= value
    step = max(min_step, power // per_octave)
    return -(-value // step) * step


def bucket(value: int) -> int:
    """rows bucket (upper end): a multiple of 1/8 of the power of two at or above."""
    return _round_up(value, 8, 1)


def bucket_num_splits(value: int) -> int:
    """num_splits bucket (upper end): a multiple of 1/16 of the power of two at or above, and of 4."""
    return _round_up(value, 16, 4)


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the database's spelling)."""
    return str(dtype).removeprefix("torch.")


def device_info(facts: DeviceFacts):
    """The database's DeviceInfo for a device."""
    from ..db import DeviceInfo  # the store's types load at the first key, not with kvsplit

    return DeviceInfo(name=facts.name[:128], cc_major=facts.cc_major, cc_minor=facts.cc_minor,
                      sm_count=facts.sm_count)


def tuning_key(facts: DeviceFacts, build_hash: str, head_dim: int, partial_dtype: str,
               out_dtype: str, stats_format: str, num_splits: int, rows: int,
               scattered: bool = False):
    """The database key of a call, with rows and num_splits bucketed."""
    from ..db import TuningKey

    return TuningKey(device=device_info(facts), build_hash=build_hash, head_dim=head_dim,
                     partial_dtype=partial_dtype, out_dtype=out_dtype,
                     stats_format=key_stats_format(stats_format, scattered),
                     num_splits=bucket_num_splits(num_splits), rows=bucket(rows))
