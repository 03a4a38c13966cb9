"""Few states at L2-resident sizes: the product's Few kernel beside hand-written merges whose
states are spread over S adjacent lanes (lab_split.cu says which), and the read probe.

    python -P benchmarks/lab/lab_split.py [--out DIR]

Shapes: rows = tokens x heads of bf16 partials, base-2 LSE, N = 4, 8, 16 (the sizes where
the Few family sits 1.15-1.20x over the read probe) and a few others. us per launch, graph
replay in turns, L2-warm; every output checked against float64 first. Needs torch only.
"""

from __future__ import annotations

import argparse
import ctypes
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import labkit  # noqa: E402

timing = labkit.load("lab_timing", "autotune/timing.py")

VARIANTS = ["product v1", "product v2", "split1", "split2", "split4", "half2", "half4", "phase",
            "m-base", "m-ldg", "m-math", "m-addr", "m-all", "m-pad", "m-far"]
# (rows, head_dim, N)
SHAPES = [(4096, 128, 4), (4096, 128, 8), (4096, 128, 16), (1024, 512, 4), (1024, 512, 8),
          (1024, 512, 16), (2048, 256, 8), (8192, 64, 8), (8192, 64, 16), (32, 128, 16),
          (512, 128, 8), (32768, 128, 4), (16384, 128, 8)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp"))
    args = parser.parse_args()
    lib = ctypes.CDLL(str(labkit.build("split", "", ["benchmarks/lab/lab_split.cu"])))
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    timing.spin_up_gpu()
    g = torch.Generator().manual_seed(0)

    names = ["read"] + VARIANTS
    lines = ["| rows | D | N | MB | " + " | ".join(names) + " | best / read | best |",
             "|---" * (len(names) + 6) + "|"]
    for rows, head_dim, num_splits in SHAPES:
        (o, lse, out), p, reference = labkit.problem(rows, head_dim, num_splits, g, empty_every=7)
        runs = {}
        for k, name in enumerate(VARIANTS):
            def run(i, k=k):
                status = lib.lab_split(ctypes.byref(p), k, sm_count, labkit.stream())
                assert status == 0, status
            if labkit.first_launch(lambda k=k: lib.lab_split(ctypes.byref(p), k, sm_count,
                                                            labkit.stream()),
                                   out, reference, (name, rows, head_dim, num_splits)):
                runs[name] = run  # else not for this shape (two vectors of a short row)
        runs["read"] = lambda i: labkit.read_probe(lib, o, lse, out)
        megabytes = (o.numel() * 2 + lse.numel() * 4 + out.numel() * 2) / 1e6
        times = labkit.median_us(timing, runs, megabytes / 4 + 2.0)
        best = min((n for n in VARIANTS if n in times), key=times.get)
        cells = [f"{times[n]:.2f}" if n in times else "-" for n in names]
        lines.append(f"| {rows} | {head_dim} | {num_splits} | {megabytes:.1f} | " + " | ".join(cells)
                     + f" | {times[best] / times['read']:.2f} | {best} |")
        print(lines[-1], flush=True)
    text = "us per launch, bf16, base-2 LSE, graph replay in turns, L2-warm\n" + "\n".join(lines)
    labkit.report(args.out, "lab_split.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
