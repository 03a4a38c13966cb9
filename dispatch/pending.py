"""Keys met during CUDA-graph capture, when profiling is not allowed.

They are kept in memory (tuned at the next uncaptured call of the same shape)
and appended to ``pending.jsonl`` in the user cache directory, where
``kvsplit tune --pending`` finds them for an offline run.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import platformdirs

_lock = threading.Lock()
_keys: set = set()


def path() -> Path:
    """Where pending keys are written (``KVSPLIT_PENDING`` overrides)."""
    override = os.environ.get("KVSPLIT_PENDING")
    return Path(override) if override else Path(platformdirs.user_cache_dir("kvsplit")) / "pending.jsonl"


def add(key) -> None:
    with _lock:
        if key in _keys:
            return
        _keys.add(key)
        try:
            target = path()
            target.parent.mkdir(parents=True, exist_ok=True)
            with target.open("a", encoding="utf-8") as stream:
                stream.write(key.model_dump_json() + "\n")
        except OSError:
            pass  # pending keys are a convenience; the in-memory set still works


def discard(key) -> None:
    with _lock:
        _keys.discard(key)


def load() -> list:
    """Every pending key on disk (deduplicated, in order of first appearance)."""
    from ..db import TuningKey

    try:
        lines = path().read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    seen: dict = {}
    for line in lines:
        try:
            key = TuningKey.model_validate_json(line)
        except ValueError:
            continue
        seen.setdefault(key, None)
    return list(seen)


def clear(done) -> None:
    """Remove ``done`` keys from the file."""
    remaining = [k for k in load() if k not in set(done)]
    with _lock:
        try:
            path().write_text("".join(k.model_dump_json() + "\n" for k in remaining), encoding="utf-8")
        except OSError:
            pass
