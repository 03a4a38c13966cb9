"""Helpers shared by the database tests and by the worker processes they spawn.

conftest.py puts this directory on ``sys.path`` so that test modules (imported
with ``--import-mode=importlib``) and spawned children can import it by name.
"""

from __future__ import annotations

from datetime import datetime, timezone

from kvsplit.db import CandidateResult, DeviceInfo, TuningKey, TuningPolicy, TuningRecord

from kvsplit.config import KernelConfig

H200 = DeviceInfo(name="NVIDIA H200", cc_major=9, cc_minor=0, sm_count=132)
A100 = DeviceInfo(name="NVIDIA A100-SXM4-80GB", cc_major=8, cc_minor=0, sm_count=108)
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def make_record(
    *,
    device: DeviceInfo = H200,
    build_hash: str = "build-a",
    head_dim: int = 512,
    partial_dtype: str = "bfloat16",
    out_dtype: str = "bfloat16",
    stats_format: str = "maxsum",
    num_splits: int = 16,
    rows: int = 64,
    winner: int = 4,
    base_us: float = 8.0,
    samples: int = 200,
    tool_version: str = "0.1.0",
    created_at: datetime | None = None,
    updated_at: datetime | None = None,
) -> TuningRecord:
    """A record with all five kv_split candidates; the winner runs 2.5x faster than kv_split=1.

    ``samples`` tags every candidate, so a test can tell which write a stored
    candidate list came from.
    """
    candidates = []
    for k in (1, 2, 4, 8, 16):
        median = base_us / (1.0 + abs(k.bit_length() - 1) * 0.1) if k != winner else base_us / 2.5
        candidates.append(
            CandidateResult(
                config=KernelConfig.kvsplit(k),
                median_us=median,
                p10_us=median * 0.95,
                p90_us=median * 1.1,
                samples=samples,
                matched=True,
            )
        )
    return TuningRecord(
        key=TuningKey(
            device=device,
            build_hash=build_hash,
            head_dim=head_dim,
            partial_dtype=partial_dtype,
            out_dtype=out_dtype,
            stats_format=stats_format,
            num_splits=num_splits,
            rows=rows,
        ),
        winner=KernelConfig.kvsplit(winner),
        policy=TuningPolicy(l2_state="warm", repeats=100, noise_margin=0.02),
        candidates=candidates,
        tool_version=tool_version,
        created_at=created_at,
        updated_at=updated_at,
    )


# -- worker processes for test_concurrency (spawned: must be importable by name) --

SHARED_KEYS_EVERY = 2  # every 2nd upsert of a writer goes to a key all writers share


def writer_rows(proc: int, i: int, upserts: int) -> int:
    """The ``rows`` of writer ``proc``'s ``i``-th upsert: shared by all writers or its own."""
    if i % SHARED_KEYS_EVERY == 0:
        return 1 + i
    return 1 + upserts + proc * upserts + i


def writer(url: str, proc: int, upserts: int, ready, start, results) -> None:
    """Open the store, wait for the start signal, upsert, report (proc, seconds, errors)."""
    import time

    from kvsplit.db import open_store

    errors: list[str] = []
    store = open_store(url)
    ready.put(proc)
    start.wait()
    began = time.perf_counter()
    for i in range(upserts):
        # samples tags the writer: a stored candidate list must come from one writer.
        record = make_record(
            rows=writer_rows(proc, i, upserts),
            winner=(1, 2, 4, 8, 16)[(i + proc) % 5],
            samples=proc + 1,
            tool_version=f"writer-{proc + 1}",
        )
        try:
            store.upsert(record)
        except Exception as exc:  # noqa: BLE001 - every failure is reported to the test
            errors.append(f"{type(exc).__name__}: {exc}")
    results.put(("writer", proc, time.perf_counter() - began, errors))
    store.close()


def reader(url: str, ready, start, stop, results) -> None:
    """Read everything in a loop until told to stop; report inconsistent snapshots."""
    from kvsplit.db import open_store

    problems: list[str] = []
    snapshots = 0
    store = open_store(url)
    ready.put(-1)
    start.wait()
    # A short pause between snapshots leaves the writers most of the CPU.
    while not stop.wait(0.02):
        try:
            records = store.query()
            store.load_choices(H200, "build-a")
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{type(exc).__name__}: {exc}")
            continue
        snapshots += 1
        for r in records:
            # Result row and candidates must come from the same upsert.
            tags = {f"writer-{c.samples}" for c in r.candidates} | {r.tool_version}
            fastest = min(r.candidates, key=lambda c: c.median_us).config if r.candidates else None
            if len(r.candidates) != 5 or len(tags) != 1 or fastest != r.winner:
                problems.append(f"rows={r.key.rows}: {len(r.candidates)} candidates, tags {sorted(tags)}")
    results.put(("reader", snapshots, problems))
    store.close()


def open_and_count(url: str) -> int:
    """Open (creating the schema if nobody has yet) and count the results."""
    from kvsplit.db import open_store

    with open_store(url) as store:
        return len(store.query())
