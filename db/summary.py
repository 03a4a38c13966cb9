"""Summaries of a set of records (``kvsplit db stats``); pure functions, no database."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime

from .schemas import BuildStats, DeviceInfo, DeviceStats, StoreStats, TuningRecord


def _span(records: list[TuningRecord]) -> tuple[datetime | None, datetime | None]:
    times = [r.updated_at for r in records if r.updated_at is not None]
    return (min(times), max(times)) if times else (None, None)


def summarize(
    url: str,
    records: list[TuningRecord],
    builds: dict[str, str],
    stale: set[str],
    current_build: str | None = None,
) -> StoreStats:
    """Build :class:`StoreStats` from every record, every build (hash -> library
    version) and the hashes of the stale builds.

    ``mean_speedup`` is the arithmetic mean, over the keys of a device that
    measured kv_split=1, of (kv_split=1 median) / (winner median).
    """
    per_device: dict[DeviceInfo, list[TuningRecord]] = defaultdict(list)
    per_build: dict[str, list[TuningRecord]] = defaultdict(list)
    for record in records:
        per_device[record.key.device].append(record)
        per_build[record.key.build_hash].append(record)

    devices = []
    for device, recs in sorted(per_device.items(), key=lambda item: item[0].label):
        speedups = [s for s in (r.speedup for r in recs) if s is not None]
        oldest, newest = _span(recs)
        devices.append(
            DeviceStats(
                device=device,
                keys=len(recs),
                mean_speedup=sum(speedups) / len(speedups) if speedups else None,
                max_speedup=max(speedups) if speedups else None,
                oldest=oldest,
                newest=newest,
            )
        )

    build_stats = [
        BuildStats(
            build_hash=h,
            library_version=version,
            keys=len(per_build.get(h, [])),
            newest=_span(per_build.get(h, []))[1],
            stale=h in stale,
        )
        for h, version in sorted(builds.items())
    ]
    oldest, newest = _span(records)
    return StoreStats(
        url=url,
        keys=len(records),
        devices=devices,
        builds=build_stats,
        current_build=current_build,
        oldest=oldest,
        newest=newest,
    )
