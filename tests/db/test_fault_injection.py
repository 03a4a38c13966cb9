"""Fault injection: no damage to the tuning database breaks a merge, crashes a command or loses a row.

The faults come from faultlib (every column of every table x wrong type, out
of range, unparsable; the version table missing, empty, doubled, from the
future or garbage; each table dropped; rows that do not agree).  For each one,
on SQLite and (with KVSPLIT_TEST_PG_URL) PostgreSQL:

(a) merges in a new process are right against the float64 reference, on
    fresh random data, with at most one database warning;
(b) every command exits 0 or 3, never with a traceback; commands that show or
    change data refuse the damaged database with exit 3 and name the remedy;
(c) ``kvsplit db repair`` leaves a database that every command reads, and
    every record that did not depend on the damaged row is there unchanged.

The commands run in this process through click's CliRunner (an exception
that escaped them would be ``result.exception``, what a user would see as a
traceback); the merges run in one child process per backend, each database
with a dispatcher that has never seen it.  Set KVSPLIT_FAULT_REPORT to a file
to get one JSON line per fault and command (the closing note's table).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from faultlib import add_claim, all_faults, cpu_records, fault_names, inject

from kvsplit.cli import main
from kvsplit.db import open_store
from kvsplit.config import KernelConfig
from kvsplit.export import dump_export, make_export
from kvsplit.dispatch import dispatcher as dispatch_module

FAULTS = {f.name: f for f in all_faults()}
BACKENDS = ["sqlite", "postgres"]
PG_ENV = "KVSPLIT_TEST_PG_URL"


# -- databases ---------------------------------------------------------------------------------


class Databases:
    """A template database per backend holding the records of faultlib, and fresh copies of it."""

    def __init__(self, backend: str, root: Path):
        self.backend, self.root = backend, root
        self.records = cpu_records()
        self._made: list[str] = []
        if backend == "sqlite":
            self.template = f"sqlite:///{root / 'template.sqlite'}"
        else:
            base = os.environ.get(PG_ENV)
            if not base:
                pytest.skip(f"{PG_ENV} is not set: no PostgreSQL server (source .ci/postgres.sh to start one)")
            self._base = base
            self._prefix = f"kvsplit_fi_{os.getpid()}_{secrets.token_hex(3)}"
            self.template = self._create(f"{self._prefix}_template")
        with open_store(self.template) as store:
            store.upsert_many(self.records.values())
            add_claim(store, self.records["h200"].key)
            # Back by name: the stored records carry the stored times.
            stored = {r.key: r for r in store.query()}
        self.records = {name: stored[r.key] for name, r in self.records.items()}

    def _admin(self) -> sa.Engine:
        return sa.create_engine(self._base, isolation_level="AUTOCOMMIT")

    def _create(self, name: str, template: str | None = None) -> str:
        admin = self._admin()
        with admin.connect() as conn:
            suffix = f' TEMPLATE "{template}"' if template else ""
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"{suffix}')
        admin.dispose()
        self._made.append(name)
        return sa.make_url(self._base).set(database=name).render_as_string(hide_password=False)

    def copy(self, label: str) -> str:
        """URL of a new database equal to the template."""
        name = f"{label}_{secrets.token_hex(3)}"
        if self.backend == "sqlite":
            path = self.root / f"{name}.sqlite"
            shutil.copyfile(self.root / "template.sqlite", path)
            return f"sqlite:///{path}"
        return self._create(f"{self._prefix}_{name}".lower()[:63], template=sa.make_url(self.template).database)

    def close(self) -> None:
        if self.backend == "postgres":
            admin = self._admin()
            with admin.connect() as conn:
                for name in reversed(self._made):
                    conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            admin.dispose()


@pytest.fixture(scope="module", params=BACKENDS)
def dbs(request, tmp_path_factory):
    databases = Databases(request.param, tmp_path_factory.mktemp(f"faults-{request.param}"))
    yield databases
    databases.close()


@pytest.fixture(autouse=True)
def private_environment(tmp_path, monkeypatch):
    """No KVSPLIT_* overrides; pending keys and any default database in tmp_path."""
    for name in ("KVSPLIT_MODE", "KVSPLIT_MAX_SPLIT", "KVSPLIT_PDL", "KVSPLIT_DB"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVSPLIT_PENDING", str(tmp_path / "pending.jsonl"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    dispatch_module.dispatcher.forget()
    yield
    dispatch_module.dispatcher.forget()


# -- commands ----------------------------------------------------------------------------------


def kvsplit(*args: str) -> SimpleNamespace:
    """``kvsplit ARGS`` in this process; any exception that escaped is reported, not raised."""
    result = CliRunner().invoke(main, list(args), catch_exceptions=True)
    escaped = result.exception if not isinstance(result.exception, SystemExit) else None
    output = result.stdout + result.stderr
    return SimpleNamespace(code=result.exit_code, out=result.stdout, output=output, escaped=escaped)


def commands(url: str, tmp: Path, import_file: Path, *, render: bool = True) -> dict[str, list[str]]:
    """Every command, once, with arguments that read the intact records.

    Without ``render``, plot's filter matches nothing: it reads the database as
    always and stops before matplotlib, which costs half a second a plot.
    """
    plot_filter = ["--device", "a100"] if render else ["--device", "no-such-gpu"]
    return {
        "info": ["info", "--db", url],
        "list": ["db", "list", "--db", url],
        "show": ["db", "show", "--db", url, "--device", "h200", "--build", "build-b"],
        "stats": ["db", "stats", "--db", url],
        "export": ["db", "export", "--db", url, "--out", str(tmp / "export.json")],
        "import": ["db", "import", str(import_file), "--db", url, "--dry-run"],
        "prune": ["db", "prune", "--db", url, "--older-than", "3650d", "--dry-run"],
        "plot": ["db", "plot", "--db", url, "--out", str(tmp / "plot.png"), *plot_filter],
        "repair-dry-run": ["db", "repair", "--db", url, "--dry-run"],
    }


TUNE = ["--devices", "cpu", "--head-dim", "64", "--num-splits", "16", "--rows", "8", "--json"]


def _report(fault: str, backend: str, stage: str, outcome: dict[str, int]) -> None:
    path = os.environ.get("KVSPLIT_FAULT_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps({"fault": fault, "backend": backend, "stage": stage, "exit": outcome}) + "\n")


def run_all(url: str, tmp: Path, import_file: Path, *, render: bool = True) -> dict[str, SimpleNamespace]:
    results = {}
    for name, args in commands(url, tmp, import_file, render=render).items():
        result = kvsplit(*args)
        assert result.escaped is None, f"{name}: {type(result.escaped).__name__}: {result.escaped}"
        assert "Traceback" not in result.output, f"{name}: {result.output}"
        results[name] = result
    return results


def expected_after_repair(dbs: Databases, fault) -> dict[str, object]:
    """The records that ``repair`` must leave, by name: all but those the fault may take."""
    expected = {}
    for name, record in dbs.records.items():
        if name in fault.lost:
            continue
        if fault.winners_only:
            record = record.model_copy(update={"candidates": []})
        elif name in fault.trimmed:
            k2 = KernelConfig.kvsplit(2)
            record = record.model_copy(update={"candidates": [c for c in record.candidates if c.config != k2]})
        expected[name] = record
    return expected


def stored_by_name(dbs: Databases, url: str) -> dict[str, object]:
    names = {r.key: name for name, r in dbs.records.items()}
    with open_store(url, create=False) as store:
        return {names.get(r.key, repr(r.key)): r for r in store.query()}


@pytest.fixture(scope="module")
def import_file(tmp_path_factory, dbs):
    path = tmp_path_factory.mktemp("import") / "h200.json"
    path.write_text(dump_export(make_export([dbs.records["h200"]])))
    return path


# -- (b) and (c): every command, before and after repair ----------------------------------------


def test_the_faults_cover_every_column_of_every_table():
    from kvsplit.db.models import METADATA

    columns = {(t.name, c.name) for t in METADATA.sorted_tables for c in t.columns if not c.primary_key}
    covered = {tuple(name.split(":")[0].split(".")) for name in FAULTS if ":" in name and "." in name}
    assert covered == columns
    assert all(f"{t}.{c}:{kind}" in FAULTS for t, c in columns for kind in ("wrong_type", "out_of_range", "unparsable"))
    assert len(FAULTS) == 3 * len(columns) + 14


@pytest.mark.parametrize("fault_name", fault_names())
def test_every_command_survives_the_fault_and_repair_loses_nothing_else(dbs, fault_name, tmp_path, import_file):
    fault = FAULTS[fault_name]
    url = dbs.copy("cli")
    if not inject(url, fault):
        _report(fault_name, dbs.backend, "refused", {})
        pytest.skip(f"{dbs.backend} refuses this value (the column's type keeps it out)")

    before = run_all(url, tmp_path, import_file)
    _report(fault_name, dbs.backend, "damaged", {name: r.code for name, r in before.items()})
    for name, result in before.items():
        assert result.code in (0, 3), f"{name}: exit {result.code}: {result.output}"
    assert before["repair-dry-run"].code == (3 if fault.too_new else 0), before["repair-dry-run"].output
    remedy = "upgrade kvsplit" if fault.too_new else "kvsplit db repair"
    for name in ("list", "show", "stats", "export", "import", "prune", "plot"):
        assert before[name].code == 3 and remedy in before[name].output, f"{name}: {before[name].output}"
    assert before["info"].code == 3 and remedy in before["info"].output

    quarantine = tmp_path / "quarantine.jsonl"
    repaired = kvsplit("db", "repair", "--db", url, "--quarantine", str(quarantine), "--json")
    assert repaired.escaped is None and "Traceback" not in repaired.output
    if fault.too_new:  # a newer kvsplit's database is left alone
        assert repaired.code == 3 and "upgrade kvsplit" in repaired.output
        assert not quarantine.exists()
        return
    assert repaired.code == 0, repaired.output
    summary = json.loads(repaired.out)
    lines = quarantine.read_text().splitlines() if quarantine.exists() else []
    assert len(lines) == sum(summary["quarantined"].values())
    assert fault.schema or summary["problems"], "the damaged row went unnoticed"
    if fault.schema and not fault.lost and not fault.winners_only:
        assert summary["schema_repairs"] and not lines  # only the version table was wrong

    # A plot is drawn after the schema and record faults; after the others
    # plot reads the repaired database and finds nothing to draw (exit 1).
    render = fault.schema or fault_name.startswith("record:")
    after = run_all(url, tmp_path, import_file, render=render)
    tuned = kvsplit("tune", "--db", url, *TUNE)
    outcome = {name: r.code for name, r in after.items()} | {"repair": repaired.code, "tune": tuned.code}
    _report(fault_name, dbs.backend, "repaired", outcome)
    shown = {"show": "h200-b", "plot": "a100"}  # the record each one picks
    for name, result in after.items():
        nothing = shown.get(name) in fault.lost or (name == "plot" and not render)
        expected = (1,) if nothing else (0,)  # 1: nothing matches
        assert result.code in expected, f"{name} after repair: exit {result.code}: {result.output}"
    assert tuned.code == 0 and tuned.escaped is None, tuned.output

    # (c) Every record that did not depend on the damaged row, unchanged.
    got = stored_by_name(dbs, url)
    if "k0" in fault.lost:
        got.pop("k0", None)  # tune above stored it again
    assert got == expected_after_repair(dbs, fault)


# -- (a) merges in a new process ---------------------------------------------------------------


@pytest.mark.slow
def test_merges_in_a_new_process_are_right_and_warn_at_most_once(dbs, tmp_path):
    urls, applied = [], []
    for fault in FAULTS.values():
        url = dbs.copy("merge")
        if inject(url, fault):
            urls.append(url)
            applied.append(fault.name)
    urls.append(dbs.copy("intact"))
    # SQLite holds any value anywhere; PostgreSQL's column types keep about half out.
    least = len(FAULTS) if dbs.backend == "sqlite" else len(FAULTS) // 2
    assert len(applied) >= least, f"only {len(applied)} faults applied on {dbs.backend}"
    job = tmp_path / "job.json"
    job.write_text(json.dumps(urls))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSPLIT_")}
    env["KVSPLIT_PENDING"] = str(tmp_path / "pending.jsonl")
    script = Path(__file__).resolve().parent / "faultlib.py"
    # Outside the source tree, so that the installed kvsplit is imported.
    child = subprocess.run([sys.executable, str(script), str(job)], capture_output=True, text=True, timeout=600,
                           env=env, cwd=tempfile.gettempdir())
    assert child.returncode == 0 and "Traceback" not in child.stderr, child.stderr[-3000:]
    outcomes = [json.loads(line) for line in child.stdout.splitlines()]
    assert [o["url"] for o in outcomes] == urls
    problems = []
    for name, outcome in zip([*applied, "intact"], outcomes):
        if outcome["errors"]:
            problems.append(f"{name}: {outcome['errors']}")
        if len(outcome["db_warnings"]) > 1:
            problems.append(f"{name}: {len(outcome['db_warnings'])} warnings: {outcome['db_warnings']}")
        _report(name, dbs.backend, "merge", {"errors": len(outcome["errors"]), "warnings": len(outcome["db_warnings"])})
    assert problems == []
    assert outcomes[-1]["db_warnings"] == []  # the intact database: no warning at all
    # The faults in rows a merge reads are noticed: a warning, not silence.
    read = [o for name, o in zip(applied, outcomes) if name.startswith("tuning_results.winner_params")]
    assert read and all(len(o["db_warnings"]) == 1 for o in read)


# -- the database itself unusable: every command says so with exit 3 ----------------------------

WRITERS = ("import", "prune", "repair", "tune")


def every_command(url: str, tmp: Path, import_file: Path) -> dict[str, list[str]]:
    """Every command once, the writers for real (tune on a key the template lacks); the two that
    create a database last."""
    readers = commands(url, tmp, import_file, render=False)
    return {
        **{k: v for k, v in readers.items() if k not in ("repair-dry-run", "import")},
        "tune-status": ["tune", "--status", "--db", url, "--devices", "cpu", "--head-dim", "64",
                        "--num-splits", "4", "--rows", "2"],
        "prune": ["db", "prune", "--db", url, "--older-than", "0s"],
        "repair": ["db", "repair", "--db", url, "--quarantine", str(tmp / "q.jsonl")],
        "import": ["db", "import", str(import_file), "--db", url, "--replace"],
        "tune": ["tune", "--db", url, "--devices", "cpu", "--head-dim", "64", "--num-splits", "4", "--rows", "2"],
    }


@pytest.fixture
def h200_file(tmp_path):
    from dbtestlib import make_record

    path = tmp_path / "h200.json"
    path.write_text(dump_export(make_export([make_record()])))
    return path


def _outcomes(url, tmp, import_file) -> dict[str, SimpleNamespace]:
    results = {}
    for name, args in every_command(url, tmp, import_file).items():
        result = kvsplit(*args)
        assert result.escaped is None, f"{name}: {type(result.escaped).__name__}: {result.escaped}"
        assert "Traceback" not in result.output, f"{name}: {result.output}"
        results[name] = result
    return results


def _assert_exit_3(results, names, remedy):
    for name in names:
        result = results[name]
        errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
        assert result.code == 3 and remedy in result.output, f"{name}: exit {result.code}: {result.output}"
        assert len(errors) == 1, f"{name}: {result.output}"


def test_a_missing_file_is_never_created_by_a_command_that_only_reads(tmp_path, h200_file):
    path = tmp_path / "typo.sqlite"
    results = _outcomes(f"sqlite:///{path}", tmp_path, h200_file)
    readers = ("list", "show", "stats", "export", "plot", "tune-status", "prune", "repair")
    _assert_exit_3(results, readers, "no such database file")
    assert results["info"].code == 0 and "not created yet" in results["info"].out
    # import creates the database; tune, run after it, adds its key.
    assert results["import"].code == 0 and results["tune"].code == 0
    assert path.exists()


@pytest.mark.parametrize(
    ("url", "remedy"),
    [
        ("postgresql+psycopg://kvsplit:secret@127.0.0.1:1/none", "cannot reach the database server"),
        ("nosuchdialect://host/db", "bad database URL"),
    ],
    ids=["unreachable", "bad-url"],
)
def test_an_unusable_url_is_exit_3_for_every_command(tmp_path, h200_file, url, remedy):
    results = _outcomes(url, tmp_path, h200_file)
    _assert_exit_3(results, [n for n in results if n != "info"], remedy)
    assert results["info"].code == 3 and remedy in results["info"].out
    assert all("secret" not in r.output for r in results.values())


def test_a_missing_driver_is_named_as_such(tmp_path, h200_file, monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # as if psycopg were not installed
    results = _outcomes("postgresql+psycopg://u@127.0.0.1:5432/db", tmp_path, h200_file)
    _assert_exit_3(results, [n for n in results if n != "info"], "driver for postgresql+psycopg is not installed")
    assert all("bad database URL" not in r.output for r in results.values())
    assert "pip install 'psycopg[binary]'" in results["list"].output


def test_a_corrupt_file_is_exit_3_for_every_command(tmp_path, h200_file):
    path = tmp_path / "corrupt.sqlite"
    path.write_bytes(b"\x00not a database at all" * 300)
    results = _outcomes(f"sqlite:///{path}", tmp_path, h200_file)
    _assert_exit_3(results, [n for n in results if n != "info"], "corrupt or not an SQLite database")
    assert results["info"].code == 3


def test_a_locked_database_stops_the_writers_with_exit_3(dbs, tmp_path, import_file, monkeypatch):
    if dbs.backend != "sqlite":
        pytest.skip("SQLite's one write lock; PostgreSQL writers wait on rows instead")
    import sqlite3

    from kvsplit.db import store

    url = dbs.copy("locked")
    for opener in (store.open_store, store.open_store_for_repair):
        monkeypatch.setitem(opener.__kwdefaults__, "timeout_s", 0.2)  # not 30 s per writer
    holder = sqlite3.connect(sa.make_url(url).database, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process's long write
    try:
        results = _outcomes(url, tmp_path, import_file)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    _assert_exit_3(results, WRITERS, "database is locked")
    for name in ("info", "list", "show", "stats", "export"):  # WAL: readers are not blocked
        assert results[name].code == 0, f"{name}: {results[name].output}"


# -- the real command, in real processes: what a user's terminal shows --------------------------


def _shell(script: str, env: dict | None = None, prefix: list[str] | None = None) -> list[tuple[int, str, str]]:
    """Runs ``kvsplit`` once per line of ``script`` in one shell; (exit, stdout, stderr) per line."""
    import shlex

    kvsplit_cmd = f"{shlex.quote(sys.executable)} -P -m kvsplit"
    lines = [line.strip() for line in script.strip().splitlines()]
    body = "".join(f"{kvsplit_cmd} {line} >o{i} 2>e{i}; echo $? >c{i}\n" for i, line in enumerate(lines))
    work = Path(tempfile.mkdtemp())
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVSPLIT_")} | (env or {})
    subprocess.run([*(prefix or []), "sh", "-c", body], cwd=work, env=full_env, timeout=300, check=True)
    return [(int((work / f"c{i}").read_text()), (work / f"o{i}").read_text(), (work / f"e{i}").read_text())
            for i in range(len(lines))]


def test_a_stored_winner_that_is_not_json_in_real_processes(dbs, tmp_path):
    """Issue 13's first case, end to end: list and export refused (exit 3), prune too, repair mends."""
    if dbs.backend != "sqlite":
        pytest.skip("one backend is enough for the real-process check; the matrix covers both")
    url = dbs.copy("real")
    assert inject(url, FAULTS["tuning_results.winner_params:unparsable"])
    results = _shell(f"""
        db list --db {url}
        db export --db {url}
        db prune --older-than 3650d --db {url}
        --db {url} db repair
        db list --db {url} --json
    """, env={"KVSPLIT_PENDING": str(tmp_path / "p.jsonl")})
    for code, out, err in results:
        assert "Traceback" not in out + err
    (list_code, _, list_err), (export_code, _, _), (prune_code, _, _), (repair_code, repair_out, _), \
        (after_code, after_out, _) = results
    assert (list_code, export_code, prune_code) == (3, 3, 3)
    assert "winner_params is not JSON" in list_err and "kvsplit db repair" in list_err
    assert repair_code == 0 and "moved 6 rows" in repair_out  # the result and its 5 candidates
    assert after_code == 0 and len(json.loads(after_out)) == len(dbs.records) - 1


def test_a_read_only_database_in_real_processes(tmp_path):
    """Root ignores permission bits: the commands run without the capabilities that allow it."""
    folder = tmp_path / "readonly"
    folder.mkdir()
    url = f"sqlite:///{folder / 'tuning.sqlite'}"
    from dbtestlib import make_record

    with open_store(url) as store:
        store.upsert(make_record())
    export = tmp_path / "e.json"
    export.write_text(dump_export(make_export([make_record(rows=65)])))
    folder.chmod(0o555)
    prefix = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv")
        prefix = [setpriv, "--bounding-set=-dac_override,-dac_read_search,-fowner"]
    try:
        results = _shell(f"""
            db import {export} --db {url}
            db prune --older-than 0s --db {url}
            tune --devices cpu --head-dim 64 --num-splits 4 --rows 2 --db {url}
        """, prefix=prefix)
    finally:
        folder.chmod(0o755)
    for code, out, err in results:
        assert code == 3 and "Traceback" not in out + err, (code, out, err)
        assert "read-only" in err or "cannot open the database file" in err, err
