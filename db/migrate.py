"""Schema versioning: Alembic run from code, without an alembic.ini.

The scripts live in ``migrations/`` inside the package.  :func:`ensure_schema`
is what opening a store calls: an empty database is created at the head
revision, an older one upgraded in place, a newer one refused.
"""

from __future__ import annotations

import functools
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
import re

from sqlalchemy import Connection, Engine, inspect, text

from .engine import WRITE_OPTION, engine_name
from .errors import NoDatabase, SchemaDamaged, SchemaTooNew
from .models import Base

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
#: Not Alembic's default name, so kvsplit can share a PostgreSQL database with other apps.
VERSION_TABLE = "kvsplit_schema_version"
# Any constant: serializes concurrent first-time migrations on PostgreSQL.
_PG_LOCK_ID = 0x6B7673706C6974  # "kvsplit"


def _config(connection: Connection | None = None) -> Config:
    cfg = Config()
    # ConfigParser interpolation would eat a '%' in the install path.
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    cfg.attributes["connection"] = connection
    cfg.attributes["version_table"] = VERSION_TABLE
    return cfg


@functools.cache
def _scripts() -> ScriptDirectory:
    # Parsing the revision files costs milliseconds; they never change at run time.
    return ScriptDirectory.from_config(_config())


def head_revision() -> str:
    """The newest revision this code knows."""
    head = _scripts().get_current_head()
    assert head is not None
    return head


def current_revision(conn: Connection) -> str | None:
    """The revision stamped in the database, ``None`` if it has no kvsplit schema."""
    ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
    return ctx.get_current_revision()


def _is_known(revision: str) -> bool:
    try:
        return _scripts().get_revision(revision) is not None
    except CommandError:
        return False


_REVISION_ID = re.compile(r"^[0-9A-Za-z_]{1,32}$")
_REPAIR = "run `kvsplit db repair` to restore it"


def stamped_revision(conn: Connection, shown: str, *, check_tables: bool = True) -> str | None:
    """The one revision stamped in the database; ``None`` for a database without kvsplit tables.

    Raises
    ------
    SchemaDamaged
        kvsplit tables without a version row, several version rows, a row
        that is not a revision id, or (at the head revision) a missing table.
    SchemaTooNew
        A revision this code does not know.
    """
    tables = set(inspect(conn).get_table_names())
    has_version_table = VERSION_TABLE in tables
    rows = [r[0] for r in conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}"))] if has_version_table else []
    if not rows:
        if tables & set(Base.metadata.tables):
            state = "is empty" if has_version_table else "is missing"
            raise SchemaDamaged(f"{shown}: the database has kvsplit tables but its schema version table "
                                f"{VERSION_TABLE} {state}; {_REPAIR}")
        return None
    for row in rows:
        if not (isinstance(row, str) and _REVISION_ID.match(row)):
            raise SchemaDamaged(f"{shown}: the schema version table {VERSION_TABLE} holds {row!r}, "
                                f"which is not a schema revision; {_REPAIR}")
    for row in rows:
        _check_known(row, shown)
    if len(rows) > 1:
        raise SchemaDamaged(f"{shown}: the schema version table {VERSION_TABLE} has {len(rows)} rows "
                            f"({', '.join(map(repr, rows))}) where one belongs; {_REPAIR}")
    if check_tables and rows[0] == head_revision():
        missing = [t for t in Base.metadata.tables if t not in tables]
        if missing:
            raise SchemaDamaged(f"{shown}: the table {missing[0]} is missing; run `kvsplit db repair` "
                                f"to recreate it")
    return rows[0]


def restore_schema(engine: Engine, *, dry_run: bool = False) -> list[str]:
    """Restore a damaged version table or missing tables (``kvsplit db repair``); what was done.

    A version table that is missing, empty, duplicated or holds garbage is
    stamped with the head revision, but only when every table and column of
    the head schema is there: otherwise nobody can tell which revision the
    tables are.  At the head revision, missing tables are created empty.
    A newer schema is refused (:class:`SchemaTooNew`).
    """
    shown = engine_name(engine)
    head = head_revision()
    with engine.execution_options(**{WRITE_OPTION: True}).connect() as conn, conn.begin():
        try:
            found = stamped_revision(conn, shown, check_tables=False)
        except SchemaDamaged:
            found = None
            restamp = True
        else:
            restamp = False
            if found != head:
                return []  # empty (created on open) or older (upgraded on open)
        inspector = inspect(conn)
        tables = set(inspector.get_table_names())
        for table in Base.metadata.sorted_tables:
            if table.name in tables:
                columns = {c["name"] for c in inspector.get_columns(table.name)}
                lacking = sorted(set(table.columns.keys()) - columns)
                if lacking:
                    raise SchemaDamaged(
                        f"{shown}: table {table.name} lacks the columns {', '.join(lacking)} of schema revision "
                        f"{head}, so its revision cannot be told; restore the database from a backup or an "
                        f"export, or start a new one with --db / KVSPLIT_DB")
        missing = [t for t in Base.metadata.sorted_tables if t.name not in tables]
        done = [f"created the missing table {t.name} (empty)" for t in missing]
        if restamp:
            done.append(f"stamped schema revision {head} in {VERSION_TABLE}")
        if dry_run or not done:
            return done
        Base.metadata.create_all(conn, tables=missing)
        if restamp:
            if VERSION_TABLE in tables:
                conn.execute(text(f"DELETE FROM {VERSION_TABLE}"))
                conn.execute(text(f"INSERT INTO {VERSION_TABLE} (version_num) VALUES (:v)"), {"v": head})
            else:
                command.stamp(_config(conn), head)
        return done


def _check_known(revision: str | None, shown: str) -> None:
    if revision is None or _is_known(revision):
        return
    raise SchemaTooNew(
        f"{shown}: the database has schema revision {revision!r}, newer than this "
        f"kvsplit knows (up to {head_revision()!r}); upgrade kvsplit, or use another "
        f"database with --db / KVSPLIT_DB",
        revision,
    )


def upgrade(engine: Engine, target: str = "head") -> tuple[str | None, str | None]:
    """Migrate the database to ``target`` in one transaction; returns (before, after).

    ``target`` may also be an older revision; a downgrade then runs (tests use
    this to build databases at revision ``"0001"``).
    """
    with engine.execution_options(**{WRITE_OPTION: True}).connect() as conn:
        sqlite = conn.dialect.name == "sqlite"
        if sqlite:
            # Batch mode drops and recreates tables; with foreign keys on, dropping
            # tuning_results would cascade-delete every candidate.  The pragma is
            # a no-op inside a transaction, so it goes to the driver before BEGIN.
            conn.connection.driver_connection.execute("PRAGMA foreign_keys = OFF")
        try:
            with conn.begin():
                if conn.dialect.name == "postgresql":
                    conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_LOCK_ID})")
                before = current_revision(conn)
                _check_known(before, engine_name(engine))
                if target == "head" and before == head_revision():
                    return before, before  # another process got here first
                cfg = _config(conn)
                if target == "head" or before is None or _is_ancestor(target, before):
                    command.upgrade(cfg, target)
                else:
                    command.downgrade(cfg, target)
                after = current_revision(conn)
        finally:
            if sqlite:
                conn.connection.driver_connection.execute("PRAGMA foreign_keys = ON")
    return before, after


def _is_ancestor(target: str, revision: str) -> bool:
    # True when ``target`` is newer than ``revision``, i.e. reached by upgrading.
    return any(r.revision == revision for r in _scripts().iterate_revisions(target, "base"))


def ensure_schema(engine: Engine, *, create: bool = True) -> str | None:
    """Bring the database to the head revision; with ``create=False`` never create the schema.

    Returns
    -------
    str or None
        The revision the database had if it was upgraded from an older one;
        ``None`` when it was already current or was empty and got created.

    Raises
    ------
    SchemaTooNew
        The database carries a revision this code does not know.
    SchemaDamaged
        The version table is damaged or a table is missing (see :func:`stamped_revision`).
    """
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
