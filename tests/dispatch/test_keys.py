"""dispatch/keys.py: the half-octave bucketing policy and the tuning key (SPEC section 4).

Policy (keys.py docstring): rows and num_splits are rounded up to the
smallest value of the form 2^e or 3 * 2^(e-1) that is >= the value, so a
bucket spans at most a factor 1.5. The oracle below enumerates those values
instead of computing them the way keys.py does.
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

# Every half-octave value up to 2^62: 1, 2, 3, 4, 6, 8, 12, 16, 24, ...
HALF_OCTAVES = sorted({1 << e for e in range(63)} | {3 << e for e in range(62)})

values = st.one_of(st.integers(1, 300), st.integers(1, 2_000_000), st.integers(1, 2**40))


def is_half_octave(value: int) -> bool:
    def power_of_two(n: int) -> bool:
        return n >= 1 and n & (n - 1) == 0

    return power_of_two(value) or (value % 3 == 0 and power_of_two(value // 3))


@pytest.mark.parametrize("value, expected", [
    (1, 1), (2, 2), (3, 3), (4, 4), (5, 6), (6, 6), (7, 8), (9, 12), (13, 16), (17, 24),
    (20, 24), (25, 32), (33, 48), (100, 128), (129, 192), (132, 192), (193, 256), (264, 384),
    (385, 512), (1024, 1024), (1025, 1536), (1_000_000, 1_048_576),
])
def test_known_buckets(value, expected):
    assert bucket(value) == expected


@SETTINGS
@given(values)
def test_bucket_is_the_smallest_half_octave_at_or_above(value):
    b = bucket(value)
    assert b >= value
    assert 2 * b <= 3 * value  # a bucket spans at most a factor 1.5
    assert is_half_octave(b)
    assert b == HALF_OCTAVES[bisect.bisect_left(HALF_OCTAVES, value)]


@SETTINGS
@given(values)
def test_bucket_is_idempotent(value):
    assert bucket(bucket(value)) == bucket(value)


@SETTINGS
@given(values, values)
def test_bucket_is_monotone(a, b):
    low, high = sorted((a, b))
    assert bucket(low) <= bucket(high)


@SETTINGS
@given(st.sampled_from(HALF_OCTAVES[:45]))
def test_half_octaves_are_their_own_bucket_and_bound_the_next(value):
    assert bucket(value) == value
    assert bucket(value + 1) == HALF_OCTAVES[HALF_OCTAVES.index(value) + 1]


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
                                             (21, 24), (63, 64), (64, 64), (65, 96), (100, 128),
                                             (132, 192), (264, 384)])
def test_num_splits_buckets(value, expected):
    assert bucket_num_splits(value) == expected


@SETTINGS
@given(st.integers(1, 100_000))
def test_num_splits_bucket_keeps_the_load_batches_up_to_64(value):
    b = bucket_num_splits(value)
    assert b >= value and bucket_num_splits(b) == b
    if value <= 64:
        # The same number of 4-deep load batches (at K = 1) as the exact shape.
        assert -(-b // 4) == -(-value // 4) and b - value < 4


def test_shapes_in_different_buckets_get_different_keys():
    one = tuning_key(H200, "b", 128, "bfloat16", "bfloat16", "maxsum", 132, 64)
    assert one == tuning_key(H200, "b", 128, "bfloat16", "bfloat16", "maxsum", 190, 49)
    assert one != tuning_key(H200, "b", 128, "bfloat16", "bfloat16", "maxsum", 193, 64)
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
