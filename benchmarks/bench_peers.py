"""kvsplit next to its peers and the read probe on the 35-shape grid.

Run on a GPU machine:  python -P benchmarks/bench_peers.py [--out DIR]
then  python benchmarks/report.py DIR  for the tables (also printed at the end).

For every shape of bench_merge's grid (SHAPES x NUM_SPLITS; bf16 partials,
LSE in base 2, bf16 out) it measures, in microseconds per launch from
CUDA-graph replay, all candidates of a regime captured in their own graphs
and replayed in turns (autotune.timing.time_cuda_graphs):
  read     the read probe: every input byte read once, every output byte
           written, nothing merged;
  auto     kvsplit.merge_lse(kv_split=None): the dispatcher's choice (the
           shipped table, the database, or first-use profiling, made by the
           first eager call of the shape, before any capture);
  best     the fastest of every valid config of both families (a warm sweep
           first), measured again next to the others;
  triton   the serial Triton merge of benchmarks/peers.py, the fastest of
           num_warps 1, 2, 4, 8 (warm), that warp count cold;
  compile  the plain PyTorch merge under torch.compile (static shapes,
           default mode unless --compile-mode), captured like the rest.
Two regimes: warm (the same buffers every launch, L2-resident when they fit)
and cold (rotating over buffer sets 4x the L2 size). Each peer's output is
compared with kvsplit's. The JSON is rewritten after every shape, so a run
cut short keeps what it measured.
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
from kvsplit.autotune.timing import spin_up_gpu, time_cuda_graphs  # noqa: E402
from kvsplit.dispatch.constraints import valid_configs  # noqa: E402
from kvsplit.dispatch.device import device_facts  # noqa: E402
from kvsplit.dispatch.dispatcher import dispatcher  # noqa: E402

import peers  # noqa: E402
import report  # noqa: E402
from bench_merge import NUM_SPLITS, SHAPES, copy_bandwidth, noop_launch_us, read_probe  # noqa: E402

WARPS = (1, 2, 4, 8)
BATCH = 64  # launches per graph: the graph's own launch cost is spread over 64


def make_set(num_splits: int, rows: int, head_dim: int, generator: torch.Generator):
    """Normalised bf16 partials, base-2 LSE ~ N(0, 2), a bf16 output."""
    o = torch.randn(num_splits, rows, head_dim, generator=generator, device="cuda",
                    dtype=torch.bfloat16)
    lse = torch.randn(num_splits, rows, generator=generator, device="cuda") * 2
    return o, lse, torch.empty(rows, head_dim, dtype=torch.bfloat16, device="cuda")


def kvsplit_auto(o, lse, out) -> None:
    kvsplit.merge_lse(o, lse, base=2.0, out=out)


def config_launcher(config, sets):
    plan = _kernel.Plan(config, merge.LSE, *sets[0], None, 1.0)
    return lambda i: _kernel.run(plan, *sets[i % len(sets)], 1.0)


def rotating(fn, sets):
    return lambda i: fn(*sets[i % len(sets)])


def triton_fn(num_warps):
    return lambda o, lse, out: peers.triton_merge(o, lse, out, base=2.0, num_warps=num_warps)


def compile_fn(mode):
    return lambda o, lse, out: peers.compiled_merge(o, lse, out, base=2.0, mode=mode)


def try_first_call(name, fn, warm, failures):
    """Runs ``fn`` once eagerly (compiles it); returns its output, or None if it fails."""
    try:
        warm[2].fill_(float("nan"))
        fn(*warm)
        torch.cuda.synchronize()
        return warm[2].float().clone()
    except Exception:  # a peer that cannot run here leaves its column empty
        if name not in failures:
            failures[name] = traceback.format_exc(limit=4)
            print(f"  {name} failed:\n{failures[name]}", flush=True)
        return None


def timed(launches: dict, failures: dict, **kwargs) -> dict:
    """time_cuda_graphs of ``launches``; a peer whose capture fails is dropped (compile first)."""
    while True:
        try:
            return time_cuda_graphs(launches, **kwargs)
        except Exception:
            torch.cuda.synchronize()
            drop = next((n for n in ("compile", "triton")
                         if any(k.startswith(n) for k in launches)), None)
            if drop is None:
                raise
            failures.setdefault(f"{drop} in graph", traceback.format_exc(limit=4))
            print(f"  {drop} failed in graph capture:\n{failures[f'{drop} in graph']}", flush=True)
            launches = {k: v for k, v in launches.items() if not k.startswith(drop)}


def bench_shape(head_dim, rows, num_splits, sm_count, l2_bytes, generator, compile_mode,
                failures):
    warm = make_set(num_splits, rows, head_dim, generator)
    set_bytes = warm[0].numel() * 2 + warm[1].numel() * 4 + warm[2].numel() * 2
    n_sets = max(2, min(64, math.ceil(4 * l2_bytes / set_bytes)))
    cold = [warm] + [make_set(num_splits, rows, head_dim, generator) for _ in range(n_sets - 1)]
    r = {"head_dim": head_dim, "rows": rows, "num_splits": num_splits, "bytes": set_bytes,
         "cold_sets": n_sets, "warm": {}, "cold": {}, "max_diff_vs_auto": {}}

    # kvsplit auto: the first eager call decides, as in a server's first step.
    torch.cuda.synchronize()
    begin = time.perf_counter()
    kvsplit_auto(*warm)
    torch.cuda.synchronize()
    r["auto_first_call_ms"] = (time.perf_counter() - begin) * 1e3
    plan = merge._plan(merge.LSE, warm[0], warm[1], 2.0, None, None, warm[2], False, None)
    r["auto"] = plan.kernel.config.label
    decision = dispatcher.explain(device_facts(warm[0].device), head_dim, torch.bfloat16,
                                  torch.bfloat16, merge.LSE, num_splits, rows)
    r["auto_source"] = decision.source if decision is not None else "?"
    warm[2].fill_(float("nan"))
    kvsplit_auto(*warm)
    ref = warm[2].float().clone()

    # The best config: a warm sweep of every valid one.
    configs = {c.label: c for c in valid_configs(head_dim=head_dim, elem_bytes=2, rows=rows,
                                                 num_splits=num_splits, sm_count=sm_count)}
    sweep = time_cuda_graphs({label: config_launcher(c, [warm]) for label, c in configs.items()},
                             batch=16, replays=7)
    r["sweep"] = {label: t.median_us for label, t in sweep.items()}
    r["best"] = min(r["sweep"], key=r["sweep"].get)
    best = configs[r["best"]]

    fns = {"read": read_probe, "auto": kvsplit_auto}
    fns.update({f"triton_w{w}": triton_fn(w) for w in WARPS})
    fns["compile"] = compile_fn(compile_mode)
    for name in list(fns):
        if name in ("read", "auto"):
            continue
        got = try_first_call("compile" if name == "compile" else "triton", fns[name], warm,
                             failures)
        if got is None:
            del fns[name]
        else:
            r["max_diff_vs_auto"][name] = (got - ref).abs().max().item()

    launches = {name: rotating(fn, [warm]) for name, fn in fns.items()}
    launches["best"] = config_launcher(best, [warm])
    warm_t = timed(launches, failures, batch=BATCH, replays=11)
    r["warm"] = {name: t.median_us for name, t in warm_t.items()}
    r["warm_spread"] = {name: t.spread for name, t in warm_t.items()}
    tritons = [name for name in r["warm"] if name.startswith("triton_w")]
    if tritons:
        fastest = min(tritons, key=r["warm"].get)
        r["triton_warps"] = int(fastest[len("triton_w"):])
        r["warm"]["triton"] = r["warm"][fastest]

    cold_fns = {name: fns[name] for name in ("read", "auto", "compile") if name in fns}
    if tritons:
        cold_fns["triton"] = fns[f"triton_w{r['triton_warps']}"]
    launches = {name: rotating(fn, cold) for name, fn in cold_fns.items()}
    launches["best"] = config_launcher(best, cold)
    cold_t = timed(launches, failures, batch=max(BATCH, n_sets), replays=11)
    r["cold"] = {name: t.median_us for name, t in cold_t.items()}
    r["cold_spread"] = {name: t.spread for name, t in cold_t.items()}
    return r


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."),
                        help="folder for bench_peers.json [default: .]")
    parser.add_argument("--quick", action="store_true", help="N in {16, 132} only")
    parser.add_argument("--compile-mode", default=None,
                        help="torch.compile mode [default: default; "
                             "e.g. max-autotune-no-cudagraphs]")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark", file=sys.stderr)
        return 1
    props = torch.cuda.get_device_properties(0)
    generator = torch.Generator(device="cuda").manual_seed(0)
    started = time.perf_counter()
    spin_up_gpu()
    bandwidth = copy_bandwidth()
    noop_us = noop_launch_us()
    versions = {"torch": torch.__version__,
                "triton": getattr(peers.triton, "__version__", None) if peers.triton else None}
    print(f"{props.name}: {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MiB, "
          f"copy {bandwidth / 1e6:.2f} TB/s, empty launch {noop_us:.2f} us; {versions}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_peers.json"
    meta = {"gpu": props.name, "copy_bytes_per_us": bandwidth, "noop_us": noop_us,
            "date": str(datetime.date.today()), "versions": versions,
            "compile_mode": args.compile_mode or "default", "complete": False, "failures": {},
            "results": []}
    for head_dim, rows in SHAPES:
        for num_splits in ((16, 132) if args.quick else NUM_SPLITS):
            shape_start = time.perf_counter()
            r = bench_shape(head_dim, rows, num_splits, props.multi_processor_count,
                            props.L2_cache_size, generator, args.compile_mode, meta["failures"])
            meta["results"].append(r)
            w, c = r["warm"], r["cold"]

            def fmt(times, name):
                return f"{times[name]:.2f}" if name in times else "-"

            print(f"  D={head_dim} rows={rows} N={num_splits}: auto {report.short(r['auto'])} "
                  f"({r['auto_source']}) warm {fmt(w, 'auto')} / read {fmt(w, 'read')} / best "
                  f"{fmt(w, 'best')} / triton {fmt(w, 'triton')} / compile {fmt(w, 'compile')}; "
                  f"cold {fmt(c, 'auto')} / {fmt(c, 'read')} / {fmt(c, 'best')} / "
                  f"{fmt(c, 'triton')} / {fmt(c, 'compile')} us; max diff vs auto "
                  f"{max(r['max_diff_vs_auto'].values(), default=float('nan')):.1e} "
                  f"[{time.perf_counter() - shape_start:.1f} s]", flush=True)
            path.write_text(json.dumps(meta, indent=1))
    meta["complete"] = True
    meta["wall_s"] = time.perf_counter() - started
    path.write_text(json.dumps(meta, indent=1))
    print(f"wrote {path} in {meta['wall_s']:.0f} s\n")
    print(report.peers_section(meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
