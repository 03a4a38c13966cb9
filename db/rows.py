"""The one place where rows of the tuning database become models, and where records become rows.

Rows are read as stored (no driver or SQLAlchemy conversion: a value that
does not convert must not fail the whole query, and timestamps come as text,
which psycopg cannot fail on), then validated by pydantic in two steps: a row
model per table, whose field types follow the column types (:data:`_FIELDS`),
then the models of :mod:`.schemas` with ``from_attributes=True``.  A row that
fails is never an exception: it becomes a :class:`Damage` naming the table,
the id and the problem, and the store skips it, warns about it or refuses, by
its policy.  Whatever a column holds, it is read or it is damage.

A result is usable when its own row, its device row and its build row parse;
a full record also needs its candidate rows to form a consistent record (the
winner among them and matched).  A candidate row that does not parse is left
out of its record.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Annotated, Any, NamedTuple, Optional

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, StrictBool, StrictFloat, StrictInt,
                      StrictStr, TypeAdapter, ValidationError, create_model)
from sqlalchemy import (Boolean, ColumnElement, Float, Integer, Select, String, Table, Text, bindparam, cast, delete,
                        false, func, insert, inspect, or_, select, type_coerce, update)
from sqlalchemy.orm import Session
from sqlalchemy.types import NullType

from .models import (KEY_COLUMNS, Candidate, CanonicalJSON, Device, Generation, KernelBuild, TuningClaim, TuningResult,
                     UTCDateTime)
from .schemas import CandidateResult, ClaimInfo, DeviceInfo, KernelBuildInfo, TuningKey, TuningRecord

DEVICES, BUILDS = Device.__table__, KernelBuild.__table__
RESULTS, CANDIDATES = TuningResult.__table__, Candidate.__table__
CLAIMS, GENERATION = TuningClaim.__table__, Generation.__table__
#: Every table whose rows are read, parents first (the fleet's two tables stand alone).
TABLES: tuple[Table, ...] = (DEVICES, BUILDS, RESULTS, CANDIDATES, CLAIMS, GENERATION)


# -- rows as stored, and their row models ----------------------------------------------------------


def raw_columns(table: Table, prefix: str = "") -> list[ColumnElement]:
    """``table``'s columns as stored, labelled ``prefix + name``: timestamps as text, the rest untouched."""
    return [(cast(c, Text) if isinstance(c.type, UTCDateTime) else type_coerce(c, NullType())).label(prefix + c.name)
            for c in table.columns]


def _utf8(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # invalid bytes, read back as surrogates (see engine.py)
        raise ValueError("is not valid UTF-8 text") from None
    return value


def _json_object(value: Any) -> Any:
    try:
        value = json.loads(_utf8(value)) if isinstance(value, str) else value
    except ValueError:
        raise ValueError("is not JSON") from None
    if not isinstance(value, dict):
        raise ValueError("is not a JSON object")
    return value


_TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(\.\d{1,6})?")


def _timestamp_text(value: Any) -> Any:
    # Only the form the backends write: pydantic alone would read '12345' as a Unix time.
    if isinstance(value, str) and _TIMESTAMP.fullmatch(value.strip()):
        return value.strip()
    raise ValueError("is not a timestamp")


def _flag(value: Any) -> Any:
    return bool(value) if type(value) is int and value in (0, 1) else value  # SQLite's booleans


#: Column type -> the pydantic type its stored values must pass (the TypeDecorators first).
_FIELDS: tuple[tuple[type, Any], ...] = (
    (UTCDateTime, Annotated[datetime, BeforeValidator(_timestamp_text),
                            AfterValidator(lambda t: t.replace(tzinfo=timezone.utc))]),
    (CanonicalJSON, Annotated[dict, BeforeValidator(_json_object)]),
    (Boolean, Annotated[StrictBool, BeforeValidator(_flag)]),
    (Integer, StrictInt),
    (Float, StrictFloat),
    (String, Annotated[StrictStr, AfterValidator(_utf8)]),
)


def _row_model(table: Table) -> type[BaseModel]:
    def kind(column: Any) -> Any:
        return next(t for types, t in _FIELDS if isinstance(column.type, types))

    return create_model(f"{table.name}_row", __config__=ConfigDict(from_attributes=True),
                        **{c.name: (Optional[kind(c)] if c.nullable else kind(c), ...) for c in table.columns})


_ROWS = {t.name: _row_model(t) for t in TABLES}


# -- damage -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Damage:
    """A row that does not parse: which, why, and what it holds (for the quarantine)."""

    table: str
    row_id: Any
    problem: str
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def where(self) -> tuple[str, Any]:
        return (self.table, self.row_id)

    def __str__(self) -> str:
        return f"{self.table} id {self.row_id}: {self.problem}"


class Unparsable(Exception):
    """One row that does not parse; the message names the column or field."""


def shown(value: Any) -> str:
    """A stored value for a message: its repr, cut to 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def validated(model: Any, data: Any, context: dict | None = None) -> Any:
    """``model`` validated from ``data`` (attributes or a mapping), or :class:`Unparsable` naming why."""
    try:
        return model.model_validate(data, context=context)
    except TypeError as error:  # a config type's check that met a stranger value
        raise Unparsable(f"{model.__name__}: {error}") from None
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"]) or model.__name__
        message = first["msg"].removeprefix("Value error, ")
        stored = "" if isinstance(first["input"], (dict, BaseModel)) else f" (stored {shown(first['input'])})"
        raise Unparsable(f"{where}{' ' if message.startswith('is ') else ': '}{message}{stored}") from None


class StoredRecord(NamedTuple):
    """A record with the id of its result row."""

    id: int
    record: TuningRecord


class Reader:
    """The rows of one read, validated; each damaged row recorded once, parents decoded once."""

    def __init__(self, session: Session | None = None):
        # The validation context of the store's transaction: its config type (see Store).
        self.context = None if session is None else session.info.get("context")
        self.damage: dict[tuple[str, Any], Damage] = {}
        self._parents: dict[tuple[str, Any], Any] = {}

    def hurt(self, table: str, row_id: Any, problem: str, raw: Mapping[str, Any]) -> None:
        self.damage.setdefault((table, row_id), Damage(table, row_id, problem, dict(raw)))

    def parent(self, table: Table, raw: Mapping[str, Any] | None, row_id: Any) -> Any:
        """The device or build of a result, or :class:`Unparsable` saying why the result cannot use it."""
        if raw is None:
            column = "device_id" if table is DEVICES else "build_id"
            raise Unparsable(f"{column} {shown(row_id)} names no {table.name} row")
        where = (table.name, row_id)
        if where not in self._parents:
            model = DeviceInfo if table is DEVICES else KernelBuildInfo
            try:
                self._parents[where] = validated(model, validated(_ROWS[table.name], raw))
            except Unparsable as bad:
                self.hurt(table.name, row_id, str(bad), raw)
                self._parents[where] = None
        if self._parents[where] is None:
            raise Unparsable(f"its {table.name} row (id {row_id}) does not parse")
        return self._parents[where]

    def result(self, raw: Mapping[str, Any], device: Mapping[str, Any] | None,
               build: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """The record data of a result row (its own columns checked), or ``None`` and damage."""
        try:
            r = validated(_ROWS["tuning_results"], raw)
            data = {
                "key": {"device": self.parent(DEVICES, device, r.device_id),
                        "build_hash": self.parent(BUILDS, build, r.build_id).build_hash,
                        **{k: getattr(r, k) for k in KEY_COLUMNS[2:]}},
                "winner": {"family": r.winner_family, "params": r.winner_params},
                "policy": {"l2_state": r.l2_state, "repeats": r.repeats, "noise_margin": r.noise_margin},
                **{k: getattr(r, k) for k in ("tool_version", "created_at", "updated_at")},
            }
            validated(TuningRecord, data, self.context)  # the row's own columns, before any candidate joins in
            return data
        except Unparsable as bad:
            self.hurt("tuning_results", raw["id"], str(bad), raw)
            return None

    def record(self, result_id: Any, data: dict[str, Any], candidates: Iterable[Mapping[str, Any]]) -> TuningRecord | None:
        """The record of a result and its candidate rows; ``None`` (and damage) if they do not agree."""
        measured = []
        for raw in candidates:
            try:
                c = validated(_ROWS["tuning_candidates"], raw)
                measured.append(validated(CandidateResult, {
                    "config": {"family": c.family, "params": c.params},
                    **{k: getattr(c, k) for k in ("median_us", "p10_us", "p90_us", "samples", "matched")}},
                    self.context))
            except Unparsable as bad:
                self.hurt("tuning_candidates", raw["id"], str(bad), raw)
        try:
            return validated(TuningRecord, {**data, "candidates": measured}, self.context)
        except Unparsable as bad:
            self.hurt("tuning_results", result_id, str(bad), {})
            return None

    def claim(self, raw: Mapping[str, Any] | None) -> ClaimInfo | None:
        """A claim row, or ``None`` for no row or one that does not parse (claimable: it is overwritten)."""
        try:
            return None if raw is None else validated(ClaimInfo, validated(_ROWS["tuning_claims"], raw))
        except Unparsable as bad:
            self.hurt("tuning_claims", raw["id"], str(bad), raw)
            return None


# -- reads ------------------------------------------------------------------------------------

_D, _B = "device.", "build."
# Outer joins: a result whose device_id or build_id names no row still shows.
_JOINED = RESULTS.outerjoin(DEVICES, RESULTS.c.device_id == DEVICES.c.id).outerjoin(
    BUILDS, RESULTS.c.build_id == BUILDS.c.id)


def _part(row: Mapping[str, Any], prefix: str) -> dict[str, Any] | None:
    part = {k[len(prefix):]: v for k, v in row.items() if k.startswith(prefix)}
    return part if part["id"] is not None else None


class Read(NamedTuple):
    records: list[StoredRecord]
    damage: list[Damage]


def read_records(session: Session, where: Sequence[ColumnElement[bool]] = (), *, order_by: Iterable[Any] = (),
                 candidates: bool = True) -> Read:
    """The records whose result rows match ``where`` (conditions on the ORM tables), and the damage met.

    Without ``candidates`` the records carry none (one query: what dispatch needs).
    """
    reader = Reader(session)
    stmt = (select(*raw_columns(RESULTS), *raw_columns(DEVICES, _D), *raw_columns(BUILDS, _B))
            .select_from(_JOINED).where(*where).order_by(*order_by, RESULTS.c.id))
    found = []
    for row in session.execute(stmt).mappings():
        own = {k: v for k, v in row.items() if not k.startswith((_D, _B))}
        data = reader.result(own, _part(row, _D), _part(row, _B))
        if data is not None:
            found.append((own["id"], data))
    per_result: dict[Any, list[dict[str, Any]]] = {}
    if candidates and found:
        ids = select(RESULTS.c.id).select_from(_JOINED).where(*where)
        stmt = select(*raw_columns(CANDIDATES)).where(CANDIDATES.c.result_id.in_(ids)).order_by(CANDIDATES.c.id)
        for row in session.execute(stmt).mappings():
            per_result.setdefault(row["result_id"], []).append(dict(row))
    records = [StoredRecord(i, r) for i, data in found
               if (r := reader.record(i, data, per_result.get(i, []))) is not None]
    return Read(records, list(reader.damage.values()))


class Scan(NamedTuple):
    """Every table read whole: usable records, builds, the damage, and every raw row by table and id."""

    records: list[StoredRecord]
    builds: dict[Any, KernelBuildInfo]
    damage: list[Damage]
    raw: dict[str, dict[Any, dict[str, Any]]]


def scan(session: Session) -> Scan:
    """Read every row of every table (no joins, so dangling and orphaned rows show too).

    A missing table reads as empty (``repair --dry-run`` scans before it is recreated).
    """
    present = set(inspect(session.connection()).get_table_names())
    raw = {t.name: {m["id"]: dict(m) for m in session.execute(select(*raw_columns(t)).order_by(t.c.id)).mappings()}
           if t.name in present else {} for t in TABLES}
    reader = Reader(session)
    builds = {}
    for table in (BUILDS, DEVICES):
        for row_id, row in raw[table.name].items():
            try:
                parsed = reader.parent(table, row, row_id)
            except Unparsable:
                continue
            if table is BUILDS:
                builds[row_id] = parsed
    found = {}
    for result_id, row in raw["tuning_results"].items():
        device, build = (raw[t].get(row[c]) for t, c in (("devices", "device_id"), ("kernel_builds", "build_id")))
        data = reader.result(row, device, build)
        if data is not None:
            found[result_id] = data
    per_result: dict[Any, list[dict[str, Any]]] = {}
    for candidate_id, row in raw["tuning_candidates"].items():
        if row["result_id"] in raw["tuning_results"]:
            per_result.setdefault(row["result_id"], []).append(row)
        else:
            reader.hurt("tuning_candidates", candidate_id,
                        f"result_id {shown(row['result_id'])} names no tuning_results row", row)
    records = [StoredRecord(i, r) for i, data in found.items()
               if (r := reader.record(i, data, per_result.get(i, []))) is not None]
    for row in raw["tuning_claims"].values():
        reader.claim(row)
    for row_id, row in raw["tuning_generation"].items():
        try:
            if validated(_ROWS["tuning_generation"], row).generation < 0:
                raise Unparsable(f"generation is negative (stored {shown(row['generation'])})")
        except Unparsable as bad:
            reader.hurt("tuning_generation", row_id, str(bad), row)
    # Damage found by record() has no raw row yet: give it the stored one.
    damage = [d if d.raw else Damage(d.table, d.row_id, d.problem, raw[d.table].get(d.row_id, {}))
              for d in reader.damage.values()]
    return Scan(records, builds, damage, raw)


# -- writes -------------------------------------------------------------------------------------


def device_is(device: DeviceInfo | str) -> list[ColumnElement[bool]]:
    """Conditions on :class:`Device`: exact for a DeviceInfo, part of the name for a string."""
    if isinstance(device, str):
        if "\x00" in device:  # no stored name holds one; PostgreSQL would refuse the parameter
            return [false()]
        return [func.lower(Device.name).contains(device.lower(), autoescape=True)]
    return [getattr(Device, k) == v for k, v in device.model_dump().items()]


def key_conditions(key: TuningKey) -> list[ColumnElement[bool]]:
    """Conditions on a result row (joined to its device and build) that pick ``key``."""
    return [*device_is(key.device), KernelBuild.build_hash == key.build_hash,
            *(RESULTS.c[k] == getattr(key, k) for k in KEY_COLUMNS[2:])]


def stored_time(value: Any) -> datetime | None:
    """A timestamp as :func:`raw_columns` reads it, aware UTC; ``None`` if it does not parse."""
    try:
        return _TIME.validate_python(value)
    except ValidationError:
        return None


_TIME = TypeAdapter(_FIELDS[0][1])


class StoredTimes(NamedTuple):
    """A stored result's id and times; a time that does not parse is ``None`` (the write replaces it)."""

    id: int
    created_at: datetime | None
    updated_at: datetime | None


# The write path runs prebuilt statements with bound parameters: building the
# expressions anew costs more Python than the SQL itself, and SQLite writers
# hold the database's one write lock for all of it.
_DEVICE_MATCH = [DEVICES.c[k] == bindparam(k) for k in ("name", "cc_major", "cc_minor", "sm_count")]
_FIND_FOR_WRITE = (
    select(RESULTS.c.id, *(c for c in raw_columns(RESULTS) if c.name in ("created_at", "updated_at")))
    .join(DEVICES, RESULTS.c.device_id == DEVICES.c.id)
    .join(BUILDS, RESULTS.c.build_id == BUILDS.c.id)
    .where(*_DEVICE_MATCH, BUILDS.c.build_hash == bindparam("build_hash"),
           *(RESULTS.c[name] == bindparam(name) for name in KEY_COLUMNS[2:]))
    # Makes a concurrent re-tune of the key on PostgreSQL wait, then see the
    # other writer's candidates before replacing them.
    .with_for_update(of=RESULTS)
)
_DEVICE_ID = select(DEVICES.c.id).where(*_DEVICE_MATCH)
_BUILD_ID = select(BUILDS.c.id).where(BUILDS.c.build_hash == bindparam("build_hash"))
_UPDATE_RESULT = update(RESULTS).where(RESULTS.c.id == bindparam("stored_id"))
_DELETE_CANDIDATES = delete(CANDIDATES).where(CANDIDATES.c.result_id == bindparam("stored_id"))


def find_for_write(session: Session, key: TuningKey) -> StoredTimes | None:
    """Id and timestamps of the result for ``key``, locked FOR UPDATE where the backend can.

    (SQLite writers are already serialized by BEGIN IMMEDIATE.)
    """
    params = {**key.device.model_dump(), **key.model_dump(exclude={"device"})}
    row = session.execute(_FIND_FOR_WRITE, params).one_or_none()
    return None if row is None else StoredTimes(row[0], stored_time(row[1]), stored_time(row[2]))


def _id(session: Session, find: Select, table: Table, params: dict[str, Any], **more: Any) -> int:
    found = session.execute(find, params).scalar()
    return found if found is not None else session.execute(insert(table), params | more).inserted_primary_key[0]


def write_record(session: Session, record: TuningRecord, stored: StoredTimes | None, now: datetime, *,
                 keep_times: bool = False) -> None:
    """Insert ``record``, or overwrite the stored result of the same key and its candidates.

    Core statements, not the unit of work: writers hold SQLite's write lock for
    the whole transaction, so the less Python runs inside it the better.
    With ``keep_times`` (imports) the record's own timestamps are stored when
    present; otherwise ``updated_at`` is ``now`` and ``created_at`` is kept.
    """
    updated = (record.updated_at if keep_times else None) or now
    if stored is None:
        created = record.created_at or now
    else:
        created = (record.created_at if keep_times else None) or stored.created_at or now
    values = {
        "winner_family": record.winner.family, "winner_params": record.winner.params,
        **record.policy.model_dump(), "tool_version": record.tool_version,
        "created_at": min(created, updated), "updated_at": updated,
    }
    if stored is None:
        key = record.key
        values |= key.model_dump(exclude={"device", "build_hash"})
        values["device_id"] = _id(session, _DEVICE_ID, DEVICES, key.device.model_dump())
        values["build_id"] = _id(session, _BUILD_ID, BUILDS, {"build_hash": key.build_hash},
                                 library_version=record.tool_version)
        result_id = session.execute(insert(RESULTS), values).inserted_primary_key[0]
    else:
        result_id = stored.id
        session.execute(_UPDATE_RESULT, {**values, "stored_id": result_id})
        session.execute(_DELETE_CANDIDATES, {"stored_id": result_id})
    if record.candidates:
        session.execute(insert(CANDIDATES), [
            {"result_id": result_id, "family": c.config.family, "params": c.config.params,
             **c.model_dump(exclude={"config"})}
            for c in record.candidates])


def stale_build_ids(session: Session, current_build: str | Collection[str] | None) -> list[int]:
    """Ids of stale builds: not ``current_build`` (one hash or several), or when ``None``, not the
    most recently updated one."""
    if current_build is not None:
        current = [current_build] if isinstance(current_build, str) else list(current_build)
        current = [h for h in current if "\x00" not in h]  # no stored hash holds one
        return list(session.scalars(select(BUILDS.c.id).where(BUILDS.c.build_hash.not_in(current))))
    newest = session.execute(select(RESULTS.c.build_id).order_by(RESULTS.c.updated_at.desc(), RESULTS.c.id.desc())
                             .limit(1)).scalar_one_or_none()
    return [] if newest is None else list(session.scalars(select(BUILDS.c.id).where(BUILDS.c.id != newest)))


def prune_results(session: Session, *, stale_builds: bool, current_build: str | Collection[str] | None,
                  other_devices_than: DeviceInfo | str | None, cutoff: datetime | None,
                  dry_run: bool) -> tuple[list[TuningKey], list[Damage]]:
    """Delete (unless ``dry_run``) the results matching any criterion; return their keys and the damage met.

    Devices and builds left without results are deleted too.  A string
    ``other_devices_than`` that matches no device raises ``ValueError``: a typo
    must not delete every result.  Rows that do not parse are left alone.
    """
    r = RESULTS.c
    criteria = []
    if stale_builds:
        stale = stale_build_ids(session, current_build)
        if stale:
            criteria.append(r.build_id.in_(stale))
    if other_devices_than is not None:
        keep = select(DEVICES.c.id).where(*device_is(other_devices_than))
        if isinstance(other_devices_than, str) and session.scalar(keep.limit(1)) is None:
            raise ValueError(f"no device in the database matches {other_devices_than!r}")
        criteria.append(r.device_id.not_in(keep))
    if cutoff is not None:
        criteria.append(r.updated_at < cutoff)
    if not criteria:
        return [], []
    found = read_records(session, [or_(*criteria)], candidates=False)
    if not dry_run and found.records:
        ids = [stored.id for stored in found.records]
        session.execute(delete(CANDIDATES).where(CANDIDATES.c.result_id.in_(ids)))
        session.execute(delete(RESULTS).where(r.id.in_(ids)))
        session.execute(delete(DEVICES).where(DEVICES.c.id.not_in(select(r.device_id))))
        session.execute(delete(BUILDS).where(BUILDS.c.id.not_in(select(r.build_id))))
    return [stored.record.key for stored in found.records], found.damage


def merge_records(session: Session, records: list[TuningRecord], *, rule: str, dry_run: bool,
                  now: datetime) -> dict[str, int]:
    """Apply an import's merge ``rule`` to every record; counts of inserted/replaced/kept."""
    counts = {"inserted": 0, "replaced": 0, "kept": 0}
    for record in records:
        stored = find_for_write(session, record.key)
        if stored is None:
            counts["inserted"] += 1
        elif rule == "replace" or (rule == "newer" and record.updated_at is not None
                                   and (stored.updated_at is None or record.updated_at > stored.updated_at)):
            counts["replaced"] += 1
        else:
            counts["kept"] += 1
            continue
        if not dry_run:
            write_record(session, record, stored, now, keep_times=True)
    return counts


# -- the generation counter ---------------------------------------------------------------------
# One row that every write of results bumps, in the write's own transaction: a
# serving process that cached a table of winners reads this one value (a
# primary-key lookup) to learn whether anything changed since.  It is never
# parsed: a damaged counter can at worst cost one reload.

_BUMP = update(GENERATION).where(GENERATION.c.id == 1).values(generation=GENERATION.c.generation + 1)
_READ_GENERATION = select(*raw_columns(GENERATION)).where(GENERATION.c.id == 1)


def bump_generation(session: Session) -> None:
    """Add one to the counter, creating its row at 1 if there is none.

    Two first writers on PostgreSQL may both insert; the loser's transaction
    fails with an IntegrityError, which the store retries (it then updates).
    """
    if session.execute(_BUMP).rowcount == 0:
        session.execute(insert(GENERATION).values(id=1, generation=1))


def read_generation(session: Session) -> Any:
    """The stored counter as it is (``None`` when there is no row yet)."""
    row = session.execute(_READ_GENERATION).mappings().one_or_none()
    return None if row is None else row["generation"]
