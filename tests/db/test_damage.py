"""Rows that do not parse, through the store's API: skipped with one warning, refused, or healed.

The fault-injection suite covers every column; these pin the store's policy
for the cases people hit: a winner that is not JSON, a bad timestamp.
"""

from __future__ import annotations

import warnings

import pytest
import sqlalchemy as sa
from dbtestlib import H200, make_record
from kvsplit.cli.reports import store_stats
from kvsplit.config import KernelConfig
from kvsplit.db import DamagedRows, DbWarning, open_store, open_store_for_library
from kvsplit.db.engine import create_db_engine


def _damage(url: str, sql: str) -> None:
    engine = create_db_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text(sql))
    engine.dispose()


@pytest.fixture
def damaged(db_url):
    """Three results for H200/build-a; the first one's winner_params is not JSON."""
    with open_store(db_url) as store:
        store.upsert_many(make_record(rows=r, winner=w) for r, w in ((1, 4), (2, 8), (3, 16)))
    _damage(db_url, "UPDATE tuning_results SET winner_params = 'notjson' WHERE rows = 1")
    return db_url


def _caught(operation):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = operation()
    return value, [str(w.message) for w in caught if issubclass(w.category, DbWarning)]


def test_a_library_store_skips_the_row_with_one_warning_naming_it(damaged):
    store = open_store_for_library(damaged, config_type=KernelConfig)  # as the dispatcher opens it
    choices, first = _caught(lambda: store.load_choices(H200, "build-a"))
    assert {key[-1]: config.kv_split for key, config in choices.items()} == {2: 8, 3: 16}
    assert len(first) == 1
    assert "tuning_results id" in first[0] and "winner_params is not JSON" in first[0]
    assert "kvsplit db repair" in first[0]
    # The same row is not warned about again, whatever reads it.
    again, later = _caught(lambda: (store.load_choices(H200, "build-a"), store.query(), store_stats(store)))
    assert later == [] and len(again[1]) == 2 and again[2].keys == 2
    assert not store.in_memory  # the database still serves the rows that parse
    store.close()


def test_a_strict_store_refuses_with_every_row_named(damaged):
    with open_store(damaged) as store:
        with pytest.raises(DamagedRows, match=r"1 row does not parse \(tuning_results id \d+: winner_params") as info:
            store.query()
        assert len(info.value.damage) == 1 and info.value.damage[0].table == "tuning_results"
        assert len(store.query(rows=2)) == 1  # a read that does not meet the row is fine
        with pytest.raises(DamagedRows):
            store.check()


def test_a_strict_prune_that_meets_a_damaged_row_deletes_nothing(damaged):
    with open_store(damaged) as store:
        with pytest.raises(DamagedRows):
            store.prune(stale_builds=True, current_build="other")
    with open_store(damaged, on_damage="warn") as store:
        assert len(_caught(store.query)[0]) == 2


def test_an_upsert_heals_a_damaged_row_of_its_key(db_url):
    record = make_record(rows=7)
    with open_store(db_url) as store:
        store.upsert(record)
    # A time Python cannot hold: PostgreSQL stores year 10000, SQLite any text.
    bad_time = "'garbage'" if db_url.startswith("sqlite") else "'10000-01-01 00:00:00'"
    _damage(db_url, f"UPDATE tuning_results SET created_at = {bad_time}, winner_params = '[1]'")
    with open_store(db_url, on_damage="warn") as store:
        assert _caught(lambda: store.get(record.key))[0] is None  # damaged: as if absent
        store.upsert(make_record(rows=7, winner=16))
    with open_store(db_url) as store:
        healed = store.get(record.key)
        assert healed.winner == KernelConfig.kvsplit(16) and healed.created_at is not None
        assert store.damage() == []


def test_an_import_replaces_a_stored_row_whose_time_does_not_parse(tmp_path, days):
    # SQLite only: PostgreSQL keeps text out of a timestamp column.
    url = f"sqlite:///{tmp_path / 'tuning.sqlite'}"
    with open_store(url) as store:
        store.upsert(make_record(rows=5, winner=2))
    _damage(url, "UPDATE tuning_results SET updated_at = 'garbage'")
    with open_store(url, on_damage="warn") as store:
        # Any real time is newer than one that does not parse.
        summary = store.import_records([make_record(rows=5, winner=8, updated_at=days(1))], rule="newer")
        assert (summary.inserted, summary.replaced, summary.kept) == (0, 1, 0)
    with open_store(url) as store:
        assert store.damage() == [] and store.query()[0].winner == KernelConfig.kvsplit(8)
