"""The processes of the fleet tests, each started as a script: a process of its own, as a host would be.

``python fleetlib.py JOB.json`` runs one job:

- ``{"role": "worker", "ready": FILE, "start": FILE, "delay_s": S, "hold_s": S or null, "argv": [...]}``:
  imports kvsplit and torch, writes ``ready``, waits until ``start`` exists,
  then runs the real command line (``kvsplit.cli.main(argv)``). Tuning a key
  takes ``delay_s`` longer than it would (a tiny CPU grid would otherwise be
  done before the other workers start); with ``hold_s`` the first key takes
  that long instead, so that the test can kill the worker while it holds the claim.
- ``{"role": "serve", "ready": FILE, "shape": [D, N, ROWS], "timeout_s": S}``: a
  serving process (``KVSPLIT_MODE``, ``KVSPLIT_REFRESH_S`` and ``KVSPLIT_DB``
  from its environment) that merges one shape every 50 ms and prints one JSON
  line per change of the config its kept launch holds, ``{"t": unix time,
  "source": ..., "config": ..., "launches": ...}``, until the source is the
  database (or the timeout).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _wait_for(path: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} never appeared")
        time.sleep(0.02)


def worker(job: dict) -> None:
    import torch  # noqa: F401 - imported before the start, as the command would

    from kvsplit.autotune import tuner
    from kvsplit.cli import main

    real_tune = tuner.tune
    calls = []

    def slow_tune(*args, **kwargs):
        calls.append(1)
        time.sleep(job["hold_s"] if job.get("hold_s") and len(calls) == 1 else job["delay_s"])
        return real_tune(*args, **kwargs)

    tuner.tune = slow_tune
    Path(job["ready"]).write_text("ready")
    _wait_for(job["start"])
    main(job["argv"], prog_name="kvsplit")


def serve(job: dict) -> None:
    import torch

    import kvsplit
    from kvsplit import merge
    from kvsplit.dispatch import dispatcher as dispatch_module
    from kvsplit.dispatch.device import device_facts
    from kvsplit.reference import random_partials

    head_dim, num_splits, rows = job["shape"]
    partial_o, stats = random_partials(num_splits, rows, head_dim, generator=torch.Generator().manual_seed(0))
    partial_o = partial_o.bfloat16()
    facts = device_facts(torch.device("cpu"))
    last = None
    deadline = time.monotonic() + job["timeout_s"]
    while time.monotonic() < deadline:
        kvsplit.merge_maxsum(partial_o, stats, 1.0)
        decision = dispatch_module.dispatcher.explain(facts, head_dim, torch.bfloat16, torch.bfloat16, 0,
                                                      num_splits, rows)
        launches = [p.kernel.config.label for p in merge._launches.values() if p.kernel is not None]
        now = (decision.source, decision.config.label, launches)
        if now != last:
            print(json.dumps({"t": time.time(), "source": now[0], "config": now[1], "launches": launches}), flush=True)
            last = now
            Path(job["ready"]).write_text("ready")
        if decision.source == "database":
            return
        time.sleep(0.05)
    raise SystemExit("the serving process never saw a winner from the database")


if __name__ == "__main__":
    JOB = json.loads(Path(sys.argv[1]).read_text())
    {"worker": worker, "serve": serve}[JOB["role"]](JOB)
