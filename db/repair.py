"""``repair``: rows that do not parse leave the database for a quarantine file.

No table of its own (the schema stays as the migrations make it): the rows go,
as JSON lines, to a file beside an SQLite database or wherever the caller
says, and the line keeps every stored value, so nothing is lost that was
there.  Used by :meth:`kvsplit.db.Store.repair` only.
"""

from __future__ import annotations

import json
import math
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import delete
from sqlalchemy.orm import Session

from .rows import BUILDS, CANDIDATES, CLAIMS, DEVICES, GENERATION, RESULTS, TABLES, scan
from .schemas import RepairResult

_CHUNK = 500  # ids per DELETE, well under every backend's parameter limit


def _json_safe(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError:
            return {"hex": value.encode("utf-8", "surrogateescape").hex()}
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"hex": bytes(value).hex()}
    return str(value)


def quarantine(session: Session, shown_url: str, default: Path, path: Path | None, *, dry_run: bool) -> RepairResult:
    """Find what does not parse (and what depends on it), write it to ``path``, delete it."""
    everything = scan(session)
    chosen: dict[tuple[str, Any], tuple[str, dict]] = {d.where: (d.problem, dict(d.raw)) for d in everything.damage}
    gone = {row_id for table, row_id in chosen if table == "tuning_results"}
    for candidate_id, row in everything.raw["tuning_candidates"].items():
        if row["result_id"] in gone and ("tuning_candidates", candidate_id) not in chosen:
            chosen[("tuning_candidates", candidate_id)] = (
                f"belongs to tuning_results id {row['result_id']}, which is quarantined",
                row,
            )
    counts = {t.name: sum(1 for table, _ in chosen if table == t.name) for t in TABLES}
    target = Path(path) if path is not None else default
    result = RepairResult(
        dry_run=dry_run,
        quarantined={t: n for t, n in counts.items() if n},
        problems=[str(d) for d in everything.damage],
        schema_repairs=[],
        quarantine_file=str(target) if chosen else None,
    )
    if dry_run or not chosen:
        return result
    now = datetime.now(timezone.utc).isoformat()
    lines = [
        json.dumps(
            {
                "quarantined_at": now,
                "database": shown_url,
                "table": table,
                "id": _json_safe(row_id),
                "problem": problem,
                "row": {k: _json_safe(v) for k, v in raw.items()},
            },
            sort_keys=True,
        )
        for (table, row_id), (problem, raw) in chosen.items()
    ]
    # The file first, inside the transaction: if it cannot be written, nothing is deleted.
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("a", encoding="utf-8") as out:
        out.write("\n".join(lines) + "\n")
        out.flush()
        os.fsync(out.fileno())
    # Children before parents.
    for table in (CANDIDATES, RESULTS, BUILDS, DEVICES, CLAIMS, GENERATION):
        ids = [row_id for t, row_id in chosen if t == table.name]
        for start in range(0, len(ids), _CHUNK):
            session.execute(delete(table).where(table.c.id.in_(ids[start : start + _CHUNK])))
    return result
