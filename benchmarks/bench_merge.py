"""Per-launch time of every kernel config on the benchmark grid.

Run on a GPU machine:  python -P benchmarks/bench_merge.py [--out DIR]
then  python benchmarks/report.py DIR  for the tables.

For every shape (bf16 partials, maxsum stats) it measures, in microseconds
per launch from CUDA-graph replay:
  warm   every valid config of both families on the same buffers (L2-warm,
         like right after attention): KvSplit K = 1, the best KvSplit K, the
         best DSplit (slices, kv_split) and the best of all;
  read   the read probe: every input byte read once, every output byte
         written, nothing merged (no merge can beat it); best / read;
  cold   the read probe, K = 1 and the best config rotating over buffer sets
         4x the L2 size;
  floor  max(empty-kernel launch, bytes / measured copy bandwidth);
  torch  a PyTorch merge of the same partials, captured in a graph too;
  PDL    the best config in graph replay with programmatic dependent launch
         (each merge launched while the previous one drains);
  eager  the best config launched back to back without a graph (host-bound).
The JSON output keeps every config's time (the tuner's pruning rules come
from it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import sys

import torch

from kvsplit import _kernel, _native, merge
from kvsplit.autotune.timing import spin_up_gpu, time_cuda_graph, time_cuda_stream
from kvsplit.dispatch.constraints import DSPLIT, KVSPLIT, kvsplit_config, valid_configs

SHAPES = [(512, 64), (512, 128), (512, 512), (512, 2048), (128, 32), (128, 256), (128, 2048)]
NUM_SPLITS = (16, 32, 64, 132, 264)


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/us (bytes read + written), by an SM kernel."""
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    timing = time_cuda_graph(lambda i: torch.mul(src, 1.0, out=dst), batch=4, replays=7)
    return 2 * src.numel() * 4 / timing.median_us


def noop_launch_us() -> float:
    noop = _native.bench().launch_noop
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


def launch_config(o, stats, out, scale, config) -> None:
    _kernel.launch(config, merge.MAXSUM, o, stats, out, scale, merge._LN2,
                   pdl=os.environ.get("KVSPLIT_PDL") == "1")


def read_probe(o, stats, out) -> None:
    _native.bench().launch_read_probe(o.data_ptr(), o.numel() * o.element_size(),
                                      stats.data_ptr(), stats.numel() * 4, out.data_ptr(),
                                      out.numel() * out.element_size(),
                                      torch.cuda.current_stream().cuda_stream)


def bench_shape(head_dim, rows, num_splits, sm_count, l2_bytes, bandwidth, noop_us, generator):
    scale = 1.0 / math.sqrt(head_dim) * 1.4426950408889634
    warm = make_set(num_splits, rows, head_dim, generator)
    set_bytes = warm[0].numel() * 2 + warm[1].numel() * 4 + warm[2].numel() * 2
    n_sets = max(2, min(64, math.ceil(4 * l2_bytes / set_bytes)))
    cold = [warm] + [make_set(num_splits, rows, head_dim, generator) for _ in range(n_sets - 1)]
    configs = valid_configs(head_dim=head_dim, elem_bytes=2, rows=rows, num_splits=num_splits,
                            sm_count=sm_count)

    def launcher(sets, config):  # one launch: what an eager call of the layout pays per launch
        made = _kernel.Launch(config, merge.MAXSUM, *sets[0], None, merge._LN2,
                              pdl=os.environ.get("KVSPLIT_PDL") == "1")
        return lambda i: _kernel.run(made, *sets[i % len(sets)], scale)

    def probe(sets):
        return lambda i: read_probe(*sets[i % len(sets)])

    result = {"head_dim": head_dim, "rows": rows, "num_splits": num_splits, "bytes": set_bytes,
              "floor_us": max(noop_us, set_bytes / bandwidth), "bytes_us": set_bytes / bandwidth,
              "warm": {}, "cold": {}, "max_diff_vs_k1": {}}
    baseline = kvsplit_config(1)
    launch_config(*warm, scale, baseline)
    reference = warm[2].float().clone()
    for config in configs:
        result["warm"][config.label] = time_cuda_graph(launcher([warm], config)).median_us
        launch_config(*warm, scale, config)
        result["max_diff_vs_k1"][config.label] = (warm[2].float() - reference).abs().max().item()
    by_label = {c.label: c for c in configs}

    def best_of(family):
        labels = [c.label for c in configs if c.family == family]
        return min(labels, key=result["warm"].get) if labels else None

    result["best_kvsplit"] = best_of(KVSPLIT)
    result["best_dsplit"] = best_of(DSPLIT)
    result["best"] = min(result["warm"], key=result["warm"].get)
    result["read_us"] = time_cuda_graph(probe([warm])).median_us
    result["cold_read_us"] = time_cuda_graph(probe(cold), batch=max(32, n_sets)).median_us
    for label in dict.fromkeys([baseline.label, result["best_kvsplit"], result["best"]]):
        result["cold"][label] = time_cuda_graph(launcher(cold, by_label[label]),
                                                batch=max(32, n_sets)).median_us
    os.environ["KVSPLIT_PDL"] = "1"  # back-to-back merges, each launched while the last drains
    try:
        result["best_pdl_us"] = time_cuda_graph(launcher([warm], by_label[result["best"]])).median_us
    finally:
        os.environ["KVSPLIT_PDL"] = "0"
    result["eager_us"] = time_cuda_stream(launcher([warm], by_label[result["best"]])).median_us
    result["torch_us"] = time_cuda_graph(lambda i: torch_merge(warm[0], warm[1], scale, warm[2]),
                                         batch=8).median_us
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."),
                        help="folder for bench_merge.json [default: .]")
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
            r = results[-1]
            worst = max(r["max_diff_vs_k1"].values())
            print(f"  D={head_dim} rows={rows} N={num_splits}: best {r['best']} "
                  f"{r['warm'][r['best']]:.2f} us, read {r['read_us']:.2f} us "
                  f"(max |config - K1| {worst:.1e})", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": props.name, "copy_bytes_per_us": bandwidth, "noop_us": noop_us,
            "date": str(datetime.date.today()), "results": results}
    (args.out / "bench_merge.json").write_text(json.dumps(meta, indent=1))
    print(f"wrote {args.out / 'bench_merge.json'}; tables: python benchmarks/report.py {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
