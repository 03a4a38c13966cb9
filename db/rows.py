"""Session-level helpers that read and write ORM rows; used by :mod:`.store` only."""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime
from typing import NamedTuple

from sqlalchemy import ColumnElement, bindparam, delete, false, func, insert, or_, select, update
from sqlalchemy.orm import Session

from .decode import Damage, parse_timestamp, raw_columns
from .reads import read_records
from .models import KEY_COLUMNS, Candidate, Device, KernelBuild, TuningResult
from .schemas import DeviceInfo, TuningKey, TuningRecord


def device_is(device: DeviceInfo | str) -> list[ColumnElement[bool]]:
    """Conditions on :class:`Device`: exact for a DeviceInfo, part of the name for a string."""
    if isinstance(device, str):
        if "\x00" in device:  # no stored name holds one; PostgreSQL would refuse the parameter
            return [false()]
        return [func.lower(Device.name).contains(device.lower(), autoescape=True)]
    return [
        Device.name == device.name,
        Device.cc_major == device.cc_major,
        Device.cc_minor == device.cc_minor,
        Device.sm_count == device.sm_count,
    ]


def key_conditions(key: TuningKey) -> list[ColumnElement[bool]]:
    """Conditions on a result row (joined to its device and build) that pick ``key``."""
    r = TuningResult
    return [
        *device_is(key.device),
        KernelBuild.build_hash == key.build_hash,
        r.head_dim == key.head_dim,
        r.partial_dtype == key.partial_dtype,
        r.out_dtype == key.out_dtype,
        r.stats_format == key.stats_format,
        r.num_splits == key.num_splits,
        r.rows == key.rows,
    ]


class StoredTimes(NamedTuple):
    """A stored result's id and times; a time that does not parse is ``None`` (the write replaces it)."""

    id: int
    created_at: datetime | None
    updated_at: datetime | None


# The write path runs prebuilt statements with bound parameters: building the
# expressions anew costs more Python than the SQL itself, and SQLite writers
# hold the database's one write lock for all of it.
_R, _C = TuningResult.__table__, Candidate.__table__
_DEVICE_MATCH = [
    Device.name == bindparam("name"),
    Device.cc_major == bindparam("cc_major"),
    Device.cc_minor == bindparam("cc_minor"),
    Device.sm_count == bindparam("sm_count"),
]
_RAW_TIMES = [c for c in raw_columns(_R) if c.name in ("created_at", "updated_at")]
_FIND_FOR_WRITE = (
    select(_R.c.id, *_RAW_TIMES)
    .join(Device.__table__, _R.c.device_id == Device.id)
    .join(KernelBuild.__table__, _R.c.build_id == KernelBuild.id)
    .where(
        *_DEVICE_MATCH,
        KernelBuild.build_hash == bindparam("build_hash"),
        *(_R.c[name] == bindparam(name) for name in KEY_COLUMNS[2:]),
    )
    # Makes a concurrent re-tune of the key on PostgreSQL wait, then see the
    # other writer's candidates before replacing them.
    .with_for_update(of=_R)
)
_DEVICE_ID = select(Device.id).where(*_DEVICE_MATCH)
_BUILD_ID = select(KernelBuild.id).where(KernelBuild.build_hash == bindparam("build_hash"))
_INSERT_DEVICE = insert(Device.__table__)
_INSERT_BUILD = insert(KernelBuild.__table__)
_INSERT_RESULT = insert(_R)
_UPDATE_RESULT = update(_R).where(_R.c.id == bindparam("stored_id"))
_DELETE_CANDIDATES = delete(_C).where(_C.c.result_id == bindparam("stored_id"))
_INSERT_CANDIDATES = insert(_C)


def find_for_write(session: Session, key: TuningKey) -> StoredTimes | None:
    """Id and timestamps of the result for ``key``, locked FOR UPDATE where the backend can.

    (SQLite writers are already serialized by BEGIN IMMEDIATE.)
    """
    params = {**key.device.model_dump(), **key.model_dump(exclude={"device"})}
    row = session.execute(_FIND_FOR_WRITE, params).one_or_none()
    return None if row is None else StoredTimes(row[0], parse_timestamp(row[1]), parse_timestamp(row[2]))


def _device_id(session: Session, device: DeviceInfo) -> int:
    params = device.model_dump()
    found = session.execute(_DEVICE_ID, params).scalar()
    return found if found is not None else session.execute(_INSERT_DEVICE, params).inserted_primary_key[0]


def _build_id(session: Session, build_hash: str, library_version: str) -> int:
    found = session.execute(_BUILD_ID, {"build_hash": build_hash}).scalar()
    if found is not None:
        return found
    params = {"build_hash": build_hash, "library_version": library_version}
    return session.execute(_INSERT_BUILD, params).inserted_primary_key[0]


def write_record(
    session: Session,
    record: TuningRecord,
    stored: StoredTimes | None,
    now: datetime,
    *,
    keep_times: bool = False,
) -> None:
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
        "winner_family": record.winner.family,
        "winner_params": dict(record.winner.params),
        "l2_state": record.policy.l2_state,
        "repeats": record.policy.repeats,
        "noise_margin": record.policy.noise_margin,
        "tool_version": record.tool_version,
        "created_at": min(created, updated),
        "updated_at": updated,
    }
    if stored is None:
        key = record.key
        values |= key.model_dump(exclude={"device", "build_hash"})
        values["device_id"] = _device_id(session, key.device)
        values["build_id"] = _build_id(session, key.build_hash, record.tool_version)
        result_id = session.execute(_INSERT_RESULT, values).inserted_primary_key[0]
    else:
        result_id = stored.id
        session.execute(_UPDATE_RESULT, {**values, "stored_id": result_id})
        session.execute(_DELETE_CANDIDATES, {"stored_id": result_id})
    if record.candidates:
        session.execute(
            _INSERT_CANDIDATES,
            [
                {
                    "result_id": result_id,
                    "family": cand.config.family,
                    "params": dict(cand.config.params),
                    "median_us": cand.median_us,
                    "p10_us": cand.p10_us,
                    "p90_us": cand.p90_us,
                    "samples": cand.samples,
                    "matched": cand.matched,
                }
                for cand in record.candidates
            ],
        )


def stale_build_ids(session: Session, current_build: str | Collection[str] | None) -> list[int]:
    """Ids of stale builds: not ``current_build`` (one hash or several), or when ``None``, not the
    most recently updated one."""
    if current_build is not None:
        current = [current_build] if isinstance(current_build, str) else list(current_build)
        current = [h for h in current if "\x00" not in h]  # no stored hash holds one
        return list(session.scalars(select(KernelBuild.id).where(KernelBuild.build_hash.not_in(current))))
    newest = session.execute(
        select(TuningResult.build_id).order_by(TuningResult.updated_at.desc(), TuningResult.id.desc()).limit(1)
    ).scalar_one_or_none()
    if newest is None:
        return []
    return list(session.scalars(select(KernelBuild.id).where(KernelBuild.id != newest)))


def prune_results(
    session: Session,
    *,
    stale_builds: bool,
    current_build: str | Collection[str] | None,
    other_devices_than: DeviceInfo | str | None,
    cutoff: datetime | None,
    dry_run: bool,
) -> tuple[list[TuningKey], list[Damage]]:
    """Delete (unless ``dry_run``) the results matching any criterion; return their keys and the damage met.

    Devices and builds left without results are deleted too.  A string
    ``other_devices_than`` that matches no device raises ``ValueError``: a typo
    must not delete every result.  Rows that do not parse are left alone.
    """
    r = TuningResult
    criteria = []
    if stale_builds:
        stale = stale_build_ids(session, current_build)
        if stale:
            criteria.append(r.build_id.in_(stale))
    if other_devices_than is not None:
        keep = select(Device.id).where(*device_is(other_devices_than))
        if isinstance(other_devices_than, str) and session.scalar(keep.limit(1)) is None:
            raise ValueError(f"no device in the database matches {other_devices_than!r}")
        criteria.append(r.device_id.not_in(keep))
    if cutoff is not None:
        criteria.append(r.updated_at < cutoff)
    if not criteria:
        return [], []
    found = read_records(session, [or_(*criteria)], candidates=False)
    keys = [stored.record.key for stored in found.records]
    if not dry_run and found.records:
        ids = [stored.id for stored in found.records]
        session.execute(delete(Candidate).where(Candidate.result_id.in_(ids)))
        session.execute(delete(r).where(r.id.in_(ids)))
        session.execute(delete(Device).where(Device.id.not_in(select(r.device_id))))
        session.execute(delete(KernelBuild).where(KernelBuild.id.not_in(select(r.build_id))))
    return keys, found.damage


def merge_records(
    session: Session, records: list[TuningRecord], *, rule: str, dry_run: bool, now: datetime
) -> dict[str, int]:
    """Apply an import's merge ``rule`` to every record; counts of inserted/replaced/kept."""
    counts = {"inserted": 0, "replaced": 0, "kept": 0}
    for record in records:
        stored = find_for_write(session, record.key)
        if stored is None:
            counts["inserted"] += 1
        elif rule == "replace" or (
            rule == "newer"
            and record.updated_at is not None
            and (stored.updated_at is None or record.updated_at > stored.updated_at)
        ):
            counts["replaced"] += 1
        else:
            counts["kept"] += 1
            continue
        if not dry_run:
            write_record(session, record, stored, now, keep_times=True)
    return counts
