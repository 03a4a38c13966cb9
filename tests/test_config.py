"""kvsplit/config.py: the kernel layer's rules as the binding exports them, against worked cases.

The cases are worked out by hand from the kernels' geometry, not computed by a
second statement of the rule (a test that re-derived the rule would drift with
it): KvSplit, a CTA of 512 threads, 16 bytes a thread, K groups of 512 / K
threads, each holding whole rows of head_dim x element bytes; DSplit, a row's
16-byte vectors cut into slices of 4..32 lanes (a power of two at or above
the vectors of a slice), K groups of a slice's lanes, 32..512 threads a CTA.
"""

from __future__ import annotations

import pytest

from kvsplit import _native
from kvsplit.config import (DEFAULT_OUT_DTYPES, FAMILY_CODES, KEY_STATS_FORMATS, KVSPLIT,
                            STATS_FORMAT_NAMES, KernelConfig, check, kvsplit_rows_per_band)

# (kv_split, head_dim, bytes per element): (the rule the config breaks or None, rows a CTA's
# group covers per band). A group holds (512 / K) x 16 bytes.
KVSPLIT_CASES = {
    (1, 64, 2): (None, 64),             # 8192 bytes a group, rows of 128
    (1, 1024, 4): (None, 2),            # 8192 / 4096
    (2, 1024, 4): (None, 1),            # 4096 / 4096: exactly one row
    (4, 1024, 4): ("group_holds_row", 0),  # 2048 < 4096
    (4, 1024, 2): (None, 1),            # 2048 / 2048
    (8, 1024, 2): ("group_holds_row", 0),  # 1024 < 2048
    (8, 512, 2): (None, 1),             # 1024 / 1024
    (16, 512, 2): ("group_holds_row", 0),  # 512 < 1024
    (16, 256, 2): (None, 1),            # 512 / 512
    (16, 128, 2): (None, 2),            # 512 / 256
    (16, 128, 4): (None, 1),            # 512 / 512
    (16, 256, 4): ("group_holds_row", 0),  # 512 < 1024
    (8, 256, 4): (None, 1),             # 1024 / 1024
    (4, 576, 2): (None, 1),             # 2048 / 1152 (DeepSeek's latent head dim)
    (8, 576, 2): ("group_holds_row", 0),  # 1024 < 1152
    (2, 8, 2): (None, 256),             # one 16-byte vector a row: 4096 / 16
}


@pytest.mark.parametrize("case", sorted(KVSPLIT_CASES))
def test_kvsplit_legality_worked_cases(case):
    kv_split, head_dim, elem_bytes = case
    rule, rows = KVSPLIT_CASES[case]
    assert check(KernelConfig.kvsplit(kv_split), head_dim, elem_bytes) == rule
    assert kvsplit_rows_per_band(head_dim, elem_bytes, kv_split) == rows


# (slices, kv_split, depth, head_dim, bytes per element): the rule the config breaks, or None.
DSPLIT_CASES = {
    (1, 2, 8, 128, 2): None,            # 16 lanes x 2 = 32 threads
    (1, 1, 8, 128, 2): "cta_threads",   # 16 threads
    (1, 32, 8, 128, 2): None,           # 512 threads
    (1, 64, 8, 128, 2): "cta_threads",  # 1024 threads
    (8, 16, 8, 64, 2): "slice_width",   # 8 vectors in 8 slices: 1 lane
    (4, 8, 4, 128, 2): None,            # 4 lanes x 8 = 32
    (2, 16, 16, 512, 2): None,          # 32 lanes x 16 = 512
    (16, 4, 8, 512, 2): "cta_threads",  # 4 lanes x 4 = 16
    (16, 8, 8, 512, 2): None,           # 4 x 8 = 32
    (1, 4, 8, 576, 2): "slice_width",   # 72 vectors in one slice: more than 32 lanes
    (4, 4, 8, 576, 2): None,            # 18 vectors a slice: 32 lanes x 4 = 128
    (2, 8, 8, 1024, 4): "slice_width",  # 128 vectors a slice
    (16, 2, 4, 1024, 4): None,          # 16 lanes x 2 = 32
}


@pytest.mark.parametrize("case", sorted(DSPLIT_CASES))
def test_dsplit_legality_worked_cases(case):
    slices, kv_split, depth, head_dim, elem_bytes = case
    assert check(KernelConfig.dsplit(slices, kv_split, depth), head_dim, elem_bytes) == \
        DSPLIT_CASES[case]


@pytest.mark.parametrize("kv_split", [0, 3, 32, -1])
def test_a_kvsplit_k_outside_its_legal_values_is_refused(kv_split):
    with pytest.raises(ValueError, match="kv_split"):
        KernelConfig.kvsplit(kv_split)
    ext = _native.ext()
    error = ext.check_config(FAMILY_CODES[KVSPLIT], 1, kv_split, 4, 1, 128, 2)
    assert ext.ERRORS[error] == "kv_split"


def test_the_vocabulary_is_the_bindings():
    ext = _native.ext()
    assert STATS_FORMAT_NAMES == {code: name for name, code in ext.STATS_FORMATS.items()}
    assert KEY_STATS_FORMATS == ("maxsum", "lse", "maxsum:scattered", "lse:scattered")
    assert DEFAULT_OUT_DTYPES == {"bfloat16": "bfloat16", "float16": "float16",
                                  "float32": "bfloat16"}
