"""A fleet worker: claims the keys of a grid one at a time, tunes each, stores it with its claim's end.

Any number of these, on any number of hosts, run the same ``kvsplit tune``
command line against one database URL; the database is the only thing they
share (see :mod:`kvsplit.db.claims`).  A worker stops when nothing of its
grid is left to claim and nobody else holds a live lease on any of it: a
worker that waits for others is there to take over the key of one that dies.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..db import Claim, Claims, StoreError, TuningKey, TuningRecord

log = logging.getLogger("kvsplit.autotune")

#: Default lease of a claim, in seconds; heartbeats renew it every third of that.
DEFAULT_LEASE_S = 60.0
#: Outcome messages: ("tuned", key JSON, record JSON), ("failed", key JSON, error text).
Report = Callable[[tuple], None]


def owner_name(device: str) -> str:
    """Who holds a claim: ``host/pid/device`` (unique among live workers)."""
    return f"{socket.gethostname()}/{os.getpid()}/{device}"


def poll_interval(lease_s: float) -> float:
    """How long a worker waits, in seconds, before it looks again for keys that others hold."""
    return max(0.05, min(1.0, lease_s / 4))


class Heartbeat:
    """Renews a claim's lease every ``lease_s / 3`` seconds in a thread, while the key is tuned."""

    def __init__(self, claims: Claims, claim: Claim, lease_s: float):
        self._claims, self._claim, self._lease_s = claims, claim, lease_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="kvsplit-heartbeat", daemon=True)
        self.lost = False

    def _beat(self) -> None:
        while not self._stop.wait(self._lease_s / 3):
            try:
                if not self._claims.renew(self._claim, self._lease_s):
                    self.lost = True
                    log.warning("kvsplit: the claim on %s was taken over (a lease ran out); its result "
                                "is stored all the same", self._claim.key.choice_key)
                    return
            except StoreError as error:  # the next renewal may get through; finish() will tell
                log.warning("kvsplit: could not renew the claim on %s: %s", self._claim.key.shape_label, error)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class WorkerResult:
    """What one worker did besides its outcomes: the keys it took over from expired claims."""

    owner: str
    taken_over: list[tuple[TuningKey, str]] = field(default_factory=list)


def run_worker(claims: Claims, keys: Sequence[TuningKey], tune_one: Callable[[TuningKey], TuningRecord],
               report: Report, *, owner: str, lease_s: float = DEFAULT_LEASE_S, force: bool = False,
               on_standings: Callable[[dict[str, int]], None] | None = None) -> WorkerResult:
    """Claim, tune and store keys of ``keys`` until the grid is finished; report each outcome.

    ``tune_one`` raising is a failed key (recorded in its claim, reported,
    and the grid goes on); a :class:`StoreError` stops the worker.  Keys that
    others finish are not reported (the caller counts them as skipped).
    """
    result = WorkerResult(owner)
    if not keys:
        return result
    run_started = claims.now()
    claims.register(keys)
    while True:
        step = claims.claim_next(keys, owner, lease_s, run_started=run_started, force=force)
        if on_standings is not None:
            on_standings(step.standings)
        claim = step.claim
        if claim is None:
            if step.busy == 0:
                return result
            time.sleep(poll_interval(lease_s))
            continue
        if claim.taken_from is not None:
            result.taken_over.append((claim.key, claim.taken_from))
            log.info("kvsplit: took over %s from %s, whose lease ran out", claim.key.shape_label, claim.taken_from)
        raw = claim.key.model_dump_json()
        with Heartbeat(claims, claim, lease_s):
            try:
                record = tune_one(claim.key)
            except StoreError:
                raise
            except Exception as error:  # noqa: BLE001 - one failed key must not stop the grid
                text = f"{type(error).__name__}: {error}"
                claims.finish(claim, error=text)
                report(("failed", raw, text))
                continue
        claims.finish(claim, record=record)
        report(("tuned", raw, record.model_dump_json()))
