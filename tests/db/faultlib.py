"""Fault injection for the tuning database: the faults, the database they damage, what must survive.

Shared by test_fault_injection.py and the child process it starts (run this
file as a script: ``python faultlib.py JOB.json`` merges against every
database listed and prints one JSON line per database).

The faults are generated from the models, not listed by hand: for every
column of every table (``METADATA``) a value of the wrong type, one out
of range and one that does not parse, written with raw SQL so that neither
SQLAlchemy's column types nor pydantic stand in the way; then the version table (missing,
empty, two rows, a future revision, garbage), each data table dropped, and
three rows that parse alone but not together.  A column type without fault
values fails the suite: a new column cannot slip past it.

A backend refuses some values (PostgreSQL keeps 'abc' out of an integer
column and invalid UTF-8 out of text); such a fault is *refused*, counted,
and not a damaged database: the suite checks that each backend applied
enough of them to mean something.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sqlalchemy as sa  # noqa: E402
from dbtestlib import A100, H200, make_record  # noqa: E402

KINDS = ("wrong_type", "out_of_range", "unparsable")
VERSION_TABLE = "kvsplit_schema_version"

# The records every damaged database starts from. "k0" and "k1" are keys that
# merges on this machine's CPU look up (so the faults sit in rows a merge
# reads); the others are other devices and builds, which must come through.
MERGE_SHAPES = {"k0": (64, 16, 8), "k1": (64, 32, 8)}  # head_dim, num_splits, rows


def cpu_records():
    """The template's records by name (needs the installed kvsplit and torch)."""
    import torch

    from kvsplit.config import build_hash
    from kvsplit.dispatch.device import device_facts
    from kvsplit.dispatch.keys import device_info

    cpu = device_info(device_facts(torch.device("cpu")))
    build = build_hash(False)
    return {
        "k0": make_record(device=cpu, build_hash=build, head_dim=64, num_splits=16, rows=8, winner=4),
        "k1": make_record(device=cpu, build_hash=build, head_dim=64, num_splits=32, rows=8, winner=2),
        "h200": make_record(device=H200, build_hash="build-a", rows=64, winner=8),
        "a100": make_record(device=A100, build_hash="build-a", rows=64, winner=2),
        "h200-b": make_record(device=H200, build_hash="build-b", rows=128, winner=16),
    }


# Which row of each table a fault damages: the k0 result, its device and build,
# and a candidate of k0 that is not the winner (K = 2).
TARGET_SQL = {
    "devices": "SELECT device_id FROM tuning_results WHERE id = (SELECT min(id) FROM tuning_results)",
    "kernel_builds": "SELECT build_id FROM tuning_results WHERE id = (SELECT min(id) FROM tuning_results)",
    "tuning_results": "SELECT min(id) FROM tuning_results",
    "tuning_candidates": "SELECT id FROM tuning_candidates WHERE result_id = (SELECT min(id) FROM tuning_results)"
    " AND params = '{\"kv_split\":2}'",
    # The fleet's tables: the one failed claim of the template, and the generation counter.
    "tuning_claims": "SELECT min(id) FROM tuning_claims",
    "tuning_generation": "SELECT min(id) FROM tuning_generation",
}


def add_claim(store, key) -> None:
    """Give the template a claim row with every column set but expires_at: claimed, then failed."""
    from kvsplit.db import Claims

    claims = Claims(store)
    step = claims.claim_next([key], "fault-host/1/cpu", 60.0, run_started=claims.now(), force=True)
    claims.finish(step.claim, error="RuntimeError: a fault-injection template")
WINNER_CANDIDATE_SQL = (
    "SELECT id FROM tuning_candidates WHERE result_id = (SELECT min(id) FROM tuning_results)"
    " AND params = '{\"kv_split\":4}'"
)

# Value families of SQL literals, by backend.  None: the backend cannot hold
# such a value in such a column (recorded as refused without trying).
_BAD_UTF8 = "CAST(X'FF41' AS TEXT)"
VALUES = {
    "sqlite": {
        "integer": {"wrong_type": "'abc'", "out_of_range": "-1", "unparsable": _BAD_UTF8},
        "float": {"wrong_type": "'abc'", "out_of_range": "-1.0", "unparsable": _BAD_UTF8},
        "boolean": {"wrong_type": "'abc'", "out_of_range": "2", "unparsable": _BAD_UTF8},
        "text": {"wrong_type": "X'DEADBEEF'", "out_of_range": "''", "unparsable": _BAD_UTF8},
        "json": {"wrong_type": "'[4]'", "out_of_range": "'{\"kv_split\":-1}'", "unparsable": "'notjson'"},
        "timestamp": {"wrong_type": "12345", "out_of_range": "'10000-01-01 00:00:00'", "unparsable": "'garbage'"},
    },
    "postgresql": {
        "integer": {"wrong_type": "'abc'", "out_of_range": "-1", "unparsable": None},
        "float": {"wrong_type": "'abc'", "out_of_range": "-1.0", "unparsable": "'NaN'"},
        "boolean": {"wrong_type": "'abc'", "out_of_range": "2", "unparsable": None},
        "text": {"wrong_type": None, "out_of_range": "''", "unparsable": None},
        "json": {"wrong_type": "'[4]'", "out_of_range": "'{\"kv_split\":-1}'", "unparsable": "'notjson'"},
        # PostgreSQL holds years Python cannot (10000, BC): they must read as damage, not crash.
        "timestamp": {
            "wrong_type": "12345",
            "out_of_range": "'10000-01-01 00:00:00'",
            "unparsable": "'0044-03-15 00:00:00 BC'",
        },
    },
}


def value_family(column) -> str:
    """The fault family of a model column; a new type must be added here."""
    from kvsplit.db.models import CanonicalJSON, UTCDateTime

    kind = column.type
    for types, name in (
        (UTCDateTime, "timestamp"),
        (CanonicalJSON, "json"),
        (sa.Boolean, "boolean"),
        (sa.Integer, "integer"),
        (sa.Float, "float"),
        (sa.String, "text"),
    ):
        if isinstance(kind, types):
            return name
    raise AssertionError(f"no fault values for column {column} of type {kind!r}: add them to faultlib.VALUES")


@dataclass(frozen=True)
class Fault:
    """One damage to a database, and what must still be there after ``kvsplit db repair``."""

    name: str
    statements: dict[str, list[str]]  # backend -> SQL; a backend missing here refuses the fault
    lost: frozenset[str] = frozenset()  # records that may not survive repair
    trimmed: frozenset[str] = frozenset()  # records that survive without candidate K = 2
    winners_only: bool = False  # records survive without their candidates
    schema: bool = False  # the version table or a table, not a row
    too_new: bool = False  # repair must refuse and change nothing

    def sql(self, backend: str) -> list[str] | None:
        return self.statements.get(backend)


def _column_faults() -> list[Fault]:
    from kvsplit.db.models import METADATA

    faults = []
    for table in METADATA.sorted_tables:
        for column in table.columns:
            if column.primary_key:
                continue  # rowids: SQLite cannot store anything but an integer there
            family = value_family(column)
            for kind in KINDS:
                statements = {}
                for backend, families in VALUES.items():
                    value = families[family][kind]
                    if value is not None:
                        statements[backend] = [
                            f"UPDATE {table.name} SET {column.name} = {value} WHERE id = ({TARGET_SQL[table.name]})"
                        ]
                lost = {"devices": {"k0", "k1"}, "kernel_builds": {"k0", "k1"}, "tuning_results": {"k0"}}
                faults.append(
                    Fault(
                        f"{table.name}.{column.name}:{kind}",
                        statements,
                        lost=frozenset(lost.get(table.name, ())),
                        trimmed=frozenset({"k0"} if table.name == "tuning_candidates" else ()),
                    )
                )
    return faults


def _both(*sql: str) -> dict[str, list[str]]:
    return {"sqlite": list(sql), "postgresql": list(sql)}


def _other_faults() -> list[Fault]:
    everything = frozenset({"k0", "k1", "h200", "a100", "h200-b"})
    return [
        Fault("version:missing", _both(f"DROP TABLE {VERSION_TABLE}"), schema=True),
        Fault("version:empty", _both(f"DELETE FROM {VERSION_TABLE}"), schema=True),
        Fault("version:two-rows", _both(f"INSERT INTO {VERSION_TABLE} (version_num) VALUES ('0001')"), schema=True),
        Fault("version:future", _both(f"UPDATE {VERSION_TABLE} SET version_num = '9999'"), schema=True, too_new=True),
        Fault("version:garbage", _both(f"UPDATE {VERSION_TABLE} SET version_num = 'not a revision!'"), schema=True),
        Fault("table:devices:dropped", _both("DROP TABLE devices CASCADE"), lost=everything, schema=True),
        Fault("table:kernel_builds:dropped", _both("DROP TABLE kernel_builds CASCADE"), lost=everything, schema=True),
        Fault("table:tuning_results:dropped", _both("DROP TABLE tuning_results CASCADE"), lost=everything,
              schema=True),
        Fault("table:tuning_candidates:dropped", _both("DROP TABLE tuning_candidates"), winners_only=True,
              schema=True),
        # The fleet's tables hold no results: dropped, they are recreated empty and every record stays.
        Fault("table:tuning_claims:dropped", _both("DROP TABLE tuning_claims"), schema=True),
        Fault("table:tuning_generation:dropped", _both("DROP TABLE tuning_generation"), schema=True),
        # Rows that parse one by one but not as a record.
        Fault("record:winner-did-not-match",
              _both(f"UPDATE tuning_candidates SET matched = false WHERE id = ({WINNER_CANDIDATE_SQL})"),
              lost=frozenset({"k0"})),
        Fault("record:winner-candidate-missing", _both(f"DELETE FROM tuning_candidates WHERE id = ({WINNER_CANDIDATE_SQL})"),
              lost=frozenset({"k0"})),
        # Same config as the winner in other JSON text: the unique constraint lets it by.
        Fault("record:candidate-twice",
              _both(f"UPDATE tuning_candidates SET params = '{{\"kv_split\": 4}}' WHERE id = ({TARGET_SQL['tuning_candidates']})"),
              lost=frozenset({"k0"})),
    ]


def all_faults() -> list[Fault]:
    return _column_faults() + _other_faults()


def fault_names() -> list[str]:
    """Names only, for parametrize at collection time (no torch needed)."""
    return [f.name for f in all_faults()]


def inject(url: str, fault: Fault) -> bool:
    """Apply ``fault`` with raw SQL; False if the backend refuses it (the database is then unchanged)."""
    backend = sa.make_url(url).get_backend_name()
    statements = fault.sql(backend)
    if statements is None:
        return False
    if backend == "sqlite":
        import sqlite3

        # A plain connection: foreign keys off, as any tool that edits the file.
        conn = sqlite3.connect(sa.make_url(url).database, isolation_level=None)
        try:
            conn.execute("BEGIN")
            for sql in statements:
                conn.execute(sql.replace(" CASCADE", ""))
            conn.execute("COMMIT")
        except sqlite3.Error:
            conn.execute("ROLLBACK")
            return False
        finally:
            conn.close()
        return True
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            # As a restore of a partial dump would: no foreign-key triggers.
            conn.exec_driver_sql("SET LOCAL session_replication_role = replica")
            for sql in statements:
                conn.exec_driver_sql(sql.replace("%", "%%"))
    except sa.exc.DBAPIError:
        return False
    finally:
        engine.dispose()
    return True


# -- the child process: merges in a new process ------------------------------------------------


def _merge_job(urls: list[str]) -> None:
    import os
    import warnings

    import torch

    import kvsplit
    from kvsplit.db import DbWarning
    from kvsplit.dispatch import dispatcher as dispatch_module
    from kvsplit.reference import merge_maxsum_reference, random_partials

    gen = torch.Generator().manual_seed(1234)
    for url in urls:
        os.environ["KVSPLIT_DB"] = url
        dispatch_module.dispatcher.forget()  # as a process that never saw this database
        errors, caught_db = [], []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for name in ("k0", "k0", "k1"):
                head_dim, num_splits, rows = MERGE_SHAPES[name]
                partial_o, stats = random_partials(num_splits, rows, head_dim, generator=gen)  # fresh data
                scale = 0.5 + float(torch.rand((), generator=gen))
                try:
                    out = kvsplit.merge_maxsum(partial_o.bfloat16(), stats, scale)
                except Exception as exc:  # noqa: BLE001 - reported to the test
                    errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                ref, _ = merge_maxsum_reference(partial_o.bfloat16(), stats, scale)
                error = float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))
                if not error <= 4e-3:
                    errors.append(f"{name}: relative error {error:.3g}")
        caught_db = [str(w.message) for w in caught if issubclass(w.category, DbWarning)]
        print(json.dumps({"url": url, "errors": errors, "db_warnings": caught_db}), flush=True)


if __name__ == "__main__":
    _merge_job(json.loads(Path(sys.argv[1]).read_text()))
