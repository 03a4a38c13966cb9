"""The one place where rows become models, and records become rows.

Rows are read as stored (timestamps as text: a value the driver cannot convert must not fail the query), then validated
once, strictly, as the model that leaves the store; a row that fails is a :class:`Damage`, never an exception."""

from __future__ import annotations

import contextlib
import json
import re
from collections import defaultdict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, NamedTuple

from pydantic import BaseModel, TypeAdapter, ValidationError
from sqlalchemy import (Boolean, ColumnElement, Select, Table, Text, bindparam, cast, delete, false, func, insert,
                        inspect, select, type_coerce, update)
from sqlalchemy.orm import Session
from sqlalchemy.types import NullType

from .models import BUILDS, CANDIDATES, CLAIMS, DEVICES, GENERATION, RESULTS, TABLES, CanonicalJSON, UTCDateTime
from .schemas import CHOICE_FIELDS, CandidateResult, ClaimInfo, DeviceInfo, KernelBuildInfo, TuningKey, TuningRecord

CHUNK = 500  # values per IN list, well under every backend's parameter limit
_TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(\.\d{1,6})?")
_TIME = TypeAdapter(datetime)


def raw_columns(table: Table, prefix: str = "") -> list[ColumnElement]:
    """``table``'s columns as stored, labelled ``prefix + name``: timestamps as text."""
    return [(cast(c, Text) if isinstance(c.type, UTCDateTime) else type_coerce(c, NullType())).label(prefix + c.name)
            for c in table.columns]


def chunks(values: Sequence[Any]) -> Iterator[Sequence[Any]]:
    """``values`` in slices of at most :data:`CHUNK`, one IN list each."""
    return (values[start:start + CHUNK] for start in range(0, len(values), CHUNK))


def stored_value(column: Any, value: Any) -> Any:
    """A stored value as its column's Python type, or ``ValueError`` saying why it is not one.  Only
    the backends' timestamp form is read: pydantic would take '12345' as a Unix time."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("is not valid UTF-8 text") from None
    if value is None:
        return None
    if isinstance(column.type, UTCDateTime):
        with contextlib.suppress(ValidationError):
            if isinstance(value, str) and _TIMESTAMP.fullmatch(value.strip()):
                return _TIME.validate_python(value.strip()).replace(tzinfo=timezone.utc)
        raise ValueError("is not a timestamp")
    if isinstance(column.type, CanonicalJSON):
        try:
            value = json.loads(value) if isinstance(value, str) else value
        except ValueError:
            raise ValueError("is not JSON") from None
        if not isinstance(value, dict):
            raise ValueError("is not a JSON object")
    if isinstance(column.type, Boolean) and type(value) is int and value in (0, 1):
        return bool(value)
    return value


def stored_time(value: Any) -> datetime | None:
    """A timestamp as :func:`raw_columns` reads it, aware UTC; ``None`` if it does not parse."""
    with contextlib.suppress(ValueError):
        return stored_value(RESULTS.c.created_at, value)
    return None


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
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _values(table: Table, raw: Mapping[str, Any]) -> dict[str, Any]:
    values = {}
    for name, value in raw.items():
        if name != "id":
            try:
                values[name] = stored_value(table.c[name], value)
            except ValueError as error:
                raise Unparsable(f"{name} {error} (stored {shown(value)})") from None
    return values


def _candidate(values: dict[str, Any]) -> dict[str, Any]:
    del values["result_id"]
    return {"config": {"family": values.pop("family"), "params": values.pop("params")}, **values}


class Reader:
    """The rows of one read as models: each damaged row recorded once, each parent decoded once."""

    def __init__(self, context: dict | None = None):
        self.context = context
        self.damage: dict[tuple[str, Any], Damage] = {}
        self.parents: dict[tuple[str, Any], Any] = {}

    def hurt(self, table: Table, raw: Mapping[str, Any], problem: str) -> None:
        self.damage.setdefault((table.name, raw["id"]), Damage(table.name, raw["id"], problem, dict(raw)))

    def parsed(self, table: Table, raw: Mapping[str, Any], model: Any,
               shape: Callable[[dict[str, Any]], Any] = dict) -> Any:
        """The row as ``model``, validated strictly (``shape`` makes its values the model's data), or
        ``None`` and its damage: the first problem, with the column or field it is in."""
        try:
            return model.model_validate(shape(_values(table, raw)), strict=True, context=self.context)
        except Unparsable as bad:
            problem = str(bad)
        except TypeError as error:  # a config type's check that met a stranger value
            problem = f"{model.__name__}: {error}"
        except ValidationError as error:
            first = error.errors(include_url=False)[0]
            where = ".".join(str(part) for part in first["loc"]) or model.__name__
            message = first["msg"].removeprefix("Value error, ")
            value = first["input"]
            stored = "" if isinstance(value, (dict, BaseModel)) else f" (stored {shown(value)})"
            problem = f"{where}{' ' if message.startswith('is ') else ': '}{message}{stored}"
        self.hurt(table, raw, problem)
        return None

    def parent(self, table: Table, raw: Mapping[str, Any] | None, row_id: Any) -> Any:
        """The device or build of a result, or :class:`Unparsable` saying why the result cannot use it."""
        if raw is None:
            column = "device_id" if table is DEVICES else "build_id"
            raise Unparsable(f"{column} {shown(row_id)} names no {table.name} row")
        where = (table.name, row_id)
        if where not in self.parents:
            self.parents[where] = self.parsed(table, raw, DeviceInfo if table is DEVICES else KernelBuildInfo)
        if self.parents[where] is None:
            raise Unparsable(f"its {table.name} row (id {row_id}) does not parse")
        return self.parents[where]

    def record(self, raw: Mapping[str, Any], tables: Mapping[str, Mapping[Any, Any]],
               candidates: Sequence[Mapping[str, Any]]) -> TuningRecord | None:
        measured = [self.parsed(CANDIDATES, row, CandidateResult, _candidate) for row in candidates]

        def shape(r: dict[str, Any]) -> dict[str, Any]:
            device = self.parent(DEVICES, tables[DEVICES.name].get(r["device_id"]), r["device_id"])
            build = self.parent(BUILDS, tables[BUILDS.name].get(r["build_id"]), r["build_id"])
            return {"key": {"device": device, "build_hash": build.build_hash, **{k: r[k] for k in CHOICE_FIELDS}},
                    "winner": {"family": r["winner_family"], "params": r["winner_params"]},
                    "policy": {k: r[k] for k in ("l2_state", "repeats", "noise_margin")},
                    "candidates": [c for c in measured if c is not None],
                    **{k: r[k] for k in ("tool_version", "created_at", "updated_at")}}

        return self.parsed(RESULTS, raw, TuningRecord, shape)

    def claim(self, raw: Mapping[str, Any] | None) -> ClaimInfo | None:
        """A claim row, or ``None`` for no row or one that does not parse (claimable: it is overwritten)."""
        return None if raw is None else self.parsed(CLAIMS, raw, ClaimInfo)


# Outer joins: a result whose device_id or build_id names no row still shows.
_JOINED = RESULTS.outerjoin(DEVICES, RESULTS.c.device_id == DEVICES.c.id).outerjoin(
    BUILDS, RESULTS.c.build_id == BUILDS.c.id)


class Read(NamedTuple):
    """Records by result id, the damage met, the rows as stored (by table and id), the builds that parse."""

    records: dict[Any, TuningRecord]
    damage: list[Damage]
    raw: dict[str, dict[Any, dict[str, Any]]]
    builds: dict[Any, KernelBuildInfo]


def _by_id(session: Session, statement: Select) -> dict[Any, dict[str, Any]]:
    return {row["id"]: dict(row) for row in session.execute(statement).mappings()}


def read(session: Session, where: Sequence[ColumnElement[bool]] | None = None, *, order_by: Sequence[Any] = (),
         candidates: bool = True) -> Read:
    """The records whose result rows match ``where`` (with or without their candidates), and the
    damage met; with ``where`` None every row of every table, orphans, claims and the counter
    included (a missing table reads as empty: ``repair --dry-run`` reads before recreating it)."""
    reader = Reader(session.info.get("context"))
    if where is None:
        present = set(inspect(session.connection()).get_table_names())
        raw = {t.name: _by_id(session, select(*raw_columns(t)).order_by(t.c.id)) if t.name in present else {}
               for t in TABLES}
        for table in (BUILDS, DEVICES):
            for row_id, row in raw[table.name].items():
                with contextlib.suppress(Unparsable):
                    reader.parent(table, row, row_id)
    else:  # one query for the results and their parents, one for their candidates
        parts = ((RESULTS, ""), (DEVICES, "devices."), (BUILDS, "kernel_builds."))
        raw = {table.name: {} for table, _ in parts}
        joined = select(*(c for table, prefix in parts for c in raw_columns(table, prefix))).select_from(_JOINED)
        for row in session.execute(joined.where(*where).order_by(*order_by, RESULTS.c.id)).mappings():
            for table, prefix in parts:
                part = {c.name: row[prefix + c.name] for c in table.columns}
                if part["id"] is not None:
                    raw[table.name][part["id"]] = part
        chosen = select(RESULTS.c.id).select_from(_JOINED).where(*where)
        raw[CANDIDATES.name] = _by_id(session, select(*raw_columns(CANDIDATES)).where(
            CANDIDATES.c.result_id.in_(chosen)).order_by(CANDIDATES.c.id)) if candidates and raw[RESULTS.name] else {}
    per_result = defaultdict(list)
    for row in raw[CANDIDATES.name].values():
        if row["result_id"] in raw[RESULTS.name]:
            per_result[row["result_id"]].append(row)
        else:
            reader.hurt(CANDIDATES, row, f"result_id {shown(row['result_id'])} names no tuning_results row")
    records = {result_id: record for result_id, row in raw[RESULTS.name].items()
               if (record := reader.record(row, raw, per_result[result_id])) is not None}
    for row in raw.get(CLAIMS.name, {}).values():
        reader.claim(row)
    for row in raw.get(GENERATION.name, {}).values():
        if type(row["generation"]) is not int or row["generation"] < 0:
            reader.hurt(GENERATION, row, f"generation is not a count (stored {shown(row['generation'])})")
    builds = {row_id: info for (table, row_id), info in reader.parents.items()
              if table == BUILDS.name and info is not None}
    return Read(records, list(reader.damage.values()), raw, builds)


def device_is(device: DeviceInfo | str) -> list[ColumnElement[bool]]:
    """Conditions on the devices table: exact for a DeviceInfo, part of the name for a string."""
    if isinstance(device, str):
        if "\x00" in device:  # no stored name holds one; PostgreSQL would refuse the parameter
            return [false()]
        return [func.lower(DEVICES.c.name).contains(device.lower(), autoescape=True)]
    return [DEVICES.c[k] == v for k, v in device.model_dump().items()]


class StoredTimes(NamedTuple):
    """A stored result's id and times; a time that does not parse is ``None`` (the write replaces it)."""

    id: int
    created_at: datetime | None
    updated_at: datetime | None


# Prebuilt statements with bound parameters: building expressions anew costs more Python than the
# SQL itself, and SQLite writers hold the database's one write lock for all of it.
_DEVICE_MATCH = [DEVICES.c[k] == bindparam(k) for k in ("name", "cc_major", "cc_minor", "sm_count")]
_FIND_FOR_WRITE = (
    select(RESULTS.c.id, *(c for c in raw_columns(RESULTS) if c.name in ("created_at", "updated_at")))
    .join(DEVICES, RESULTS.c.device_id == DEVICES.c.id)
    .join(BUILDS, RESULTS.c.build_id == BUILDS.c.id)
    .where(*_DEVICE_MATCH, BUILDS.c.build_hash == bindparam("build_hash"),
           *(RESULTS.c[name] == bindparam(name) for name in CHOICE_FIELDS))
    # A concurrent re-tune of the key on PostgreSQL waits, then sees the other's candidates.
    .with_for_update(of=RESULTS)
)
_DEVICE_ID = select(DEVICES.c.id).where(*_DEVICE_MATCH)
_BUILD_ID = select(BUILDS.c.id).where(BUILDS.c.build_hash == bindparam("build_hash"))
_UPDATE_RESULT = update(RESULTS).where(RESULTS.c.id == bindparam("stored_id"))
_DELETE_CANDIDATES = delete(CANDIDATES).where(CANDIDATES.c.result_id == bindparam("stored_id"))


def find_for_write(session: Session, key: TuningKey) -> StoredTimes | None:
    """Id and times of the result stored for ``key``, locked FOR UPDATE where the backend can (SQLite
    writers are serialized by BEGIN IMMEDIATE already)."""
    params = {**key.device.model_dump(), **key.model_dump(exclude={"device"})}
    row = session.execute(_FIND_FOR_WRITE, params).one_or_none()
    return None if row is None else StoredTimes(row[0], stored_time(row[1]), stored_time(row[2]))


def _id(session: Session, find: Select, table: Table, params: dict[str, Any], **more: Any) -> int:
    found = session.execute(find, params).scalar()
    return found if found is not None else session.execute(insert(table), params | more).inserted_primary_key[0]


def write_record(session: Session, record: TuningRecord, stored: StoredTimes | None, now: datetime, *,
                 keep_times: bool = False) -> None:
    """Insert ``record``, or overwrite the stored result of its key and its candidates: ``updated_at``
    is ``now``, ``created_at`` kept; with ``keep_times`` (imports) the record's own times where it has them."""
    updated = (record.updated_at if keep_times else None) or now
    if stored is None:
        created = record.created_at or now
    else:
        created = (record.created_at if keep_times else None) or stored.created_at or now
    values = {"winner_family": record.winner.family, "winner_params": record.winner.params,
              **record.policy.model_dump(), "tool_version": record.tool_version,
              "created_at": min(created, updated), "updated_at": updated}
    if stored is None:
        values |= record.key.model_dump(exclude={"device", "build_hash"})
        values["device_id"] = _id(session, _DEVICE_ID, DEVICES, record.key.device.model_dump())
        values["build_id"] = _id(session, _BUILD_ID, BUILDS, {"build_hash": record.key.build_hash},
                                 library_version=record.tool_version)
        result_id = session.execute(insert(RESULTS), values).inserted_primary_key[0]
    else:
        result_id = stored.id
        session.execute(_UPDATE_RESULT, {**values, "stored_id": result_id})
        session.execute(_DELETE_CANDIDATES, {"stored_id": result_id})
    if record.candidates:
        session.execute(insert(CANDIDATES), [
            {"result_id": result_id, "family": c.config.family, "params": c.config.params,
             **c.model_dump(exclude={"config"})} for c in record.candidates])


def stale_build_ids(session: Session, current_build: str | Collection[str] | None) -> list[int]:
    """Ids of the builds that are not ``current_build`` (one hash or several); when that is ``None``,
    of every build but the one with the most recently updated result."""
    if current_build is not None:
        current = [current_build] if isinstance(current_build, str) else list(current_build)
        current = [h for h in current if "\x00" not in h]  # no stored hash holds one
        return list(session.scalars(select(BUILDS.c.id).where(BUILDS.c.build_hash.not_in(current))))
    newest = session.execute(select(RESULTS.c.build_id).order_by(RESULTS.c.updated_at.desc(), RESULTS.c.id.desc())
                             .limit(1)).scalar_one_or_none()
    return [] if newest is None else list(session.scalars(select(BUILDS.c.id).where(BUILDS.c.id != newest)))


# The generation counter is never parsed: a damaged one costs a serving process at most one reload.
BUMP_GENERATION = update(GENERATION).where(GENERATION.c.id == 1).values(generation=GENERATION.c.generation + 1)
READ_GENERATION = select(type_coerce(GENERATION.c.generation, NullType())).where(GENERATION.c.id == 1)
