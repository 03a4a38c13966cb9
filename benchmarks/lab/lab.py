"""Kernel lab: compile variants of merge.cuh's experiment knobs and time them side by side.

    python -P benchmarks/lab/lab.py [--out DIR]

Each variant is one shared library built from lab_kernel.cu with -D flags
(compiled in parallel); all run on the same buffers in one process, so the
ratios between them are measured side by side.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import pathlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from kvsplit.autotune.timing import spin_up_gpu, time_cuda_graph
from kvsplit.dispatch.constraints import valid_kv_splits

ROOT = pathlib.Path(__file__).resolve().parents[2]
VARIANTS = {
    "product": "",
    "unroll8,128reg": "-DKVSPLIT_MIN_CTAS=1 -DKVSPLIT_LOAD_UNROLL=8",
}
SHAPES = [(512, 64, 16), (512, 64, 132), (512, 64, 264), (128, 32, 16), (128, 32, 264),
          (128, 256, 132), (512, 512, 132), (512, 2048, 132), (128, 2048, 64)]


class Params(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("partial_o", "stats", "split_counts", "sinks", "out", "out_stats")] + \
               [(name, ctypes.c_int64) for name in
                ("num_splits", "rows", "heads", "o_stride_split", "o_stride_row",
                 "stats_stride_split", "stats_stride_row", "out_stride_row")] + \
               [("log2_scale", ctypes.c_float), ("export_scale", ctypes.c_float)]


def build(name: str, flags: str, folder: pathlib.Path) -> pathlib.Path:
    target = folder / (name.replace(",", "_") + ".so")
    cmd = (f"nvcc -O3 -std=c++17 --expt-relaxed-constexpr -lineinfo "
           f"-gencode=arch=compute_90a,code=sm_90a -Xcompiler -fPIC -shared "
           f"-I{ROOT / 'csrc/include'} {flags} -o {target} {ROOT / 'benchmarks/lab/lab_kernel.cu'}")
    subprocess.run(cmd, shell=True, check=True)
    return target


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp"))
    args = parser.parse_args()
    folder = pathlib.Path("/tmp/kvsplit-lab")
    folder.mkdir(exist_ok=True)
    with ThreadPoolExecutor(len(VARIANTS)) as pool:
        libs = dict(zip(VARIANTS, pool.map(lambda kv: build(kv[0], kv[1], folder), VARIANTS.items())))
    launchers = {name: ctypes.CDLL(str(path)).lab_launch for name, path in libs.items()}
    spin_up_gpu()
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator().manual_seed(0)
    lines = ["| D | rows | N | " + " | ".join(VARIANTS) + " |", "|---" * (3 + len(VARIANTS)) + "|"]
    for head_dim, rows, num_splits in SHAPES:
        m = torch.randn(num_splits, rows, generator=g) * 2
        l = 1 + 64 * torch.rand(num_splits, rows, generator=g)
        o = (torch.randn(num_splits, rows, head_dim, generator=g) * l.unsqueeze(-1)).cuda().bfloat16()
        stats = torch.stack([m, l], -1).cuda()
        out = torch.empty(rows, head_dim, dtype=torch.bfloat16, device="cuda")
        p = Params(o.data_ptr(), stats.data_ptr(), None, None, out.data_ptr(), None, num_splits,
                   rows, 1, o.stride(0), o.stride(1), stats.stride(0), stats.stride(1),
                   out.stride(0), 1.0 / math.sqrt(head_dim) * 1.4427, 0.6931)
        ks = valid_kv_splits(head_dim=head_dim, elem_bytes=2, rows=rows, num_splits=num_splits,
                             sm_count=sm_count)
        cells = []
        reference = None
        for name, launch in launchers.items():
            times = {}
            for k in ks:
                def run(i, launch=launch, k=k):
                    status = launch(ctypes.byref(p), head_dim, k, sm_count,
                                    ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
                    assert status == 0, status
                times[k] = time_cuda_graph(run, batch=64, replays=15).median_us
                run(0)
                torch.cuda.synchronize()
                reference = out.clone() if reference is None else reference
                assert (out.float() - reference.float()).abs().max().item() < 0.05 * reference.float().abs().max().item()
            best = min(times, key=times.get)
            cells.append(f"{times[1]:.2f} / {times[best]:.2f} ({best})")
        lines.append(f"| {head_dim} | {rows} | {num_splits} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    text = "K=1 / best (K), us per launch, graph replay, L2-warm\n" + "\n".join(lines)
    print(text)
    (args.out / "lab.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
