"""Fixtures for the dispatcher tests: an isolated dispatcher, a tuner spy, one merge call.

Every test that goes through the module-level dispatcher takes ``isolated``:
an empty SQLite tuning database and pending file of its own, no
``KVSPLIT_*`` overrides, no pending keys in memory, and the dispatcher's
caches dropped before and after.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

import kvsplit
from kvsplit import merge as merge_module
from kvsplit.config import build_hash
from kvsplit.autotune import tuner
from kvsplit.db import TuningPolicy, TuningRecord, open_store
from kvsplit.config import KernelConfig
from kvsplit.dispatch import dispatcher as dispatch_module
from kvsplit.dispatch import pending
from kvsplit.dispatch.constraints import KVSPLIT
from kvsplit.dispatch.device import device_facts
from kvsplit.dispatch.keys import tuning_key


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """A private database and pending file; the dispatcher forgets before and after."""
    url = f"sqlite:///{tmp_path / 'tuning.sqlite'}"
    pending_path = tmp_path / "pending.jsonl"
    monkeypatch.setenv("KVSPLIT_DB", url)
    monkeypatch.setenv("KVSPLIT_PENDING", str(pending_path))
    for name in ("KVSPLIT_MODE", "KVSPLIT_MAX_SPLIT", "KVSPLIT_PDL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(pending, "_keys", set())
    dispatch_module.dispatcher.forget()
    yield SimpleNamespace(url=url, pending_path=pending_path, tmp_path=tmp_path)
    dispatch_module.dispatcher.forget()


@pytest.fixture
def tuner_calls(monkeypatch):
    """Counts calls of the tuner (keys, in order); ``.delay`` seconds widen race windows."""
    calls = SimpleNamespace(keys=[], delay=0.0)
    lock = threading.Lock()
    real_tune = tuner.tune

    def counting_tune(key, device, **kwargs):
        with lock:
            calls.keys.append(key)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise AssertionError("the tuner ran during CUDA-graph capture")
        time.sleep(calls.delay)
        return real_tune(key, device, **kwargs)

    monkeypatch.setattr(tuner, "tune", counting_tune)
    return calls


@pytest.fixture
def no_tuning(monkeypatch):
    """Any profiling fails the test."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the tuner ran, but this call must not profile")

    monkeypatch.setattr(tuner, "tune", forbidden)


def key_for(head_dim, num_splits, rows, *, dtype="bfloat16", out_dtype=None, stats_format="maxsum",
            device="cpu"):
    """The (bucketed) tuning key the dispatcher looks up for a call of this shape."""
    return tuning_key(device_facts(torch.device(device)), build_hash(device != "cpu"), head_dim, dtype,
                      out_dtype or dtype, stats_format, num_splits, rows)


def stored_record(key, kv_split: int) -> TuningRecord:
    """A winners-only record (as a shipped table or a hand-edited database holds)."""
    return TuningRecord(key=key, winner=KernelConfig.kvsplit(kv_split),
                        policy=TuningPolicy(repeats=1, noise_margin=0.02), tool_version="test")


def store_winner(url: str, key, kv_split: int) -> None:
    with open_store(url) as store:
        store.upsert(stored_record(key, kv_split))


@pytest.fixture
def kernel_ks(monkeypatch):
    """The K each merge call handed to the kernel, in order (after the constraints).

    Only outermost calls count: the tuner's scratch runs, which go through the
    dispatcher from inside a caller's first call, are left out.
    ``kernel_ks.use(dispatcher)`` routes merge calls to another Dispatcher.
    """
    ks: list[int] = []
    launch = merge_module._launch  # the public calls' launches, not the tuner's

    def spy_launch(layout, *args):
        if layout.kernel is not None:  # a KvSplit config as its K, any other as itself
            config = layout.kernel.config
            ks.append(config.kv_split if config.family == KVSPLIT else config)
        return launch(layout, *args)

    def use(other):
        dispatch_module.dispatcher.launches.clear()
        monkeypatch.setattr(dispatch_module, "choose_config", other.choose_config)

    monkeypatch.setattr(merge_module, "_launch", spy_launch)
    # Every call through the Python path, so that the spy sees each launch.
    monkeypatch.setattr(merge_module, "_call_fast", lambda *args: False)
    yield SimpleNamespace(ks=ks, use=use)
    dispatch_module.dispatcher.launches.clear()


@pytest.fixture
def call(merge_kit, kernel_ks):
    """``call(head_dim=..., num_splits=..., rows=..., kv_split=...)``: one checked maxsum merge.

    Runs kvsplit.merge_maxsum on fresh partials, checks the result against the
    float64 reference and returns (K the kernel ran with, the module
    dispatcher's Decision for the call, or None when it cached nothing).
    """

    def run(*, head_dim=64, num_splits=16, rows=8, dtype=torch.bfloat16, kv_split=None,
            device="cpu", seed=0):
        gen = merge_kit.generator("dispatch", head_dim, num_splits, rows, seed)
        partial_o, stats = merge_kit.partials("maxsum", num_splits, rows, head_dim, dtype, gen)
        scale = merge_kit.scale_log2(gen)
        partial_o, stats = partial_o.to(device), stats.to(device)
        before = len(kernel_ks.ks)
        out, out_stats = kvsplit.merge_maxsum(partial_o, stats, scale, return_stats=True,
                                              kv_split=kv_split)
        merge_kit.assert_matches_reference(out, out_stats,
                                           *merge_kit.reference("maxsum", partial_o, stats, scale=scale))
        assert len(kernel_ks.ks) == before + 1
        decision = dispatch_module.dispatcher.explain(
            device_facts(torch.device(device)), head_dim, dtype, out.dtype, 0, num_splits, rows,
            kv_split)
        return kernel_ks.ks[-1], decision

    return run


@pytest.fixture
def keys():
    """Helpers to build keys and records as the dispatcher and a database hold them."""
    return SimpleNamespace(key_for=key_for, stored_record=stored_record, store_winner=store_winner)
