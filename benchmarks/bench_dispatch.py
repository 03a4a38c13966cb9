"""Dispatcher benchmarks: regret and first-use tuning time.

Run on a GPU machine:  python -P benchmarks/bench_dispatch.py [--out DIR]
(with KVSPLIT_DB filled by `kvsplit tune` over the benchmark grid, or empty).

Regret: the time of the config that `kv_split=None` picks (mode auto: a
stored choice for the shape's bucket, the shipped table, or profiling of the
pruned candidates at first use) over the best of *every* valid config of
both families, measured in the same run; on the benchmark grid and on 32
shapes the tuning grid did not see.
(Host time per call: benchmarks/bench_host.py.)
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

import torch

import kvsplit
from kvsplit import _kernel, merge
from kvsplit.autotune.timing import spin_up_gpu, time_cuda_graphs
from kvsplit.dispatch.constraints import valid_configs
from kvsplit.dispatch.device import device_facts
from kvsplit.dispatch.dispatcher import dispatcher

UNSEEN = [(d, r, n) for d in (512, 128) for r in (40, 100, 300, 1000) for n in (20, 48, 100, 200)]
GRID = [(d, r, n) for d, r in ((512, 64), (512, 128), (512, 512), (512, 2048), (128, 32),
                                (128, 256), (128, 2048)) for n in (16, 32, 64, 132, 264)]


def make(num_splits, rows, head_dim, g):
    m = torch.randn(num_splits, rows, generator=g) * 2
    l = 1 + 64 * torch.rand(num_splits, rows, generator=g)
    o = torch.randn(num_splits, rows, head_dim, generator=g) * l.unsqueeze(-1)
    return o.cuda().bfloat16(), torch.stack([m, l], -1).cuda()


def regret(g, sm_count, shapes):
    rows_out = []
    facts = device_facts(torch.device("cuda", 0))
    for head_dim, rows, num_splits in shapes:
        o, stats = make(num_splits, rows, head_dim, g)
        out = torch.empty(rows, head_dim, dtype=torch.bfloat16, device="cuda")
        configs = valid_configs(head_dim=head_dim, elem_bytes=2, rows=rows,
                                num_splits=num_splits, sm_count=sm_count)
        # Every config replayed in turns (fair against drift), as the tuner does.
        timings = time_cuda_graphs({c: (lambda i, c=c: _kernel.launch(c, merge.MAXSUM, o, stats, out, 0.1, merge._LN2))
            for c in configs}, batch=32, replays=15)
        times = {c: t.median_us for c, t in timings.items()}
        torch.cuda.synchronize()
        begin = time.perf_counter()
        kvsplit.merge_maxsum(o, stats, 0.1, out=out)
        torch.cuda.synchronize()
        first_ms = (time.perf_counter() - begin) * 1e3
        decision = dispatcher.explain(facts, head_dim, torch.bfloat16, torch.bfloat16, 0,
                                      num_splits, rows)
        best = min(times, key=times.get)
        auto = decision.config
        rows_out.append({"head_dim": head_dim, "rows": rows, "num_splits": num_splits,
                         "best": best.label, "best_us": times[best], "auto": auto.label,
                         "auto_us": times[auto], "source": decision.source,
                         "first_call_ms": first_ms, "regret": times[auto] / times[best] - 1,
                         # every config's time, so that a pruning rule can be judged offline
                         "times": {c.label: round(t, 3) for c, t in times.items()}})
        r = rows_out[-1]
        print(f"  D={head_dim} rows={rows} N={num_splits}: best {best.label} {times[best]:.2f} us, "
              f"auto {auto.label} ({r['source']}, first call {first_ms:.1f} ms) "
              f"regret {100 * r['regret']:.1f}%", flush=True)
    return rows_out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    spin_up_gpu()
    g = torch.Generator().manual_seed(7)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    summaries = {}
    for name, shapes in (("grid", GRID), ("unseen", UNSEEN)):
        print(f"regret on the {name} shapes (mode auto):", flush=True)
        rows = regret(g, sm_count, shapes)
        regrets = [max(r["regret"], 0.0) for r in rows]
        geomean = math.exp(sum(math.log1p(x) for x in regrets) / len(regrets)) - 1
        tuned = sorted(r["first_call_ms"] for r in rows if r["source"] == "tuned")
        summaries[name] = {"rows": rows, "geomean_regret": geomean, "worst_regret": max(regrets),
                           "tuned_keys": len(tuned), "first_use_ms": tuned}
        print(f"{name}: geomean regret {100 * geomean:.2f}%, worst {100 * max(regrets):.2f}%; "
              f"first-use tuning {len(tuned)} keys, median "
              f"{tuned[len(tuned) // 2] if tuned else float('nan'):.1f} ms, "
              f"max {max(tuned) if tuned else float('nan'):.1f} ms, "
              f"{sum(t <= 50 for t in tuned)} of {len(tuned)} <= 50 ms", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_dispatch.json").write_text(json.dumps(
            {"regret": summaries}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
