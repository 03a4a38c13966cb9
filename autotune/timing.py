"""Timing one kernel launch without measuring the host.

On these GPUs an event-bracketed single launch measures the host's launch
rate (about 3 us), not the kernel. Instead a batch of launches is captured in
one CUDA graph and replayed; the time of a replay divided by the batch is the
per-launch time, close to what the kernel costs inside a decode step's graph.
On the CPU the same interface times calls with a host clock.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Timing:
    """Per-launch times in microseconds over ``samples`` measurements."""

    median_us: float
    p10_us: float
    p90_us: float
    samples: int

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: the relative noise of the measurement."""
        return (self.p90_us - self.p10_us) / self.median_us if self.median_us > 0 else 0.0


def summarize(per_launch_us: list[float]) -> Timing:
    ordered = sorted(per_launch_us)
    n = len(ordered)
    if n == 1:
        return Timing(ordered[0], ordered[0], ordered[0], 1)
    deciles = statistics.quantiles(ordered, n=10, method="inclusive")
    median = statistics.median(ordered)
    # Interpolating between equal samples can round a decile one ulp past the median
    # (eleven samples of 1.6892630802957636 us give a p10 above it).
    return Timing(median, min(deciles[0], median), max(deciles[-1], median), n)


def time_cuda_graph(launch: Callable[[int], None], *, batch: int = 32, replays: int = 15,
                    warmup: int = 2) -> Timing:
    """Per-launch time of ``launch(i)`` captured ``batch`` times in one graph.

    ``launch`` gets the launch index so that it can rotate buffers (L2-cold
    timing); it must enqueue work on the current stream and not synchronize.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(warmup):
            launch(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(batch):
            launch(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / batch)
    del graph
    return summarize(samples)


def time_cuda_graphs(launches: dict, *, batch: int = 12, replays: int = 11,
                     warmup: int = 2, prime: bool = False) -> dict:
    """Per-launch times of several ``launch(i)`` functions, compared fairly.

    Each is captured ``batch`` times in its own graph; the graphs are then
    replayed in turns, ``replays`` rounds, with no host synchronisation until
    the end, so that clock drift or a busy neighbour touches every candidate
    alike and the host's round trips are not paid per sample.
    ``prime`` replays each graph once more, untimed, right before each timed
    replay: a sample then starts from the L2 contents of its own launches,
    not from what the candidate before it left (whose reads the first
    launches of the sample would otherwise pay for).
    Returns ``{key: Timing}`` for the keys of ``launches``.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for launch in launches.values():
            for i in range(warmup):
                launch(i)
    torch.cuda.current_stream().wait_stream(side)
    graphs = {}
    for key, launch in launches.items():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(batch):
                launch(i)
        graph.replay()
        graphs[key] = graph
    marks = {key: [] for key in graphs}
    for _ in range(replays):
        for key, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if prime:
                graph.replay()
            start.record()
            graph.replay()
            end.record()
            marks[key].append((start, end))
    torch.cuda.synchronize()
    timings = {key: summarize([s.elapsed_time(e) * 1000.0 / batch for s, e in pairs])
               for key, pairs in marks.items()}
    del graphs
    return timings


def time_cuda_stream(launch: Callable[[int], None], *, batch: int = 100, replays: int = 5) -> Timing:
    """Per-launch time of back-to-back eager launches (host launch rate included)."""
    launch(0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(replays):
        start.record()
        for i in range(batch):
            launch(i)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / batch)
    return summarize(samples)


def time_host(launch: Callable[[int], None], *, batch: int = 4, replays: int = 9,
              warmup: int = 1) -> Timing:
    """Per-call time of a synchronous (CPU) ``launch(i)`` with a monotonic clock."""
    for i in range(warmup):
        launch(i)
    samples = []
    for _ in range(replays):
        begin = time.perf_counter()
        for i in range(batch):
            launch(i)
        samples.append((time.perf_counter() - begin) * 1e6 / batch)
    return summarize(samples)


def spin_up_gpu(seconds: float = 1.0) -> None:
    """Keep the GPU busy for ``seconds`` so that clocks are up before timing.

    An idle H200 sits at a few hundred MHz; the first milliseconds of a
    benchmark would otherwise measure the ramp.
    """
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
