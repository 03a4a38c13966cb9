"""The main job: merge the split-KV partials of a real decode attention problem.

It builds one MLA-like decode step (head_dim 512, 16 heads sharing one latent
KV cache, 4 tokens, 8192 keys) in float64, cuts the keys into num_splits chunks as a flash-decoding
kernel would, hands the bf16 partials to kvsplit, and compares the merged
output with exact attention.
"""

from __future__ import annotations

import math
import os
import time

import torch

import kvsplit
from kvsplit.reference import attention_partials

HEAD_DIM, HEADS, TOKENS, KV_LEN, NUM_SPLITS = 512, 16, 4, 8192, 48


def run(device: str | None, seed: int) -> int:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(seed)
    rows = TOKENS * HEADS
    q = torch.randn(rows, HEAD_DIM, generator=g, dtype=torch.float64)
    # MLA: the heads of a token share one latent cache, so K and V are views.
    k = torch.randn(TOKENS, 1, KV_LEN, HEAD_DIM, generator=g, dtype=torch.float64)
    v = torch.randn(TOKENS, 1, KV_LEN, HEAD_DIM, generator=g, dtype=torch.float64)
    k = k.expand(TOKENS, HEADS, KV_LEN, HEAD_DIM).reshape(rows, KV_LEN, HEAD_DIM)
    v = v.expand(TOKENS, HEADS, KV_LEN, HEAD_DIM).reshape(rows, KV_LEN, HEAD_DIM)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    partial_o, stats, exact = attention_partials(q, k, v, NUM_SPLITS, scale=scale)
    partial_o = partial_o.to(device, torch.bfloat16)
    stats = stats.to(device, torch.float32)
    print(f"decode step: rows={rows} (tokens {TOKENS} x heads {HEADS}), head_dim={HEAD_DIM}, "
          f"kv_len={KV_LEN}, num_splits={NUM_SPLITS}, device={device}")
    begin = time.perf_counter()
    out = kvsplit.merge_maxsum(partial_o, stats, scale * math.log2(math.e))
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed_ms = (time.perf_counter() - begin) * 1e3
    _report(partial_o, rows, elapsed_ms)
    error = ((out.double().cpu() - exact).norm() / exact.norm()).item()
    print(f"relative error vs exact attention: {error:.2e}")
    ok = error < 1e-2
    print("OK" if ok else "FAILED: error above 1e-2")
    return 0 if ok else 1


def _report(partial_o: torch.Tensor, rows: int, elapsed_ms: float) -> None:
    from .db import StoreError
    from .db.engine import parse_target, shown_as_given
    from .dispatch.device import device_facts
    from .dispatch.dispatcher import dispatcher

    decision = dispatcher.explain(device_facts(partial_o.device), HEAD_DIM, partial_o.dtype,
                                  partial_o.dtype, 0, NUM_SPLITS, rows)
    try:
        where = parse_target(os.environ.get("KVSPLIT_DB")).shown
    except StoreError:  # the merge warned about it and went on in memory
        where = f"memory ({shown_as_given(os.environ.get('KVSPLIT_DB', ''))} is unusable)"
    print(f"chosen config = {decision.config.label} ({decision.source}); first call took "
          f"{elapsed_ms:.1f} ms wall clock")
    if decision.record is not None:
        print(f"profiled the candidate configs at the key's shape {decision.key.shape_label}:")
        width = max(len(c.config.label) for c in decision.record.candidates)
        for c in decision.record.candidates:
            mark = "  <- winner" if c.config == decision.record.winner else ""
            print(f"  {c.config.label:<{width}}  median {c.median_us:9.2f} us  "
                  f"(p10 {c.p10_us:.2f}, p90 {c.p90_us:.2f}, {c.samples} samples, "
                  f"{'matches K=1' if c.matched else 'MISMATCH'}){mark}")
        print(f"stored in {where}")
    elif decision.source == "database":
        print(f"reused the stored choice from {where}: no profiling in this run")
