"""What the lab drivers share: loading repository modules by path, params.h's
MergeParams as a ctypes structure, and building one variant (nvcc flags) into a
shared library loaded with ctypes."""

from __future__ import annotations

import ctypes
import importlib.util
import math
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
FOLDER = pathlib.Path("/tmp/kvsplit-lab")


def load(name: str, path: str):
    """A module of the repository (``path`` under it) that imports nothing of the package,
    loaded from the tree, so that the lab runs without the package installed."""
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class RowStrides(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("batch", "token", "head")]


class Params(ctypes.Structure):
    """params.h's MergeParams, field for field, with its C++ defaults (a zero
    pass_through_tokens would pass every row through; tests/test_lab_params.py
    holds the layout to the compiler's)."""

    _fields_ = [("partial_o", ctypes.c_void_p), ("stats", ctypes.c_void_p),
                ("out_scale", ctypes.c_void_p), ("o_stride_split", ctypes.c_int64),
                ("stats_stride_split", ctypes.c_int64), ("o_row", RowStrides),
                ("stats_row", RowStrides), ("num_splits", ctypes.c_int64),
                ("rows", ctypes.c_int64), ("head_dim", ctypes.c_int32)] + \
               [(name, ctypes.c_float) for name in ("log2_scale", "empty_stat", "export_scale")] + \
               [("out", ctypes.c_void_p), ("out_stats", ctypes.c_void_p), ("out_row", RowStrides),
                ("out_stats_row", RowStrides), ("sinks", ctypes.c_void_p)] + \
               [(name, ctypes.c_int32) for name in ("partial_dtype", "out_dtype", "stats_format")] + \
               [(name, ctypes.c_bool) for name in ("flat_rows", "stats_in_place", "indptr_int64",
                                                   "pair_stats")] + \
               [("heads", ctypes.c_int64), ("seqlen", ctypes.c_int64),
                ("split_counts", ctypes.c_void_p), ("row_mask", ctypes.c_void_p),
                ("row_mask_stride", ctypes.c_int64), ("indptr", ctypes.c_void_p),
                ("pass_through_tokens", ctypes.c_int64), ("pass_through_split", ctypes.c_int32),
                ("quant_group", ctypes.c_int32), ("group_scales", ctypes.c_void_p),
                ("group_scales_row", RowStrides), ("group_scales_stride", ctypes.c_int64),
                ("group_scales_dtype", ctypes.c_int32), ("scale_ue8m0", ctypes.c_bool),
                ("request_starts", ctypes.c_void_p), ("request_ops", ctypes.c_void_p),
                ("num_requests", ctypes.c_int64)]

    DEFAULTS = {"heads": 1, "seqlen": 1, "row_mask_stride": 1, "pass_through_tokens": 2**63 - 1,
                "group_scales_stride": 1, "group_scales_dtype": 2, "log2_scale": 1.0,
                "export_scale": 1.0, "empty_stat": math.nan}

    def __init__(self, **fields):
        super().__init__(**{**self.DEFAULTS, **fields})


def row_params(o, stats, out, **fields) -> Params:
    """Params of a split-major call: o (N, rows, D), stats (N, rows[, 2]), out (rows, D)."""
    return Params(partial_o=o.data_ptr(), stats=stats.data_ptr(), out=out.data_ptr(),
                  head_dim=o.shape[-1], num_splits=o.shape[0], rows=o.shape[1], heads=1,
                  seqlen=1, o_stride_split=o.stride(0), o_row=RowStrides(o.stride(1), 0, o.stride(1)),
                  stats_stride_split=stats.stride(0),
                  stats_row=RowStrides(stats.stride(1), 0, stats.stride(1)),
                  out_row=RowStrides(out.stride(0), 0, out.stride(0)), row_mask_stride=1,
                  **fields)


#: Linked into every lab library: ``lab_read`` (the read probe), ``lab_read_quarter`` (its former
#: geometry) and ``lab_noop`` (an empty kernel).
PROBE_SOURCES = ["benchmarks/lab/lab_probe.cu", "csrc/cuda/probe.cu"]


def stream() -> ctypes.c_void_p:
    """The current CUDA stream as the lab libraries take it."""
    import torch

    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def read_probe(lib, o, stats, out, quarter: bool = False) -> int:
    """The read probe over ``o``'s and ``stats``' bytes, writing ``out``'s (a lab library's);
    ``quarter``: its former geometry, a thread per four input chunks (lab_probe.cu)."""
    launch = lib.lab_read_quarter if quarter else lib.lab_read
    return launch(ctypes.c_void_p(o.data_ptr()), ctypes.c_int64(o.numel() * o.element_size()),
                  ctypes.c_void_p(stats.data_ptr()),
                  ctypes.c_int64(stats.numel() * stats.element_size()),
                  ctypes.c_void_p(out.data_ptr()),
                  ctypes.c_int64(out.numel() * out.element_size()), stream())


def problem(rows: int, head_dim: int, num_splits: int, generator, empty_every: int = 0):
    """A split-major merge on the GPU: bf16 partials (N, rows, D), base-2 LSE (N, rows) (state 0
    empty in every ``empty_every``-th row), a bf16 output; returns ((o, lse, out), Params, the
    float64 reference)."""
    import torch

    lse = (torch.randn(num_splits, rows, generator=generator) * 2).cuda()
    if empty_every:
        lse[0, ::empty_every] = float("-inf")
    o = torch.randn(num_splits, rows, head_dim, generator=generator).cuda().bfloat16()
    out = torch.empty(rows, head_dim, dtype=torch.bfloat16, device="cuda")
    weights = torch.softmax(lse.double() * math.log(2.0), 0)
    reference = (weights.unsqueeze(-1) * o.double()).sum(0)
    p = row_params(o, lse, out, stats_format=1, log2_scale=1.0, export_scale=1.0)
    return (o, lse, out), p, reference


def build(name: str, flags: str, sources: list[str]) -> pathlib.Path:
    """``sources`` (paths under the repository) and PROBE_SOURCES with ``flags`` into
    FOLDER/name.so."""
    FOLDER.mkdir(exist_ok=True)
    target = FOLDER / (name.replace(",", "_") + ".so")
    files = " ".join(str(ROOT / source) for source in [*sources, *PROBE_SOURCES])
    cmd = (f"nvcc -O3 -std=c++17 --expt-relaxed-constexpr -lineinfo "
           f"-gencode=arch=compute_90a,code=sm_90a -Xcompiler -fPIC -shared -DKVSPLIT_WITH_CUDA "
           f"{flags} -I{ROOT / 'csrc/include'} -o {target} {files}")
    if not target.exists():  # --one reuses the table run's build
        subprocess.run(cmd, shell=True, check=True)
    return target


def first_launch(launch, out, reference, what, relative: float = 0.0) -> bool:
    """Launches a variant once into ``out`` (filled with NaN first) and checks it against the
    float64 ``reference`` (abs error under 2e-2 plus ``relative`` times the reference's magnitude);
    False, unchecked, where the launch returns a nonzero status (the variant does not serve this
    shape)."""
    import torch

    out.fill_(float("nan"))
    if launch():
        return False
    torch.cuda.synchronize()
    error = ((out.double() - reference).abs() - relative * reference.abs()).max().item()
    assert error < 2e-2, (*what, error)
    return True


def median_us(timing, runs: dict, launch_us: float) -> dict:
    """Each run's median us per launch in graph replay (in turns, 15 replays), batched so that a
    replay lasts about 2 ms for a launch of about ``launch_us``."""
    batch = max(4, min(64, round(2000 / launch_us)))
    return {key: t.median_us for key, t in timing.time_cuda_graphs(runs, batch=batch,
                                                                    replays=15).items()}


def report(folder: pathlib.Path, name: str, text: str) -> None:
    """Prints a lab's table and writes it to ``folder/name``."""
    print(text)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text + "\n")
