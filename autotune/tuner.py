"""Profiles every valid config for one tuning key and picks the winner.

Scratch tensors of the key's shape are made on the target device (never the
caller's tensors). Every candidate's output is compared with kv_split = 1;
a mismatch disqualifies it (and is logged). Times come from CUDA-graph replay
on GPUs and from a host clock on the CPU. The winner is the fastest median,
except that a smaller kv_split within ``noise_margin`` of it wins instead.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass

import torch

from ..db import CandidateResult, KernelConfig, TuningPolicy, TuningRecord
from ..db.transfer import tool_version
from ..dispatch.constraints import valid_kv_splits
from .timing import Timing, time_cuda_graph, time_host

log = logging.getLogger("kvsplit.autotune")

NOISE_MARGIN = 0.02
_MATCH_TOLERANCE = 1e-2  # relative norm vs kv_split=1: a different summation order only
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True, order=True)
class Candidate:
    """A kernel config to try: a family and its parameters (hashable)."""

    kv_split: int
    family: str = "kvsplit"

    def to_db(self) -> KernelConfig:
        return KernelConfig.kvsplit(self.kv_split)


def candidates(key, *, max_split: int | None = None, is_cuda: bool = True) -> list[Candidate]:
    """Every config that satisfies the constraints at the key's shape."""
    return [Candidate(k) for k in valid_kv_splits(
        head_dim=key.head_dim, elem_bytes=_DTYPES[key.partial_dtype].itemsize, rows=key.rows,
        num_splits=key.num_splits, sm_count=key.device.sm_count if is_cuda else None,
        max_split=max_split)]


class _Scratch:
    """Random, self-consistent inputs of the key's shape on ``device``."""

    def __init__(self, key, device: torch.device, copies: int, seed: int = 0):
        from ..reference import random_partials

        # Made on the device itself: building large scratch sets on the host
        # would dominate the first-use tuning time.
        g = torch.Generator(device).manual_seed(seed)
        self.key = key
        self.sets = []
        for _ in range(copies):
            o, stats = random_partials(key.num_splits, key.rows, key.head_dim,
                                       stats_format=key.stats_format, generator=g)
            out = torch.empty(key.rows, key.head_dim, dtype=_DTYPES[key.out_dtype], device=device)
            self.sets.append((o.to(device, _DTYPES[key.partial_dtype]), stats.to(device), out))

    def run(self, candidate: Candidate, index: int = 0) -> torch.Tensor:
        from .. import merge

        o, stats, out = self.sets[index % len(self.sets)]
        # exact=True: measure the K that is recorded, whatever KVSPLIT_* says.
        if self.key.stats_format == "maxsum":
            merge._launch(merge.MAXSUM, o, stats, None, None, out, None, 1.0, merge._LN2,
                          candidate.kv_split, fresh_out=True, exact=True)
        else:
            merge._launch(merge.LSE, o, stats, None, None, out, None, 1.0, 1.0,
                          candidate.kv_split, fresh_out=True, exact=True)
        return out


def _copies_for_cold(key, l2_bytes: int) -> int:
    per_set = key.num_splits * key.rows * key.head_dim * _DTYPES[key.partial_dtype].itemsize
    return max(2, min(64, math.ceil(4 * l2_bytes / max(per_set, 1))))


def pick_winner(timings: dict[Candidate, Timing], noise_margin: float) -> Candidate:
    """Fastest median; a smaller kv_split within ``noise_margin`` of it wins instead."""
    best = min(timings.values(), key=lambda t: t.median_us).median_us
    return min(c for c, t in timings.items() if t.median_us <= best * (1.0 + noise_margin))


def tune(key, device: torch.device, *, l2_state: str = "warm", noise_margin: float = NOISE_MARGIN,
         max_split: int | None = None, batch: int = 12, replays: int = 7) -> TuningRecord:
    """Profile every valid config for ``key`` on ``device``; return the record (not stored)."""
    is_cuda = device.type == "cuda"
    copies = 1
    if l2_state == "cold" and is_cuda:
        copies = _copies_for_cold(key, torch.cuda.get_device_properties(device).L2_cache_size)
    with torch.cuda.device(device) if is_cuda else contextlib.nullcontext():
        scratch = _Scratch(key, device, copies)
        reference = scratch.run(Candidate(1)).float().clone()
        timings: dict[Candidate, Timing] = {}
        results = []
        for candidate in candidates(key, max_split=max_split, is_cuda=is_cuda):
            got = scratch.run(candidate).float()
            error = ((got - reference).norm() / reference.norm().clamp_min(1e-30)).item()
            matched = math.isfinite(error) and error <= _MATCH_TOLERANCE
            if not matched:
                log.warning("kvsplit: %s disagrees with kv_split=1 for %s (relative error %.3g); "
                            "disqualified", candidate, key.choice_key, error)
            if is_cuda:
                timing = time_cuda_graph(lambda i, c=candidate: scratch.run(c, i),
                                         batch=max(batch, copies), replays=replays)
            else:
                timing = time_host(lambda i, c=candidate: scratch.run(c, i), batch=2,
                                   replays=replays)
            if matched:
                timings[candidate] = timing
            results.append(CandidateResult(config=candidate.to_db(), median_us=timing.median_us,
                                           p10_us=timing.p10_us, p90_us=timing.p90_us,
                                           samples=timing.samples, matched=matched))
    winner = pick_winner(timings, noise_margin)
    return TuningRecord(key=key, winner=winner.to_db(),
                        policy=TuningPolicy(l2_state=l2_state, repeats=replays,
                                            noise_margin=noise_margin),
                        candidates=results, tool_version=tool_version())

