"""Opening a store: the command line's strict way, the library's forgiving way, and repair's way."""

from __future__ import annotations

import warnings

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from .engine import DEFAULT_TIMEOUT_S, create_db_engine, describe_error, engine_name
from .errors import DbWarning, NoDatabase, StoreError
from .migrate import ensure_schema, head_revision, restore_schema
from .schemas import Config
from .store import OnDamage, Store, memory_engine
from .targets import Target, parse_target, stat_file


def _engine(url: str | None, timeout_s: float, *, create: bool, pooled: bool = True) -> tuple[Engine, Target]:
    target = parse_target(url)
    if target.memory and not create:
        raise NoDatabase(
            f"{target.shown}: an in-memory database starts empty in every process, so there is nothing to "
            f"read; give the file or server that holds the tuning results with --db / KVSPLIT_DB"
        )
    # Looked at before SQLite sees it, so that a path that cannot name a file here
    # (too long, a link loop) is said to be one.
    missing = target.path is not None and stat_file(target) is None
    if missing and not create:
        raise NoDatabase(
            f"{target.shown}: no such database file; check the path given with --db / KVSPLIT_DB "
            f"(commands that only read never create a database: `kvsplit tune` and `kvsplit db import` do)"
        )
    return create_db_engine(target, timeout_s=timeout_s, pooled=pooled), target


def _guarded(engine: Engine, timeout_s: float, step) -> object:  # noqa: ANN001
    # Runs a schema step; database failures become StoreError with the store's message.
    try:
        return step()
    except StoreError:
        engine.dispose()
        raise
    except (SQLAlchemyError, OSError, ValueError) as exc:
        # ValueError: a driver refusing a value of the URL it cannot use (a query
        # argument that is not a number, a name it cannot encode).
        engine.dispose()
        raise StoreError(describe_error(exc, engine_name(engine), timeout_s)) from exc


def _ready_engine(url: str | None, timeout_s: float, *, create: bool = True,
                  pooled: bool = True) -> tuple[Engine, Target]:
    # An engine whose database is at the head revision, or StoreError.
    engine, target = _engine(url, timeout_s, create=create, pooled=pooled)
    upgraded_from = _guarded(engine, timeout_s, lambda: ensure_schema(engine, create=create))
    if upgraded_from is not None:
        warnings.warn(
            f"kvsplit upgraded the tuning database {target.shown} from schema "
            f"revision {upgraded_from} to {head_revision()}",
            DbWarning,
            stacklevel=3,
        )
    return engine, target


def open_store(
    url: str | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    create: bool = True,
    on_damage: OnDamage = "raise",
    config_type: type[Config] = Config,
) -> Store:
    """Open the tuning database, creating or upgrading its schema.

    Parameters
    ----------
    url : str, optional
        SQLAlchemy URL (it has a scheme) or SQLite file path (taken
        literally; see :mod:`kvsplit.db.targets`); default ``$KVSPLIT_DB``,
        else ``tuning.sqlite`` in the user cache directory.
    timeout_s : float
        How long to wait for another process's lock, in seconds.
    create : bool
        If false, a missing SQLite file, an in-memory database or a database
        without kvsplit tables is a :class:`NoDatabase` instead of being
        created (commands that only read).
    on_damage : {"raise", "warn"}
        What a read that meets rows that do not parse does: raise
        :class:`DamagedRows`, or skip them with one :class:`DbWarning`.
    config_type : type of Config
        What stored configs become (see :class:`Store`): the commands and the
        dispatcher give ``kvsplit.config.KernelConfig``.

    Returns
    -------
    Store
        A store that raises :class:`StoreError` on database problems.  If the
        schema was upgraded in place, one :class:`DbWarning` says so.

    Raises
    ------
    StoreError
        Bad URL or path (:class:`~kvsplit.db.targets.BadTarget`), missing
        driver, unreachable server, corrupt or unreadable file, read-only or
        locked database, damaged version table
        (:class:`SchemaDamaged`); :class:`SchemaTooNew` for a newer schema.
    """
    engine, target = _ready_engine(url, timeout_s, create=create)
    return Store(engine, target=target, timeout_s=timeout_s, on_damage=on_damage, config_type=config_type)


def open_store_for_library(url: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                           config_type: type[Config] = Config) -> Store:
    """Open the tuning database for a library caller; never raises for a database problem.

    Like :func:`open_store`, but a database that cannot be used (bad URL or
    path, corrupt, read-only, locked, newer schema, damaged version table)
    gives one :class:`DbWarning` naming the problem and an in-memory store; a
    database problem that shows up later, in a read or write, does the same
    instead of raising; and rows that do not parse are skipped with one
    warning.  An SQLite file is watched: deleted or replaced under the
    process, it is noticed at the next read or write (see :class:`Store`).
    """
    try:
        # No SQLite connection kept between transactions: an idle serving process
        # then maps nothing of the file's -shm index, which would kill it with
        # SIGBUS at its next write once the file is made immutable.
        engine, target = _ready_engine(url, timeout_s, pooled=False)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the caller's merge must go on
        warnings.warn(
            f"kvsplit tuning database unusable, continuing in memory: {exc}",
            DbWarning,
            stacklevel=2,
        )
        return Store(memory_engine(), fallback=True, timeout_s=timeout_s, config_type=config_type)
    return Store(engine, target=target, fallback=True, timeout_s=timeout_s, config_type=config_type)


def open_store_for_repair(url: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S, dry_run: bool = False,
                          config_type: type[Config] = Config) -> tuple[Store, list[str]]:
    """Open a database that may be damaged, for :meth:`Store.repair`.

    A damaged version table or missing tables are restored first (see
    :func:`kvsplit.db.migrate.restore_schema`; with ``dry_run`` only listed).
    Returns the store and one line per schema repair.  Never creates a database.

    Raises
    ------
    StoreError
        As :func:`open_store`; :class:`SchemaTooNew` for a newer schema, which
        repair leaves alone.
    """
    engine, target = _engine(url, timeout_s, create=False)
    done = _guarded(engine, timeout_s, lambda: restore_schema(engine, dry_run=dry_run))
    if not (dry_run and done):
        _guarded(engine, timeout_s, lambda: ensure_schema(engine, create=False))
    return Store(engine, target=target, timeout_s=timeout_s, on_damage="raise", config_type=config_type), done
