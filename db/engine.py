"""Engine factory: create the engine of a target (see :mod:`.targets`), name failures.

SQLite gets one ``connect`` listener for its pragmas and one ``begin`` listener
so that writers take the write lock up front (see :func:`_install_sqlite_listeners`).
Any other SQLAlchemy URL is used as it is; PostgreSQL through psycopg 3
(``postgresql+psycopg://user@host/db``).
"""

from __future__ import annotations

import re
import weakref
from pathlib import Path

import platformdirs
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.pool import NullPool, StaticPool

from .errors import StoreError
from .targets import ENV_VAR, BadTarget, Target, is_memory, parse_target, visible

__all__ = ["DEFAULT_TIMEOUT_S", "ENV_VAR", "WRITE_OPTION", "create_db_engine", "describe_error", "display_url",
           "engine_name", "is_memory_url"]
#: How long a writer waits for another process's write lock, in seconds.
DEFAULT_TIMEOUT_S = 30.0
#: Execution option that makes a SQLite transaction start with BEGIN IMMEDIATE.
WRITE_OPTION = "kvsplit_write"



# Import name of a database driver -> the package that installs it (pip's name).
_DRIVER_PACKAGES = {
    "psycopg": "'psycopg[binary]'", "psycopg2": "psycopg2-binary", "MySQLdb": "mysqlclient",
    "pymysql": "PyMySQL", "mysql": "mysql-connector-python", "asyncpg": "asyncpg",
    "pg8000": "pg8000", "oracledb": "oracledb", "pyodbc": "pyodbc", "pymssql": "pymssql",
    "aiosqlite": "aiosqlite", "aiomysql": "aiomysql",
}

def display_url(url: str) -> str:
    """``url`` with any password masked, for messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return url


def is_memory_url(url: URL) -> bool:
    """Whether ``url`` names an in-memory SQLite database."""
    return url.get_backend_name() == "sqlite" and is_memory(url.database, url.query)


# The name each engine's database goes by in messages: its target as the user wrote it.
_NAMES: weakref.WeakKeyDictionary[Engine, str] = weakref.WeakKeyDictionary()


def engine_name(engine: Engine) -> str:
    """The database of ``engine`` as messages show it (as given with --db / KVSPLIT_DB)."""
    return _NAMES.get(engine) or display_url(engine.url.render_as_string(hide_password=False))


def default_quarantine_path(sqlite_file: Path | None) -> Path:
    """Where ``repair`` writes the rows it removes: beside an SQLite file, else in the user cache dir."""
    if sqlite_file is not None:
        return sqlite_file.with_name(sqlite_file.name + ".quarantine.jsonl")
    return Path(platformdirs.user_cache_dir("kvsplit")) / "quarantine.jsonl"


def create_db_engine(target: Target | str, *, timeout_s: float = DEFAULT_TIMEOUT_S, pooled: bool = True) -> Engine:
    """Create an engine for ``target`` (a string is read by :func:`.targets.parse_target`).

    Parameters
    ----------
    target : Target or str
        The database.
    timeout_s : float
        SQLite busy timeout, and PostgreSQL connect timeout, in seconds.
    pooled : bool
        If false, an SQLite file's connections are closed after each
        transaction (a serving process: see :class:`.store.Store`).

    Raises
    ------
    StoreError
        The URL does not parse, names an unknown dialect, or its driver is not installed.
    """
    if not isinstance(target, Target):
        target = parse_target(target)
    shown, url = target.shown, target.url
    try:
        if url.get_backend_name() == "sqlite":
            if target.memory:
                # One shared connection: every session must see the same database.
                engine = create_engine(url, poolclass=StaticPool, connect_args={"check_same_thread": False})
            else:
                if target.default:
                    target.path.parent.mkdir(parents=True, exist_ok=True)
                pool = {} if pooled else {"poolclass": NullPool}
                engine = create_engine(url, connect_args={"timeout": timeout_s}, **pool)
            _install_sqlite_listeners(engine, timeout_s)
        else:
            connect_args = {}
            if url.get_backend_name() == "postgresql":
                # Fail in bounded time on an unreachable server instead of hanging; timestamps
                # read as text (see rows.py) in the one form whatever the server's DateStyle.
                connect_args["connect_timeout"] = max(1, int(timeout_s))
                if "options" not in url.query:
                    connect_args["options"] = "-c DateStyle=ISO"
            engine = create_engine(url, pool_pre_ping=True, connect_args=connect_args)
    except NoSuchModuleError as exc:
        raise BadTarget(
            f"bad database URL {shown!r}: {exc}; give an SQLAlchemy URL such as sqlite:///path/tuning.sqlite "
            f"or postgresql+psycopg://user@host/db"
        ) from exc
    except ImportError as exc:
        # The dialect is known but its DBAPI module is missing: not the URL's fault.
        driver = f"{url.get_backend_name()}+{url.get_driver_name()}"
        package = _DRIVER_PACKAGES.get(exc.name or "", exc.name)
        hint = f"pip install {package}" if package else "install the driver"
        raise StoreError(f"{shown}: the database driver for {driver} is not installed ({exc}); {hint}") from exc
    except (ArgumentError, ValueError) as exc:
        raise BadTarget(
            f"bad database URL {shown!r}: {visible(str(exc))}; give an SQLAlchemy URL such as "
            f"sqlite:///path/tuning.sqlite or postgresql+psycopg://user@host/db"
        ) from exc
    except OSError as exc:
        raise StoreError(f"cannot create the directory for {shown!r}: {exc}; check its permissions") from exc
    _NAMES[engine] = shown
    return engine


def _lenient_text(data: bytes) -> str:
    # Invalid UTF-8 in a text column must not fail the whole query in the
    # driver: it reads back with surrogates, and rows.py calls it damage.
    return data.decode("utf-8", "surrogateescape")


def _install_sqlite_listeners(engine: Engine, timeout_s: float) -> None:
    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection, connection_record):  # noqa: ANN001
        # The driver's own transaction handling is turned off: it would BEGIN
        # deferred, and a deferred transaction that later writes fails at once
        # with "database is locked" under WAL instead of waiting.
        dbapi_connection.isolation_level = None
        dbapi_connection.text_factory = _lenient_text
        cursor = dbapi_connection.cursor()
        try:
            # busy_timeout first: switching to WAL itself needs the lock.
            cursor.execute(f"PRAGMA busy_timeout = {int(timeout_s * 1000)}")
            cursor.execute("PRAGMA journal_mode = WAL")
            # NORMAL is safe in WAL mode (no corruption; a power cut may lose
            # the last commits) and spares an fsync per upsert.
            cursor.execute("PRAGMA synchronous = NORMAL")
            cursor.execute("PRAGMA foreign_keys = ON")
            # No memory-mapped reads of the file, whatever this SQLite's build
            # default: a mapped file that is truncated or made immutable under
            # the process kills it with SIGBUS instead of failing a query.
            cursor.execute("PRAGMA mmap_size = 0")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn):  # noqa: ANN001
        immediate = conn.get_execution_options().get(WRITE_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


_MISSING_TABLE = re.compile(r'no such table: (\w+)|relation "(\w+)" does not exist')


def describe_error(exc: BaseException, shown: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """One sentence for people: what is wrong with the database ``shown`` (see :func:`engine_name`), and what to do."""
    orig = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    text = visible(str(orig).strip().splitlines()[0]) if str(orig).strip() else type(orig).__name__
    low = text.lower()
    elsewhere = "or use another database with --db / KVSPLIT_DB"
    if "database is locked" in low or "database table is locked" in low:
        return (
            f"{shown}: database is locked (another process held it for more than {timeout_s:g} s); "
            f"try again once that process is done"
        )
    if "not a database" in low or "malformed" in low or "corrupt" in low:
        return (
            f"{shown}: the file is corrupt or not an SQLite database ({text}); move it away "
            f"(kvsplit then starts a new one) {elsewhere}"
        )
    if "readonly" in low or "read-only" in low:
        return f"{shown}: the database is read-only ({text}); make the file and its directory writable {elsewhere}"
    if "unable to open database file" in low:
        return (
            f"{shown}: cannot open the database file: missing directory or no permission ({text}); "
            f"check the path and its permissions"
        )
    missing = _MISSING_TABLE.search(text)
    if missing:
        table = missing.group(1) or missing.group(2)
        return f"{shown}: the table {table} is missing; run `kvsplit db repair` to recreate it"
    if "password authentication failed" in low or "authentication failed" in low:
        return f"{shown}: the server refused the login ({text}); check the user and password in the URL"
    if "does not exist" in low and "database" in low:
        return f"{shown}: {text}; create that database on the server or fix the URL"
    if "connection" in low or "could not" in low or "timeout" in low or "timed out" in low:
        return (
            f"{shown}: cannot reach the database server ({text}); check that it is running and that "
            f"the host, port and database in the URL are right"
        )
    if isinstance(exc, (SQLAlchemyError, OSError)):
        return f"{shown}: {type(orig).__name__}: {text}; check the database {elsewhere}"
    return f"{shown}: {text}"
