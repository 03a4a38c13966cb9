"""What leaves the store: pydantic models, the plain config type, and the store's errors.

Times are microseconds, timestamps aware UTC, dtypes torch's names.  Unknown fields are refused.
A config's vocabulary is checked above the store, by a subclass given as ``context={"config": ...}``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator
from pydantic_core import core_schema


class StoreError(Exception):
    """The tuning database cannot be used; the message is one line for people, shown as is."""


class NoDatabase(StoreError):
    """Nothing to read: no such SQLite file, memory, or no kvsplit tables (commands that only read)."""


class SchemaTooNew(StoreError):
    """The database's schema revision is newer than this kvsplit knows."""

    def __init__(self, message: str, revision: str) -> None:
        super().__init__(message)
        self.revision = revision


class SchemaDamaged(StoreError):
    """The schema version table is missing, empty, doubled or garbage, or a table is missing."""


#: The remedy for damaged rows, named in every message about them.
REPAIR_HINT = "run `kvsplit db repair` to move them to a quarantine file (`--dry-run` lists them first)"


class DamagedRows(StoreError):
    """Rows that do not parse; ``damage`` holds one ``kvsplit.db.rows.Damage`` (table, id, problem) each.
    Its message (how many, the first three, the remedy) is also the warning of a store that skips them."""

    def __init__(self, url: str, damage: list) -> None:
        self.damage = list(damage)
        count = len(self.damage)
        first = "; ".join(map(str, self.damage[:3])) + (f"; and {count - 3} more" if count > 3 else "")
        super().__init__(f"{url}: {count} {'row does' if count == 1 else 'rows do'} not parse ({first}); {REPAIR_HINT}")


class DbWarning(UserWarning):
    """A database problem that did not stop the caller: an upgrade, a fall-back to memory, skipped rows."""


ImportRule = Literal["newer", "replace", "keep"]

INT_MAX = 2**31 - 1  # an INTEGER column's bound: too large fails validation, not the database
Positive = Annotated[StrictInt, Field(ge=1, le=INT_MAX)]
Count = Annotated[StrictInt, Field(ge=0, le=INT_MAX)]
Micros = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


def no_nul(value: str) -> str:
    # PostgreSQL's text cannot hold NUL and SQLite's can: refused here, so no backend sees one.
    if "\x00" in value:
        raise ValueError("holds a NUL character (\\x00), which no tuning database may store")
    return value


#: Text stored in the database.
Text = Annotated[str, AfterValidator(no_nul)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", from_attributes=True)


def _utc(value: datetime) -> datetime:
    # Naive timestamps are UTC: that is how the database stores them.
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


#: A timestamp, aware UTC.
Time = Annotated[datetime, AfterValidator(_utc)] | None


class Config:
    """A kernel config as data: a family name and its positive integer parameters; immutable, and
    equal to any config (a subclass included) of the same family and parameters."""

    __slots__ = ("family", "_params", "_hash")

    def __init__(self, family: str, params: Mapping[str, int]):
        if not isinstance(family, str) or not 0 < len(family) <= 32 or "\x00" in family:
            raise ValueError(f"a kernel family is a name of 1 to 32 characters, got {family!r}")
        if not isinstance(params, Mapping) or not all(
                isinstance(k, str) and type(v) is int and 0 < v <= INT_MAX for k, v in params.items()):
            raise ValueError(f"a config's params map names to positive integers, got {params!r}")
        object.__setattr__(self, "family", family)
        object.__setattr__(self, "_params", tuple(sorted(params.items())))
        object.__setattr__(self, "_hash", hash((family, self._params)))

    @property
    def params(self) -> dict[str, int]:
        """The family's parameters (a fresh dict)."""
        return dict(self._params)

    @property
    def label(self) -> str:
        return f"{self.family}({', '.join(f'{k}={v}' for k, v in self._params)})"

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Config):
            return NotImplemented
        return self.family == other.family and self._params == other._params

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.label})"

    def __reduce__(self):  # noqa: ANN204
        return (type(self), (self.family, self.params))

    @staticmethod
    def _validate(value: Any, info: core_schema.ValidationInfo) -> Config:
        # The caller's config type (context "config") checks the vocabulary; plain data otherwise.
        kind = (info.context or {}).get("config", Config)
        if isinstance(value, Config):
            return value if isinstance(value, kind) else kind(value.family, value.params)
        if not isinstance(value, Mapping):
            raise ValueError(f"a kernel config is an object {{family, params}}, got {value!r}")
        if extra := sorted(set(value) - {"family", "params"}):
            raise ValueError(f"a kernel config has only family and params, got {', '.join(map(str, extra))}")
        if "params" not in value:
            raise ValueError("a kernel config needs params")
        return kind(value.get("family", BASELINE_FAMILY), value["params"])

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
        serialize = core_schema.plain_serializer_function_ser_schema(lambda c: {"family": c.family, "params": c.params})
        return core_schema.with_info_plain_validator_function(Config._validate, serialization=serialize)


#: The config every speed-up is measured against: one thread group per row.
BASELINE_FAMILY = "kvsplit"
BASELINE = Config(BASELINE_FAMILY, {"kv_split": 1})


class DeviceInfo(_Model, frozen=True):
    """A GPU as the tuner saw it: name, compute capability and SM count (MIG slices differ by SMs)."""

    name: Text = Field(min_length=1, max_length=128)
    cc_major: int = Field(ge=0, le=99, strict=True)
    cc_minor: int = Field(ge=0, le=99, strict=True)
    sm_count: Positive

    @property
    def label(self) -> str:
        return f"{self.name} (sm_{self.cc_major}{self.cc_minor}, {self.sm_count} SMs)"


class KernelBuildInfo(_Model, frozen=True):
    """A compiled kernel library; ``library_version`` is the kvsplit of its first record."""

    build_hash: Text = Field(min_length=1, max_length=128)
    library_version: Text = Field(min_length=1, max_length=64)


ChoiceKey = tuple[int, str, str, str, int, int]
#: A key's fields after the device and build: a result's key columns, and :attr:`TuningKey.choice_key`.
CHOICE_FIELDS = ("head_dim", "partial_dtype", "out_dtype", "stats_format", "num_splits", "rows")


class TuningKey(_Model, frozen=True):
    """Everything a tuning result depends on (``rows`` and ``num_splits`` may be bucket representatives)."""

    device: DeviceInfo
    build_hash: Text = Field(min_length=1, max_length=128)
    head_dim: Positive
    partial_dtype: Literal["bfloat16", "float16", "float32"]
    out_dtype: Literal["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e4m3fnuz"]
    # ":scattered": the stats of adjacent rows are not adjacent in memory (vLLM's and FlashAttention's
    # head-major LSE): one 32-byte sector per row instead of one per band changes what is fastest.
    stats_format: Literal["maxsum", "lse", "maxsum:scattered", "lse:scattered"]
    num_splits: Positive
    rows: Positive

    @property
    def shape_label(self) -> str:
        """The key's shape with each value named, for messages."""
        return " ".join(f"{name}={getattr(self, name)}" for name in CHOICE_FIELDS)

    @property
    def choice_key(self) -> ChoiceKey:
        """The key of :meth:`Store.load_choices`: the values of :data:`CHOICE_FIELDS`."""
        return tuple(getattr(self, name) for name in CHOICE_FIELDS)  # type: ignore[return-value]


class TuningPolicy(_Model):
    """The winner's policy: ``noise_margin`` is relative (0.02: a larger config must beat a smaller one by over 2 %)."""

    l2_state: Literal["warm", "cold"] = "warm"
    repeats: Positive
    noise_margin: float = Field(ge=0.0, allow_inf_nan=False)


class CandidateResult(_Model):
    """One measured config; times in microseconds per launch.  ``samples == 0``: it raised before
    it could be timed (times 0, not matched)."""

    config: Config
    median_us: Micros
    p10_us: Micros
    p90_us: Micros
    samples: Count
    matched: StrictBool  # whether its output matched kv_split=1

    @property
    def failed(self) -> bool:
        return self.samples == 0

    @model_validator(mode="after")
    def _ordered(self) -> CandidateResult:
        if self.samples == 0 and (self.matched or self.median_us or self.p10_us or self.p90_us):
            raise ValueError("a candidate with 0 samples failed: its times must be 0 and matched false")
        if not self.p10_us <= self.median_us <= self.p90_us:
            raise ValueError(f"need p10_us <= median_us <= p90_us, got {self.p10_us}, {self.median_us}, {self.p90_us}")
        return self


class TuningRecord(_Model):
    """A tuning result: key, winner, policy and every candidate measured.  ``candidates`` may be
    empty (winners only); otherwise the winner is one of them and matched kv_split=1."""

    key: TuningKey
    winner: Config
    policy: TuningPolicy
    candidates: list[CandidateResult] = Field(default_factory=list)
    tool_version: Text = Field(min_length=1, max_length=64)
    created_at: Time = None
    updated_at: Time = None

    @model_validator(mode="after")
    def _consistent(self) -> TuningRecord:
        seen: set[Config] = set()
        for c in self.candidates:
            if c.config in seen:
                raise ValueError(f"candidate {c.config.label} appears twice")
            seen.add(c.config)
        if self.candidates:
            winner = self.candidate(self.winner)
            if winner is None:
                raise ValueError(f"winner {self.winner.label} is not among the candidates")
            if not winner.matched:
                raise ValueError(f"winner {self.winner.label} did not match kv_split=1")
        return self

    def candidate(self, config: Config) -> CandidateResult | None:
        """The measurement of ``config``, or ``None`` if it was not measured."""
        return next((c for c in self.candidates if c.config == config), None)

    @property
    def speedup(self) -> float | None:
        """Median time of kv_split=1 divided by the winner's; ``None`` if either is unknown."""
        base, best = self.candidate(BASELINE), self.candidate(self.winner)
        if base is None or best is None or base.failed or best.median_us <= 0:
            return None
        value = base.median_us / best.median_us
        return value if math.isfinite(value) else None


class ImportSummary(_Model):
    """What an import did (or, with ``dry_run``, would do)."""

    rule: ImportRule
    inserted: int = 0
    replaced: int = 0
    kept: int = 0
    dry_run: bool = False


class PruneResult(_Model):
    """The keys that a prune deleted (or, with ``dry_run``, would delete)."""

    keys: list[TuningKey]
    dry_run: bool

    @property
    def count(self) -> int:
        return len(self.keys)


class RepairResult(_Model):
    """What ``repair`` did (or would do): rows quarantined per table, one problem line per row that
    does not parse itself, one line per repair of the schema."""

    dry_run: bool
    quarantined: dict[str, int]
    problems: list[str]
    schema_repairs: list[str]
    quarantine_file: str | None

    @property
    def count(self) -> int:
        return sum(self.quarantined.values())


class ClaimInfo(_Model):
    """One key of a fleet's grid as the claims table holds it (server clock times; a ``claimed``
    claim past ``expires_at`` may be taken over)."""

    key: TuningKey
    state: Literal["open", "claimed", "done", "failed"]
    owner: Text | None = Field(default=None, min_length=1, max_length=255)
    attempts: Count
    claimed_at: Time = None
    heartbeat_at: Time = None
    expires_at: Time = None
    error: Text | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> ClaimInfo:
        if self.state == "open" and (self.owner is not None or self.attempts):
            raise ValueError("an open claim has no owner and no attempts")
        if self.state != "open" and (self.owner is None or self.claimed_at is None or not self.attempts):
            raise ValueError(f"a {self.state} claim needs an owner, claimed_at and attempts >= 1")
        if self.state == "claimed" and self.expires_at is None:
            raise ValueError("a claimed claim needs expires_at")
        return self
