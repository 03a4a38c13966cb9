"""Exceptions and warnings raised by the tuning database layer."""

from __future__ import annotations

import re


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
    damage : list of kvsplit.db.decode.Damage
        Each names the table, the row id and the problem.
    """

    def __init__(self, url: str, damage: list) -> None:
        self.damage = list(damage)
        rows = "row does" if len(self.damage) == 1 else "rows do"
        super().__init__(f"{url}: {len(self.damage)} {rows} not parse ({listed(self.damage)}); {REPAIR_HINT}")


class SchemaDamaged(StoreError):
    """The schema version table is missing, empty, duplicated or holds garbage, or a table is missing."""


class InvalidExportError(ValueError):
    """An export file failed validation; nothing was written.

    Attributes
    ----------
    problems : list of str
        One line per problem, each naming the record index and the field;
        the first 100 problems only when there are more.
    total : int
        How many problems were found in all.
    invalid_records : int
        How many records have at least one.
    """

    def __init__(self, problems: list[str], *, total: int | None = None, invalid_records: int | None = None) -> None:
        self.problems = list(problems)
        self.total = len(self.problems) if total is None else total
        self.invalid_records = len(_records_named(self.problems)) if invalid_records is None else invalid_records
        super().__init__("invalid tuning export: " + "; ".join(self.report()))

    def report(self, shown: int = 5) -> list[str]:
        """The first ``shown`` problems, then one line counting the rest (and the records they are in)."""
        lines = self.problems[:shown]
        more = self.total - len(lines)
        if more > 0:
            records = self.invalid_records - len(_records_named(lines))
            lines.append(f"... and {_count(more, 'more problem')}"
                         + (f" in {_count(records, 'more record')}" if records > 0 else ""))
        return lines


_RECORD = re.compile(r"record (\d+)\b")


def _records_named(problems: list[str]) -> set[str]:
    return {match.group(1) for match in map(_RECORD.match, problems) if match}


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


class DbWarning(UserWarning):
    """Something about the tuning database that a caller should know but that did not stop it.

    Emitted once when a database is upgraded in place, and once when a library
    caller falls back to an in-memory database.
    """
