"""Per-launch time of every valid kv_split on the issue's benchmark grid.

Run on a GPU machine:  python -P benchmarks/bench_merge.py [--out DIR]

For every shape (bf16 partials, maxsum stats) it prints, in microseconds per
launch from CUDA-graph replay:
  warm   every K on the same buffers (L2-warm, like right after attention);
  cold   K = 1 and the best K rotating over buffer sets 4x the L2 size;
  floor  max(empty-kernel launch, bytes / measured copy bandwidth);
  torch  a PyTorch merge of the same partials, captured in a graph too;
  eager  the best K launched back to back without a graph (host-bound).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import sys

import torch

import kvsplit
from kvsplit import _native
from kvsplit.autotune.timing import spin_up_gpu, time_cuda_graph, time_cuda_stream
from kvsplit.dispatch.constraints import num_ctas, valid_kv_splits

SHAPES = [(512, 64), (512, 128), (512, 512), (512, 2048), (128, 32), (128, 256), (128, 2048)]
NUM_SPLITS = (16, 32, 64, 132, 264)
KS = (1, 2, 4, 8, 16)


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/us (bytes read + written), by an SM kernel."""
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    timing = time_cuda_graph(lambda i: torch.mul(src, 1.0, out=dst), batch=4, replays=7)
    return 2 * src.numel() * 4 / timing.median_us


def noop_launch_us() -> float:
    noop = _native.ext().launch_noop
    return time_cuda_graph(lambda i: noop(1, torch.cuda.current_stream().cuda_stream),
                           batch=64).median_us


def make_set(num_splits: int, rows: int, head_dim: int, generator: torch.Generator):
    m = torch.randn(num_splits, rows, generator=generator) * 2
    l = 1 + 64 * torch.rand(num_splits, rows, generator=generator)
    o = torch.randn(num_splits, rows, head_dim, generator=generator) * l.unsqueeze(-1)
    return (o.to("cuda", torch.bfloat16), torch.stack([m, l], -1).cuda(),
            torch.empty(rows, head_dim, dtype=torch.bfloat16, device="cuda"))


def torch_merge(o, stats, scale_log2, out):
    m, l = stats[..., 0], stats[..., 1]
    big_m = m.amax(dim=0)
    w = torch.exp2(scale_log2 * (m - big_m))
    total = (w * l).sum(dim=0)
    out.copy_(((w / total).unsqueeze(-1) * o.float()).sum(dim=0))


def bench_shape(head_dim, rows, num_splits, sm_count, l2_bytes, bandwidth, noop_us, generator):
    scale = 1.0 / math.sqrt(head_dim) * 1.4426950408889634
    warm = make_set(num_splits, rows, head_dim, generator)
    set_bytes = warm[0].numel() * 2 + warm[1].numel() * 4 + warm[2].numel() * 2
    n_sets = max(2, min(64, math.ceil(4 * l2_bytes / set_bytes)))
    cold = [warm] + [make_set(num_splits, rows, head_dim, generator) for _ in range(n_sets - 1)]
    valid = valid_kv_splits(head_dim=head_dim, elem_bytes=2, rows=rows, num_splits=num_splits,
                            sm_count=sm_count)

    def launcher(sets, k):
        return lambda i: kvsplit.merge_maxsum(sets[i % len(sets)][0], sets[i % len(sets)][1], scale,
                                              out=sets[i % len(sets)][2], kv_split=k)

    result = {"head_dim": head_dim, "rows": rows, "num_splits": num_splits, "bytes": set_bytes,
              "floor_us": max(noop_us, set_bytes / bandwidth), "bytes_us": set_bytes / bandwidth,
              "warm": {}, "cold": {}, "max_diff_vs_k1": {}}
    reference = None
    for k in valid:
        result["warm"][k] = time_cuda_graph(launcher([warm], k)).median_us
        out = kvsplit.merge_maxsum(warm[0], warm[1], scale, kv_split=k).float()
        reference = out if reference is None else reference
        result["max_diff_vs_k1"][k] = (out - reference).abs().max().item()
    best_k = min(result["warm"], key=result["warm"].get)
    for k in sorted({1, best_k}):
        result["cold"][k] = time_cuda_graph(launcher(cold, k), batch=max(32, n_sets)).median_us
    result["best_k"] = best_k
    result["ctas"] = num_ctas(best_k, head_dim, 2, rows)
    result["rounds"] = math.ceil(num_splits / best_k / 4)
    result["eager_us"] = time_cuda_stream(launcher([warm], best_k)).median_us
    result["torch_us"] = time_cuda_graph(lambda i: torch_merge(warm[0], warm[1], scale, warm[2]),
                                         batch=8).median_us
    return result


def table(results, gpu: str) -> str:
    lines = [
        f"GPU: {gpu}; {datetime.date.today()}; bf16 partials, maxsum stats; "
        "us per launch in CUDA-graph replay",
        "",
        "| D | rows | N | " + " | ".join(f"K={k}" for k in KS)
        + " | best (K) | floor | best-floor | CTAs | rounds | cold K=1 | cold best | torch | eager |",
        "|" + "---|" * (len(KS) + 12),
    ]
    for r in results:
        ks = " | ".join(f"{r['warm'][k]:.2f}" if k in r["warm"] else "-" for k in KS)
        best = r["warm"][r["best_k"]]
        lines.append(
            f"| {r['head_dim']} | {r['rows']} | {r['num_splits']} | {ks} | {best:.2f} ({r['best_k']}) "
            f"| {r['floor_us']:.2f} | {best - r['floor_us']:+.2f} | {r['ctas']} | {r['rounds']} "
            f"| {r['cold'][1]:.2f} | {r['cold'][r['best_k']]:.2f} | {r['torch_us']:.2f} "
            f"| {r['eager_us']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=None, help="folder for .md and .json")
    parser.add_argument("--quick", action="store_true", help="N in {16, 132} only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark", file=sys.stderr)
        return 1
    props = torch.cuda.get_device_properties(0)
    generator = torch.Generator().manual_seed(0)
    spin_up_gpu()
    bandwidth = copy_bandwidth()
    noop_us = noop_launch_us()
    print(f"{props.name}: {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MiB, "
          f"copy {bandwidth / 1e6:.2f} TB/s, empty launch {noop_us:.2f} us", flush=True)
    results = []
    for head_dim, rows in SHAPES:
        for num_splits in ((16, 132) if args.quick else NUM_SPLITS):
            results.append(bench_shape(head_dim, rows, num_splits, props.multi_processor_count,
                                       props.L2_cache_size, bandwidth, noop_us, generator))
            worst = max(results[-1]["max_diff_vs_k1"].values())
            print(f"  D={head_dim} rows={rows} N={num_splits}: best K={results[-1]['best_k']} "
                  f"{results[-1]['warm'][results[-1]['best_k']]:.2f} us (max |K - K1| {worst:.1e})",
                  flush=True)
    text = table(results, props.name)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_merge.md").write_text(text + "\n")
        meta = {"gpu": props.name, "copy_bytes_per_us": bandwidth, "noop_us": noop_us,
                "date": str(datetime.date.today()), "results": results}
        (args.out / "bench_merge.json").write_text(json.dumps(meta, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
