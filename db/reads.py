"""The queries that read the store: raw rows in, records and damage out (decoded by :mod:`.decode`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from sqlalchemy import ColumnElement, Select, inspect, select
from sqlalchemy.orm import Session

from .decode import (
    BUILDS,
    CANDIDATES,
    CLAIMS,
    DEVICES,
    GENERATION,
    RESULTS,
    TABLES,
    Damage,
    Parents,
    StoredRecord,
    Unparsable,
    assemble,
    claim_row,
    generation_row,
    raw_columns,
    result_row,
    row_values,
    shown,
)
from .schemas import KernelBuildInfo

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
    parents = Parents(damage)
    rows = [dict(m) for m in session.execute(joined_results(where, order_by)).mappings()]
    found: list[tuple[int, dict[str, Any]]] = []
    for raw in rows:
        own = {k: v for k, v in raw.items() if not k.startswith((_D, _B))}
        try:
            data, _, _ = result_row(
                own,
                parents,
                raw if raw[_D + "id"] is not None else None,
                raw if raw[_B + "id"] is not None else None,
                (_D, _B),
            )
        except Unparsable as bad:
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
    parents = Parents(damage)
    builds = {}
    for build_id, row in raw["kernel_builds"].items():
        try:
            builds[build_id] = parents.get(BUILDS, row, build_id)
        except Unparsable:
            pass
    for device_id, row in raw["devices"].items():
        try:
            parents.get(DEVICES, row, device_id)
        except Unparsable:
            pass
    found: dict[Any, dict[str, Any]] = {}
    for result_id, row in raw["tuning_results"].items():
        try:
            v = row_values(RESULTS, row)
            data, _, _ = result_row(
                row, parents, raw["devices"].get(v["device_id"]), raw["kernel_builds"].get(v["build_id"])
            )
        except Unparsable as bad:
            damage.setdefault(("tuning_results", result_id), Damage("tuning_results", result_id, str(bad), row))
            continue
        found[result_id] = data
    per_result: dict[Any, list[tuple[Any, dict[str, Any]]]] = {}
    for candidate_id, row in raw["tuning_candidates"].items():
        result_id = row["result_id"]
        if result_id not in raw["tuning_results"]:
            problem = f"result_id {shown(result_id)} names no tuning_results row"
            damage[("tuning_candidates", candidate_id)] = Damage("tuning_candidates", candidate_id, problem, row)
        else:
            per_result.setdefault(result_id, []).append((candidate_id, row))
    records = []
    for result_id, data in found.items():
        record = assemble(result_id, data, per_result.get(result_id, []), damage)
        if record is not None:
            records.append(StoredRecord(result_id, record))
    for table, decode in ((CLAIMS, claim_row), (GENERATION, generation_row)):
        for row_id, row in raw[table.name].items():
            try:
                decode(row)
            except Unparsable as bad:
                damage[(table.name, row_id)] = Damage(table.name, row_id, str(bad), row)
    # Damage found by assemble has no raw row yet: give it the stored one.
    listed = [
        d if d.raw else Damage(d.table, d.row_id, d.problem, raw[d.table].get(d.row_id, {}))
        for d in damage.values()
    ]
    return Scan(records, builds, listed, raw)
