"""Merges of a few states (N = 2, 4, 8, 16) next to the engines' designs and the read probe.

Run on a GPU machine:  python -P benchmarks/bench_few.py [--out DIR] [--quick]
(benchmarks/gpu_check.sh stage ``bench_few``), then ``python benchmarks/report.py DIR``.

Every shape is (tokens, heads, head_dim) x N states: bf16 states (N, tokens, heads,
head_dim), a float32 LSE (N, tokens, heads), a bf16 output. Per shape it first tunes the
key at this very shape into the run's database (``KVSPLIT_DB``; a stored choice goes
before the shipped tables, which were tuned before the Few family existed) and records
that first-use tuning time, then measures, in microseconds per launch from CUDA-graph
replay, all captured in their own graphs and replayed in turns, L2-warm:
  read       the read probe over the same bytes (nothing merged; no merge beats it);
  auto       kvsplit.merge_lse(base=2): the dispatcher's choice (the tuned record);
  F1 F2 F4   each Few config (1, 2 or 4 vectors a thread) the head dim allows;
  pre-few    the fastest other candidate of the tuning record (what auto chose before
             the Few family), timed again here;
  vllm       two states only: vLLM's design (peer_kernels.cu; natural-log LSE);
  fi2        two states only: FlashInfer's merge_state design;
  fiN        FlashInfer's merge_states design (any N);
  triton     the serial Triton merge of benchmarks/peers.py (one program per row; head
             dims that are powers of two).
Each output is compared with kvsplit's of the same base (the vLLM peer with
kvsplit.merge_lse(base=e)). The JSON is rewritten after every shape, so a run cut short
keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import sys
import time
import traceback

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # run with -P: peers, report

import kvsplit  # noqa: E402
from kvsplit import _kernel, merge  # noqa: E402
from kvsplit.autotune import tuner  # noqa: E402
from kvsplit.autotune.timing import spin_up_gpu, time_cuda_graphs  # noqa: E402
from kvsplit.config import build_hash, legal_configs  # noqa: E402
from kvsplit.db import open_store  # noqa: E402
from kvsplit.dispatch.constraints import configs_for_key  # noqa: E402
from kvsplit.dispatch.device import device_facts  # noqa: E402
from kvsplit.dispatch.dispatcher import dispatcher  # noqa: E402
from kvsplit.dispatch.keys import tuning_key  # noqa: E402

import peers  # noqa: E402
import peers_cuda  # noqa: E402
import report  # noqa: E402
from bench_merge import copy_bandwidth, noop_launch_us, read_probe  # noqa: E402

# (tokens, heads, head_dim): decode (one token), then prefill and chunked-prefill sizes.
SHAPES = [(1, 8, 128), (1, 32, 128), (1, 128, 128), (1, 16, 512), (1, 128, 576),
          (16, 32, 128), (128, 32, 128), (64, 16, 512), (256, 8, 256), (256, 32, 64),
          (1024, 32, 128), (1024, 16, 512), (2048, 32, 80), (4096, 32, 128), (16384, 8, 128)]
QUICK_SHAPES = [(1, 32, 128), (1, 16, 512), (128, 32, 128), (1024, 32, 128), (4096, 32, 128)]
NUM_STATES = (2, 4, 8, 16)
REPLAY_US = 2000.0  # a replay's target length: batches shrink as launches grow


def make_set(n, tokens, heads, head_dim, generator):
    o = torch.randn(n, tokens, heads, head_dim, generator=generator, device="cuda",
                    dtype=torch.bfloat16)
    lse = torch.randn(n, tokens, heads, generator=generator, device="cuda") * 2
    return o, lse, torch.empty(tokens, heads, head_dim, dtype=torch.bfloat16, device="cuda")


def tune_here(o, lse, store):
    """Tunes this call's key at its own shape and stores it; (record, milliseconds)."""
    n, tokens, heads, head_dim = o.shape
    facts = device_facts(o.device)
    key = tuning_key(facts, build_hash(True), head_dim, "bfloat16", "bfloat16", "lse", n,
                     tokens * heads)
    torch.cuda.synchronize()
    begin = time.perf_counter()
    shape = (tokens * heads, n)
    record = tuner.tune(key, o.device, configs_for_key(key, is_cuda=True, shape=shape),
                        shape=shape)
    milliseconds = (time.perf_counter() - begin) * 1e3
    store.upsert(record)
    dispatcher.forget()  # the next call reads the database again
    return record, milliseconds


def config_launcher(config, o, lse, out):
    plan = _kernel.Launch(config, merge.LSE, o, lse, out, None, 1.0)
    return lambda i: _kernel.run(plan, o, lse, out, 1.0)


def bench_shape(tokens, heads, head_dim, n, generator, store, failures):
    o, lse, out = make_set(n, tokens, heads, head_dim, generator)
    set_bytes = o.numel() * 2 + lse.numel() * 4 + out.numel() * 2
    r = {"tokens": tokens, "heads": heads, "head_dim": head_dim, "num_splits": n,
         "bytes": set_bytes, "warm": {}, "max_diff": {}}
    record, r["tune_ms"] = tune_here(o, lse, store)
    r["tuned_winner"] = record.winner.label
    r["tuned_candidates"] = {c.config.label: c.median_us for c in record.candidates if c.samples}

    kvsplit.merge_lse(o, lse, base=2.0, out=out)  # plans the call: the choice is made here
    plan = merge._layout_launch(merge.LSE, o, lse, 2.0, None, None, out, False, None)
    r["auto"] = plan.kernel.config.label
    decision = dispatcher.explain(device_facts(o.device), head_dim, torch.bfloat16,
                                  torch.bfloat16, merge.LSE, n, tokens * heads)
    r["auto_source"] = decision.source if decision is not None else "?"
    reference = out.float().clone()
    base_e = kvsplit.merge_lse(o, lse, base=math.e).float()

    launches = {"read": lambda i: read_probe(o, lse, out),
                "auto": lambda i: kvsplit.merge_lse(o, lse, base=2.0, out=out)}
    for config in legal_configs(head_dim, 2, ("few",)):
        launches[report.short(config.label)] = config_launcher(config, o, lse, out)
    others = [c for c in record.candidates if c.samples and c.matched and c.config.family != "few"]
    if others:
        pre_few = min(others, key=lambda c: c.median_us).config
        r["pre_few"] = pre_few.label
        launches["pre-few"] = config_launcher(pre_few, o, lse, out)
    peer_fns = {"fiN": lambda: peers_cuda.states_flashinfer(o, lse, out)}
    if n == 2:
        peer_fns["vllm"] = lambda: peers_cuda.two_state_vllm(o[0], lse[0], o[1], lse[1], out)
        if head_dim in (64, 128, 256, 512):  # FlashInfer's two-state merge takes these alone
            peer_fns["fi2"] = lambda: peers_cuda.two_state_flashinfer(o[0], lse[0], o[1], lse[1],
                                                                      out)
    if head_dim & (head_dim - 1) == 0:  # the serial Triton merge takes powers of two only
        flat_o, flat_lse = o.view(n, tokens * heads, head_dim), lse.view(n, tokens * heads)
        peer_fns["triton"] = lambda: peers.triton_merge(flat_o, flat_lse, out.view(-1, head_dim),
                                                        stats_format="lse", base=2.0)
    for name, fn in peer_fns.items():
        try:
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            expected = base_e if name == "vllm" else reference
            r["max_diff"][name] = (out.float() - expected).abs().max().item()
            launches[name] = lambda i, fn=fn: fn()
        except Exception:  # a peer that cannot run here leaves its column empty
            if name not in failures:
                failures[name] = traceback.format_exc(limit=4)
                print(f"  {name} failed:\n{failures[name]}", flush=True)
    for name, launch in launches.items():
        if name.startswith("F") or name == "pre-few":
            out.fill_(float("nan"))
            launch(0)
            r["max_diff"][name] = (out.float() - reference).abs().max().item()

    launch_us = set_bytes / 4e6 + 2.0  # at about 4 TB/s
    batch = max(2, min(64, round(REPLAY_US / launch_us)))
    timings = time_cuda_graphs(launches, batch=batch, replays=11)
    r["warm"] = {name: t.median_us for name, t in timings.items()}
    r["spread"] = {name: t.spread for name, t in timings.items()}
    return r


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."),
                        help="folder for bench_few.json [default: .]")
    parser.add_argument("--quick", action="store_true",
                        help=f"{len(QUICK_SHAPES)} shapes at N = 2 and 16 only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark", file=sys.stderr)
        return 1
    props = torch.cuda.get_device_properties(0)
    generator = torch.Generator(device="cuda").manual_seed(0)
    started = time.perf_counter()
    peers_cuda.library()  # built before any timing
    spin_up_gpu()
    bandwidth, noop_us = copy_bandwidth(), noop_launch_us()
    print(f"{props.name}: {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MiB, "
          f"copy {bandwidth / 1e6:.2f} TB/s, empty launch {noop_us:.2f} us", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_few.json"
    meta = {"gpu": props.name, "copy_bytes_per_us": bandwidth, "noop_us": noop_us,
            "date": str(datetime.date.today()), "torch": torch.__version__,
            "complete": False, "failures": {}, "results": []}
    shapes = QUICK_SHAPES if args.quick else SHAPES
    states = (2, 16) if args.quick else NUM_STATES
    with open_store() as store:
        for tokens, heads, head_dim in shapes:
            for n in states:
                begin = time.perf_counter()
                r = bench_shape(tokens, heads, head_dim, n, generator, store, meta["failures"])
                meta["results"].append(r)
                w = r["warm"]
                peers_text = " ".join(f"{k} {w[k]:.2f}" for k in ("vllm", "fi2", "fiN", "triton")
                                      if k in w)
                print(f"  {tokens}x{heads}x{head_dim} N={n} ({r['bytes'] / 1e6:.1f} MB): read "
                      f"{w['read']:.2f} auto {w['auto']:.2f} ({report.short(r['auto'])}, "
                      f"{r['auto_source']}) = {w['auto'] / w['read']:.2f}x read; {peers_text}; "
                      f"tuned in {r['tune_ms']:.0f} ms [{time.perf_counter() - begin:.1f} s]",
                      flush=True)
                path.write_text(json.dumps(meta, indent=1))
                torch.cuda.empty_cache()
    meta["complete"] = True
    meta["wall_s"] = time.perf_counter() - started
    path.write_text(json.dumps(meta, indent=1))
    print(f"wrote {path} in {meta['wall_s']:.0f} s\n")
    print(report.few_section(meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
