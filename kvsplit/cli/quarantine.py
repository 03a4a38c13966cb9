"""The quarantine file of ``kvsplit db repair``: each row the store removes, one JSON object a line,
with every value it held (invalid UTF-8 and bytes as hex, inf and NaN as text)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import platformdirs

from ..db.rows import Damage


def default_quarantine(database: Path | None) -> Path:
    """Beside the SQLite file ``database``; for a server, in the user cache directory."""
    if database is not None:
        return database.with_name(database.name + ".quarantine.jsonl")
    return Path(platformdirs.user_cache_dir("kvsplit")) / "quarantine.jsonl"


def quarantine_writer(path: Path, url: str) -> Callable[[list[Damage]], None]:
    """What :meth:`kvsplit.db.Store.repair` hands the rows to before it deletes them: appended to
    ``path`` and synced to disk (an ``OSError`` deletes nothing)."""

    def write(rows: list[Damage]) -> None:
        now = datetime.now(timezone.utc).isoformat()
        lines = [json.dumps({"quarantined_at": now, "database": url, "table": row.table, "id": _json_safe(row.row_id),
                             "problem": row.problem, "row": {k: _json_safe(v) for k, v in row.raw.items()}},
                            sort_keys=True) for row in rows]
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as out:
            out.write("\n".join(lines) + "\n")
            out.flush()
            os.fsync(out.fileno())

    return write


def _json_safe(value: Any) -> Any:
    # A stored value as JSON, whatever it is: invalid UTF-8 and bytes as hex, inf and NaN as text.
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
    return value if value is None or isinstance(value, (bool, int)) else str(value)
