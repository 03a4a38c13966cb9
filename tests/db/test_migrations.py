"""Schema versions: fresh databases, the 0001 -> head and 0002 -> head upgrades with data, newer schemas refused."""

from __future__ import annotations

import warnings
from datetime import datetime

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from dbtestlib import make_record
from kvsplit.cli.reports import fleet_progress
from kvsplit.config import KernelConfig
from kvsplit.db import (
    DbWarning,
    SchemaTooNew,
    StoreError,
    head_revision,
    open_store,
    open_store_for_library,
)
from kvsplit.db.engine import create_db_engine
from kvsplit.db.migrate import VERSION_TABLE, upgrade
from kvsplit.db.models import METADATA

CREATED = datetime(2026, 3, 1, 12, 0, 0)
UPDATED = datetime(2026, 3, 2, 12, 0, 0)


def _build_revision_1(url: str) -> None:
    """A database at revision 0001 with two results (K=8 and K=1 winners) and their candidates."""
    engine = create_db_engine(url)
    upgrade(engine, "0001")
    with engine.begin() as conn:
        conn.execute(
            sa.text("INSERT INTO devices (id, name, cc_major, cc_minor, sm_count) VALUES (1, 'NVIDIA H200', 9, 0, 132)")
        )
        conn.execute(
            sa.text("INSERT INTO kernel_builds (id, build_hash, library_version) VALUES (1, 'build-a', '0.0.9')")
        )
        for rid, rows, winner in [(1, 64, 8), (2, 4096, 1)]:
            conn.execute(
                sa.text(
                    "INSERT INTO tuning_results (id, device_id, build_id, head_dim, partial_dtype, out_dtype,"
                    " stats_format, num_splits, rows, winner_kv_split, l2_state, repeats, noise_margin,"
                    " tool_version, created_at, updated_at) VALUES (:id, 1, 1, 512, 'bfloat16', 'bfloat16',"
                    " 'maxsum', 16, :rows, :winner, 'cold', 50, 0.03, '0.0.9', :c, :u)"
                ),
                # As text, the way SQLAlchemy stores SQLite DATETIME (sqlite3's own
                # datetime adapter is deprecated since Python 3.12).
                {"id": rid, "rows": rows, "winner": winner, "c": CREATED.isoformat(" "), "u": UPDATED.isoformat(" ")},
            )
            for k in (1, 2, 4, 8, 16):
                median = 2.0 if k == winner else 5.0 + k
                conn.execute(
                    sa.text(
                        "INSERT INTO tuning_candidates (result_id, kv_split, median_us, p10_us, p90_us, samples,"
                        " matched) VALUES (:r, :k, :m, :lo, :hi, :n, :ok)"
                    ),
                    {
                        "r": rid,
                        "k": k,
                        "m": median,
                        "lo": median - 0.5,
                        "hi": median + 0.5,
                        "n": 100 + k,
                        "ok": k != 16 or winner == 16,
                    },
                )
    engine.dispose()


def _revision(url: str) -> str | None:
    engine = create_db_engine(url)
    with engine.connect() as conn:
        found = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()
    engine.dispose()
    return found


def _schema_diff(url: str) -> list:
    engine = create_db_engine(url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE, "compare_type": True})
        diff = compare_metadata(ctx, METADATA)
    engine.dispose()
    return diff


def test_empty_database_is_created_at_head_and_matches_the_models(db_url):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DbWarning)  # creating is not an upgrade: no warning
        open_store(db_url).close()
    assert _revision(db_url) == head_revision() == "0003"
    assert _schema_diff(db_url) == []


def test_revision_1_with_data_is_upgraded_in_place(db_url):
    _build_revision_1(db_url)
    assert _revision(db_url) == "0001"
    with pytest.warns(DbWarning, match="from schema revision 0001 to 0003") as caught:
        store = open_store(db_url, config_type=KernelConfig)
    assert len(caught) == 1
    records = {r.key.rows: r for r in store.query()}
    assert sorted(records) == [64, 4096]
    r64 = records[64]
    assert r64.winner == KernelConfig.kvsplit(8)
    assert r64.policy.l2_state == "cold" and r64.policy.repeats == 50 and r64.policy.noise_margin == 0.03
    assert r64.tool_version == "0.0.9"
    assert r64.created_at.replace(tzinfo=None) == CREATED and r64.updated_at.replace(tzinfo=None) == UPDATED
    assert [(c.config.kv_split, c.median_us, c.samples, c.matched) for c in r64.candidates] == [
        (1, 6.0, 101, True),
        (2, 7.0, 102, True),
        (4, 9.0, 104, True),
        (8, 2.0, 108, True),
        (16, 21.0, 116, False),
    ]
    assert r64.speedup == pytest.approx(3.0)
    assert records[4096].winner == KernelConfig.kvsplit(1)
    # The upgraded database takes new writes and has exactly the models' schema.
    store.upsert(make_record(rows=64, build_hash="build-a", winner=16))
    assert store.get(r64.key).winner.kv_split == 16
    store.close()
    assert _schema_diff(db_url) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", DbWarning)  # already current: no second warning
        open_store(db_url).close()


def test_downgrade_and_upgrade_again_keep_the_data(db_url):
    with open_store(db_url) as store:
        store.upsert_many([make_record(rows=1, winner=2), make_record(rows=2, winner=16)])
        before = store.query()
    engine = create_db_engine(db_url)
    assert upgrade(engine, "0001") == ("0003", "0001")
    assert upgrade(engine, "head") == ("0001", "0003")
    engine.dispose()
    with open_store(db_url) as store:
        assert store.query() == before


def _stamp(url: str, revision: str) -> None:
    engine = create_db_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE {VERSION_TABLE} SET version_num = :v"), {"v": revision})
    engine.dispose()


def test_newer_schema_is_refused_with_a_clear_message(db_url):
    open_store(db_url).close()
    _stamp(db_url, "0007_from_the_future")
    with pytest.raises(SchemaTooNew) as info:
        open_store(db_url)
    message = str(info.value)
    assert "'0007_from_the_future'" in message and "upgrade kvsplit" in message and "--db" in message
    assert info.value.revision == "0007_from_the_future"
    assert isinstance(info.value, StoreError)
    assert _revision(db_url) == "0007_from_the_future"  # untouched


def test_newer_schema_gives_a_library_caller_one_warning_and_memory(db_url):
    open_store(db_url).close()
    _stamp(db_url, "0007_from_the_future")
    with pytest.warns(DbWarning, match="0007_from_the_future") as caught:
        store = open_store_for_library(db_url)
    assert len(caught) == 1
    assert store.in_memory
    store.upsert(make_record())
    assert len(store.query()) == 1


def test_a_database_from_before_the_dsplit_family_still_serves_its_choices(db_url):
    """Revision 0001 knew only kv_split: its winners still reach the kernel, next to DSplit ones."""
    from kvsplit.db import CandidateResult, DeviceInfo
    from kvsplit.dispatch.constraints import constrain_config, kvsplit_config

    _build_revision_1(db_url)
    with pytest.warns(DbWarning):
        store = open_store(db_url, config_type=KernelConfig)  # as the dispatcher opens it
    h200 = DeviceInfo(name="NVIDIA H200", cc_major=9, cc_minor=0, sm_count=132)
    before = store.load_choices(h200, "build-a")
    assert sorted(w.kv_split for w in before.values()) == [1, 8]
    for (head_dim, _, _, _, num_splits, rows), winner in before.items():
        config = winner  # what the dispatcher constrains and launches
        assert config == kvsplit_config(winner.kv_split)
        assert constrain_config(config, head_dim=head_dim, elem_bytes=2, rows=rows,
                                num_splits=num_splits, sm_count=132) == config
    # The upgraded database takes a DSplit winner beside them, and gives it back.
    dsplit = KernelConfig(family="dsplit", params={"depth": 8, "kv_split": 16, "slices": 4})
    record = make_record(rows=32, build_hash="build-a")
    record = record.model_copy(update={
        "winner": dsplit,
        "candidates": record.candidates + [CandidateResult(config=dsplit, median_us=1.0, p10_us=0.9,
                                                           p90_us=1.1, samples=9, matched=True)]})
    store.upsert(record)
    after = store.load_choices(h200, "build-a")
    assert {k: v for k, v in after.items() if k in before} == before
    assert after[record.key.choice_key] == KernelConfig.dsplit(4, 16, 8)
    assert store.get(record.key).winner.label == "dsplit(depth=8, kv_split=16, slices=4)"
    store.close()


def test_a_database_from_before_fleet_tuning_is_upgraded_and_takes_claims(db_url):
    """Revision 0002 (no claims, no generation counter): its results stay, the fleet tables come empty."""
    from kvsplit.db import Claims

    _build_revision_1(db_url)
    engine = create_db_engine(db_url)
    assert upgrade(engine, "0002") == ("0001", "0002")
    engine.dispose()
    with pytest.warns(DbWarning, match="from schema revision 0002 to 0003"):
        store = open_store(db_url)
    assert sorted(r.key.rows for r in store.query()) == [64, 4096]
    assert store.generation() is None  # no write since the upgrade
    assert _schema_diff(db_url) == []
    claims = Claims(store)
    new = make_record(rows=32)
    stored = store.query()[0].key
    step = claims.claim_next([stored, new.key], "host/1/cpu", 30.0, run_started=claims.now())
    assert step.claim is not None and step.claim.key == new.key  # the stored key is done already
    assert step.standings["done"] == 1
    claims.finish(step.claim, record=new)
    assert store.generation() == 1
    progress = fleet_progress(claims, [stored, new.key])
    assert (progress.keys, progress.done, progress.left, progress.attempts) == (2, 2, 0, 1)
    store.close()
    engine = create_db_engine(db_url)
    assert upgrade(engine, "0002") == ("0003", "0002")  # and back: the fleet tables go, results stay
    engine.dispose()
    assert _revision(db_url) == "0002"
