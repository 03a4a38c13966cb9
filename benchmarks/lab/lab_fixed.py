"""Fixed cost of a small Few launch: the product kernel beside lab kernels that add one of
its parts at a time to a bare two-state merge (lab_fixed.cu says which), the serial Triton
peer, the read probe and an empty kernel, at decode sizes, N = 2.

    python -P benchmarks/lab/lab_fixed.py [--out DIR] [--variants a,b,...] [--shapes R:D,...]

us per launch, graph replay in turns, L2-warm; every output checked against float64 first.
Needs torch (and triton for the peer); the package does not have to be installed.
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
peers = labkit.load("lab_peers", "benchmarks/peers.py")

VARIANTS = ["bare", "ex", "pdl", "bigp", "any", "general", "product", "hand16", "hand8", "hand4",
            "row16", "row8", "hdiv", "h64", "hstate", "hfirst", "lean8", "lean6", "lean4",
            "lconst", "lnoloop", "lfin", "lnochk", "lexit", "lbare", "l8", "l8row", "l16row", "lean",
            "p8", "p8row", "p16row", "pshift", "pflat", "pmath", "pnoexp", "phand", "pnopdl",
            "hbigp", "htail", "hmid", "pair", "packed", "pkrow", "pk8", "pk8row", "pkc64", "pkc128", "pkc256", "pk8c128",
            "pk8c256", "pk1l", "pk1l0", "hspread", "hlate"]
SHAPES = [(8, 128), (32, 128), (128, 128), (512, 128), (4096, 128), (32768, 128), (16, 512),
          (1024, 512)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp"))
    parser.add_argument("--variants", help="comma-separated subset of the variants (default: all)")
    parser.add_argument("--shapes", help="comma-separated rows:D pairs (default: the decode grid)")
    args = parser.parse_args()
    variants = args.variants.split(",") if args.variants else VARIANTS
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants: {sorted(unknown)}")
    shapes = ([tuple(int(v) for v in pair.split(":")) for pair in args.shapes.split(",")]
              if args.shapes else SHAPES)
    lib = ctypes.CDLL(str(labkit.build("fixed", "", ["benchmarks/lab/lab_fixed.cu"])))
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    timing.spin_up_gpu()
    g = torch.Generator().manual_seed(0)

    names = ["noop", "read", "triton", "triton4w"] + variants
    lines = ["| rows | D | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]
    for rows, head_dim in shapes:
        (o, lse, out), p, reference = labkit.problem(rows, head_dim, 2, g)
        runs = {}
        for name in variants:
            def run(i, k=VARIANTS.index(name)):
                return lib.lab_fixed(ctypes.byref(p), k, sm_count, labkit.stream())
            if labkit.first_launch(lambda run=run: run(0), out, reference, (name,)):
                runs[name] = run
        runs["noop"] = lambda i: lib.lab_noop(1, labkit.stream())
        runs["read"] = lambda i: labkit.read_probe(lib, o, lse, out)
        runs["triton"] = lambda i: peers.triton_merge(o, lse, out, stats_format="lse", base=2.0)
        runs["triton4w"] = lambda i: peers.triton_merge(o, lse, out, stats_format="lse", base=2.0,
                                                        num_warps=4)
        times = labkit.median_us(timing, runs, (o.numel() * 2 + out.numel() * 2) / 4e6 + 2.0)
        lines.append(f"| {rows} | {head_dim} | "
                     + " | ".join(f"{times[n]:.2f}" if n in times else "-" for n in names) + " |")
        print(lines[-1], flush=True)
    text = "us per launch, N = 2, bf16, graph replay in turns, L2-warm\n" + "\n".join(lines)
    labkit.report(args.out, "lab_fixed.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
