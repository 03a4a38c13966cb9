"""Per-launch time of each kvsplit.compat adapter next to the plain API on the same tensors,
and next to the same merge in split-major layout.

Run on a GPU machine:  python -P benchmarks/bench_adapters.py [--out DIR]

Shapes are decode and chunked-prefill ones: tokens x heads rows, head_dim
128 and 512, N partials. For each shape every adapter that takes it,
``kvsplit.merge_lse`` on the adapter's own tensors (the engine's layout,
the merged LSE returned as the adapter returns it: "NAME plain"), and the
plain split-major ``kvsplit.merge_lse`` (partials (N, rows, D), LSE (N,
rows), same dtypes, the dispatcher's config) with and without exporting
the merged LSE are captured into CUDA graphs and replayed in turns,
L2-warm (each graph replayed once, untimed, right before each timed replay:
adapter and twin share their inputs, so without it the one replayed second
found them in L2 and the other paid their reads, 3 % at 8 MB states);
microseconds per launch. One call's time moves by a few per cent
from one capture to the next (where its buffers land), so every shape is
captured ``--captures`` times (in alternating order) and each call's time
is the median over the captures of its median; the largest spread of one
call's per-capture medians is printed. The first table's ratios are each
adapter over the plain API on its tensors (what the adapter's layer costs);
the second's over split-major "+lse" (what the engine's layout costs). A
control, FlashInfer merge_states' plain twin captured once more in a graph
of its own, gives the ratio of one call to itself: how far apart two
captures of the same work land.
Two-state adapters (FlashInfer merge_state and merge_state_in_place, vLLM)
run at N = 2 only; merge_state_in_place has no plain twin (the plain API
does not export stats over its inputs). Writes DIR/adapters.json and prints
the markdown tables of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import time

import torch

import kvsplit
from kvsplit.autotune.timing import spin_up_gpu, time_cuda_graphs
from kvsplit.compat import flash_attn, flashinfer, vllm

ROWS = [(1, 16), (1, 128), (16, 16), (64, 128)]  # (tokens, heads)
HEAD_DIMS = (128, 512)
NUM_SPLITS = (2, 16, 264)
BUDGET_S = 150.0  # the device run is short: stop adding shapes past this
CONTROL = "flashinfer.merge_states plain again"


def _launches(tokens: int, heads: int, head_dim: int, n: int):
    """{name: launch(i)} for this shape: "split-major" (bf16) and "split-major fp32"
    baselines, and the adapters."""
    g = torch.Generator("cuda").manual_seed(n * 1000 + tokens * heads + head_dim)
    dev = {"device": "cuda"}
    rows = tokens * heads
    v = torch.randn(n, tokens, heads, head_dim, generator=g, **dev).bfloat16()
    s = torch.randn(n, tokens, heads, generator=g, **dev)
    o_sm, s_sm = v.view(n, rows, head_dim), s.view(n, rows)
    out = torch.empty(rows, head_dim, dtype=torch.bfloat16, **dev)
    lau = {"split-major": lambda i: kvsplit.merge_lse(o_sm, s_sm, out=out)}
    # Every adapter returns the merged LSE too: the baseline that does the same work.
    lau["split-major +lse"] = lambda i: kvsplit.merge_lse(o_sm, s_sm, out=out, return_lse=True)
    # FlashInfer merge_states: [tokens, N, heads, D].
    v_fi = v.permute(1, 0, 2, 3).contiguous()
    s_fi = s.permute(1, 0, 2).contiguous()
    lau["flashinfer.merge_states"] = lambda i: flashinfer.merge_states(v_fi, s_fi)
    lau["flashinfer.merge_states plain"] = lambda i: kvsplit.merge_lse(
        v_fi.transpose(0, 1), s_fi.transpose(0, 1), base=2.0, return_lse=True)
    # The control: the same call in a graph of its own (its own outputs' memory).
    lau[CONTROL] = lau["flashinfer.merge_states plain"]
    # FlashAttention 3: float32 partials, LSE contiguous along seqlen (here tokens).
    o32 = v.float().view(n, 1, tokens, heads, head_dim)
    s_fa = s.permute(0, 2, 1).contiguous().permute(0, 2, 1).view(n, 1, tokens, heads)
    o32_sm = o32.view(n, rows, head_dim)
    lau["split-major fp32"] = lambda i: kvsplit.merge_lse(o32_sm, s_sm, out=out)
    lau["split-major fp32 +lse"] = lambda i: kvsplit.merge_lse(o32_sm, s_sm, out=out,
                                                               return_lse=True)
    lau["flash_attn.combine"] = lambda i: flash_attn.flash_attn_combine(
        o32, s_fa, out_dtype=torch.bfloat16)
    lau["flash_attn.combine plain"] = lambda i: kvsplit.merge_lse(  # its one batch as tokens
        o32[:, 0], s_fa[:, 0], base=math.e, out_dtype=torch.bfloat16, return_lse=True)
    if n == 2:
        a, b = v[0].clone(), v[1].clone()
        sa, sb = s[0].clone(), s[1].clone()
        lau["flashinfer.merge_state"] = lambda i: flashinfer.merge_state(a, sa, b, sb)
        lau["flashinfer.merge_state plain"] = lambda i: kvsplit.merge_lse(
            [a, b], [sa, sb], base=2.0, return_lse=True)
        ia, isa = a.clone(), sa.clone()
        lau["flashinfer.merge_state_in_place"] = (
            lambda i: flashinfer.merge_state_in_place(ia, isa, b, sb))
        hm_a, hm_b = sa.t().contiguous(), sb.t().contiguous()
        out3 = torch.empty(tokens, heads, head_dim, dtype=torch.bfloat16, **dev)
        lse_hm = torch.empty(heads, tokens, **dev)
        lau["vllm.merge_attn_states"] = lambda i: vllm.merge_attn_states(out3, a, hm_a, b, hm_b,
                                                                         lse_hm)
        lau["vllm.merge_attn_states plain"] = lambda i: kvsplit.merge_lse(
            [a, b], [hm_a.t(), hm_b.t()], base=math.e, out=out3, return_lse=True)
    return lau


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."))
    parser.add_argument("--captures", type=int, default=3, help="captures of each shape")
    args = parser.parse_args()
    spin_up_gpu()
    start, results = time.monotonic(), []
    for head_dim in HEAD_DIMS:
        for n in NUM_SPLITS:
            for tokens, heads in ROWS:
                if time.monotonic() - start > BUDGET_S:
                    break
                launches = _launches(tokens, heads, head_dim, n)
                for launch in launches.values():  # first use: tuning, launches
                    launch(0)
                torch.cuda.synchronize()
                captured = []
                for capture in range(args.captures):
                    order = list(launches.items())[::-1 if capture % 2 else 1]
                    times = time_cuda_graphs(dict(order), batch=32, replays=31, prime=True)
                    captured.append({name: t.median_us for name, t in times.items()})
                us = {name: statistics.median(c[name] for c in captured) for name in launches}
                spread = {name: max(c[name] for c in captured) / min(c[name] for c in captured)
                          for name in launches}
                results.append({"head_dim": head_dim, "num_splits": n, "tokens": tokens,
                                "heads": heads, "us": us, "captures": captured, "spread": spread})
                print(head_dim, n, tokens, heads, {k: round(t, 2) for k, t in us.items()}, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "adapters.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                        "results": results}, indent=1))
    print(plain_table(results))
    print()
    print(control_line(results))
    print()
    print(table(results))
    print()
    print(spread_line(results))


def plain_table(results) -> str:
    """Each adapter over the plain API on the same tensors."""
    adapters = ["flashinfer.merge_states", "flashinfer.merge_state", "vllm.merge_attn_states",
                "flash_attn.combine"]
    lines = ["| D | N | tokens x heads | " + " | ".join(
                 f"{a} | plain | x" for a in adapters) + " |",
             "|---" * (3 + 3 * len(adapters)) + "|"]
    worst = {}
    for r in results:
        us, cells = r["us"], []
        for a in adapters:
            if a not in us or f"{a} plain" not in us:
                cells.append(" |  | ")
                continue
            ratio = us[a] / us[f"{a} plain"]
            worst[a] = max(worst.get(a, 0.0), ratio)
            cells.append(f"{us[a]:.2f} | {us[f'{a} plain']:.2f} | {ratio:.2f}")
        lines.append(f"| {r['head_dim']} | {r['num_splits']} | {r['tokens']}x{r['heads']} | "
                     + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Worst adapter / plain API on the same tensors: " + ", ".join(
        f"{a} {w:.3f}" for a, w in worst.items()))
    return "\n".join(lines)


def control_line(results) -> str:
    """The plain call against itself: how far two captures of one call land apart."""
    twin = "flashinfer.merge_states plain"
    pairs = [(max(r["us"][CONTROL] / r["us"][twin], r["us"][twin] / r["us"][CONTROL]), r)
             for r in results if CONTROL in r["us"]]
    if not pairs:
        return "No control timed."
    value, r = max(pairs, key=lambda item: item[0])
    return (f"Control, the plain twin of flashinfer.merge_states captured twice: worst "
            f"{value:.3f} (D {r['head_dim']}, N {r['num_splits']}, {r['tokens']}x{r['heads']}), "
            f"median {statistics.median(v for v, _ in pairs):.3f}")


def table(results) -> str:
    adapters = ["flashinfer.merge_states", "flashinfer.merge_state",
                "flashinfer.merge_state_in_place", "vllm.merge_attn_states", "flash_attn.combine"]
    lines = ["| D | N | tokens x heads | split-major | split-major +lse | " + " | ".join(
                 a + " (x)" for a in adapters) + " |",
             "|---" * (5 + len(adapters)) + "|"]
    worst = {}
    for r in results:
        us = r["us"]
        cells = []
        for a in adapters:
            if a not in us:
                cells.append("")
                continue
            base = us["split-major fp32 +lse" if a == "flash_attn.combine" else "split-major +lse"]
            ratio = us[a] / base
            worst[a] = max(worst.get(a, 0.0), ratio)
            cells.append(f"{us[a]:.2f} ({ratio:.2f})")
        lines.append(f"| {r['head_dim']} | {r['num_splits']} | {r['tokens']}x{r['heads']} | "
                     f"{us['split-major']:.2f} | {us['split-major +lse']:.2f} | "
                     + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Worst adapter / (split-major +lse) ratio: " + ", ".join(
        f"{a} {w:.3f}" for a, w in worst.items()) + " (every adapter returns the merged LSE, "
        "as the +lse baseline does; flash_attn.combine against fp32 split-major partials)")
    return "\n".join(lines)


def spread_line(results) -> str:
    """The largest spread of one call's per-capture medians: ratios inside it are not resolved."""
    spreads = [(value, name, r) for r in results for name, value in r["spread"].items()]
    if not spreads:
        return "No shape timed."
    value, name, r = max(spreads, key=lambda item: item[0])
    captures = len(r["captures"])
    return (f"Largest spread of one call over {captures} captures: {value:.3f} ({name} at D {r['head_dim']}, "
            f"N {r['num_splits']}, {r['tokens']}x{r['heads']}); median spread "
            f"{statistics.median(v for v, _, _ in spreads):.3f}")


if __name__ == "__main__":
    main()
