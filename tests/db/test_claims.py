"""Claims, leases and progress (db/claims.py), and the generation counter, on both backends."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import sqlalchemy as sa
from dbtestlib import H200, make_record

from kvsplit.cli.quarantine import quarantine_writer
from kvsplit.cli.reports import fleet_progress, store_stats
from kvsplit.db import Claims, StoreError, open_store, open_store_for_library
from kvsplit.db.claims import standing

LEASE_S = 30.0


def grid(n: int = 4):
    return [make_record(rows=1 + i).key for i in range(n)]


@pytest.fixture
def claims(store):
    return Claims(store)


def _next(claims, keys, owner="host-a/1/cpu", *, lease_s=LEASE_S, run_started=None, force=False):
    return claims.claim_next(keys, owner, lease_s, run_started=run_started or claims.now(), force=force)


def _record(key):
    return make_record(rows=key.rows)


def test_each_key_is_claimed_once_until_the_grid_is_done(claims):
    keys = grid()
    claims.register(keys)
    got = [_next(claims, keys, f"host-{i}/1/cpu").claim for i in range(len(keys))]
    assert sorted(c.key.rows for c in got) == [1, 2, 3, 4]
    assert {c.attempt for c in got} == {1} and all(c.taken_from is None for c in got)
    none = _next(claims, keys, "host-z/1/cpu")
    assert none.claim is None and none.busy == 4 and none.standings["claimed"] == 4
    for claim in got:
        claims.finish(claim, record=_record(claim.key))
    done = _next(claims, keys, "host-z/1/cpu")
    assert (done.claim, done.busy, done.standings["done"]) == (None, 0, 4)


def test_a_stored_key_is_done_and_never_claimed_without_force(claims, store):
    keys = grid(2)
    store.upsert(_record(keys[0]))
    step = _next(claims, keys)
    assert step.claim.key == keys[1] and step.standings["done"] == 1


def test_force_tunes_each_stored_key_once_per_run(claims, store):
    keys = grid(2)
    store.upsert_many([_record(k) for k in keys])
    started = claims.now()
    first = _next(claims, keys, "a/1/cpu", run_started=started, force=True).claim
    second = _next(claims, keys, "b/1/cpu", run_started=started, force=True).claim
    assert {first.key, second.key} == set(keys)
    for claim in (first, second):
        claims.finish(claim, record=_record(claim.key))
    assert _next(claims, keys, "c/1/cpu", run_started=started, force=True).claim is None
    later = claims.now() + timedelta(microseconds=1)  # a new run re-tunes them again
    assert _next(claims, keys, "c/1/cpu", run_started=later, force=True).claim is not None


def test_an_expired_lease_is_taken_over_and_the_old_owner_can_no_longer_renew(claims):
    keys = grid(1)
    old = _next(claims, keys, "dead/1/cpu", lease_s=0.5).claim
    assert claims.renew(old, 0.5)
    assert _next(claims, keys, "live/2/cpu").claim is None  # still held
    time.sleep(0.7)
    step = _next(claims, keys, "live/2/cpu")
    assert step.claim is not None and step.claim.taken_from == "dead/1/cpu" and step.claim.attempt == 2
    assert not claims.renew(old, 0.5)
    claims.finish(old, error="late failure")  # not ours any more: changes nothing
    claims.finish(step.claim, record=_record(keys[0]))
    progress = fleet_progress(claims, keys)
    assert (progress.done, progress.failed, progress.attempts) == (1, 0, 2)


def test_a_failure_is_final_for_the_run_and_retried_by_a_later_one(claims):
    keys = grid(1)
    started = claims.now()
    claim = _next(claims, keys, run_started=started).claim
    claims.finish(claim, error="NoWorkingCandidate: every candidate raised")
    same_run = _next(claims, keys, "other/2/cpu", run_started=started)
    assert same_run.claim is None and same_run.busy == 0 and same_run.standings["failed"] == 1
    later = _next(claims, keys, "other/2/cpu", run_started=claims.now() + timedelta(microseconds=1))
    assert later.claim is not None and later.claim.attempt == 2


def test_progress_counts_owners_failures_and_expired_leases(claims, store):
    keys = grid(5)
    claims.register(keys)
    store.upsert(_record(keys[0]))
    held = _next(claims, keys, "gpu-host/7/cuda:0").claim
    expired = _next(claims, keys, "gone/8/cuda:1", lease_s=0.3).claim
    failed = _next(claims, keys, "gpu-host/7/cuda:0").claim
    claims.finish(failed, error="RuntimeError: boom")
    time.sleep(0.4)
    progress = fleet_progress(claims, keys)
    assert (progress.keys, progress.done, progress.claimed, progress.failed, progress.left,
            progress.expired) == (5, 1, 1, 1, 2, 1)
    assert [(w.owner, w.claimed) for w in progress.workers] == [("gpu-host/7/cuda:0", 1)]
    assert progress.workers[0].since == held.claimed_at
    assert [(f.key, f.error) for f in progress.failures] == [(failed.key, "RuntimeError: boom")]
    everything = fleet_progress(claims)  # every registered key: the same grid here
    assert everything.model_dump(exclude={"now"}) == progress.model_dump(exclude={"now"})
    assert expired.key not in {f.key for f in progress.failures}


def test_workers_racing_for_one_grid_claim_each_key_once(db_url):
    """Threads with stores of their own: SKIP LOCKED / BEGIN IMMEDIATE hand out each key once."""
    keys = grid(24)
    open_store(db_url).close()

    def work(i: int) -> list:
        got = []
        with open_store(db_url) as store:
            claims = Claims(store)
            started = claims.now()
            while (claim := _next(claims, keys, f"t{i}/1/cpu", run_started=started).claim) is not None:
                got.append(claim.key)
                claims.finish(claim, record=_record(claim.key))
        return got

    with ThreadPoolExecutor(4) as pool:  # an exception in a worker is raised here
        got = [key for keys_of_one in pool.map(work, range(4)) for key in keys_of_one]
    assert sorted(k.rows for k in got) == list(range(1, 25))


def test_a_key_finished_while_another_worker_looks_is_not_claimed_again(db_url, monkeypatch):
    """The interleaving behind a key tuned twice on PostgreSQL: worker B reads which keys have
    results, then A claims and finishes the key, then B locks its claim row. B must see A's
    result (read under the lock), not its earlier read, and leave the key alone.

    SQLite cannot interleave so: B's write transaction holds the database's one write lock.
    """
    if not db_url.startswith("postgresql"):
        pytest.skip("SQLite serializes write transactions (BEGIN IMMEDIATE): no such interleaving")
    from kvsplit.db import claims as claims_module

    keys = grid(1)
    with open_store(db_url) as store_a, open_store(db_url) as store_b:
        claims_a, claims_b = Claims(store_a), Claims(store_b)
        claims_a.register(keys)
        started = claims_b.now()
        real_stored = claims_module._stored
        calls = []

        def stored_then_a_finishes(session, wanted):
            found = real_stored(session, wanted)
            calls.append(set(found))
            if len(calls) == 1:  # B has read the results; now A does all its work
                claim = _next(claims_a, keys, "host-a/1/cpu").claim
                assert claim is not None
                claims_a.finish(claim, record=_record(claim.key))
            return found

        monkeypatch.setattr(claims_module, "_stored", stored_then_a_finishes)
        step = _next(claims_b, keys, "host-b/1/cpu", run_started=started)
        monkeypatch.undo()
        assert calls[0] == set()  # B's first read did not see A's result
        assert step.claim is None
        progress = fleet_progress(claims_a, keys)
        assert (progress.done, progress.attempts) == (1, 1)


def test_a_claim_row_that_does_not_parse_is_claimable_and_repaired_away(store, claims, db_url):
    keys = grid(1)
    claims.register(keys)
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE tuning_claims SET state = 'gone'")
    engine.dispose()
    assert [d.table for d in store.damage()] == ["tuning_claims"]
    assert fleet_progress(claims, keys).left == 1
    step = _next(claims, keys)
    assert step.claim is not None and step.claim.attempt == 1
    assert store.damage() == []  # the claim overwrote it


def test_the_result_and_the_end_of_its_claim_are_one_transaction(claims, store, monkeypatch):
    from kvsplit.db import claims as claims_module

    keys = grid(1)
    claim = _next(claims, keys).claim

    def broken(table):  # the claim's update fails after the result was written
        raise sa.exc.OperationalError("UPDATE tuning_claims", {}, Exception("disk I/O error"))

    real = claims_module.update
    monkeypatch.setattr(claims_module, "update", broken)
    with pytest.raises(StoreError, match="disk I/O error"):
        claims.finish(claim, record=_record(keys[0]))
    monkeypatch.setattr(claims_module, "update", real)
    assert store.get(keys[0]) is None  # rolled back with the claim: no result without its claim's end
    assert fleet_progress(claims, keys).claimed == 1


def test_standing_of_a_key():
    from datetime import datetime, timezone

    from kvsplit.db import ClaimInfo

    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    key = make_record().key
    live = ClaimInfo(key=key, state="claimed", owner="a/1/cpu", attempts=1, claimed_at=now,
                     heartbeat_at=now, expires_at=now + timedelta(seconds=5))
    assert standing(live, False, now) == "claimed"
    assert standing(live, False, now + timedelta(seconds=6)) == "expired"
    done = live.model_copy(update={"state": "done", "expires_at": None})
    assert standing(done, True, now) == "done"
    assert standing(done, False, now) == "left"  # done, but the result was pruned since
    assert standing(done, True, now, run_started=now, force=True) == "done"
    assert standing(done, True, now, run_started=now + timedelta(seconds=1), force=True) == "left"
    assert standing(None, True, now) == "done" and standing(None, False, now) == "left"


# -- the generation counter ------------------------------------------------------------------


def test_every_write_of_results_bumps_the_generation_and_reads_do_not(store, tmp_path):
    from kvsplit.export import dump_export, make_export, read_export

    assert store.generation() is None
    store.upsert(make_record(rows=1))
    assert store.generation() == 1
    store.upsert_many([make_record(rows=2), make_record(rows=3)])
    assert store.generation() == 2  # one transaction, one bump
    store.query()
    store.load_choices(H200, "build-a")
    store_stats(store)
    assert store.generation() == 2
    export = tmp_path / "e.json"
    export.write_text(dump_export(make_export([make_record(rows=4)])))
    store.import_records(read_export(export), dry_run=True)
    assert store.generation() == 2
    store.import_records(read_export(export))
    assert store.generation() == 3
    store.prune(older_than=timedelta(days=1), dry_run=True)
    assert store.generation() == 3
    store.prune(older_than=timedelta(seconds=0))
    assert store.generation() == 4
    store.repair(quarantine_writer(tmp_path / "q.jsonl", store.url))
    assert store.generation() == 5


def test_a_library_store_reads_the_generation_of_another_process(db_url):
    reader = open_store_for_library(db_url)
    assert reader.generation() is None
    with open_store(db_url) as writer:
        writer.upsert(make_record())
    assert reader.generation() == 1
    reader.close()
