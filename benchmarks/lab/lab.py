"""Kernel lab: compile variants of merge_kvsplit.cuh's experiment knobs and time them side by side.

    python -P benchmarks/lab/lab.py [--out DIR]            # the timing table
    python -P benchmarks/lab/lab.py --one VARIANT D ROWS N K  # three launches, for ncu

Each variant is one shared library built from lab_kernel.cu with -D flags
(compiled in parallel); all run on the same buffers in one process and are
replayed in turns (CUDA graphs), so the ratios between them are measured side
by side. Needs torch and the installed package (its K rules, kvsplit.dispatch.constraints).
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import pathlib
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import labkit  # noqa: E402  (the lab's own helpers, beside this file)

timing = labkit.load("lab_timing", "autotune/timing.py")
from kvsplit.dispatch import constraints  # noqa: E402  (the package's K rules)
Params, RowStrides = labkit.Params, labkit.RowStrides

# Name -> nvcc flags (the knobs at the top of merge_kvsplit.cuh). "-I DIR" ahead of
# csrc/include swaps in another copy of a header, e.g. an older merge_kvsplit.cuh.
VARIANTS = {
    "product": "",
    "unroll8": "-DKVSPLIT_LOAD_UNROLL=8",
    "unroll8,128reg": "-DKVSPLIT_LOAD_UNROLL=8 -DKVSPLIT_MIN_CTAS=1",
}
SHAPES = [(512, 64, 16), (512, 64, 132), (128, 32, 264), (512, 2048, 132), (512, 64, 264),
          (128, 32, 16), (128, 256, 132), (512, 512, 132), (128, 2048, 64)]


def build_all(names) -> dict:
    with ThreadPoolExecutor(len(names)) as pool:
        paths = pool.map(lambda name: labkit.build(name, VARIANTS[name],
                                                   ["benchmarks/lab/lab_kernel.cu"]), names)
    return {name: ctypes.CDLL(str(path)).lab_launch for name, path in zip(names, paths)}


def problem(head_dim, rows, num_splits, generator):
    m = torch.randn(num_splits, rows, generator=generator) * 2
    l = 1 + 64 * torch.rand(num_splits, rows, generator=generator)
    o = (torch.randn(num_splits, rows, head_dim, generator=generator) * l.unsqueeze(-1)).cuda().bfloat16()
    stats = torch.stack([m, l], -1).cuda()
    out = torch.empty(rows, head_dim, dtype=torch.bfloat16, device="cuda")
    p = Params(partial_o=o.data_ptr(), stats=stats.data_ptr(), out=out.data_ptr(),
               head_dim=head_dim, num_splits=num_splits, rows=rows, heads=1, seqlen=1,
               o_stride_split=o.stride(0), o_row=RowStrides(o.stride(1), 0, o.stride(1)),
               stats_stride_split=stats.stride(0),
               stats_row=RowStrides(stats.stride(1), 0, stats.stride(1)),
               out_row=RowStrides(out.stride(0), 0, out.stride(0)), row_mask_stride=1,
               log2_scale=1.0 / math.sqrt(head_dim) * 1.4427, export_scale=0.6931,
               empty_stat=math.nan)
    return (o, stats, out), p


def launcher(launch, p, head_dim, k, sm_count):
    def run(i):
        status = launch(ctypes.byref(p), head_dim, k, sm_count,
                        ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        assert status == 0, status
    return run


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp"))
    parser.add_argument("--one", nargs=5, metavar=("VARIANT", "D", "ROWS", "N", "K"))
    args = parser.parse_args()
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator().manual_seed(0)
    if args.one:
        name, *numbers = args.one
        head_dim, rows, num_splits, k = map(int, numbers)
        run = launcher(build_all([name])[name], problem(head_dim, rows, num_splits, g)[1],
                       head_dim, k, sm_count)
        for i in range(3):
            run(i)
        torch.cuda.synchronize()
        return 0
    names = [n for n in VARIANTS if n in os.environ.get("LAB_VARIANTS", ",".join(VARIANTS)).split(",")]
    launchers = build_all(names)
    timing.spin_up_gpu()
    lines = ["| D | rows | N | " + " | ".join(names) + " |", "|---" * (3 + len(names)) + "|"]
    for head_dim, rows, num_splits in SHAPES:
        buffers, p = problem(head_dim, rows, num_splits, g)
        out = buffers[2]
        ks = constraints.valid_kv_splits(head_dim=head_dim, elem_bytes=2, rows=rows,
                                         num_splits=num_splits, sm_count=sm_count)
        runs = {(name, k): launcher(launch, p, head_dim, k, sm_count)
                for name, launch in launchers.items() for k in ks}
        reference = None
        for key, run in runs.items():
            run(0)
            torch.cuda.synchronize()
            if reference is None:
                reference = out.float().clone()
            err = (out.float() - reference).abs().max().item()
            assert err <= 0.02 * reference.abs().max().item(), (key, err)
        times = {key: t.median_us for key, t in
                 timing.time_cuda_graphs(runs, batch=64, replays=15).items()}
        cells = []
        for name in names:
            best = min(ks, key=lambda k: times[(name, k)])
            cells.append(f"{times[(name, 1)]:.2f} / {times[(name, best)]:.2f} ({best})")
        lines.append(f"| {head_dim} | {rows} | {num_splits} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    text = "K=1 / best (K), us per launch, graph replay in turns, L2-warm\n" + "\n".join(lines)
    print(text)
    (args.out / "lab.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
