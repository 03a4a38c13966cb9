"""Chained launches: a producer that writes the partials, then the merge.

Run on a GPU machine:  python -P benchmarks/bench_chain.py [--out DIR]
then  python benchmarks/report.py DIR  for the table.

Like a decode step, each pair (producer kernel writing bf16 partials and
maxsum stats, then the merge reading them) is captured 16 times in one CUDA
graph and replayed; the table gives microseconds per pair with programmatic
dependent launch off and on (KVSPLIT_PDL), for the best KvSplit K and the
best DSplit config of the shape (picked by a warm sweep here), next to the
producer alone. With PDL on, the merge waits (griddepcontrol.wait) for the
producer's writes before its first load but is launched while the producer
drains, and releases its own dependants once its loads are done.
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
from kvsplit.autotune.timing import spin_up_gpu, time_cuda_graph
from kvsplit.dispatch.constraints import DSPLIT, KVSPLIT, valid_configs

SHAPES = [(512, 64, 16), (512, 64, 132), (512, 64, 264), (128, 32, 16), (128, 32, 264),
          (128, 256, 132), (512, 512, 132)]
PAIRS = 16


def produce(o, stats, pdl: bool, seed: int) -> None:
    _native.bench().launch_producer(o.data_ptr(), o.numel(), stats.data_ptr(),
                                    stats.shape[0] * stats.shape[1], seed,
                                    pdl and _kernel.pdl_supported(o.device.index),
                                    torch.cuda.current_stream().cuda_stream)


def per_pair_us(o, stats, out, scale, config, pdl: bool) -> float:
    os.environ["KVSPLIT_PDL"] = "1" if pdl else "0"

    def step(i):
        produce(o, stats, pdl, i)
        if config is not None:
            _kernel.launch(config, merge.MAXSUM, o, stats, out, scale, merge._LN2, pdl=pdl)

    try:
        return time_cuda_graph(step, batch=PAIRS).median_us
    finally:
        os.environ["KVSPLIT_PDL"] = "0"


def bench_shape(head_dim, rows, num_splits):
    scale = 1.0 / math.sqrt(head_dim) * 1.4426950408889634
    o = torch.empty(num_splits, rows, head_dim, dtype=torch.bfloat16, device="cuda")
    stats = torch.empty(num_splits, rows, 2, dtype=torch.float32, device="cuda")
    out = torch.empty(rows, head_dim, dtype=torch.bfloat16, device="cuda")
    produce(o, stats, False, 0)
    configs = valid_configs(head_dim=head_dim, elem_bytes=2, rows=rows, num_splits=num_splits,
                            sm_count=torch.cuda.get_device_properties(0).multi_processor_count)
    warm = {c: time_cuda_graph(lambda i, c=c: _kernel.launch(
        c, merge.MAXSUM, o, stats, out, scale, merge._LN2)).median_us for c in configs}
    result = {"head_dim": head_dim, "rows": rows, "num_splits": num_splits,
              "producer_us": per_pair_us(o, stats, out, scale, None, False), "configs": {}}
    for family in (KVSPLIT, DSPLIT):
        mine = [c for c in configs if c.family == family]
        if not mine:
            continue
        best = min(mine, key=warm.get)
        result["configs"][best.label] = {
            "merge_us": warm[best],
            "pair_off_us": per_pair_us(o, stats, out, scale, best, False),
            "pair_on_us": per_pair_us(o, stats, out, scale, best, True),
        }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."),
                        help="folder for bench_chain.json [default: .]")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark", file=sys.stderr)
        return 1
    props = torch.cuda.get_device_properties(0)
    spin_up_gpu()
    results = []
    for shape in SHAPES:
        results.append(bench_shape(*shape))
        for label, c in results[-1]["configs"].items():
            print(f"  D={shape[0]} rows={shape[1]} N={shape[2]} {label}: pair "
                  f"{c['pair_off_us']:.2f} us, with PDL {c['pair_on_us']:.2f} us", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_chain.json").write_text(json.dumps(
        {"gpu": props.name, "date": str(datetime.date.today()), "results": results}, indent=1))
    print(f"wrote {args.out / 'bench_chain.json'}; tables: python benchmarks/report.py {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
