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
from sqlalchemy import Connection, Engine

from .engine import WRITE_OPTION, display_url
from .errors import SchemaTooNew

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


def _check_known(revision: str | None, url: str) -> None:
    if revision is None:
        return
    try:
        _scripts().get_revision(revision)
    except CommandError:
        raise SchemaTooNew(
            f"{display_url(url)}: the database has schema revision {revision!r}, newer than this "
            f"kvsplit knows (up to {head_revision()!r}); upgrade kvsplit, or use another "
            f"database with --db / KVSPLIT_DB",
            revision,
        ) from None


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
                _check_known(before, str(engine.url))
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


def ensure_schema(engine: Engine) -> str | None:
    """Bring the database to the head revision.

    Returns
    -------
    str or None
        The revision the database had if it was upgraded from an older one;
        ``None`` when it was already current or was empty and got created.

    Raises
    ------
    SchemaTooNew
        The database carries a revision this code does not know.
    """
    head = head_revision()
    with engine.connect() as conn:
        found = current_revision(conn)
    if found == head:
        return None
    _check_known(found, str(engine.url))
    before, _ = upgrade(engine, "head")
    return before if before not in (None, head) else None
