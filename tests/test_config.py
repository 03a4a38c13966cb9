"""kvsplit/config.py: the kernel layer's rules as the binding exports them, against worked cases.

The cases are worked out by hand from the KvSplit kernel's geometry (a CTA of
512 threads, 16 bytes a thread, K groups of 512 / K threads, each holding whole
rows of head_dim x element bytes), not computed by a second statement of the
rule: a test that re-derived the rule would drift with it.
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
