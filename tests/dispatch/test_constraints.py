"""dispatch/constraints.py against the kernel's constraints, written out independently here.

constrain() halves K until (a) K <= max_split, (b) a group of 512 / K threads,
16 bytes each, holds a whole row, (c) on a GPU the CTA count fits 2 CTAs per
SM (K = 1 always fits: its CTAs loop over slices), (d) K <= num_splits; it
never goes below 1.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsplit.config import FAMILIES, KernelConfig
from kvsplit.dispatch.constraints import (DSPLIT_DEPTHS, DSPLIT_KV_SPLITS, DSPLIT_SLICES,
                                          KV_SPLITS, constrain, constrain_config,
                                          dsplit_violations, kvsplit_config, num_ctas,
                                          rows_per_cta, valid_configs, valid_kv_splits, violations)

SETTINGS = settings(max_examples=300, deadline=None, database=None)


def spec_violations(k, *, head_dim, elem_bytes, rows, num_splits, sm_count, max_split):
    """The kernel constraints that K breaks, by the names dispatch/ uses."""
    group_bytes = (512 // k) * 16
    row_bytes = head_dim * elem_bytes
    broken = set()
    if max_split is not None and k > max_split:
        broken.add("max_split")
    if group_bytes < row_bytes:
        broken.add("group_holds_row")
    elif sm_count is not None and k > 1:
        rows_per_slice = group_bytes // row_bytes
        if -(-rows // rows_per_slice) > 2 * sm_count:
            broken.add("cta_budget")
    if k > 1 and k > num_splits:
        broken.add("num_splits")
    return broken


def spec_constrain(k_requested, **shape):
    """The largest K in KV_SPLITS, at most the request, that breaks nothing; else 1."""
    fitting = [k for k in KV_SPLITS if k <= k_requested and not spec_violations(k, **shape)]
    return max(fitting, default=1)


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
    assert k == spec_constrain(k_requested, **shape)
    if k > 1:
        assert not violations(k, **shape)
        assert not spec_violations(k, **shape)
    if shape["max_split"] is not None and shape["max_split"] >= 1:
        assert k <= shape["max_split"]
    if shape["num_splits"] >= 1:
        assert k <= shape["num_splits"]
    # Nothing between k and the request would have done.
    for bigger in KV_SPLITS:
        if k < bigger <= k_requested:
            assert violations(bigger, **shape)


@SETTINGS
@given(st.sampled_from(KV_SPLITS), shapes)
def test_violations_names_exactly_the_broken_constraints(k, shape):
    assert set(violations(k, **shape)) == spec_violations(k, **shape)
    assert len(violations(k, **shape)) == len(set(violations(k, **shape)))


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
    assert valid == [k for k in KV_SPLITS if k == 1 or not spec_violations(k, **shape)]
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
    per_cta = rows_per_cta(k, head_dim, elem_bytes)
    assert per_cta == (512 // k) * 16 // (head_dim * elem_bytes)
    ctas = num_ctas(k, head_dim, elem_bytes, rows)
    if per_cta:
        assert (ctas - 1) * per_cta < rows <= ctas * per_cta or rows == ctas == 0
    else:
        assert ctas == 0


SM_H100 = 132  # H100 / H200 SXM


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
        assert config == kvsplit_config(spec_constrain(min(k_requested, 16), **shape))


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
