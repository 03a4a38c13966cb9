"""Where the tuning database is: the one reading of ``--db`` and ``KVSPLIT_DB``.

A value is a URL only when it starts with a scheme (``sqlite://``,
``postgresql+psycopg://``); anything else is the path of an SQLite file, taken
literally: no query, no percent-decoding (``tun?ing.sqlite`` and
``pct%41.sqlite`` are file names), ``~`` and ``~user`` expanded.  A path is
made absolute the way the SQLite driver does (``os.path.abspath``), so that
kvsplit and the driver always mean the same file.

In-memory targets are ``:memory:``, ``sqlite://``, ``sqlite:///``,
``sqlite:///:memory:`` and any SQLite URL with ``?mode=memory``.  kvsplit
then hands the driver a plain in-memory URL: the driver never opens a file
that kvsplit thinks is memory, nor the other way round.  Besides
``mode=memory``, the query of an SQLite URL may hold only the driver's own
arguments (``timeout`` and the like); SQLite URI filenames (``uri=true``) are
refused, since they would let the name mean something else to the driver.

Every problem is a :class:`BadTarget` (a :class:`StoreError`): one line,
exit 3 on the command line, one warning and memory in a merge.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path

import platformdirs
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.util import asbool

from .errors import StoreError

ENV_VAR = "KVSPLIT_DB"
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def _isolation_level(value: str) -> str:
    if value.upper() not in ("", "DEFERRED", "IMMEDIATE", "EXCLUSIVE"):
        raise ValueError("not '', DEFERRED, IMMEDIATE or EXCLUSIVE")
    return value


# The arguments SQLAlchemy's pysqlite dialect takes from a URL's query and gives the driver,
# each with the conversion the dialect applies to it.
_SQLITE_DRIVER_ARGS = {"timeout": float, "detect_types": int, "cached_statements": int,
                       "check_same_thread": asbool, "isolation_level": _isolation_level}
_EXAMPLES = ("give an SQLite file path, or a URL such as sqlite:////abs/path/tuning.sqlite or "
             "postgresql+psycopg://user@host/db")


class BadTarget(StoreError):
    """``--db`` / ``KVSPLIT_DB`` names nothing kvsplit can open: bad URL, unknown home, bad path."""


@dataclass(frozen=True)
class Target:
    """A database as kvsplit and the driver both understand it.

    Attributes
    ----------
    shown : str
        For messages: as the user wrote it (a URL's password masked, control
        characters made visible); the file's path for the default database.
    url : sqlalchemy.engine.URL
        What the engine is created from.
    path : Path or None
        The SQLite file; ``None`` in memory or on a server.
    memory : bool
        An in-memory SQLite database (every process starts it empty).
    default : bool
        Nothing was given: ``tuning.sqlite`` in the user cache directory.
    """

    shown: str
    url: URL
    path: Path | None = None
    memory: bool = False
    default: bool = False


def visible(text: str) -> str:
    """``text`` on one line: control and other unprintable characters as escapes (``\\n``, ``\\x00``)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii")
                   for c in text)


def _masked(url: str) -> str:
    # The password of a URL, even of one that does not parse, never reaches a message.
    scheme, _, rest = url.partition("://")
    authority, slash, tail = rest.partition("/")
    user_info, at, host = authority.rpartition("@")
    if at and ":" in user_info:
        user_info = user_info.split(":", 1)[0] + ":***"
    return f"{scheme}://{user_info}{at}{host}{slash}{tail}"


def shown_as_given(value: str) -> str:
    """``value`` (of --db or KVSPLIT_DB) as messages show it, even when it names nothing usable."""
    return visible(_masked(value) if _SCHEME.match(value) else value)


def default_path() -> Path:
    """``tuning.sqlite`` in the user cache directory."""
    return Path(platformdirs.user_cache_dir("kvsplit")) / "tuning.sqlite"


def is_memory(database: str | None, query: dict) -> bool:
    """Whether an SQLite URL with this database and query is in memory (the one rule)."""
    return database in (None, "", ":memory:") or query.get("mode") == "memory"


def parse_target(value: str | None = None) -> Target:
    """The database that ``value`` names, else ``$KVSPLIT_DB``, else the default file.

    An empty string counts as not given.

    Raises
    ------
    BadTarget
        A URL that does not parse or that SQLite would read differently, a
        ``~user`` whose home is unknown, a NUL character, a relative path
        with no current directory.
    """
    given = value or os.environ.get(ENV_VAR) or None
    if given is None:
        path = default_path()
        if not path.is_absolute():  # platformdirs found no home either
            raise BadTarget(f"{visible(str(path))}: kvsplit cannot tell the user's home directory for its "
                            f"default database; set HOME, or give one with --db / KVSPLIT_DB")
        return Target(str(path), URL.create("sqlite", database=str(path)), path, default=True)
    if _SCHEME.match(given):
        return _from_url(given)
    shown = shown_as_given(given)
    if "\x00" in given:
        raise BadTarget(f"{shown}: a path cannot hold a NUL character; {_EXAMPLES}")
    if given == ":memory:":
        return Target(shown, URL.create("sqlite"), memory=True)
    expanded = os.path.expanduser(given)
    if expanded.startswith("~"):
        user = given[1:].split("/", 1)[0]
        whose = f"no user {visible(user)!r} is known here" if user else "HOME is not set and the user has none"
        raise BadTarget(f"{shown}: cannot expand ~{visible(user)}: {whose}; write the path in full "
                        f"(./{shown} for a file of that name)")
    return Target(shown, *_absolute(shown, expanded))


def _absolute(shown: str, path: str) -> tuple[URL, Path]:
    try:
        path = os.path.abspath(path)  # what the driver does with it
    except OSError as exc:  # the current directory was removed
        raise BadTarget(f"{shown}: a relative path, but the current directory cannot be read "
                        f"({exc.strerror}); give an absolute path") from None
    return URL.create("sqlite", database=path), Path(path)


def _from_url(given: str) -> Target:
    shown = shown_as_given(given)
    try:
        url = make_url(given)
    except (ArgumentError, ValueError) as exc:
        raise BadTarget(f"bad database URL {shown!r}: {visible(str(exc))}; {_EXAMPLES}") from None
    parts = [url.username, url.password, url.host, url.database,
             *url.query.keys(), *(v for vs in url.query.values() for v in ((vs,) if isinstance(vs, str) else vs))]
    if any(part and "\x00" in part for part in parts):
        raise BadTarget(f"bad database URL {shown!r}: it holds a NUL character (%00); {_EXAMPLES}")
    if url.get_backend_name() != "sqlite":
        return Target(shown, url)
    if url.host or url.username or url.password or url.port:
        raise BadTarget(f"bad database URL {shown!r}: an SQLite URL names a file, not a host: "
                        f"sqlite:///relative/path or sqlite:////absolute/path")
    unknown = sorted(set(url.query) - set(_SQLITE_DRIVER_ARGS) - {"mode"})
    if unknown:
        uri = " (SQLite URI filenames are not taken: give the path)" if "uri" in unknown else ""
        raise BadTarget(f"bad database URL {shown!r}: unknown SQLite URL parameter {visible(unknown[0])!r}{uri}; "
                        f"the query may hold mode=memory and the driver's {', '.join(sorted(_SQLITE_DRIVER_ARGS))}")
    for name, value in url.query.items():
        if not isinstance(value, str):
            raise BadTarget(f"bad database URL {shown!r}: {visible(name)} is given {len(value)} times")
        try:
            _SQLITE_DRIVER_ARGS.get(name, str)(value)
        except ValueError as exc:
            raise BadTarget(f"bad database URL {shown!r}: {visible(name)}={visible(value)} is not a value "
                            f"the driver takes ({visible(str(exc))})") from None
    if url.query.get("mode", "memory") != "memory":
        raise BadTarget(f"bad database URL {shown!r}: mode={visible(url.query['mode'])} is not taken; "
                        f"only mode=memory (an in-memory database)")
    if is_memory(url.database, url.query):
        return Target(shown, URL.create(url.drivername), memory=True)
    address, path = _absolute(shown, url.database)
    return Target(shown, url.set(database=address.database), path)


def stat_file(target: Target) -> os.stat_result | None:
    """``os.stat`` of the target's SQLite file; ``None`` when there is no such file.

    Raises
    ------
    BadTarget
        The path cannot name a file here: too long, a loop of links, a part
        that is not a directory, no permission to look.
    """
    try:
        return os.stat(target.path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        what = "a part of the path is not a directory" if exc.errno == errno.ENOTDIR else exc.strerror or str(exc)
        raise BadTarget(f"{target.shown}: cannot use this path: {what}; check the path given with "
                        f"--db / KVSPLIT_DB") from None
