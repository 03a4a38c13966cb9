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

    _fields_ = [(name, ctypes.c_void_p) for name in
                ("partial_o", "stats", "split_counts", "sinks", "out", "out_stats",
                 "row_mask", "indptr", "out_scale", "group_scales", "request_starts",
                 "request_ops")] + \
               [(name, ctypes.c_int32) for name in
                ("head_dim", "partial_dtype", "out_dtype", "stats_format")] + \
               [(name, ctypes.c_int64) for name in ("num_splits", "rows", "heads", "seqlen",
                                                    "o_stride_split")] + \
               [("o_row", RowStrides), ("stats_stride_split", ctypes.c_int64),
                ("stats_row", RowStrides), ("out_row", RowStrides),
                ("out_stats_row", RowStrides), ("row_mask_stride", ctypes.c_int64),
                ("pass_through_tokens", ctypes.c_int64), ("pass_through_split", ctypes.c_int32),
                ("quant_group", ctypes.c_int32), ("group_scales_row", RowStrides),
                ("group_scales_stride", ctypes.c_int64), ("group_scales_dtype", ctypes.c_int32),
                ("scale_ue8m0", ctypes.c_bool), ("indptr_int64", ctypes.c_bool),
                ("num_requests", ctypes.c_int64), ("pair_stats", ctypes.c_bool)] + \
               [(name, ctypes.c_float) for name in ("log2_scale", "export_scale", "empty_stat")] + \
               [("stats_in_place", ctypes.c_bool), ("flat_rows", ctypes.c_bool)]

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


def build(name: str, flags: str, sources: list[str]) -> pathlib.Path:
    """``sources`` (paths under the repository) with ``flags`` into FOLDER/name.so."""
    FOLDER.mkdir(exist_ok=True)
    target = FOLDER / (name.replace(",", "_") + ".so")
    files = " ".join(str(ROOT / source) for source in sources)
    cmd = (f"nvcc -O3 -std=c++17 --expt-relaxed-constexpr -lineinfo "
           f"-gencode=arch=compute_90a,code=sm_90a -Xcompiler -fPIC -shared -DKVSPLIT_WITH_CUDA "
           f"{flags} -I{ROOT / 'csrc/include'} -o {target} {files}")
    if not target.exists():  # --one reuses the table run's build
        subprocess.run(cmd, shell=True, check=True)
    return target
