"""Shared helpers for the merge tests.

The suite runs with ``--import-mode=importlib``, so test files cannot import
each other; the helpers reach them through the session fixture ``merge_kit``
(plain functions, no state) and the function fixture ``chosen_kv_split``.

Stats formats are named by one string everywhere: ``"maxsum"``,
``"lse2"`` (log-sum-exp in base 2) and ``"lsee"`` (base e).
"""

from __future__ import annotations

import math
import os
import secrets
import sys
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import sqlalchemy as sa
import torch
from sqlalchemy.engine import make_url

import kvsplit
from kvsplit import _kernel, reference
from kvsplit import merge as merge_module
from kvsplit.config import has_cuda_kernels
from kvsplit.dispatch import dispatcher
from kvsplit.dispatch.constraints import KVSPLIT, constrain

# Test helper modules (merge_grid.py) import by name under --import-mode=importlib.
sys.path.insert(0, str(Path(__file__).resolve().parent))

PG_ENV = "KVSPLIT_TEST_PG_URL"
LOG2E = 1.0 / math.log(2.0)
BASES = {"lse2": 2.0, "lsee": math.e}

# Largest ||out - ref|| / ||ref|| accepted per output dtype: the 16-bit rounding
# of the output alone costs about eps / 2 / sqrt(3) on random data.
REL_NORM_TOL = {torch.bfloat16: 4e-3, torch.float16: 1e-3}
# Elementwise: one ulp of the output (twice its rounding error) plus the float32
# accumulation error of values of order one.
ATOL = 1e-5
STATS_RTOL, STATS_ATOL = 1e-5, 1e-6


def generator(*key) -> torch.Generator:
    """A CPU generator seeded from ``key`` (stable across runs and processes)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def stats_kind(fmt: str) -> str:
    return "maxsum" if fmt == "maxsum" else "lse"


def partials(fmt, num_splits, rows, head_dim, dtype, gen, *, empty_fraction=0.2):
    """Random self-consistent CPU partials: (partial_o in ``dtype``, float32 stats)."""
    partial_o, stats = reference.random_partials(
        num_splits, rows, head_dim, stats_format=stats_kind(fmt), generator=gen,
        empty_fraction=empty_fraction)
    return partial_o.to(dtype), stats


def scale_log2(gen) -> float:
    """A softmax scale (times log2 e) in [0.25, 2): spread weights, some near 0."""
    return float(0.25 + 1.75 * torch.rand((), generator=gen))


def merge(fmt, partial_o, stats, *, scale=1.0, **kwargs):
    """Runs the public merge for ``fmt``; returns (out, exported stats or LSE)."""
    if fmt == "maxsum":
        return kvsplit.merge_maxsum(partial_o, stats, scale, return_stats=True, **kwargs)
    return kvsplit.merge_lse(partial_o, stats, base=BASES[fmt], return_lse=True, **kwargs)


def merge_reference(fmt, partial_o, stats, *, scale=1.0, sinks=None, split_counts=None):
    """Float64 reference on the CPU; returns (out, stats or LSE)."""
    partial_o, stats = partial_o.cpu(), stats.cpu()
    sinks = None if sinks is None else sinks.cpu()
    split_counts = None if split_counts is None else split_counts.cpu()
    if fmt == "maxsum":
        return reference.merge_maxsum_reference(partial_o, stats, scale, sinks=sinks,
                                                split_counts=split_counts)
    return reference.merge_lse_reference(partial_o, stats, base=BASES[fmt], sinks=sinks,
                                         split_counts=split_counts)


def log_totals(fmt, merged_stats):
    """Natural log of each row's softmax denominator, from a merge's exported stats."""
    if fmt == "maxsum":
        return merged_stats[:, 0] + merged_stats[:, 1].log()
    return merged_stats * math.log(BASES[fmt])


def assert_matches_reference(out, out_stats, ref_out, ref_stats, *, stats_rtol=STATS_RTOL):
    """Output and exported stats of one merge against the float64 reference.

    ||out - ref|| / ||ref|| is bounded per output dtype, with an absolute
    floor for outputs that are nearly all zero (subnormal 16-bit values);
    elementwise, one output ulp plus ATOL. The stats are float32, so they are
    held to the reference rounded to float32 (a total past 2^128 is inf there).
    """
    out, out_stats = out.cpu(), out_stats.cpu()
    assert not out.isnan().any() and not out_stats.isnan().any()
    eps = torch.finfo(out.dtype).eps
    got = out.double()
    error = float((got - ref_out).norm())
    bound = REL_NORM_TOL[out.dtype] * float(ref_out.norm()) + ATOL * math.sqrt(ref_out.numel())
    assert error <= bound, f"||out - ref|| = {error:.3g} > {bound:.3g}"
    torch.testing.assert_close(got, ref_out, rtol=eps, atol=ATOL)
    # assert_close also requires -inf where the reference has -inf (empty rows).
    torch.testing.assert_close(out_stats.double(), ref_stats.float().double(), rtol=stats_rtol,
                               atol=STATS_ATOL)


def assert_same_function(fmt, out, out_stats, base_out, base_stats):
    """Two evaluations of the same merge that may differ only by float32 rounding.

    Changing kv_split reorders float32 sums, which can move a rounded 16-bit
    output by one ulp (and tiny values by a float32 rounding), no more, and
    only in a few elements. The maximum is exact whatever the order.
    """
    out, out_stats, base_out, base_stats = (t.cpu() for t in (out, out_stats, base_out, base_stats))
    eps = torch.finfo(out.dtype).eps
    torch.testing.assert_close(out.double(), base_out.double(), rtol=eps, atol=ATOL)
    differing = (out != base_out).double().mean().item()
    assert differing <= 0.02, f"{differing:.1%} of the elements differ"
    if fmt == "maxsum":
        assert torch.equal(out_stats[:, 0], base_stats[:, 0])
        torch.testing.assert_close(out_stats[:, 1], base_stats[:, 1], rtol=2e-6, atol=1e-6)
    else:
        torch.testing.assert_close(out_stats, base_stats, rtol=2e-6, atol=1e-6)


def expected_kv_split(kv_split, *, head_dim, elem_bytes, rows, num_splits, sm_count=None):
    """The K a forced ``kv_split`` runs as: the constraints' (tested against worked cases in
    tests/dispatch/test_constraints.py), which the merge must apply."""
    return constrain(kv_split, head_dim=head_dim, elem_bytes=elem_bytes, rows=rows,
                     num_splits=num_splits, sm_count=sm_count)


def cuda_skip_reason() -> str | None:
    """Why the CUDA tests cannot run here (None: they can)."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if not has_cuda_kernels():
        return "this kvsplit build has no CUDA kernels"
    major, minor = torch.cuda.get_device_capability()
    capability = 10 * major + minor
    built = kvsplit._native.ext().cuda_architectures.split()
    for entry in built:
        arch, _, kind = entry.partition("-")
        specific = arch.endswith(("a", "f"))
        number = int(arch.rstrip("af"))
        if kind in ("real", "") and number == capability:
            return None
        if kind in ("virtual", "") and not specific and number <= capability:
            return None  # PTX, JIT-compiled for newer GPUs
    return f"kvsplit was built for {built}, not for sm_{capability}"


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    """Every merge test runs on the CPU, and on CUDA where it can."""
    if request.param == "cuda":
        reason = cuda_skip_reason()
        if reason:
            pytest.skip(reason)
    return request.param


@pytest.fixture
def cuda_device() -> str:
    """For CUDA-only tests (mark them ``gpu`` too)."""
    reason = cuda_skip_reason()
    if reason:
        pytest.skip(reason)
    return "cuda"


def assert_empty_rows_and_nan_row(fmt, gen, num_splits, rows, head_dim, device, poisoned_row):
    """Raw-stats merge of random scale and empty splits (-inf stats): row 0 has every split
    empty and merges to zeros; then a NaN stat (the max, or the LSE) in ``poisoned_row``
    poisons that row and no other. The kernel config is the caller's (pinned)."""
    partial_o, stats = partials(fmt, num_splits, rows, head_dim, torch.bfloat16, gen,
                                empty_fraction=0.3)
    if fmt == "maxsum":
        stats[:, 0] = torch.tensor([-math.inf, 0.0])
    else:
        stats[:, 0] = -math.inf
    scale = scale_log2(gen)
    out, out_stats = merge(fmt, partial_o.to(device), stats.to(device), scale=scale)
    assert_matches_reference(out, out_stats, *merge_reference(fmt, partial_o, stats, scale=scale))
    assert torch.equal(out[0].cpu(), torch.zeros(head_dim, dtype=out.dtype))
    poisoned = stats.clone()
    poisoned[num_splits // 2, poisoned_row] = math.nan
    bad_out, bad_stats = merge(fmt, partial_o.to(device), poisoned.to(device), scale=scale)
    others = torch.arange(rows) != poisoned_row
    assert bad_out[poisoned_row].isnan().all()
    assert torch.equal(bad_out[others].cpu(), out[others].cpu())
    assert torch.equal(bad_stats[others].cpu(), out_stats[others].cpu())


@pytest.fixture(scope="session")
def merge_kit():
    """The helpers above, as one namespace (see the module docstring)."""
    return SimpleNamespace(
        generator=generator, partials=partials, scale_log2=scale_log2, merge=merge,
        reference=merge_reference, log_totals=log_totals,
        assert_matches_reference=assert_matches_reference,
        assert_empty_rows_and_nan_row=assert_empty_rows_and_nan_row,
        assert_same_function=assert_same_function, expected_kv_split=expected_kv_split,
        stats_kind=stats_kind, bases=BASES)


@pytest.fixture(scope="module")
def dispatch_sandbox(tmp_path_factory):
    """Keeps merge tests off the user's tuning database, off profiling and off env overrides.

    The numerics do not depend on how ``kv_split=None`` was resolved; ``cached``
    mode resolves it without profiling, from a throwaway database (profiling
    and the database have tests of their own).
    """
    database = tmp_path_factory.mktemp("kvsplit-db") / "tuning.sqlite"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSPLIT_DB", f"sqlite:///{database}")
        patch.setenv("KVSPLIT_MODE", "cached")
        patch.delenv("KVSPLIT_MAX_SPLIT", raising=False)
        yield


@pytest.fixture
def chosen_kv_split(monkeypatch):
    """Records the K the dispatcher hands to the kernel, call by call.

    Lets a test check that a forced kv_split really ran (after the
    constraints), so that a grid over K cannot silently test K = 1 only.
    """
    monkeypatch.delenv("KVSPLIT_MAX_SPLIT", raising=False)
    chosen: list[int] = []
    launch = merge_module._launch

    def spy(layout, *args):
        # A KvSplit config is recorded as its K, any other config as itself.
        if layout.kernel is not None:
            config = layout.kernel.config
            chosen.append(config.kv_split if config.family == KVSPLIT else config)
        return launch(layout, *args)

    monkeypatch.setattr(merge_module, "_launch", spy)
    # Every call through the Python path, so that the spy sees each launch.
    monkeypatch.setattr(merge_module, "_call_fast", lambda *args: False)
    return chosen


# -- databases: SQLite, and PostgreSQL when KVSPLIT_TEST_PG_URL is set (.ci/postgres.sh) ------


@pytest.fixture(scope="session")
def pg_session_url():
    """A database of its own on the test server, dropped at the end of the session."""
    base = os.environ.get(PG_ENV)
    if not base:
        pytest.skip(f"{PG_ENV} is not set: no PostgreSQL server (source .ci/postgres.sh to start one)")
    name = f"kvsplit_test_{os.getpid()}_{secrets.token_hex(4)}"
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    yield make_url(base).set(database=name).render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


@pytest.fixture
def pg_url(pg_session_url):
    """The session database with an empty public schema."""
    engine = sa.create_engine(pg_session_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP SCHEMA public CASCADE")
        conn.exec_driver_sql("CREATE SCHEMA public")
    engine.dispose()
    return pg_session_url


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path):
    """URL of an empty database, once per backend."""
    if request.param == "postgres":
        return request.getfixturevalue("pg_url")
    return f"sqlite:///{tmp_path / 'tuning.sqlite'}"
