"""db/engine.py: one reading of --db / KVSPLIT_DB, the same as the SQLite driver's.

A value is a URL only when it has a scheme; a plain path is taken literally.
What kvsplit takes for a file is the file the driver opens (``PRAGMA
database_list`` names it), and what it takes for memory the driver keeps in
memory: checked on fixed cases and on random paths and URLs (hypothesis).
"""

from __future__ import annotations

import os
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvsplit.db import StoreError
from kvsplit.db.engine import create_db_engine
from kvsplit.db.engine import BadTarget, Target, parse_target, visible

SETTINGS = settings(max_examples=300, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    """An empty current directory: relative paths land here, and nothing else may appear in it."""
    folder = tmp_path / "cwd"
    folder.mkdir()
    monkeypatch.chdir(folder)
    monkeypatch.delenv("KVSPLIT_DB", raising=False)
    return folder


def driver_file(target: Target) -> str:
    """The file the SQLite driver opened for ``target`` ('' for memory)."""
    engine = create_db_engine(target, timeout_s=1)
    try:
        with engine.connect() as conn:
            rows = conn.exec_driver_sql("PRAGMA database_list").all()
    finally:
        engine.dispose()
    return next(row[2] for row in rows if row[1] == "main")


# -- fixed cases -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tun?ing.sqlite", "pct%41.sqlite", "a#b.sqlite", "x&mode=memory.sqlite",
                                  "sp ace.sqlite", "file:x.sqlite", ":memory:x", "é.sqlite", "%00"])
def test_a_plain_path_is_a_file_of_exactly_that_name(cwd, name):
    target = parse_target(name)
    assert target.path == cwd / name and not target.memory and target.shown == name
    assert driver_file(target) == str(cwd / name)
    assert sorted(p.name for p in cwd.iterdir() if not p.name.endswith(("-wal", "-shm"))) == [name]


@pytest.mark.parametrize("value", [":memory:", "sqlite://", "sqlite:///", "sqlite:///:memory:",
                                   "sqlite+pysqlite:///:memory:", "sqlite:///x.sqlite?mode=memory",
                                   "sqlite:////abs/x.sqlite?mode=memory", "sqlite:///x.sqlite?mode=memory&timeout=3"])
def test_in_memory_targets_are_memory_to_kvsplit_and_to_the_driver(cwd, value):
    target = parse_target(value)
    assert target.memory and target.path is None and target.shown == value
    assert driver_file(target) == ""
    assert list(cwd.iterdir()) == []  # no file named :memory:, x.sqlite or anything else


@pytest.mark.parametrize("value", ["sqlite:///rel/x.sqlite", "sqlite:////abs/dir/x.sqlite",
                                   "sqlite:///x.sqlite?timeout=5", "sqlite:///pct%2541.sqlite"])
def test_a_sqlite_url_names_the_file_the_driver_opens(cwd, value):
    target = parse_target(value)
    expected = {"sqlite:///rel/x.sqlite": cwd / "rel/x.sqlite",
                "sqlite:////abs/dir/x.sqlite": Path("/abs/dir/x.sqlite"),
                "sqlite:///x.sqlite?timeout=5": cwd / "x.sqlite",
                "sqlite:///pct%2541.sqlite": cwd / "pct%41.sqlite"}
    assert target.path == expected[value] and not target.memory
    if target.path.parent == cwd:
        assert driver_file(target) == str(target.path)


def test_home_is_expanded_in_paths_not_in_urls(cwd, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert parse_target("~/x.sqlite").path == tmp_path / "x.sqlite"
    assert parse_target("~/x.sqlite").shown == "~/x.sqlite"  # as written
    assert parse_target("sqlite:///~/x.sqlite").path == cwd / "~/x.sqlite"  # what the driver opens


@pytest.mark.parametrize(("value", "problem"), [
    ("~nonexistentuser_kvsplit/x.sqlite", "cannot expand ~nonexistentuser_kvsplit: no user"),
    ("a\x00b.sqlite", "NUL character"),
    ("sqlite:///a%00b.sqlite", "NUL character"),
    ("postgresql+psycopg://u@h/d%00b", "NUL character"),
    ("postgresql+psycopg://u@[::1/db", "bad database URL"),
    ("postgresql+psycopg://u@h:port/db", "bad database URL"),
    ("sqlite:///x.sqlite?uri=true", "SQLite URI filenames are not taken"),
    ("sqlite:///file:x.sqlite?mode=ro&uri=true", "SQLite URI filenames are not taken"),
    ("sqlite:///x.sqlite?mode=ro", "only mode=memory"),
    ("sqlite:///x.sqlite?cache=shared", "unknown SQLite URL parameter 'cache'"),
    ("sqlite://host/x.sqlite", "names a file, not a host"),
    ("sqlite://u:secret@/x.sqlite", "names a file, not a host"),
])
def test_what_names_no_database_is_one_bad_target_line(cwd, value, problem):
    with pytest.raises(BadTarget, match=problem) as info:
        parse_target(value)
    message = str(info.value)
    assert isinstance(info.value, StoreError) and "\n" not in message and "\x00" not in message
    assert "secret" not in message
    assert list(cwd.iterdir()) == []


def test_a_home_that_cannot_be_told_is_refused(cwd, monkeypatch):
    monkeypatch.setattr(os.path, "expanduser", lambda path: path)  # as with HOME unset and no passwd entry
    with pytest.raises(BadTarget, match="cannot expand ~: HOME is not set"):
        parse_target("~/x.sqlite")


def test_passwords_are_masked_even_in_urls_that_do_not_parse():
    assert parse_target("postgresql+psycopg://kv:secret@h/db").shown == "postgresql+psycopg://kv:***@h/db"
    with pytest.raises(BadTarget) as info:
        parse_target("postgresql+psycopg://kv:se@cret@[::1/db")
    assert "cret" not in str(info.value) and "kv:***@[::1/db" in str(info.value)


def test_nothing_given_is_the_environment_then_the_default(cwd, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    default = parse_target(None)
    assert default.default and default.path == tmp_path / "cache" / "kvsplit" / "tuning.sqlite"
    assert parse_target("") == default
    monkeypatch.setenv("KVSPLIT_DB", "env?.sqlite")
    assert parse_target(None).path == cwd / "env?.sqlite" and parse_target("given.sqlite").path == cwd / "given.sqlite"


# -- properties: random paths and URLs ---------------------------------------------------------

# Characters that mean something in a URL, a shell or a path, and some that are neither ASCII nor printable.
_NAME_CHARS = st.sampled_from(list(string.ascii_letters + string.digits + "?%#&=;:@+ ~!$'()*,[]{}-_.\\\t\n")
                              + ["é", "\u200b", "\x1b", "\x7f", "💾", "\udcff"])
_NAMES = st.text(_NAME_CHARS, min_size=1, max_size=40).filter(lambda n: n not in (".", "..") and "/" not in n)


@SETTINGS
@given(name=_NAMES)
def test_random_file_names_are_the_files_the_driver_opens(cwd, name, monkeypatch):
    monkeypatch.setenv("HOME", str(cwd / "home"))
    for leftover in cwd.iterdir():
        leftover.unlink()
    try:
        target = parse_target(name)
    except BadTarget as exc:  # only a ~user nobody has
        assert name.startswith("~") and "\n" not in str(exc)
        return
    assert target.shown == visible(name) and "\n" not in target.shown
    if name == ":memory:":
        assert target.memory
        return
    if name.startswith("~"):  # ~ or ~user expanded: checked, never created (it may be /root or /bin)
        assert target.path == Path(os.path.abspath(os.path.expanduser(name))) and not target.memory
        return
    assert target.path == cwd / name and not target.memory
    assert driver_file(target) == os.fsdecode(os.fsencode(str(cwd / name)))
    assert [p.name for p in cwd.iterdir() if not p.name.endswith(("-wal", "-shm"))] == [name]


_SCHEMES = st.sampled_from(["sqlite", "sqlite+pysqlite", "postgresql+psycopg", "postgresql", "mysql",
                            "nosuchdialect", "sqlite+nosuchdriver", "SQLite"])
_URL_TEXT = st.lists(st.sampled_from(list(string.ascii_letters + string.digits + "/?%#&=:@[]+.~ -_\x00")
                                     + ["%00", "%41", "%3F", "é", "\n", ":memory:"]), max_size=30).map("".join)
_QUERY = st.lists(st.tuples(st.sampled_from(["mode", "timeout", "uri", "cache", "check_same_thread", "x"]),
                            st.sampled_from(["memory", "ro", "rwc", "5", "true", "abc", ""])), max_size=3)


@st.composite
def any_urls(draw) -> str:
    query = "&".join(f"{k}={v}" for k, v in draw(_QUERY))
    authority = draw(st.sampled_from(["", "", "host", "u:secret@h", "u:secret@[::1", "h:5432", "h:99999999",
                                      "[::1]:x"]))
    path = draw(_URL_TEXT)
    return f"{draw(_SCHEMES)}://{authority}/{path}" + (f"?{query}" if query else "")


@st.composite
def sqlite_urls(draw) -> str:
    """Well-formed SQLite URLs, mostly: relative file names of odd characters, percent-escapes, driver args."""
    name = draw(st.lists(st.sampled_from(list(string.ascii_letters + "?%#&=:@+ ~-_.") + ["%41", "%3F", "%25", "é",
                                                                                         ":memory:"]),
                         max_size=12).map("".join))
    query = draw(st.lists(st.sampled_from(["mode=memory", "timeout=2.5", "cached_statements=10", "detect_types=0",
                                           "check_same_thread=false", "isolation_level=DEFERRED", "mode=ro"]),
                          max_size=2, unique=True))
    scheme = draw(st.sampled_from(["sqlite", "sqlite+pysqlite"]))
    return f"{scheme}:///{name}" + (f"?{'&'.join(query)}" if query else "")


@SETTINGS
@given(value=st.one_of(any_urls(), sqlite_urls()))
def test_random_urls_parse_or_are_one_bad_target_line(cwd, value):
    try:
        target = parse_target(value)
    except BadTarget as exc:
        event("refused")
        message = str(exc)
        assert "\n" not in message and "\x00" not in message and "secret" not in message
        return
    assert "secret" not in target.shown and "\n" not in target.shown
    if target.url.get_backend_name() != "sqlite":
        event("a server URL")
        assert target.path is None and not target.memory
        return
    assert target.memory == (target.path is None)
    if target.memory:
        assert target.url.database is None  # the driver gets no file name at all
    else:
        assert target.path.is_absolute() and "\x00" not in str(target.path)
        assert "mode" not in target.url.query and "uri" not in target.url.query
    if not (target.memory or target.path.parent.is_dir()) or target.path and target.path.is_dir():
        return  # a missing directory, or a directory: the store says so (test_faults.py)
    try:
        opened = driver_file(target)
    except StoreError:
        event("no such SQLite driver")
        return  # a dialect or driver that does not exist: one line, tested above
    event("opened in memory" if target.memory else "opened the file")
    assert opened == ("" if target.memory else str(target.path))
    for leftover in cwd.iterdir():
        if leftover.is_file():
            leftover.unlink()
