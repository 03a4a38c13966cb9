"""The tables of the tuning database (schema revision 0003); they never leave ``db/``.

Constraint names are spelled out: Alembic's batch mode on SQLite finds constraints by
name, and the migrations must make exactly these tables (a test compares them)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (Boolean, Column, DateTime, Float, ForeignKey, Integer, MetaData, String, Table, Text,
                        UniqueConstraint)
from sqlalchemy.types import TypeDecorator

from .schemas import CHOICE_FIELDS


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


class CanonicalJSON(TypeDecorator):
    """A JSON object stored as canonical text, so that equal objects are equal strings: unique
    constraints then hold on SQLite and PostgreSQL alike (PostgreSQL's ``json`` has no equality)."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> str | None:
        return None if value is None else canonical_json(value)


class UTCDateTime(TypeDecorator):
    """A timestamp stored as naive UTC (SQLite keeps no time zone, so no backend does)."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        return value if value is None or value.tzinfo is None else value.astimezone(timezone.utc).replace(tzinfo=None)


METADATA = MetaData()


def _table(name: str, columns: dict[str, Any], *constraints: UniqueConstraint, nullable: tuple[str, ...] = ()) -> Table:
    # An integer id, then the columns, NOT NULL unless named in ``nullable`` (a tuple: the type and a foreign key).
    return Table(name, METADATA, Column("id", Integer, primary_key=True),
                 *(Column(n, *(t if isinstance(t, tuple) else (t,)), nullable=n in nullable)
                   for n, t in columns.items()), *constraints)


def _parent(table: str, name: str) -> tuple[Any, ...]:
    return Integer, ForeignKey(f"{table}.id", ondelete="CASCADE", name=name)


DEVICES = _table("devices", {"name": String(128), "cc_major": Integer, "cc_minor": Integer, "sm_count": Integer},
                 UniqueConstraint("name", "cc_major", "cc_minor", "sm_count", name="uq_devices_identity"))
BUILDS = _table("kernel_builds", {"build_hash": String(128), "library_version": String(64)},
                UniqueConstraint("build_hash", name="uq_kernel_builds_build_hash"))
#: The winner for one key, with the policy that chose it.
RESULTS = _table("tuning_results", {
    "device_id": _parent("devices", "fk_tuning_results_device_id"),
    "build_id": _parent("kernel_builds", "fk_tuning_results_build_id"),
    "head_dim": Integer, "partial_dtype": String(16), "out_dtype": String(16), "stats_format": String(16),
    "num_splits": Integer, "rows": Integer,
    "winner_family": String(32), "winner_params": CanonicalJSON,
    "l2_state": String(8), "repeats": Integer, "noise_margin": Float,
    "tool_version": String(64), "created_at": UTCDateTime, "updated_at": UTCDateTime,
}, UniqueConstraint("device_id", "build_id", *CHOICE_FIELDS, name="uq_tuning_results_key"))
#: One config measured for a result; times in microseconds.
CANDIDATES = _table("tuning_candidates", {
    "result_id": _parent("tuning_results", "fk_tuning_candidates_result_id"),
    "family": String(32), "params": CanonicalJSON,
    "median_us": Float, "p10_us": Float, "p90_us": Float, "samples": Integer, "matched": Boolean,
}, UniqueConstraint("result_id", "family", "params", name="uq_tuning_candidates_config"))
#: One key of a fleet's grid (``key``: the TuningKey's canonical JSON; no foreign keys, so pruning never
#: touches a claim): ``open``, ``claimed`` (a lease until ``expires_at``, renewed by heartbeats), ``done``
#: or ``failed`` (``error`` says why).  Times are the database server's clock.
CLAIMS = _table("tuning_claims", {
    "key": CanonicalJSON, "state": String(16), "owner": String(255), "attempts": Integer,
    "claimed_at": UTCDateTime, "heartbeat_at": UTCDateTime, "expires_at": UTCDateTime, "error": Text,
}, UniqueConstraint("key", name="uq_tuning_claims_key"),
    nullable=("owner", "claimed_at", "heartbeat_at", "expires_at", "error"))
#: One row (id 1) whose counter every write of results bumps: a serving process polls it to see new winners cheaply.
GENERATION = _table("tuning_generation", {"generation": Integer})
#: Every table, parents first (the fleet's two tables stand alone).
TABLES = (DEVICES, BUILDS, RESULTS, CANDIDATES, CLAIMS, GENERATION)
