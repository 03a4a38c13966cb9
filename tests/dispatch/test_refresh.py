"""dispatch/refresh.py: a serving process picks up winners stored after it read its table.

Another process is played by a store of its own on the same database; the
dispatcher under test is the module's (through kvsplit.merge_maxsum, with
its per-layout launches), so a refresh that forgot ``dispatcher.launches`` would
keep launching the old config and fail here.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvsplit.db.store import Store
from kvsplit.dispatch import InvalidSetting
from kvsplit.dispatch import dispatcher as dispatch_module
from kvsplit.dispatch.refresh import DEFAULT_REFRESH_S, refresh_interval

pytestmark = pytest.mark.usefixtures("isolated")


@pytest.fixture
def refresh_s(monkeypatch):
    """``refresh_s(value)`` sets KVSPLIT_REFRESH_S for this test."""
    return lambda value: monkeypatch.setenv("KVSPLIT_REFRESH_S", str(value))


@pytest.mark.usefixtures("no_tuning")
def test_a_winner_stored_elsewhere_replaces_the_heuristic_and_the_kept_launch(monkeypatch, call, isolated,
                                                                              keys, kernel_ks, refresh_s):
    monkeypatch.setenv("KVSPLIT_MODE", "cached")
    refresh_s(3600)  # the thread stays out of it: this test calls refresh() itself
    k, decision = call(num_splits=16, rows=8)
    assert (k, decision.source) == (4, "heuristic")
    assert call(num_splits=16, rows=8, seed=1)[0] == 4 and len(dispatch_module.dispatcher.launches) == 1
    keys.store_winner(isolated.url, keys.key_for(64, 16, 8), 2)  # a tuning job, elsewhere
    assert call(num_splits=16, rows=8, seed=2)[0] == 4  # a hit: no database access
    assert dispatch_module.dispatcher.refresh()
    assert dispatch_module.dispatcher.launches == {}
    k, decision = call(num_splits=16, rows=8, seed=3)
    assert (k, decision.source) == (2, "database")
    assert not dispatch_module.dispatcher.refresh()  # nothing new: one query, nothing dropped


@pytest.mark.usefixtures("no_tuning")
def test_a_changed_winner_replaces_the_old_one_and_other_shapes_keep_theirs(call, isolated, keys, refresh_s):
    refresh_s(3600)
    keys.store_winner(isolated.url, keys.key_for(64, 16, 8), 2)
    keys.store_winner(isolated.url, keys.key_for(64, 32, 8), 8)
    assert call(num_splits=16, rows=8)[0] == 2 and call(num_splits=32, rows=8)[0] == 8
    keys.store_winner(isolated.url, keys.key_for(64, 16, 8), 1)  # re-tuned with --force elsewhere
    assert dispatch_module.dispatcher.refresh()
    assert call(num_splits=16, rows=8)[0] == 1
    k, decision = call(num_splits=32, rows=8)
    assert (k, decision.source) == (8, "database")


def test_a_miss_looks_for_new_winners_before_it_profiles(call, isolated, keys, tuner_calls, refresh_s):
    refresh_s(3600)
    call(num_splits=16, rows=8)  # tuned here: the table is loaded
    assert len(tuner_calls.keys) == 1
    keys.store_winner(isolated.url, keys.key_for(64, 32, 8), 8)  # the fleet tuned another shape
    k, decision = call(num_splits=32, rows=8)
    assert (k, decision.source) == (8, "database") and len(tuner_calls.keys) == 1


def test_a_process_own_writes_do_not_reload_its_tables(monkeypatch, call, isolated, keys, tuner_calls,
                                                      refresh_s):
    """First use of one shape after another: each miss checks the counter, and only another
    process's write (not this one's own) reads the table again."""
    refresh_s(3600)
    loads = []
    real_load = Store.load_choices
    monkeypatch.setattr(Store, "load_choices",
                        lambda self, *args: (loads.append(args), real_load(self, *args))[1])
    call(num_splits=16, rows=8)  # loads the (empty) table, then tunes and stores
    call(num_splits=32, rows=8)
    call(num_splits=64, rows=8)
    assert len(tuner_calls.keys) == 3 and len(loads) == 1
    keys.store_winner(isolated.url, keys.key_for(64, 16, 16), 2)  # another process
    k, decision = call(num_splits=16, rows=16)
    assert (k, decision.source) == (2, "database") and len(loads) == 2
    assert len(tuner_calls.keys) == 3


def test_with_refreshing_off_a_miss_does_not_look(monkeypatch, call, isolated, keys, refresh_s):
    monkeypatch.setenv("KVSPLIT_MODE", "cached")
    refresh_s(0)
    call(num_splits=16, rows=8)
    keys.store_winner(isolated.url, keys.key_for(64, 32, 8), 8)
    assert call(num_splits=32, rows=8)[1].source == "heuristic"


def decided(call, **shape):
    """(K, Decision) of a call whose decision was still cached when it was read: the refresh
    thread empties the cache between a merge and the read now and then."""
    for _ in range(100):
        k, decision = call(**shape)
        if decision is not None:
            return k, decision
    raise AssertionError("the decision cache was emptied after each of 100 calls")


@pytest.mark.usefixtures("no_tuning")
def test_the_refresh_thread_picks_up_a_winner_within_its_interval(monkeypatch, call, isolated, keys,
                                                                  refresh_s):
    monkeypatch.setenv("KVSPLIT_MODE", "cached")
    refresh_s(0.2)
    assert decided(call, num_splits=16, rows=8)[1].source == "heuristic"
    keys.store_winner(isolated.url, keys.key_for(64, 16, 8), 2)
    stored = time.monotonic()
    while decided(call, num_splits=16, rows=8)[1].source != "database":
        assert time.monotonic() - stored < 10, "no refresh within 10 s"
        time.sleep(0.02)
    assert time.monotonic() - stored < 0.2 + 2.0
    assert decided(call, num_splits=16, rows=8)[0] == 2


@pytest.mark.parametrize(("raw", "expected"), [(None, DEFAULT_REFRESH_S), ("", DEFAULT_REFRESH_S),
                                               ("0", None), ("2.5", 2.5), ("60", 60.0)])
def test_refresh_interval(monkeypatch, raw, expected):
    if raw is None:
        monkeypatch.delenv("KVSPLIT_REFRESH_S", raising=False)
    else:
        monkeypatch.setenv("KVSPLIT_REFRESH_S", raw)
    assert refresh_interval() == expected


@pytest.mark.parametrize("bad", ["-1", "soon", "nan", "inf"])
def test_an_invalid_refresh_interval_is_a_value_error_naming_the_variable(monkeypatch, merge_kit, bad,
                                                                          refresh_s):
    refresh_s(bad)
    with pytest.raises(InvalidSetting, match="KVSPLIT_REFRESH_S"):
        refresh_interval()
    partial_o, stats = merge_kit.partials("maxsum", 16, 8, 64, torch.bfloat16, merge_kit.generator("r"))
    monkeypatch.setenv("KVSPLIT_MODE", "cached")
    import kvsplit

    with pytest.raises(ValueError, match="KVSPLIT_REFRESH_S"):
        kvsplit.merge_maxsum(partial_o, stats, 1.0)


@pytest.mark.usefixtures("no_tuning")
def test_a_store_that_fell_back_to_memory_keeps_the_tables_it_read(monkeypatch, call, isolated, keys,
                                                                   refresh_s):
    refresh_s(3600)
    keys.store_winner(isolated.url, keys.key_for(64, 16, 8), 2)
    assert call(num_splits=16, rows=8)[0] == 2
    store = dispatch_module.dispatcher._store
    monkeypatch.setattr(store, "_engine", store._engine)  # restored after the test
    from kvsplit.db.store import memory_engine

    store._engine = memory_engine()  # as after a database failure (it warns and swaps)
    store.upsert(keys.stored_record(keys.key_for(64, 16, 8), 16))  # a generation in memory
    assert not dispatch_module.dispatcher.refresh()
    assert call(num_splits=16, rows=8)[0] == 2


@pytest.mark.usefixtures("no_tuning")
def test_a_forked_child_refreshes_with_connections_of_its_own(call, isolated, keys, refresh_s):
    import os

    refresh_s(3600)
    keys.store_winner(isolated.url, keys.key_for(64, 16, 8), 2)
    assert call(num_splits=16, rows=8)[0] == 2
    keys.store_winner(isolated.url, keys.key_for(64, 16, 8), 8)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it saw, never return into pytest
        try:
            os.close(read)
            changed = dispatch_module.dispatcher.refresh()
            os.write(write, f"{changed} {call(num_splits=16, rows=8)[0]}".encode())
        finally:
            os._exit(0)
    os.close(write)
    seen = os.read(read, 100)
    os.close(read)
    os.waitpid(pid, 0)
    assert seen == b"True 8"
    assert call(num_splits=16, rows=8)[0] == 2  # the parent has not refreshed yet
    assert dispatch_module.dispatcher.refresh() and call(num_splits=16, rows=8)[0] == 8
