"""The tuning store: upserts and queries over one engine.

Every operation is one short transaction.  Rows become the pydantic models of
:mod:`.schemas` in :mod:`.rows` only, before the session closes; none leaves.
A row that does not parse is never an exception in a read: the store raises
:class:`DamagedRows` (``on_damage="raise"``, the command line) or skips it
with a :class:`DbWarning` that names each row once (``"warn"``, library
callers).
A store opened with ``fallback=True`` (library callers) never raises for a
database problem: it warns once and carries on with an in-memory database.
Such a store also watches its SQLite file (see :mod:`.watch`) before each
transaction: deleted, emptied or made immutable, it warns once and goes on in
memory; replaced by another file, it warns once and uses the new one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Literal, TypeVar

from sqlalchemy import Engine
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from . import repair as repairing
from .engine import (DEFAULT_TIMEOUT_S, WRITE_OPTION, create_db_engine, default_quarantine_path, describe_error,
                     engine_name, is_memory_url)
from .errors import REPAIR_HINT, DamagedRows, DbWarning, StoreError, listed
from .migrate import ensure_schema
from .rows import (BUILDS, DEVICES, RESULTS, Damage, bump_generation, device_is, find_for_write, key_conditions,
                   merge_records, prune_results, read_generation, read_records, scan, stale_build_ids, write_record)
from .schemas import (BuildStats, ChoiceKey, Config, DeviceInfo, DeviceStats, ExportFile, ImportRule, ImportSummary,
                      PruneResult, RepairResult, StoreStats, TuningKey, TuningRecord, tool_version)
from .targets import Target
from .watch import FileWatch

log = logging.getLogger("kvsplit.db")
T = TypeVar("T")
OnDamage = Literal["raise", "warn"]
MEMORY_URL = "sqlite://"
# A concurrent writer (PostgreSQL) may insert the same device, build or key
# between our SELECT and INSERT; the retry then finds its row and updates it.
_WRITE_ATTEMPTS = 5


_WRITE_OPTIONS = {WRITE_OPTION: True}


def _read_options(engine: Engine) -> dict[str, object]:
    # A read is several statements (results, then their candidates).  Under
    # PostgreSQL's default READ COMMITTED each sees a new snapshot, so a writer
    # committing in between could pair one writer's winner with another's
    # candidates.  SQLite transactions are snapshots already.
    return {"isolation_level": "REPEATABLE READ"} if engine.dialect.name == "postgresql" else {}


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _watch(target: Target | None) -> FileWatch | None:
    if target is None or target.path is None:
        return None
    try:
        return FileWatch(target.path)
    except OSError:  # gone already: the first transaction fails and falls back to memory
        return None


def memory_engine() -> Engine:
    """A fresh in-memory SQLite engine with the schema at head."""
    engine = create_db_engine(MEMORY_URL)
    ensure_schema(engine)
    return engine


class Store:
    """Tuning results in a database reached through one SQLAlchemy engine.

    Use :func:`kvsplit.db.open_store` or :func:`kvsplit.db.open_store_for_library`
    rather than this constructor: they create the schema or upgrade it.

    Parameters
    ----------
    engine : sqlalchemy.Engine
        Engine whose database is already at the head revision.
    target : Target, optional
        The database the engine was created for (its SQLite file is watched
        with ``fallback``, and reopened when replaced).
    fallback : bool
        If true, a database error warns once (:class:`DbWarning`) and the store
        continues in memory; if false it raises :class:`StoreError`.
    timeout_s : float
        Busy timeout the engine was created with, for messages.
    on_damage : {"raise", "warn"}, optional
        Rows that do not parse: raise :class:`DamagedRows`, or skip them with
        one :class:`DbWarning` naming each row once.  Default ``"warn"`` with
        ``fallback``, else ``"raise"``.
    config_type : type of Config
        What stored configs become: plain :class:`Config` data, or a subclass
        that checks the kernel layer's vocabulary (``kvsplit.config.KernelConfig``),
        so that a config it refuses is a row that does not parse.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        target: Target | None = None,
        fallback: bool = False,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        on_damage: OnDamage | None = None,
        config_type: type[Config] = Config,
    ):
        self._engine = engine
        self._context = {"config": config_type}
        self._target = target
        self._watch = _watch(target) if fallback else None
        #: How many times a replaced file was reopened: tables read before are from another file.
        self.reopened = 0
        self._fallback = fallback
        self._timeout_s = timeout_s
        self._on_damage: OnDamage = on_damage or ("warn" if fallback else "raise")
        self._warned: set[tuple[str, object]] = set()
        self._swap_lock = threading.Lock()
        self._memory_lock = threading.RLock()

    # -- plumbing -----------------------------------------------------------

    @property
    def url(self) -> str:
        """The database as given (a URL's password masked), for messages."""
        return engine_name(self._engine)

    @property
    def in_memory(self) -> bool:
        """Whether results live only in this process (in-memory SQLite)."""
        return is_memory_url(self._engine.url)

    def close(self) -> None:
        """Release pooled connections (an in-memory store loses its data)."""
        self._engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def after_fork(self) -> None:
        """In a forked child: drop the parent's pooled connections without closing them."""
        self._engine.dispose(close=False)

    def transaction(self, work: Callable[[Session], T], *, write: bool, bump: bool = False) -> T:
        """Run ``work(session)`` in one transaction, as every operation of the store does.

        Database errors become :class:`StoreError` (or, with ``fallback``, a
        warning and memory); a write that meets a unique-key race is retried.
        ``bump`` also advances the generation counter in the same transaction
        (a write of results).
        """
        attempt = 0
        while True:
            if self._watch is not None:
                self._check_file(self._watch)
            engine = self._engine
            bound = engine.execution_options(**(_WRITE_OPTIONS if write else _read_options(engine)))
            # One in-memory connection serves every thread: transactions must not interleave.
            guard = self._memory_lock if self.in_memory else contextlib.nullcontext()
            try:
                session = Session(bound, expire_on_commit=False, info={"context": self._context})
                with guard, session, session.begin():
                    value = work(session)
                    if bump:
                        bump_generation(session)
                    return value
            except IntegrityError as exc:
                attempt += 1
                if write and attempt < _WRITE_ATTEMPTS:
                    log.debug("write conflict, retrying: %s", exc.orig)
                    continue
                self._failed(exc, engine)
            except SQLAlchemyError as exc:
                self._failed(exc, engine)
            except StoreError:
                raise
            except Exception as exc:
                # A library caller's merge must go on whatever the database holds.
                if not self._fallback:
                    raise
                self._failed(exc, engine)

    def _failed(self, exc: Exception, engine: Engine) -> None:
        message = describe_error(exc, engine_name(engine), self._timeout_s)
        if not self._fallback or is_memory_url(engine.url):
            raise StoreError(message) from exc
        with self._swap_lock:
            if self._engine is not engine:
                return  # another thread already moved to memory; just retry there
            warnings.warn(
                f"kvsplit tuning database unusable, continuing in memory: {message}",
                DbWarning,
                stacklevel=4,
            )
            self._engine = memory_engine()
            self._watch = None
        engine.dispose()

    def _check_file(self, watch: FileWatch) -> None:
        """Before a transaction of a serving store: is the file still the one opened? If not,
        one warning, and the new file (when one replaced it and it opens) or memory."""
        change = watch.changed()
        if change is None:
            return
        with self._swap_lock:
            if self._watch is not watch:
                return  # another thread dealt with it
            old = self._engine
            engine, problem = self._reopen() if change.reopen else (None, None)
            if engine is not None:
                self._watch = _watch(self._target)
                self.reopened += 1
                outcome = "reading and writing the new file from now on"
            else:
                engine, self._watch = memory_engine(), None
                unusable = f"; the new file cannot be used ({problem})" if problem else ""
                outcome = f"{unusable}; continuing in memory (what is profiled from now on stays in this process)"
            warnings.warn(f"kvsplit tuning database {engine_name(old)} {change.what}"
                          f"{outcome if outcome.startswith(';') else ': ' + outcome}", DbWarning, stacklevel=5)
            self._engine = engine
        # An immutable file's connections are dropped, never closed: closing writes
        # to its mapped shared-memory index, which is what kills the process.
        old.dispose(close="immutable" not in change.what)

    def _reopen(self) -> tuple[Engine | None, str | None]:
        try:
            engine = create_db_engine(self._target, timeout_s=self._timeout_s, pooled=False)
        except StoreError as exc:
            return None, str(exc)
        try:
            ensure_schema(engine)
        except (StoreError, SQLAlchemyError, OSError, ValueError) as exc:
            engine.dispose()
            return None, str(exc) if isinstance(exc, StoreError) else describe_error(exc, self.url, self._timeout_s)
        return engine, None

    def _read(self, work: Callable[[Session], tuple[T, list[Damage]]]) -> T:
        value, damage = self.transaction(work, write=False)
        self._report(damage)
        return value

    def _report(self, damage: list[Damage]) -> None:
        if not damage:
            return
        if self._on_damage == "raise":
            raise DamagedRows(self.url, damage)
        new = [d for d in damage if d.where not in self._warned]
        if new:
            self._warned.update(d.where for d in new)
            rows = "row that does" if len(new) == 1 else "rows that do"
            warnings.warn(
                f"kvsplit tuning database {self.url}: skipped {len(new)} {rows} not parse "
                f"({listed(new)}); {REPAIR_HINT}",
                DbWarning,
                stacklevel=3,
            )

    # -- writes -------------------------------------------------------------

    def upsert(self, record: TuningRecord) -> None:
        """Insert ``record``, or replace the result and candidates stored for its key.

        ``updated_at`` becomes now; ``created_at`` is kept from the stored
        result (or the record, or now).
        """
        self.upsert_many([record])

    def upsert_many(self, records: Iterable[TuningRecord]) -> None:
        """:meth:`upsert` each record, all in one transaction."""
        records = list(records)

        def work(session: Session) -> None:
            now = _now()
            for record in records:
                write_record(session, record, find_for_write(session, record.key), now)

        self.transaction(work, write=True, bump=True)

    # -- reads --------------------------------------------------------------

    def get(self, key: TuningKey) -> TuningRecord | None:
        """The record stored for ``key``, or ``None``."""

        def work(session: Session) -> tuple[TuningRecord | None, list[Damage]]:
            found = read_records(session, key_conditions(key))
            return (found.records[0].record if found.records else None), found.damage

        return self._read(work)

    def load_choices(self, device: DeviceInfo, build_hash: str) -> dict[ChoiceKey, Config]:
        """Every winner for one device and build, in one query.

        Returns
        -------
        dict
            ``(head_dim, partial_dtype, out_dtype, stats_format, num_splits, rows)``
            -> winning config (of ``config_type``).  Rows that do not parse (a
            config that ``config_type`` refuses among them) are left out, as
            ``on_damage`` says.  Candidates are not read.
        """
        where = [*device_is(device), BUILDS.c.build_hash == build_hash]

        def work(session: Session) -> tuple[dict[ChoiceKey, Config], list[Damage]]:
            found = read_records(session, where, candidates=False)
            return {s.record.key.choice_key: s.record.winner for s in found.records}, found.damage

        return self._read(work)

    def query(
        self,
        *,
        device: DeviceInfo | str | None = None,
        build_hash: str | None = None,
        head_dim: int | None = None,
        dtype: str | None = None,
        out_dtype: str | None = None,
        stats_format: str | None = None,
        num_splits: int | Iterable[int] | None = None,
        rows: int | Iterable[int] | None = None,
    ) -> list[TuningRecord]:
        """Records matching every filter given, in key order.

        ``device`` is a :class:`DeviceInfo` (exact) or a string matched
        case-insensitively against part of the device name; ``dtype`` filters
        the partials' dtype; ``num_splits`` and ``rows`` may be several values
        (any of them matches).
        """
        text_filters = (build_hash, dtype, out_dtype, stats_format)  # a device is device_is()'s
        if any(value is not None and "\x00" in value for value in text_filters):
            return []  # no stored text holds a NUL (see schemas.Text); PostgreSQL would refuse the parameter
        r = RESULTS.c
        conditions = [
            col.in_(list(value)) if isinstance(value, Iterable) and not isinstance(value, str) else col == value
            for col, value in (
                (BUILDS.c.build_hash, build_hash),
                (r.head_dim, head_dim),
                (r.partial_dtype, dtype),
                (r.out_dtype, out_dtype),
                (r.stats_format, stats_format),
                (r.num_splits, num_splits),
                (r.rows, rows),
            )
            if value is not None
        ]
        if device is not None:
            conditions.extend(device_is(device))

        order = (DEVICES.c.name, DEVICES.c.sm_count, BUILDS.c.build_hash, r.head_dim, r.partial_dtype, r.out_dtype,
                 r.stats_format, r.num_splits, r.rows)

        def work(session: Session) -> tuple[list[TuningRecord], list[Damage]]:
            found = read_records(session, conditions, order_by=order)
            return [stored.record for stored in found.records], found.damage

        return self._read(work)

    def stats(self, current_build: str | Collection[str] | None = None) -> StoreStats:
        """Keys per device, mean speed-up of the winner over kv_split=1, times, stale builds.

        A build is stale if its hash is not ``current_build`` (one hash or several, e.g.
        the installed CUDA and CPU builds); when that is ``None``, every build but the
        one with the most recently updated result.
        """

        def work(session: Session) -> tuple[StoreStats, list[Damage]]:
            everything = scan(session)
            builds = everything.builds
            stale = {builds[i].build_hash for i in stale_build_ids(session, current_build) if i in builds}
            records = [stored.record for stored in everything.records]
            named = (current_build if current_build is None or isinstance(current_build, str)
                     else ",".join(sorted(current_build)))
            per_device: dict[DeviceInfo, list[TuningRecord]] = defaultdict(list)
            per_build: dict[str, list[TuningRecord]] = defaultdict(list)
            for record in records:
                per_device[record.key.device].append(record)
                per_build[record.key.build_hash].append(record)
            devices = []
            for device, recs in sorted(per_device.items(), key=lambda item: item[0].label):
                speedups = [s for s in (r.speedup for r in recs) if s is not None]
                devices.append(DeviceStats(
                    device=device, keys=len(recs), mean_speedup=sum(speedups) / len(speedups) if speedups else None,
                    max_speedup=max(speedups, default=None), oldest=_span(recs)[0], newest=_span(recs)[1]))
            versions = sorted({b.build_hash: b.library_version for b in builds.values()}.items())
            return StoreStats(
                url=self.url, keys=len(records), devices=devices, current_build=named,
                builds=[BuildStats(build_hash=h, library_version=v, keys=len(per_build[h]),
                                   newest=_span(per_build[h])[1], stale=h in stale) for h, v in versions],
                oldest=_span(records)[0], newest=_span(records)[1]), everything.damage

        return self._read(work)

    def generation(self) -> object:
        """The generation counter as stored (``None`` before the first write).

        It changes with every write of results (upsert, import, repair,
        prune), here or in any other process: one primary-key lookup tells a
        process whether its cached winners are still current.
        """
        return self.transaction(read_generation, write=False)

    # -- damage -------------------------------------------------------------

    def damage(self) -> list[Damage]:
        """Every row that does not parse, and every row that cannot stand without one (never raises for them)."""
        return self.transaction(lambda session: scan(session).damage, write=False)

    def check(self) -> None:
        """Raise :class:`DamagedRows` if any row does not parse, whatever ``on_damage`` says."""
        damage = self.damage()
        if damage:
            raise DamagedRows(self.url, damage)

    def repair(self, quarantine: Path | None = None, *, dry_run: bool = False) -> RepairResult:
        """Move every row that does not parse, and the rows that depend on it, to a quarantine file.

        One transaction: the rows are written to ``quarantine`` (JSON lines,
        appended; default beside an SQLite file, else ``quarantine.jsonl`` in
        the user cache directory) and then deleted; if the file cannot be
        written nothing is deleted.  Every other row stays as it was.

        Raises
        ------
        OSError
            The quarantine file cannot be written (nothing was deleted).
        """

        def work(session: Session) -> RepairResult:
            default = default_quarantine_path(self._target.path if self._target is not None else None)
            return repairing.quarantine(session, self.url, default, quarantine, dry_run=dry_run)

        return self.transaction(work, write=not dry_run, bump=not dry_run)

    # -- pruning ------------------------------------------------------------

    def prune(
        self,
        *,
        stale_builds: bool = False,
        current_build: str | Collection[str] | None = None,
        other_devices_than: DeviceInfo | str | None = None,
        older_than: timedelta | None = None,
        dry_run: bool = False,
    ) -> PruneResult:
        """Delete results matching any criterion given; devices and builds left empty go too.

        Parameters
        ----------
        stale_builds : bool
            Results of stale builds (see :meth:`stats` for ``current_build``, which
            may here also be several hashes, all kept).
        other_devices_than : DeviceInfo or str, optional
            Results of every device but this one (a string matches part of the
            name, and must match at least one device).
        older_than : timedelta, optional
            Results last updated longer ago than this.
        dry_run : bool
            Only report what would be deleted.

        Raises
        ------
        ValueError
            ``other_devices_than`` is a string that matches no device.
        """
        if not (stale_builds or other_devices_than is not None or older_than is not None):
            return PruneResult(keys=[], dry_run=dry_run)
        cutoff = _now() - older_than if older_than is not None else None

        def work(session: Session) -> tuple[PruneResult, list[Damage]]:
            keys, damage = prune_results(
                session,
                stale_builds=stale_builds,
                current_build=current_build,
                other_devices_than=other_devices_than,
                cutoff=cutoff,
                dry_run=dry_run,
            )
            if damage and self._on_damage == "raise":
                raise DamagedRows(self.url, damage)  # before the transaction commits: nothing deleted
            return PruneResult(keys=keys, dry_run=dry_run), damage

        value, damage = self.transaction(work, write=not dry_run, bump=not dry_run)
        self._report(damage)
        return value

    # -- exchange -----------------------------------------------------------

    def export_records(self, **filters: object) -> ExportFile:
        """An :class:`ExportFile` of the records matching ``filters`` (as :meth:`query`), stamped now."""
        return ExportFile(exported_at=_now(), tool_version=tool_version(), records=self.query(**filters))

    def import_records(
        self,
        source: ExportFile | Iterable[TuningRecord],
        *,
        rule: ImportRule = "newer",
        dry_run: bool = False,
    ) -> ImportSummary:
        """Merge records into the store, all or nothing, in one transaction.

        Parameters
        ----------
        source : ExportFile or iterable of TuningRecord
            An export file is read and validated above the store
            (``kvsplit.export.parse_export``); records are validated again here
            (against ``config_type`` too), and two of one key are refused.
        rule : {"newer", "replace", "keep"}
            For a key already stored: ``"newer"`` replaces it only if the
            incoming ``updated_at`` is strictly later (a tie, or an incoming
            record without ``updated_at``, keeps the stored one);
            ``"replace"`` always replaces; ``"keep"`` never does.  Keys not
            yet stored are always inserted.  Timestamps are kept as imported.
        dry_run : bool
            Count what would happen; write nothing.

        Raises
        ------
        ValueError
            A record failed validation (``pydantic.ValidationError``), or
            two have one key; nothing was written.
        """
        # A record changed with model_copy(update=...) was never validated: all are, again.
        records = [TuningRecord.model_validate(r.model_dump(), context=self._context)
                   for r in (source.records if isinstance(source, ExportFile) else source)]
        if len({r.key for r in records}) != len(records):
            raise ValueError("two records of one tuning key")

        def work(session: Session) -> ImportSummary:
            counts = merge_records(session, records, rule=rule, dry_run=dry_run, now=_now())
            return ImportSummary(rule=rule, dry_run=dry_run, **counts)

        return self.transaction(work, write=not dry_run, bump=not dry_run)


def _span(records: list[TuningRecord]) -> tuple[datetime | None, datetime | None]:
    times = [r.updated_at for r in records if r.updated_at is not None]
    return (min(times), max(times)) if times else (None, None)

