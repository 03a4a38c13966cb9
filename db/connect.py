"""Opening a store: the command line's strict way and the library's forgiving way."""

from __future__ import annotations

import warnings

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from .engine import DEFAULT_TIMEOUT_S, create_db_engine, describe_error, display_url, resolve_url
from .errors import DbWarning, StoreError
from .migrate import ensure_schema, head_revision
from .store import Store, memory_engine


def _ready_engine(url: str | None, timeout_s: float) -> Engine:
    # An engine whose database is at the head revision, or StoreError.
    resolved = resolve_url(url)
    engine = create_db_engine(resolved, timeout_s=timeout_s)
    try:
        upgraded_from = ensure_schema(engine)
    except StoreError:
        engine.dispose()
        raise
    except (SQLAlchemyError, OSError) as exc:
        engine.dispose()
        raise StoreError(describe_error(exc, resolved, timeout_s)) from exc
    if upgraded_from is not None:
        warnings.warn(
            f"kvsplit upgraded the tuning database {display_url(resolved)} from schema "
            f"revision {upgraded_from} to {head_revision()}",
            DbWarning,
            stacklevel=3,
        )
    return engine


def open_store(url: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Store:
    """Open the tuning database, creating or upgrading its schema.

    Parameters
    ----------
    url : str, optional
        SQLAlchemy URL or SQLite file path; default ``$KVSPLIT_DB``, else
        ``tuning.sqlite`` in the user cache directory.
    timeout_s : float
        How long to wait for another process's lock, in seconds.

    Returns
    -------
    Store
        A store that raises :class:`StoreError` on database problems.  If the
        schema was upgraded in place, one :class:`DbWarning` says so.

    Raises
    ------
    StoreError
        Bad URL, unreachable server, corrupt or unreadable file, read-only or
        locked database; :class:`SchemaTooNew` for a newer schema.
    """
    return Store(_ready_engine(url, timeout_s), timeout_s=timeout_s)


def open_store_for_library(url: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Store:
    """Open the tuning database for a library caller; never raises for a database problem.

    Like :func:`open_store`, but a database that cannot be used (bad URL,
    corrupt, read-only, locked, newer schema) gives one :class:`DbWarning`
    naming the problem and an in-memory store; and a database problem that
    shows up later, in a read or write, does the same instead of raising.
    """
    try:
        engine = _ready_engine(url, timeout_s)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the caller's merge must go on
        warnings.warn(
            f"kvsplit tuning database unusable, continuing in memory: {exc}",
            DbWarning,
            stacklevel=2,
        )
        engine = memory_engine()
    return Store(engine, fallback=True, timeout_s=timeout_s)
