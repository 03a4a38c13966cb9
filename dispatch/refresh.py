"""Serving processes notice new winners without a restart.

A process caches the winners of its device whole (one query) and then never
reads the database on a hit. To see what a fleet stores later, the
dispatcher compares the database's generation counter (one row that every
write of results bumps; see :meth:`kvsplit.db.Store.generation`) with the
one its tables were loaded at: on a miss, before it profiles or falls back to
the heuristic, and every ``KVSPLIT_REFRESH_S`` seconds in a daemon thread
(default 30; 0 turns both off). The thread keeps the hot path as it is: no
clock read, no database access, no lock.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable

from . import InvalidSetting

log = logging.getLogger("kvsplit.dispatch")

ENV_VAR = "KVSPLIT_REFRESH_S"
#: Seconds between two generation checks of the refresh thread.
DEFAULT_REFRESH_S = 30.0


def refresh_interval(raw: str | None = None) -> float | None:
    """Seconds between checks from ``KVSPLIT_REFRESH_S`` (or ``raw``); ``None`` when refreshing is off.

    Raises :class:`~kvsplit.dispatch.InvalidSetting` for a value that is not a
    number of seconds >= 0.
    """
    raw = os.environ.get(ENV_VAR) if raw is None else raw
    if raw in (None, ""):
        return DEFAULT_REFRESH_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0.0 or value == float("inf"):
        raise InvalidSetting(f"{ENV_VAR} must be a number of seconds >= 0 (0: never refresh the cached "
                             f"winners), got {raw!r}")
    return value or None


class Refresher:
    """Calls ``check()`` every :func:`refresh_interval` seconds in a daemon thread.

    ``check`` is held weakly: the thread ends with its owner, and when
    refreshing is turned off (started again by :meth:`start`). A forked child
    starts its own thread if the parent had one (threads do not survive
    ``fork``).
    """

    def __init__(self, check: Callable[[], object]):
        self._check = weakref.WeakMethod(check) if hasattr(check, "__self__") else (lambda: check)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wanted = False  # started and not turned off: a forked child starts its own
        self._pid = os.getpid()
        os.register_at_fork(after_in_child=_after_fork(weakref.ref(self)))

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive() and self._pid == os.getpid()

    def start(self) -> None:
        """Start the thread unless it runs or refreshing is off (an invalid setting raises)."""
        if refresh_interval() is None:
            return
        with self._lock:
            if self.running:
                return
            self._pid = os.getpid()
            self._wanted = True
            self._thread = threading.Thread(target=self._loop, name="kvsplit-refresh", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        # Sleeps at most a second at a time, so that a new KVSPLIT_REFRESH_S
        # takes effect within a second (the check itself runs once per interval).
        last = time.monotonic()
        while True:
            try:
                interval = refresh_interval()
            except InvalidSetting:  # the next miss raises it to the caller; keep the default meanwhile
                interval = DEFAULT_REFRESH_S
            if interval is None:
                self._wanted = False
                return
            remaining = last + interval - time.monotonic()
            if remaining > 0:
                time.sleep(min(remaining, 1.0))
                continue
            last = time.monotonic()
            check = self._check()
            if check is None:
                return
            try:
                check()
            except Exception as error:  # noqa: BLE001 - a serving process must never die of this
                log.warning("kvsplit: refreshing the cached winners failed (%s: %s); trying again "
                            "in %g s", type(error).__name__, error, interval)
            del check

    def forked(self) -> None:
        """In a forked child: the parent's thread is gone; start one if the parent had one."""
        self._thread = None
        self._lock = threading.Lock()  # the parent may have held it at the fork
        if self._wanted:
            try:
                self.start()
            except InvalidSetting:
                pass


def _after_fork(ref: weakref.ref) -> Callable[[], None]:
    def hook() -> None:
        refresher = ref()
        if refresher is not None:
            refresher.forked()
    return hook
