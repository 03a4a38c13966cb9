"""benchmarks/replay_pruning.py judges a pruning rule by the timings stored with each record."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from kvsplit.autotune.tuner import prune
from kvsplit.db import CandidateResult
from kvsplit.export import read_export
from kvsplit.dispatch.constraints import configs_for_key

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("replay_pruning", ROOT / "benchmarks/replay_pruning.py")
replay_pruning = importlib.util.module_from_spec(spec)
spec.loader.exec_module(replay_pruning)

SHIPPED = ROOT / "kvsplit/tables/nvidia-h200.json"


def test_a_dropped_candidate_that_was_fastest_is_the_regret():
    """A stored candidate that prune() drops, made twice as fast as the best kept one: regret
    100 %. (The shipped tables hold only candidates the present rule keeps, so one is added.)"""
    record = read_export(SHIPPED)[0]
    kept = set(prune(configs_for_key(record.key, is_cuda=True), record.key))
    dropped = next(c for c in configs_for_key(record.key, is_cuda=True) if c not in kept)
    record.candidates = [c for c in record.candidates if c.config in kept]
    best = min(c.median_us for c in record.candidates if c.matched)
    untouched = replay_pruning.replay([record])
    assert untouched["regrets"] == [pytest.approx(0.0)]
    record.candidates.append(CandidateResult(config=dropped, median_us=best / 2, p10_us=best / 2,
                                             p90_us=best / 2, samples=9, matched=True))
    result = replay_pruning.replay([record])
    assert result["records"] == 1 and result["unknown"] == untouched["unknown"]
    assert result["regrets"] == [pytest.approx(best / (best / 2) - 1.0)]
    assert result["worst"] == (pytest.approx(1.0), record.key)


def test_the_rule_keeps_every_shipped_winner_within_its_candidate_budget():
    """The rule in autotune/tuner.py against the shipped tables: every stored winner is among
    the candidates the rule keeps for its key (a rule that dropped one would give up that
    key's speed), and no key keeps more than 25. (A regret replay of these tables says
    nothing: they were tuned with this rule, so they timed no candidate it drops.)"""
    records = [r for path in sorted(SHIPPED.parent.glob("*.json")) for r in read_export(path)]
    assert records
    for record in records:
        kept = prune(configs_for_key(record.key, is_cuda=True), record.key)
        assert record.winner in kept, (record.key.shape_label, record.winner.label)
        assert len(kept) <= 25, record.key.shape_label
