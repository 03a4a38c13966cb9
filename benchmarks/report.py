"""Turns the JSON of bench_merge.py and bench_dispatch.py into markdown sections.

    python benchmarks/report.py DIR     (DIR holds bench_merge.json, bench_dispatch.json)
"""

from __future__ import annotations

import json
import math
import pathlib
import sys

# Reference figures for the seed's design on an H200 (issue 2): K=1, best K, floor.
REFERENCE = {(512, 64, 132): (20.4, 5.3, 2.05), (512, 64, 16): (3.7, 2.5, 0.50),
             (128, 32, 264): (38.8, 5.8, 0.52), (512, 2048, 132): (65.6, 65.6, 65.8)}


def merge_sections(data: dict) -> str:
    by_shape = {(r["head_dim"], r["rows"], r["num_splits"]): r for r in data["results"]}
    lines = ["| D / rows / N | K=1 measured / reference | best measured / reference | "
             "K=1 ratio | best ratio |", "|---|---|---|---|---|"]
    for shape, (k1, best, _) in REFERENCE.items():
        r = by_shape[shape]
        got_best = r["warm"][str(r["best_k"])] if isinstance(next(iter(r["warm"])), str) \
            else r["warm"][r["best_k"]]
        got_k1 = r["warm"]["1"] if "1" in r["warm"] else r["warm"][1]
        lines.append(f"| {shape[0]} / {shape[1]} / {shape[2]} | {got_k1:.2f} / {k1} | "
                     f"{got_best:.2f} (K={r['best_k']}) / {best} | {got_k1 / k1:.2f} | "
                     f"{got_best / best:.2f} |")
    return "\n".join(lines)


def dispatch_sections(data: dict) -> str:
    rows = data["regret"]
    regrets = [max(r["regret"], 0.0) for r in rows]
    tuned = sorted(r["first_call_ms"] for r in rows if r["source"] == "tuned")
    lines = [
        f"Unseen shapes: {len(rows)}; geomean regret {100 * data['geomean_regret']:.2f} %, "
        f"worst {100 * max(regrets):.2f} %; {sum(1 for x in regrets if x > 0)} shapes with "
        "any regret.",
        f"First-use tuning (first call of an untuned key, wall clock, includes building the "
        f"scratch tensors): median {tuned[len(tuned) // 2]:.1f} ms, "
        f"{sum(1 for t in tuned if t <= 50)} of {len(tuned)} keys within 50 ms, max "
        f"{tuned[-1]:.1f} ms (the first key of the process, which also pays CUDA-graph "
        "and database start-up).",
        "",
        "| D | rows | N | best K | best us | auto K | auto us | regret | first call ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['head_dim']} | {r['rows']} | {r['num_splits']} | {r['best_k']} | "
                     f"{r['best_us']:.2f} | {r['auto_k']} | {r['auto_us']:.2f} | "
                     f"{100 * r['regret']:.1f} % | {r['first_call_ms']:.1f} |")
    lines += ["", "Host time per call, no sync (D=512 rows=64 N=16, a cache hit):", "",
              "| call | us |", "|---|---|"]
    lines += [f"| {name} | {us:.2f} |" for name, us in data["host_overhead_us"].items()]
    return "\n".join(lines)


def main() -> int:
    folder = pathlib.Path(sys.argv[1])
    merge = json.loads((folder / "bench_merge.json").read_text())
    print(f"## vs the reference figures ({merge['gpu']}, copy {merge['copy_bytes_per_us'] / 1e6:.2f}"
          f" TB/s, empty launch {merge['noop_us']:.2f} us)\n")
    print(merge_sections(merge))
    dispatch = folder / "bench_dispatch.json"
    if dispatch.exists():
        print("\n## Dispatcher\n")
        print(dispatch_sections(json.loads(dispatch.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
