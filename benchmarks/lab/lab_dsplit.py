"""DSplit lab: the product kernel with its items-per-CTA knob, beside the read probe,
the serial Triton peer and an empty kernel of the same geometry.

    python -P benchmarks/lab/lab_dsplit.py [--out DIR]                 # the tables
    python -P benchmarks/lab/lab_dsplit.py --one VARIANT D ROWS N P K DEPTH  # for ncu
    python -P benchmarks/lab/lab_dsplit.py --triton D ROWS N WARPS         # for ncu
    python -P benchmarks/lab/lab_dsplit.py --read D ROWS N                 # for ncu

Each variant builds lab_dsplit.cu with other nvcc flags. Per shape (bf16
partials, base-2 LSE): every DSplit config of every variant, the read probe
and the serial Triton peer (benchmarks/peers.py), replayed in turns in CUDA
graphs (L2-warm). A second pass times every variant at the product's best
config beside an empty kernel of that config's grid, and the stage variants
(STAGES), which are built from a copy of csrc/include with one stage of the
product kernel cut out: the time a shape's merge spends in each stage is the
difference between two of them. Needs torch and triton only: the package does
not have to be installed.

The leave-one-out runs of docs/benchmarks.md ("What each miss is made of") (stages of the kernel left out
by -D knobs of a copy of the kernel before flat rows and packed one-warp
items) used benchmarks/lab/knobs at commit 4f65f3c.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import pathlib
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import labkit  # noqa: E402  (the lab's own helpers, beside this file)

timing = labkit.load("lab_timing", "autotune/timing.py")
peers = labkit.load("lab_peers", "benchmarks/peers.py")

# Name -> nvcc flags: the lab knobs of dsplit_geometry.h and merge_math.h (the default is the
# product). The pack variants also double their count in calls of 1024 one-warp items or more.
VARIANTS = {
    "product": "",
    "pack1": "-DKVSPLIT_DSPLIT_ITEMS_PER_CTA=1",  # one-warp items one to a CTA, as before
    "pack2": "-DKVSPLIT_DSPLIT_ITEMS_PER_CTA=2",
    "pack8": "-DKVSPLIT_DSPLIT_ITEMS_PER_CTA=8",
    "pack16": "-DKVSPLIT_DSPLIT_ITEMS_PER_CTA=16",
    "pack4": "-DKVSPLIT_DSPLIT_WIDE_ITEMS=0",  # 4 to a CTA at any call size, as before
    # the kernel before the lean math and 32-bit offsets (compare-and-select max, a test
    # per weight, IEEE divide and log2f, 64-bit offsets), and each change apart
    "classic": "-DKVSPLIT_LEAN_MATH=0 -DKVSPLIT_DSPLIT_INDEX32=0",
    "index64": "-DKVSPLIT_DSPLIT_INDEX32=0",
    # the plain kernel testing and scaling each stat, as before the raw-stats change
    "scaled": "-DKVSPLIT_DSPLIT_RAW_STATS=0",
    # combine() testing for an empty state and skipping it, as before the lean combine
    "skipcombine": "-DKVSPLIT_LEAN_COMBINE=0",
    # the register bounds of merge_dsplit.cuh: 64 for every depth, as before (regs64), or up
    # to 128 for every depth, the 4-deep kernel too (regs4)
    "regs64": "-DKVSPLIT_DSPLIT_ROOMY_DEPTH=32",
    "regs4": "-DKVSPLIT_DSPLIT_ROOMY_DEPTH=4",
}
# Variants whose lanes load fewer bytes of a row per partial than the product's 16.
LANE_BYTES = {"lane8": 8, "lane4": 4}
VARIANTS.update({name: f"-DKVSPLIT_DSPLIT_LANE_BYTES={b}" for name, b in LANE_BYTES.items()})
# 8-byte lanes with every kernel at 64 registers (lane8 has the product's register bounds)
VARIANTS["lane8regs64"] = VARIANTS["lane8"] + " " + VARIANTS["regs64"]
LANE_BYTES["lane8regs64"] = 8


# Stage variants: the product kernel (merge_dsplit.cuh, copied) with a stage cut out, timed
# only at the product's best config of each shape (pass 2). Each is a list of (text, its
# replacement); a text that is not found fails the build, so a change of the kernel cannot
# silently leave a variant equal to the product.
_MERGE_MATH = """  state.merge_batch(m_in, l_in, [&](int j, int v) { return unpack<kPartial>(packed[j], v); },
                    log2_scale);"""
# Every loaded word still feeds the state (through an XOR), so no load can be dropped.
_NO_MATH = """  uint32_t folded = 0;
#pragma unroll
  for (int u = 0; u < kDepth; ++u) {
    folded ^= __float_as_uint(m_in[u]) ^ __float_as_uint(l_in[u]);
#pragma unroll
    for (int w = 0; w < kDsplitLaneBytes / 4; ++w) folded ^= packed[u].w[w];
  }
  state.m = fmaxf(state.m, __uint_as_float(folded & 0x3fffffffu));"""
_COMBINE = (
    "    // Groups of one warp: butterfly over the lane bits above the group's own.\n",
    "    // An item of one warp has no barrier to order the reads")
_STORE = "    if (thread < lanes) {\n      finalize_and_store"
# Every group stores its own state under a condition the compiler cannot decide (its max
# is never FLT_MAX), so no group's loads or math can be dropped.
_STORE_ALL = ("    if (thread < lanes || __float_as_uint(state.m) == 0x7f7fffffu) {\n"
              "      finalize_and_store")
# No group loads or merges anything (a condition false at run time, so the code stays):
# the prologue, a combine of empty states and the epilogue.
_GROUP = ("    } else if (holds && group < num_splits) {",
          "    } else if (holds && group < num_splits - (1 << 30)) {")
# The stats not loaded: every partial's stat a constant.
_NO_STATS = [("    const float m_raw = __ldg(s + u * s_step);", "    const float m_raw = 0.f;"),
             ("    l_in[u] = kFormat == StatsFormat::kMaxSum ? __ldg(s + u * s_step + 1) : 1.f;",
              "    l_in[u] = 1.f;")]
_NO_COMBINE = [(_COMBINE, None), (_STORE, _STORE_ALL)]
_BARE = [(_MERGE_MATH, _NO_MATH), *_NO_COMBINE]
# The kernel returns right after its PDL wait (a condition true at run time, so the code
# stays): the launch of this kernel, its parameters and its CTAs.
_EXIT = ("  pdl_wait();\n", "  pdl_wait();\n  if (p.rows >= 0) return;\n")
STAGES = {
    "exit": [_EXIT],
    "bare": _BARE,  # loads and epilogue: no merge arithmetic, no shuffles, parking or fold
    "nomath": [(_MERGE_MATH, _NO_MATH)],  # no merge arithmetic: loads, combine, epilogue
    "nocombine": _NO_COMBINE,  # no shuffles, parking or fold
    "shell": [_GROUP],
    "shellnocombine": [_GROUP, *_NO_COMBINE],
    "barenostats": _BARE + _NO_STATS,  # bare, loading the partials alone
}
# What a shape's time is made of: differences of the variants at the product's best config.
PARTS = {
    "launch": lambda f: f["empty"],
    "this kernel's launch": lambda f: f["exit"] - f["empty"],
    "prologue, epilogue": lambda f: f["shellnocombine"] - f["exit"],
    "combine of empties": lambda f: f["shell"] - f["shellnocombine"],
    "loads": lambda f: f["bare"] - f["shell"],
    "of which stats": lambda f: f["bare"] - f["barenostats"],
    "math": lambda f: f["nocombine"] - f["bare"],
    "combine": lambda f: f["product"] - f["nocombine"],
    "product / read": lambda f: f["product"] / f["read"],
}


def staged_include(name: str) -> pathlib.Path:
    """A copy of csrc/include whose merge_dsplit.cuh has STAGES[name] applied."""
    folder = labkit.FOLDER / f"include-{name}"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(labkit.ROOT / "csrc/include", folder)
    kernel = folder / "kvsplit/merge_dsplit.cuh"
    text = kernel.read_text()
    for old, new in STAGES[name]:
        if isinstance(old, tuple):  # cut from the first text up to (not including) the second
            begin, end = text.index(old[0]), text.index(old[1])
            text = text[:begin] + text[end:]
        else:
            assert old in text, f"stage variant {name}: the kernel no longer has {old!r}"
            text = text.replace(old, new)
    kernel.write_text(text)
    return folder


def lane_bytes(variant: str) -> int:
    """Bytes each lane loads per partial in ``variant`` (the product: 16)."""
    return LANE_BYTES.get(variant, 16)


SOURCES = ["benchmarks/lab/lab_dsplit.cu"]
SHAPES = [(512, 64, 16), (128, 32, 16), (128, 256, 16), (512, 512, 16), (128, 32, 64),
          (512, 64, 64), (128, 32, 264), (512, 64, 132), (512, 128, 16), (512, 2048, 16),
          (128, 2048, 16), (128, 2048, 32)]
# LAB_SHAPES=grid: the 35 shapes of benchmarks/bench_peers.py instead.
GRID_SHAPES = [(head_dim, rows, n) for head_dim, row_counts in
               ((512, (64, 128, 512, 2048)), (128, (32, 256, 2048)))
               for rows in row_counts for n in (16, 32, 64, 132, 264)]


def configs(head_dim: int, num_splits: int, elem_bytes: int = 2, lane_bytes: int = 16):
    """DSplit (slices, kv_split, depth, lanes) legal by config.h, kv_split <= N,
    depths 8 and 16 only where a group has more than 4 partials."""
    found = []
    for slices in (1, 2, 4, 8, 16):
        lanes = head_dim * elem_bytes // (lane_bytes * slices)
        if lanes < 4 or lanes > 32:
            continue
        for kv_split in (1, 2, 4, 8, 16, 32, 64, 128):
            if not 32 <= lanes * kv_split <= 512 or kv_split > max(num_splits, 32 // lanes):
                continue
            per_group = -(-num_splits // kv_split)
            for depth in [d for d in (4, 8, 16) if d == 4 or per_group > 4]:
                found.append((slices, kv_split, depth, lanes))
    return found


def problem(head_dim, rows, num_splits, generator):
    lse = (torch.randn(num_splits, rows, generator=generator) * 2).cuda()
    o = torch.randn(num_splits, rows, head_dim, generator=generator).cuda().bfloat16()
    out = torch.empty(rows, head_dim, dtype=torch.bfloat16, device="cuda")
    weights = torch.softmax(lse.double() * torch.log(torch.tensor(2.0, dtype=torch.float64)), 0)
    reference = (weights.unsqueeze(-1) * o.double()).sum(0)
    p = labkit.row_params(o, lse, out, stats_format=1, log2_scale=1.0, export_scale=1.0,
                          empty_stat=float("nan"))
    return (o, lse, out), p, reference


def flags(name: str) -> str:
    if name in STAGES:
        return f"-I{staged_include(name)}"
    return VARIANTS[name]


def load_all(names):
    with ThreadPoolExecutor(len(names)) as pool:
        paths = list(pool.map(lambda n: labkit.build("dsplit_" + n, flags(n), SOURCES), names))
    return {name: ctypes.CDLL(str(path)) for name, path in zip(names, paths)}


def dsplit_run(lib, p, slices, kv_split, depth):
    def run(i):
        status = lib.lab_dsplit(ctypes.byref(p), slices, kv_split, depth, labkit.stream())
        assert status == 0, status
    return run


def read_run(lib, o, lse, out):
    """The read probe over the shape's partials, stats and output."""
    def run(i):
        labkit.read_probe(lib, o, lse, out)
    return run


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp"))
    parser.add_argument("--one", nargs=7)
    parser.add_argument("--triton", nargs=4, type=int)
    parser.add_argument("--read", nargs=3, type=int)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    if args.one or args.triton or args.read:
        numbers = list(map(int, args.one[1:] if args.one else args.triton or args.read))
        buffers, p, _ = problem(*numbers[:3], g)
        if args.one:
            run = dsplit_run(load_all([args.one[0]])[args.one[0]], p, *numbers[3:])
        elif args.read:
            run = read_run(load_all(["product"])["product"], *buffers)
        else:
            o, lse, out = buffers
            run = lambda i: peers.triton_merge(o, lse, out, num_warps=numbers[3])  # noqa: E731
        for i in range(3):
            run(i)
        torch.cuda.synchronize()
        return 0

    wanted = os.environ.get("LAB_VARIANTS", ",".join(VARIANTS)).split(",")
    libs = load_all([n for n in [*VARIANTS, *STAGES] if n in wanted])
    swept = {name: lib for name, lib in libs.items() if name not in STAGES}
    timing.spin_up_gpu()
    record = {}
    best_lines = ["| D / rows / N | read | serial Triton | " + " | ".join(swept) + " |",
                  "|---" * (3 + len(swept)) + "|"]
    split_lines = ["| D / rows / N | config (grid x block) | read | empty | "
                   + " | ".join(libs) + " |", "|---" * (4 + len(libs)) + "|"]
    staged = [name for name in STAGES if name in libs]
    stage_lines = []
    shapes = GRID_SHAPES if os.environ.get("LAB_SHAPES") == "grid" else SHAPES
    for head_dim, rows, num_splits in shapes:
        (o, lse, out), p, reference = problem(head_dim, rows, num_splits, g)
        shape = f"{head_dim} / {rows} / {num_splits}"
        runs = {("read",): read_run(libs["product"], o, lse, out)}
        for warps in (1, 2, 4, 8):
            runs[("triton", warps)] = (lambda w: lambda i: peers.triton_merge(
                o, lse, out, num_warps=w))(warps)
        for name, lib in swept.items():
            for slices, kv_split, depth, lanes in configs(head_dim, num_splits,
                                                          lane_bytes=lane_bytes(name)):
                run = dsplit_run(lib, p, slices, kv_split, depth)
                run(0)
                torch.cuda.synchronize()
                err = (out.double() - reference).abs().max().item()
                assert err < 0.02, (name, slices, kv_split, depth, err)
                runs[(name, slices, kv_split, depth)] = run
        times = {key: t.median_us for key, t in
                 timing.time_cuda_graphs(runs, batch=64, replays=11).items()}
        record[shape] = {" ".join(map(str, key)): value for key, value in times.items()}

        def best(prefix):
            keys = [key for key in times if key[0] == prefix]
            return min(keys, key=times.get) if keys else None

        def cell(key):
            return "-" if key is None else f"{times[key]:.2f} ({'x'.join(map(str, key[1:]))})"
        best_lines.append(f"| {shape} | {times[('read',)]:.2f} | {cell(best('triton'))} | "
                          + " | ".join(cell(best(name)) for name in swept) + " |")
        print(best_lines[-1], flush=True)

        # Pass 2: every variant at the product's best config, with an empty kernel of its geometry.
        _, slices, kv_split, depth = best("product")
        lanes = next(lanes for *config, lanes in configs(head_dim, num_splits)
                     if config == [slices, kv_split, depth])
        # The product's grid: items of one warp run 4 to a CTA, 8 from 1024 items on
        # (dsplit_geometry.h).
        items, block = rows * slices, lanes * kv_split
        per_cta = 1 if block > 32 else (8 if items >= 1024 else 4)
        grid, block = -(-items // per_cta), block * per_cta
        again = {name: dsplit_run(lib, p, slices, kv_split, depth) for name, lib in libs.items()
                 if lane_bytes(name) == 16}
        again["read"] = runs[("read",)]
        again["empty"] = lambda i: libs["product"].lab_empty(grid, block, labkit.stream())
        fixed = {key: t.median_us for key, t in
                 timing.time_cuda_graphs(again, batch=64, replays=11).items()}
        record[shape]["fixed"] = {"config": [slices, kv_split, depth], **fixed}
        split_lines.append(
            f"| {shape} | P{slices}xK{kv_split}d{depth} ({grid} x {block}) | {fixed['read']:.2f} | "
            f"{fixed['empty']:.2f} | "
            + " | ".join(f"{fixed[n]:.2f}" if n in fixed else "-" for n in libs) + " |")
        print(split_lines[-1], flush=True)
        if staged and "product" in fixed:
            # What the product's time is made of, stage by stage.
            columns = ["read", "empty", *staged, "product"]
            parts = {}
            for part, of in PARTS.items():
                try:
                    parts[part] = of(fixed)
                except KeyError:  # a variant it needs was not run
                    pass
            if not stage_lines:
                stage_lines += ["| D / rows / N | config | " + " | ".join([*columns, *parts])
                                + " |", "|---" * (2 + len(columns) + len(parts)) + "|"]
            stage_lines.append(
                f"| {shape} | P{slices}xK{kv_split}d{depth} | "
                + " | ".join(f"{fixed[n]:.2f}" for n in columns) + " | "
                + " | ".join(f"{x:.2f}" for x in parts.values()) + " |")
    text = ("Best per variant, us per launch (config PxKxdepth; Triton: warps), graph replay, "
            "L2-warm\n" + "\n".join(best_lines) + "\n\nAt the product's best config\n"
            + "\n".join(split_lines)
            + ("\n\nStages of the product at its best config\n" + "\n".join(stage_lines)
               if stage_lines else ""))
    print(text)
    (args.out / "lab_dsplit.md").write_text(text + "\n")
    (args.out / "lab_dsplit.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
