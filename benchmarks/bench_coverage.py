"""Head dims beyond the powers of two and float32/FP8 outputs, against the read probe.

Run on a GPU machine:  python -P benchmarks/bench_coverage.py [--out DIR]

For each (rows, num_splits, head_dim) with bf16 partials and base-e LSE stats it
tunes the key at first use (auto mode, a fresh database: the first-use time in
ms), then times in CUDA-graph replay (L2-warm, us per launch) the auto choice
writing bfloat16, float32 and FP8 e4m3fn (a per-tensor scale) outputs, and the
read probe over the same bytes (partials and stats read, output written).
Prints kvsplit/read per shape, the ratio of a new head dim to its power-of-two
neighbours, and of float32/FP8 outputs to bfloat16, and the config the tuner chose for
each key. Then, at a few shapes, every
valid config timed with bfloat16 and FP8 outputs: the best of each, and the
bfloat16 winner writing FP8 (what an FP8 output costs in the same kernel config,
apart from the tuner's choice).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import tempfile
import time

ROWS_SPLITS = [(128, 32), (512, 16), (4096, 2)]
HEAD_DIMS = [64, 80, 96, 128, 192, 256, 512, 576]
NEIGHBOURS = {80: (64, 128), 96: (64, 128), 192: (128, 256), 576: (512,)}
# (rows, num_splits, head_dim) where every config is timed.
CONFIG_SHAPES = [(128, 32, 128), (512, 16, 512), (512, 16, 576), (4096, 2, 192), (4096, 2, 256),
                 (4096, 2, 512), (4096, 2, 576)]


def every_config(torch, sm_count: int) -> list[str]:
    """Each CONFIG_SHAPES shape: the best config for bf16 and FP8 outputs and the bf16
    winner's time with FP8 outputs (us, graph replay), as markdown lines."""
    from kvsplit import _kernel
    from kvsplit.autotune.timing import time_cuda_graph
    from kvsplit.dispatch.constraints import valid_configs

    lines = ["| rows x N x D | best bf16 | config | best fp8 | config | bf16 winner, fp8 out |",
             "|---|---|---|---|---|---|"]
    g = torch.Generator(device="cuda").manual_seed(1)
    for rows, num_splits, head_dim in CONFIG_SHAPES:
        o = torch.randn(num_splits, rows, head_dim, device="cuda", generator=g).bfloat16()
        lse = torch.randn(num_splits, rows, device="cuda", generator=g)
        times = {}
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            out = torch.empty(rows, head_dim, dtype=dtype, device="cuda")
            for config in valid_configs(head_dim=head_dim, elem_bytes=2, rows=rows,
                                        num_splits=num_splits, sm_count=sm_count):
                plan = _kernel.Launch(config, 1, o, lse, out, None, 1.0)
                times[dtype, config] = time_cuda_graph(
                    lambda i, plan=plan, out=out: _kernel.run(plan, o, lse, out, 1.0),
                    batch=16, replays=7).median_us
        best = {d: min((t, c.label) for (dd, c), t in times.items() if dd == d)
                for d in (torch.bfloat16, torch.float8_e4m3fn)}
        # By time alone: two configs may tie, and configs do not order.
        winner = min(((t, c) for (d, c), t in times.items() if d == torch.bfloat16),
                     key=lambda tc: tc[0])[1]
        lines.append(f"| {rows} x {num_splits} x {head_dim} | {best[torch.bfloat16][0]:.2f} | "
                     f"{best[torch.bfloat16][1]} | {best[torch.float8_e4m3fn][0]:.2f} | "
                     f"{best[torch.float8_e4m3fn][1]} | "
                     f"{times[torch.float8_e4m3fn, winner]:.2f} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    os.environ["KVSPLIT_DB"] = f"sqlite:///{tempfile.mkdtemp()}/coverage.sqlite"
    os.environ["KVSPLIT_MODE"] = "auto"
    import torch

    import kvsplit
    from kvsplit import _native, merge as merge_module
    from kvsplit.autotune.timing import spin_up_gpu, time_cuda_graph

    probe = _native.bench().launch_read_probe
    spin_up_gpu()
    fp8 = torch.float8_e4m3fn
    outs = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": fp8}
    scale = torch.tensor([0.5], device="cuda")
    results, first_use_ms = [], []
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows, num_splits in ROWS_SPLITS:
        for head_dim in HEAD_DIMS:
            o = torch.randn(num_splits, rows, head_dim, device="cuda", generator=g).bfloat16()
            lse = torch.randn(num_splits, rows, device="cuda", generator=g)
            row = {"rows": rows, "num_splits": num_splits, "head_dim": head_dim}
            for name, dtype in outs.items():
                out = torch.empty(rows, head_dim, dtype=dtype, device="cuda")
                extra = {"out_scale": scale} if dtype == fp8 else {}

                def merge(i, out=out, extra=extra):
                    kvsplit.merge_lse(o, lse, base=math.e, out=out, **extra)

                torch.cuda.synchronize()
                start = time.perf_counter()
                merge(0)  # first use: tunes the key
                torch.cuda.synchronize()
                first_use_ms.append((time.perf_counter() - start) * 1e3)
                # The layout's launch, made by that first call: its config.
                plan = merge_module._layout_launch(merge_module.LSE, o, lse, math.e, None, None,
                                                   out, False, None)
                row[f"config_{name}"] = plan.kernel.config.label

                def read(i, out=out):
                    probe(o.data_ptr(), o.numel() * 2, lse.data_ptr(), lse.numel() * 4,
                          out.data_ptr(), out.numel() * out.element_size(),
                          torch.cuda.current_stream().cuda_stream)

                timed = {k: time_cuda_graph(f, batch=32, replays=11).median_us
                         for k, f in (("kvsplit", merge), ("read", read))}
                row[name] = timed["kvsplit"]
                row[f"read_{name}"] = timed["read"]
            results.append(row)
            print(f"{rows:5d} x {num_splits:3d} x D {head_dim:4d}: " + "  ".join(
                f"{n} {row[n]:6.2f}/{row['read_' + n]:5.2f} us" for n in outs), flush=True)

    lines = ["| rows | N | D | bf16 | read | k/read | fp32 | k/read | fp8 | k/read | "
             "fp32/bf16 ratio | fp8/bf16 ratio |", "|" + "---|" * 12]
    ratio = {(r["rows"], r["head_dim"], n): r[n] / r[f"read_{n}"] for r in results for n in outs}
    for r in results:
        key = (r["rows"], r["head_dim"])
        lines.append(
            f"| {r['rows']} | {r['num_splits']} | {r['head_dim']} | {r['bf16']:.2f} | "
            f"{r['read_bf16']:.2f} | {ratio[key + ('bf16',)]:.2f} | {r['fp32']:.2f} | "
            f"{ratio[key + ('fp32',)]:.2f} | {r['fp8']:.2f} | {ratio[key + ('fp8',)]:.2f} | "
            f"{ratio[key + ('fp32',)] / ratio[key + ('bf16',)]:.3f} | "
            f"{ratio[key + ('fp8',)] / ratio[key + ('bf16',)]:.3f} |")
    lines += ["", "| rows | D | k/read | neighbour k/read | new / neighbour |", "|---|---|---|---|---|"]
    for rows, _ in ROWS_SPLITS:
        for d, near in NEIGHBOURS.items():
            for n in near:
                a, b = ratio[(rows, d, "bf16")], ratio[(rows, n, "bf16")]
                lines.append(f"| {rows} | {d} vs {n} | {a:.2f} | {b:.2f} | {a / b:.3f} |")
    lines += ["", "| rows | N | D | bf16 config | fp32 config | fp8 config |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['rows']} | {r['num_splits']} | {r['head_dim']} | " +
              " | ".join(r[f"config_{n}"] for n in outs) + " |" for r in results]
    lines += ["", f"first use, ms per key: median {statistics.median(first_use_ms):.1f}, "
              f"max {max(first_use_ms):.1f} over {len(first_use_ms)} keys", ""]
    lines += every_config(torch, torch.cuda.get_device_properties(0).multi_processor_count)
    text = "\n".join(lines)
    print(text)
    out_dir = pathlib.Path(args.out)
    (out_dir / "coverage.md").write_text(text + "\n")
    (out_dir / "coverage.json").write_text(json.dumps({"results": results,
                                                       "first_use_ms": first_use_ms}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
