"""Is a serving process's SQLite file still the one it opened?

A process that serves merges keeps its store open for hours.  Meanwhile the
file may be deleted (the process would go on writing into the unlinked
inode, lost at exit), replaced by another (a shared tuning file copied over
it), emptied, or made immutable (``chattr +i``: SQLite's shared-memory index
of a WAL database is a mapped file, and a write to a mapped page of an
immutable file kills the process with SIGBUS).  :class:`~.store.Store` asks a
:class:`FileWatch` before each transaction of a serving store.

The watch never opens the files: closing any descriptor of a file drops
every POSIX lock the process holds on it, SQLite's included.  It uses
``stat``, and on Linux ``statx`` for the immutable attribute.
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass
from pathlib import Path

_AT_FDCWD = -100
_STATX_BASIC_STATS = 0x7FF
_STATX_ATTR_IMMUTABLE = 0x10
# struct statx: __u32 stx_mask, __u32 stx_blksize, __u64 stx_attributes (offset 8), ...,
# __u64 stx_attributes_mask (offset 56); 256 bytes in all.
_STATX_SIZE, _ATTRIBUTES, _ATTRIBUTES_MASK = 256, 8, 56


def _load_statx():
    if not sys.platform.startswith("linux"):
        return None
    try:
        statx = ctypes.CDLL(None, use_errno=True).statx
    except (OSError, AttributeError):  # a C library without statx (glibc < 2.28)
        return None
    statx.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p)
    statx.restype = ctypes.c_int
    return statx


_statx = _load_statx()


def immutable(path: str) -> bool:
    """Whether ``path`` has the immutable attribute (``chattr +i``); false where that cannot be told."""
    if _statx is None:
        return False
    buffer = ctypes.create_string_buffer(_STATX_SIZE)
    if _statx(_AT_FDCWD, os.fsencode(path), 0, _STATX_BASIC_STATS, buffer) != 0:
        return False
    attributes = int.from_bytes(buffer.raw[_ATTRIBUTES:_ATTRIBUTES + 8], sys.byteorder)
    supported = int.from_bytes(buffer.raw[_ATTRIBUTES_MASK:_ATTRIBUTES_MASK + 8], sys.byteorder)
    return bool(attributes & supported & _STATX_ATTR_IMMUTABLE)


@dataclass(frozen=True)
class Change:
    """What happened to the file, and whether a file stands at its path that may be reopened."""

    what: str
    reopen: bool


def _identity(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_dev, stat.st_ino


class FileWatch:
    """The identity (device and inode) of an SQLite file when it was opened, checked on request."""

    def __init__(self, path: Path):
        self.path = path
        self._identity = _identity(os.stat(path))

    def changed(self) -> Change | None:
        """``None`` while the file is the one opened, else what happened to it."""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return Change("was deleted", reopen=False)
        except OSError as exc:
            return Change(f"cannot be looked at any more ({exc.strerror})", reopen=False)
        if any(immutable(f"{self.path}{suffix}") for suffix in ("", "-wal", "-shm")):
            return Change("was made immutable", reopen=False)
        if _identity(stat) != self._identity:
            return Change("was replaced by another file", reopen=True)
        if stat.st_size == 0:  # an open database always has its header page
            return Change("was emptied", reopen=False)
        return None
