"""dispatch/keys.py: the bucketing policy and the tuning key.

Policy (keys.py docstring): rows are rounded up to a multiple of 1/8 of the
power of two at or above them, at least 1; num_splits to a multiple of 1/16
of theirs, at least 4. The oracle below enumerates the
bucket values octave by octave instead of computing them the way keys.py does.
"""

from __future__ import annotations

import bisect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsplit.db import DeviceInfo, TuningKey
from kvsplit.dispatch.device import DeviceFacts
from kvsplit.dispatch.keys import bucket, bucket_num_splits, device_info, dtype_name, tuning_key

SETTINGS = settings(max_examples=500, deadline=None, database=None)


def bucket_values(per_octave: int, min_step: int, top: int = 2**40) -> list[int]:
    """Every bucket value up to ``top``: each octave (lo, hi] in steps of max(min_step, hi / n)."""
    values, lo = [1], 1
    while lo < top:
        hi = 2 * lo
        step = max(min_step, hi // per_octave)
        first = (lo // step + 1) * step
        values += list(range(first, hi + 1, step))
        lo = hi
    return sorted(set(values))


ROWS = bucket_values(8, 1)
SPLITS = [v for v in bucket_values(16, 4) if v % 4 == 0]

values = st.one_of(st.integers(1, 300), st.integers(1, 2_000_000), st.integers(1, 2**39))


@pytest.mark.parametrize("value, expected", [
    (1, 1), (2, 2), (3, 3), (5, 5), (8, 8), (9, 10), (17, 20), (33, 40), (40, 40), (65, 80),
    (100, 112), (129, 160), (300, 320), (1000, 1024), (1025, 1280), (2048, 2048),
    (1_000_000, 1_048_576),
])
def test_known_row_buckets(value, expected):
    assert bucket(value) == expected


@SETTINGS
@given(values)
def test_row_bucket_is_the_smallest_bucket_value_at_or_above(value):
    b = bucket(value)
    assert b == ROWS[bisect.bisect_left(ROWS, value)]
    assert value <= b and 4 * b <= 5 * value  # at most 25 % above


@SETTINGS
@given(values)
def test_buckets_are_idempotent(value):
    assert bucket(bucket(value)) == bucket(value)
    assert bucket_num_splits(bucket_num_splits(value)) == bucket_num_splits(value)


@SETTINGS
@given(values, values)
def test_buckets_are_monotone(a, b):
    low, high = sorted((a, b))
    assert bucket(low) <= bucket(high)
    assert bucket_num_splits(low) <= bucket_num_splits(high)


@SETTINGS
@given(st.sampled_from(ROWS[:-1]))
def test_bucket_values_are_their_own_bucket_and_bound_the_next(value):
    assert bucket(value) == value
    assert bucket(value + 1) == ROWS[ROWS.index(value) + 1]


H200 = DeviceFacts("NVIDIA H200", 9, 0, 132, True)
CPU = DeviceFacts("cpu: test", 0, 0, 2, False)


@SETTINGS
@given(st.sampled_from([H200, CPU]), st.sampled_from([64, 128, 256, 512]),
       st.sampled_from(["bfloat16", "float16", "float32"]), st.sampled_from(["maxsum", "lse"]),
       st.integers(1, 2048), st.integers(1, 2_000_000))
def test_tuning_key_buckets_rows_and_num_splits_and_keeps_the_rest(
        facts, head_dim, partial_dtype, stats_format, num_splits, rows):
    out_dtype = "bfloat16" if partial_dtype == "float32" else partial_dtype
    key = tuning_key(facts, "build-1", head_dim, partial_dtype, out_dtype, stats_format,
                     num_splits, rows)
    assert isinstance(key, TuningKey)
    assert key.device == DeviceInfo(name=facts.name, cc_major=facts.cc_major,
                                    cc_minor=facts.cc_minor, sm_count=facts.sm_count)
    assert (key.build_hash, key.head_dim, key.partial_dtype, key.out_dtype, key.stats_format) == (
        "build-1", head_dim, partial_dtype, out_dtype, stats_format)
    assert key.num_splits == bucket_num_splits(num_splits) and key.rows == bucket(rows)
    assert key.choice_key == (head_dim, partial_dtype, out_dtype, stats_format,
                              bucket_num_splits(num_splits), bucket(rows))
    # Every shape of one bucket shares the key (and its hash, for dictionaries).
    top = tuning_key(facts, "build-1", head_dim, partial_dtype, out_dtype, stats_format,
                     bucket_num_splits(num_splits), bucket(rows))
    assert top == key and hash(top) == hash(key)


@pytest.mark.parametrize("value, expected", [(1, 4), (4, 4), (5, 8), (16, 16), (20, 20),
                                             (21, 24), (63, 64), (64, 64), (65, 72), (100, 104),
                                             (132, 144), (200, 208), (264, 288), (1000, 1024)])
def test_num_splits_buckets(value, expected):
    assert bucket_num_splits(value) == expected


@SETTINGS
@given(values)
def test_num_splits_bucket_is_the_smallest_bucket_value_at_or_above(value):
    b = bucket_num_splits(value)
    assert b == SPLITS[bisect.bisect_left(SPLITS, value)]
    if value <= 64:
        # The same number of 4-deep load batches (at K = 1) as the exact shape.
        assert -(-b // 4) == -(-value // 4) and b - value < 4
    else:
        assert 8 * b <= 9 * value  # at most 12.5 % above


def test_shapes_in_different_buckets_get_different_keys():
    one = tuning_key(H200, "b", 128, "bfloat16", "bfloat16", "maxsum", 132, 64)
    assert one == tuning_key(H200, "b", 128, "bfloat16", "bfloat16", "maxsum", 129, 57)
    assert one != tuning_key(H200, "b", 128, "bfloat16", "bfloat16", "maxsum", 145, 64)
    assert one != tuning_key(H200, "b", 128, "bfloat16", "bfloat16", "maxsum", 132, 65)
    assert one != tuning_key(H200, "other", 128, "bfloat16", "bfloat16", "maxsum", 132, 64)
    assert one != tuning_key(CPU, "b", 128, "bfloat16", "bfloat16", "maxsum", 132, 64)


def test_device_info_truncates_long_names_to_the_database_limit():
    facts = DeviceFacts("x" * 300, 12, 1, 170, True)
    assert device_info(facts) == DeviceInfo(name="x" * 128, cc_major=12, cc_minor=1, sm_count=170)


@pytest.mark.parametrize("dtype, name", [(torch.bfloat16, "bfloat16"), (torch.float16, "float16"),
                                         (torch.float32, "float32")])
def test_dtype_name_is_the_database_spelling(dtype, name):
    assert dtype_name(dtype) == name
