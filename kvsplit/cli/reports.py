"""The reports of ``kvsplit db stats``, ``kvsplit db progress`` and ``kvsplit tune --status``, each
built from one read of the store.

The models are what ``--json`` prints, field by field.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Collection, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from ..db.schemas import ClaimInfo, DeviceInfo, TuningKey, TuningRecord

if TYPE_CHECKING:
    from ..db.claims import Claims
    from ..db.store import Store


class DeviceStats(BaseModel):
    """Per-device summary; speed-ups are over kv_split=1, among keys that measured it."""

    device: DeviceInfo
    keys: int
    mean_speedup: float | None
    max_speedup: float | None
    oldest: datetime | None
    newest: datetime | None


class BuildStats(BaseModel):
    """Per-build summary; ``stale`` as :meth:`kvsplit.db.Store.inventory` says; ``installed``: a build
    of this kvsplit (CUDA or CPU)."""

    build_hash: str
    library_version: str
    keys: int
    newest: datetime | None
    stale: bool
    installed: bool = False


class StoreStats(BaseModel):
    """Summary of a whole database."""

    url: str
    keys: int
    devices: list[DeviceStats]
    builds: list[BuildStats]
    current_build: str | None
    oldest: datetime | None
    newest: datetime | None


def _span(records: list[TuningRecord]) -> dict[str, Any]:
    times = [r.updated_at for r in records if r.updated_at is not None]
    return {"oldest": min(times, default=None), "newest": max(times, default=None)}


def store_stats(store: Store, current_build: str | Collection[str] | None = None,
                installed: Collection[str] = ()) -> StoreStats:
    """Keys per device, mean speed-up of the winner over kv_split=1, times, and stale builds (builds
    other than ``current_build``, or all but the most recently tuned); ``installed`` marks builds."""
    records, builds, stale = store.inventory(current_build)
    per_device: dict[DeviceInfo, list[TuningRecord]] = defaultdict(list)
    per_build: dict[str, list[TuningRecord]] = defaultdict(list)
    for record in records:
        per_device[record.key.device].append(record)
        per_build[record.key.build_hash].append(record)
    devices = []
    for device, recs in sorted(per_device.items(), key=lambda item: item[0].label):
        speedups = [s for s in (r.speedup for r in recs) if s is not None]
        devices.append(DeviceStats(device=device, keys=len(recs), max_speedup=max(speedups, default=None),
                                   mean_speedup=sum(speedups) / len(speedups) if speedups else None, **_span(recs)))
    versions = sorted({b.build_hash: b.library_version for b in builds}.items())
    named = (current_build if current_build is None or isinstance(current_build, str)
             else ",".join(sorted(current_build)))
    return StoreStats(
        url=store.url, keys=len(records), devices=devices, current_build=named,
        builds=[BuildStats(build_hash=h, library_version=v, keys=len(per_build[h]),
                           newest=_span(per_build[h])["newest"], stale=h in stale, installed=h in installed)
                for h, v in versions],
        **_span(records))


class WorkerProgress(BaseModel):
    """A worker (host/pid/device) that holds live claims."""

    owner: str
    claimed: int
    since: datetime | None
    heartbeat_at: datetime | None


class Progress(BaseModel):
    """How far a grid (or every registered key) is: ``done + claimed + failed + left == keys``, with
    ``expired`` claims among those ``left`` (see :func:`kvsplit.db.claims.standing`)."""

    url: str
    now: datetime
    keys: int
    done: int
    claimed: int
    failed: int
    left: int
    expired: int
    attempts: int
    workers: list[WorkerProgress]
    failures: list[ClaimInfo]


def fleet_progress(claims: Claims, keys: Sequence[TuningKey] | None = None) -> Progress:
    """How far ``keys`` are; without ``keys``, every key ever registered (rows that do not parse left out)."""
    now, surveyed = claims.survey(keys)
    counts = Counter(at for _, _, at in surveyed)
    held: dict[str, list[ClaimInfo]] = defaultdict(list)
    for _, claim, at in surveyed:
        if at == "claimed":
            held[claim.owner or "?"].append(claim)
    return Progress(
        url=claims.url, now=now, keys=len(surveyed), done=counts["done"], claimed=counts["claimed"],
        failed=counts["failed"], left=counts["left"] + counts["expired"], expired=counts["expired"],
        attempts=sum(claim.attempts for _, claim, _ in surveyed if claim is not None),
        workers=[WorkerProgress(owner=owner, claimed=len(mine),
                                since=min((c.claimed_at for c in mine if c.claimed_at), default=None),
                                heartbeat_at=max((c.heartbeat_at for c in mine if c.heartbeat_at), default=None))
                 for owner, mine in sorted(held.items())],
        failures=[claim for _, claim, at in surveyed if at == "failed"])
