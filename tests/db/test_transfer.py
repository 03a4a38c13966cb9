"""Export and import: round trips, merge rules, and invalid files that write nothing."""

from __future__ import annotations

import json
import re

import pytest
from dbtestlib import A100, make_record
from kvsplit.db import open_store
from kvsplit.export import InvalidExportError, dump_export, make_export, parse_export, read_export


def _export_dict(records) -> dict:
    with open_store("sqlite://") as scratch:
        scratch.import_records(records)
        return json.loads(dump_export(make_export(scratch.query())))


def test_export_then_import_into_an_empty_database(store, db_url, tmp_path, days):
    records = [make_record(rows=r, winner=w, updated_at=days(r)) for r, w in [(1, 16), (64, 4), (4096, 1)]]
    store.import_records(records)
    path = tmp_path / "export.json"
    path.write_text(dump_export(make_export(store.query())))
    data = json.loads(path.read_text())
    assert data["format"] == "kvsplit-tuning" and data["version"] == 1
    assert len(data["records"]) == 3

    with open_store(f"sqlite:///{tmp_path / 'other.sqlite'}") as other:
        summary = other.import_records(read_export(path))
        assert (summary.inserted, summary.replaced, summary.kept) == (3, 0, 0)
        assert other.query() == store.query()  # every field, timestamps included


def test_export_filters_and_read_export(store):
    store.upsert_many([make_record(), make_record(device=A100)])
    text = dump_export(make_export(store.query(device="a100")))
    records = read_export(text)
    assert [r.key.device for r in records] == [A100]
    assert read_export(text.encode()) == records


@pytest.mark.parametrize(
    ("rule", "expect_rows_winner", "counts"),
    [
        # stored: rows=1 at day 5 (winner 4), rows=2 at day 5 (winner 4)
        # incoming: rows=1 at day 9 (newer), rows=2 at day 5 (tie), rows=3 new
        ("newer", {1: 16, 2: 4, 3: 16}, (1, 1, 1)),
        ("replace", {1: 16, 2: 16, 3: 16}, (1, 2, 0)),
        ("keep", {1: 4, 2: 4, 3: 16}, (1, 0, 2)),
    ],
)
def test_import_merge_rules_into_a_non_empty_database(store, days, rule, expect_rows_winner, counts):
    store.import_records([make_record(rows=1, updated_at=days(5)), make_record(rows=2, updated_at=days(5))])
    incoming = [
        make_record(rows=1, winner=16, updated_at=days(9)),
        make_record(rows=2, winner=16, updated_at=days(5)),
        make_record(rows=3, winner=16, updated_at=days(1)),
    ]
    summary = store.import_records(read_export(json.dumps(_export_dict(incoming))), rule=rule)
    assert (summary.inserted, summary.replaced, summary.kept) == counts
    assert {r.key.rows: r.winner.kv_split for r in store.query()} == expect_rows_winner
    if rule == "newer":
        assert store.get(incoming[0].key).updated_at == days(9)  # imported times are kept


def test_import_older_record_keeps_the_stored_one(store, days):
    store.import_records([make_record(updated_at=days(5), winner=4)])
    summary = store.import_records([make_record(updated_at=days(1), winner=16)])
    assert summary.kept == 1 and store.query()[0].winner.kv_split == 4


def test_import_dry_run_writes_nothing(store):
    summary = store.import_records([make_record()], dry_run=True)
    assert summary.inserted == 1 and summary.dry_run
    assert store.query() == []


def _good() -> dict:
    return _export_dict([make_record(rows=1), make_record(rows=2)])


def _set(path, value):
    def change(doc):
        target = doc
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = value
        return doc

    return change


def _delete(path):
    def change(doc):
        target = doc
        for part in path[:-1]:
            target = target[part]
        del target[path[-1]]
        return doc

    return change


# name -> (change to a valid export, regular expression one problem must match)
BAD_CASES = {
    "unknown field": (_set(["records", 1, "key", "colour"], "red"), "record 1: key.colour"),
    "unknown top-level field": (_set(["comment"], "x"), "comment"),
    "K not a power of two": (_set(["records", 1, "winner", "params", "kv_split"], 3), "record 1: winner"),
    "K too large": (
        _set(["records", 0, "candidates", 4, "config", "params", "kv_split"], 32),
        "record 0: candidates.4.config",
    ),
    "unknown family": (_set(["records", 0, "winner", "family"], "headsplit"), "unknown kernel family"),
    "unknown param": (_set(["records", 1, "winner", "params", "tile"], 2), "record 1: winner"),
    "K as a string": (_set(["records", 1, "winner", "params", "kv_split"], "4"), "record 1: winner: kvsplit.kv_split='4'"),
    "negative time": (_set(["records", 1, "candidates", 0, "p10_us"], -1.0), "record 1: candidates.0.p10_us"),
    "infinite time": (
        _set(["records", 0, "candidates", 2, "median_us"], float("inf")),
        "record 0: candidates.2.median_us",
    ),
    "NaN time": (_set(["records", 0, "candidates", 2, "p90_us"], float("nan")), "record 0: candidates.2.p90_us"),
    "missing key": (_delete(["records", 1, "key"]), "record 1: key: Field required"),
    "missing rows": (_delete(["records", 0, "key", "rows"]), "record 0: key.rows"),
    "bad dtype": (_set(["records", 0, "key", "partial_dtype"], "bf16"), "record 0: key.partial_dtype"),
    "winner not measured": (
        _delete(["records", 1, "candidates", 2]),  # kv_split=4, the winner
        r"record 1: winner kvsplit\(kv_split=4\) is not among",
    ),
    "wrong format": (_set(["format"], "other"), "format"),
    "future version": (_set(["version"], 2), "version"),
    "duplicate key": (
        lambda d: {**d, "records": [d["records"][0], d["records"][0]]},
        "record 1: key: same key as record 0",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_invalid_import_names_record_and_field_and_writes_nothing(store, days, case):
    store.import_records([make_record(rows=2, winner=2, updated_at=days(1))])
    before = store.query()
    change, expected = BAD_CASES[case]
    doc = _good()
    doc["records"][1]["updated_at"] = days(99).isoformat()  # would replace the stored rows=2
    text = json.dumps(change(doc))  # json writes NaN/Infinity literally, as Python would
    with pytest.raises(InvalidExportError) as info:
        store.import_records(read_export(text), rule="replace")
    assert any(re.search(expected, p) for p in info.value.problems), info.value.problems
    assert store.query() == before


@pytest.mark.parametrize("text", ["", "not json", '{"format": "kvsplit-tuning", "version": 1, "records": [', "[]"])
def test_malformed_json_is_an_invalid_export(text, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(InvalidExportError):
        parse_export(path)


def test_winner_that_did_not_match_is_refused():
    doc = _good()
    doc["records"][0]["candidates"][2]["matched"] = False  # kv_split=4 is the winner
    with pytest.raises(InvalidExportError, match="record 0: winner kvsplit.kv_split=4. did not match"):
        parse_export(json.dumps(doc))
