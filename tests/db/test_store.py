"""Store round trips on every backend: upsert, get, load_choices, query, stats, prune."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa
from dbtestlib import A100, H200, make_record
from kvsplit.db import TuningKey, open_store
from kvsplit.cli.reports import store_stats
from kvsplit.config import KernelConfig


def test_upsert_then_get_round_trips_every_field(store):
    record = make_record(winner=8, rows=4096)
    store.upsert(record)
    got = store.get(record.key)
    assert got is not None
    assert got.key == record.key
    assert got.winner == KernelConfig.kvsplit(8)
    assert got.policy == record.policy
    assert got.candidates == record.candidates
    assert got.tool_version == "0.1.0"
    assert got.created_at is not None and got.created_at.tzinfo is not None
    assert got.speedup == pytest.approx(2.5)


def test_get_of_an_unknown_key_is_none(store):
    store.upsert(make_record())
    assert store.get(make_record(rows=65).key) is None
    assert store.get(make_record(device=A100).key) is None
    assert store.get(make_record(build_hash="other").key) is None


def test_upsert_replaces_result_and_candidates_and_keeps_created_at(store):
    first = make_record(winner=4, samples=10)
    store.upsert(first)
    before = store.get(first.key)
    second = make_record(winner=16, samples=20)
    second = second.model_copy(update={"candidates": second.candidates[2:]})  # K=4, 8, 16 only
    store.upsert(second)
    after = store.get(first.key)
    assert after.winner.kv_split == 16
    assert [c.config.kv_split for c in after.candidates] == [4, 8, 16]
    assert {c.samples for c in after.candidates} == {20}
    assert after.created_at == before.created_at
    assert after.updated_at >= before.updated_at
    assert len(store.query()) == 1


def test_upsert_many_and_load_choices_in_one_dict(store):
    records = [
        make_record(num_splits=n, rows=r, winner=w) for n, r, w in [(4, 1, 4), (16, 1, 16), (16, 8192, 1), (64, 128, 8)]
    ]
    records.append(make_record(device=A100, winner=2))
    records.append(make_record(build_hash="build-b", winner=2))
    store.upsert_many(records)
    choices = store.load_choices(H200, "build-a")
    assert choices == {
        (512, "bfloat16", "bfloat16", "maxsum", 4, 1): KernelConfig.kvsplit(4),
        (512, "bfloat16", "bfloat16", "maxsum", 16, 1): KernelConfig.kvsplit(16),
        (512, "bfloat16", "bfloat16", "maxsum", 16, 8192): KernelConfig.kvsplit(1),
        (512, "bfloat16", "bfloat16", "maxsum", 64, 128): KernelConfig.kvsplit(8),
    }
    assert records[0].key.choice_key in choices
    assert store.load_choices(A100, "build-a") == {records[4].key.choice_key: KernelConfig.kvsplit(2)}
    assert store.load_choices(H200, "nope") == {}


def test_load_choices_is_one_query(store, db_url):
    store.upsert_many(make_record(rows=r) for r in (1, 2, 3, 4, 5))
    statements = []
    engine = store._engine  # noqa: SLF001 - counting statements needs the engine
    sa.event.listen(engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    store.load_choices(H200, "build-a")
    selects = [s for s in statements if s.lstrip().upper().startswith("SELECT")]
    assert len(selects) == 1, selects


def test_query_filters(store):
    store.upsert_many(
        [
            make_record(head_dim=128, partial_dtype="float16", out_dtype="float16"),
            make_record(head_dim=512),
            make_record(head_dim=512, stats_format="lse", rows=7),
            make_record(device=A100, head_dim=128, num_splits=32),
        ]
    )
    assert len(store.query()) == 4
    assert len(store.query(device="h200")) == 3
    assert len(store.query(device="A100")) == 1
    assert len(store.query(device=A100)) == 1
    assert len(store.query(device="nothing")) == 0
    assert len(store.query(head_dim=128)) == 2
    assert len(store.query(dtype="float16")) == 1
    assert len(store.query(out_dtype="bfloat16")) == 3
    assert len(store.query(stats_format="lse")) == 1
    assert len(store.query(num_splits=32)) == 1
    assert len(store.query(rows=7, head_dim=512)) == 1
    assert len(store.query(build_hash="build-a", rows=64)) == 3
    assert len(store.query(device="%")) == 0  # LIKE wildcards are escaped


def test_stats_counts_speedups_and_stale_builds(store, days):
    store.import_records(
        [
            make_record(rows=1, winner=4, updated_at=days(1)),
            make_record(rows=2, winner=1, updated_at=days(2)),
            make_record(device=A100, rows=1, winner=2, build_hash="build-b", updated_at=days(5)),
        ]
    )
    stats = store_stats(store)
    assert stats.keys == 3
    by_name = {d.device.name: d for d in stats.devices}
    assert by_name["NVIDIA H200"].keys == 2
    assert by_name["NVIDIA H200"].mean_speedup == pytest.approx((2.5 + 1.0) / 2)
    assert by_name["NVIDIA H200"].max_speedup == pytest.approx(2.5)
    assert by_name["NVIDIA H200"].oldest == days(1)
    assert by_name["NVIDIA H200"].newest == days(2)
    assert stats.oldest == days(1) and stats.newest == days(5)
    # Without a current build, all but the most recently tuned build are stale.
    assert {b.build_hash: b.stale for b in stats.builds} == {"build-a": True, "build-b": False}
    current = store_stats(store, current_build="build-a")
    assert {b.build_hash: b.stale for b in current.builds} == {"build-a": False, "build-b": True}


def test_stats_of_an_empty_store(store):
    stats = store_stats(store)
    assert stats.keys == 0 and stats.devices == [] and stats.builds == [] and stats.newest is None


def test_prune_criteria_dry_run_and_orphans(store, days):
    now = datetime.now(timezone.utc)
    store.import_records(
        [
            make_record(rows=1, updated_at=now - timedelta(days=40)),
            make_record(rows=2, updated_at=now),
            make_record(rows=3, build_hash="build-old", updated_at=now - timedelta(days=1)),
            make_record(rows=4, device=A100, updated_at=now),
        ]
    )
    dry = store.prune(older_than=timedelta(days=30), dry_run=True)
    assert dry.dry_run and [k.rows for k in dry.keys] == [1]
    assert len(store.query()) == 4

    assert [k.rows for k in store.prune(older_than=timedelta(days=30)).keys] == [1]
    assert [k.rows for k in store.prune(stale_builds=True).keys] == [3]
    assert store_stats(store).builds[0].build_hash == "build-a"  # the emptied build row went too
    with pytest.raises(ValueError, match="no device"):
        store.prune(other_devices_than="B200")
    assert [k.rows for k in store.prune(other_devices_than="h200").keys] == [4]
    assert [d.device for d in store_stats(store).devices] == [H200]
    assert store.prune(other_devices_than=H200).count == 0
    assert store.prune().count == 0  # no criterion, nothing deleted
    assert [r.key.rows for r in store.query()] == [2]


def test_prune_with_explicit_current_build(store):
    store.upsert_many([make_record(rows=1), make_record(rows=2, build_hash="build-b")])
    result = store.prune(stale_builds=True, current_build="build-b")
    assert [k.build_hash for k in result.keys] == ["build-a"]
    assert [r.key.build_hash for r in store.query()] == ["build-b"]


def test_prune_of_more_results_than_one_statement_may_bind(tmp_path):
    # SQLite refuses a statement with more parameters than its limit (32766 by default): a prune of
    # more results than that must still delete them all.  The limit is lowered so the test stays small.
    sqlite3 = pytest.importorskip("sqlite3")
    if not hasattr(sqlite3.Connection, "setlimit"):
        pytest.skip("this Python's sqlite3 cannot lower the parameter limit")
    limit = 600
    with open_store(str(tmp_path / "many.sqlite"), config_type=KernelConfig) as store:
        keep = make_record(rows=1, build_hash="build-new")
        store.upsert_many([keep, *(make_record(rows=r) for r in range(1, 2 * limit))])
        engine = store._engine
        sa.event.listen(engine, "connect", lambda conn, _: conn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, limit))
        engine.dispose()
        with engine.connect() as conn, pytest.raises(sa.exc.OperationalError, match="too many SQL variables"):
            conn.execute(sa.select(sa.literal(1)).where(sa.literal(0).in_(list(range(limit + 1)))))
        pruned = store.prune(stale_builds=True, current_build="build-new")
        assert sorted(k.rows for k in pruned.keys) == list(range(1, 2 * limit))
        assert store.query() == [store.get(keep.key)]
        assert [b.build_hash for b in store_stats(store).builds] == ["build-new"]


def test_data_survives_reopening(db_url):
    with open_store(db_url) as s:
        s.upsert(make_record())
    with open_store(db_url) as s:
        assert len(s.query()) == 1
        assert not s.in_memory
        assert "build" not in s.url


def test_store_keys_are_hashable_and_equal_by_value():
    a, b = make_record().key, make_record().key
    assert a == b and hash(a) == hash(b)
    assert len({KernelConfig.kvsplit(4), KernelConfig(family="kvsplit", params={"kv_split": 4})}) == 1
    assert isinstance(a, TuningKey)
