"""Claims: workers on any number of hosts share one grid through the database, with no coordinator.

Before it tunes a key a worker claims it: one transaction finds a claimable
key of its grid, locks that key's claim row (``SELECT ... FOR UPDATE SKIP
LOCKED`` on PostgreSQL, so that two workers never wait on each other; on
SQLite every write transaction is ``BEGIN IMMEDIATE``, which serializes
them) and marks it claimed with a lease.  The worker renews the lease with
heartbeats while it tunes; the result and the end of the claim are written in
one transaction, so a key is either claimable or done, never lost in
between.  A lease that runs out (worker killed, host lost) makes the key
claimable again.  All times are the database server's clock, so hosts with
skewed clocks agree.  Which keys are claimable is :func:`.progress.standing`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import Text, func, insert, literal_column, select, type_coerce, update
from sqlalchemy.orm import Session

from .decode import CLAIMS, Unparsable, claim_row, parse_timestamp, raw_columns
from .models import CanonicalJSON, KernelBuild
from .progress import CLAIMABLE, Standing, standing, summarize
from .reads import read_records
from .rows import device_is, find_for_write, write_record
from .schemas import ClaimInfo, Progress, TuningKey, TuningRecord
from .store import Store

_CHUNK = 500  # keys per IN list, well under every backend's parameter limit
_CANONICAL = CanonicalJSON()
_RAW = raw_columns(CLAIMS)
_KEY_TEXT = type_coerce(CLAIMS.c.key, Text)  # compared as the stored text, not re-encoded
_NOW_PG = func.clock_timestamp()
_NOW_SQLITE = func.strftime("%Y-%m-%d %H:%M:%f", literal_column("'now'"))


def key_text(key: TuningKey) -> str:
    """The claims table's ``key`` for ``key``: its canonical JSON, as the column stores it."""
    return _CANONICAL.process_bind_param(key.model_dump(mode="json"), None)


def database_now(session: Session) -> datetime:
    """The database server's clock, aware UTC (this host's clock for backends without one we read)."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        value = session.execute(select(_NOW_PG)).scalar_one()
        return value.astimezone(timezone.utc)
    if dialect == "sqlite":
        value = parse_timestamp(session.execute(select(_NOW_SQLITE)).scalar_one())
        if value is not None:
            return value
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
    """What :meth:`Claims.claim_next` found: a claim, or nothing, and how the grid stands.

    ``busy`` counts the keys that others hold (live leases, and claimable keys
    that another worker was locking at that very moment): when no claim came
    back and ``busy`` is 0, the grid is finished for this worker.
    """

    claim: Claim | None
    standings: dict[str, int] = field(default_factory=dict)
    busy: int = 0


def _claim_rows(session: Session, texts: Sequence[str]) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for start in range(0, len(texts), _CHUNK):
        chunk = texts[start:start + _CHUNK]
        for raw in session.execute(select(*_RAW).where(_KEY_TEXT.in_(chunk))).mappings():
            rows[raw["key"]] = dict(raw)
    return rows


def _decoded(raw: dict[str, Any] | None) -> ClaimInfo | None:
    """The claim, or ``None`` for no row or a row that does not parse (claimable: it is overwritten)."""
    if raw is None:
        return None
    try:
        return claim_row(raw)
    except Unparsable:
        return None


def _register(session: Session, texts: Sequence[str]) -> None:
    """Insert an open claim row for each key (canonical text) that has none; a race with another
    worker is fine."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as dialect_insert
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as dialect_insert
    else:
        dialect_insert = None
    # One order for every worker: concurrent inserts of the same keys then wait, never deadlock.
    missing = sorted(texts)
    if dialect_insert is None:
        present = _claim_rows(session, missing)
        missing = [t for t in missing if t not in present]
    for start in range(0, len(missing), _CHUNK):
        values = [{"key": _CANONICAL.process_result_value(t, None), "state": "open", "attempts": 0}
                  for t in missing[start:start + _CHUNK]]
        if dialect_insert is None:  # a unique-key race raises IntegrityError: the store retries
            session.execute(insert(CLAIMS), values)
        else:
            session.execute(dialect_insert(CLAIMS).on_conflict_do_nothing(index_elements=["key"]), values)


def _stored(session: Session, keys: Iterable[TuningKey]) -> set[TuningKey]:
    """The keys among ``keys`` that have a result that parses (one query per device and build)."""
    keys = set(keys)
    found: set[TuningKey] = set()
    for device, build_hash in {(k.device, k.build_hash) for k in keys}:
        read = read_records(session, [*device_is(device), KernelBuild.build_hash == build_hash],
                            candidates=False)
        found.update(s.record.key for s in read.records if s.record.key in keys)
    return found


def _attempts(raw: dict[str, Any]) -> int:
    value = raw.get("attempts")
    return value if type(value) is int and value >= 0 else 0


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
        """Claim the first claimable key of ``keys`` for ``owner``, for ``lease_s`` seconds.

        ``run_started`` and ``force`` as in :func:`.progress.standing`.
        """
        texts = {key_text(k): k for k in keys}

        def work(session: Session) -> Step:
            now = database_now(session)
            rows = _claim_rows(session, list(texts))
            missing = [t for t in texts if t not in rows]
            if missing:  # repaired away, or a grid registered by nobody yet
                _register(session, missing)
                rows.update(_claim_rows(session, missing))
            stored = _stored(session, keys)
            where: dict[str, Standing] = {
                t: standing(_decoded(rows.get(t)), k in stored, now, run_started=run_started, force=force)
                for t, k in texts.items()}
            counts = {s: list(where.values()).count(s) for s in ("done", "claimed", "failed", "expired", "left")}
            skipped_locked = 0
            for text, key in texts.items():
                if where[text] not in CLAIMABLE or text not in rows:
                    continue
                row_id = rows[text]["id"]
                locked = session.execute(select(*_RAW).where(CLAIMS.c.id == row_id)
                                         .with_for_update(skip_locked=True)).mappings().one_or_none()
                if locked is None:  # another worker is claiming it in this very moment
                    skipped_locked += 1
                    continue
                before = _decoded(dict(locked))
                # Read again under the lock: on PostgreSQL (read committed) each statement sees
                # the latest commits, so a worker that finished this key after `stored` was read
                # left a done row whose result the stale set would miss ("done but since
                # pruned": claimable), and the key would be tuned twice.
                now_stored = key in _stored(session, [key])
                if standing(before, now_stored, now, run_started=run_started, force=force) not in CLAIMABLE:
                    skipped_locked += 1  # changed since we looked: somebody else's now
                    continue
                attempt = _attempts(dict(locked)) + 1
                session.execute(update(CLAIMS).where(CLAIMS.c.id == row_id).values(
                    state="claimed", owner=owner, attempts=attempt, claimed_at=now, heartbeat_at=now,
                    expires_at=now + timedelta(seconds=lease_s), error=None))
                taken = before.owner if before is not None and before.state == "claimed" else None
                return Step(Claim(row_id, key, owner, attempt, now, taken), counts,
                            counts["claimed"] + skipped_locked)
            return Step(None, counts, counts["claimed"] + skipped_locked)

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
        """End ``claim``: store ``record`` and mark the key done, in one transaction; or mark it failed.

        A stored result marks the key done even if the lease was lost meanwhile
        (the result is there); a failure is recorded only while the claim is
        still ours.
        """

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
            session.execute(update(CLAIMS).where(*condition).values(heartbeat_at=now, expires_at=None,
                                                                    **values))

        self._store.transaction(work, write=True, bump=record is not None)

    def progress(self, keys: Sequence[TuningKey] | None = None) -> Progress:
        """How far ``keys`` are; without ``keys``, every key ever registered (rows that do not parse left out)."""

        def work(session: Session) -> Progress:
            now = database_now(session)
            if keys is None:
                raws = [dict(m) for m in session.execute(select(*_RAW).order_by(CLAIMS.c.id)).mappings()]
                claims = {c.key: c for c in map(_decoded, raws) if c is not None}
                wanted = list(claims)
            else:
                rows = _claim_rows(session, [key_text(k) for k in keys])
                claims = {}
                for k in keys:
                    decoded = _decoded(rows.get(key_text(k)))
                    if decoded is not None:
                        claims[k] = decoded
                wanted = list(keys)
            return summarize(self.url, now, wanted, claims, _stored(session, wanted))

        return self._store.transaction(work, write=False)
