"""The kvsplit tuning database.

Results of tuning (which config won for which key, and how every candidate
measured) in any SQLAlchemy database; SQLite in the user cache directory by
default.  Everything returned is a pydantic model; ORM rows stay inside.

Typical use::

    from kvsplit.db import open_store_for_library
    store = open_store_for_library()          # never raises; warns and uses memory
    choices = store.load_choices(device, build_hash)
"""

from ..config import FAMILIES, KernelConfig
from ..config import check_params as check_config
from .claims import Claim, Claims, Step
from .connect import open_store, open_store_for_library, open_store_for_repair
from .decode import Damage
from .engine import DEFAULT_TIMEOUT_S, ENV_VAR, default_url, resolve_url
from .errors import DamagedRows, DbWarning, InvalidExportError, NoDatabase, SchemaDamaged, SchemaTooNew, StoreError
from .migrate import head_revision
from .schemas import (
    BASELINE,
    BuildStats,
    CandidateResult,
    ChoiceKey,
    ClaimInfo,
    DeviceInfo,
    DeviceStats,
    ExportFile,
    ImportSummary,
    KernelBuildInfo,
    Progress,
    PruneResult,
    RepairResult,
    StoreStats,
    TuningKey,
    TuningPolicy,
    TuningRecord,
    WorkerProgress,
)
from .store import Store
from .transfer import dump_export, make_export, parse_export, read_export

__all__ = [
    "BASELINE",
    "DEFAULT_TIMEOUT_S",
    "ENV_VAR",
    "FAMILIES",
    "BuildStats",
    "CandidateResult",
    "ChoiceKey",
    "Claim",
    "ClaimInfo",
    "Claims",
    "Damage",
    "DamagedRows",
    "DbWarning",
    "DeviceInfo",
    "DeviceStats",
    "ExportFile",
    "ImportSummary",
    "InvalidExportError",
    "KernelBuildInfo",
    "NoDatabase",
    "KernelConfig",
    "Progress",
    "PruneResult",
    "RepairResult",
    "SchemaDamaged",
    "SchemaTooNew",
    "Store",
    "StoreError",
    "Step",
    "StoreStats",
    "TuningKey",
    "TuningPolicy",
    "TuningRecord",
    "WorkerProgress",
    "check_config",
    "default_url",
    "dump_export",
    "head_revision",
    "make_export",
    "open_store",
    "open_store_for_library",
    "open_store_for_repair",
    "parse_export",
    "read_export",
    "resolve_url",
]
