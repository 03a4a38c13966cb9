"""The generation counter: one row that every write of results bumps, in the write's own transaction.

A serving process that cached a table of winners reads this one value (a
primary-key lookup) to learn whether anything changed since; it never
parses the row (:func:`read` gives whatever is stored), so a damaged counter
can at worst cost one reload.  Used by :mod:`.store` only.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session

from .decode import GENERATION, raw_columns

_ROW_ID = 1
_BUMP = update(GENERATION).where(GENERATION.c.id == _ROW_ID).values(generation=GENERATION.c.generation + 1)
_CREATE = insert(GENERATION).values(id=_ROW_ID, generation=1)
_READ = select(*raw_columns(GENERATION)).where(GENERATION.c.id == _ROW_ID)


def bump(session: Session) -> None:
    """Add one to the counter, creating its row at 1 if there is none.

    Two first writers on PostgreSQL may both insert; the loser's transaction
    fails with an IntegrityError, which the store retries (it then updates).
    """
    if session.execute(_BUMP).rowcount == 0:
        session.execute(_CREATE)


def read(session: Session) -> Any:
    """The stored counter as it is (``None`` when there is no row yet)."""
    row = session.execute(_READ).mappings().one_or_none()
    return None if row is None else row["generation"]
