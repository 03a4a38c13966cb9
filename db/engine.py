"""Where the database is and how to reach it: the one reading of ``--db`` / ``KVSPLIT_DB``,
the engine made from it, failures named for people, and the watch on a serving process's file."""

from __future__ import annotations

import ctypes
import errno
import os
import re
import sqlite3
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import platformdirs
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, SQLAlchemyError
from sqlalchemy.pool import NullPool, StaticPool
from sqlalchemy.util import asbool

from .schemas import NoDatabase, StoreError

ENV_VAR = "KVSPLIT_DB"
#: How long a writer waits for another process's write lock, in seconds.
DEFAULT_TIMEOUT_S = 30.0
# Execution option that makes an SQLite transaction start with BEGIN IMMEDIATE: see writing().
_WRITE_OPTION = "kvsplit_write"
_SHOWN_OPTION = "kvsplit_shown"  # the database as given, for messages: see engine_name()
# A URL's user, then ":" and the password up to the authority's last "@".
_PASSWORD = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^:/]*):[^/]*@")
_EXAMPLES = ("give an SQLite file path, or a URL such as sqlite:////abs/path/tuning.sqlite or "
             "postgresql+psycopg://user@host/db")


def _isolation_level(value: str) -> str:
    if value.upper() not in ("", "DEFERRED", "IMMEDIATE", "EXCLUSIVE"):
        raise ValueError("not '', DEFERRED, IMMEDIATE or EXCLUSIVE")
    return value


# The arguments pysqlite takes from a URL's query, each with the dialect's conversion.
_SQLITE_DRIVER_ARGS = {"timeout": float, "detect_types": int, "cached_statements": int,
                       "check_same_thread": asbool, "isolation_level": _isolation_level}
# Import name of a database driver -> the package that installs it, where the names differ.
_DRIVER_PACKAGES = {"psycopg": "'psycopg[binary]'", "psycopg2": "psycopg2-binary", "MySQLdb": "mysqlclient",
                    "pymysql": "PyMySQL", "mysql": "mysql-connector-python"}


class BadTarget(StoreError):
    """``--db`` / ``KVSPLIT_DB`` names nothing kvsplit can open: bad URL, unknown home, bad path."""


@dataclass(frozen=True)
class Target:
    """A database as kvsplit and the driver both understand it: ``shown`` as written (for messages),
    ``path`` the SQLite file (``None`` in memory or on a server), ``default``: nothing was given."""

    shown: str
    url: URL
    path: Path | None = None
    memory: bool = False
    default: bool = False


def visible(text: str) -> str:
    """``text`` on one line: control and other unprintable characters as escapes (``\\n``, ``\\x00``)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii")
                   for c in text)


def shown_as_given(value: str) -> str:
    """``value`` (of --db or KVSPLIT_DB) as messages show it, even when it names nothing usable: the
    password of a URL, even of one that does not parse, masked."""
    return visible(_PASSWORD.sub(r"\1:***@", value))


def parse_target(value: str | None = None) -> Target:
    """The database that ``value`` names, else ``$KVSPLIT_DB``, else ``tuning.sqlite`` in the user
    cache directory; :class:`BadTarget` if there is none.  A value is a URL only when it starts with
    a scheme; anything else is an SQLite file's path, taken literally and made absolute as the driver does."""
    given = value or os.environ.get(ENV_VAR) or None
    if given is None:
        path = Path(platformdirs.user_cache_dir("kvsplit")) / "tuning.sqlite"
        if not path.is_absolute():  # platformdirs found no home either
            raise BadTarget(f"{visible(str(path))}: kvsplit cannot tell the user's home directory for its "
                            f"default database; set HOME, or give one with --db / KVSPLIT_DB")
        return Target(str(path), URL.create("sqlite", database=str(path)), path, default=True)
    shown = shown_as_given(given)
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", given):
        return _from_url(given, shown)
    if "\x00" in given:
        raise BadTarget(f"{shown}: a path cannot hold a NUL character; {_EXAMPLES}")
    if given == ":memory:":
        return Target(shown, URL.create("sqlite"), memory=True)
    if (expanded := os.path.expanduser(given)).startswith("~"):
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


def _from_url(given: str, shown: str) -> Target:
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
    if unknown := sorted(set(url.query) - set(_SQLITE_DRIVER_ARGS) - {"mode"}):
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
    if is_memory_url(url):
        return Target(shown, URL.create(url.drivername), memory=True)
    address, path = _absolute(shown, url.database)
    return Target(shown, url.set(database=address.database), path)


def engine_name(engine: Engine) -> str:
    """The database of ``engine`` as messages show it (as given with --db / KVSPLIT_DB)."""
    return engine.get_execution_options().get(_SHOWN_OPTION) or engine.url.render_as_string(hide_password=True)


def writing(engine: Engine) -> Engine:
    """``engine`` for transactions that write: on SQLite they take the write lock at BEGIN (IMMEDIATE)."""
    return engine.execution_options(**{_WRITE_OPTION: True})


def is_memory_url(url: URL) -> bool:
    """Whether ``url`` names an in-memory SQLite database (the one rule)."""
    return url.get_backend_name() == "sqlite" and (url.database in (None, "", ":memory:")
                                                   or url.query.get("mode") == "memory")


def create_db_engine(target: Target | str, *, timeout_s: float = DEFAULT_TIMEOUT_S, pooled: bool = True,
                     create: bool = True) -> Engine:
    """An engine for ``target`` (a string is read by :func:`parse_target`), or a :class:`StoreError`.  ``timeout_s``:
    SQLite's busy timeout and PostgreSQL's connect timeout, in seconds; ``pooled`` false: an SQLite file's
    connections close after each transaction; ``create`` false: memory or a missing file is :class:`NoDatabase`."""
    if not isinstance(target, Target):
        target = parse_target(target)
    shown, url = target.shown, target.url
    if target.memory and not create:
        raise NoDatabase(f"{shown}: an in-memory database starts empty in every process, so there is nothing to "
                         f"read; give the file or server that holds the tuning results with --db / KVSPLIT_DB")
    try:  # before SQLite sees the path, so that a path that cannot name a file here is said to be one
        if target.path is not None:
            os.stat(target.path)
    except FileNotFoundError:
        if not create:
            raise NoDatabase(f"{shown}: no such database file; check the path given with --db / KVSPLIT_DB "
                             f"(commands that only read never create a database: `kvsplit tune` and `kvsplit db "
                             f"import` do)") from None
    except OSError as exc:  # too long, a loop of links, no permission
        what = "a part of the path is not a directory" if exc.errno == errno.ENOTDIR else exc.strerror or str(exc)
        raise BadTarget(f"{shown}: cannot use this path: {what}; check the path given with --db / KVSPLIT_DB") from None
    try:
        if url.get_backend_name() == "sqlite":
            if target.memory:  # one shared connection: every session must see the same database
                engine = create_engine(url, poolclass=StaticPool, connect_args={"check_same_thread": False})
            else:
                if target.default:
                    target.path.parent.mkdir(parents=True, exist_ok=True)
                engine = create_engine(url, connect_args={"timeout": timeout_s}, poolclass=None if pooled else NullPool)
            _install_sqlite_listeners(engine, timeout_s)
        else:
            connect_args = {}
            if url.get_backend_name() == "postgresql":
                # Bounded time on an unreachable server; timestamps read as text (see rows.py)
                # in one form whatever the server's DateStyle.
                connect_args["connect_timeout"] = max(1, int(timeout_s))
                if "options" not in url.query:
                    connect_args["options"] = "-c DateStyle=ISO"
            engine = create_engine(url, pool_pre_ping=True, connect_args=connect_args)
    except ImportError as exc:  # the dialect is known but its driver is missing: not the URL's fault
        driver = f"{url.get_backend_name()}+{url.get_driver_name()}"
        package = _DRIVER_PACKAGES.get(exc.name or "", exc.name)
        hint = f"pip install {package}" if package else "install the driver"
        raise StoreError(f"{shown}: the database driver for {driver} is not installed ({exc}); {hint}") from exc
    except (ArgumentError, ValueError) as exc:  # an unknown dialect or driver (NoSuchModuleError) among them
        raise BadTarget(f"bad database URL {shown!r}: {visible(str(exc))}; {_EXAMPLES}") from exc
    except OSError as exc:
        raise StoreError(f"cannot create the directory for {shown!r}: {exc}; check its permissions") from exc
    engine.update_execution_options(**{_SHOWN_OPTION: shown})
    return engine


def set_wal(dbapi_connection, timeout_s: float) -> None:
    """``PRAGMA journal_mode = WAL`` on a new connection, retried for up to ``timeout_s``: on
    a new file that other processes open at the same moment, the change can fail at once with
    "database is locked" (SQLite takes no busy timeout there), where it succeeds a moment
    later."""
    deadline = time.monotonic() + timeout_s
    pause = 0.005
    while True:
        try:
            dbapi_connection.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(pause)
            pause = min(2 * pause, 0.1)


def _install_sqlite_listeners(engine: Engine, timeout_s: float) -> None:
    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection, connection_record):  # noqa: ANN001
        # The driver's own transactions are off: it would BEGIN deferred, and a deferred
        # transaction that later writes fails at once under WAL ("database is locked").
        dbapi_connection.isolation_level = None
        # Invalid UTF-8 must not fail the whole query: it reads back with surrogates, which rows.py calls damage.
        dbapi_connection.text_factory = lambda data: data.decode("utf-8", "surrogateescape")
        dbapi_connection.execute(f"PRAGMA busy_timeout = {int(timeout_s * 1000)}")  # first: WAL itself needs the lock
        set_wal(dbapi_connection, timeout_s)
        # NORMAL is safe under WAL (a power cut may lose the last commits) and spares an fsync per upsert.
        dbapi_connection.execute("PRAGMA synchronous = NORMAL")
        dbapi_connection.execute("PRAGMA foreign_keys = ON")
        # No memory-mapped reads: a mapped file truncated or made immutable kills the process (SIGBUS).
        dbapi_connection.execute("PRAGMA mmap_size = 0")

    @event.listens_for(engine, "begin")
    def _begin(conn):  # noqa: ANN001
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(_WRITE_OPTION) else "BEGIN")


def describe_error(exc: BaseException, shown: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """One line for people: what is wrong with the database ``shown``, and what to do."""
    orig = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    text = visible(str(orig).strip().splitlines()[0]) if str(orig).strip() else type(orig).__name__
    low = text.lower()
    elsewhere = "or use another database with --db / KVSPLIT_DB"
    if "database is locked" in low or "database table is locked" in low:
        return (f"{shown}: database is locked (another process held it for more than {timeout_s:g} s); "
                f"try again once that process is done")
    if "not a database" in low or "malformed" in low or "corrupt" in low:
        return (f"{shown}: the file is corrupt or not an SQLite database ({text}); move it away "
                f"(kvsplit then starts a new one) {elsewhere}")
    if "readonly" in low or "read-only" in low:
        return f"{shown}: the database is read-only ({text}); make the file and its directory writable {elsewhere}"
    if "unable to open database file" in low:
        return (f"{shown}: cannot open the database file: missing directory or no permission ({text}); "
                f"check the path and its permissions")
    if missing := re.search(r'no such table: (\w+)|relation "(\w+)" does not exist', text):
        table = missing.group(1) or missing.group(2)
        return f"{shown}: the table {table} is missing; run `kvsplit db repair` to recreate it"
    if "authentication failed" in low:
        return f"{shown}: the server refused the login ({text}); check the user and password in the URL"
    if "does not exist" in low and "database" in low:
        return f"{shown}: {text}; create that database on the server or fix the URL"
    if "connection" in low or "could not" in low or "timeout" in low or "timed out" in low:
        return (f"{shown}: cannot reach the database server ({text}); check that it is running and that "
                f"the host, port and database in the URL are right")
    if isinstance(exc, (SQLAlchemyError, OSError)):
        return f"{shown}: {type(orig).__name__}: {text}; check the database {elsewhere}"
    return f"{shown}: {text}"


# Deleted, it would be written as an unlinked inode, lost at exit; replaced (a shared file copied over it), emptied,
# or made immutable (a write to SQLite's mapped -shm index of an immutable file is SIGBUS).  The watch only stats
# the files: closing any descriptor of a file would drop every POSIX lock the process holds on it, SQLite's included.

_statx = getattr(ctypes.CDLL(None) if sys.platform.startswith("linux") else None, "statx", None)  # glibc >= 2.28
if _statx is not None:
    _statx.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p)  # returns int


def immutable(path: str) -> bool:
    """Whether ``path`` has the immutable attribute (``chattr +i``); false where that cannot be told."""
    buffer = ctypes.create_string_buffer(256)  # struct statx
    if _statx is None or _statx(-100, os.fsencode(path), 0, 0x7FF, buffer) != 0:  # AT_FDCWD, STATX_BASIC_STATS
        return False
    # stx_attributes at offset 8, stx_attributes_mask at 56; STATX_ATTR_IMMUTABLE is 0x10.
    attributes, supported = (int.from_bytes(buffer.raw[at:at + 8], sys.byteorder) for at in (8, 56))
    return bool(attributes & supported & 0x10)


class FileWatch:
    """The device and inode of an SQLite file when it was opened, checked on request."""

    def __init__(self, path: Path):
        self.path = path
        stat = os.stat(path)
        self._identity = (stat.st_dev, stat.st_ino)

    def changed(self) -> tuple[str, bool] | None:
        """``None`` while the file is the one opened, else what happened to it and whether its path may be reopened."""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return "was deleted", False
        except OSError as exc:
            return f"cannot be looked at any more ({exc.strerror})", False
        if any(immutable(f"{self.path}{suffix}") for suffix in ("", "-wal", "-shm")):
            return "was made immutable", False
        if (stat.st_dev, stat.st_ino) != self._identity:
            return "was replaced by another file", True
        if stat.st_size == 0:  # an open database always has its header page
            return "was emptied", False
        return None
