"""What a float32 output's store costs a two-state merge: the same hand merge (bf16 partials,
base-2 LSE) with 16- or 8-byte loads a lane and each way of storing float32 (lab_store.cu
says which), beside the product writing bf16 and float32 and the read probe over each
output's bytes.

    python -P benchmarks/lab/lab_store.py [--out DIR]

us per launch, graph replay in turns, L2-warm; every output checked against float64 first.
Needs torch, and an installed kvsplit with CUDA kernels for the product's columns.
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

VARIANTS = {"bf16": (0, torch.bfloat16), "two": (1, torch.float32), "pair": (2, torch.float32),
            "w8": (3, torch.float32), "w8bf": (4, torch.bfloat16)}
# (rows, head_dim)
SHAPES = [(512, 128), (4096, 128), (4096, 512), (1024, 576), (16384, 128), (32768, 128)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp"))
    args = parser.parse_args()
    lib = ctypes.CDLL(str(labkit.build("store", "", ["benchmarks/lab/lab_store.cu"])))
    try:
        import kvsplit
    except ImportError:
        kvsplit = None
    timing.spin_up_gpu()
    g = torch.Generator().manual_seed(0)
    names = ["read bf16", "read fp32", *VARIANTS, "product bf16", "product fp32"]
    lines = ["| rows x D | MB (bf16 out) | " + " | ".join(names) + " | pair - bf16 | w8 - bf16 |",
             "|---" * (len(names) + 4) + "|"]
    for rows, head_dim in SHAPES:
        (o, lse, out16), _, reference = labkit.problem(rows, head_dim, 2, g, empty_every=7)
        out32 = torch.empty(rows, head_dim, dtype=torch.float32, device="cuda")
        outs = {torch.bfloat16: out16, torch.float32: out32}
        runs = {}
        for name, (variant, dtype) in VARIANTS.items():
            out = outs[dtype]

            def launch(variant=variant, out=out):
                return lib.lab_store(variant, ctypes.c_void_p(o.data_ptr()), ctypes.c_void_p(lse.data_ptr()),
                                     ctypes.c_void_p(out.data_ptr()), rows, head_dim, labkit.stream())

            if labkit.first_launch(launch, out, reference, (name, rows, head_dim)):
                runs[name] = lambda i, launch=launch: launch()
        if kvsplit is not None:
            for dtype, name in ((torch.bfloat16, "product bf16"), (torch.float32, "product fp32")):
                out = outs[dtype]

                def merge(out=out):
                    kvsplit.merge_lse(o, lse, base=2, out=out)
                    return 0

                labkit.first_launch(merge, out, reference, (name, rows, head_dim))
                runs[name] = lambda i, merge=merge: merge()
        runs["read bf16"] = lambda i: labkit.read_probe(lib, o, lse, out16)
        runs["read fp32"] = lambda i: labkit.read_probe(lib, o, lse, out32)
        megabytes = (o.numel() * 2 + lse.numel() * 4 + out16.numel() * 2) / 1e6
        times = labkit.median_us(timing, runs, megabytes / 4 + 2.0)
        cells = [f"{times[n]:.2f}" if n in times else "-" for n in names]
        lines.append(f"| {rows} x {head_dim} | {megabytes:.1f} | " + " | ".join(cells)
                     + f" | {times['pair'] - times['bf16']:+.2f} | {times['w8'] - times['bf16']:+.2f} |")
        print(lines[-1], flush=True)
    text = "us per launch, two bf16 states, base-2 LSE, graph replay in turns, L2-warm\n" + "\n".join(lines)
    labkit.report(args.out, "lab_store.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
