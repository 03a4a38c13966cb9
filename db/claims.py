"""Claims: workers on any number of hosts share one grid through the database, with no coordinator.

A claim locks its row (``FOR UPDATE SKIP LOCKED`` on PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite);
the result and the end of the claim are one transaction; times are the database server's clock."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

from sqlalchemy import Text, func, insert, literal_column, select, type_coerce, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from .models import BUILDS, CLAIMS, canonical_json
from .rows import Reader, chunks, device_is, find_for_write, raw_columns, read, stored_time, write_record
from .schemas import ClaimInfo, TuningKey, TuningRecord
from .store import Store

#: ``done``: result stored; ``claimed``: live lease; ``failed``: final for now;
#: ``expired``: lease ran out (claimable); ``left``: claimable.
Standing = Literal["done", "claimed", "failed", "expired", "left"]
CLAIMABLE: tuple[Standing, ...] = ("left", "expired")
Surveyed = tuple[TuningKey, ClaimInfo | None, Standing]


def standing(claim: ClaimInfo | None, stored: bool, now: datetime, *,
             run_started: datetime | None = None, force: bool = False) -> Standing:
    """Where one key stands, given its claim (``None``: none, or one that does not parse), whether a result is
    stored, and the database's clock.  A failure before ``run_started`` (when the asking worker started) is tried
    again, one since is final; with ``force`` a key is done only if it was finished since ``run_started``."""
    if claim is not None and claim.state == "claimed":
        return "claimed" if claim.expires_at is not None and claim.expires_at > now else "expired"
    finished_in_run = claim is not None and claim.state in ("done", "failed") and (
        run_started is None or (claim.heartbeat_at is not None and claim.heartbeat_at >= run_started))
    if force and run_started is not None:
        return claim.state if finished_in_run else "left"  # type: ignore[union-attr, return-value]
    if stored:
        return "done"
    if finished_in_run and claim.state == "failed":  # type: ignore[union-attr]
        return "failed"
    return "left"  # open, never claimed, damaged, an old failure, or done but since pruned


_RAW = raw_columns(CLAIMS)
_KEY_TEXT = type_coerce(CLAIMS.c.key, Text)  # compared as the stored text, not re-encoded


def key_text(key: TuningKey) -> str:
    """The claims table's ``key`` for ``key``: its canonical JSON, as the column stores it."""
    return canonical_json(key.model_dump(mode="json"))


def database_now(session: Session) -> datetime:
    """The database server's clock, aware UTC (this host's for other backends)."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        return session.execute(select(func.clock_timestamp())).scalar_one().astimezone(timezone.utc)
    if dialect == "sqlite":
        now = func.strftime("%Y-%m-%d %H:%M:%f", literal_column("'now'"))
        return stored_time(session.execute(select(now)).scalar_one()) or datetime.now(timezone.utc)
    return datetime.now(timezone.utc)


@dataclass(frozen=True)
class Claim:
    """A key this worker holds: the claim row's id, and from whom it was taken over, if anyone."""

    id: int
    key: TuningKey
    owner: str
    attempt: int
    claimed_at: datetime
    taken_from: str | None = None


@dataclass(frozen=True)
class Step:
    """What :meth:`Claims.claim_next` found: a claim or none, how the grid stands, and ``busy``: the keys others
    hold (live leases, and keys another worker was locking that very moment).  Neither: finished for this worker."""

    claim: Claim | None
    standings: dict[str, int] = field(default_factory=dict)
    busy: int = 0


def _claim_rows(session: Session, texts: Sequence[str]) -> dict[str, dict[str, Any]]:
    return {raw["key"]: dict(raw) for chunk in chunks(texts)
            for raw in session.execute(select(*_RAW).where(_KEY_TEXT.in_(chunk))).mappings()}


def _register(session: Session, texts: Sequence[str]) -> None:
    # An open claim row for each key (canonical text) that has none; a race with another worker is fine.
    dialect_insert = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}.get(session.get_bind().dialect.name)
    # One order for every worker: concurrent inserts of the same keys then wait, never deadlock.
    missing = sorted(texts)
    if dialect_insert is None:  # a unique-key race raises IntegrityError: the store retries
        present = _claim_rows(session, missing)
        missing = [t for t in missing if t not in present]
        statement = insert(CLAIMS)
    else:
        statement = dialect_insert(CLAIMS).on_conflict_do_nothing(index_elements=["key"])
    if missing:  # one executemany: each row its own parameters, so no IN-list limit applies
        session.execute(statement, [{"key": json.loads(t), "state": "open", "attempts": 0} for t in missing])


def _stored(session: Session, keys: Iterable[TuningKey]) -> set[TuningKey]:
    """The keys among ``keys`` that have a result that parses (one read per device and build)."""
    keys = set(keys)
    found: set[TuningKey] = set()
    for device, build_hash in {(k.device, k.build_hash) for k in keys}:
        records = read(session, [*device_is(device), BUILDS.c.build_hash == build_hash], candidates=False).records
        found.update(r.key for r in records.values() if r.key in keys)
    return found


class Claims:
    """The claims of one database, through a :class:`~kvsplit.db.Store` (its errors, its retries)."""

    def __init__(self, store: Store):
        self._store = store

    @property
    def url(self) -> str:
        return self._store.url

    def now(self) -> datetime:
        """The database server's clock."""
        return self._store.transaction(database_now, write=False)

    def register(self, keys: Sequence[TuningKey]) -> None:
        """Make every key of a grid known (an open claim row), so that progress counts what is left."""
        texts = [key_text(k) for k in keys]
        self._store.transaction(lambda session: _register(session, texts), write=True)

    def claim_next(self, keys: Sequence[TuningKey], owner: str, lease_s: float, *,
                   run_started: datetime, force: bool = False) -> Step:
        """Claim the first claimable key of ``keys`` for ``owner``, for ``lease_s`` seconds
        (``run_started`` and ``force`` as in :func:`standing`)."""
        texts = {key_text(k): k for k in keys}

        def work(session: Session) -> Step:
            now = database_now(session)
            rows = _claim_rows(session, list(texts))
            if missing := [t for t in texts if t not in rows]:  # repaired away, or a grid registered by nobody yet
                _register(session, missing)
                rows.update(_claim_rows(session, missing))
            stored = _stored(session, keys)
            where: dict[str, Standing] = {
                t: standing(Reader().claim(rows.get(t)), k in stored, now, run_started=run_started, force=force)
                for t, k in texts.items()}
            counts = {s: list(where.values()).count(s) for s in ("done", "claimed", "failed", "expired", "left")}
            busy = counts["claimed"]
            for text, key in texts.items():
                if where[text] not in CLAIMABLE or text not in rows:
                    continue
                row_id = rows[text]["id"]
                locked = session.execute(select(*_RAW).where(CLAIMS.c.id == row_id)
                                         .with_for_update(skip_locked=True)).mappings().one_or_none()
                before = None if locked is None else Reader().claim(dict(locked))
                # Read again under the lock: on PostgreSQL (read committed) a worker that finished
                # this key after `stored` was read left a done row whose result the stale set would
                # miss ("done but since pruned": claimable), and the key would be tuned twice.
                if locked is None or standing(before, key in _stored(session, [key]), now, run_started=run_started,
                                              force=force) not in CLAIMABLE:
                    busy += 1  # another worker is claiming it this very moment, or took it since we looked
                    continue
                stored_attempts = locked["attempts"]  # a damaged count starts again
                attempt = (stored_attempts if type(stored_attempts) is int and stored_attempts >= 0 else 0) + 1
                session.execute(update(CLAIMS).where(CLAIMS.c.id == row_id).values(
                    state="claimed", owner=owner, attempts=attempt, claimed_at=now, heartbeat_at=now,
                    expires_at=now + timedelta(seconds=lease_s), error=None))
                taken = before.owner if before is not None and before.state == "claimed" else None
                return Step(Claim(row_id, key, owner, attempt, now, taken), counts, busy)
            return Step(None, counts, busy)

        return self._store.transaction(work, write=True)

    def renew(self, claim: Claim, lease_s: float) -> bool:
        """Extend the lease by ``lease_s`` seconds from now; ``False`` if the claim is no longer ours."""

        def work(session: Session) -> bool:
            now = database_now(session)
            done = session.execute(update(CLAIMS).where(
                CLAIMS.c.id == claim.id, CLAIMS.c.owner == claim.owner, CLAIMS.c.state == "claimed",
                CLAIMS.c.attempts == claim.attempt,  # owner and attempt name this one lease
            ).values(heartbeat_at=now, expires_at=now + timedelta(seconds=lease_s)))
            return done.rowcount == 1

        return self._store.transaction(work, write=True)

    def finish(self, claim: Claim, record: TuningRecord | None = None, error: str | None = None) -> None:
        """End ``claim``: store ``record`` and mark the key done in one transaction (even if the lease
        was lost meanwhile: the result is there), or mark it failed (only while the claim is ours)."""

        def work(session: Session) -> None:
            now = database_now(session)
            if record is not None:
                write_record(session, record, find_for_write(session, record.key), now)
                condition = [CLAIMS.c.id == claim.id]
                values = {"state": "done", "owner": claim.owner, "error": None}
            else:
                condition = [CLAIMS.c.id == claim.id, CLAIMS.c.owner == claim.owner,
                             CLAIMS.c.state == "claimed", CLAIMS.c.attempts == claim.attempt]
                # Escaped, not refused: a failure's text must be stored on every backend.
                values = {"state": "failed", "error": (error or "failed").replace("\x00", "\\x00")[:2000]}
            session.execute(update(CLAIMS).where(*condition).values(heartbeat_at=now, expires_at=None, **values))

        self._store.transaction(work, write=True, bump=record is not None)

    def survey(self, keys: Sequence[TuningKey] | None = None) -> tuple[datetime, list[Surveyed]]:
        """From one read: the database's clock, and each of ``keys`` with its claim (``None``: none, or one that does
        not parse) and :func:`standing`; without ``keys``, every key registered (rows that do not parse left out)."""

        def work(session: Session) -> tuple[datetime, list[Surveyed]]:
            now = database_now(session)
            if keys is None:
                rows = [dict(m) for m in session.execute(select(*_RAW).order_by(CLAIMS.c.id)).mappings()]
            else:
                rows = list(_claim_rows(session, [key_text(k) for k in keys]).values())
            claims = {c.key: c for c in map(Reader().claim, rows) if c is not None}
            wanted = list(claims) if keys is None else list(keys)
            stored = _stored(session, wanted)
            return now, [(key, claims.get(key), standing(claims.get(key), key in stored, now)) for key in wanted]

        return self._store.transaction(work, write=False)
