"""Replays the tuner's pruning rule against the candidate timings stored in tuning exports.

    python -P benchmarks/replay_pruning.py [EXPORT.json ...]   # default: kvsplit/tables/*.json

Every record of a ``kvsplit db export`` file keeps the timing of each
candidate its tuner ran. For each record this prints nothing; at the end it
reports, over all records, how many candidates ``autotune.tuner.prune``
keeps today, and the regret of its choice: the fastest candidate that
prune() keeps (among those stored) over the fastest stored one, both
measured side by side in that tuning run. It needs no GPU, so a change to
the pruning rule can be checked against measured data before a device run
(it can only judge a rule that keeps a subset of what was stored: configs
that were never timed are reported as unknown).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import sys

from kvsplit.autotune.tuner import prune
from kvsplit.export import read_export
from kvsplit.dispatch.constraints import configs_for_key

TABLES = pathlib.Path(__file__).resolve().parents[1] / "kvsplit" / "tables"


def replay(records) -> dict:
    regrets, kept_counts, unknown = [], [], 0
    worst = (0.0, None)
    for record in records:
        timed = {c.config: c.median_us for c in record.candidates if c.matched and c.samples}
        if not timed:
            continue
        kept = prune(configs_for_key(record.key, is_cuda=True), record.key)
        kept_counts.append(len(kept))
        unknown += sum(1 for c in kept if c not in timed)
        known = [timed[c] for c in kept if c in timed]
        if not known:
            continue
        regret = min(known) / min(timed.values()) - 1.0
        regrets.append(regret)
        if regret > worst[0]:
            worst = (regret, record.key)
    return {"records": len(regrets), "kept": kept_counts, "unknown": unknown,
            "regrets": regrets, "worst": worst}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exports", nargs="*", type=pathlib.Path)
    args = parser.parse_args()
    paths = args.exports or sorted(TABLES.glob("*.json"))
    records = [r for path in paths for r in read_export(path)]
    result = replay(records)
    kept, regrets = result["kept"], result["regrets"]
    if not regrets:
        print("no records with stored candidate timings")
        return 1
    geomean = math.exp(statistics.fmean(math.log1p(r) for r in regrets)) - 1.0
    regret, key = result["worst"]
    print(f"{result['records']} records from {len(paths)} file(s); prune() keeps "
          f"{statistics.median(kept):.0f} candidates (median), {max(kept)} at most; "
          f"{result['unknown']} kept candidates were never timed")
    print(f"regret of the pruned choice: geomean {geomean:.2%}, worst {regret:.2%}"
          + (f" (D {key.head_dim}, {key.partial_dtype}, {key.stats_format}, "
             f"N {key.num_splits}, rows {key.rows})" if key else "")
          + f", over 2 % at {sum(r > 0.02 for r in regrets)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
