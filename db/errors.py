"""Exceptions and warnings raised by the tuning database layer."""

from __future__ import annotations


class StoreError(Exception):
    """The tuning database cannot be used: bad URL, corrupt file, unwritable, locked.

    The message is one line meant for people; the command line prints it as is.
    """


class SchemaTooNew(StoreError):
    """The database was written by a newer kvsplit whose schema revision this code does not know."""

    def __init__(self, message: str, revision: str) -> None:
        super().__init__(message)
        self.revision = revision


class InvalidExportError(ValueError):
    """An export file failed validation; nothing was written.

    Attributes
    ----------
    problems : list of str
        One line per problem, each naming the record index and the field.
    """

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        shown = "; ".join(self.problems[:5])
        more = f" (and {len(self.problems) - 5} more)" if len(self.problems) > 5 else ""
        super().__init__(f"invalid tuning export: {shown}{more}")


class DbWarning(UserWarning):
    """Something about the tuning database that a caller should know but that did not stop it.

    Emitted once when a database is upgraded in place, and once when a library
    caller falls back to an in-memory database.
    """
