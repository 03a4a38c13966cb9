"""Many processes writing one database at once lose nothing and never see 'database is locked'."""

from __future__ import annotations

import multiprocessing
import sqlite3
import time

import dbtestlib
import pytest
import sqlalchemy as sa
from kvsplit.db import open_store

WRITERS = 8
UPSERTS = 500


@pytest.mark.slow
def test_parallel_upserts_and_a_consistent_reader(db_url, capsys):
    open_store(db_url).close()  # create the schema up front; racing creators are another test
    ctx = multiprocessing.get_context("spawn")
    ready, results = ctx.Queue(), ctx.Queue()
    start, stop = ctx.Event(), ctx.Event()
    procs = [
        ctx.Process(target=dbtestlib.writer, args=(db_url, p, UPSERTS, ready, start, results)) for p in range(WRITERS)
    ]
    procs.append(ctx.Process(target=dbtestlib.reader, args=(db_url, ready, start, stop, results)))
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=120)  # every process imported and opened the store
        began = time.perf_counter()
        start.set()
        writers = [results.get(timeout=300) for _ in range(WRITERS)]
        wall = time.perf_counter() - began
        stop.set()
        reader = results.get(timeout=120)
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()

    errors = [e for w in writers for e in w[3]]
    assert errors == []
    assert reader[0] == "reader" and reader[2] == [], reader[2][:5]

    shared = len(range(0, UPSERTS, dbtestlib.SHARED_KEYS_EVERY))
    expected = shared + WRITERS * (UPSERTS - shared)
    engine = sa.create_engine(db_url)
    with engine.connect() as conn:
        n_results = conn.exec_driver_sql("SELECT COUNT(*) FROM tuning_results").scalar_one()
        n_candidates = conn.exec_driver_sql("SELECT COUNT(*) FROM tuning_candidates").scalar_one()
        n_devices = conn.exec_driver_sql("SELECT COUNT(*) FROM devices").scalar_one()
        n_builds = conn.exec_driver_sql("SELECT COUNT(*) FROM kernel_builds").scalar_one()
        mixed = conn.exec_driver_sql(
            "SELECT COUNT(*) FROM (SELECT result_id FROM tuning_candidates c"
            " JOIN tuning_results r ON r.id = c.result_id"
            " GROUP BY result_id HAVING COUNT(DISTINCT samples) > 1"
            " OR MIN(r.tool_version) <> 'writer-' || CAST(MIN(c.samples) AS VARCHAR(8))) AS t"
        ).scalar_one()
    engine.dispose()
    assert (n_results, n_candidates, n_devices, n_builds, mixed) == (expected, 5 * expected, 1, 1, 0)

    with open_store(db_url) as store:
        records = {r.key.rows: r for r in store.query()}
    for proc in range(WRITERS):
        own = dbtestlib.writer_rows(proc, 1, UPSERTS)
        assert {c.samples for c in records[own].candidates} == {proc + 1}
        assert records[own].tool_version == f"writer-{proc + 1}"
    with capsys.disabled():
        backend = db_url.split(":", 1)[0]
        print(
            f"\n[concurrency {backend}] {WRITERS} processes x {UPSERTS} upserts: {wall:.1f} s wall "
            f"({WRITERS * UPSERTS / wall:.0f} upserts/s; slowest writer {max(w[2] for w in writers):.1f} s), "
            f"{n_results} results / {n_candidates} candidates (expected {expected}), "
            f"reader took {reader[1]} consistent snapshots"
        )


@pytest.mark.parametrize("openers", [6])
def test_racing_first_opens_create_the_schema_once(db_url, openers):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(openers) as pool:
        results = pool.map(dbtestlib.open_and_count, [db_url] * openers)
    assert results == [0] * openers


class _LockedAtFirst:
    """A DB-API connection whose journal-mode change fails ``times`` times with "database is
    locked", as SQLite's does at once while other processes open a new file."""

    def __init__(self, times: int):
        self.left, self.tries = times, 0

    def execute(self, sql: str):
        assert sql == "PRAGMA journal_mode = WAL"
        self.tries += 1
        if self.left:
            self.left -= 1
            raise sqlite3.OperationalError("database is locked")


def test_a_journal_mode_change_that_finds_the_file_locked_is_retried():
    from kvsplit.db.engine import set_wal

    connection = _LockedAtFirst(3)
    set_wal(connection, timeout_s=5.0)
    assert connection.tries == 4
    stuck = _LockedAtFirst(10 ** 6)
    begin = time.monotonic()
    with pytest.raises(sqlite3.OperationalError, match="database is locked"):
        set_wal(stuck, timeout_s=0.2)
    assert 0.2 <= time.monotonic() - begin < 2 and stuck.tries > 2
