"""Files that someone else may have written: regular files only, read to a limit.

A tuning export comes from another host or person, and ``KVSPLIT_PENDING``
from the environment; either may name ``/dev/zero``, a FIFO that never
delivers, or a file of gigabytes.  kvsplit looks before it opens (``os.stat``,
symlinks followed): anything but a regular file is refused unopened, and a
regular file larger than the limit unread.  It then opens without blocking
and checks again (the path may have been swapped in between), and reads at
most the limit plus one byte, so a file that grows while read is caught too.
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

#: Bytes of a tuning export that ``kvsplit db import`` reads (file or stdin).
IMPORT_LIMIT = 64 * 2**20
#: Bytes of the pending-keys file (``KVSPLIT_PENDING``) that ``kvsplit tune --pending`` reads.
PENDING_LIMIT = 16 * 2**20

_NOT_REGULAR = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)
# No blocking open (a FIFO's), and no controlling terminal from a tty device.
_OPEN_FLAGS = os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)


class InputRefused(ValueError):
    """A file kvsplit will not read or write: not a regular file, or larger than its limit.

    The message is one line for people, naming the file and the rule.
    """


def size_text(limit: int) -> str:
    """``67108864`` -> ``"64 MiB"``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if limit >= size and limit % size == 0:
            return f"{limit // size} {unit}"
    return f"{limit:,} bytes"


def too_large(name: str, limit: int, hint: str = "") -> InputRefused:
    return InputRefused(f"{name} is larger than {size_text(limit)}, the most kvsplit reads of it{hint}")


def _check_regular(mode: int, name: str) -> None:
    if not stat.S_ISREG(mode):
        kind = next((what for test, what in _NOT_REGULAR if test(mode)), "not a plain file")
        raise InputRefused(f"{name} is {kind}, not a regular file: kvsplit reads and writes only regular files")


def read_regular(path: str | os.PathLike, limit: int, *, name: str | None = None, hint: str = "") -> bytes:
    """The bytes of the regular file ``path`` (a symlink to one is fine), at most ``limit``.

    Raises
    ------
    InputRefused
        ``path`` is not a regular file (never opened then), or holds more than
        ``limit`` bytes (``hint`` ends that message).
    OSError
        It cannot be read: missing, no permission.
    """
    name = name or os.fspath(path)
    info = os.stat(path)
    _check_regular(info.st_mode, name)
    if info.st_size > limit:
        raise too_large(name, limit, hint)
    fd = os.open(path, os.O_RDONLY | _OPEN_FLAGS)
    with open(fd, "rb") as stream:
        _check_regular(os.fstat(fd).st_mode, name)  # swapped since the stat
        return read_capped(stream, limit, name=name, hint=hint)


def read_capped(stream: BinaryIO, limit: int, *, name: str, hint: str = "") -> bytes:
    """At most ``limit`` bytes of ``stream`` (stdin, say); :class:`InputRefused` if there are more."""
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise too_large(name, limit, hint)
    return data


def open_regular_for_writing(path: str | os.PathLike, *, append: bool) -> BinaryIO:
    """``path`` opened to append (or to replace its content), created if missing, only if regular.

    A FIFO, a device or a directory is refused before it is opened
    (:class:`InputRefused`), so that writing can never block or feed a device.
    """
    name = os.fspath(path)
    try:
        _check_regular(os.stat(path).st_mode, name)
    except FileNotFoundError:
        pass
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC) | _OPEN_FLAGS
    fd = os.open(path, flags, 0o644)
    try:
        _check_regular(os.fstat(fd).st_mode, name)
    except InputRefused:
        os.close(fd)
        raise
    return open(fd, "ab" if append else "wb")
