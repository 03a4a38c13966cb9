"""Broken databases: the CLI-facing opener says what is wrong, the library never breaks."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import warnings
from pathlib import Path

import pytest
from dbtestlib import make_record
from kvsplit.cli.reports import store_stats
from kvsplit.db import DbWarning, StoreError, open_store, open_store_for_library


def _library_store(url: str, **kwargs):
    """open_store_for_library, returning the store and the DbWarnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = open_store_for_library(url, **kwargs)
    return store, [w for w in caught if issubclass(w.category, DbWarning)]


def _assert_works_in_memory(store) -> None:
    assert store.in_memory
    record = make_record()
    store.upsert(record)
    assert store.get(record.key) == store.query()[0]
    assert store.load_choices(record.key.device, record.key.build_hash) == {record.key.choice_key: record.winner}


def _filled_file(path: Path, results: int = 300) -> None:
    with open_store(f"sqlite:///{path}") as store:
        store.upsert_many(make_record(rows=r) for r in range(1, results + 1))
    # The last connection closed, so the WAL was checkpointed into the file and removed.
    assert not Path(f"{path}-wal").exists()


def test_garbage_file(tmp_path):
    path = tmp_path / "tuning.sqlite"
    path.write_bytes(os.urandom(1) + b"this is not a database, just some bytes" * 200)
    with pytest.raises(StoreError, match="corrupt or not an SQLite database"):
        open_store(str(path))
    store, caught = _library_store(str(path))
    assert len(caught) == 1 and "corrupt" in str(caught[0].message)
    _assert_works_in_memory(store)


@pytest.mark.parametrize("keep", [0.5, 0.02])
def test_truncated_file(tmp_path, keep):
    path = tmp_path / "tuning.sqlite"
    _filled_file(path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    # Depending on what survived, the open or the first read fails; both must be a StoreError.
    with pytest.raises(StoreError, match="corrupt|malformed|not a database"):
        with open_store(str(path)) as store:
            store.query()
    store, caught = _library_store(str(path))
    rows = store.query()  # a read through a broken store: warning, then memory
    for warning in caught_after(store, lambda s: s.query()):
        caught.append(warning)
    assert rows == [] and store.in_memory
    assert len(caught) == 1, [str(w.message) for w in caught]
    _assert_works_in_memory(store)


def caught_after(store, operation):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        operation(store)
    return [w for w in caught if issubclass(w.category, DbWarning)]


def test_truncated_file_warns_once_across_operations(tmp_path):
    path = tmp_path / "tuning.sqlite"
    _filled_file(path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = open_store_for_library(str(path))
        store.query()
        store.upsert(make_record())
        store.query()
        store_stats(store)
    assert len([w for w in caught if issubclass(w.category, DbWarning)]) == 1
    assert len(store.query()) == 1


def test_locked_beyond_the_timeout(tmp_path):
    path = tmp_path / "tuning.sqlite"
    _filled_file(path, results=3)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process's long write transaction
    try:
        with open_store(str(path), timeout_s=0.3) as store:
            assert len(store.query()) == 3  # WAL: readers are not blocked
            with pytest.raises(StoreError, match=r"locked \(another process held it for more than 0.3 s\)"):
                store.upsert(make_record(rows=99))
        store, caught = _library_store(str(path), timeout_s=0.3)
        assert caught == [] and not store.in_memory
        late = caught_after(store, lambda s: s.upsert(make_record(rows=99)))
        assert len(late) == 1 and "locked" in str(late[0].message)
        assert store.in_memory and store.get(make_record(rows=99).key) is not None
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_locked_while_a_new_database_is_created(tmp_path):
    path = tmp_path / "tuning.sqlite"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("PRAGMA journal_mode = WAL")
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StoreError, match="locked"):
            open_store(str(path), timeout_s=0.2)
        store, caught = _library_store(str(path), timeout_s=0.2)
        assert len(caught) == 1
        _assert_works_in_memory(store)
    finally:
        holder.execute("ROLLBACK")
        holder.close()


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("nosuchdialect://host/db", "bad database URL"),
        ("sqlite+nosuchdriver:///x.sqlite", "bad database URL"),
        ("postgresql+psycopg://kvsplit:secret@127.0.0.1:1/none", "127.0.0.1:1"),
    ],
)
def test_bad_urls(url, match):
    with pytest.raises(StoreError, match=match) as info:
        open_store(url, timeout_s=2)
    assert "secret" not in str(info.value)  # passwords are masked
    store, caught = _library_store(url, timeout_s=2)
    assert len(caught) == 1 and "secret" not in str(caught[0].message)
    _assert_works_in_memory(store)


def test_missing_directory(tmp_path):
    with pytest.raises(StoreError, match="cannot open the database file"):
        open_store(str(tmp_path / "no" / "such" / "dir" / "tuning.sqlite"))


# The read-only cases run in a child process.  Root ignores permission bits
# (and CI runs as root), so as root the child drops the capabilities that let
# it do so; util-linux's setpriv does that and is on every Debian system.
_CHILD = textwrap.dedent(
    """
    import json, sys, warnings
    from kvsplit.db import DbWarning, StoreError, open_store, open_store_for_library
    url = sys.argv[1]
    out = {}
    try:
        open_store(url).close()
        out["open_store"] = "opened"
    except StoreError as exc:
        out["open_store"] = str(exc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = open_store_for_library(url)
        out["rows"] = len(store.query())
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, DbWarning)]
    out["in_memory"] = store.in_memory
    print(json.dumps(out))
    """
)


def _run_unprivileged(url: str) -> dict:
    command = [sys.executable, "-c", _CHILD, url]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: cannot make a directory read-only for us")
        command = [setpriv, "--bounding-set=-dac_override,-dac_read_search,-fowner", *command]
    # Run outside the source tree so that the installed kvsplit is imported.
    result = subprocess.run(command, capture_output=True, text=True, timeout=60,
                            env=dict(os.environ), cwd=tempfile.gettempdir())
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def readonly_dir(tmp_path):
    path = tmp_path / "readonly"
    path.mkdir()
    yield path
    path.chmod(0o755)  # so that pytest can clean up


@pytest.mark.parametrize("existing", [False, True], ids=["new-file", "existing-file"])
def test_read_only_directory(readonly_dir, existing):
    path = readonly_dir / "tuning.sqlite"
    if existing:
        _filled_file(path, results=2)
    readonly_dir.chmod(0o555)
    out = _run_unprivileged(f"sqlite:///{path}")
    assert out["open_store"] != "opened"
    assert "read-only" in out["open_store"] or "cannot open" in out["open_store"]
    assert len(out["warnings"]) == 1 and out["in_memory"] is True and out["rows"] == 0
