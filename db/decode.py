"""The one place where rows of the tuning database become objects.

Every read of the store comes through here (the queries are in
:mod:`.reads`).  Columns are fetched raw (no SQLAlchemy type processing;
timestamps as text, see :func:`raw_columns`), each value is checked against
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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, NamedTuple

from pydantic import ValidationError
from sqlalchemy import Boolean, ColumnElement, Float, Integer, String, Table, type_coerce
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.expression import ColumnClause, FunctionElement
from sqlalchemy.types import NullType

from .models import CanonicalJSON, Candidate, Device, Generation, KernelBuild, TuningClaim, TuningResult, UTCDateTime
from .schemas import CandidateResult, ClaimInfo, DeviceInfo, KernelBuildInfo, TuningRecord

DEVICES, BUILDS = Device.__table__, KernelBuild.__table__
RESULTS, CANDIDATES = TuningResult.__table__, Candidate.__table__
CLAIMS, GENERATION = TuningClaim.__table__, Generation.__table__
#: Every table whose rows are read, parents first (the fleet's two tables stand alone).
TABLES: tuple[Table, ...] = (DEVICES, BUILDS, RESULTS, CANDIDATES, CLAIMS, GENERATION)


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


class Unparsable(Exception):
    """One value or row that does not parse; the message names the column (never leaves ``db/``)."""


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


def shown(value: Any) -> str:
    """A stored value for a message: its repr, cut to 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _integer(name: str, value: Any) -> int:
    if type(value) is int:
        return value
    raise Unparsable(f"{name} is not an integer (stored {shown(value)})")


def _number(name: str, value: Any) -> float:
    if type(value) in (int, float):
        return float(value)
    raise Unparsable(f"{name} is not a number (stored {shown(value)})")


def _boolean(name: str, value: Any) -> bool:
    if type(value) is bool:
        return value
    if type(value) is int and value in (0, 1):  # SQLite's booleans
        return bool(value)
    raise Unparsable(f"{name} is not a boolean (stored {shown(value)})")


def _text(name: str, value: Any) -> str:
    if type(value) is not str:
        raise Unparsable(f"{name} is not text (stored {shown(value)})")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # invalid bytes, read back as surrogates (see engine.py)
        raise Unparsable(f"{name} is not valid UTF-8 text (stored {shown(value)})") from None
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
        raise Unparsable(f"{name} is not a timestamp (stored {shown(value)})")
    return parsed


def _json_object(name: str, value: Any) -> dict:
    text = _text(name, value)
    try:
        parsed = json.loads(text)
    except ValueError:
        raise Unparsable(f"{name} is not JSON (stored {shown(value)})") from None
    if not isinstance(parsed, dict):
        raise Unparsable(f"{name} is not a JSON object (stored {shown(value)})")
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


def row_values(table: Table, raw: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    values = {}
    for name, nullable, decode in _DECODERS[table.name]:
        value = raw[prefix + name]
        if value is None:
            if not nullable:
                raise Unparsable(f"{name} is NULL")
            values[name] = None
        else:
            values[name] = decode(name, value)
    return values


def _validated(model: Any, data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except TypeError as error:  # a plain validator (the kernel config's) that met a stranger value
        raise Unparsable(f"{model.__name__}: {error}") from None
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"]) or model.__name__
        message = first["msg"].removeprefix("Value error, ")
        stored = f" (stored {shown(first['input'])})" if not isinstance(first["input"], dict) else ""
        raise Unparsable(f"{where}: {message}{stored}") from None


# -- rows -------------------------------------------------------------------------------------


def unprefixed(raw: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix):]: v for k, v in raw.items() if k.startswith(prefix)} if prefix else dict(raw)


def device_row(raw: Mapping[str, Any], prefix: str = "") -> DeviceInfo:
    values = row_values(DEVICES, raw, prefix)
    values.pop("id")
    return _validated(DeviceInfo, values)


def build_row(raw: Mapping[str, Any], prefix: str = "") -> KernelBuildInfo:
    values = row_values(BUILDS, raw, prefix)
    values.pop("id")
    return _validated(KernelBuildInfo, values)


def candidate_row(raw: Mapping[str, Any]) -> tuple[int, CandidateResult]:
    v = row_values(CANDIDATES, raw)
    candidate = _validated(
        CandidateResult,
        {
            "config": {"family": v["family"], "params": v["params"]},
            **{k: v[k] for k in ("median_us", "p10_us", "p90_us", "samples", "matched")},
        },
    )
    return v["result_id"], candidate


def claim_row(raw: Mapping[str, Any]) -> ClaimInfo:
    """A row of ``tuning_claims`` (the key is canonical JSON of a TuningKey)."""
    values = row_values(CLAIMS, raw)
    values.pop("id")
    return _validated(ClaimInfo, values)


def generation_row(raw: Mapping[str, Any]) -> int:
    """The counter of a ``tuning_generation`` row (never negative)."""
    value = row_values(GENERATION, raw)["generation"]
    if value < 0:
        raise Unparsable(f"generation is negative (stored {shown(value)})")
    return value


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


class Parents:
    """Device and build rows decoded once each, by id; damage recorded once each."""

    def __init__(self, damage: dict[tuple[str, Any], Damage]):
        self.damage = damage
        self._seen: dict[tuple[str, Any], Any] = {}

    def get(self, table: Table, raw: Mapping[str, Any] | None, row_id: Any, prefix: str = "") -> Any:
        """The decoded parent, or raise Unparsable naming why the child cannot use it."""
        if raw is None:
            raise Unparsable(f"{_FK[table.name]} {shown(row_id)} names no {table.name} row")
        where = (table.name, row_id)
        if where not in self._seen:
            try:
                self._seen[where] = (DEVICE_OR_BUILD[table.name](raw, prefix), None)
            except Unparsable as bad:
                self.damage.setdefault(where, Damage(table.name, row_id, str(bad), unprefixed(raw, prefix)))
                self._seen[where] = (None, bad)
        value, bad = self._seen[where]
        if bad is not None:
            raise Unparsable(f"its {table.name} row (id {row_id}) does not parse")
        return value


DEVICE_OR_BUILD = {"devices": device_row, "kernel_builds": build_row}
_FK = {"devices": "device_id", "kernel_builds": "build_id"}


def result_row(
    raw: Mapping[str, Any],
    parents: Parents,
    device_raw: Mapping[str, Any] | None,
    build_raw: Mapping[str, Any] | None,
    prefixes: tuple[str, str] = ("", ""),
) -> tuple[dict[str, Any], DeviceInfo, KernelBuildInfo]:
    v = row_values(RESULTS, raw)
    device = parents.get(DEVICES, device_raw, v["device_id"], prefixes[0])
    build = parents.get(BUILDS, build_raw, v["build_id"], prefixes[1])
    data = _record_data(v, device, build)
    _validated(TuningRecord, data)  # the row's own columns, before any candidate joins in
    return data, device, build


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
        except Unparsable as bad:
            damage.setdefault(
                ("tuning_candidates", candidate_id), Damage("tuning_candidates", candidate_id, str(bad), raw)
            )
    try:
        return _validated(TuningRecord, {**data, "candidates": candidates})
    except Unparsable as bad:
        damage.setdefault(("tuning_results", result_id), Damage("tuning_results", result_id, str(bad), {}))
        return None
