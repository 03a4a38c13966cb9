"""The tables of the tuning database (schema revision 0003); they never leave ``db/``.

Constraint names are spelled out: Alembic's batch mode on SQLite finds constraints by
name, and the migrations must make exactly these tables (a test compares them).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Boolean, DateTime, Float, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from .schemas import CHOICE_FIELDS


def canonical_json(value: Any) -> str:
    """``value`` as the JSON columns store it: sorted keys, no spaces."""
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
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(timezone.utc).replace(tzinfo=None)
        return value


class Base(DeclarativeBase):
    pass


class Device(Base):
    __tablename__ = "devices"
    __table_args__ = (UniqueConstraint("name", "cc_major", "cc_minor", "sm_count", name="uq_devices_identity"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    cc_major: Mapped[int] = mapped_column(Integer)
    cc_minor: Mapped[int] = mapped_column(Integer)
    sm_count: Mapped[int] = mapped_column(Integer)


class KernelBuild(Base):
    __tablename__ = "kernel_builds"
    __table_args__ = (UniqueConstraint("build_hash", name="uq_kernel_builds_build_hash"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    build_hash: Mapped[str] = mapped_column(String(128))
    library_version: Mapped[str] = mapped_column(String(64))


class TuningResult(Base):
    """The winner for one key, with the policy that chose it."""

    __tablename__ = "tuning_results"
    __table_args__ = (UniqueConstraint("device_id", "build_id", *CHOICE_FIELDS, name="uq_tuning_results_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    device_id: Mapped[int] = mapped_column(
        ForeignKey("devices.id", ondelete="CASCADE", name="fk_tuning_results_device_id"))
    build_id: Mapped[int] = mapped_column(
        ForeignKey("kernel_builds.id", ondelete="CASCADE", name="fk_tuning_results_build_id"))
    head_dim: Mapped[int] = mapped_column(Integer)
    partial_dtype: Mapped[str] = mapped_column(String(16))
    out_dtype: Mapped[str] = mapped_column(String(16))
    stats_format: Mapped[str] = mapped_column(String(16))
    num_splits: Mapped[int] = mapped_column(Integer)
    rows: Mapped[int] = mapped_column(Integer)
    winner_family: Mapped[str] = mapped_column(String(32))
    winner_params: Mapped[dict[str, int]] = mapped_column(CanonicalJSON)
    l2_state: Mapped[str] = mapped_column(String(8))
    repeats: Mapped[int] = mapped_column(Integer)
    noise_margin: Mapped[float] = mapped_column(Float)
    tool_version: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)


class Candidate(Base):
    """One config measured for a result; times in microseconds."""

    __tablename__ = "tuning_candidates"
    __table_args__ = (UniqueConstraint("result_id", "family", "params", name="uq_tuning_candidates_config"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    result_id: Mapped[int] = mapped_column(
        ForeignKey("tuning_results.id", ondelete="CASCADE", name="fk_tuning_candidates_result_id"))
    family: Mapped[str] = mapped_column(String(32))
    params: Mapped[dict[str, int]] = mapped_column(CanonicalJSON)
    median_us: Mapped[float] = mapped_column(Float)
    p10_us: Mapped[float] = mapped_column(Float)
    p90_us: Mapped[float] = mapped_column(Float)
    samples: Mapped[int] = mapped_column(Integer)
    matched: Mapped[bool] = mapped_column(Boolean)


class TuningClaim(Base):
    """One key of a fleet's grid (``key``: the TuningKey's canonical JSON; no foreign keys, so pruning
    never touches a claim): ``open``, ``claimed`` (a lease until ``expires_at``, renewed by heartbeats),
    ``done`` or ``failed`` (``error`` says why).  Times are the database server's clock."""

    __tablename__ = "tuning_claims"
    __table_args__ = (UniqueConstraint("key", name="uq_tuning_claims_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[dict[str, Any]] = mapped_column(CanonicalJSON)
    state: Mapped[str] = mapped_column(String(16))
    owner: Mapped[str | None] = mapped_column(String(255), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer)
    claimed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)


class Generation(Base):
    """One row (id 1) whose counter every write of results bumps: a serving process compares it
    to notice new winners cheaply."""

    __tablename__ = "tuning_generation"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    generation: Mapped[int] = mapped_column(Integer)


DEVICES, BUILDS = Device.__table__, KernelBuild.__table__
RESULTS, CANDIDATES = TuningResult.__table__, Candidate.__table__
CLAIMS, GENERATION = TuningClaim.__table__, Generation.__table__
#: Every table, parents first (the fleet's two tables stand alone).
TABLES = (DEVICES, BUILDS, RESULTS, CANDIDATES, CLAIMS, GENERATION)
