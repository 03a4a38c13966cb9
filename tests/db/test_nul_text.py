"""A NUL character in stored text means the same on SQLite and PostgreSQL.

PostgreSQL's text cannot hold NUL; SQLite's can.  kvsplit refuses it where
text comes in (an import: exit 2, nothing written), escapes it in the text
it writes itself (a failure's message), and a filter holding one matches
nothing: the same outcome on both backends, checked on fixed cases and on
random device names.
"""

from __future__ import annotations

import json
import string
from datetime import timedelta

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from dbtestlib import H200, make_record
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsplit.cli import main
from kvsplit.cli.reports import fleet_progress
from kvsplit.db import Claims, DbWarning, DeviceInfo, open_store, open_store_for_library

FIELDS = {
    "device name": lambda r: r["key"]["device"].update(name="H200\x00evil"),
    "build hash": lambda r: r["key"].update(build_hash="build\x00a"),
    "tool version": lambda r: r.update(tool_version="0.1\x00"),
}


def export_text(edit=None) -> str:
    data = {"format": "kvsplit-tuning", "version": 1, "records": [make_record().model_dump(mode="json")]}
    if edit is not None:
        edit(data["records"][0])
    return json.dumps(data)


def cli(*args: str):
    result = CliRunner().invoke(main, list(args), catch_exceptions=True)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


@pytest.mark.parametrize("field", list(FIELDS))
def test_an_import_with_a_nul_is_invalid_input_on_every_backend(db_url, tmp_path, field):
    path = tmp_path / "nul.json"
    path.write_text(export_text(FIELDS[field]))
    result = cli("db", "import", str(path), "--db", db_url)
    assert result.exit_code == 2, result.output
    assert "NUL character" in result.stderr and "nothing was written" in result.stderr
    with open_store(db_url) as store:
        assert store.query() == []


def test_filters_holding_a_nul_match_nothing_on_every_backend(db_url):
    with open_store(db_url) as store:
        store.upsert(make_record())
    for args in (["db", "list", "--device", "h200\x00"], ["db", "list", "--build", "build-a\x00"],
                 ["db", "stats", "--current-build", "build-a\x00", "--json"]):
        result = cli(*args, "--db", db_url)
        assert result.exit_code == 0, (args, result.output)
    assert cli("db", "list", "--device", "h2\x00", "--json", "--db", db_url).stdout.strip() == "[]"
    pruned = cli("db", "prune", "--other-devices-than", "h200\x00", "--db", db_url)
    assert pruned.exit_code == 2 and "no device in the database matches" in pruned.stderr
    with open_store(db_url) as store:
        assert store.query(device="H200\x00") == [] and len(store.query()) == 1


def test_a_failure_message_with_a_nul_is_stored_escaped_on_every_backend(db_url):
    with open_store(db_url) as store:
        claims = Claims(store)
        key = make_record().key
        step = claims.claim_next([key], "host/1/cpu", 60.0, run_started=claims.now())
        claims.finish(step.claim, error="boom\x00bang")
        [failure] = fleet_progress(claims, [key]).failures
    assert failure.error == "boom\\x00bang"


def test_a_nul_written_past_kvsplit_into_sqlite_is_a_damaged_row(tmp_path):
    """Only SQLite can hold one; there it is damage like any value that does not validate."""
    url = f"sqlite:///{tmp_path / 'tuning.sqlite'}"
    with open_store(url) as store:
        store.upsert(make_record())
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE devices SET name = 'NVIDIA H200' || char(0) || 'x'")
    engine.dispose()
    listed = cli("db", "list", "--db", url)
    assert listed.exit_code == 3 and "kvsplit db repair" in listed.stderr and "NUL" in listed.stderr
    with pytest.warns(DbWarning, match="do not parse"):
        assert open_store_for_library(url).query() == []
    assert cli("db", "repair", "--db", url).exit_code == 0
    assert cli("db", "list", "--db", url, "--json").stdout.strip() == "[]"


# -- random device names: the same outcome on both backends ------------------------------------

_NAMES = st.text(st.sampled_from(list(string.printable) + ["\x00", "\x1b", "é", "\u202e", "💾", "\ufeff"]),
                 min_size=0, max_size=140)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=_NAMES)
def test_random_device_names_import_alike_on_sqlite_and_postgresql(pg_url, tmp_path_factory, name):
    sqlite_url = f"sqlite:///{tmp_path_factory.mktemp('nul') / 'tuning.sqlite'}"
    record = make_record().model_dump(mode="json")
    record["key"]["device"]["name"] = name
    path = tmp_path_factory.mktemp("import") / "e.json"
    path.write_text(json.dumps({"format": "kvsplit-tuning", "version": 1, "records": [record]}))
    outcomes = {}
    for backend, url in (("sqlite", sqlite_url), ("postgres", pg_url)):
        result = cli("db", "import", str(path), "--db", url, "--replace", "--json")
        with open_store(url) as store:
            names = [r.key.device.name for r in store.query()]
            store.prune(older_than=timedelta(0))  # empty again for the next example
        outcomes[backend] = (result.exit_code, names)
    assert outcomes["sqlite"] == outcomes["postgres"], (name, outcomes)
    code, names = outcomes["sqlite"]
    valid = 1 <= len(name) <= 128 and "\x00" not in name
    assert (code, names) == ((0, [name]) if valid else (2, [])), (name, outcomes)


def test_device_info_refuses_a_nul_itself():
    with pytest.raises(ValueError, match="NUL"):
        DeviceInfo(name="H\x00", cc_major=9, cc_minor=0, sm_count=132)
    assert DeviceInfo(name="H200 \x1b[31m", cc_major=9, cc_minor=0, sm_count=132) != H200  # other controls: data
