"""dispatch/constraints.py against worked cases, and the properties its halving must have.

constrain() halves K until (a) K <= max_split, (b) the kernel layer takes the
config (a group of 512 / K threads, 16 bytes each, holds a whole row: the
binding's check, whose own worked cases are in tests/test_config.py), (c) on a
GPU the CTA count fits 2 CTAs per SM (K = 1 always fits: its CTAs loop over
slices), (d) K <= num_splits; it never goes below 1. The expected answers are
tables worked out by hand, not a second statement of the rules.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsplit.config import FAMILIES, KernelConfig
from kvsplit.dispatch.constraints import (DSPLIT, DSPLIT_DEPTHS, DSPLIT_KV_SPLITS,
                                          DSPLIT_SLICES, FEW_MAX_SPLITS, FEW_VECTORS, KV_SPLITS,
                                          KVSPLIT, constrain, constrain_config,
                                          dsplit_violations, few_mended, group_quant_config,
                                          in_place_config, kvsplit_config, num_ctas,
                                          rows_per_cta, valid_configs, valid_kv_splits, violations)

SETTINGS = settings(max_examples=300, deadline=None, database=None)


shapes = st.fixed_dictionaries({
    "head_dim": st.sampled_from([32, 64, 128, 256, 512, 1024]),
    "elem_bytes": st.sampled_from([2, 4]),
    "rows": st.one_of(st.integers(0, 64), st.integers(0, 2_000_000)),
    "num_splits": st.one_of(st.integers(0, 20), st.integers(0, 2048)),
    "sm_count": st.one_of(st.none(), st.integers(1, 200)),
    "max_split": st.one_of(st.none(), st.integers(-1, 40)),
})


@SETTINGS
@given(st.sampled_from(KV_SPLITS), shapes)
def test_constrain_is_the_largest_fitting_power_of_two(k_requested, shape):
    k = constrain(k_requested, **shape)
    assert k in KV_SPLITS and k <= k_requested
    if k > 1:
        assert not violations(k, **shape)
    if shape["max_split"] is not None and shape["max_split"] >= 1:
        assert k <= shape["max_split"]
    if shape["num_splits"] >= 1:
        assert k <= shape["num_splits"]
    # Nothing between k and the request would have done.
    for bigger in KV_SPLITS:
        if k < bigger <= k_requested:
            assert violations(bigger, **shape)


SM_H100 = 132  # H100 / H200 SXM

# (K, shape): the constraints K breaks, worked out by hand. A KvSplit CTA covers
# (512 / K) x 16 // (head_dim x element bytes) rows; the grid budget is 2 x SMs CTAs.
VIOLATION_CASES = [
    (16, dict(head_dim=512, elem_bytes=2, rows=1, num_splits=64, sm_count=None),
     ["group_holds_row"]),  # 512 bytes a group, rows of 1024
    (8, dict(head_dim=512, elem_bytes=2, rows=1, num_splits=64, sm_count=None), []),
    (8, dict(head_dim=128, elem_bytes=2, rows=10**6, num_splits=64, sm_count=SM_H100),
     ["cta_budget"]),  # 4 rows a CTA: 250000 CTAs > 264
    (8, dict(head_dim=128, elem_bytes=2, rows=10**6, num_splits=64, sm_count=None), []),
    (16, dict(head_dim=128, elem_bytes=2, rows=528, num_splits=64, sm_count=SM_H100),
     []),  # 2 rows a CTA: 264 CTAs, the budget exactly
    (16, dict(head_dim=128, elem_bytes=2, rows=529, num_splits=64, sm_count=SM_H100),
     ["cta_budget"]),  # 265 CTAs
    (4, dict(head_dim=64, elem_bytes=2, rows=8, num_splits=3, sm_count=None), ["num_splits"]),
    (16, dict(head_dim=64, elem_bytes=2, rows=8, num_splits=64, sm_count=None, max_split=8),
     ["max_split"]),
    (16, dict(head_dim=1024, elem_bytes=2, rows=10**6, num_splits=4, sm_count=SM_H100,
              max_split=2),
     ["max_split", "group_holds_row", "num_splits"]),  # no CTA count without a group
    (1, dict(head_dim=1024, elem_bytes=4, rows=10**6, num_splits=0, sm_count=1), []),
    (2, dict(head_dim=1024, elem_bytes=4, rows=8, num_splits=1, sm_count=None),
     ["num_splits"]),  # a group of 4096 bytes holds one float32 row of 1024
    (4, dict(head_dim=1024, elem_bytes=4, rows=8, num_splits=8, sm_count=None),
     ["group_holds_row"]),
]


@pytest.mark.parametrize("k, shape, broken", VIOLATION_CASES)
def test_violations_worked_cases(k, shape, broken):
    assert violations(k, **shape) == broken


@SETTINGS
@given(st.sampled_from(KV_SPLITS), shapes)
def test_violations_names_each_broken_constraint_once(k, shape):
    broken = violations(k, **shape)
    assert len(broken) == len(set(broken))
    assert set(broken) <= {"max_split", "group_holds_row", "cta_budget", "num_splits"}


@SETTINGS
@given(shapes)
def test_constraints_are_monotone_in_k(shape):
    """A K that fits makes every smaller K fit, so halving finds the largest."""
    fits = [not violations(k, **shape) for k in KV_SPLITS]
    for smaller, larger in zip(fits, fits[1:]):
        assert smaller or not larger
    results = [constrain(k, **shape) for k in KV_SPLITS]
    assert results == sorted(results)


@SETTINGS
@given(shapes)
def test_valid_kv_splits(shape):
    valid = valid_kv_splits(**shape)
    assert valid == [k for k in KV_SPLITS if k == 1 or not violations(k, **shape)]
    assert valid[0] == 1 and valid == sorted(set(valid))
    assert constrain(KV_SPLITS[-1], **shape) == valid[-1]


@SETTINGS
@given(st.sampled_from(KV_SPLITS), shapes)
def test_the_cpu_has_no_grid_budget(k, shape):
    shape = dict(shape, sm_count=None)
    assert "cta_budget" not in violations(k, **shape)


@SETTINGS
@given(st.sampled_from(KV_SPLITS), st.sampled_from([64, 128, 256, 512]),
       st.sampled_from([2, 4]), st.integers(0, 100_000))
def test_rows_per_cta_and_num_ctas(k, head_dim, elem_bytes, rows):
    per_cta = rows_per_cta(k, head_dim, elem_bytes)  # worked cases: tests/test_config.py
    ctas = num_ctas(k, head_dim, elem_bytes, rows)
    if per_cta:
        assert (ctas - 1) * per_cta < rows <= ctas * per_cta or rows == ctas == 0
    else:
        assert ctas == 0


@pytest.mark.parametrize("request_k, shape, expected", [
    # (b) a group must hold a row: 16-bit D = 512 allows K <= 8, float32 K <= 4.
    (16, dict(head_dim=512, elem_bytes=2, rows=1, num_splits=1024, sm_count=SM_H100), 8),
    (16, dict(head_dim=512, elem_bytes=4, rows=1, num_splits=1024, sm_count=SM_H100), 4),
    (16, dict(head_dim=256, elem_bytes=4, rows=1, num_splits=1024, sm_count=SM_H100), 8),
    (16, dict(head_dim=128, elem_bytes=4, rows=1, num_splits=1024, sm_count=SM_H100), 16),
    (16, dict(head_dim=64, elem_bytes=2, rows=1, num_splits=1024, sm_count=None), 16),
    (16, dict(head_dim=1024, elem_bytes=4, rows=1, num_splits=1024, sm_count=None), 2),
    # (c) the grid budget of 2 CTAs per SM.
    (16, dict(head_dim=512, elem_bytes=2, rows=2048, num_splits=1024, sm_count=SM_H100), 1),
    (16, dict(head_dim=512, elem_bytes=2, rows=64, num_splits=SM_H100, sm_count=SM_H100), 8),
    (16, dict(head_dim=128, elem_bytes=2, rows=528, num_splits=64, sm_count=SM_H100), 16),
    (16, dict(head_dim=128, elem_bytes=2, rows=529, num_splits=64, sm_count=SM_H100), 8),
    (16, dict(head_dim=128, elem_bytes=2, rows=10**6, num_splits=64, sm_count=SM_H100), 1),
    (16, dict(head_dim=128, elem_bytes=2, rows=10**6, num_splits=64, sm_count=None), 16),
    # (d) K <= num_splits.
    (16, dict(head_dim=64, elem_bytes=2, rows=8, num_splits=3, sm_count=SM_H100), 2),
    (16, dict(head_dim=64, elem_bytes=2, rows=8, num_splits=1, sm_count=SM_H100), 1),
    (16, dict(head_dim=64, elem_bytes=2, rows=0, num_splits=0, sm_count=SM_H100), 1),
    (4, dict(head_dim=64, elem_bytes=2, rows=8, num_splits=15, sm_count=None), 4),
    # (a) the upper bound.
    (16, dict(head_dim=64, elem_bytes=2, rows=8, num_splits=64, sm_count=None, max_split=4), 4),
    (16, dict(head_dim=64, elem_bytes=2, rows=8, num_splits=64, sm_count=None, max_split=3), 2),
    (16, dict(head_dim=64, elem_bytes=2, rows=8, num_splits=64, sm_count=None, max_split=0), 1),
    (2, dict(head_dim=64, elem_bytes=2, rows=8, num_splits=64, sm_count=None, max_split=8), 2),
])
def test_known_cases(request_k, shape, expected):
    assert constrain(request_k, **shape) == expected


@pytest.mark.parametrize("kv_split", [0, 3, 6, 32, -1])
def test_constrain_rejects_a_k_outside_kv_splits(kv_split):
    with pytest.raises(ValueError, match="kv_split"):
        constrain(kv_split, head_dim=64, elem_bytes=2, rows=8, num_splits=8, sm_count=None)


# -- the DSplit family and constrain_config ------------------------------------------------

def spec_dsplit_valid(slices, k, *, head_dim, elem_bytes, num_splits, max_split):
    """The DSplit rules, written out: a slice is 4..32 lanes of 16 bytes (a power of two),
    a CTA 32..512 threads, K <= num_splits and K <= the cap (depth is mended separately)."""
    lanes, rest = divmod(head_dim * elem_bytes, 16 * slices)
    return (not rest and lanes in (4, 8, 16, 32) and 32 <= lanes * k <= 512
            and k <= max(num_splits, 1) and (max_split is None or k <= max_split))


# A DSplit config exists only for legal head dims.
dsplit_shapes = shapes.map(lambda shape: dict(shape, head_dim=min(max(shape["head_dim"], 64), 512)))


@SETTINGS
@given(st.sampled_from(DSPLIT_SLICES), st.sampled_from(DSPLIT_KV_SPLITS),
       st.sampled_from(DSPLIT_DEPTHS), dsplit_shapes)
def test_constrain_config_mends_dsplit_by_halving_or_falls_back(slices, k_requested, depth, shape):
    config = constrain_config(KernelConfig.dsplit(slices, k_requested, depth), **shape)
    rules = dict(head_dim=shape["head_dim"], elem_bytes=shape["elem_bytes"],
                 num_splits=shape["num_splits"], max_split=shape["max_split"])
    fitting = [k for k in DSPLIT_KV_SPLITS if k <= k_requested
               and spec_dsplit_valid(slices, k, **rules)]
    if fitting:
        assert config == KernelConfig.dsplit(slices, max(fitting), depth)
        assert not dsplit_violations(config, **rules)
    else:  # KvSplit of the same K (at most 16), constrained
        assert config == kvsplit_config(constrain(min(k_requested, 16), **shape))


@SETTINGS
@given(st.sampled_from(KV_SPLITS), shapes)
def test_constrain_config_of_kvsplit_is_constrain(k_requested, shape):
    assert constrain_config(kvsplit_config(k_requested), **shape) == kvsplit_config(
        constrain(k_requested, **shape))


@SETTINGS
@given(dsplit_shapes)
def test_valid_configs_are_exactly_those_that_constrain_leaves_alone(shape):
    configs = valid_configs(**shape)
    assert configs[0] == kvsplit_config(1)
    everything = [kvsplit_config(k) for k in KV_SPLITS] + [
        KernelConfig.dsplit(p, k, d) for p in DSPLIT_SLICES for k in DSPLIT_KV_SPLITS for d in (4, 8, 16)]
    for config in everything:
        unchanged = constrain_config(config, **shape) == config
        assert unchanged == (config in configs) or config == kvsplit_config(1)


def test_the_rules_are_the_kernel_layers():
    """Legal values come from the compiled module: the lists dispatch/ uses are its lists."""
    assert KV_SPLITS == FAMILIES["kvsplit"]["kv_split"] == (1, 2, 4, 8, 16)
    assert DSPLIT_SLICES == FAMILIES["dsplit"]["slices"]
    assert DSPLIT_KV_SPLITS == FAMILIES["dsplit"]["kv_split"]
    assert DSPLIT_DEPTHS == FAMILIES["dsplit"]["depth"] == (4, 8, 16)
    # A 2-lane slice (64 bf16 in 8 slices) is illegal for the kernel and the CPU twin alike.
    assert dsplit_violations(KernelConfig.dsplit(8, 16), head_dim=64, elem_bytes=2,
                             num_splits=64) == ["slice_width"]
    assert violations(16, head_dim=512, elem_bytes=2, rows=1, num_splits=64,
                      sm_count=None) == ["group_holds_row"]


@pytest.mark.parametrize("family, params", [
    ("dsplit", {"kv_split": 16}), ("persistent", {"kv_split": 16}),
    ("kvsplit", {"kv_split": 3}), ("dsplit", {"depth": 6, "kv_split": 16, "slices": 4}),
])
def test_unknown_configs_cannot_be_made(family, params):
    with pytest.raises(ValueError):
        KernelConfig(family, params)


def test_stored_configs_are_launch_configs():
    config = KernelConfig("dsplit", {"depth": 8, "kv_split": 16, "slices": 4})
    assert (config.family, config.slices, config.kv_split, config.depth) == ("dsplit", 4, 16, 8)
    assert config == KernelConfig.dsplit(4, 16, 8) and config.params == {
        "depth": 8, "kv_split": 16, "slices": 4}
    assert KernelConfig.kvsplit(8).params == {"kv_split": 8}


# -- the Few family ---------------------------------------------------------------------------

def spec_few_lanes(vectors, *, head_dim, elem_bytes):
    """Threads per row of a Few thread of ``vectors`` vectors, written out (0: illegal)."""
    row = head_dim * elem_bytes // 16
    lanes = -(-row // vectors)
    return lanes if vectors in (1, 2, 4) and (vectors - 1) * lanes < row else 0


def spec_few_call_ok(vectors, *, head_dim, elem_bytes, in_place, quant_group):
    """The rules a call adds: in place, a row's threads in one warp (L divides 32); per-group
    scales, whole groups (quant_group * elem_bytes / 16 lanes) in a step of a row."""
    lanes = spec_few_lanes(vectors, head_dim=head_dim, elem_bytes=elem_bytes)
    if not lanes:
        return False
    if in_place and 32 % lanes:
        return False
    return not quant_group or lanes % (quant_group * elem_bytes // 16) == 0


few_shapes = st.fixed_dictionaries({
    "head_dim": st.sampled_from([8, 16, 32, 40, 64, 80, 96, 128, 192, 256, 512, 576, 1024]),
    "elem_bytes": st.sampled_from([2, 4]),
    "rows": st.integers(0, 2_000_000),
    "num_splits": st.integers(0, 64),
    "sm_count": st.one_of(st.none(), st.integers(1, 200)),
    "max_split": st.one_of(st.none(), st.integers(-1, 40)),
})


@SETTINGS
@given(st.sampled_from(FEW_VECTORS), few_shapes)
def test_constrain_config_halves_few_vectors_until_legal(vectors, shape):
    config = constrain_config(KernelConfig.few(vectors), **shape)
    rule = dict(head_dim=shape["head_dim"], elem_bytes=shape["elem_bytes"])
    fitting = [v for v in FEW_VECTORS if v <= vectors and spec_few_lanes(v, **rule)]
    assert config == KernelConfig.few(max(fitting))  # one vector always fits
    # Neither the states nor a cap on K change it: a Few config merges any count.
    assert constrain_config(KernelConfig.few(vectors), **dict(shape, num_splits=4096,
                                                                 max_split=1)) == config


@SETTINGS
@given(st.sampled_from(FEW_VECTORS), few_shapes, st.booleans(), st.sampled_from([0, 64, 128]))
def test_calls_mend_few_configs_to_the_nearest_vectors_their_rules_allow(vectors, shape, in_place,
                                                                         quant_group):
    rule = dict(head_dim=shape["head_dim"], elem_bytes=shape["elem_bytes"])
    if quant_group and shape["head_dim"] % quant_group:
        return  # validation refuses such calls
    call = dict(in_place=in_place, quant_group=quant_group)
    mended = few_mended(KernelConfig.few(vectors), **rule, stats_in_place=in_place,
                        quant_group=quant_group)
    allowed = [v for v in FEW_VECTORS if spec_few_call_ok(v, **rule, **call)]
    if not allowed:
        assert mended is None
        return
    nearest = min(allowed, key=lambda v: (abs(v.bit_length() - vectors.bit_length()), v))
    assert mended == KernelConfig.few(nearest)
    rules = dict(shape)
    del rules["max_split"]
    # A call merges in place or writes per-group FP8 scales, never both (an in-place
    # output is a partial's dtype): each mend serves its own rule.
    if in_place and not quant_group:
        assert in_place_config(KernelConfig.few(vectors), **rules) == mended
    if quant_group and not in_place:
        assert group_quant_config(KernelConfig.few(vectors), **rules,
                                  quant_group=quant_group) == mended
    if quant_group and not in_place:  # one vector a thread always holds whole groups
        assert 1 in allowed


@pytest.mark.parametrize("vectors, shape, expected", [
    # a 2-vector row (16 bf16): four vectors a thread leave steps empty, two do not
    (4, dict(head_dim=16, elem_bytes=2), 2),
    # 5 vectors (40 bf16): 4 a thread is 2 threads, (4 - 1) * 2 >= 5; 2 a thread is 3
    (4, dict(head_dim=40, elem_bytes=2), 2),
    # one vector (8 bf16): only one a thread
    (4, dict(head_dim=8, elem_bytes=2), 1), (2, dict(head_dim=8, elem_bytes=2), 1),
    # D = 576 bf16, 72 vectors: 4 a thread (18 threads a row) is legal
    (4, dict(head_dim=576, elem_bytes=2), 4),
])
def test_known_few_cases(vectors, shape, expected):
    rules = dict(shape, rows=64, num_splits=2, sm_count=132)
    assert constrain_config(KernelConfig.few(vectors), **rules) == KernelConfig.few(expected)


@pytest.mark.parametrize("vectors, head_dim, in_place, quant_group, expected", [
    (1, 512, True, 0, 2),       # 64 threads a row > a warp: two vectors a thread, 32 threads
    (1, 128, True, 0, 1),       # 16 threads a row: in one warp
    (4, 192, True, 0, None),    # 24 vectors: 24, 12 or 6 threads a row, none divides 32
    (4, 128, False, 64, 2),     # 4 threads a row, groups of 8 lanes: 2 a thread (8 threads)
    (4, 576, False, 64, 1),     # 18 threads a row: 72 with one a thread holds groups of 8
    (2, 576, True, 0, None),    # 72 vectors: 72, 36 or 18 threads a row, none divides 32
    (4, 256, False, 128, 2),    # groups of 16 lanes: 16 threads a row (two vectors) hold one
])
def test_known_few_call_cases(vectors, head_dim, in_place, quant_group, expected):
    rules = dict(head_dim=head_dim, elem_bytes=2, rows=64, num_splits=2, sm_count=132)
    mended = few_mended(KernelConfig.few(vectors), head_dim=head_dim, elem_bytes=2,
                        stats_in_place=in_place, quant_group=quant_group)
    assert mended == (None if expected is None else KernelConfig.few(expected))
    if in_place:  # a call no Few config serves runs as KvSplit K = 1
        assert in_place_config(KernelConfig.few(vectors), **rules) == (
            mended or kvsplit_config(1))


def test_few_is_offered_up_to_16_states_on_gpus_only():
    rules = dict(head_dim=128, elem_bytes=2, rows=1024, sm_count=132)
    few = {KernelConfig.few(v) for v in FEW_VECTORS}
    assert few <= set(valid_configs(**rules, num_splits=16))
    assert not few & set(valid_configs(**rules, num_splits=17))
    assert not few & set(valid_configs(**rules, num_splits=2, families=(KVSPLIT, DSPLIT)))
    assert FEW_VECTORS == FAMILIES["few"]["vectors"] == (1, 2, 4)
    assert FEW_MAX_SPLITS == 16
