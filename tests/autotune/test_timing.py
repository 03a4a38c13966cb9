"""autotune/timing.py: summaries in microseconds and the host clock used on the CPU."""

from __future__ import annotations

import time

import pytest
import torch

from kvsplit.autotune.timing import Timing, summarize, time_cuda_graph, time_cuda_graphs, time_host
from kvsplit.db.schemas import BASELINE, CandidateResult


def test_summarize_one_sample():
    assert summarize([7.5]) == Timing(7.5, 7.5, 7.5, 1)


def test_summarize_is_order_free_with_deciles_around_the_median():
    samples = [float(v) for v in (9, 1, 5, 3, 7, 2, 8, 4, 6, 10, 11)]
    timing = summarize(samples)
    assert timing == summarize(sorted(samples))
    assert timing.median_us == 6.0 and timing.samples == 11
    assert 1.0 <= timing.p10_us < timing.median_us < timing.p90_us <= 11.0
    assert timing.spread == pytest.approx((timing.p90_us - timing.p10_us) / 6.0)


def test_deciles_of_equal_samples_never_pass_the_median():
    # Interpolating between equal samples rounded this p10 one ulp above the median, which the
    # database's CandidateResult refuses: kvsplit tune lost the key (an H100, an FP8-output
    # key of the coverage grid).
    samples = [1.6892630802957636] * 11
    timing = summarize(samples)
    assert timing.median_us == 1.6892630802957636
    assert timing.p10_us <= timing.median_us <= timing.p90_us
    assert timing.p90_us - timing.p10_us < 1e-15
    CandidateResult(config=BASELINE, median_us=timing.median_us, p10_us=timing.p10_us,
                    p90_us=timing.p90_us, samples=timing.samples, matched=True)


def test_spread_of_a_zero_median_is_zero():
    assert Timing(0.0, 0.0, 0.0, 3).spread == 0.0


def test_time_host_calls_launch_with_indices_and_reports_per_call_microseconds():
    indices = []

    def launch(i):
        indices.append(i)
        time.sleep(0.002)

    timing = time_host(launch, batch=3, replays=4, warmup=2)
    assert indices == [0, 1] + [0, 1, 2] * 4
    assert timing.samples == 4
    assert 2000.0 <= timing.p10_us <= timing.median_us <= timing.p90_us < 200_000.0


@pytest.mark.gpu
def test_time_cuda_graph_replays_a_captured_batch(cuda_device):
    x = torch.zeros(1024, device=cuda_device)
    indices = []

    def launch(i):
        indices.append(i)
        x.add_(1.0)

    timing = time_cuda_graph(launch, batch=4, replays=3, warmup=2)
    torch.cuda.synchronize()
    assert indices == [0, 1] + [0, 1, 2, 3]  # warm-up, then captured once
    assert float(x[0]) == 2 + 4 * (1 + 3)  # the warm-up, one replay before timing, 3 timed
    assert timing.samples == 3 and 0 < timing.median_us < 1e4


@pytest.mark.gpu
def test_time_cuda_graphs_replays_every_batch_in_turns_and_orders_them(cuda_device):
    x = torch.zeros(1024, device=cuda_device)
    calls = []

    def launcher(name, cycles):
        def launch(i):
            calls.append((name, i))
            x.add_(1.0)
            torch.cuda._sleep(cycles)
        return launch

    timings = time_cuda_graphs({"short": launcher("short", 1_000),
                                "long": launcher("long", 200_000)}, batch=3, replays=5, warmup=1)
    torch.cuda.synchronize()
    assert calls == [("short", 0), ("long", 0)] + [("short", i) for i in range(3)] + [
        ("long", i) for i in range(3)]
    # warm-ups, one replay each before timing, then 5 timed rounds of both graphs
    assert float(x[0]) == 2 + 2 * 3 * (1 + 5)
    assert set(timings) == {"short", "long"}
    assert all(t.samples == 5 for t in timings.values())
    assert timings["long"].median_us > 10 * timings["short"].median_us
