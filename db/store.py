"""The tuning store: a database opened three ways, and its operations, each one short transaction."""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from datetime import datetime, timedelta, timezone
from typing import Any, Literal, TypeVar

from sqlalchemy import Engine, delete, false, insert, or_, select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from .engine import (DEFAULT_TIMEOUT_S, FileWatch, Target, create_db_engine, describe_error, engine_name,
                     is_memory_url, parse_target, writing)
from .migrate import ensure_schema, head_revision, restore_schema
from .models import BUILDS, CANDIDATES, DEVICES, GENERATION, RESULTS, TABLES
from .rows import (BUMP_GENERATION, READ_GENERATION, Damage, chunks, device_is, find_for_write, read,
                   stale_build_ids, write_record)
from .schemas import (CHOICE_FIELDS, ChoiceKey, Config, DamagedRows, DbWarning, DeviceInfo, ImportRule, ImportSummary,
                      KernelBuildInfo, PruneResult, RepairResult, StoreError, TuningKey, TuningRecord)

log = logging.getLogger("kvsplit.db")
T = TypeVar("T")
OnDamage = Literal["raise", "warn"]
Inventory = tuple[list[TuningRecord], list[KernelBuildInfo], set[str]]
# Another writer (PostgreSQL) may insert our device, build or key between our SELECT and INSERT: the retry updates it.
_WRITE_ATTEMPTS = 5


def _watch(target: Target | None) -> FileWatch | None:
    if target is not None and target.path is not None:
        with contextlib.suppress(OSError):  # gone already: the first transaction fails and falls back to memory
            return FileWatch(target.path)
    return None


def memory_engine() -> Engine:
    """A fresh in-memory SQLite engine with the schema at head."""
    engine = create_db_engine("sqlite://")
    ensure_schema(engine)
    return engine


class Store(contextlib.AbstractContextManager):
    """Tuning results in a database at the head revision, opened by :func:`open_store` and its siblings.
    ``config_type``: what stored configs become (``KernelConfig`` above the store); a config it refuses is a row
    that does not parse.  Such rows raise :class:`DamagedRows` or (``on_damage="warn"``) are skipped, warned once."""

    def __init__(self, engine: Engine, *, target: Target | None = None, fallback: bool = False,
                 timeout_s: float = DEFAULT_TIMEOUT_S, on_damage: OnDamage | None = None,
                 config_type: type[Config] = Config):
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

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def after_fork(self) -> None:
        """In a forked child: drop the parent's pooled connections without closing them."""
        self._engine.dispose(close=False)

    def transaction(self, work: Callable[[Session], T], *, write: bool, bump: bool = False) -> T:
        """``work(session)`` in one transaction (a write's unique-key race retried; ``bump``: a write of results);
        database errors are :class:`StoreError` or, with ``fallback``, a warning and memory from then on."""
        attempt = 0
        while True:
            if self._watch is not None:
                self._check_file(self._watch)
            engine = self._engine
            # A read is several statements: under PostgreSQL's READ COMMITTED each would see a new
            # snapshot and could pair one writer's winner with another's candidates.
            isolation = {"isolation_level": "REPEATABLE READ"} if engine.dialect.name == "postgresql" else {}
            bound = writing(engine) if write else engine.execution_options(**isolation)
            # One in-memory connection serves every thread: transactions must not interleave.
            guard = self._memory_lock if self.in_memory else contextlib.nullcontext()
            try:
                session = Session(bound, expire_on_commit=False, info={"context": self._context})
                with guard, session, session.begin():
                    value = work(session)
                    if bump and session.execute(BUMP_GENERATION).rowcount == 0:
                        # Two first writers on PostgreSQL may both insert: the loser's IntegrityError is retried.
                        session.execute(insert(GENERATION).values(id=1, generation=1))
                    return value
            except StoreError:
                raise
            except Exception as exc:
                if isinstance(exc, IntegrityError) and write and attempt < _WRITE_ATTEMPTS - 1:
                    attempt += 1
                    log.debug("write conflict, retrying: %s", exc.orig)
                    continue
                if not (self._fallback or isinstance(exc, SQLAlchemyError)):
                    raise  # only a library caller's merge must go on whatever the database holds
                self._failed(exc, engine)

    def _failed(self, exc: Exception, engine: Engine) -> None:
        message = describe_error(exc, engine_name(engine), self._timeout_s)
        if not self._fallback or is_memory_url(engine.url):
            raise StoreError(message) from exc
        with self._swap_lock:
            if self._engine is not engine:
                return  # another thread already moved to memory; just retry there
            warnings.warn(f"kvsplit tuning database unusable, continuing in memory: {message}", DbWarning, stacklevel=4)
            self._engine, self._watch = memory_engine(), None
        engine.dispose()

    def _check_file(self, watch: FileWatch) -> None:
        # A file changed under us: one warning, and the new file (when one replaced it and it opens) or memory.
        if (change := watch.changed()) is None:
            return
        what, reopen = change
        with self._swap_lock:
            if self._watch is not watch:
                return  # another thread dealt with it
            old, engine, problem = self._engine, None, None
            if reopen:
                try:
                    engine = create_db_engine(self._target, timeout_s=self._timeout_s, pooled=False)
                    _guarded(engine, self._timeout_s, lambda: ensure_schema(engine))
                except StoreError as exc:
                    engine, problem = None, str(exc)
            if engine is not None:
                self._watch = _watch(self._target)
                self.reopened += 1
                outcome = ": reading and writing the new file from now on"
            else:
                engine, self._watch = memory_engine(), None
                unusable = f"; the new file cannot be used ({problem})" if problem else ""
                outcome = f"{unusable}; continuing in memory (what is profiled from now on stays in this process)"
            warnings.warn(f"kvsplit tuning database {engine_name(old)} {what}{outcome}", DbWarning, stacklevel=5)
            self._engine = engine
        # An immutable file's connections are dropped, never closed: closing writes to its
        # mapped shared-memory index, which is what kills the process.
        old.dispose(close="immutable" not in what)

    def _read(self, work: Callable[[Session], tuple[T, list[Damage]]], **options: Any) -> T:
        value, damage = self.transaction(work, **{"write": False, **options})
        if damage and self._on_damage == "raise":
            raise DamagedRows(self.url, damage)
        if new := [d for d in damage if d.where not in self._warned]:
            self._warned.update(d.where for d in new)
            warnings.warn(f"kvsplit skipped rows of the tuning database {DamagedRows(self.url, new)}",
                          DbWarning, stacklevel=3)
        return value

    def _records(self, where: list, **options: Any) -> list[TuningRecord]:
        def work(session: Session) -> tuple[list[TuningRecord], list[Damage]]:
            found = read(session, where, **options)
            return list(found.records.values()), found.damage

        return self._read(work)

    def upsert(self, record: TuningRecord) -> None:
        """Insert ``record``, or replace the result and candidates stored for its key (``updated_at``
        becomes now; ``created_at`` is kept from the stored result, or the record, or now)."""
        self.upsert_many([record])

    def upsert_many(self, records: Iterable[TuningRecord]) -> None:
        """:meth:`upsert` each record, all in one transaction."""
        records = list(records)

        def work(session: Session) -> None:
            now = datetime.now(timezone.utc)
            for record in records:
                write_record(session, record, find_for_write(session, record.key), now)

        self.transaction(work, write=True, bump=True)

    def get(self, key: TuningKey) -> TuningRecord | None:
        """The record stored for ``key``, or ``None``."""
        where = [*device_is(key.device), BUILDS.c.build_hash == key.build_hash,
                 *(RESULTS.c[k] == getattr(key, k) for k in CHOICE_FIELDS)]
        return next(iter(self._records(where)), None)

    def load_choices(self, device: DeviceInfo, build_hash: str) -> dict[ChoiceKey, Config]:
        """Every winner for one device and build, by ``TuningKey.choice_key`` (candidates are not read)."""
        records = self._records([*device_is(device), BUILDS.c.build_hash == build_hash], candidates=False)
        return {record.key.choice_key: record.winner for record in records}

    def query(self, *, device: DeviceInfo | str | None = None, build_hash: str | None = None,
              head_dim: int | None = None, dtype: str | None = None, out_dtype: str | None = None,
              stats_format: str | None = None, num_splits: int | Iterable[int] | None = None,
              rows: int | Iterable[int] | None = None) -> list[TuningRecord]:
        """Records matching every filter given, in key order: ``device`` exact, or a string matched
        case-insensitively in the name; ``dtype`` the partials'; ``num_splits`` and ``rows`` one or several."""
        if any(value is not None and "\x00" in value for value in (build_hash, dtype, out_dtype, stats_format)):
            return []  # no stored text holds a NUL; PostgreSQL would refuse the parameter
        r = RESULTS.c
        columns = {BUILDS.c.build_hash: build_hash, r.head_dim: head_dim, r.partial_dtype: dtype,
                   r.out_dtype: out_dtype, r.stats_format: stats_format, r.num_splits: num_splits, r.rows: rows}
        conditions = [column.in_(list(value)) if isinstance(value, Iterable) and not isinstance(value, str)
                      else column == value for column, value in columns.items() if value is not None]
        if device is not None:
            conditions.extend(device_is(device))
        order = (DEVICES.c.name, DEVICES.c.sm_count, BUILDS.c.build_hash, *(r[k] for k in CHOICE_FIELDS))
        return self._records(conditions, order_by=order)

    def inventory(self, current_build: str | Collection[str] | None = None) -> Inventory:
        """From one read, for a report of the whole database: every record, every build, and the hashes
        of the stale builds (as :func:`~kvsplit.db.rows.stale_build_ids` says)."""

        def work(session: Session) -> tuple[Inventory, list[Damage]]:
            found = read(session)
            stale = {found.builds[i].build_hash for i in stale_build_ids(session, current_build) if i in found.builds}
            return (list(found.records.values()), list(found.builds.values()), stale), found.damage

        return self._read(work)

    def generation(self) -> object:
        """The stored generation counter (``None`` before any write); any process's write of results changes it."""
        return self.transaction(lambda session: session.execute(READ_GENERATION).scalar(), write=False)

    def damage(self) -> list[Damage]:
        """Every row that does not parse, and every row that cannot stand without one."""
        return self.transaction(lambda session: read(session).damage, write=False)

    def check(self) -> None:
        """Raise :class:`DamagedRows` if any row does not parse, whatever ``on_damage`` says."""
        if damage := self.damage():
            raise DamagedRows(self.url, damage)

    def repair(self, keep: Callable[[list[Damage]], None], *, dry_run: bool = False) -> RepairResult:
        """Delete every row that does not parse, and the rows that depend on it, in one transaction, once
        ``keep`` has them (``kvsplit db repair`` appends them to its quarantine file): if it raises,
        nothing is deleted.  ``quarantine_file`` and ``schema_repairs`` are the caller's to fill in."""

        def work(session: Session) -> RepairResult:
            found = read(session)
            chosen = {d.where: d for d in found.damage}
            gone = {row_id for table, row_id in chosen if table == RESULTS.name}
            for row_id, row in found.raw[CANDIDATES.name].items():
                if row["result_id"] in gone:
                    problem = f"belongs to tuning_results id {row['result_id']}, which is quarantined"
                    chosen.setdefault((CANDIDATES.name, row_id), Damage(CANDIDATES.name, row_id, problem, row))
            counts = {t.name: sum(1 for table, _ in chosen if table == t.name) for t in TABLES}
            result = RepairResult(dry_run=dry_run, quarantined={t: n for t, n in counts.items() if n},
                                  problems=[str(d) for d in found.damage], schema_repairs=[], quarantine_file=None)
            if dry_run or not chosen:
                return result
            keep(list(chosen.values()))  # first, inside the transaction: if it raises, nothing is deleted
            for table in reversed(TABLES):  # children first
                for ids in chunks([row_id for t, row_id in chosen if t == table.name]):
                    session.execute(delete(table).where(table.c.id.in_(ids)))
            return result

        return self.transaction(work, write=not dry_run, bump=not dry_run)

    def prune(self, *, stale_builds: bool = False, current_build: str | Collection[str] | None = None,
              other_devices_than: DeviceInfo | str | None = None, older_than: timedelta | None = None,
              dry_run: bool = False) -> PruneResult:
        """Delete the results of stale builds (see :meth:`inventory`), of every device but ``other_devices_than``
        (a string matches part of a name and must match one, else ``ValueError``) or last updated longer ago
        than ``older_than``; devices and builds left empty go too."""
        if not (stale_builds or other_devices_than is not None or older_than is not None):
            return PruneResult(keys=[], dry_run=dry_run)

        def work(session: Session) -> tuple[PruneResult, list[Damage]]:
            criteria = []
            if stale_builds and (stale := stale_build_ids(session, current_build)):
                criteria.append(RESULTS.c.build_id.in_(stale))
            if other_devices_than is not None:
                keep = select(DEVICES.c.id).where(*device_is(other_devices_than))
                if isinstance(other_devices_than, str) and session.scalar(keep.limit(1)) is None:
                    raise ValueError(f"no device in the database matches {other_devices_than!r}")
                criteria.append(RESULTS.c.device_id.not_in(keep))
            if older_than is not None:
                criteria.append(RESULTS.c.updated_at < datetime.now(timezone.utc) - older_than)
            found = read(session, [or_(false(), *criteria)], candidates=False)
            if found.damage and self._on_damage == "raise":
                raise DamagedRows(self.url, found.damage)  # before the transaction commits: nothing deleted
            if found.records and not dry_run:  # rows that do not parse are left alone
                for ids in chunks(list(found.records)):
                    session.execute(delete(CANDIDATES).where(CANDIDATES.c.result_id.in_(ids)))
                    session.execute(delete(RESULTS).where(RESULTS.c.id.in_(ids)))
                session.execute(delete(DEVICES).where(DEVICES.c.id.not_in(select(RESULTS.c.device_id))))
                session.execute(delete(BUILDS).where(BUILDS.c.id.not_in(select(RESULTS.c.build_id))))
            return PruneResult(keys=[r.key for r in found.records.values()], dry_run=dry_run), found.damage

        return self._read(work, write=not dry_run, bump=not dry_run)

    def import_records(self, records: Iterable[TuningRecord], *, rule: ImportRule = "newer",
                       dry_run: bool = False) -> ImportSummary:
        """Merge records into the store, all or nothing, keeping their times: a stored key is replaced
        if ``rule`` is ``"replace"``, or ``"newer"`` and the incoming ``updated_at`` is strictly later.
        A record that fails validation (``config_type`` too) or two of one key: ``ValueError``."""
        # A record changed with model_copy(update=...) was never validated: all are, again.
        records = [TuningRecord.model_validate(r.model_dump(), context=self._context) for r in records]
        if len({r.key for r in records}) != len(records):
            raise ValueError("two records of one tuning key")

        def work(session: Session) -> ImportSummary:
            counts, now = Counter(), datetime.now(timezone.utc)
            for record in records:
                stored = find_for_write(session, record.key)
                wins = rule == "replace" or (rule == "newer" and record.updated_at is not None and (
                    stored is None or stored.updated_at is None or record.updated_at > stored.updated_at))
                outcome = "inserted" if stored is None else "replaced" if wins else "kept"
                counts[outcome] += 1
                if outcome != "kept" and not dry_run:
                    write_record(session, record, stored, now, keep_times=True)
            return ImportSummary(rule=rule, dry_run=dry_run, **counts)

        return self.transaction(work, write=not dry_run, bump=not dry_run)


def _guarded(engine: Engine, timeout_s: float, step: Callable[[], T]) -> T:
    try:
        return step()
    except (StoreError, SQLAlchemyError, OSError, ValueError) as exc:  # ValueError: a driver refusing a URL's value
        engine.dispose()
        if isinstance(exc, StoreError):
            raise
        raise StoreError(describe_error(exc, engine_name(engine), timeout_s)) from exc


def _open(url: str | None, timeout_s: float, *, create: bool = True, pooled: bool = True, **store: Any) -> Store:
    target = parse_target(url)
    engine = create_db_engine(target, timeout_s=timeout_s, pooled=pooled, create=create)
    if (upgraded_from := _guarded(engine, timeout_s, lambda: ensure_schema(engine, create=create))) is not None:
        warnings.warn(f"kvsplit upgraded the tuning database {target.shown} from schema revision {upgraded_from} "
                      f"to {head_revision()}", DbWarning, stacklevel=3)
    return Store(engine, target=target, timeout_s=timeout_s, **store)


def open_store(url: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S, create: bool = True,
               on_damage: OnDamage = "raise", config_type: type[Config] = Config) -> Store:
    """Open the database ``url`` names (see :func:`~kvsplit.db.engine.parse_target`), creating or upgrading its
    schema (an upgrade warns once); any problem is a :class:`StoreError`.  ``timeout_s``: how long to wait for
    another process's lock, in seconds; ``create`` false: memory, no file or no kvsplit tables: :class:`NoDatabase`."""
    return _open(url, timeout_s, create=create, on_damage=on_damage, config_type=config_type)


def open_store_for_library(url: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                           config_type: type[Config] = Config) -> Store:
    """:func:`open_store` for a library caller, which never raises for a database problem: one :class:`DbWarning`
    and memory instead, now or later; rows that do not parse are skipped with one warning; a file is watched."""
    try:
        # No SQLite connection kept between transactions: an idle serving process then maps
        # nothing of the file's -shm index, which would be SIGBUS once the file is made immutable.
        return _open(url, timeout_s, pooled=False, fallback=True, config_type=config_type)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the caller's merge must go on
        warnings.warn(f"kvsplit tuning database unusable, continuing in memory: {exc}", DbWarning, stacklevel=2)
        return Store(memory_engine(), fallback=True, timeout_s=timeout_s, config_type=config_type)


def open_store_for_repair(url: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S, dry_run: bool = False,
                          config_type: type[Config] = Config) -> tuple[Store, list[str]]:
    """Open a database that may be damaged, for :meth:`Store.repair`, and one line per repair of its
    schema (:func:`kvsplit.db.migrate.restore_schema`; with ``dry_run`` only listed).  Never creates
    a database; raises as :func:`open_store`."""
    target = parse_target(url)
    engine = create_db_engine(target, timeout_s=timeout_s, create=False)
    done = _guarded(engine, timeout_s, lambda: restore_schema(engine, dry_run=dry_run))
    if not (dry_run and done):
        _guarded(engine, timeout_s, lambda: ensure_schema(engine, create=False))
    return Store(engine, target=target, timeout_s=timeout_s, on_damage="raise", config_type=config_type), done
