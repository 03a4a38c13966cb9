"""Schema versions: Alembic run from code (no alembic.ini), with the scripts in ``migrations/``."""

from __future__ import annotations

import contextlib
import functools
import re
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Connection, Engine, inspect, text

from .engine import engine_name, writing
from .models import METADATA
from .schemas import NoDatabase, SchemaDamaged, SchemaTooNew

#: Not Alembic's default name, so kvsplit can share a PostgreSQL database with other apps.
VERSION_TABLE = "kvsplit_schema_version"
_PG_LOCK_ID = 0x6B7673706C6974  # "kvsplit": serializes concurrent first migrations on PostgreSQL
_REPAIR = "run `kvsplit db repair` to restore it"


def _config(connection: Connection | None = None) -> Config:
    cfg = Config(attributes={"connection": connection, "version_table": VERSION_TABLE})
    # ConfigParser interpolation would eat a '%' in the install path.
    cfg.set_main_option("script_location", str(Path(__file__).resolve().parent / "migrations").replace("%", "%%"))
    return cfg


@functools.cache
def _scripts() -> ScriptDirectory:
    return ScriptDirectory.from_config(_config())  # milliseconds to parse; never changes at run time


def head_revision() -> str:
    """The newest revision this code knows."""
    return _scripts().get_current_head()


def stamped_revision(conn: Connection, shown: str, *, check_tables: bool = True) -> str | None:
    """The one revision stamped in the database, ``None`` without kvsplit tables; else
    :class:`SchemaDamaged` (or, at head with ``check_tables``, a missing table) or :class:`SchemaTooNew`."""
    tables = set(inspect(conn).get_table_names())
    rows = list(conn.scalars(text(f"SELECT version_num FROM {VERSION_TABLE}"))) if VERSION_TABLE in tables else []
    if not rows:
        if tables & set(METADATA.tables):
            raise SchemaDamaged(f"{shown}: the database has kvsplit tables but its schema version table "
                                f"{VERSION_TABLE} {'is empty' if VERSION_TABLE in tables else 'is missing'}; {_REPAIR}")
        return None
    for row in rows:
        if not (isinstance(row, str) and re.match(r"^[0-9A-Za-z_]{1,32}$", row)):
            raise SchemaDamaged(f"{shown}: the schema version table {VERSION_TABLE} holds {row!r}, "
                                f"which is not a schema revision; {_REPAIR}")
    for row in rows:
        with contextlib.suppress(CommandError):  # Alembic may raise for a revision it does not know
            if _scripts().get_revision(row) is not None:
                continue
        raise SchemaTooNew(f"{shown}: the database has schema revision {row!r}, newer than this kvsplit knows "
                           f"(up to {head_revision()!r}); upgrade kvsplit, or use another database with --db / "
                           f"KVSPLIT_DB", row)
    if len(rows) > 1:
        raise SchemaDamaged(f"{shown}: the schema version table {VERSION_TABLE} has {len(rows)} rows "
                            f"({', '.join(map(repr, rows))}) where one belongs; {_REPAIR}")
    if check_tables and rows[0] == head_revision() and (missing := [t for t in METADATA.tables if t not in tables]):
        raise SchemaDamaged(f"{shown}: the table {missing[0]} is missing; run `kvsplit db repair` to recreate it")
    return rows[0]


def restore_schema(engine: Engine, *, dry_run: bool = False) -> list[str]:
    """Restore a damaged version table (stamped head, only when every table there has every column of
    head) or missing tables (created empty) for ``kvsplit db repair``; one line per repair."""
    shown, head = engine_name(engine), head_revision()
    with writing(engine).connect() as conn, conn.begin():
        try:
            restamp = False
            if stamped_revision(conn, shown, check_tables=False) != head:
                return []  # empty (created on open) or older (upgraded on open)
        except SchemaDamaged:
            restamp = True
        inspector = inspect(conn)
        tables = set(inspector.get_table_names())
        for table in (t for t in METADATA.sorted_tables if t.name in tables):
            if lacking := sorted(set(table.columns.keys()) - {c["name"] for c in inspector.get_columns(table.name)}):
                raise SchemaDamaged(f"{shown}: table {table.name} lacks the columns {', '.join(lacking)} of schema "
                                    f"revision {head}, so its revision cannot be told; restore the database from a "
                                    f"backup or an export, or start a new one with --db / KVSPLIT_DB")
        missing = [t for t in METADATA.sorted_tables if t.name not in tables]
        done = [f"created the missing table {t.name} (empty)" for t in missing]
        if restamp:
            done.append(f"stamped schema revision {head} in {VERSION_TABLE}")
        if dry_run or not done:
            return done
        METADATA.create_all(conn, tables=missing)
        if restamp:
            command.stamp(_config(conn), head, purge=True)  # purge: whatever rows the table holds go
        return done


def upgrade(engine: Engine, target: str = "head") -> tuple[str | None, str | None]:
    """Migrate the database to ``target`` in one transaction; (before, after).  An older ``target``
    downgrades (tests build databases of revision ``"0001"`` so)."""
    with writing(engine).connect() as conn:
        sqlite = conn.dialect.name == "sqlite"
        if sqlite:
            # Batch mode drops and recreates tables: with foreign keys on, dropping tuning_results
            # would delete every candidate.  The pragma is a no-op in a transaction: before BEGIN.
            conn.connection.driver_connection.execute("PRAGMA foreign_keys = OFF")
        try:
            with conn.begin():
                if conn.dialect.name == "postgresql":
                    conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_LOCK_ID})")
                before = stamped_revision(conn, engine_name(engine), check_tables=False)
                if target == "head" and before == head_revision():
                    return before, before  # another process got here first
                upward = target == "head" or before is None or any(
                    r.revision == before for r in _scripts().iterate_revisions(target, "base"))
                (command.upgrade if upward else command.downgrade)(_config(conn), target)
                after = stamped_revision(conn, engine_name(engine), check_tables=False)
        finally:
            if sqlite:
                conn.connection.driver_connection.execute("PRAGMA foreign_keys = ON")
    return before, after


def ensure_schema(engine: Engine, *, create: bool = True) -> str | None:
    """Bring the database to the head revision (empty with ``create`` false: :class:`NoDatabase`);
    the revision it had if it was upgraded, else ``None``."""
    head = head_revision()
    with engine.connect() as conn:
        found = stamped_revision(conn, engine_name(engine))
    if found == head:
        return None
    if found is None and not create:
        raise NoDatabase(f"{engine_name(engine)}: holds no kvsplit tuning tables yet; "
                         f"`kvsplit tune` or `kvsplit db import` creates them")
    before, _ = upgrade(engine, "head")
    return before if before not in (None, head) else None
