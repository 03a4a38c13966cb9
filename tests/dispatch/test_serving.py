"""A serving process: first-use profiles under reloads, and a database file that changes under it.

First-use profiling of a key happens once per process, even when a reload
(the refresh thread, or a miss) comes between the profile and its write.
A file deleted, emptied, spoiled, made immutable or unreadable under the
process is one DbWarning and memory, and nothing is written to an unlinked
file; a file replaced by another database is reopened.  The dispatcher under
test is the module's, through kvsplit.merge_maxsum.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

import kvsplit
from kvsplit.db import DbWarning, open_store
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


# -- the database file changes under a serving process ------------------------------------------


def db_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, DbWarning)]


def deleted_descriptors(path) -> list[str]:
    """This process's open descriptors of ``path`` (or its -wal, -shm) after it was unlinked."""
    folder = "/proc/self/fd"
    if not os.path.isdir(folder):
        return []
    found = []
    for fd in os.listdir(folder):
        try:
            target = os.readlink(f"{folder}/{fd}")
        except OSError:
            continue
        if target.startswith(str(path)) and target.endswith(" (deleted)"):
            found.append(target)
    return found


CHANGES = {
    "deleted": "was deleted; continuing in memory",
    "replaced-by-garbage": "was replaced by another file; the new file cannot be used",
    "overwritten-with-garbage": "corrupt or not an SQLite database",
    "emptied": "was emptied; continuing in memory",
}


@pytest.mark.parametrize("how", list(CHANGES))
def test_a_file_deleted_or_spoiled_under_a_serving_process_warns_once_and_goes_on_in_memory(
        merge, isolated, keys, tuner_calls, refresh_s, how):
    refresh_s(3600)
    path = isolated.tmp_path / "tuning.sqlite"
    merge(num_splits=16, rows=8)  # profiled and stored in the file
    with open_store(isolated.url) as store:
        assert store.get(keys.key_for(64, 16, 8)) is not None
    garbage = b"\x00 not a tuning database " * 300
    if how == "deleted":
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
    elif how == "replaced-by-garbage":
        (isolated.tmp_path / "new").write_bytes(garbage)
        os.replace(isolated.tmp_path / "new", path)
    elif how == "overwritten-with-garbage":
        with open(path, "r+b") as file:
            file.write(garbage)
    else:
        os.truncate(path, 0)
    left = path.read_bytes() if path.exists() else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (9, 17, 33, 65):  # first-use profiles of four buckets: each one a write
            assert merge(num_splits=16, rows=rows).source == "tuned"
        dispatch_module.dispatcher.refresh()  # the refresh thread's check
        assert merge(num_splits=16, rows=10).source == "database"  # 9's bucket, profiled once
    found = db_warnings(caught)
    assert len(found) == 1 and CHANGES[how] in found[0], found
    assert str(isolated.tmp_path / "tuning.sqlite") in found[0]
    assert len(tuner_calls.keys) == 5
    assert (path.read_bytes() if path.exists() else None) == left  # nothing written, nothing recreated
    assert deleted_descriptors(path) == []


def test_a_file_replaced_by_another_database_is_reopened(merge, isolated, keys, tuner_calls, refresh_s):
    """A shared tuning file copied over the one a process serves from: its winners are used, and
    what the process profiles goes into it."""
    refresh_s(3600)
    path = isolated.tmp_path / "tuning.sqlite"
    keys.store_winner(isolated.url, keys.key_for(64, 16, 8), 2)
    assert merge(num_splits=16, rows=8).config.kv_split == 2
    newer = isolated.tmp_path / "newer.sqlite"
    keys.store_winner(f"sqlite:///{newer}", keys.key_for(64, 16, 8), 8)  # the same generation, 1
    os.replace(newer, path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert dispatch_module.dispatcher.refresh()
        decision = merge(num_splits=16, rows=8, seed=1)
        assert (decision.config.kv_split, decision.source) == (8, "database")
        assert merge(num_splits=16, rows=9).source == "tuned"
    found = db_warnings(caught)
    assert len(found) == 1 and "was replaced by another file: reading and writing the new file" in found[0]
    with open_store(isolated.url) as store:
        assert store.get(keys.key_for(64, 16, 9)) is not None
    assert len(tuner_calls.keys) == 1


# A serving process in a child (a SIGBUS must not take pytest with it): it profiles two keys,
# then its file is made immutable (chattr +i) or unreadable (chmod 000) while another process
# holds it open (so that its -wal and -shm stay), and it profiles three more.
_CHILD = textwrap.dedent("""
    import json, os, subprocess, sys, warnings
    import torch
    import kvsplit
    from kvsplit import reference
    from kvsplit.db import DbWarning
    from kvsplit.dispatch import dispatcher as dispatch_module

    path, how = sys.argv[1], sys.argv[2]

    def merge(rows):
        gen = torch.Generator().manual_seed(rows)
        partial_o, stats = reference.random_partials(16, rows, 64, stats_format="maxsum", generator=gen)
        out = kvsplit.merge_maxsum(partial_o.to(torch.bfloat16), stats, 1.0)
        ref, _ = reference.merge_maxsum_reference(partial_o.to(torch.bfloat16), stats, 1.0)
        torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        merge(8)
        merge(9)
        files = [f for f in (path, path + "-wal", path + "-shm") if os.path.exists(f)]
        if how == "immutable":
            subprocess.run(["chattr", "+i", *files], check=True)
        else:
            for f in files:
                os.chmod(f, 0)
        for rows in (10, 17, 20):
            merge(rows)
        dispatch_module.dispatcher.refresh()
    print(json.dumps({"files": files, "warnings": [str(w.message) for w in caught
                                                  if issubclass(w.category, DbWarning)]}))
""")
_HOLDER = ("import sqlite3, sys, time; c = sqlite3.connect(sys.argv[1]); "
           "c.execute('select 1 from sqlite_master').fetchall(); print('ready', flush=True); time.sleep(120)")


def _can_set_immutable(folder: Path) -> bool:
    probe = folder / "probe"
    probe.touch()
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(probe)],
                                                        capture_output=True).returncode != 0:
        return False
    subprocess.run(["chattr", "-i", str(probe)], check=True)
    return True


@pytest.mark.parametrize("how", ["immutable", "unreadable"])
def test_a_file_made_immutable_or_unreadable_under_a_serving_process_does_not_kill_it(isolated, how):
    path = isolated.tmp_path / "tuning.sqlite"
    prefix = []
    if how == "immutable" and not _can_set_immutable(isolated.tmp_path):
        pytest.skip("chattr +i is not allowed here (needs root and a file system with attributes)")
    if how == "unreadable" and os.geteuid() == 0:  # root reads anything: drop what lets it
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv")
        prefix = [setpriv, "--bounding-set=-dac_override,-dac_read_search"]
    with open_store(isolated.url):
        pass  # the schema, so that the holder below has a database to hold
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        env = {**os.environ, "KVSPLIT_REFRESH_S": "3600"}
        child = subprocess.run([*prefix, sys.executable, "-c", _CHILD, str(path), how], capture_output=True,
                               text=True, timeout=300, env=env, cwd=tempfile.gettempdir())
    finally:
        holder.kill()
        holder.wait()
        files = [str(p) for p in isolated.tmp_path.glob("tuning.sqlite*")]
        if how == "immutable":
            subprocess.run(["chattr", "-i", *files], check=False)
        for f in files:
            os.chmod(f, 0o644)
    assert child.returncode == 0, (child.returncode, child.stderr[-3000:])  # -7 would be SIGBUS
    outcome = json.loads(child.stdout.strip().splitlines()[-1])
    assert len(outcome["files"]) == 3  # the -wal and -shm were there, held by the other process
    assert len(outcome["warnings"]) == 1, outcome["warnings"]
    assert "continuing in memory" in outcome["warnings"][0]
    if how == "immutable":
        assert "was made immutable" in outcome["warnings"][0]
