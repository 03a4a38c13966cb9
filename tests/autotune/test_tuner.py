"""autotune/tuner.py on the CPU: candidates, the winner rule, matching against K = 1.

The CPU implementation runs the same group merge as the kernel, so tune()
really profiles every K here; only the disqualification tests replace the
clock (to make the corrupted candidate the fastest) and one scratch run.
"""

from __future__ import annotations

import logging
import math
import threading
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsplit import _native
from kvsplit.autotune import tuner
from kvsplit.autotune.timing import Timing
from kvsplit.autotune.tuner import NOISE_MARGIN, pick_winner, prune
from kvsplit.config import build_hash
from kvsplit.db import DeviceInfo, TuningKey, TuningRecord, open_store
from kvsplit.config import KernelConfig
from kvsplit.export import tool_version
from kvsplit.dispatch import dispatcher as dispatch_module
from kvsplit.dispatch.constraints import configs_for_key, kvsplit_config, valid_kv_splits
from kvsplit.dispatch.device import device_facts
from kvsplit.dispatch.keys import device_info

SETTINGS = settings(max_examples=300, deadline=None, database=None)
CPU = torch.device("cpu")
KV_SPLITS = (1, 2, 4, 8, 16)
ELEM_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@pytest.fixture(autouse=True)
def plain_environment(monkeypatch, tmp_path):
    """No KVSPLIT_* overrides (the scratch runs go through the dispatcher) and a private database."""
    for name in ("KVSPLIT_MODE", "KVSPLIT_MAX_SPLIT", "KVSPLIT_PDL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVSPLIT_DB", f"sqlite:///{tmp_path / 'tuning.sqlite'}")
    monkeypatch.setenv("KVSPLIT_PENDING", str(tmp_path / "pending.jsonl"))
    dispatch_module.dispatcher.forget()
    yield
    dispatch_module.dispatcher.forget()


def candidates(key, *, max_split=None, is_cuda=True, pruned=True, shape=None):
    """What the dispatcher hands the tuner: the valid configs (at the key and at the
    profiled shape), pruned on GPUs."""
    configs = configs_for_key(key, is_cuda=is_cuda, max_split=max_split, shape=shape)
    return prune(configs, key) if pruned and is_cuda else configs


def tune(key, device, *, max_split=None, **options):
    return tuner.tune(key, device, candidates(key, max_split=max_split,
                                              is_cuda=device.type == "cuda", pruned=False,
                                              shape=options.get("shape")),
                      **options)


def cpu_key(head_dim=64, num_splits=16, rows=8, *, dtype="bfloat16", stats_format="maxsum"):
    out_dtype = "bfloat16" if dtype == "float32" else dtype
    return TuningKey(device=device_info(device_facts(CPU)), build_hash=build_hash(False),
                     head_dim=head_dim, partial_dtype=dtype, out_dtype=out_dtype,
                     stats_format=stats_format, num_splits=num_splits, rows=rows)


# -- candidates -------------------------------------------------------------------------------

def spec_dsplit(head_dim, elem_bytes, num_splits, max_split):
    """The DSplit rules, written out: 4..32 lanes of 16 bytes per slice, 32..512 threads."""
    configs = []
    for slices in (1, 2, 4, 8, 16):
        lanes, rest = divmod(head_dim * elem_bytes, 16 * slices)
        for k in (1, 2, 4, 8, 16, 32, 64, 128):
            if (not rest and lanes in (4, 8, 16, 32) and 32 <= lanes * k <= 512
                    and k <= num_splits and (max_split is None or k <= max_split)):
                configs += [KernelConfig.dsplit(slices, k, depth) for depth in (4, 8, 16)]
    return configs


def spec_few(head_dim, elem_bytes, num_splits):
    """The Few rules, written out: 1, 2 or 4 vectors of 16 bytes a thread, no step of a row
    empty ((vectors - 1) * ceil(V / vectors) < V); offered up to 16 states."""
    vectors = head_dim * elem_bytes // 16
    return [KernelConfig.few(v) for v in (1, 2, 4)
            if num_splits <= 16 and (v - 1) * -(-vectors // v) < vectors]


@SETTINGS
@given(head_dim=st.sampled_from([16, 32, 64, 128, 256, 512]),
       dtype=st.sampled_from(sorted(ELEM_BYTES)),
       num_splits=st.one_of(st.integers(1, 20), st.integers(1, 2048)),
       rows=st.one_of(st.integers(1, 64), st.integers(1, 2_000_000)), sm_count=st.integers(1, 200),
       is_cuda=st.booleans(), max_split=st.one_of(st.none(), st.integers(1, 32)))
def test_candidates_are_the_valid_configs_of_every_family(head_dim, dtype, num_splits, rows,
                                                          sm_count, is_cuda, max_split):
    key = TuningKey(device=DeviceInfo(name="GPU", cc_major=9, cc_minor=0, sm_count=sm_count),
                    build_hash="b", head_dim=head_dim, partial_dtype=dtype, out_dtype="bfloat16",
                    stats_format="maxsum", num_splits=num_splits, rows=rows)
    everything = candidates(key, max_split=max_split, is_cuda=is_cuda, pruned=False)
    # The KvSplit Ks that the constraints allow (worked cases: tests/dispatch/test_constraints.py).
    expected = [kvsplit_config(k) for k in valid_kv_splits(
        head_dim=head_dim, elem_bytes=ELEM_BYTES[dtype], rows=rows, num_splits=num_splits,
        sm_count=sm_count if is_cuda else None, max_split=max_split)]
    if is_cuda:  # DSplit slices and Few threads are a GPU matter: the CPU tunes KvSplit only
        expected += spec_dsplit(head_dim, ELEM_BYTES[dtype], num_splits, max_split)
        expected += spec_few(head_dim, ELEM_BYTES[dtype], num_splits)
    assert everything == expected
    assert all(KernelConfig(c.family, c.params) == c for c in everything)
    assert len(set(everything)) == len(everything)  # hashable configs
    pruned = candidates(key, max_split=max_split, is_cuda=is_cuda)
    assert kvsplit_config(1) in pruned and set(pruned) <= set(everything)
    if is_cuda:  # few enough to time within the first-use budget
        # every one-warp item, and at most 18 others: K = 1, three Ks of each family and DSplit
        # at the fewest groups that take a row in one 16-deep round; every DSplit config
        # 8-deep up to 8 partials a group (one-warp items 4-deep as well), 4-, 8- and 16-deep
        # with 9-16, 8- and 16-deep past
        def depths(c):
            per_group = -(-num_splits // c.kv_split)
            if per_group <= 8:
                return {4, 8} if one_warp_item(c, head_dim, dtype) else {8}
            return {4, 8, 16} if per_group <= 16 else {8, 16}

        assert all(c.depth in depths(c) for c in pruned if c.family == "dsplit")
        # every Few config: at most three
        few = [c for c in everything if c.family == "few"]
        assert len(few) <= 3 and set(few) <= set(pruned)
        pruned = [c for c in pruned if c.family != "few"]
        one_warp = {c for c in everything if c.family == "dsplit"
                    and one_warp_item(c, head_dim, dtype) and c.depth in depths(c)}
        assert len(one_warp) <= 10 and one_warp <= set(pruned)
        others = [c for c in pruned if c not in one_warp]
        one_round = next(k for k in (1 << i for i in range(12)) if k * 16 >= num_splits)
        ks = {c.kv_split for c in others if c.kv_split > 1}
        extra = {one_round} if len(ks) == 4 else set()
        assert len(ks) <= 4 and (not extra or one_round == min(ks))
        ks -= extra
        assert not ks or max(ks) <= max(1, num_splits // 2)
        # per K of DSplit, at most two slice counts
        for k in {c.kv_split for c in others if c.family == "dsplit"}:
            assert len({c.slices for c in others if c.family == "dsplit" and c.kv_split == k}) <= 2
        assert len(others) <= 18
    else:
        assert pruned == everything


def one_warp_item(config, head_dim, dtype):
    """Whether a DSplit config's item is one warp: lanes (16-byte vectors per slice) x K = 32."""
    return head_dim * ELEM_BYTES[dtype] // 16 // config.slices * config.kv_split == 32


@pytest.mark.parametrize("head_dim, rows, num_splits, kept", [
    # (D, rows, N) -> the fastest config of every valid one at that shape, bf16 maxsum, in
    # benchmarks/bench_dispatch.py on the H200 (8- and 16-deep kernels of up to 128 registers)
    (512, 64, 132, KernelConfig.dsplit(2, 8, 8)),  # two halvings below the sweet spot
    (512, 64, 264, KernelConfig.dsplit(2, 8, 16)),
    (512, 128, 16, KernelConfig.dsplit(2, 1, 16)),  # one-warp items, a 16-deep round
    (512, 128, 64, KernelConfig.dsplit(4, 2, 16)),
    (512, 512, 132, KernelConfig.dsplit(4, 2, 16)),
    (512, 300, 200, KernelConfig.dsplit(2, 4, 8)),  # 8-deep past 16 partials a group
    (512, 1000, 48, KernelConfig.dsplit(2, 1, 16)),
    (128, 32, 16, KernelConfig.dsplit(2, 4, 8)),  # 8-deep at 4 partials a group
    (128, 2048, 16, KernelConfig.dsplit(1, 2, 4)),  # one-warp items 4-deep at 8 partials
    (128, 32, 64, KernelConfig.dsplit(2, 16, 8)),
    (128, 256, 264, KernelConfig.dsplit(1, 16, 16)),
    (128, 1000, 100, KernelConfig.dsplit(1, 2, 16)),
    (512, 40, 20, KernelConfig.dsplit(8, 4, 8)),
    (512, 2048, 32, kvsplit_config(1)),
    (128, 2048, 32, kvsplit_config(4)),
    (128, 32, 264, KernelConfig.dsplit(2, 32, 8)),  # 1 % behind P2xK16d16, which is not timed
])
def test_pruning_keeps_the_measured_winners(head_dim, rows, num_splits, kept):
    key = TuningKey(device=DeviceInfo(name="NVIDIA H200", cc_major=9, cc_minor=0, sm_count=132),
                    build_hash="b", head_dim=head_dim, partial_dtype="bfloat16",
                    out_dtype="bfloat16", stats_format="maxsum", num_splits=num_splits, rows=rows)
    pruned = candidates(key)
    assert kept in pruned
    assert len(pruned) <= 25 and len(pruned) <= len(candidates(key, pruned=False)) / 2


@pytest.mark.parametrize("rows, num_splits, head_dim, low, high", [
    (8, 2, 128, 36, 48),        # one token, 8 KB: about 80 us of 2 us launches
    (32, 16, 512, 34, 48),      # 0.5 MB: still small launches
    (4096, 2, 128, 20, 30),     # 3 MB: 3 us a launch
    (4096, 16, 512, 2, 3),      # 64 MB: 24 us a launch
    (16384, 64, 576, 2, 2),     # 1.2 GB: never fewer than two
])
def test_a_replay_is_about_80_us_of_launches(rows, num_splits, head_dim, low, high):
    # Replays of small launches must outlast the host's turn between two (12 launches of 1.5 us
    # did not), large ones must stay within the first-use budget.
    key = cpu_key(head_dim, num_splits, rows)
    assert low <= tuner.replay_batch(key) <= high


# -- the winner rule --------------------------------------------------------------------------

def timings(**medians):
    """{kvsplit_config(K): Timing} from k1=..., k2=... medians in microseconds (spread +-5 %)."""
    return {kvsplit_config(int(name[1:])): Timing(m, 0.95 * m, 1.05 * m, 9) for name, m in medians.items()}


@pytest.mark.parametrize("medians, margin, winner", [
    (dict(k1=10.0, k2=8.0, k4=5.0, k8=6.0), 0.02, 4),      # fastest median
    (dict(k1=10.0, k2=5.05, k4=5.0), 0.02, 2),              # 1 % slower, smaller: wins
    (dict(k1=5.2, k2=5.09, k4=5.0), 0.02, 2),               # the smallest within the margin
    (dict(k1=5.05, k2=5.04, k4=5.0), 0.02, 1),
    (dict(k2=5.2, k4=5.0), 0.02, 4),                        # 4 % slower: loses
    (dict(k2=5.2, k4=5.0), 0.05, 2),                        # ... unless the margin is wider
    (dict(k1=5.0, k16=5.0), 0.0, 1),                        # a tie goes to the smaller K
    (dict(k2=5.01, k16=5.0), 0.0, 16),                      # no margin: strictly the fastest
    (dict(k1=5.0, k8=5.05), 0.02, 1),                       # a larger K never wins by the margin
    (dict(k8=3.0), 0.02, 8),
])
def test_pick_winner(medians, margin, winner):
    assert pick_winner(timings(**medians), margin) == kvsplit_config(winner)


def test_pick_winner_compares_medians_not_best_samples():
    noisy_but_slow = Timing(5.0, 1.0, 9.0, 9)
    steady = Timing(4.0, 3.9, 4.1, 9)
    assert pick_winner({kvsplit_config(1): noisy_but_slow, kvsplit_config(2): steady}, 0.02) == kvsplit_config(2)


@SETTINGS
@given(st.dictionaries(st.sampled_from(KV_SPLITS), st.floats(0.1, 1000.0), min_size=1),
       st.floats(0.0, 0.2))
def test_pick_winner_is_the_smallest_k_within_the_margin_of_the_fastest(medians, margin):
    table = {kvsplit_config(k): Timing(m, m, m, 1) for k, m in medians.items()}
    winner = pick_winner(table, margin)
    best = min(medians.values())
    assert winner.kv_split in medians
    assert medians[winner.kv_split] <= best * (1 + margin)
    assert all(medians[k] > best * (1 + margin) for k in medians if k < winner.kv_split)


# -- tune() on the CPU ------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("stats_format", ["maxsum", "lse"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_tune_profiles_every_valid_kv_split(head_dim, stats_format, dtype, tmp_path):
    key = cpu_key(head_dim, 16, 8, dtype=dtype, stats_format=stats_format)
    record = tune(key, CPU, replays=5)
    assert isinstance(record, TuningRecord) and record.key == key
    measured = [c.config for c in record.candidates]
    assert sorted(measured, key=lambda c: c.kv_split) == candidates(key, is_cuda=False)
    assert len(measured) == 5  # 1..16: the CPU has no grid budget
    assert all(c.matched for c in record.candidates)
    for c in record.candidates:
        assert c.samples == 5 and 0 < c.p10_us <= c.median_us <= c.p90_us
    assert record.winner in measured
    assert record.policy.l2_state == "warm" and record.policy.noise_margin == NOISE_MARGIN
    assert record.policy.repeats == 5
    assert record.tool_version == tool_version()
    assert record.speedup is not None and record.speedup >= 1.0
    # The winner follows the rule from the recorded measurements.
    recorded = {kvsplit_config(c.config.kv_split): Timing(c.median_us, c.p10_us, c.p90_us, c.samples)
                for c in record.candidates}
    assert pick_winner(recorded, record.policy.noise_margin) == record.winner
    # And the record is what the database accepts and gives back.
    with open_store(f"sqlite:///{tmp_path / 'db.sqlite'}") as store:
        store.upsert(record)
        back = store.get(key)
    assert back.winner == record.winner and back.candidates == record.candidates


def test_tune_records_its_policy_and_respects_max_split():
    key = cpu_key(128, 32, 16)
    record = tune(key, CPU, l2_state="cold", noise_margin=0.1, max_split=4, replays=3)
    assert [c.config.kv_split for c in record.candidates] == [1, 2, 4]
    assert record.policy.l2_state == "cold" and record.policy.noise_margin == 0.1
    assert record.policy.repeats == 3
    assert record.winner.kv_split in (1, 2, 4)


def test_tune_profiles_the_shape_it_is_given_under_the_key(monkeypatch):
    """``shape`` sets the scratch that is timed (rows, num_splits); the record keeps the key."""
    made = []
    real = tuner.random_partials

    def spy(num_splits, rows, head_dim, **kwargs):
        made.append((rows, num_splits))
        return real(num_splits, rows, head_dim, **kwargs)

    monkeypatch.setattr(tuner, "random_partials", spy)
    key = cpu_key(64, 16, 40)
    record = tune(key, CPU, replays=3, shape=(33, 13))
    assert made == [(33, 13)] and record.key == key
    assert {c.config.kv_split for c in record.candidates} == {1, 2, 4, 8}  # K <= 13 partials
    tune(key, CPU, replays=3)
    assert made[-1] == (40, 16)  # by default, the key's own values
    for bad in ((41, 16), (40, 17), (0, 16)):
        with pytest.raises(ValueError, match="exceeds the key's buckets"):
            tune(key, CPU, replays=3, shape=bad)


def test_tune_measures_the_kv_split_it_records_whatever_the_environment(monkeypatch):
    """The scratch runs must run the K being measured.

    KVSPLIT_MAX_SPLIT, left set in the shell of ``kvsplit tune``, caps what the
    dispatcher hands to callers; were the tuner's runs capped too, every
    candidate would run as K = 1 while the record says K = 2, 4, 8, 16 were
    measured. The spy sits on the kernel entry point, below any dispatch.
    """
    ext = _native.ext()
    ran: list[int] = []

    def merge_cpu(launch, *args):
        ran.append(launch.config.kv_split)
        return ext.merge_cpu(launch, *args)

    monkeypatch.setattr(tuner._kernel, "merge_cpu", merge_cpu)
    monkeypatch.setenv("KVSPLIT_MAX_SPLIT", "1")
    record = tune(cpu_key(64, 16, 8), CPU, replays=3)
    recorded = {c.config.kv_split for c in record.candidates}
    assert recorded == {1, 2, 4, 8, 16}
    assert set(ran) == recorded, f"ran {sorted(set(ran))}, recorded {sorted(recorded)}"


# -- disqualification -------------------------------------------------------------------------

FAKE_MEDIANS = {1: 10.0, 2: 9.0, 4: 1.0, 8: 8.0, 16: 7.0}  # K = 4 is by far the fastest


@pytest.fixture
def rigged(monkeypatch):
    """Clock replaced by FAKE_MEDIANS; ``rigged.corrupt[K] = fn`` spoils K's output in place."""
    state = threading.local()
    corrupt: dict = {}
    real_run = tuner._Scratch.run

    def run(self, launch, index=0):
        out = real_run(self, launch, index)
        state.last = launch.config.kv_split
        if launch.config.kv_split in corrupt:
            corrupt[launch.config.kv_split](out)
        return out

    def fake_clock(launch, **kwargs):
        launch(0)
        median = FAKE_MEDIANS[state.last]
        return Timing(median, 0.9 * median, 1.1 * median, 9)

    monkeypatch.setattr(tuner._Scratch, "run", run)
    monkeypatch.setattr(tuner, "time_host", fake_clock)
    return corrupt


def test_rigged_clock_makes_kv_split_4_win(rigged):
    record = tune(cpu_key(64, 16, 8), CPU)
    assert record.winner == KernelConfig.kvsplit(4)
    assert all(c.matched for c in record.candidates)


CORRUPTIONS = {
    "scaled": lambda out: out.mul_(1.05),
    "one row zeroed": lambda out: out[0].zero_(),
    "nan": lambda out: out[1, 3].fill_(math.nan),
    "inf": lambda out: out[2].fill_(math.inf),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
@pytest.mark.parametrize("stats_format", ["maxsum", "lse"])
def test_a_candidate_that_disagrees_with_k1_is_disqualified_and_logged(rigged, caplog, tmp_path,
                                                                      corruption, stats_format):
    rigged[4] = CORRUPTIONS[corruption]
    key = cpu_key(64, 16, 8, stats_format=stats_format)
    with caplog.at_level(logging.WARNING, logger="kvsplit.autotune"):
        record = tune(key, CPU)
    assert record.winner == KernelConfig.kvsplit(16)  # the fastest that matched
    matched = {c.config.kv_split: c.matched for c in record.candidates}
    assert matched == {1: True, 2: True, 4: False, 8: True, 16: True}
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "kv_split=4" in warnings[0].getMessage() and "disqualified" in warnings[0].getMessage()
    with open_store(f"sqlite:///{tmp_path / 'db.sqlite'}") as store:
        store.upsert(record)
        assert store.get(key).candidate(KernelConfig.kvsplit(4)).matched is False


def test_when_every_k_above_1_disagrees_k1_wins(rigged):
    for k in (2, 4, 8, 16):
        rigged[k] = CORRUPTIONS["scaled"]
    record = tune(cpu_key(64, 16, 8), CPU)
    assert record.winner == KernelConfig.kvsplit(1)
    assert [c.config.kv_split for c in record.candidates if c.matched] == [1]


@pytest.mark.parametrize("medians, winner", [
    ({kvsplit_config(8): 5.05, KernelConfig.dsplit(4, 16): 5.0}, kvsplit_config(8)),   # fewer groups
    ({kvsplit_config(8): 6.0, KernelConfig.dsplit(4, 16): 5.0}, KernelConfig.dsplit(4, 16)),
    ({kvsplit_config(8): 5.0, KernelConfig.dsplit(2, 4): 5.0}, kvsplit_config(8)),      # 8 groups each
    ({KernelConfig.dsplit(4, 4): 5.08, KernelConfig.dsplit(2, 16): 5.0}, KernelConfig.dsplit(4, 4)),
    ({KernelConfig.dsplit(2, 8): 5.0, KernelConfig.dsplit(4, 4): 5.0}, KernelConfig.dsplit(2, 8)),  # fewer slices
    ({KernelConfig.dsplit(2, 8, 8): 5.0, KernelConfig.dsplit(2, 8, 4): 5.05}, KernelConfig.dsplit(2, 8, 4)),
])
def test_pick_winner_prefers_the_simpler_config_among_near_ties(medians, winner):
    table = {c: Timing(m, m, m, 1) for c, m in medians.items()}
    assert pick_winner(table, 0.02) == winner


# -- a candidate that raises ------------------------------------------------------------------

@pytest.fixture
def raising(monkeypatch):
    """``raising.ks`` = the K whose scratch runs raise, as a launch failure would."""
    state = SimpleNamespace(ks=set())
    real_run = tuner._Scratch.run

    def run(self, launch, index=0):
        if launch.config.kv_split in state.ks:
            raise RuntimeError(f"launch failed for kv_split={launch.config.kv_split}")
        return real_run(self, launch, index)

    monkeypatch.setattr(tuner._Scratch, "run", run)
    return state


def test_a_candidate_that_raises_is_recorded_as_failed_and_the_search_goes_on(raising, caplog, tmp_path):
    raising.ks = {4}
    key = cpu_key(64, 16, 8)
    with caplog.at_level(logging.WARNING, logger="kvsplit.autotune"):
        record = tune(key, CPU, replays=3)
    failed = record.candidate(KernelConfig.kvsplit(4))
    assert failed.failed and not failed.matched and failed.median_us == 0.0
    assert record.winner != KernelConfig.kvsplit(4)
    assert [c.config.kv_split for c in record.candidates if not c.failed] == [1, 2, 8, 16]
    assert any("kv_split=4" in r.getMessage() and "raised" in r.getMessage() for r in caplog.records)
    with open_store(f"sqlite:///{tmp_path / 'db.sqlite'}") as store:  # and the database takes it
        store.upsert(record)
        assert store.get(key).candidate(KernelConfig.kvsplit(4)).failed


def test_a_candidate_that_raises_only_while_timed_is_recorded_as_failed(monkeypatch):
    real_time_host = tuner.time_host
    calls = []

    def time_host(launch, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second candidate timed (K = 2)
            raise RuntimeError("launch failed")
        return real_time_host(launch, **kwargs)

    monkeypatch.setattr(tuner, "time_host", time_host)
    record = tune(cpu_key(64, 16, 8), CPU, replays=3)
    assert [c.config.kv_split for c in record.candidates if c.failed] == [2]
    assert record.winner != KernelConfig.kvsplit(2)


def test_a_key_whose_reference_raises_has_no_working_candidate(raising):
    raising.ks = {1, 2, 4, 8, 16}
    with pytest.raises(tuner.NoWorkingCandidate, match="kv_split=1, the reference, raised RuntimeError"):
        tune(cpu_key(64, 16, 8), CPU, replays=3)
