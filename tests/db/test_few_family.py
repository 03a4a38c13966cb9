"""A Few-family config (``{"family": "few", "params": {"vectors": V}}``) round-trips through
the store, the JSON exchange format and the ``kvsplit db`` commands, like the others."""

from __future__ import annotations

import json

from clirun import invoke
from dbtestlib import make_record
from kvsplit.config import KernelConfig
from kvsplit.db import CandidateResult, open_store
from kvsplit.export import dump_export, make_export, read_export
from kvsplit.cli.db import db

FEW = KernelConfig.few(2)


def few_record(**kwargs):
    """make_record's KvSplit candidates plus the three Few configs, few(vectors=2) the winner."""
    record = make_record(num_splits=2, rows=1024, head_dim=128, **kwargs)
    extra = [CandidateResult(config=KernelConfig.few(v), median_us=median, p10_us=median * 0.9,
                             p90_us=median * 1.1, samples=200, matched=True)
             for v, median in ((1, 2.5), (2, 2.0), (4, 2.2))]
    return record.model_copy(update={"winner": FEW, "candidates": record.candidates + extra})


def test_a_few_winner_round_trips_through_the_store(db_url):
    record = few_record()
    with open_store(db_url) as store:
        store.upsert(record)
        stored = store.get(record.key)
        choices = store.load_choices(record.key.device, record.key.build_hash)
    assert stored.winner == FEW and stored.winner.label == "few(vectors=2)"
    assert {c.config for c in stored.candidates} >= {KernelConfig.few(v) for v in (1, 2, 4)}
    assert choices[record.key.choice_key] == FEW
    # The exchange format: {"family": "few", "params": {"vectors": 2}}.
    text = dump_export(make_export([stored]))
    winner = json.loads(text)["records"][0]["winner"]
    assert winner == {"family": "few", "params": {"vectors": 2}}
    assert read_export(text)[0].winner == FEW


def test_db_commands_show_export_import_and_plot_a_few_winner(db_url, tmp_path):
    with open_store(db_url) as store:
        store.upsert(few_record())
    listed = invoke(db, "--db", db_url, "list")
    assert listed.exit_code == 0 and "few(vectors=2)" in listed.stdout
    shown = invoke(db, "--db", db_url, "show", "--num-splits", "2", "--rows", "1024")
    assert shown.exit_code == 0 and "few(vectors=4)" in shown.stdout
    path = tmp_path / "few.json"
    assert invoke(db, "--db", db_url, "export", "--out", str(path)).exit_code == 0
    target = f"sqlite:///{tmp_path / 'target.sqlite'}"
    imported = invoke(db, "--db", target, "import", str(path), "--json")
    assert imported.exit_code == 0 and json.loads(imported.stdout)["inserted"] == 1
    with open_store(target) as store:
        assert [r.winner for r in store.query()] == [FEW]
    plot = invoke(db, "--db", target, "plot", "--out", str(tmp_path / "few.png"))
    assert plot.exit_code == 0, plot.output


def test_an_illegal_few_config_is_refused_on_import(db_url, tmp_path):
    doc = json.loads(dump_export(make_export([few_record()])))
    doc["records"][0]["winner"]["params"] = {"vectors": 3}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    result = invoke(db, "--db", db_url, "import", str(bad))
    assert result.exit_code == 2 and "vectors" in result.output
    with open_store(db_url) as store:
        assert store.query() == []
