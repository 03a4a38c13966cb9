"""Hypothesis properties of the merge math, on the CPU (the kernel's C++ twin).

For any shape, empty splits and split counts the merge is the
reference; the split order does not matter beyond rounding; and cutting one
attention problem into any number of splits merges back to exact attention.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvsplit
from kvsplit import reference

FORMATS = ["maxsum", "lse2", "lsee"]
BASES = {"lse2": 2.0, "lsee": math.e}
DTYPE_PAIRS = [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
               (torch.float32, torch.bfloat16), (torch.float32, torch.float16)]
REL_NORM_TOL = {torch.bfloat16: 4e-3, torch.float16: 1e-3}

pytestmark = pytest.mark.usefixtures("dispatch_sandbox")

# No example database: a failure reproduces from the seed hypothesis prints,
# not from state left in the working directory.
SETTINGS = settings(max_examples=50, deadline=None, database=None)


@st.composite
def merge_problems(draw):
    fmt = draw(st.sampled_from(FORMATS))
    partial_dtype, out_dtype = draw(st.sampled_from(DTYPE_PAIRS))
    problem = {
        "fmt": fmt,
        "num_splits": draw(st.integers(1, 64)),
        "rows": draw(st.integers(1, 8)),
        "head_dim": draw(st.sampled_from([64, 128, 256, 512])),
        "partial_dtype": partial_dtype,
        "out_dtype": out_dtype,
        "kv_split": draw(st.sampled_from([None, 1, 2, 4, 8, 16])),
        "empty_fraction": draw(st.sampled_from([0.0, 0.3, 0.8, 1.0])),
        "with_counts": draw(st.booleans()),
        "heads": draw(st.sampled_from([None, 1, 2])),
        # Spread of the raw maxima: 2 is random_partials' own; 30 makes one
        # split dominate and others underflow to weight 0.
        "spread": draw(st.sampled_from([1.0, 30.0])),
        "scale_log2": draw(st.floats(0.05, 4.0)),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }
    if problem["heads"] and problem["rows"] % problem["heads"]:
        problem["heads"] = 1
    return problem


def build(problem):
    """Partials, stats, sinks and split counts of one drawn problem (CPU tensors)."""
    gen = torch.Generator().manual_seed(problem["seed"])
    kind = "maxsum" if problem["fmt"] == "maxsum" else "lse"
    num_splits, rows = problem["num_splits"], problem["rows"]
    partial_o, stats = reference.random_partials(
        num_splits, rows, problem["head_dim"], stats_format=kind, generator=gen,
        empty_fraction=problem["empty_fraction"])
    if kind == "maxsum":
        stats[..., 0] *= problem["spread"] / 2.0
    else:
        stats *= problem["spread"] / 2.0
    split_counts = None
    if problem["with_counts"]:
        split_counts = torch.randint(-1, num_splits + 3, (rows,), generator=gen,
                                     dtype=torch.int32)
    sinks = None
    if problem["heads"]:
        sinks = 3.0 * torch.randn(problem["heads"], generator=gen)
    return partial_o.to(problem["partial_dtype"]), stats, sinks, split_counts


def run(problem, partial_o, stats, sinks, split_counts):
    out = torch.full((problem["rows"], problem["head_dim"]), math.nan,
                     dtype=problem["out_dtype"])
    common = dict(sinks=sinks, split_counts=split_counts, out=out, kv_split=problem["kv_split"])
    if problem["fmt"] == "maxsum":
        return kvsplit.merge_maxsum(partial_o, stats, problem["scale_log2"], return_stats=True,
                                    **common)
    return kvsplit.merge_lse(partial_o, stats, base=BASES[problem["fmt"]], return_lse=True,
                             **common)


def run_reference(problem, partial_o, stats, sinks, split_counts):
    if problem["fmt"] == "maxsum":
        return reference.merge_maxsum_reference(partial_o, stats, problem["scale_log2"],
                                                sinks=sinks, split_counts=split_counts)
    return reference.merge_lse_reference(partial_o, stats, base=BASES[problem["fmt"]],
                                         sinks=sinks, split_counts=split_counts)


def assert_close_output(out, expected):
    """As tests/conftest.py's assert_matches_reference, for the output alone."""
    assert not out.isnan().any()
    eps = torch.finfo(out.dtype).eps
    got = out.double()
    bound = REL_NORM_TOL[out.dtype] * expected.norm() + 1e-5 * math.sqrt(expected.numel())
    assert (got - expected).norm() <= bound
    torch.testing.assert_close(got, expected, rtol=eps, atol=1e-5)


@SETTINGS
@given(merge_problems())
def test_merge_is_the_reference(problem):
    tensors = build(problem)
    out, out_stats = run(problem, *tensors)
    expected, expected_stats = run_reference(problem, *tensors)
    assert_close_output(out, expected)
    assert not out_stats.isnan().any()
    # float32 stats: held to the reference rounded to float32, where a maxsum
    # total past 2^128 (a sink far above every split) is inf. An LSE is finite.
    torch.testing.assert_close(out_stats, expected_stats.float(), rtol=1e-5, atol=1e-6)


@SETTINGS
@given(merge_problems(), st.randoms(use_true_random=False))
def test_split_order_does_not_matter(problem, rnd):
    problem = dict(problem, with_counts=False)  # counts pick splits by position
    partial_o, stats, sinks, _ = build(problem)
    order = list(range(problem["num_splits"]))
    rnd.shuffle(order)
    out, out_stats = run(problem, partial_o, stats, sinks, None)
    shuffled, shuffled_stats = run(problem, partial_o[order], stats[order], sinks, None)
    # Both are within rounding of the same float64 value, so within two output
    # ulps (and float32 accumulation error) of each other.
    eps = torch.finfo(out.dtype).eps
    torch.testing.assert_close(shuffled.double(), out.double(), rtol=2 * eps, atol=2e-5)
    torch.testing.assert_close(shuffled_stats, out_stats, rtol=2e-6, atol=1e-6)
    if problem["fmt"] == "maxsum":
        assert torch.equal(shuffled_stats[:, 0], out_stats[:, 0])  # a max is exact


@st.composite
def attention_problems(draw):
    return {
        "fmt": draw(st.sampled_from(FORMATS)),
        "rows": draw(st.integers(1, 8)),
        "kv_len": draw(st.integers(1, 300)),
        "num_splits": draw(st.lists(st.integers(1, 64), min_size=2, max_size=3)),
        "head_dim": draw(st.sampled_from([64, 128, 256, 512])),
        "out_dtype": draw(st.sampled_from([torch.bfloat16, torch.float16])),
        "kv_split": draw(st.sampled_from([None, 1, 4, 16])),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@SETTINGS
@given(attention_problems())
def test_any_split_of_attention_merges_to_exact_attention(problem):
    gen = torch.Generator().manual_seed(problem["seed"])
    rows, kv_len, head_dim = problem["rows"], problem["kv_len"], problem["head_dim"]
    q = torch.randn(rows, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(rows, kv_len, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(rows, kv_len, head_dim, generator=gen, dtype=torch.float64)
    scale = 1.0 / math.sqrt(head_dim)
    logits = torch.einsum("rd,rkd->rk", q, k) * scale
    fmt = problem["fmt"]
    base = BASES.get(fmt, 2.0)
    log_total = torch.logsumexp(logits, dim=-1)  # natural log of the softmax denominator

    for num_splits in problem["num_splits"]:
        partial_o, stats, exact = reference.attention_partials(
            q, k, v, num_splits, stats_format="maxsum" if fmt == "maxsum" else "lse",
            scale=scale, base=base)
        out = torch.empty(rows, head_dim, dtype=problem["out_dtype"])
        if fmt == "maxsum":
            _, exported = kvsplit.merge_maxsum(partial_o.float(), stats.float(),
                                               scale * math.log2(math.e), out=out,
                                               return_stats=True, kv_split=problem["kv_split"])
            # (M * scale, L) with L the denominator relative to exp(M * scale).
            got_log_total = exported[:, 0].double() + exported[:, 1].double().log()
            expected_max = (logits / scale).amax(dim=-1) * scale
            torch.testing.assert_close(exported[:, 0].double(), expected_max,
                                       rtol=1e-5, atol=1e-5)
        else:
            _, exported = kvsplit.merge_lse(partial_o.float(), stats.float(), base=base, out=out,
                                            return_lse=True, kv_split=problem["kv_split"])
            got_log_total = exported.double() * math.log(base)
        assert_close_output(out, exact)
        torch.testing.assert_close(got_log_total, log_total, rtol=1e-5, atol=1e-5)
