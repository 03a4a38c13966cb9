"""The float64 reference of merging attention states, for the adapters' tests.

A state is (v, lse); the merge is v = sum_i w_i v_i / sum_i w_i with
w_i = base^(lse_i - max) and lse = log_base(sum_i w_i) + max; a row with no
non-empty state is 0 and -inf. Written from the engines' definitions, never
from kvsplit.
"""

from __future__ import annotations

import math
import zlib

import torch


def seeded(*key) -> torch.Generator:
    """A generator seeded from ``key`` (fresh data per test case, repeatable)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def merge_reference(vs, ss, base, *, inf_is_empty=False):
    """vs (n, ..., D), ss (n, ...) -> float64 (v, lse); with ``inf_is_empty`` a +inf LSE is an
    empty state too (vLLM, SGLang)."""
    v, s = vs.double(), ss.double()
    if inf_is_empty:
        s = torch.where(s == math.inf, torch.full_like(s, -math.inf), s)
    top = s.amax(dim=0)
    empty = top == -math.inf
    safe = torch.where(empty, torch.zeros_like(top), top)
    w = torch.where(s == -math.inf, torch.zeros_like(s), base ** (s - safe))
    total = w.sum(dim=0)
    out = (w.unsqueeze(-1) * v).sum(dim=0) / torch.where(empty, torch.ones_like(total),
                                                          total).unsqueeze(-1)
    lse = torch.where(empty, torch.full_like(top, -math.inf),
                      torch.log(total.clamp_min(1e-300)) / math.log(base) + safe)
    return torch.where(empty.unsqueeze(-1), torch.zeros_like(out), out), lse
