"""The kvsplit tuning database.

Results of tuning (which config won for which key, and how every candidate
measured) in any SQLAlchemy database; SQLite in the user cache directory by
default.  Everything returned is a pydantic model; ORM rows stay inside.
Configs are plain data (:class:`Config`); the store never loads the kernel
extension, and a caller that knows the kernel layer's vocabulary passes its
config type (``config_type=kvsplit.config.KernelConfig``).

Typical use::

    from kvsplit.db import open_store_for_library
    store = open_store_for_library()          # never raises; warns and uses memory
    choices = store.load_choices(device, build_hash)
"""

import importlib

from .errors import DamagedRows, DbWarning, NoDatabase, SchemaDamaged, SchemaTooNew, StoreError
from .schemas import (BASELINE, BuildStats, CandidateResult, ChoiceKey, ClaimInfo, Config, DeviceInfo, DeviceStats,
                      ExportFile, ImportSummary, KernelBuildInfo, Progress, PruneResult, RepairResult, StoreStats,
                      TuningKey, TuningPolicy, TuningRecord, WorkerProgress)

# The store's side (SQLAlchemy, Alembic) is imported at its first use, not with the
# package: a process whose merges find their configs elsewhere never loads it.
_STORE_SIDE = {
    "Claim": "claims", "Claims": "claims", "Step": "claims",
    "open_store": "connect", "open_store_for_library": "connect", "open_store_for_repair": "connect",
    "Damage": "rows",
    "DEFAULT_TIMEOUT_S": "engine", "ENV_VAR": "engine",
    "head_revision": "migrate",
    "Store": "store",
}


def __getattr__(name: str):
    module = _STORE_SIDE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = ["BASELINE", "DEFAULT_TIMEOUT_S", "ENV_VAR", "BuildStats", "CandidateResult", "ChoiceKey", "Claim",
           "ClaimInfo", "Claims", "Config", "Damage", "DamagedRows", "DbWarning", "DeviceInfo", "DeviceStats",
           "ExportFile", "ImportSummary", "KernelBuildInfo", "NoDatabase", "Progress",
           "PruneResult", "RepairResult", "SchemaDamaged", "SchemaTooNew", "Step", "Store", "StoreError",
           "StoreStats", "TuningKey", "TuningPolicy", "TuningRecord", "WorkerProgress", "head_revision",
           "open_store", "open_store_for_library", "open_store_for_repair"]
