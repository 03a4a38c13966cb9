"""The one place where rows of the tuning database become objects.

Every read of the store comes through here.  Columns are fetched raw (no
SQLAlchemy type processing; timestamps as text), each value is checked against
its column's model type, and the row is then validated by the pydantic models
of :mod:`.schemas`.  A row that fails is never an exception: it becomes a
:class:`Damage` naming the table, the id and the problem, and the store skips
it, warns about it or refuses, by its policy.  Hand edits, half-finished
migrations, restored dumps and bugs all look alike from here, so no case is
special: whatever a column holds, it is read or it is damage.

A result is usable when its own row, its device row and its build row parse;
a full record also needs its candidate rows to form a consistent record (the
winner among them and matched).  A candidate row that does not parse is left
out of its record.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, NamedTuple

from pydantic import ValidationError
from sqlalchemy import Boolean, ColumnElement, Float, Integer, Select, String, Table, inspect, select, type_coerce
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session
from sqlalchemy.sql.expression import ColumnClause, FunctionElement
from sqlalchemy.types import NullType

from .models import CanonicalJSON, Candidate, Device, KernelBuild, TuningResult, UTCDateTime
from .schemas import CandidateResult, DeviceInfo, KernelBuildInfo, TuningRecord

DEVICES, BUILDS = Device.__table__, KernelBuild.__table__
RESULTS, CANDIDATES = TuningResult.__table__, Candidate.__table__
#: Every table whose rows are read, parents first.
TABLES: tuple[Table, ...] = (DEVICES, BUILDS, RESULTS, CANDIDATES)


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


class StoredRecord(NamedTuple):
    """A record with the id of its result row."""

    id: int
    record: TuningRecord


class _Bad(Exception):
    """One value or row that does not parse; the message names the column."""


# -- raw columns ------------------------------------------------------------------------------


class _TimestampText(FunctionElement):
    """A timestamp column as text, so that no driver parses it (psycopg raises on 'infinity')."""

    type = String()
    inherit_cache = True


@compiles(_TimestampText)
def _timestamp_text_default(element, compiler, **kw):  # noqa: ANN001, ANN202
    # SQLite keeps whatever was stored; CAST gives text for every storage class.
    return f"CAST({compiler.process(element.clauses, **kw)} AS TEXT)"


@compiles(_TimestampText, "postgresql")
def _timestamp_text_pg(element, compiler, **kw):  # noqa: ANN001, ANN202
    # Fixed format whatever the DateStyle; AD/BC so that BC years do not read as AD.
    return f"to_char({compiler.process(element.clauses, **kw)}, 'YYYY-MM-DD HH24:MI:SS.US AD')"


def _raw(column: ColumnClause, prefix: str = "") -> ColumnElement:
    label = f"{prefix}{column.name}"
    if isinstance(column.type, UTCDateTime):
        return _TimestampText(column).label(label)
    return type_coerce(column, NullType()).label(label)


def raw_columns(table: Table, prefix: str = "") -> list[ColumnElement]:
    """``table``'s columns as raw values, labelled ``prefix + name``."""
    return [_raw(c, prefix) for c in table.columns]


# -- values -----------------------------------------------------------------------------------


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _integer(name: str, value: Any) -> int:
    if type(value) is int:
        return value
    raise _Bad(f"{name} is not an integer (stored {_shown(value)})")


def _number(name: str, value: Any) -> float:
    if type(value) in (int, float):
        return float(value)
    raise _Bad(f"{name} is not a number (stored {_shown(value)})")


def _boolean(name: str, value: Any) -> bool:
    if type(value) is bool:
        return value
    if type(value) is int and value in (0, 1):  # SQLite's booleans
        return bool(value)
    raise _Bad(f"{name} is not a boolean (stored {_shown(value)})")


def _text(name: str, value: Any) -> str:
    if type(value) is not str:
        raise _Bad(f"{name} is not text (stored {_shown(value)})")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # invalid bytes, read back as surrogates (see engine.py)
        raise _Bad(f"{name} is not valid UTF-8 text (stored {_shown(value)})") from None
    return value


_TIMESTAMP = re.compile(r"^(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:\.(\d{1,6}))?(?: AD)?$")


def parse_timestamp(value: Any) -> datetime | None:
    """A stored timestamp (naive UTC text) as an aware UTC datetime; ``None`` if it does not parse."""
    if type(value) is not str:
        return None
    match = _TIMESTAMP.match(value.strip())
    if match is None:
        return None
    *parts, fraction = match.groups()
    try:
        return datetime(*map(int, parts), int((fraction or "0").ljust(6, "0")), tzinfo=timezone.utc)
    except ValueError:  # month 13, day 32, ...
        return None


def _timestamp(name: str, value: Any) -> datetime:
    parsed = parse_timestamp(value)
    if parsed is None:
        raise _Bad(f"{name} is not a timestamp (stored {_shown(value)})")
    return parsed


def _json_object(name: str, value: Any) -> dict:
    text = _text(name, value)
    try:
        parsed = json.loads(text)
    except ValueError:
        raise _Bad(f"{name} is not JSON (stored {_shown(value)})") from None
    if not isinstance(parsed, dict):
        raise _Bad(f"{name} is not a JSON object (stored {_shown(value)})")
    return parsed


def _decoder(column: ColumnClause) -> Callable[[str, Any], Any]:
    # Order matters: the TypeDecorators first, Boolean before Integer.
    kind = column.type
    for types, decode in (
        (UTCDateTime, _timestamp),
        (CanonicalJSON, _json_object),
        (Boolean, _boolean),
        (Integer, _integer),
        (Float, _number),
        (String, _text),
    ):
        if isinstance(kind, types):
            return decode
    raise TypeError(f"decode.py has no reader for column {column} of type {kind!r}")


_DECODERS = {t.name: [(c.name, c.nullable, _decoder(c)) for c in t.columns] for t in TABLES}


def _values(table: Table, raw: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    values = {}
    for name, nullable, decode in _DECODERS[table.name]:
        value = raw[prefix + name]
        if value is None:
            if not nullable:
                raise _Bad(f"{name} is NULL")
            values[name] = None
        else:
            values[name] = decode(name, value)
    return values


def _validated(model: Any, data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"]) or model.__name__
        message = first["msg"].removeprefix("Value error, ")
        stored = f" (stored {_shown(first['input'])})" if not isinstance(first["input"], dict) else ""
        raise _Bad(f"{where}: {message}{stored}") from None


# -- rows -------------------------------------------------------------------------------------


def _row_id(raw: Mapping[str, Any], prefix: str = "") -> Any:
    return raw.get(prefix + "id")


def _unprefixed(raw: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix):]: v for k, v in raw.items() if k.startswith(prefix)} if prefix else dict(raw)


def device_row(raw: Mapping[str, Any], prefix: str = "") -> DeviceInfo:
    values = _values(DEVICES, raw, prefix)
    values.pop("id")
    return _validated(DeviceInfo, values)


def build_row(raw: Mapping[str, Any], prefix: str = "") -> KernelBuildInfo:
    values = _values(BUILDS, raw, prefix)
    values.pop("id")
    return _validated(KernelBuildInfo, values)


def candidate_row(raw: Mapping[str, Any]) -> tuple[int, CandidateResult]:
    v = _values(CANDIDATES, raw)
    candidate = _validated(
        CandidateResult,
        {
            "config": {"family": v["family"], "params": v["params"]},
            **{k: v[k] for k in ("median_us", "p10_us", "p90_us", "samples", "matched")},
        },
    )
    return v["result_id"], candidate


def _record_data(v: dict[str, Any], device: DeviceInfo, build: KernelBuildInfo) -> dict[str, Any]:
    return {
        "key": {
            "device": device,
            "build_hash": build.build_hash,
            **{k: v[k] for k in ("head_dim", "partial_dtype", "out_dtype", "stats_format", "num_splits", "rows")},
        },
        "winner": {"family": v["winner_family"], "params": v["winner_params"]},
        "policy": {k: v[k] for k in ("l2_state", "repeats", "noise_margin")},
        "tool_version": v["tool_version"],
        "created_at": v["created_at"],
        "updated_at": v["updated_at"],
    }


class _Parents:
    """Device and build rows decoded once each, by id; damage recorded once each."""

    def __init__(self, damage: dict[tuple[str, Any], Damage]):
        self.damage = damage
        self._seen: dict[tuple[str, Any], Any] = {}

    def get(self, table: Table, raw: Mapping[str, Any] | None, row_id: Any, prefix: str = "") -> Any:
        """The decoded parent, or raise _Bad naming why the child cannot use it."""
        if raw is None:
            raise _Bad(f"{_FK[table.name]} {_shown(row_id)} names no {table.name} row")
        where = (table.name, row_id)
        if where not in self._seen:
            try:
                self._seen[where] = (DEVICE_OR_BUILD[table.name](raw, prefix), None)
            except _Bad as bad:
                self.damage.setdefault(where, Damage(table.name, row_id, str(bad), _unprefixed(raw, prefix)))
                self._seen[where] = (None, bad)
        value, bad = self._seen[where]
        if bad is not None:
            raise _Bad(f"its {table.name} row (id {row_id}) does not parse")
        return value


DEVICE_OR_BUILD = {"devices": device_row, "kernel_builds": build_row}
_FK = {"devices": "device_id", "kernel_builds": "build_id"}


def _result(
    raw: Mapping[str, Any],
    parents: _Parents,
    device_raw: Mapping[str, Any] | None,
    build_raw: Mapping[str, Any] | None,
    prefixes: tuple[str, str] = ("", ""),
) -> tuple[dict[str, Any], DeviceInfo, KernelBuildInfo]:
    v = _values(RESULTS, raw)
    device = parents.get(DEVICES, device_raw, v["device_id"], prefixes[0])
    build = parents.get(BUILDS, build_raw, v["build_id"], prefixes[1])
    data = _record_data(v, device, build)
    _validated(TuningRecord, data)  # the row's own columns, before any candidate joins in
    return data, device, build


# -- reading ----------------------------------------------------------------------------------

_D, _B = "device.", "build."


# Outer joins: a result whose device_id or build_id names no row still shows.
_JOINED = RESULTS.outerjoin(DEVICES, RESULTS.c.device_id == DEVICES.c.id).outerjoin(
    BUILDS, RESULTS.c.build_id == BUILDS.c.id
)


def joined_results(where: Sequence[ColumnElement[bool]] = (), order_by: Iterable[Any] = ()) -> Select:
    """Raw result rows with their device and build rows."""
    return (
        select(*raw_columns(RESULTS), *raw_columns(DEVICES, _D), *raw_columns(BUILDS, _B))
        .select_from(_JOINED)
        .where(*where)
        .order_by(*order_by, RESULTS.c.id)
    )


class Read(NamedTuple):
    records: list[StoredRecord]
    damage: list[Damage]


def read_records(
    session: Session,
    where: Sequence[ColumnElement[bool]] = (),
    *,
    order_by: Iterable[Any] = (),
    candidates: bool = True,
) -> Read:
    """The records whose result rows match ``where`` (conditions on the ORM tables), and the damage met.

    Without ``candidates`` the records carry none (one query: what dispatch needs).
    """
    damage: dict[tuple[str, Any], Damage] = {}
    parents = _Parents(damage)
    rows = [dict(m) for m in session.execute(joined_results(where, order_by)).mappings()]
    found: list[tuple[int, dict[str, Any]]] = []
    for raw in rows:
        own = {k: v for k, v in raw.items() if not k.startswith((_D, _B))}
        try:
            data, _, _ = _result(
                own,
                parents,
                raw if raw[_D + "id"] is not None else None,
                raw if raw[_B + "id"] is not None else None,
                (_D, _B),
            )
        except _Bad as bad:
            damage.setdefault(("tuning_results", own["id"]), Damage("tuning_results", own["id"], str(bad), own))
            continue
        found.append((own["id"], data))
    per_result: dict[Any, list[tuple[Any, Mapping[str, Any]]]] = {}
    if candidates and found:
        ids = select(RESULTS.c.id).select_from(_JOINED).where(*where)
        stmt = select(*raw_columns(CANDIDATES)).where(CANDIDATES.c.result_id.in_(ids)).order_by(CANDIDATES.c.id)
        for m in session.execute(stmt).mappings():
            per_result.setdefault(m["result_id"], []).append((m["id"], dict(m)))
    records = []
    for result_id, data in found:
        record = assemble(result_id, data, per_result.get(result_id, []), damage)
        if record is not None:
            records.append(StoredRecord(result_id, record))
    return Read(records, list(damage.values()))


def assemble(
    result_id: Any,
    data: dict[str, Any],
    candidate_rows: Iterable[tuple[Any, Mapping[str, Any]]],
    damage: dict[tuple[str, Any], Damage],
) -> TuningRecord | None:
    """The record of a result row and its candidate rows; ``None`` (and damage) if they do not agree."""
    candidates = []
    for candidate_id, raw in candidate_rows:
        try:
            candidates.append(candidate_row(raw)[1])
        except _Bad as bad:
            damage.setdefault(
                ("tuning_candidates", candidate_id), Damage("tuning_candidates", candidate_id, str(bad), raw)
            )
    try:
        return _validated(TuningRecord, {**data, "candidates": candidates})
    except _Bad as bad:
        damage.setdefault(("tuning_results", result_id), Damage("tuning_results", result_id, str(bad), {}))
        return None


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
    raw = {
        t.name: {m["id"]: dict(m) for m in session.execute(select(*raw_columns(t)).order_by(t.c.id)).mappings()}
        if t.name in present
        else {}
        for t in TABLES
    }
    damage: dict[tuple[str, Any], Damage] = {}
    parents = _Parents(damage)
    builds = {}
    for build_id, row in raw["kernel_builds"].items():
        try:
            builds[build_id] = parents.get(BUILDS, row, build_id)
        except _Bad:
            pass
    for device_id, row in raw["devices"].items():
        try:
            parents.get(DEVICES, row, device_id)
        except _Bad:
            pass
    found: dict[Any, dict[str, Any]] = {}
    for result_id, row in raw["tuning_results"].items():
        try:
            v = _values(RESULTS, row)
            data, _, _ = _result(
                row, parents, raw["devices"].get(v["device_id"]), raw["kernel_builds"].get(v["build_id"])
            )
        except _Bad as bad:
            damage.setdefault(("tuning_results", result_id), Damage("tuning_results", result_id, str(bad), row))
            continue
        found[result_id] = data
    per_result: dict[Any, list[tuple[Any, dict[str, Any]]]] = {}
    for candidate_id, row in raw["tuning_candidates"].items():
        result_id = row["result_id"]
        if result_id not in raw["tuning_results"]:
            problem = f"result_id {_shown(result_id)} names no tuning_results row"
            damage[("tuning_candidates", candidate_id)] = Damage("tuning_candidates", candidate_id, problem, row)
        else:
            per_result.setdefault(result_id, []).append((candidate_id, row))
    records = []
    for result_id, data in found.items():
        record = assemble(result_id, data, per_result.get(result_id, []), damage)
        if record is not None:
            records.append(StoredRecord(result_id, record))
    # Damage found by assemble has no raw row yet: give it the stored one.
    listed = [
        d if d.raw else Damage(d.table, d.row_id, d.problem, raw[d.table].get(d.row_id, {}))
        for d in damage.values()
    ]
    return Scan(records, builds, listed, raw)
