"""dispatch/dispatcher.py through kvsplit.merge_maxsum on the CPU.

Order of the slow path: forced K -> KVSPLIT_MODE -> tuning database ->
shipped tables -> tune at first use (``auto``) or the heuristic (``cached``);
the constraints have the last word whatever the source. After the first call
of a shape, a call is one dictionary lookup.

Every test runs on an empty database of its own (``isolated``); ``call`` runs
one merge, checks it against the float64 reference and returns the K the
kernel ran with and the dispatcher's Decision. On the CPU the constraints are
(a) the cap, (b) a group of 512 / K threads holds a row, (d) K <= num_splits.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import kvsplit
from kvsplit.autotune import tuner
from kvsplit.config import KernelConfig, build_hash
from kvsplit.db import CandidateResult, DbWarning, DeviceInfo, TuningPolicy, TuningRecord, open_store
from kvsplit.export import dump_export, make_export
from kvsplit.dispatch import dispatcher as dispatch_module
from kvsplit.dispatch import pending
from kvsplit.dispatch.constraints import (DSPLIT, FEW, KV_SPLITS, constrain, kvsplit_config,
                                          valid_kv_splits)
from kvsplit.dispatch.device import DeviceFacts, device_facts
from kvsplit.dispatch.keys import tuning_key

pytestmark = pytest.mark.usefixtures("isolated")

CPU_FACTS = device_facts(torch.device("cpu"))


def spec_heuristic(num_splits: int) -> int:
    """dispatcher.heuristic's documented rule: about one batch of 4 partials per group."""
    return max(k for k in KV_SPLITS if k <= max(1, num_splits // 4))


@pytest.mark.parametrize("num_splits", [1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64, 65, 1024])
def test_heuristic_gives_each_group_about_four_partials(num_splits):
    assert dispatch_module.heuristic(num_splits) == spec_heuristic(num_splits)


# -- modes ------------------------------------------------------------------------------------

@pytest.mark.usefixtures("no_tuning")
def test_mode_off_runs_kv_split_1(monkeypatch, call):
    monkeypatch.setenv("KVSPLIT_MODE", "off")
    k, decision = call(num_splits=32, rows=8)
    assert k == 1 and decision.config.kv_split == 1 and decision.source == "mode"


@pytest.mark.usefixtures("no_tuning")
@pytest.mark.parametrize("mode", ["1", "2", "4", "8", "16"])
def test_fixed_mode_runs_that_kv_split(monkeypatch, call, mode):
    monkeypatch.setenv("KVSPLIT_MODE", mode)
    k, decision = call(num_splits=32, rows=8)
    assert k == int(mode) and decision.source == "mode"


@pytest.mark.usefixtures("no_tuning")
def test_fixed_mode_is_still_constrained(monkeypatch, call, merge_kit):
    monkeypatch.setenv("KVSPLIT_MODE", "16")
    assert call(num_splits=4, rows=8)[0] == 4  # (d) K <= num_splits
    k, _ = call(head_dim=512, num_splits=32, rows=8)  # (b) 32 threads cannot hold 1 KiB
    assert k == merge_kit.expected_kv_split(16, head_dim=512, elem_bytes=2, rows=8, num_splits=32) == 8


@pytest.mark.usefixtures("no_tuning")
def test_cached_mode_miss_uses_the_heuristic_and_stores_nothing(monkeypatch, call, isolated, keys):
    monkeypatch.setenv("KVSPLIT_MODE", "cached")
    k, decision = call(num_splits=20, rows=8)
    assert decision.source == "heuristic"
    assert k == decision.config.kv_split == spec_heuristic(20) == 4
    # A heuristic that the constraints cut down: head_dim 512 bf16 holds K <= 8.
    assert call(head_dim=512, num_splits=64, rows=8)[0] == 8
    with open_store(isolated.url) as store:
        assert store.query() == []
        assert store.get(keys.key_for(64, 20, 8)) is None


@pytest.mark.usefixtures("no_tuning")
def test_cached_mode_uses_a_stored_choice(monkeypatch, call, isolated, keys):
    keys.store_winner(isolated.url, keys.key_for(64, 20, 8), 2)
    monkeypatch.setenv("KVSPLIT_MODE", "cached")
    k, decision = call(num_splits=20, rows=8)
    assert (k, decision.source) == (2, "database")  # the heuristic would say 4


def test_auto_tunes_once_then_a_call_is_a_dictionary_hit(monkeypatch, call, tuner_calls, isolated,
                                                          keys):
    k, decision = call(num_splits=16, rows=8)
    assert decision.source == "tuned" and len(tuner_calls.keys) == 1
    key = keys.key_for(64, 16, 8)
    assert tuner_calls.keys == [key] and decision.key == key
    record = decision.record
    assert record.key == key and k == record.winner.kv_split
    with open_store(isolated.url) as store:
        assert store.get(key).winner == record.winner  # stored for other processes

    # From now on: no tuning, no slow path, no database.
    def broken(*args, **kwargs):
        raise AssertionError("the second call of a shape must be a dictionary lookup")

    the_dispatcher = dispatch_module.dispatcher
    for name in ("_slow", "_lookup", "_tune", "_table", "_open_store"):
        monkeypatch.setattr(the_dispatcher, name, broken)
    monkeypatch.setattr(the_dispatcher, "_store", None)
    monkeypatch.setattr(tuner, "tune", broken)
    monkeypatch.setattr("kvsplit.db.open_store_for_library", broken)
    again, decision_again = call(num_splits=16, rows=8, seed=1)
    assert again == k
    assert decision_again.source == "tuned" and decision_again.record == record
    assert len(tuner_calls.keys) == 1


def test_first_use_profiles_the_calls_own_shape(monkeypatch, call, keys):
    """The key is the bucket (rows 9 -> 10, num_splits 13 -> 16); the tuner times the call's shape."""
    seen = []
    real = tuner.tune

    def spy(key, device, **kwargs):
        seen.append((key, kwargs.get("shape")))
        return real(key, device, **kwargs)

    monkeypatch.setattr(tuner, "tune", spy)
    _, decision = call(num_splits=13, rows=9)
    assert decision.source == "tuned"
    assert seen == [(keys.key_for(64, 16, 10), (9, 13))] and decision.record.key == seen[0][0]


def test_invalid_mode_is_a_value_error_naming_the_variable(monkeypatch, merge_kit):
    gen = merge_kit.generator("bad mode")
    partial_o, stats = merge_kit.partials("maxsum", 8, 4, 64, torch.bfloat16, gen)
    out = torch.full((4, 64), 7.0, dtype=torch.bfloat16)
    for bad in ("fast", "3", "32", "0", "-1", "AUTO", " auto"):
        monkeypatch.setenv("KVSPLIT_MODE", bad)
        with pytest.raises(ValueError, match="KVSPLIT_MODE"):
            kvsplit.merge_maxsum(partial_o, stats, 1.0, out=out)
        assert (out == 7.0).all(), "nothing may be written before the error"


def test_invalid_max_split_is_a_value_error_naming_the_variable(monkeypatch, merge_kit):
    gen = merge_kit.generator("bad max split")
    partial_o, stats = merge_kit.partials("maxsum", 8, 4, 64, torch.bfloat16, gen)
    for bad in ("two", "1.5", "4x"):
        monkeypatch.setenv("KVSPLIT_MAX_SPLIT", bad)
        with pytest.raises(ValueError, match="KVSPLIT_MAX_SPLIT"):
            kvsplit.merge_maxsum(partial_o, stats, 1.0, kv_split=4)


@pytest.mark.usefixtures("no_tuning")
def test_max_split_caps_forced_mode_and_stored_choices(monkeypatch, call, isolated, keys):
    keys.store_winner(isolated.url, keys.key_for(64, 32, 8), 16)
    monkeypatch.setenv("KVSPLIT_MAX_SPLIT", "2")
    assert call(num_splits=32, rows=8, kv_split=16)[0] == 2
    k, decision = call(num_splits=32, rows=8)
    assert (k, decision.source) == (2, "database")
    monkeypatch.setenv("KVSPLIT_MODE", "8")
    assert call(num_splits=32, rows=8)[0] == 2
    monkeypatch.setenv("KVSPLIT_MAX_SPLIT", "4")  # the cache follows the variable
    assert call(num_splits=32, rows=8)[0] == 4
    monkeypatch.delenv("KVSPLIT_MODE")
    assert call(num_splits=32, rows=8)[0] == 4
    monkeypatch.delenv("KVSPLIT_MAX_SPLIT")
    assert call(num_splits=32, rows=8)[0] == 16


def test_max_split_does_not_leak_into_the_shared_database(monkeypatch, call, isolated, keys):
    """A per-process cap constrains this process's choice, not what is stored for the fleet.

    A record tuned under KVSPLIT_MAX_SPLIT=1 must not become every later
    process's answer for the key: the database must hold every valid K's
    measurement (or nothing), and an uncapped process must be free to run K > 1.
    """
    monkeypatch.setenv("KVSPLIT_MAX_SPLIT", "1")
    assert call(num_splits=32, rows=8)[0] == 1
    key = keys.key_for(64, 32, 8)
    valid = valid_kv_splits(head_dim=64, elem_bytes=2, rows=8, num_splits=32, sm_count=None)
    with open_store(isolated.url, config_type=KernelConfig) as store:  # as the dispatcher opens it
        record = store.get(key)
    if record is not None:
        assert sorted(c.config.kv_split for c in record.candidates) == valid


# -- choices from the database and the shipped tables are re-checked ---------------------------

@pytest.mark.usefixtures("no_tuning")
def test_a_tampered_database_value_is_constrained(call, isolated, keys, merge_kit):
    # kv_split=16 at head_dim 512 bf16 breaks (b): 32 threads * 16 B < 1 KiB.
    keys.store_winner(isolated.url, keys.key_for(512, 32, 8), 16)
    k, decision = call(head_dim=512, num_splits=32, rows=8)
    assert decision.source == "database"
    assert k == decision.config.kv_split == merge_kit.expected_kv_split(
        16, head_dim=512, elem_bytes=2, rows=8, num_splits=32) == 8


@pytest.mark.usefixtures("no_tuning")
@pytest.mark.parametrize("params, expected", [
    ({"slices": 2, "kv_split": 8, "depth": 8}, KernelConfig.dsplit(2, 8, 8)),  # valid: as stored
    ({"slices": 2, "kv_split": 32, "depth": 4}, KernelConfig.dsplit(2, 16)),   # 32 groups > 24
    ({"slices": 16, "kv_split": 8, "depth": 4}, 8),   # partials: halved. 16 slices of 64 bf16
])                                                    # are 1 lane each: KvSplit K = 8
def test_a_stored_dsplit_winner_is_applied_after_its_rules(call, isolated, keys, params, expected):
    key = keys.key_for(64, 24, 8)
    record = keys.stored_record(key, 1).model_copy(
        update={"winner": KernelConfig(family="dsplit", params=params)})
    with open_store(isolated.url) as store:
        store.upsert(record)
    k, decision = call(head_dim=64, num_splits=24, rows=8)
    assert decision.source == "database"
    assert k == expected


@pytest.fixture
def shipped_tables(monkeypatch, tmp_path):
    """Points the dispatcher's shipped-table loader at ``tmp_path/tables`` (real JSON files)."""
    import importlib.resources as resources

    package = tmp_path / "package"
    (package / "tables").mkdir(parents=True)
    real_files = resources.files

    def files(anchor):
        return package if anchor == "kvsplit" else real_files(anchor)

    monkeypatch.setattr(resources, "files", files)
    monkeypatch.setattr(dispatch_module, "_SHIPPED", {})
    return package / "tables"


@pytest.mark.usefixtures("no_tuning")
def test_a_tampered_shipped_table_is_constrained(call, keys, merge_kit, shipped_tables):
    # A shipped table serves any kernel build of this device.
    key = keys.key_for(512, 32, 8).model_copy(update={"build_hash": "shipped-elsewhere"})
    (shipped_tables / "this-cpu.json").write_text(
        dump_export(make_export([keys.stored_record(key, 16)])))
    k, decision = call(head_dim=512, num_splits=32, rows=8)
    assert decision.source == "shipped"
    assert k == merge_kit.expected_kv_split(16, head_dim=512, elem_bytes=2, rows=8,
                                            num_splits=32) == 8


@pytest.mark.usefixtures("no_tuning")
def test_the_database_wins_over_the_shipped_table(call, isolated, keys, shipped_tables):
    key = keys.key_for(64, 16, 8)
    (shipped_tables / "this-cpu.json").write_text(dump_export(make_export([keys.stored_record(key, 8)])))
    keys.store_winner(isolated.url, key, 2)
    assert call(num_splits=16, rows=8)[0] == 2


def _shipped_record(key, configs: list[KernelConfig]) -> TuningRecord:
    """A shipped record that timed ``configs`` (the first won)."""
    timed = [CandidateResult(config=c, median_us=2.0 + i, p10_us=2.0 + i, p90_us=2.0 + i, samples=8,
                             matched=True) for i, c in enumerate(configs)]
    return TuningRecord(key=key, winner=configs[0], candidates=timed,
                        policy=TuningPolicy(repeats=1, noise_margin=0.02), tool_version="test")


@pytest.mark.parametrize("mode", ["auto", "cached"])
@pytest.mark.parametrize("timed", ["every family", "kvsplit only"])
def test_a_shipped_record_that_never_timed_a_family_is_profiled_again_in_auto(
        monkeypatch, shipped_tables, tuner_calls, mode, timed):
    """A table tuned before a family existed (a GPU's record that timed KvSplit only, at 8
    states, where DSplit and Few run too) serves ``cached``; ``auto`` profiles the key, so
    that the present families compete. A record that timed every family serves both."""
    gpu = DeviceFacts("Simulated GPU", 9, 0, 132, True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # nothing is capturing
    monkeypatch.setenv("KVSPLIT_MODE", mode)
    shape = (64, torch.bfloat16, torch.bfloat16, 0, 8, 48)
    key = tuning_key(gpu, "shipped-elsewhere", 64, "bfloat16", "bfloat16", "maxsum", 8, 48)
    configs = [KernelConfig.kvsplit(2), KernelConfig.kvsplit(1)]
    if timed == "every family":
        configs += [KernelConfig.dsplit(1, 1), KernelConfig.few(1)]
    (shipped_tables / "simulated.json").write_text(dump_export(make_export([_shipped_record(key, configs)])))
    the_dispatcher = dispatch_module.dispatcher
    chosen, _ = the_dispatcher.choose_config(gpu, torch.device("cpu"), *shape, None)
    decision = the_dispatcher.explain(gpu, *shape)
    if mode == "auto" and timed == "kvsplit only":
        assert decision.source == "tuned" and len(tuner_calls.keys) == 1
        assert dispatch_module._untimed_families(gpu, key, (48, 8)) == {DSPLIT, FEW}
    else:
        assert decision.source == "shipped" and tuner_calls.keys == []
        assert chosen == KernelConfig.kvsplit(2)


@pytest.mark.parametrize("num_splits", [2, 4])
def test_a_shipped_record_is_judged_at_the_calls_shape_as_the_tuner_prunes_there(
        monkeypatch, shipped_tables, tuner_calls, num_splits):
    """A key of N bucket 4 tuned at 2 states timed what the tuner times there (no DSplit: one
    group a row is its sweet spot). A call of 2 states takes the record in ``auto``; a call of
    4, where the tuner would time DSplit too, profiles the key."""
    gpu = DeviceFacts("Simulated GPU", 9, 0, 132, True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # nothing is capturing
    monkeypatch.setenv("KVSPLIT_MODE", "auto")
    key = tuning_key(gpu, "shipped-elsewhere", 80, "bfloat16", "bfloat16", "maxsum", 4, 16)
    configs = [KernelConfig.few(2), KernelConfig.kvsplit(1), KernelConfig.few(1), KernelConfig.few(4)]
    (shipped_tables / "simulated.json").write_text(dump_export(make_export([_shipped_record(key, configs)])))
    shape = (80, torch.bfloat16, torch.bfloat16, 0, num_splits, 16)
    the_dispatcher = dispatch_module.dispatcher
    chosen, _ = the_dispatcher.choose_config(gpu, torch.device("cpu"), *shape, None)
    decision = the_dispatcher.explain(gpu, *shape)
    if num_splits == 2:
        assert (decision.source, chosen, tuner_calls.keys) == ("shipped", KernelConfig.few(2), [])
    else:
        assert decision.source == "tuned" and len(tuner_calls.keys) == 1
        assert dispatch_module._untimed_families(gpu, key, (16, 4)) == {DSPLIT}


def test_during_capture_a_shipped_record_that_never_timed_a_family_serves_and_leaves_the_key_pending(
        monkeypatch, shipped_tables, tuner_calls, isolated):
    """In ``auto``, while a stream captures: such a record's winner serves instead of the heuristic,
    nothing is cached and the key is pending, so that the next uncaptured call profiles it."""
    gpu = DeviceFacts("Simulated GPU", 9, 0, 132, True)
    capturing = True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: capturing)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    shape = (64, torch.bfloat16, torch.bfloat16, 0, 8, 48)
    shipped_key = tuning_key(gpu, "shipped-elsewhere", 64, "bfloat16", "bfloat16", "maxsum", 8, 48)
    record = _shipped_record(shipped_key, [KernelConfig.kvsplit(2), KernelConfig.kvsplit(1)])
    (shipped_tables / "simulated.json").write_text(dump_export(make_export([record])))
    the_dispatcher = dispatch_module.dispatcher
    chosen, _ = the_dispatcher.choose_config(gpu, torch.device("cpu"), *shape, None)
    assert chosen == KernelConfig.kvsplit(2) and tuner_calls.keys == []
    assert the_dispatcher.explain(gpu, *shape) is None  # nothing cached
    key = shipped_key.model_copy(update={"build_hash": build_hash(True)})
    assert pending._keys == {key}

    capturing = False
    the_dispatcher.choose_config(gpu, torch.device("cpu"), *shape, None)
    assert tuner_calls.keys == [key] and the_dispatcher.explain(gpu, *shape).source == "tuned"


def test_a_stored_choice_serves_a_new_dispatcher_without_tuning(call, tuner_calls, kernel_ks, keys):
    k, decision = call(num_splits=20, rows=10)
    assert decision.source == "tuned" and len(tuner_calls.keys) == 1
    # A new process: a new Dispatcher, the same database.
    fresh = dispatch_module.Dispatcher()
    kernel_ks.use(fresh)
    try:
        again, _ = call(num_splits=20, rows=10, seed=1)
        later = fresh.explain(CPU_FACTS, 64, torch.bfloat16, torch.bfloat16, 0, 20, 10)
        assert (again, later.source, later.key) == (k, "database", keys.key_for(64, 20, 10))
        # The same bucket (num_splits 18 -> 20, rows 9 -> 10) is the same key: no tuning.
        _, same_bucket = call(num_splits=18, rows=9)
        assert same_bucket is None  # it went through ``fresh``, not the module dispatcher
        assert fresh.explain(CPU_FACTS, 64, torch.bfloat16, torch.bfloat16, 0, 18, 9).source == "database"
        assert len(tuner_calls.keys) == 1
        # Another bucket (rows 8) is another key: tuned.
        call(num_splits=20, rows=8)
        assert fresh.explain(CPU_FACTS, 64, torch.bfloat16, torch.bfloat16, 0, 20, 8).source == "tuned"
        assert tuner_calls.keys[1:] == [keys.key_for(64, 20, 8)]
    finally:
        fresh.forget()


def test_forget_rereads_the_database(call, tuner_calls):
    k, _ = call(num_splits=16, rows=8)
    dispatch_module.dispatcher.forget()
    again, decision = call(num_splits=16, rows=8)
    assert (again, decision.source) == (k, "database") and len(tuner_calls.keys) == 1


def test_a_broken_database_warns_and_tuning_goes_on_in_memory(monkeypatch, call, tuner_calls, tmp_path):
    garbage = tmp_path / "not-a-database.sqlite"
    garbage.write_bytes(b"this is not an SQLite file" * 100)
    monkeypatch.setenv("KVSPLIT_DB", f"sqlite:///{garbage}")
    with pytest.warns(DbWarning):
        k, decision = call(num_splits=16, rows=8)
    assert decision.source == "tuned" and len(tuner_calls.keys) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert call(num_splits=16, rows=8)[0] == k


# -- forced K -----------------------------------------------------------------------------------

@pytest.mark.usefixtures("no_tuning")
@pytest.mark.parametrize("mode", [None, "auto", "cached", "off", "2", "16"])
@pytest.mark.parametrize("forced", [1, 4, 16])
def test_forced_kv_split_overrides_mode_and_database(monkeypatch, call, isolated, keys, mode, forced):
    keys.store_winner(isolated.url, keys.key_for(64, 32, 8), 8)
    if mode is not None:
        monkeypatch.setenv("KVSPLIT_MODE", mode)
    k, decision = call(num_splits=32, rows=8, kv_split=forced)
    assert (k, decision.source) == (forced, "forced")


@pytest.mark.usefixtures("no_tuning")
def test_forced_kv_split_is_still_constrained(call, merge_kit):
    assert call(num_splits=4, rows=8, kv_split=16)[0] == 4
    assert call(head_dim=512, num_splits=32, rows=8, kv_split=16)[0] == 8
    assert call(head_dim=512, dtype=torch.float32, num_splits=32, rows=8, kv_split=16)[0] == (
        merge_kit.expected_kv_split(16, head_dim=512, elem_bytes=4, rows=8, num_splits=32)) == 4


@pytest.mark.usefixtures("no_tuning")
def test_changing_the_mode_between_calls_takes_effect(monkeypatch, call):
    monkeypatch.setenv("KVSPLIT_MODE", "off")
    assert call(num_splits=32, rows=8)[0] == 1
    monkeypatch.setenv("KVSPLIT_MODE", "4")
    assert call(num_splits=32, rows=8)[0] == 4
    monkeypatch.setenv("KVSPLIT_MODE", "off")
    assert call(num_splits=32, rows=8)[0] == 1


# -- first use from many threads ------------------------------------------------------------------

def test_first_use_from_many_threads_tunes_once(tuner_calls, merge_kit, kernel_ks, keys):
    tuner_calls.delay = 0.3  # keep the others waiting while the first one profiles
    threads_n = 8
    start = threading.Barrier(threads_n)
    results, errors = [None] * threads_n, []
    head_dim, num_splits, rows = 128, 24, 16

    def worker(i):
        gen = merge_kit.generator("threads", i)
        partial_o, stats = merge_kit.partials("maxsum", num_splits, rows, head_dim, torch.bfloat16, gen)
        try:
            start.wait()
            out, out_stats = kvsplit.merge_maxsum(partial_o, stats, 0.5, return_stats=True)
            results[i] = (out, out_stats, merge_kit.reference("maxsum", partial_o, stats, scale=0.5))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads_n)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in workers)
    assert errors == []
    assert tuner_calls.keys == [keys.key_for(head_dim, num_splits, rows)]
    for out, out_stats, (ref_out, ref_stats) in results:
        merge_kit.assert_matches_reference(out, out_stats, ref_out, ref_stats)
    assert len(kernel_ks.ks) == threads_n and len(set(kernel_ks.ks)) == 1
    decision = dispatch_module.dispatcher.explain(CPU_FACTS, head_dim, torch.bfloat16, torch.bfloat16,
                                                  0, num_splits, rows)
    assert decision.config.kv_split == kernel_ks.ks[0]
    assert pending.load() == []


# -- CUDA-graph capture, simulated (test_capture.py does it for real on a GPU) ----------------------

def test_a_miss_during_capture_is_served_by_the_heuristic_and_left_pending(monkeypatch, tuner_calls,
                                                                          isolated, keys):
    gpu = DeviceFacts("Simulated GPU", 9, 0, 132, True)
    capturing = True  # a CUDA stream is capturing, as far as the dispatcher can tell
    monkeypatch.setattr(torch.cuda, "is_available", lambda: capturing)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    monkeypatch.setattr(dispatch_module, "_SHIPPED", {gpu: {}})
    the_dispatcher = dispatch_module.dispatcher
    shape = (64, torch.bfloat16, torch.bfloat16, 0, 24, 48)
    key = keys.key_for(64, 24, 48).model_copy(update={"device": DeviceInfo(
        name="Simulated GPU", cc_major=9, cc_minor=0, sm_count=132), "build_hash": build_hash(True)})
    heuristic_k = constrain(spec_heuristic(24), head_dim=64, elem_bytes=2, rows=48, num_splits=24,
                            sm_count=132)

    for _ in range(2):  # met twice while capturing: recorded once
        chosen, _ = the_dispatcher.choose_config(gpu, torch.device("cpu"), *shape, None)
        assert chosen == kvsplit_config(heuristic_k) and heuristic_k == 4
        assert tuner_calls.keys == []
        assert the_dispatcher.explain(gpu, *shape) is None  # nothing cached
        assert pending._keys == {key} and pending.load() == [key]
    assert len(isolated.pending_path.read_text().splitlines()) == 1

    capturing = False  # the next uncaptured call profiles the key and clears it from memory
    config, _ = the_dispatcher.choose_config(gpu, torch.device("cpu"), *shape, None)
    assert tuner_calls.keys == [key]
    decision = the_dispatcher.explain(gpu, *shape)
    assert (decision.source, decision.config) == ("tuned", config)
    assert pending._keys == set()


# -- a key whose profile would not fit in memory ------------------------------------------------

def test_a_key_whose_scratch_would_not_fit_is_served_by_the_heuristic_and_left_pending(
        monkeypatch, tuner_calls, isolated, keys):
    """A first-use profile makes scratch inputs of the call's size: where they would take more
    than half the memory free on the device, the heuristic serves (cached: one warning),
    nothing is profiled and the key is pending for an offline tune; with room, it profiles."""
    shape = (64, torch.bfloat16, torch.bfloat16, 0, 24, 48)
    key = keys.key_for(64, 24, 48)
    need = tuner.scratch_bytes(tuner.at_shape(key, (48, 24)))
    # 24 states of 48 rows of 64 (float32, then bf16), their (max, sum) stats (made twice),
    # the bf16 output and two float32 copies of it
    assert need == 24 * 48 * 64 * 6 + 24 * 48 * 2 * 4 * 2 + 48 * 64 * 10
    free = 2 * need - 1
    monkeypatch.setattr(dispatch_module, "free_memory", lambda facts, device: free)
    the_dispatcher = dispatch_module.dispatcher
    heuristic_k = constrain(spec_heuristic(24), head_dim=64, elem_bytes=2, rows=48, num_splits=24,
                            sm_count=None)
    with pytest.warns(RuntimeWarning, match=r"is not profiled at first use: its scratch inputs "
                                            r"would take 0\.00 GiB"):
        chosen, _ = the_dispatcher.choose_config(CPU_FACTS, torch.device("cpu"), *shape, None)
    assert chosen == kvsplit_config(heuristic_k) and tuner_calls.keys == []
    assert the_dispatcher.explain(CPU_FACTS, *shape).source == "heuristic"
    assert pending._keys == {key} and pending.load() == [key]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # cached: no second warning
        assert the_dispatcher.choose_config(CPU_FACTS, torch.device("cpu"), *shape, None)[0] == chosen
    the_dispatcher.forget()
    free = 2 * need  # room enough: the key is profiled
    the_dispatcher.choose_config(CPU_FACTS, torch.device("cpu"), *shape, None)
    assert tuner_calls.keys == [key]
    assert the_dispatcher.explain(CPU_FACTS, *shape).source == "tuned"


def test_free_memory_reads_the_cpu_and_the_gpu(monkeypatch):
    assert dispatch_module.free_memory(CPU_FACTS, torch.device("cpu")) > 0
    gpu = DeviceFacts("Simulated GPU", 9, 0, 132, True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (3 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 5 << 20)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 1 << 20)
    assert dispatch_module.free_memory(gpu, torch.device("cuda", 0)) == (3 << 30) + (4 << 20)


# -- a GPU that no shipped table covers -------------------------------------------------------

@pytest.mark.parametrize("mode", ["auto", "cached"])
def test_a_gpu_without_a_shipped_table_profiles_in_auto_and_takes_the_heuristic_in_cached(
        monkeypatch, tuner_calls, mode):
    """An A100 (simulated; the profile runs on the CPU): the package ships tables for the H100
    and the H200 only, so ``auto`` profiles the key at first use and ``cached`` never profiles."""
    a100 = DeviceFacts("NVIDIA A100-SXM4-80GB", 8, 0, 108, True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # nothing is capturing
    monkeypatch.setenv("KVSPLIT_MODE", mode)
    assert dispatch_module._shipped_table(a100) == {}
    the_dispatcher = dispatch_module.dispatcher
    shape = (64, torch.bfloat16, torch.bfloat16, 0, 24, 48)
    chosen, _ = the_dispatcher.choose_config(a100, torch.device("cpu"), *shape, None)
    decision = the_dispatcher.explain(a100, *shape)
    if mode == "auto":
        assert decision.source == "tuned" and len(tuner_calls.keys) == 1
        assert tuner_calls.keys[0].device == DeviceInfo(name=a100.name, cc_major=8, cc_minor=0,
                                                        sm_count=108)
    else:
        heuristic_k = constrain(spec_heuristic(24), head_dim=64, elem_bytes=2, rows=48,
                                num_splits=24, sm_count=108)
        assert decision.source == "heuristic" and tuner_calls.keys == []
        assert chosen == kvsplit_config(heuristic_k)
    # The next call of the shape is a dictionary hit: no second profile.
    assert the_dispatcher.choose_config(a100, torch.device("cpu"), *shape, None)[0] == chosen
    assert len(tuner_calls.keys) == (1 if mode == "auto" else 0)


def test_each_database_url_has_its_own_choices(monkeypatch, call, tuner_calls, isolated, tmp_path):
    call(num_splits=16, rows=8)
    assert len(tuner_calls.keys) == 1
    monkeypatch.setenv("KVSPLIT_DB", f"sqlite:///{tmp_path / 'other.sqlite'}")
    assert call(num_splits=16, rows=8)[1].source == "tuned"  # the other database is empty
    assert len(tuner_calls.keys) == 2
    monkeypatch.setenv("KVSPLIT_DB", isolated.url)
    assert call(num_splits=16, rows=8)[1].source == "tuned"  # the first decision, still cached
    assert len(tuner_calls.keys) == 2
    for url in (isolated.url, f"sqlite:///{tmp_path / 'other.sqlite'}"):
        with open_store(url) as store:
            assert len(store.query()) == 1


# -- settings that kvsplit cannot use, a key that cannot be tuned, the first-use log -----------

@pytest.mark.parametrize(("name", "bad", "message"), [
    *(("KVSPLIT_MAX_SPLIT", bad, "KVSPLIT_MAX_SPLIT must be a positive integer")
      for bad in ("0", "-1", "abc", "2.0", " ")),
    *(("KVSPLIT_PDL", bad, "KVSPLIT_PDL must be 0 or 1") for bad in ("yes", "on", "true", "2", " 1")),
])
def test_a_setting_kvsplit_cannot_read_is_refused(monkeypatch, merge_kit, name, bad, message):
    """A value kvsplit cannot read is an error naming the variable, never read as a default."""
    from kvsplit.dispatch import InvalidSetting

    gen = merge_kit.generator(name, bad)
    partial_o, stats = merge_kit.partials("maxsum", 8, 4, 64, torch.bfloat16, gen)
    monkeypatch.setenv(name, bad)
    with pytest.raises(InvalidSetting, match=message):
        kvsplit.merge_maxsum(partial_o, stats, 1.0)


def test_pdl_reads_0_empty_and_1(monkeypatch, merge_kit):
    """The values KVSPLIT_PDL takes merge as without it (on the CPU PDL changes nothing)."""
    partial_o, stats = merge_kit.partials("maxsum", 8, 4, 64, torch.bfloat16,
                                          merge_kit.generator("pdl"))
    monkeypatch.delenv("KVSPLIT_PDL", raising=False)
    expected = kvsplit.merge_maxsum(partial_o, stats, 1.0)
    for good in ("0", "", "1"):
        monkeypatch.setenv("KVSPLIT_PDL", good)
        assert torch.equal(kvsplit.merge_maxsum(partial_o, stats, 1.0), expected)


def test_a_key_with_no_working_candidate_gets_the_heuristic_with_a_warning(monkeypatch, call, isolated,
                                                                           keys):
    def broken(key, device, **kwargs):
        raise tuner.NoWorkingCandidate(f"no candidate config works for {key.choice_key}")

    monkeypatch.setattr(tuner, "tune", broken)
    with pytest.warns(RuntimeWarning, match="no candidate config works.*heuristic config kvsplit"):
        k, decision = call(num_splits=20, rows=8)  # the merge ran, against the reference
    assert decision.source == "heuristic" and k == spec_heuristic(20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert call(num_splits=20, rows=8)[0] == k  # decided once: no warning per call
    with open_store(isolated.url) as store:
        assert store.query() == []


def test_a_first_use_profile_is_logged_before_it_runs(call, tuner_calls, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="kvsplit.dispatch"):
        call(num_splits=16, rows=8)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvsplit.dispatch"]
    assert lines[0].startswith("kvsplit: profiling 5 candidate configs for head_dim=64 "
                               "partial_dtype=bfloat16")
    assert "kvsplit tune" in lines[0] and len(tuner_calls.keys) == 1
