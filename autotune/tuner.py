"""Profiles the candidate configs of one tuning key and picks the winner.

Scratch tensors of the key's shape are made on the target device (never the
caller's tensors). The candidates are an argument (the dispatch layer's
constraints decide what is valid: both families on a GPU, KvSplit on the
CPU, whose slices are a GPU matter); this module imports no dispatch code. :func:`prune`
drops the ones that measurements on an H200 never saw win before anything is
timed. Every candidate's output is compared with KvSplit K = 1; a mismatch
disqualifies it (and is logged). A candidate that raises (a launch failure)
is recorded as failed (0 samples) and scores inf; the search goes on, and
only a key with no working candidate at all raises :class:`NoWorkingCandidate`.
Times come from CUDA-graph replay on GPUs and from a host clock on the CPU.
The winner is the fastest median, except that a simpler config (fewer groups
per row) within ``noise_margin`` of it wins instead.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch

from .. import _kernel
from ..config import (BASELINE, DSPLIT, DTYPE_BYTES, DTYPE_CODES, FEW, KVSPLIT, MAXSUM_FORMAT,
                      STATS_FORMAT_CODES, KernelConfig, split_stats_format)
from ..db import CandidateResult, TuningPolicy, TuningRecord
from ..export import tool_version
from ..reference import random_partials
from .timing import Timing, time_cuda_graphs, time_host

log = logging.getLogger("kvsplit.autotune")

NOISE_MARGIN = 0.01
_MATCH_TOLERANCE = 1e-2  # relative norm vs kv_split=1: a different summation order only
_DTYPES = {name: getattr(torch, name) for name in DTYPE_CODES}


Candidate = KernelConfig  # what the tuner tries: a kernel family and its parameters


class NoWorkingCandidate(RuntimeError):
    """Every candidate config of a key raised or disagreed with K = 1: nothing to record."""


# Pruning, from a sweep of every config over the benchmark grid on an H200
# (docs/history.md, "Pruning"): the best configs run about 64-128K threads in all,
# give each group at least two partials, and use CTAs of 32-256 threads.
_TARGET_THREADS = 65536


def prune(configs: list[KernelConfig], key) -> list[KernelConfig]:
    """The configs worth timing at ``key``: three group counts K at and below
    the shape's sweet spot; for DSplit, per K the two slice counts whose CTAs
    come closest to 128 threads, and DSplit also at the fewest groups that
    take a row's partials in one 16-deep round, where that is below those Ks.
    Besides, every DSplit config whose item is one warp (lanes x K = 32; they
    run four or eight to a CTA with no barrier). KvSplit K = 1 always stays.
    Each DSplit config is timed at the round depths of :func:`dsplit_depths`.
    Every Few config the constraints offer stays (at most three: 1, 2 or 4
    vectors a thread; only at 16 states or fewer). What each rule was measured
    against, and the candidates a key it leaves: docs/history.md, "Pruning"."""
    vectors = key.head_dim * _DTYPES[key.partial_dtype].itemsize // 16  # per row
    sweet = min(2 * _TARGET_THREADS / (key.rows * vectors), key.num_splits / 2)
    k_hi = 1 << max(0, math.floor(math.log2(max(sweet, 1))))
    # The best DSplit K is mostly one to three halvings below the sweet spot.
    ks = {k_hi, k_hi // 2, k_hi // 4} - {0}
    # DSplit also at the fewest groups that take a row in one 16-deep round, below those.
    one_round = 1 << max(0, math.ceil(math.log2(math.ceil(key.num_splits / 16))))
    dsplit_ks = ks | ({one_round} if one_round < min(ks) else set())
    # Per K, the two slice counts whose CTAs come closest to 128 threads.
    slices = {}
    for k in dsplit_ks:
        options = sorted({c.slices for c in configs if c.family == DSPLIT and c.kv_split == k},
                         key=lambda p: (abs(math.log2(k * vectors / p / 128)), p))
        slices[k] = set(options[:2])
    kept = []
    for c in configs:
        if c.family == FEW:
            kept.append(c)
            continue
        if c.family == KVSPLIT:
            if c.kv_split == 1 or c.kv_split in ks:
                kept.append(c)
            continue
        one_warp = vectors // c.slices * c.kv_split == 32
        if c.depth not in dsplit_depths(math.ceil(key.num_splits / c.kv_split), one_warp):
            continue
        if one_warp or (c.kv_split in dsplit_ks and c.slices in slices[c.kv_split]):
            kept.append(c)
    return kept


def at_shape(key, shape: tuple[int, int] | None):
    """``key`` with the (rows, num_splits) of ``shape`` that it is profiled at, which :func:`prune`
    then judges (``key`` itself for ``None``); ``ValueError`` past the key's own values."""
    if shape is None:
        return key
    rows, num_splits = shape
    if not (0 < rows <= key.rows and 0 < num_splits <= key.num_splits):
        raise ValueError(f"shape (rows={rows}, num_splits={num_splits}) exceeds the key's "
                         f"buckets (rows={key.rows}, num_splits={key.num_splits})")
    return key.model_copy(update={"rows": rows, "num_splits": num_splits})


def dsplit_depths(per_group: int, one_warp: bool = False) -> set[int]:
    """The round depths timed for DSplit groups of ``per_group`` partials.

    8-deep up to 8 partials (and 4-deep as well for items of one warp, whose
    64 registers let more CTAs share an SM); 4-, 8- and 16-deep with 9-16,
    where each depth wins somewhere; 8- and 16-deep past 16, where the 4-deep
    round never won (docs/history.md, "Pruning")."""
    if per_group <= 8:
        return {4, 8} if one_warp else {8}
    return {4, 8, 16} if per_group <= 16 else {8, 16}


def simplicity(config: KernelConfig) -> tuple[int, int, int, int, int]:
    """Order among near-ties: fewer groups per row, then KvSplit, fewer slices, less depth,
    fewer vectors a thread."""
    return (config.kv_split * config.slices, config.family_code, config.slices, config.depth,
            config.vectors)


#: Floats between the stats of adjacent rows in scattered scratch: a 32-byte sector each,
#: as a head-major LSE of 8 or more tokens has them.
SCATTERED_ROW_FLOATS = 8


def scratch_bytes(key) -> int:
    """The most memory a first-use profile of ``key`` (at its own rows and num_splits)
    holds at once: the scratch states (made in float32, then converted), their stats, the
    output and two float32 copies of it (the reference and a candidate's, compared)."""
    stats_format, scattered = split_stats_format(key.stats_format)
    stats_floats = (SCATTERED_ROW_FLOATS if scattered
                    else 2 if stats_format == MAXSUM_FORMAT else 1)
    elements = key.num_splits * key.rows * key.head_dim
    states = elements * (4 + DTYPE_BYTES[key.partial_dtype])
    stats = key.num_splits * key.rows * stats_floats * 4 * 2
    outputs = key.rows * key.head_dim * (DTYPE_BYTES[key.out_dtype] + 8)
    return states + stats + outputs


class _Scratch:
    """Random, self-consistent inputs of the key's shape on ``device``, and a launch per
    candidate."""

    def __init__(self, key, device: torch.device, copies: int, seed: int = 0):
        # Made on the device itself: building large scratch sets on the host
        # would dominate the first-use tuning time.
        g = torch.Generator(device).manual_seed(seed)
        self.key = key
        stats_format, scattered = split_stats_format(key.stats_format)
        self.stats_format = STATS_FORMAT_CODES[stats_format]
        self.maxsum = stats_format == MAXSUM_FORMAT
        self.device = device
        self.sets = []
        for _ in range(copies):
            o, stats = random_partials(key.num_splits, key.rows, key.head_dim,
                                       stats_format=stats_format, generator=g)
            if scattered:  # each row's stats in a 32-byte sector of their own
                spread = torch.empty(key.num_splits, key.rows, SCATTERED_ROW_FLOATS,
                                     device=stats.device)
                width = 2 if self.maxsum else 1
                spread[..., :width] = stats.reshape(key.num_splits, key.rows, width)
                stats = spread[..., :width].squeeze(-1) if width == 1 else spread[..., :2]
            out = torch.empty(key.rows, key.head_dim, dtype=_DTYPES[key.out_dtype], device=device)
            self.sets.append((o.to(device, _DTYPES[key.partial_dtype]),
                              stats if stats.device == device else stats.to(device), out))

    def launch_of(self, candidate: Candidate) -> _kernel.Launch:
        """The launch of ``candidate`` on these sets (the config that is recorded, whatever
        KVSPLIT_* says)."""
        o, stats, out = self.sets[0]
        return _kernel.Launch(candidate, self.stats_format, o, stats, out, None,
                              math.log(2.0) if self.maxsum else 1.0)

    def run(self, launch: _kernel.Launch, index: int = 0) -> torch.Tensor:
        o, stats, out = self.sets[index % len(self.sets)]
        return _kernel.run(launch, o, stats, out, 1.0)


_REPLAY_US = 80.0  # a replay's target length on a GPU (docs/history.md, "First-use time")
_MAX_BATCH = 48  # launches a replay at most (small shapes)


def replay_batch(key) -> int:
    """How many launches each candidate's CUDA graph captures at ``key``: about
    ``_REPLAY_US`` of work at about 3 TB/s and 2 us a launch, few for large shapes (the
    first-use budget), up to ``_MAX_BATCH`` for small ones. A replay shorter than the host's
    turn between two (its events and its ``replay()``) starts only when the host gets there,
    the GPU idle since the start event: the wait lands in its time, up to 0.5 us a launch at
    12 launches of 1.5 us, and differently for each candidate (docs/history.md, "Replays that
    outlast the host's turn")."""
    launch_us = _partial_bytes(key) / 3e6 + 2.0
    return max(2, min(_MAX_BATCH, round(_REPLAY_US / launch_us)))


def _partial_bytes(key) -> int:
    return key.num_splits * key.rows * key.head_dim * _DTYPES[key.partial_dtype].itemsize


def _copies_for_cold(key, l2_bytes: int) -> int:
    per_set = _partial_bytes(key)
    return max(2, min(64, math.ceil(4 * l2_bytes / max(per_set, 1))))


def pick_winner(timings: dict[Candidate, Timing], noise_margin: float) -> Candidate:
    """Fastest median; a simpler config within ``noise_margin`` of it wins instead."""
    best = min(timings.values(), key=lambda t: t.median_us).median_us
    return min((c for c, t in timings.items() if t.median_us <= best * (1.0 + noise_margin)),
               key=simplicity)


def _measure(configs: list[Candidate], scratch: _Scratch, launches: dict, key, *, is_cuda: bool,
             batch: int, replays: int) -> dict[Candidate, Timing]:
    """Timings of the configs that time without raising (the others are left out, and logged)."""
    if is_cuda:  # all candidates replayed in turns: drift touches them alike
        try:
            return time_cuda_graphs({c: (lambda i, made=launches[c]: scratch.run(made, i))
                                     for c in configs},
                                    batch=batch, replays=replays)
        except Exception:  # noqa: BLE001 - find the one that raised: time each alone
            log.debug("kvsplit: timing the candidates together raised; timing each alone")
    measured = {}
    for c in configs:
        try:
            if is_cuda:
                measured[c] = time_cuda_graphs({c: lambda i, made=launches[c]: scratch.run(made, i)},
                                               batch=batch, replays=replays)[c]
            else:
                measured[c] = time_host(lambda i, made=launches[c]: scratch.run(made, i), batch=2,
                                        replays=replays)
        except Exception as error:  # noqa: BLE001 - one failing candidate must not stop the search
            log.warning("kvsplit: %s raised while timed for %s (%s: %s); recorded as failed",
                        c.label, key.choice_key, type(error).__name__, error)
    return measured


def _failed(candidate: Candidate) -> CandidateResult:
    return CandidateResult(config=candidate, median_us=0.0, p10_us=0.0, p90_us=0.0, samples=0,
                           matched=False)


def tune(key, device: torch.device, configs: list[KernelConfig], *, l2_state: str = "warm",
         noise_margin: float = NOISE_MARGIN, batch: int | None = None, replays: int = 11,
         pruned: bool = True, shape: tuple[int, int] | None = None) -> TuningRecord:
    """Profile ``configs`` (pruned on GPUs unless ``pruned=False``) for ``key`` on ``device``;
    return the record (not stored). KvSplit K = 1, the reference, is always timed.

    ``configs`` are the caller's, valid at ``key`` and at ``shape`` (the
    dispatch layer's ``configs_for_key`` gives them). ``shape`` is the (rows,
    num_splits) to profile, at most the key's own values: the call that asked
    for the key, or the values a grid named. By default the key's own values,
    the upper ends of its buckets. The record is keyed by ``key`` either way
    (the best config can change within a bucket: docs/history.md, "Profiling
    a key at the shape that asked for it").

    Raises
    ------
    NoWorkingCandidate
        K = 1 (the reference) raised, or no candidate could be timed.
    ValueError
        ``shape`` exceeds the key's values (or is not positive).
    """
    is_cuda = device.type == "cuda"
    record_key = key
    key = at_shape(key, shape)
    configs = prune(configs, key) if pruned and is_cuda else list(configs)
    if BASELINE not in configs:
        configs.insert(0, BASELINE)
    copies = 1
    if l2_state == "cold" and is_cuda:
        copies = _copies_for_cold(key, torch.cuda.get_device_properties(device).L2_cache_size)
    if batch is None:  # launches a replay (the CPU times calls one by one)
        batch = replay_batch(key) if is_cuda else 2
    with torch.cuda.device(device) if is_cuda else contextlib.nullcontext():
        scratch = _Scratch(key, device, copies)
        try:
            reference = scratch.run(scratch.launch_of(BASELINE)).float().clone()
        except Exception as error:  # noqa: BLE001 - reported to the caller as one clear error
            raise NoWorkingCandidate(f"no candidate config works for {record_key.shape_label}: "
                                     f"kv_split=1, the reference, raised "
                                     f"{type(error).__name__}: {error}") from error
        timings: dict[Candidate, Timing] = {}
        results = []
        matched = {}
        launches = {}
        for candidate in configs:
            try:
                launches[candidate] = scratch.launch_of(candidate)
                got = scratch.run(launches[candidate]).float()
            except Exception as error:  # noqa: BLE001 - one failing candidate must not stop the search
                log.warning("kvsplit: %s raised for %s (%s: %s); recorded as failed",
                            candidate.label, record_key.choice_key, type(error).__name__, error)
                continue
            error = ((got - reference).norm() / reference.norm().clamp_min(1e-30)).item()
            matched[candidate] = math.isfinite(error) and error <= _MATCH_TOLERANCE
            if not matched[candidate]:
                log.warning("kvsplit: %s disagrees with kv_split=1 for %s (relative error %.3g); "
                            "disqualified", candidate.label, record_key.choice_key, error)
        measured = _measure([c for c in configs if c in matched], scratch, launches, key,
                            is_cuda=is_cuda, batch=max(batch, copies), replays=replays)
        for candidate in configs:
            timing = measured.get(candidate)
            if timing is None:  # raised: recorded as failed; it scores inf, so it never wins
                results.append(_failed(candidate))
                continue
            if matched[candidate]:
                timings[candidate] = timing
            results.append(CandidateResult(config=candidate, median_us=timing.median_us,
                                           p10_us=timing.p10_us, p90_us=timing.p90_us,
                                           samples=timing.samples, matched=matched[candidate]))
    if not timings:
        raise NoWorkingCandidate(f"no candidate config works for {record_key.shape_label}: "
                                 f"every one raised or disagreed with kv_split=1")
    winner = pick_winner(timings, noise_margin)
    return TuningRecord(key=record_key, winner=winner,
                        policy=TuningPolicy(l2_state=l2_state, repeats=replays,
                                            noise_margin=noise_margin),
                        candidates=results, tool_version=tool_version())
