"""Keys met during CUDA-graph capture, when profiling is not allowed.

They are kept in memory (tuned at the next uncaptured call of the same shape)
and appended to ``pending.jsonl`` in the user cache directory, where
``kvsplit tune --pending`` finds them for an offline run.  Only a regular file
is read or written (a FIFO or a device named by ``KVSPLIT_PENDING`` is never
opened), and at most :data:`kvsplit.files.PENDING_LIMIT` bytes of it.
"""

from __future__ import annotations

import codecs
import os
import threading
import warnings
from pathlib import Path

import platformdirs

from ..files import PENDING_LIMIT, InputRefused, open_regular_for_writing, read_regular

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
            try:
                if target.stat().st_size >= PENDING_LIMIT:
                    return  # full: tune --pending would refuse it; the in-memory set still works
            except FileNotFoundError:
                pass
            with open_regular_for_writing(target, append=True) as stream:
                stream.write((key.model_dump_json() + "\n").encode())
        except (OSError, InputRefused):
            pass  # pending keys are a convenience; the in-memory set still works


def discard(key) -> None:
    with _lock:
        _keys.discard(key)


def load() -> list:
    """Every pending key on disk (deduplicated, in order of first appearance).

    A line that is not a key (not UTF-8, not JSON, not a valid key) is
    skipped, with one warning counting them.  A missing or unreadable file
    holds no keys.

    Raises
    ------
    kvsplit.files.InputRefused
        The file is not a regular file (a FIFO, a device: never opened), or is
        larger than :data:`kvsplit.files.PENDING_LIMIT`.
    """
    keys, skipped = _read()
    if skipped:
        lines = "1 line that is not a tuning key" if skipped == 1 else f"{skipped} lines that are not tuning keys"
        warnings.warn(f"the pending-keys file {path()}: skipped {lines} (clearing the tuned keys drops them)",
                      stacklevel=2)
    return keys


def _read() -> tuple[list, int]:
    """The keys on disk, and how many lines are not keys."""
    from ..db import TuningKey

    target = path()
    try:
        data = read_regular(target, PENDING_LIMIT, name=f"the pending-keys file {target}",
                            hint="; delete it, or tune a grid instead of --pending")
    except OSError:
        return [], 0
    seen: dict = {}
    skipped = 0
    for line in data.removeprefix(codecs.BOM_UTF8).splitlines():
        if not line.strip():
            continue
        try:
            key = TuningKey.model_validate_json(line.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError and pydantic's ValidationError alike
            skipped += 1
            continue
        seen.setdefault(key, None)
    return list(seen), skipped


def clear(done) -> None:
    """Remove ``done`` keys from the file (and the lines that are not keys)."""
    try:
        remaining = [k for k in _read()[0] if k not in set(done)]
    except InputRefused:
        return
    with _lock:
        try:
            with open_regular_for_writing(path(), append=False) as stream:
                stream.write("".join(k.model_dump_json() + "\n" for k in remaining).encode())
        except (OSError, InputRefused):
            pass
