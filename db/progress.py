"""Where each key of a fleet's grid stands, and the fleet's progress; pure functions, no database.

One rule serves ``kvsplit tune --status``, ``kvsplit db progress`` and the
workers' choice of what to claim next (:mod:`.claims`), so what the status
shows is what the workers do.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime
from typing import Literal

from .schemas import ClaimInfo, Progress, TuningKey, WorkerProgress

#: ``done``: result stored; ``claimed``: live lease; ``failed``: final for now;
#: ``expired``: lease ran out (claimable); ``left``: claimable.
Standing = Literal["done", "claimed", "failed", "expired", "left"]
CLAIMABLE: tuple[Standing, ...] = ("left", "expired")


def is_live(claim: ClaimInfo | None, now: datetime) -> bool:
    """Whether ``claim`` is held by a worker whose lease has not run out."""
    return (claim is not None and claim.state == "claimed" and claim.expires_at is not None
            and claim.expires_at > now)


def standing(claim: ClaimInfo | None, stored: bool, now: datetime, *,
             run_started: datetime | None = None, force: bool = False) -> Standing:
    """Where one key stands.

    Parameters
    ----------
    claim : ClaimInfo or None
        Its claim row; ``None`` when there is none or it does not parse (then
        the key is claimable, and the claim row is overwritten).
    stored : bool
        Whether a result is stored for the key.
    now : datetime
        The database's clock.
    run_started : datetime, optional
        When the asking worker started (database clock).  A failure from
        before that is tried again (a new run retries old failures); one from
        during the run is final for it, so workers never retry each other's
        failures in a loop.
    force : bool
        Re-tune stored keys, each once per run: a key counts as done only if
        it was finished after ``run_started``.
    """
    if is_live(claim, now):
        return "claimed"
    if claim is not None and claim.state == "claimed":
        return "expired"
    finished_in_run = (claim is not None and claim.state in ("done", "failed")
                       and (run_started is None or (claim.heartbeat_at is not None
                                                    and claim.heartbeat_at >= run_started)))
    if force and run_started is not None:
        return claim.state if finished_in_run else "left"  # type: ignore[union-attr, return-value]
    if stored:
        return "done"
    if finished_in_run and claim.state == "failed":  # type: ignore[union-attr]
        return "failed"
    return "left"  # open, never claimed, damaged, an old failure, or done but since pruned


def summarize(url: str, now: datetime, keys: Iterable[TuningKey], claims: dict[TuningKey, ClaimInfo],
              stored: set[TuningKey]) -> Progress:
    """The :class:`Progress` of ``keys`` given their claims and which ones have a stored result."""
    counts: dict[str, int] = defaultdict(int)
    workers: dict[str, list[ClaimInfo]] = defaultdict(list)
    failures = []
    attempts = 0
    keys = list(keys)
    for key in keys:
        claim = claims.get(key)
        where = standing(claim, key in stored, now)
        counts[where] += 1
        attempts += claim.attempts if claim is not None else 0
        if where == "claimed":
            workers[claim.owner or "?"].append(claim)  # type: ignore[union-attr]
        elif where == "failed":
            failures.append(claim)
    return Progress(
        url=url, now=now, keys=len(keys), done=counts["done"], claimed=counts["claimed"],
        failed=counts["failed"], left=counts["left"] + counts["expired"], expired=counts["expired"],
        attempts=attempts,
        workers=[WorkerProgress(owner=owner, claimed=len(held),
                                since=min((c.claimed_at for c in held if c.claimed_at), default=None),
                                heartbeat_at=max((c.heartbeat_at for c in held if c.heartbeat_at),
                                                 default=None))
                 for owner, held in sorted(workers.items())],
        failures=failures,
    )
