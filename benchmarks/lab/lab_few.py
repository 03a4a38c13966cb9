"""Few lab: the product kernel and its knobs (few_geometry.h) side by side, beside the read probe.

    python -P benchmarks/lab/lab_few.py [--out DIR]      # the table (LAB_VARIANTS=a,b to pick)

Each variant builds lab_few.cu with other nvcc flags. Per shape ((tokens x heads) rows of
bf16 partials, base-2 LSE, N states): every variant at 1, 2 and 4 vectors a thread (those the
head dim allows) and the read probe, replayed in turns in CUDA graphs (L2-warm), each
output checked against float64 first. The knobs are guesses of the first version, made
without a GPU: the smallest and largest CTA (the launch's rule) and the launch bounds'
minimum of CTAs per SM (registers against resident threads). Needs torch only: the
package does not have to be installed.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import pathlib
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import labkit  # noqa: E402  (the lab's own helpers, beside this file)

timing = labkit.load("lab_timing", "autotune/timing.py")

VARIANTS = {
    "product": "",
    "cta64": "-DKVSPLIT_FEW_MIN_CTA_THREADS=64",     # no CTA of fewer than two warps
    "cta128": "-DKVSPLIT_FEW_MIN_CTA_THREADS=128",
    "max128": "-DKVSPLIT_FEW_MAX_CTA_THREADS=128",   # large calls in CTAs of 128
    "max512": "-DKVSPLIT_FEW_MAX_CTA_THREADS=512",
    "min2": "-DKVSPLIT_FEW_MIN_CTAS=2",              # at most 128 registers a thread
    "min4": "-DKVSPLIT_FEW_MIN_CTAS=4",              # at most 64
}
SOURCES = ["benchmarks/lab/lab_few.cu"]
# (rows = tokens x heads, head_dim, N)
SHAPES = [(32, 128, 2), (16, 512, 2), (4096, 128, 2), (32768, 128, 2), (16384, 512, 2),
          (32, 128, 8), (4096, 128, 8), (32768, 128, 4), (32, 128, 16), (4096, 128, 16),
          (512, 576, 4), (65536, 80, 2)]


def load_all(names):
    with ThreadPoolExecutor(len(names)) as pool:
        paths = list(pool.map(lambda n: labkit.build("few_" + n, VARIANTS[n], SOURCES), names))
    return {name: ctypes.CDLL(str(path)) for name, path in zip(names, paths)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp"))
    args = parser.parse_args()
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    names = [n for n in VARIANTS
             if n in os.environ.get("LAB_VARIANTS", ",".join(VARIANTS)).split(",")]
    libs = load_all(names)
    timing.spin_up_gpu()
    g = torch.Generator().manual_seed(0)
    lines = ["| rows | D | N | read | " + " | ".join(names) + " |",
             "|---" * (4 + len(names)) + "|"]
    for rows, head_dim, num_splits in SHAPES:
        (o, lse, out), p, reference = labkit.problem(rows, head_dim, num_splits, g)
        vectors = [v for v in (1, 2, 4) if (v - 1) * -(-(head_dim // 8) // v) < head_dim // 8]
        runs = {}
        for name, lib in libs.items():
            for v in vectors:
                def run(i, lib=lib, v=v):
                    status = lib.lab_few(ctypes.byref(p), v, sm_count, labkit.stream())
                    assert status == 0, status
                labkit.first_launch(lambda run=run: run(0), out, reference, (name, v))
                runs[(name, v)] = run
        lib = next(iter(libs.values()))
        runs["read"] = lambda i: labkit.read_probe(lib, o, lse, out)
        times = labkit.median_us(timing, runs, (o.numel() * 2 + out.numel() * 2) / 4e6 + 2.0)
        cells = []
        for name in names:
            best = min(vectors, key=lambda v: times[(name, v)])
            cells.append(f"{times[(name, best)]:.2f} (F{best})")
        lines.append(f"| {rows} | {head_dim} | {num_splits} | {times['read']:.2f} | "
                     + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    text = ("best over vectors a thread (F1/F2/F4), us per launch, graph replay in turns, "
            "L2-warm\n" + "\n".join(lines))
    labkit.report(args.out, "lab_few.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
