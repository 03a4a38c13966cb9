"""Engine factory: resolve the database URL, create the engine, name failures.

SQLite gets one ``connect`` listener for its pragmas and one ``begin`` listener
so that writers take the write lock up front (see :func:`_install_sqlite_listeners`).
Any other SQLAlchemy URL is used as it is; PostgreSQL through psycopg 3
(``postgresql+psycopg://user@host/db``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import platformdirs
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.pool import StaticPool

from .errors import StoreError

ENV_VAR = "KVSPLIT_DB"
#: How long a writer waits for another process's write lock, in seconds.
DEFAULT_TIMEOUT_S = 30.0
#: Execution option that makes a SQLite transaction start with BEGIN IMMEDIATE.
WRITE_OPTION = "kvsplit_write"


def default_url() -> str:
    """``sqlite:///`` URL of ``tuning.sqlite`` in the user cache directory."""
    path = Path(platformdirs.user_cache_dir("kvsplit")) / "tuning.sqlite"
    return f"sqlite:///{path}"


def resolve_url(url: str | None = None) -> str:
    """The URL to use: ``url``, else ``$KVSPLIT_DB``, else :func:`default_url`.

    A value without ``://`` is taken as the path of an SQLite file.
    """
    url = url or os.environ.get(ENV_VAR) or default_url()
    if "://" not in url:
        url = f"sqlite:///{Path(url).expanduser().absolute()}"
    return url


def display_url(url: str) -> str:
    """``url`` with any password masked, for messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def is_memory_url(url: URL) -> bool:
    """Whether ``url`` names an in-memory SQLite database."""
    if url.get_backend_name() != "sqlite":
        return False
    return url.database in (None, "", ":memory:") or url.query.get("mode") == "memory"


def sqlite_file(url: str) -> Path | None:
    """The file of an SQLite URL (already resolved); ``None`` for memory or another backend."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return None
    if parsed.get_backend_name() != "sqlite" or is_memory_url(parsed):
        return None
    return Path(parsed.database)


def default_quarantine_path(url: str) -> Path:
    """Where ``repair`` writes the rows it removes: beside an SQLite file, else in the user cache dir."""
    path = sqlite_file(url)
    if path is not None:
        return path.with_name(path.name + ".quarantine.jsonl")
    return Path(platformdirs.user_cache_dir("kvsplit")) / "quarantine.jsonl"


def create_db_engine(url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Engine:
    """Create an engine for ``url`` (already resolved).

    Parameters
    ----------
    url : str
        Any SQLAlchemy URL.
    timeout_s : float
        SQLite busy timeout, and PostgreSQL connect timeout, in seconds.

    Raises
    ------
    StoreError
        The URL does not parse, names an unknown dialect, or its driver is not installed.
    """
    shown = display_url(url)
    try:
        parsed = make_url(url)
        if parsed.get_backend_name() == "sqlite":
            if is_memory_url(parsed):
                # One shared connection: every session must see the same database.
                engine = create_engine(parsed, poolclass=StaticPool, connect_args={"check_same_thread": False})
            else:
                if parsed.database == make_url(default_url()).database:
                    Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
                engine = create_engine(parsed, connect_args={"timeout": timeout_s})
            _install_sqlite_listeners(engine, timeout_s)
            return engine
        connect_args = {}
        if parsed.get_backend_name() == "postgresql":
            # Fail in bounded time on an unreachable server instead of hanging.
            connect_args["connect_timeout"] = max(1, int(timeout_s))
        return create_engine(parsed, pool_pre_ping=True, connect_args=connect_args)
    except NoSuchModuleError as exc:
        raise StoreError(
            f"bad database URL {shown!r}: {exc}; give an SQLAlchemy URL such as sqlite:///path/tuning.sqlite "
            f"or postgresql+psycopg://user@host/db"
        ) from exc
    except ImportError as exc:
        # The dialect is known but its DBAPI module is missing: not the URL's fault.
        driver = f"{parsed.get_backend_name()}+{parsed.get_driver_name()}"
        hint = "pip install 'psycopg[binary]'" if parsed.get_driver_name() == "psycopg" else f"install {exc.name or 'it'}"
        raise StoreError(f"{shown}: the database driver for {driver} is not installed ({exc}); {hint}") from exc
    except (ArgumentError, ValueError) as exc:
        raise StoreError(
            f"bad database URL {shown!r}: {exc}; give an SQLAlchemy URL such as sqlite:///path/tuning.sqlite "
            f"or postgresql+psycopg://user@host/db"
        ) from exc
    except OSError as exc:
        raise StoreError(f"cannot create the directory for {shown!r}: {exc}; check its permissions") from exc


def _lenient_text(data: bytes) -> str:
    # Invalid UTF-8 in a text column must not fail the whole query in the
    # driver: it reads back with surrogates, and decode.py calls it damage.
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
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn):  # noqa: ANN001
        immediate = conn.get_execution_options().get(WRITE_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


_MISSING_TABLE = re.compile(r'no such table: (\w+)|relation "(\w+)" does not exist')


def describe_error(exc: BaseException, url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """One sentence for people: what is wrong with the database at ``url``, and what to do."""
    shown = display_url(url)
    orig = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    text = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
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
