"""Exceptions and warnings raised by the tuning database layer."""

from __future__ import annotations


class StoreError(Exception):
    """The tuning database cannot be used: bad URL, corrupt file, unwritable, locked.

    The message is one line meant for people; the command line prints it as is.
    """


class NoDatabase(StoreError):
    """There is no database to read: no such SQLite file, or no kvsplit tables (commands that only read)."""


class SchemaTooNew(StoreError):
    """The database was written by a newer kvsplit whose schema revision this code does not know."""

    def __init__(self, message: str, revision: str) -> None:
        super().__init__(message)
        self.revision = revision


#: The remedy for damaged rows, named in every message about them.
REPAIR_HINT = "run `kvsplit db repair` to move them to a quarantine file (`--dry-run` lists them first)"


def listed(items: list, shown: int = 3) -> str:
    text = "; ".join(str(item) for item in items[:shown])
    return text + (f"; and {len(items) - shown} more" if len(items) > shown else "")


class DamagedRows(StoreError):
    """Rows of the database do not parse (wrong type, out of range, bad JSON or timestamp...).

    Attributes
    ----------
    damage : list of kvsplit.db.rows.Damage
        Each names the table, the row id and the problem.
    """

    def __init__(self, url: str, damage: list) -> None:
        self.damage = list(damage)
        rows = "row does" if len(self.damage) == 1 else "rows do"
        super().__init__(f"{url}: {len(self.damage)} {rows} not parse ({listed(self.damage)}); {REPAIR_HINT}")


class SchemaDamaged(StoreError):
    """The schema version table is missing, empty, duplicated or holds garbage, or a table is missing."""


class DbWarning(UserWarning):
    """Something about the tuning database that a caller should know but that did not stop it.

    Emitted once when a database is upgraded in place, and once when a library
    caller falls back to an in-memory database.
    """
