"""Where an adapter's time parts from the plain call's on its own tensors: the config each
took, and both under the same fixed configs.

Run on a GPU machine:  python -P benchmarks/lab/lab_adapter_choice.py [--out DIR]

For cells of benchmarks/bench_adapters.py (vLLM's and FlashInfer's merge ops and
FlashAttention 3's combine at two states, FlashInfer's merge_states at sixteen) this tunes each call at first use into a fresh database,
prints the decision behind each call (key, config, where it came from) and the tuning
record of each key with every candidate's time, then times the adapter and its plain twin
under auto and under each fixed ``KVSPLIT_MODE`` in one set of CUDA graphs (L2-warm, us
per launch, median). If the two differ under auto but not under a fixed config, the miss
is the choice; if they differ under every config, it is the layout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import tempfile

import torch

import kvsplit
from kvsplit.autotune.timing import spin_up_gpu, time_cuda_graphs
from kvsplit.compat import flash_attn, flashinfer, vllm
from kvsplit.dispatch.dispatcher import dispatcher

CELLS = [(16, 16, 512, 2), (1, 128, 512, 2), (16, 16, 128, 2), (64, 128, 128, 2), (64, 128, 512, 2),
         (64, 128, 128, 16)]
FIXED = ["few:1", "few:2", "1", "dsplit:2:1", "dsplit:4:1"]


def _pairs(tokens: int, heads: int, head_dim: int, n: int) -> dict:
    """{name: (adapter launch, plain launch)} at N = n (FlashInfer's merge_states only past 2)."""
    g = torch.Generator("cuda").manual_seed(tokens * heads + head_dim)
    dev = {"device": "cuda"}
    v = torch.randn(n, tokens, heads, head_dim, generator=g, **dev).bfloat16()
    s = torch.randn(n, tokens, heads, generator=g, **dev)
    v_fi = v.permute(1, 0, 2, 3).contiguous()
    s_fi = s.permute(1, 0, 2).contiguous()
    states = (lambda: flashinfer.merge_states(v_fi, s_fi),
              lambda: kvsplit.merge_lse(v_fi.transpose(0, 1), s_fi.transpose(0, 1), base=2.0,
                                        return_lse=True))
    if n != 2:
        return {"fi_states": states, "fi_states again": (states[0], lambda: states[0]())}
    a, b, sa, sb = v[0].clone(), v[1].clone(), s[0].clone(), s[1].clone()
    hm_a, hm_b = sa.t().contiguous(), sb.t().contiguous()
    out = torch.empty(tokens, heads, head_dim, dtype=torch.bfloat16, **dev)
    lse_hm = torch.empty(heads, tokens, **dev)
    pairs = {"vllm": (lambda: vllm.merge_attn_states(out, a, hm_a, b, hm_b, lse_hm),
                      lambda: kvsplit.merge_lse([a, b], [hm_a.t(), hm_b.t()], base=math.e, out=out,
                                                return_lse=True))}
    o32 = v.float().view(2, 1, tokens, heads, head_dim)
    s_fa = s.permute(0, 2, 1).contiguous().permute(0, 2, 1).view(2, 1, tokens, heads)
    pairs["flash_attn"] = (
        lambda: flash_attn.flash_attn_combine(o32, s_fa, out_dtype=torch.bfloat16),
        lambda: kvsplit.merge_lse(o32[:, 0], s_fa[:, 0], base=math.e, out_dtype=torch.bfloat16,
                                  return_lse=True))
    state = (lambda: flashinfer.merge_state(a, sa, b, sb),
             lambda: kvsplit.merge_lse([a, b], [sa, sb], base=2.0, return_lse=True))
    pairs.update({"fi_state": state, "fi_state again": (state[0], lambda: state[0]()), "fi_states": states})
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."))
    args = parser.parse_args()
    db = pathlib.Path(tempfile.mkdtemp()) / "choice.sqlite"
    os.environ["KVSPLIT_DB"] = f"sqlite:///{db}"
    os.environ.pop("KVSPLIT_MODE", None)
    spin_up_gpu()
    results = []
    for tokens, heads, head_dim, n in CELLS:
        pairs = _pairs(tokens, heads, head_dim, n)
        launches = {}
        for name, (adapter, plain) in pairs.items():
            before = set(dispatcher._decisions)
            adapter()
            after_adapter = set(dispatcher._decisions)
            plain()
            torch.cuda.synchronize()
            for label, keys in (("adapter", after_adapter - before),
                                ("plain", set(dispatcher._decisions) - after_adapter)):
                for key in keys:
                    d = dispatcher._decisions[key]
                    print(f"{tokens}x{heads}x{head_dim} N={n} {name} {label}: key {d.key.shape_label if d.key else '-'}"
                          f" -> {d.config} ({d.source})", flush=True)
            for mode in ["auto", *FIXED]:
                def run(fn, mode=mode):
                    os.environ["KVSPLIT_MODE"] = mode
                    try:
                        return fn()
                    finally:
                        os.environ.pop("KVSPLIT_MODE", None)

                launches[f"{name} {mode} adapter"] = lambda i, f=adapter, r=run: r(f)
                launches[f"{name} {mode} plain"] = lambda i, f=plain, r=run: r(f)
        usable = {}
        for k, launch in launches.items():
            try:
                launch(0)
                usable[k] = launch
            except Exception as error:  # noqa: BLE001 - a fixed config the shape refuses
                print(f"  {k}: {type(error).__name__}: {str(error)[:100]}")
        torch.cuda.synchronize()
        times = time_cuda_graphs(usable, batch=32, replays=31)
        us = {k: t.median_us for k, t in times.items()}
        results.append({"cell": [tokens, heads, head_dim, n], "us": us})
        for name in pairs:
            print(f"{tokens}x{heads}x{head_dim} N={n} {name}: " + ", ".join(
                f"{mode} {us.get(f'{name} {mode} adapter', math.nan):.2f}/"
                f"{us.get(f'{name} {mode} plain', math.nan):.2f}" for mode in ["auto", *FIXED]),
                flush=True)
    from kvsplit.db import open_store  # the records with every candidate's time
    with open_store(os.environ["KVSPLIT_DB"]) as store:
        for record in store.query():
            times = sorted((c.median_us, c.config.label) for c in record.candidates)
            print(record.key.shape_label, record.key.stats_format, "winner", record.winner.label,
                  " ".join(f"{label} {t:.2f}" for t, label in times[:6]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "adapter_choice.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
