"""Compares the candidate timings of two groups of tuning exports, config by config.

    python -P benchmarks/compare_records.py --base A.json [A2.json ...] --new B.json [B2.json ...]

Every record of a ``kvsplit db export`` file keeps the median time of each
candidate its tuner ran. A candidate timed in both groups (same key but for
the kernel build, same config) gives one ratio: its new time over its base
time, each the median over the group's files (tune the same grid several
times, alternating the builds, so that a drift of the GPU shows as spread
rather than as a difference). The report gives, per family and per row
bucket, the geomean ratio, its 10th and 90th percentile and the count, and
the keys whose best candidate moved most. It is how two kernel builds are
compared on one machine: ``gpu_check.sh`` stage ``against-base``.
"""

from __future__ import annotations

import argparse
import collections
import math
import pathlib
import statistics
import sys

from kvsplit.export import read_export


def _timings(paths: list[pathlib.Path]) -> dict:
    """(key without its build, config) -> median over the files of each file's median time."""
    times: dict = collections.defaultdict(list)
    for path in paths:
        for record in read_export(path.read_text()):
            key = record.key.model_copy(update={"build_hash": ""})
            for candidate in record.candidates:
                if candidate.matched and candidate.samples:
                    times[(key, candidate.config)].append(candidate.median_us)
    return {pair: statistics.median(values) for pair, values in times.items()}


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _geomean(ratios) -> float:
    ratios = list(ratios)
    return math.exp(statistics.fmean(map(math.log, ratios)))


def _line(family: str, rows: int | None, ratios: list[float]) -> str:
    ratios = sorted(ratios)
    return (f"| {family} | {rows or 'all'} | {len(ratios)} | {_geomean(ratios):.3f} | "
            f"{_quantile(ratios, 0.1):.3f} | {_quantile(ratios, 0.9):.3f} |")


def compare(base: dict, new: dict, moved: int = 8) -> list[str]:
    pairs = sorted(base.keys() & new.keys(), key=str)
    if not pairs:
        return ["no candidate was timed in both groups"]
    groups: dict = collections.defaultdict(list)  # (family, rows or 0 for all rows) -> ratios
    base_best: dict = collections.defaultdict(lambda: math.inf)
    new_best: dict = collections.defaultdict(lambda: math.inf)
    for key, config in pairs:
        ratio = new[(key, config)] / base[(key, config)]
        groups[(config.family, 0)].append(ratio)
        groups[(config.family, key.rows)].append(ratio)
        base_best[key] = min(base_best[key], base[(key, config)])
        new_best[key] = min(new_best[key], new[(key, config)])
    lines = ["| family | rows | candidates | new / base geomean | p10 | p90 |",
             "|---|---|---|---|---|---|"]
    lines += [_line(family, rows, ratios) for (family, rows), ratios in sorted(groups.items())]
    keys = sorted(base_best, key=lambda k: new_best[k] / base_best[k])
    shown = keys if len(keys) <= moved else keys[:moved // 2] + keys[-(moved // 2):]
    lines += ["", f"Best candidate of each key: geomean new / base "
              f"{_geomean(new_best[k] / base_best[k] for k in keys):.3f} over {len(keys)} keys. "
              f"Moved most:", "",
              "| D | dtype | format | N | rows | base us | new us | new / base |", "|---|---|---|---|---|---|---|---|"]
    for key in shown:
        b, n = base_best[key], new_best[key]
        lines.append(f"| {key.head_dim} | {key.partial_dtype} | {key.stats_format} | {key.num_splits} | "
                     f"{key.rows} | {b:.2f} | {n:.2f} | {n / b:.3f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", nargs="+", type=pathlib.Path, required=True)
    parser.add_argument("--new", nargs="+", type=pathlib.Path, required=True)
    args = parser.parse_args(argv)
    print("\n".join(compare(_timings(args.base), _timings(args.new))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
