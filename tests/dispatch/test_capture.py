"""First use of a shape inside CUDA-graph capture (dispatcher.py step 5).

Profiling is not allowed while a stream captures: a miss in ``auto`` mode is
served by the heuristic (after the constraints), nothing is cached, and the
key is recorded as pending, in memory and in the ``KVSPLIT_PENDING`` file.
The next uncaptured call of the shape tunes it and drops it from memory.
"""

from __future__ import annotations

import pytest
import torch

import kvsplit
from kvsplit.dispatch import dispatcher as dispatch_module
from kvsplit.dispatch import pending
from kvsplit.dispatch.constraints import KVSPLIT, constrain
from kvsplit.dispatch.device import device_facts

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("isolated")]

# Not in any shipped table (head_dim 64), and the shipped tables are emptied anyway.
HEAD_DIM, NUM_SPLITS, ROWS = 64, 24, 48


@pytest.fixture
def no_shipped_tables(monkeypatch, cuda_device):
    facts = device_facts(torch.device(cuda_device))
    monkeypatch.setattr(dispatch_module, "_SHIPPED", {facts: {}})
    return facts


@pytest.fixture
def problem(merge_kit, cuda_device):
    """Static CUDA inputs of the test shape and a way to refill them with fresh partials."""

    class Problem:
        def __init__(self):
            self.partial_o = torch.empty(NUM_SPLITS, ROWS, HEAD_DIM, dtype=torch.bfloat16,
                                         device=cuda_device)
            self.stats = torch.empty(NUM_SPLITS, ROWS, 2, dtype=torch.float32, device=cuda_device)
            self.scale = 0.7

        def refill(self, seed):
            gen = merge_kit.generator("capture", seed)
            partial_o, stats = merge_kit.partials("maxsum", NUM_SPLITS, ROWS, HEAD_DIM,
                                                  torch.bfloat16, gen)
            self.partial_o.copy_(partial_o)
            self.stats.copy_(stats)
            return merge_kit.reference("maxsum", partial_o, stats, scale=self.scale)

        def merge(self):
            return kvsplit.merge_maxsum(self.partial_o, self.stats, self.scale, return_stats=True)

    return Problem()


def capture(problem):
    """Captures one merge (kv_split=None) in a CUDA graph; returns (graph, out, out_stats)."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, out_stats = problem.merge()
    return graph, out, out_stats


def test_capture_miss_uses_the_heuristic_and_records_the_key_as_pending(
        problem, no_shipped_tables, tuner_calls, kernel_ks, keys, isolated, merge_kit):
    facts = no_shipped_tables
    key = keys.key_for(HEAD_DIM, NUM_SPLITS, ROWS, device="cuda")
    expected = constrain(dispatch_module.heuristic(NUM_SPLITS), head_dim=HEAD_DIM, elem_bytes=2,
                         rows=ROWS, num_splits=NUM_SPLITS, sm_count=facts.sm_count)
    assert expected == 4

    problem.refill(0)
    graph, out, out_stats = capture(problem)
    assert tuner_calls.keys == []
    assert kernel_ks.ks == [expected]
    explain = (facts, HEAD_DIM, torch.bfloat16, torch.bfloat16, 0, NUM_SPLITS, ROWS)
    assert dispatch_module.dispatcher.explain(*explain) is None  # a capture decision is not cached
    assert key in pending._keys
    assert pending.load() == [key]

    # A second capture of the same shape: the heuristic again, the key written once.
    second, out2, out_stats2 = capture(problem)
    assert tuner_calls.keys == [] and kernel_ks.ks == [expected, expected]
    assert len(isolated.pending_path.read_text().splitlines()) == 1

    # Both graphs replay correctly, on inputs that changed after capture.
    ref = problem.refill(1)
    graph.replay()
    second.replay()
    torch.cuda.synchronize()
    merge_kit.assert_matches_reference(out, out_stats, *ref)
    merge_kit.assert_matches_reference(out2, out_stats2, *ref)

    # The next uncaptured call of the shape profiles it, and it is pending no more.
    ref = problem.refill(2)
    out3, out_stats3 = problem.merge()
    torch.cuda.synchronize()
    merge_kit.assert_matches_reference(out3, out_stats3, *ref)
    assert tuner_calls.keys == [key]
    decision = dispatch_module.dispatcher.explain(*explain)
    # kernel_ks records a KvSplit config as its K, any other config as itself.
    ran = decision.config.kv_split if decision.config.family == KVSPLIT else decision.config
    assert decision.source == "tuned" and kernel_ks.ks[-1] == ran
    assert key not in pending._keys


def test_capture_of_a_tuned_shape_uses_the_cached_choice(
        problem, no_shipped_tables, tuner_calls, kernel_ks, keys, merge_kit):
    problem.refill(0)
    problem.merge()
    torch.cuda.synchronize()
    assert len(tuner_calls.keys) == 1
    tuned = kernel_ks.ks[-1]

    graph, out, out_stats = capture(problem)
    assert kernel_ks.ks[-1] == tuned and len(tuner_calls.keys) == 1
    assert pending.load() == [] and not pending._keys
    ref = problem.refill(1)
    graph.replay()
    torch.cuda.synchronize()
    merge_kit.assert_matches_reference(out, out_stats, *ref)
