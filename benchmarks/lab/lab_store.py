"""What a float32 or FP8 output's store costs a two-state merge: the same hand merge (bf16
partials, base-2 LSE) with 8-, 16- or 32-byte loads a lane and each way of storing float32
and FP8 e4m3fn with a per-tensor scale (lab_store.cu says which), beside the product writing
bf16, float32 and FP8 and the read probe over each output's bytes (and, as `read4`, the
probe's former geometry: a thread per four input chunks).

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

FP8 = torch.float8_e4m3fn
VARIANTS = {"bf16": (0, torch.bfloat16), "two": (1, torch.float32), "pair": (2, torch.float32),
            "w8": (3, torch.float32), "w8bf": (4, torch.bfloat16), "fp8": (5, FP8), "fp8w32": (6, FP8),
            "fp8pair": (7, FP8)}
PRODUCT = {"product bf16": torch.bfloat16, "product fp32": torch.float32, "product fp8": FP8}
READS = {"read bf16": torch.bfloat16, "read fp32": torch.float32, "read fp8": FP8}
# The probe's former geometry (a thread per four input chunks): what the ratios before it
# changed were taken against.
READS4 = {"read4 bf16": torch.bfloat16, "read4 fp32": torch.float32, "read4 fp8": FP8}
SCALE = 0.5  # FP8 outputs: value / SCALE
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
    names = [*READS, *READS4, *VARIANTS, *PRODUCT]
    differences = (("pair", "bf16"), ("w8", "bf16"), ("fp8", "bf16"), ("fp8w32", "fp8"), ("fp8pair", "fp8"))
    lines = ["| rows x D | MB (bf16 out) | " + " | ".join(names) + " | "
             + " | ".join(f"{a} - {b}" for a, b in differences) + " |",
             "|---" * (len(names) + 2 + len(differences)) + "|"]
    scale = torch.tensor([SCALE], device="cuda")
    for rows, head_dim in SHAPES:
        (o, lse, out16), _, reference = labkit.problem(rows, head_dim, 2, g, empty_every=7)
        outs = {torch.bfloat16: out16,
                **{dtype: torch.empty(rows, head_dim, dtype=dtype, device="cuda") for dtype in (torch.float32, FP8)}}
        # FP8: the reference scaled, within half an e4m3 step (2^-4 relative) of it.
        targets = {dtype: (reference, 0.0) for dtype in outs} | {FP8: (reference / SCALE, 2.0 ** -4)}
        runs = {}
        for name, (variant, dtype) in VARIANTS.items():
            out = outs[dtype]

            def launch(variant=variant, out=out):
                return lib.lab_store(variant, ctypes.c_void_p(o.data_ptr()), ctypes.c_void_p(lse.data_ptr()),
                                     ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(scale.data_ptr()), rows,
                                     head_dim, labkit.stream())

            if labkit.first_launch(launch, out, targets[dtype][0], (name, rows, head_dim), targets[dtype][1]):
                runs[name] = lambda i, launch=launch: launch()
        if kvsplit is not None:
            for name, dtype in PRODUCT.items():
                out = outs[dtype]
                extra = {"out_scale": scale} if dtype == FP8 else {}

                def merge(out=out, extra=extra):
                    kvsplit.merge_lse(o, lse, base=2, out=out, **extra)
                    return 0

                labkit.first_launch(merge, out, targets[dtype][0], (name, rows, head_dim), targets[dtype][1])
                runs[name] = lambda i, merge=merge: merge()
        for name, dtype in READS.items():
            runs[name] = lambda i, out=outs[dtype]: labkit.read_probe(lib, o, lse, out)
        for name, dtype in READS4.items():
            runs[name] = lambda i, out=outs[dtype]: labkit.read_probe(lib, o, lse, out, quarter=True)
        megabytes = (o.numel() * 2 + lse.numel() * 4 + out16.numel() * 2) / 1e6
        times = labkit.median_us(timing, runs, megabytes / 4 + 2.0)
        cells = [f"{times[n]:.2f}" if n in times else "-" for n in names]
        lines.append(f"| {rows} x {head_dim} | {megabytes:.1f} | " + " | ".join(cells)
                     + "".join(f" | {times[a] - times[b]:+.2f}" if a in times and b in times else " | -"
                               for a, b in differences) + " |")
        print(lines[-1], flush=True)
    text = "us per launch, two bf16 states, base-2 LSE, graph replay in turns, L2-warm\n" + "\n".join(lines)
    labkit.report(args.out, "lab_store.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
