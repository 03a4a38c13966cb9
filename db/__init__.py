"""The kvsplit tuning database: which config won for which key, and how every candidate measured, in
any SQLAlchemy database (SQLite in the user cache directory by default).  Everything returned is a pydantic
model of :mod:`.schemas`; SQLAlchemy and Alembic load at the store's first use, not with the package."""

import importlib

from .schemas import (BASELINE, CandidateResult, ChoiceKey, ClaimInfo, Config, DamagedRows, DbWarning, DeviceInfo,
                      ImportSummary, KernelBuildInfo, NoDatabase, PruneResult, RepairResult, SchemaDamaged,
                      SchemaTooNew, StoreError, TuningKey, TuningPolicy, TuningRecord)

_STORE_SIDE = {"Claim": "claims", "Claims": "claims", "Step": "claims", "Damage": "rows", "head_revision": "migrate",
               "DEFAULT_TIMEOUT_S": "engine", "ENV_VAR": "engine", "Store": "store", "open_store": "store",
               "open_store_for_library": "store", "open_store_for_repair": "store"}


def __getattr__(name: str):
    if name not in _STORE_SIDE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return globals().setdefault(name, getattr(importlib.import_module(f".{_STORE_SIDE[name]}", __name__), name))


__all__ = ["BASELINE", "DEFAULT_TIMEOUT_S", "ENV_VAR", "CandidateResult", "ChoiceKey", "Claim", "ClaimInfo", "Claims",
           "Config", "Damage", "DamagedRows", "DbWarning", "DeviceInfo", "ImportSummary", "KernelBuildInfo",
           "NoDatabase", "PruneResult", "RepairResult", "SchemaDamaged", "SchemaTooNew", "Step", "Store", "StoreError",
           "TuningKey", "TuningPolicy", "TuningRecord", "head_revision", "open_store", "open_store_for_library",
           "open_store_for_repair"]
