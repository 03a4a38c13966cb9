"""``kvsplit db ...`` through click's CliRunner: tables, JSON, files, exit codes."""

from __future__ import annotations

import json
import struct
import sys
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest
import sqlalchemy as sa
from clirun import invoke
from dbtestlib import A100, make_record
from kvsplit.db import open_store
from kvsplit.export import dump_export, make_export
from kvsplit.cli.db import db
from kvsplit.db.engine import create_db_engine
from kvsplit.db.migrate import VERSION_TABLE


@pytest.fixture
def filled(db_url):
    """The database URL, holding 2 devices x 2 builds x a small (num_splits, rows) grid."""
    now = datetime.now(timezone.utc)
    records = [
        make_record(num_splits=n, rows=r, winner=w, updated_at=now - timedelta(days=age), build_hash=b)
        for b, age in [("build-a", 40), ("build-b", 1)]
        for n, r, w in [(4, 1, 4), (4, 512, 2), (64, 1, 16), (64, 512, 8), (64, 65536, 1)]
    ]
    records.append(make_record(device=A100, winner=2, updated_at=now, build_hash="build-b"))
    with open_store(db_url) as store:
        store.import_records(records)
    return db_url


def run(*args: str, input: str | None = None) -> SimpleNamespace:
    """Invoke ``kvsplit db ARGS``; no command shows a traceback."""
    result = invoke(db, *args, input=input)
    assert "Traceback" not in result.output
    return result


def test_list_table_and_filters(filled):
    result = run("--db", filled, "list")
    assert result.exit_code == 0
    assert "11 tuning results" in result.stdout and "kvsplit(kv_split=16)" in result.stdout
    assert "2.50x" in result.stdout and "NVIDIA A100" in result.stdout
    filtered = run("--db", filled, "list", "--device", "a100", "--json")
    rows = json.loads(filtered.stdout)
    assert [r["key"]["device"]["name"] for r in rows] == [A100.name]
    narrow = json.loads(
        run(
            "--db",
            filled,
            "list",
            "--num-splits",
            "64",
            "--rows",
            "1",
            "--head-dim",
            "512",
            "--dtype",
            "bfloat16",
            "--json",
        ).stdout
    )
    assert len(narrow) == 2 and {r["winner"]["params"]["kv_split"] for r in narrow} == {16}


def test_list_reads_the_url_from_the_environment(filled, monkeypatch):
    monkeypatch.setenv("KVSPLIT_DB", filled)
    assert len(json.loads(run("list", "--json").stdout)) == 11


def test_show_one_key_with_candidates(filled):
    result = run("--db", filled, "show", "--build", "build-b", "--num-splits", "64", "--rows", "512")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "kvsplit(kv_split=8)" in out and "winner" in out and "candidates" in out
    for k in (1, 2, 4, 8, 16):
        assert f"kvsplit(kv_split={k})" in out
    data = json.loads(run("--db", filled, "show", "--device", "a100", "--json").stdout)
    assert data["winner"] == {"family": "kvsplit", "params": {"kv_split": 2}}
    assert len(data["candidates"]) == 5


def test_show_needs_exactly_one_match(filled):
    none = run("--db", filled, "show", "--rows", "12345")
    assert none.exit_code == 1 and "no tuning result matches" in none.output
    many = run("--db", filled, "show", "--rows", "1")
    assert many.exit_code == 2 and "4 tuning results match" in many.output


def test_stats_table_and_json(filled):
    result = run("--db", filled, "stats")
    assert result.exit_code == 0
    assert "11 tuning results" in result.stdout and "stale" in result.stdout
    data = json.loads(run("--db", filled, "stats", "--json").stdout)
    assert data["keys"] == 11
    assert {d["device"]["name"]: d["keys"] for d in data["devices"]} == {"NVIDIA H200": 10, A100.name: 1}
    # Speed-ups are 2.5 except the two kv_split=1 winners (1.0): mean (8 * 2.5 + 2 * 1) / 10.
    h200 = next(d for d in data["devices"] if d["device"]["name"] == "NVIDIA H200")
    assert h200["mean_speedup"] == pytest.approx(2.2)
    # Stale as prune --stale-builds reads it: neither is an installed build.
    assert {b["build_hash"]: (b["stale"], b["installed"]) for b in data["builds"]} == {
        "build-a": (True, False), "build-b": (True, False)}
    current = json.loads(run("--db", filled, "stats", "--current-build", "build-a", "--json").stdout)
    assert {b["build_hash"]: b["stale"] for b in current["builds"]} == {"build-a": False, "build-b": True}


def test_a_count_of_one_is_singular(db_url, tmp_path):
    with open_store(db_url) as store:
        store.import_records([make_record(winner=2)])
    outputs = {
        "stats": run("--db", db_url, "stats").stdout,
        "list": run("--db", db_url, "list").stdout,
        "export": run("--db", db_url, "export", "--out", str(tmp_path / "one.json")).output,
        "prune": run("--db", db_url, "prune", "--stale-builds", "--dry-run").output,
    }
    assert "1 tuning result," in outputs["stats"] and "1 tuning result" in outputs["list"]
    assert "exported 1 tuning result to" in outputs["export"] and "would delete 1 tuning result" in outputs["prune"]
    assert all("1 tuning results" not in text for text in outputs.values()), outputs


def test_export_import_round_trip_through_files_and_stdout(filled, tmp_path):
    path = tmp_path / "out.json"
    result = run("--db", filled, "export", "--out", str(path), "--device", "h200")
    assert result.exit_code == 0 and "exported 10 tuning results" in result.output
    stdout_export = run("--db", filled, "export", "--device", "h200").stdout
    assert json.loads(stdout_export)["records"] == json.loads(path.read_text())["records"]

    target = f"sqlite:///{tmp_path / 'target.sqlite'}"
    first = run("--db", target, "import", str(path), "--json")
    assert first.exit_code == 0
    assert json.loads(first.stdout) == {"rule": "newer", "inserted": 10, "replaced": 0, "kept": 0, "dry_run": False}
    again = run("--db", target, "import", str(path))
    assert "inserted 0, replaced 0, kept 10 existing (rule: newer)" in again.stdout
    forced = json.loads(run("--db", target, "import", str(path), "--replace", "--json").stdout)
    assert forced["replaced"] == 10
    from_stdin = json.loads(run("--db", target, "import", "-", "--keep", "--json", input=stdout_export).stdout)
    assert from_stdin["kept"] == 10
    assert run("--db", target, "import", str(path), "--keep", "--replace").exit_code == 2


def test_invalid_import_exits_2_and_writes_nothing(filled, tmp_path):
    doc = json.loads(run("--db", filled, "export").stdout)
    doc["records"][3]["winner"]["params"]["kv_split"] = 3
    doc["records"][5]["candidates"][0]["median_us"] = -1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    target = f"sqlite:///{tmp_path / 'target.sqlite'}"
    result = run("--db", target, "import", str(bad))
    assert result.exit_code == 2
    assert "nothing was written" in result.output
    assert "record 3: winner: kvsplit.kv_split=3 is not one of 1, 2, 4, 8, 16" in result.output
    assert "record 5: candidates.0.median_us" in result.output
    assert not (tmp_path / "target.sqlite").exists()  # not even created
    assert run("--db", target, "list", "--json").exit_code == 3
    garbage = tmp_path / "garbage.json"
    garbage.write_text("not json at all")
    assert run("--db", target, "import", str(garbage)).exit_code == 2
    assert run("--db", target, "import", str(tmp_path / "missing.json")).exit_code == 2


def test_prune_dry_run_then_real(filled):
    dry = run("--db", filled, "prune", "--older-than", "30d", "--dry-run")
    assert dry.exit_code == 0 and "would delete 5 tuning results" in dry.stdout
    assert len(json.loads(run("--db", filled, "list", "--json").stdout)) == 11
    stale = json.loads(run("--db", filled, "prune", "--stale-builds", "--current-build", "build-b", "--json").stdout)
    assert stale["count"] == 5 and not stale["dry_run"]
    assert {k["build_hash"] for k in stale["keys"]} == {"build-a"}
    others = json.loads(run("--db", filled, "prune", "--other-devices-than", "H200", "--json").stdout)
    assert others["count"] == 1
    assert len(json.loads(run("--db", filled, "list", "--json").stdout)) == 5


@pytest.mark.parametrize(
    "args",
    [
        ["prune"],
        ["prune", "--older-than", "soon"],
        ["prune", "--current-build", "x"],
        ["prune", "--other-devices-than", "B200"],
        ["list", "--dtype", "int8"],
        ["show", "--rows", "many"],
    ],
)
def test_usage_errors_exit_2(filled, args):
    result = run("--db", filled, *args)
    assert result.exit_code == 2, result.output


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_writes_a_png(filled, tmp_path):
    out = tmp_path / "tuning.png"
    result = run("--db", filled, "plot", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "3 groups, 11 results" in result.output
    data = out.read_bytes()
    width, height = _png_size(data)
    assert len(data) > 20_000 and width >= 1000 and height >= 1000
    assert data.endswith(b"IEND\xaeB`\x82")
    missing = run("--db", filled, "plot", "--out", str(tmp_path / "none.png"), "--device", "B200")
    assert missing.exit_code == 1 and not (tmp_path / "none.png").exists()


@pytest.mark.parametrize("suffix, magic", [(".svg", b"<?xml"), (".pdf", b"%PDF")])
def test_plot_writes_the_format_its_name_says(filled, tmp_path, suffix, magic):
    out = tmp_path / f"tuning{suffix}"
    assert run("--db", filled, "plot", "--out", str(out)).exit_code == 0
    assert out.read_bytes().startswith(magic)


def test_plot_refuses_a_name_it_cannot_honour(filled, tmp_path):
    jpg = run("--db", filled, "plot", "--out", str(tmp_path / "p.jpg"))
    assert jpg.exit_code == 2 and ".png, .svg, .pdf" in jpg.stderr
    nowhere = run("--db", filled, "plot", "--out", str(tmp_path / "no" / "such" / "p.png"))
    assert nowhere.exit_code == 2 and "does not exist" in nowhere.stderr
    assert not (tmp_path / "no").exists()
    assert not (tmp_path / "p.jpg").exists()


def test_plot_without_matplotlib_names_the_extra_and_exits_2(filled, tmp_path, monkeypatch):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError, as when not installed
    out = tmp_path / "p.png"
    result = run("--db", filled, "plot", "--out", str(out))
    assert result.exit_code == 2 and not out.exists()
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "matplotlib" in lines[0] and "pip install 'kvsplit[plot]'" in lines[0]


def test_list_filters_take_every_stats_format_a_key_can_have(filled):
    for stats_format in ("maxsum", "lse", "maxsum:scattered", "lse:scattered"):
        assert run("--db", filled, "list", "--stats-format", stats_format).exit_code == 0


def test_plot_panels_share_one_colour_scale(filled, tmp_path, monkeypatch):
    """Every group's speed-up panel maps the same value to the same colour."""
    from matplotlib.axes import Axes

    limits = []
    imshow = Axes.imshow

    def spy(self, grid, *args, **kwargs):
        limits.append((kwargs.get("cmap"), kwargs.get("vmin"), kwargs.get("vmax")))
        return imshow(self, grid, *args, **kwargs)

    monkeypatch.setattr(Axes, "imshow", spy)
    assert run("--db", filled, "plot", "--out", str(tmp_path / "p.png")).exit_code == 0
    speedups = {lim for lim in limits if lim[0] == "magma"}
    winners = {lim for lim in limits if lim[0] == "viridis"}
    assert len(limits) == 6 and len(speedups) == 1 and len(winners) == 1
    (_, low, high), = speedups
    assert low is not None and high is not None and low <= high
    (_, _, top), = winners
    assert top == 4  # log2 of the largest groups per row drawn (K = 16), not a fixed 512


def test_database_problems_exit_3_with_one_line(tmp_path):
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"\x00garbage" * 500)
    cases = {
        "nosuchdialect://x": "bad database URL",
        str(garbage): "corrupt or not an SQLite database",
        str(tmp_path / "missing-dir" / "t.sqlite"): "no such database file",
    }
    for url, message in cases.items():
        result = run("--db", url, "list")
        assert result.exit_code == 3, (url, result.output)
        assert message in result.output
        assert len(result.output.strip().splitlines()) == 1


def test_newer_schema_exits_3(db_url):
    open_store(db_url).close()
    engine = create_db_engine(db_url)
    with engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE {VERSION_TABLE} SET version_num = '0099'"))
    engine.dispose()
    result = run("--db", db_url, "stats")
    assert result.exit_code == 3
    assert "'0099'" in result.output and "upgrade kvsplit" in result.output


def test_upgrade_warning_is_printed_once(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.sqlite'}"
    from kvsplit.db.migrate import upgrade

    engine = create_db_engine(url)
    upgrade(engine, "0001")
    engine.dispose()
    result = run("--db", url, "list")
    assert result.exit_code == 0
    assert result.stderr.count("warning: kvsplit upgraded the tuning database") == 1


# -- issue 13: options where people type them, repair, no traceback ----------------------------


def test_db_goes_before_or_after_the_subcommand(filled, tmp_path, monkeypatch):
    from kvsplit.cli import main

    monkeypatch.delenv("KVSPLIT_DB", raising=False)
    other = f"sqlite:///{tmp_path / 'other.sqlite'}"
    for args in (["stats", "--db", filled], ["--db", filled, "stats"], ["--db", other, "stats", "--db", filled]):
        result = run(*args, "--json")
        assert result.exit_code == 0, (args, result.output)
        assert json.loads(result.stdout)["keys"] == 11
    for args in (["--db", filled, "db", "list"], ["db", "list", "--db", filled], ["db", "--db", filled, "list"]):
        result = invoke(main, *args, "--json")
        assert result.exit_code == 0 and len(json.loads(result.stdout)) == 11, result.output
    assert not (tmp_path / "other.sqlite").exists()  # the last --db won, the other was never opened


def test_rows_and_num_splits_find_the_bucket_a_call_looks_up(db_url):
    with open_store(db_url) as store:
        store.upsert(make_record(num_splits=20, rows=10, winner=8))  # as stored by tune: bucket values
    shown = run("--db", db_url, "show", "--rows", "9", "--num-splits", "18", "--json")
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["key"]["rows"] == 10
    assert len(json.loads(run("--db", db_url, "list", "--rows", "10", "--json").stdout)) == 1
    assert json.loads(run("--db", db_url, "list", "--rows", "11", "--json").stdout) == []  # bucket 12


def test_prune_stale_builds_keeps_the_installed_build_by_default(filled):
    from kvsplit.config import build_hash

    installed = build_hash(False)  # the CPU twin's: in every build
    with open_store(filled) as store:
        store.upsert(make_record(build_hash=installed, rows=3))
    stats = run("--db", filled, "stats")
    assert "installed" in stats.stdout and "stale = not an installed build" in stats.stdout
    builds = json.loads(run("--db", filled, "stats", "--json").stdout)["builds"]
    assert {b["build_hash"]: (b["stale"], b["installed"]) for b in builds} == {
        "build-a": (True, False), "build-b": (True, False), installed: (False, True)}
    result = json.loads(run("--db", filled, "prune", "--stale-builds", "--json").stdout)
    assert result["count"] == 11  # build-a and build-b, although build-b was tuned last
    assert [r["key"]["build_hash"] for r in json.loads(run("--db", filled, "list", "--json").stdout)] == [installed]


@pytest.mark.parametrize("width", [120, 140, 160])
def test_list_shows_every_winner_whole_on_one_line(width):
    from rich.console import Console

    from kvsplit.config import KernelConfig
    from kvsplit.cli.render import records_table

    records = [
        make_record(device=A100, partial_dtype="float32", rows=1_048_576, num_splits=1024).model_copy(
            update={"winner": KernelConfig(family="dsplit", params={"slices": 16, "kv_split": 128, "depth": 8}),
                    "candidates": [], "updated_at": datetime(2026, 1, 1, tzinfo=timezone.utc)}),
        make_record(winner=16, updated_at=datetime(2026, 1, 2, tzinfo=timezone.utc)),
    ]
    out = Console(width=width, record=True)
    out.print(records_table(records))
    text = out.export_text()
    assert max(map(len, text.splitlines())) <= width
    for record in records:
        line = next(line for line in text.splitlines() if record.winner.label in line)
        assert str(record.key.rows) in line and record.updated_at.strftime("%Y-%m-%d") in line
    assert "…" not in text


def test_import_refuses_a_head_dim_the_kernels_do_not_support(tmp_path):
    doc = json.loads(dump_export(make_export([make_record(head_dim=100), make_record(rows=5)])))
    path = tmp_path / "in.json"
    path.write_text(json.dumps(doc))
    target = tmp_path / "target.sqlite"
    result = run("--db", str(target), "import", str(path))
    assert result.exit_code == 2 and "nothing was written" in result.output
    assert ("record 0: key.head_dim: 100 is not supported with bfloat16 partials by the installed "
            "kernels (use a multiple of 8") in result.output
    assert not target.exists()


def test_repair_dry_run_changes_nothing_then_repair_quarantines(filled, tmp_path):
    engine = create_db_engine(filled)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE tuning_results SET l2_state = 'tepid' WHERE rows = 512"))
    engine.dispose()
    assert run("--db", filled, "list").exit_code == 3
    quarantine = tmp_path / "q.jsonl"
    dry = json.loads(run("--db", filled, "repair", "--dry-run", "--quarantine", str(quarantine), "--json").stdout)
    assert dry["dry_run"] and dry["quarantined"] == {"tuning_results": 4, "tuning_candidates": 20}
    assert not quarantine.exists() and run("--db", filled, "list").exit_code == 3
    result = run("--db", filled, "repair", "--quarantine", str(quarantine))
    assert result.exit_code == 0 and "moved 24 rows (tuning_results 4, tuning_candidates 20)" in result.stdout
    assert "policy.l2_state" in result.stdout and "'tepid'" in result.stdout
    lines = [json.loads(line) for line in quarantine.read_text().splitlines()]
    assert len(lines) == 24 and {line["row"]["l2_state"] for line in lines if line["table"] == "tuning_results"} == {
        "tepid"}
    assert len(json.loads(run("--db", filled, "list", "--json").stdout)) == 7
    assert "every row parses" in run("--db", filled, "repair").stdout


def test_repair_restores_a_version_table_that_was_dropped(filled):
    engine = create_db_engine(filled)
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE {VERSION_TABLE}"))
    engine.dispose()
    broken = run("--db", filled, "stats")
    assert broken.exit_code == 3 and "schema version table" in broken.output and "kvsplit db repair" in broken.output
    repaired = run("--db", filled, "repair")
    assert repaired.exit_code == 0 and "stamped schema revision" in repaired.stdout
    assert json.loads(run("--db", filled, "stats", "--json").stdout)["keys"] == 11


def test_an_unforeseen_error_is_one_line_and_debug_shows_the_traceback(filled, monkeypatch):
    from kvsplit.cli import main
    from kvsplit.db import store as store_module

    def broken(self, **filters):
        raise KeyError("bug")

    monkeypatch.setattr(store_module.Store, "query", broken)
    plain = invoke(main, "db", "list", "--db", filled, catch=True)
    assert plain.exit_code == 1 and (plain.exception is None or isinstance(plain.exception, SystemExit))
    assert "internal error: KeyError" in plain.output and "--debug" in plain.output
    assert "Traceback" not in plain.output
    debug = invoke(main, "--debug", "db", "list", "--db", filled, catch=True)
    assert debug.exit_code == 1 and "Traceback" in debug.output and "KeyError" in debug.output


def test_progress_of_a_database_without_tune_says_what_it_counts(db_url):
    """First-use results are not registered keys: progress says so instead of '0 keys'."""
    with open_store(db_url) as store:
        store.import_records([make_record()])
    result = run("--db", db_url, "progress")
    assert result.exit_code == 0
    assert "no key registered by `kvsplit tune`" in result.stdout and "0 keys" not in result.stdout


@pytest.mark.parametrize(("url", "module", "package"), [
    ("mysql://u@localhost/x", "MySQLdb", "mysqlclient"),
    ("postgresql+psycopg2://u@localhost/x", "psycopg2", "psycopg2-binary"),
])
def test_a_missing_driver_names_the_package_to_install(monkeypatch, url, module, package):
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    result = run("--db", url, "list")
    assert result.exit_code == 3 and f"pip install {package}" in result.stderr, result.output


def test_list_filters_the_scattered_formats_tune_writes(db_url):
    """Every stats format a key can hold, ':scattered' ones included, is a filter choice."""
    with open_store(db_url) as store:
        store.import_records([make_record(stats_format="lse:scattered", rows=4),
                              make_record(stats_format="lse", rows=4)])
    for fmt in ("lse:scattered", "lse"):
        result = run("--db", db_url, "list", "--stats-format", fmt, "--json")
        assert result.exit_code == 0, result.output
        assert [r["key"]["stats_format"] for r in json.loads(result.stdout)] == [fmt]
