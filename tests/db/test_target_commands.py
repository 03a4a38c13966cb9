"""--db / KVSPLIT_DB through every command and through merges.

Every target that names no usable database is exit 3 and one line from every
command, never an internal error; an in-memory target is refused by the
commands that store (exit 2: nothing would be saved) and has nothing to read
for the others (exit 3); in a merge any of them is at most one DbWarning and
memory.  The commands run in this process through click's CliRunner (an
exception that escaped would be ``result.exception``); random targets go
through them too (hypothesis).
"""

from __future__ import annotations

import os
import sqlite3
import string
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from dbtestlib import make_record
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import kvsplit
from kvsplit.cli import main
from kvsplit.db import DbWarning, open_store
from kvsplit.export import dump_export, make_export
from kvsplit.dispatch import dispatcher as dispatch_module

# Targets that name nothing kvsplit can open, each for a different reason.
BAD_TARGETS = {
    "bad-port": ("postgresql+psycopg://u:secret@[::1/db", "bad database URL"),
    "unknown-home": ("~nonexistentuser_kvsplit/x.sqlite", "cannot expand ~nonexistentuser_kvsplit"),
    "long-name": ("{tmp}/" + "n" * 300 + ".sqlite", "File name too long"),
    "long-path": ("{tmp}" + "/d" * 3000 + "/x.sqlite", "File name too long"),
    "nul-in-url": ("sqlite:///{tmp}/a%00b.sqlite", "NUL character"),
    "uri-filename": ("sqlite:///file:{tmp}/x.sqlite?mode=ro&uri=true", "SQLite URI filenames are not taken"),
    "host-in-sqlite-url": ("sqlite://host/{tmp}/x.sqlite", "names a file, not a host"),
    "driver-arg": ("sqlite:///{tmp}/x.sqlite?timeout=soon", "timeout=soon is not a value"),
    "no-such-dialect": ("nosuchdialect://host/db", "bad database URL"),
}
MEMORY_TARGETS = [":memory:", "sqlite://", "sqlite:///", "sqlite:///:memory:", "sqlite:///{tmp}/x.sqlite?mode=memory"]
WRITERS = ("import", "prune", "repair", "tune")
READERS = ("list", "show", "stats", "export", "plot", "progress")


@pytest.fixture
def place(tmp_path, monkeypatch):
    """An empty current directory, a private cache and pending file, an export file to import."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    for name in ("KVSPLIT_MODE", "KVSPLIT_MAX_SPLIT", "KVSPLIT_PDL", "KVSPLIT_DB"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVSPLIT_PENDING", str(tmp_path / "pending.jsonl"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    export = tmp_path / "h200.json"
    export.write_text(dump_export(make_export([make_record()])))
    return SimpleNamespace(cwd=cwd, tmp=tmp_path, export=export)


def kvsplit_cli(*args: str) -> SimpleNamespace:
    """``kvsplit ARGS`` in this process; what escaped is reported, not raised."""
    result = CliRunner().invoke(main, list(args), catch_exceptions=True)
    escaped = result.exception if not isinstance(result.exception, SystemExit) else None
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    return SimpleNamespace(code=result.exit_code, out=result.stdout, err=result.stderr, errors=errors,
                           escaped=escaped, output=result.stdout + result.stderr)


def every_command(url: str, place) -> dict[str, list[str]]:
    tmp = place.tmp
    return {
        "info": ["info", "--db", url],
        "list": ["db", "list", "--db", url],
        "show": ["db", "show", "--db", url, "--device", "h200"],
        "stats": ["db", "stats", "--db", url],
        "export": ["db", "export", "--db", url, "--out", str(tmp / "export.json")],
        "plot": ["db", "plot", "--db", url, "--out", str(tmp / "plot.png")],
        "progress": ["db", "progress", "--db", url],
        "import": ["db", "import", str(place.export), "--db", url],
        "prune": ["db", "prune", "--db", url, "--older-than", "0s"],
        "repair": ["db", "repair", "--db", url, "--quarantine", str(tmp / "q.jsonl")],
        "tune": ["tune", "--db", url, "--devices", "cpu", "--head-dim", "64", "--num-splits", "4", "--rows", "2"],
    }


def assert_one_line(result, name: str) -> None:
    assert result.escaped is None, f"{name}: {type(result.escaped).__name__}: {result.escaped}"
    assert "Traceback" not in result.output and "internal error" not in result.output, f"{name}: {result.output}"
    if name != "info" and result.code != 0:
        assert len(result.errors) == 1 and result.err.count("\n") <= 1, f"{name}: {result.err!r}"


@pytest.mark.parametrize("case", list(BAD_TARGETS))
def test_a_target_that_names_nothing_usable_is_exit_3_and_one_line_from_every_command(place, case):
    url, problem = BAD_TARGETS[case]
    url = url.format(tmp=place.tmp)
    for name, args in every_command(url, place).items():
        result = kvsplit_cli(*args)
        assert_one_line(result, name)
        assert result.code == 3 and problem in result.output, f"{name}: exit {result.code}: {result.output}"
        assert "secret" not in result.output
    assert list(place.cwd.iterdir()) == []


@pytest.mark.parametrize("url", MEMORY_TARGETS)
def test_an_in_memory_target_is_refused_by_the_commands_that_store(place, url):
    url = url.format(tmp=place.tmp)
    results = {name: kvsplit_cli(*args) for name, args in every_command(url, place).items()}
    for name, result in results.items():
        assert_one_line(result, name)
    for name in WRITERS:
        assert results[name].code == 2 and "nothing would be saved" in results[name].err, results[name].output
    for name in READERS:
        assert results[name].code == 3 and "nothing to read" in results[name].err, results[name].output
    assert results["info"].code == 0 and "in memory" in results["info"].out
    assert list(place.cwd.iterdir()) == [] and not (place.tmp / "x.sqlite").exists()


def test_import_looks_at_its_target_before_it_reads_the_file(place):
    invalid = place.tmp / "invalid.json"
    invalid.write_text("not an export")
    assert kvsplit_cli("db", "import", str(invalid), "--db", "~nonexistentuser_kvsplit/x").code == 3
    memory = kvsplit_cli("db", "import", str(invalid), "--db", ":memory:")
    assert memory.code == 2 and "nothing would be saved" in memory.err
    assert kvsplit_cli("db", "import", str(invalid), "--db", "x.sqlite").code == 2  # the file's fault
    assert list(place.cwd.iterdir()) == []


@pytest.mark.parametrize("name", ["tun?ing.sqlite", "pct%41.sqlite", "a#b&mode=memory.sqlite", ":memory:.sqlite"])
def test_a_plain_path_is_the_file_of_that_name_and_messages_show_it_as_written(place, name):
    missing = kvsplit_cli("db", "list", "--db", name)
    assert missing.code == 3 and f"{name}: no such database file" in missing.err
    assert kvsplit_cli("db", "import", str(place.export), "--db", name).code == 0
    assert [p.name for p in place.cwd.iterdir() if not p.name.endswith(("-wal", "-shm"))] == [name]
    listed = kvsplit_cli("db", "list", "--db", name, "--json")
    assert listed.code == 0 and '"NVIDIA H200"' in listed.out


def test_home_is_expanded_and_shown_as_written(place):
    (place.tmp / "home").mkdir()
    assert kvsplit_cli("db", "import", str(place.export), "--db", "~/tuning.sqlite").code == 0
    assert (place.tmp / "home" / "tuning.sqlite").exists()
    info = kvsplit_cli("info", "--db", "~/tuning.sqlite")
    assert info.code == 0 and "~/tuning.sqlite" in info.out and "ok, 1 tuning result" in info.out
    assert "1 tuning results" not in info.out


# -- merges: a bad target is one warning and memory; an in-memory one never touches a file -----


def merge_once(merge_kit, seed: int) -> None:
    gen = merge_kit.generator("targets", seed)
    partial_o, stats = merge_kit.partials("maxsum", 16, 8, 64, torch.bfloat16, gen)
    out, out_stats = kvsplit.merge_maxsum(partial_o, stats, 1.0, return_stats=True)
    merge_kit.assert_matches_reference(out, out_stats, *merge_kit.reference("maxsum", partial_o, stats))


def merges(monkeypatch, merge_kit, url: str, *, calls: int = 2) -> list[str]:
    """``calls`` merges (the first one profiles its key) with KVSPLIT_DB=url; the DbWarnings they gave."""
    monkeypatch.setenv("KVSPLIT_DB", url)
    dispatch_module.dispatcher.forget()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for seed in range(calls):
                merge_once(merge_kit, seed)
        return [str(w.message) for w in caught if issubclass(w.category, DbWarning)]
    finally:
        dispatch_module.dispatcher.forget()


@pytest.mark.parametrize("case", list(BAD_TARGETS))
def test_a_merge_with_a_bad_target_warns_once_and_goes_on_in_memory(place, monkeypatch, merge_kit, case):
    url, problem = BAD_TARGETS[case]
    caught = merges(monkeypatch, merge_kit, url.format(tmp=place.tmp))
    assert len(caught) == 1 and problem in caught[0] and "continuing in memory" in caught[0], caught
    assert "secret" not in caught[0]


@pytest.mark.parametrize("how", ["locked", "garbage"])
def test_a_mode_memory_url_never_opens_its_file_in_a_merge(place, monkeypatch, merge_kit, how):
    """The probe: kvsplit took ?mode=memory for memory while SQLite opened the file, and a merge
    raised 'database is read-only' or 'locked' from it."""
    path = place.tmp / "x.sqlite"
    with open_store(str(path)) as store:
        store.upsert(make_record())
    if how == "garbage":
        path.write_bytes(b"not a database" * 100)
    before = path.read_bytes()
    holder = sqlite3.connect(path, isolation_level=None) if how == "locked" else None
    if holder is not None:
        holder.execute("BEGIN IMMEDIATE")
    try:
        caught = merges(monkeypatch, merge_kit, f"sqlite:///{path}?mode=memory")
    finally:
        if holder is not None:
            holder.execute("ROLLBACK")
            holder.close()
    assert caught == []  # in memory, as asked: nothing to warn about
    assert path.read_bytes() == before


# -- random targets through the commands --------------------------------------------------------

_NAME = st.lists(st.sampled_from(list(string.ascii_letters + "?%#&=;:@+ !$'()*,[]{}-_.\\\t\n")
                                 + ["é", "\x1b", "%41", "%00", ":memory:", "~/"]),
                 min_size=1, max_size=16).map("".join).filter(
    lambda n: n not in (".", "..") and "/" not in n.lstrip("~/") and (not n.startswith("~") or n.startswith("~/")))
_QUERY = st.lists(st.sampled_from(["mode=memory", "mode=ro", "timeout=2", "timeout=x", "uri=true", "cache=shared",
                                   "timeout=1&timeout=2"]), max_size=2).map("&".join)


@st.composite
def targets(draw) -> str:
    kind = draw(st.sampled_from(["path", "sqlite-url", "server-url"]))
    if kind == "path":
        return draw(_NAME)
    if kind == "sqlite-url":
        query = draw(_QUERY)
        name = draw(_NAME).replace("~/", "")
        return f"{draw(st.sampled_from(['sqlite', 'sqlite+pysqlite']))}:///{name}" + (f"?{query}" if query else "")
    # Servers that answer at once, or URLs that do not parse: nothing waits on a network.
    authority = draw(st.sampled_from(["u:secret@127.0.0.1:1", "u@[::1", "127.0.0.1:99999999", "u:secret@[::1]:x",
                                      "u@127.0.0.1:0"]))
    scheme = draw(st.sampled_from(["postgresql+psycopg", "postgresql", "nosuchdialect", "mysql+nosuchdriver"]))
    return f"{scheme}://{authority}/{draw(_NAME).replace('~/', '')}"


_SUBSET = ("info", "list", "stats", "progress", "import", "repair", "tune-status")


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(url=targets(), command=st.sampled_from(_SUBSET))
def test_random_targets_through_the_commands_exit_0_2_or_3_with_one_line(place, url, command):
    args = {**every_command(url, place),
            "tune-status": ["tune", "--db", url, "--devices", "cpu", "--head-dim", "64", "--num-splits", "4",
                            "--rows", "2", "--status", "--json"]}[command]
    result = kvsplit_cli(*args)
    event(f"{command}: exit {result.code}")
    assert_one_line(result, command)
    assert result.code in (0, 2, 3), f"{command} --db {url!r}: exit {result.code}: {result.output}"
    assert "secret" not in result.output
    if result.code == 2:
        assert "nothing would be saved" in result.err or "invalid" in result.err, result.err
    for leftover in place.cwd.iterdir():  # every created database goes, so that each example starts afresh
        if leftover.is_file():
            leftover.unlink()
    assert not Path(place.cwd / ":memory:").exists()


@pytest.mark.slow
def test_kvsplit_db_in_the_environment_in_real_processes(place):
    """The installed command, as a user's shell runs it, with the target in KVSPLIT_DB."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSPLIT_")}
    env.update(KVSPLIT_PENDING=str(place.tmp / "pending.jsonl"))
    runs = {
        "literal-path": ("pct%41?x=1.sqlite", ["db", "import", str(place.export)]),
        "unknown-home": ("~nonexistentuser_kvsplit/x.sqlite", ["db", "list"]),
        "bad-port": ("postgresql+psycopg://u:secret@[::1/db", ["tune", "--devices", "cpu"]),
        "memory": ("sqlite:///x.sqlite?mode=memory", ["tune", "--devices", "cpu"]),
        "memory-import": (":memory:", ["db", "import", str(place.export)]),
    }
    results = {}
    for name, (value, args) in runs.items():
        done = subprocess.run([sys.executable, "-P", "-m", "kvsplit", *args], capture_output=True, text=True,
                              timeout=300, cwd=place.cwd, env={**env, "KVSPLIT_DB": value})
        assert "Traceback" not in done.stdout + done.stderr and "secret" not in done.stderr, done.stderr
        results[name] = (done.returncode, done.stderr.strip())
    assert results["literal-path"][0] == 0
    assert sorted(p.name for p in place.cwd.iterdir() if not p.name.endswith(("-wal", "-shm"))) == \
        ["pct%41?x=1.sqlite"]
    for name, code in (("unknown-home", 3), ("bad-port", 3), ("memory", 2), ("memory-import", 2)):
        returncode, err = results[name]
        assert returncode == code and len(err.splitlines()) == 1 and err.startswith("Error:"), (name, results[name])
