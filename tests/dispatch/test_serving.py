"""A serving process: first-use profiles under reloads, and a database file that changes under it.

First-use profiling of a key happens once per process, even when a reload
(the refresh thread, or a miss) comes between the profile and its write.
The dispatcher under test is the module's, through kvsplit.merge_maxsum.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import pytest
import torch

import kvsplit
from kvsplit.db import open_store
from kvsplit.db.store import Store
from kvsplit.dispatch import dispatcher as dispatch_module
from kvsplit.dispatch.device import device_facts

pytestmark = pytest.mark.usefixtures("isolated")
CPU = device_facts(torch.device("cpu"))


@pytest.fixture
def merge(merge_kit):
    """``merge(num_splits=, rows=, seed=)``: one checked maxsum merge (thread-safe); its Decision."""

    def run(*, num_splits: int, rows: int, seed: int = 0, head_dim: int = 64):
        gen = merge_kit.generator("serving", num_splits, rows, seed)
        partial_o, stats = merge_kit.partials("maxsum", num_splits, rows, head_dim, torch.bfloat16, gen)
        out, out_stats = kvsplit.merge_maxsum(partial_o, stats, 1.0, return_stats=True)
        merge_kit.assert_matches_reference(out, out_stats, *merge_kit.reference("maxsum", partial_o, stats))
        return dispatch_module.dispatcher.explain(CPU, head_dim, torch.bfloat16, out.dtype, 0, num_splits, rows)

    return run


@pytest.fixture
def refresh_s(monkeypatch):
    return lambda value: monkeypatch.setenv("KVSPLIT_REFRESH_S", str(value))


def test_a_reload_between_a_profile_and_its_write_keeps_the_key(monkeypatch, merge, isolated, keys, tuner_calls,
                                                                 refresh_s):
    """Thread A profiles a key and is writing it; another process stores a key, a reload runs;
    thread B calls another shape of the same bucket and waits for A's key lock. B must find A's
    winner, not profile again (the reload dropped it: 4 of 152 keys were profiled twice)."""
    refresh_s(3600)  # reloads come from this test only
    merge(num_splits=16, rows=8)  # the table is loaded
    key = keys.key_for(64, 16, 33)
    assert key == keys.key_for(64, 16, 34)  # two call shapes, one bucket
    writing, release = threading.Event(), threading.Event()
    real_upsert = Store.upsert

    def slow_upsert(self, record):
        if record.key == key:
            writing.set()
            assert release.wait(30)
        return real_upsert(self, record)

    monkeypatch.setattr(Store, "upsert", slow_upsert)
    results = {}
    first = threading.Thread(target=lambda: results.update(a=merge(num_splits=16, rows=33)))
    first.start()
    assert writing.wait(30)
    keys.store_winner(isolated.url, keys.key_for(64, 32, 8), 8)  # another process: the generation moves
    assert dispatch_module.dispatcher.refresh()  # a reload while A's write is in flight
    second = threading.Thread(target=lambda: results.update(b=merge(num_splits=16, rows=34)))
    second.start()
    time.sleep(0.3)  # B reaches the key lock that A holds
    release.set()
    first.join(30)
    second.join(30)
    assert Counter(tuner_calls.keys)[key] == 1, tuner_calls.keys
    assert results["a"].source == "tuned" and results["b"].source == "database"
    assert results["a"].config == results["b"].config
    with open_store(isolated.url) as store:
        assert store.get(key) is not None


def test_eight_threads_with_a_fast_refresh_and_a_writer_profile_each_key_once(merge, isolated, keys, tuner_calls,
                                                                              refresh_s):
    """The probe, generalized: 8 threads merge new shapes (each bucket reached by two shapes) in
    random orders while the refresh thread runs every 0.2 s and another process keeps writing."""
    refresh_s(0.2)
    tuner_calls.delay = 0.01  # widens the window between a profile and its write
    shapes = [(n, r) for n in (16, 24, 32, 48) for r in (9, 10, 17, 20, 33, 40)]
    buckets = {keys.key_for(64, n, r) for n, r in shapes}
    stop = threading.Event()

    def other_process() -> None:
        rows = 1000
        with open_store(isolated.url) as store:
            while not stop.is_set():
                store.upsert(keys.stored_record(keys.key_for(128, 16, rows), 2))
                rows += 1
                time.sleep(0.02)

    errors = []

    def merging(seed: int) -> None:
        order = shapes * 2
        random.Random(seed).shuffle(order)
        try:
            for n, r in order:
                merge(num_splits=n, rows=r, seed=seed)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)

    writer = threading.Thread(target=other_process)
    writer.start()
    threads = [threading.Thread(target=merging, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    stop.set()
    writer.join(30)
    assert errors == []
    profiled = Counter(k for k in tuner_calls.keys if k in buckets)
    assert set(profiled) == buckets
    assert [k for k, n in profiled.items() if n > 1] == []
