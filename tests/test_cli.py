"""The ``kvsplit`` command: info, tune, and the CPU end-to-end demo.

In process through click's CliRunner on ``kvsplit.cli.main``; the demo runs
in subprocesses, since what it shows is that a second process reuses the
first one's tuning. Every test has its own database and pending file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from clirun import invoke

import kvsplit
from kvsplit import _kernel
from kvsplit.config import NO_CUDA_KERNELS, build_hash, has_cuda_kernels
from kvsplit.autotune import tuner
from kvsplit.cli import main
from kvsplit.db import DeviceInfo, open_store
from kvsplit.db.engine import shown_as_given
from kvsplit.dispatch import dispatcher as dispatch_module
from kvsplit.dispatch import pending
from kvsplit.dispatch.device import device_facts
from kvsplit.dispatch.keys import tuning_key
from kvsplit.reference import random_partials

GRID = ["--devices", "cpu", "--head-dim", "64", "--num-splits", "8,16", "--rows", "4,8"]


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A private database and pending file, no KVSPLIT_* overrides, a dispatcher that forgot."""
    url = f"sqlite:///{tmp_path / 'tuning.sqlite'}"
    monkeypatch.setenv("KVSPLIT_DB", url)
    monkeypatch.setenv("KVSPLIT_PENDING", str(tmp_path / "pending.jsonl"))
    for name in ("KVSPLIT_MODE", "KVSPLIT_MAX_SPLIT", "KVSPLIT_PDL", "KVSPLIT_REFRESH_S"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(pending, "_keys", set())
    dispatch_module.dispatcher.forget()
    yield SimpleNamespace(url=url, tmp_path=tmp_path, pending_path=tmp_path / "pending.jsonl")
    dispatch_module.dispatcher.forget()


def run_command(*args: str, catch: bool = False) -> SimpleNamespace:
    """Invoke ``kvsplit ARGS``; stdout and stderr apart."""
    return invoke(main, *args, catch=catch)


def cpu_key(head_dim, num_splits, rows, *, stats_format="maxsum", dtype="bfloat16"):
    return tuning_key(device_facts(torch.device("cpu")), build_hash(False), head_dim, dtype,
                      dtype, stats_format, num_splits, rows)


def stored(url):
    with open_store(url) as store:
        return store.query()


# -- info -------------------------------------------------------------------------------------

def expected_device() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return "cpu"


def test_info_shows_build_hash_and_device(env):
    result = run_command("info")
    assert result.exit_code == 0, result.output
    # "name  value" lines, names padded to one width.
    lines = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1)
                 for line in result.stdout.splitlines() if line.strip())
    assert lines["build hash"] == build_hash(False)
    assert expected_device() in lines["device"]


def test_info_json(env):
    result = run_command("info", "--json")
    assert result.exit_code == 0, result.output
    facts = json.loads(result.stdout)
    assert facts["build hash"] == build_hash(False)
    assert expected_device() in facts["device"]
    assert facts["cuda kernels"].startswith("yes") == has_cuda_kernels()
    if has_cuda_kernels():
        # The runtime linked into the kernels and the driver it needs; what this machine has.
        assert re.fullmatch(r"\d+\.\d \(linked statically; needs NVIDIA driver \d+ or newer\)",
                            facts["cuda runtime"])
        assert facts["cuda driver"] == "none found" or facts["cuda driver"].startswith("CUDA ")
    else:
        # The cause and the remedy.
        assert facts["cuda kernels"] == f"no — {NO_CUDA_KERNELS}"
        assert "binary wheel" in facts["cuda kernels"] and "nvcc" in facts["cuda kernels"]
    assert facts["per-call path"].startswith("binding") == _kernel.FAST_CALL
    # On a GPU with the kernels: what kvsplit/tables holds for it.
    assert ("shipped table" in facts) == (torch.cuda.is_available() and has_cuda_kernels())


def test_info_shows_the_database_and_the_dispatch_mode(env, monkeypatch):
    """``kvsplit info`` (device, compiled architectures, database, mode)."""
    monkeypatch.setenv("KVSPLIT_MODE", "cached")
    text = run_command("info").stdout
    facts = json.dumps(json.loads(run_command("info", "--json").stdout))
    for shown in (text, facts):
        assert shown_as_given(env.url) in shown or str(env.tmp_path / "tuning.sqlite") in shown
        assert "cached" in shown


@pytest.mark.parametrize(("name", "value", "shown"), [
    ("KVSPLIT_MODE", "garbage", "mode"),
    ("KVSPLIT_MAX_SPLIT", "abc", "max kv_split"),
    ("KVSPLIT_MAX_SPLIT", "0", "max kv_split"),
    ("KVSPLIT_MAX_SPLIT", "-1", "max kv_split"),
    ("KVSPLIT_REFRESH_S", "soon", "refresh"),
    ("KVSPLIT_PDL", "yes", "pdl"),
])
def test_info_reports_an_invalid_setting_and_exits_2(env, monkeypatch, name, value, shown):
    monkeypatch.setenv(name, value)
    result = run_command("info", "--json")
    assert result.exit_code == 2, result.output
    facts = json.loads(result.stdout)
    assert facts[shown].startswith(f"invalid: {name} must be")


@pytest.mark.slow
@pytest.mark.parametrize("command", [("demo", "--device", "cpu"),
                                     ("tune", "--head-dim", "64", "--num-splits", "2", "--rows",
                                      "32", "--devices", "cpu")])
@pytest.mark.parametrize(("name", "value"), [("KVSPLIT_MODE", "garbage"), ("KVSPLIT_MAX_SPLIT", "abc"),
                                             ("KVSPLIT_MAX_SPLIT", "0"), ("KVSPLIT_PDL", "yes")])
def test_demo_and_tune_with_an_invalid_setting_exit_2_without_a_traceback(env, monkeypatch, name,
                                                                         value, command):
    monkeypatch.setenv(name, value)
    result = run_command(*command, catch=True)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.exception
    assert f"Error: {name} must be" in result.stderr and "Traceback" not in result.output


def test_info_says_what_is_wrong_with_the_database(env, tmp_path):
    assert "not created yet" in run_command("info").stdout  # and it was not created:
    assert not (tmp_path / "tuning.sqlite").exists()
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"not sqlite" * 100)
    result = run_command("info", "--db", str(garbage))
    assert result.exit_code == 3 and "corrupt or not an SQLite database" in result.stdout


# -- tune over a grid -------------------------------------------------------------------------

def test_tune_grid_is_resumable_and_force_retunes(env):
    first = run_command("tune", *GRID, "--json")
    assert first.exit_code == 0, first.output
    summary = json.loads(first.stdout)
    assert (summary["keys"], summary["tuned"], summary["skipped"], summary["failed"]) == (4, 4, 0, 0)
    assert sum(summary["winners"].values()) == 4
    assert all(label.startswith("kvsplit(kv_split=") for label in summary["winners"])
    assert summary["failures"] == [] and summary["seconds"] >= 0
    assert summary["ms_per_tuned_key"] > 0 and summary["geomean_speedup_over_k1"] >= 1.0
    records = stored(env.url)
    assert {r.key for r in records} == {cpu_key(64, n, r) for n in (8, 16) for r in (4, 8)}
    assert all(r.candidates and all(c.matched for c in r.candidates) for r in records)
    first_times = {r.key: r.updated_at for r in records}

    again = json.loads(run_command("tune", *GRID, "--json").stdout)
    assert (again["keys"], again["tuned"], again["skipped"]) == (4, 0, 4)
    assert again["winners"] == {} and again["ms_per_tuned_key"] is None
    assert {r.key: r.updated_at for r in stored(env.url)} == first_times

    forced = json.loads(run_command("tune", *GRID, "--force", "--json").stdout)
    assert (forced["keys"], forced["tuned"], forced["skipped"]) == (4, 4, 0)
    assert all(r.updated_at > first_times[r.key] for r in stored(env.url))


def test_tune_table_for_people(env):
    result = run_command("tune", *GRID)
    assert result.exit_code == 0, result.output
    for word in ("kvsplit tune", "keys", "tuned", "skipped", "winners", "speed-up over K=1"):
        assert word in result.stdout


def test_tune_buckets_the_grid_like_the_dispatcher(env, monkeypatch):
    # 7 and 8 splits share bucket 8: one key, the one a call with 7 splits looks up,
    # profiled at the first of them.
    profiled = []
    real = tuner.tune

    def spy(key, device, configs, **kwargs):
        profiled.append(kwargs.get("shape"))
        return real(key, device, configs, **kwargs)

    monkeypatch.setattr(tuner, "tune", spy)
    summary = json.loads(run_command("tune", "--devices", "cpu", "--head-dim", "64",
                                 "--num-splits", "7,8", "--rows", "3", "--json").stdout)
    assert (summary["keys"], summary["tuned"]) == (1, 1)
    assert [r.key for r in stored(env.url)] == [cpu_key(64, 8, 3)]
    assert profiled == [(3, 7)]

    # A merge of a grid shape is a database hit: no profiling in the call.
    def forbidden(*args, **kwargs):
        raise AssertionError("tuned although kvsplit tune stored this key")

    monkeypatch.setattr(tuner, "tune", forbidden)
    partial_o, stats = random_partials(7, 3, 64, generator=torch.Generator().manual_seed(0))
    kvsplit.merge_maxsum(partial_o.bfloat16(), stats, 1.0)
    decision = dispatch_module.dispatcher.explain(device_facts(torch.device("cpu")), 64,
                                                  torch.bfloat16, torch.bfloat16, 0, 7, 3)
    assert decision.source == "database"


def test_tune_spins_a_gpu_up_once_before_its_first_key(env, monkeypatch):
    """A CUDA worker keeps its GPU busy before it times anything, once a run; a CPU one never.
    (The GPU is faked: the tuner is stubbed, so no kernel runs.)"""
    from kvsplit.cli import tune as tune_cli
    from kvsplit.autotune import timing

    events = []
    monkeypatch.setattr(timing, "spin_up_gpu", lambda: events.append("spin"))
    monkeypatch.setattr(torch.cuda, "device", lambda target: contextlib.nullcontext())
    real = tuner.tune

    def stub(key, device, configs, **kwargs):
        events.append(("tune", device.type))
        return real(key, torch.device("cpu"), configs, replays=1, **kwargs)

    monkeypatch.setattr(tuner, "tune", stub)
    keys = [cpu_key(64, n, 4).model_dump_json() for n in (8, 16)]
    tune_cli._work("cuda:0", keys, env.url, "warm", False, 30.0, lambda message: None)
    assert events == ["spin", ("tune", "cuda"), ("tune", "cuda")]
    events.clear()
    tune_cli._work("cpu", keys, env.url, "warm", True, 30.0, lambda message: None)
    assert events == [("tune", "cpu"), ("tune", "cpu")]


@pytest.mark.parametrize("args, message", [
    (["--num-splits", "8,x"], "--num-splits"),
    (["--num-splits", "0"], "--num-splits"),
    (["--rows", ""], "--rows"),
    (["--rows", "-4"], "--rows"),
    (["--head-dim", "sixty"], "--head-dim"),
    (["--head-dim", "100"], "head dim 100 is not supported"),
    (["--head-dim", "128,100,2048"], "head dim 100, 2048 is not supported"),
    (["--dtype", "int8"], "--dtype"),
    (["--format", "softmax"], "--format"),
    (["--l2", "lukewarm"], "--l2"),
])
def test_tune_rejects_bad_options_with_a_clear_message(env, args, message):
    result = run_command("tune", "--devices", "cpu", *args)
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output
    assert stored(env.url) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("devices", ["cuda", "0", "all", "0,1"])
def test_tune_on_cuda_devices_without_cuda_says_so(env, devices):
    result = run_command("tune", "--devices", devices)
    assert result.exit_code == 2
    assert "--devices" in result.output and "no CUDA device" in result.output


@pytest.mark.parametrize("devices", ["cuda", "gpu", "0,x", "3", "-1"])
def test_tune_rejects_bad_devices_on_a_cuda_machine(env, monkeypatch, devices):
    # One visible GPU (only the option parsing is reached: every value here is bad).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    result = run_command("tune", "--devices", devices, catch=True)
    assert result.exit_code == 2, f"exit {result.exit_code}: {result.exception!r}"
    assert "--devices" in result.output


def test_tune_with_a_bad_database_url_fails_with_the_stores_message(env, tmp_path):
    not_a_db = tmp_path / "garbage.sqlite"
    not_a_db.write_bytes(b"definitely not sqlite" * 64)
    result = run_command("tune", *GRID, "--db", f"sqlite:///{not_a_db}")
    assert result.exit_code == 3 and "Traceback" not in result.output
    assert "garbage.sqlite" in result.output


# -- tune as one worker of a fleet -----------------------------------------------------------

def test_tune_status_shows_the_grids_progress_and_tunes_nothing(env, monkeypatch):
    missing = run_command("tune", *GRID, "--status", "--json")  # it only reads: no new file
    assert missing.exit_code == 3 and "no such database file" in missing.output, missing.output
    assert not (env.tmp_path / "tuning.sqlite").exists()
    assert run_command("tune", "--devices", "cpu", "--head-dim", "64", "--num-splits", "8", "--rows", "4",
                       "--json").exit_code == 0
    before = json.loads(run_command("tune", *GRID, "--status", "--json").stdout)
    assert (before["keys"], before["done"], before["claimed"], before["failed"],
            before["left"]) == (4, 1, 0, 0, 3)
    assert run_command("tune", "--devices", "cpu", "--head-dim", "64", "--num-splits", "8", "--rows", "8",
                   "--json").exit_code == 0

    def forbidden(*args, **kwargs):
        raise AssertionError("--status tuned a key")

    monkeypatch.setattr(tuner, "tune", forbidden)
    after = json.loads(run_command("tune", *GRID, "--status", "--json").stdout)
    assert (after["done"], after["left"], after["attempts"]) == (2, 2, 2)
    text = run_command("tune", *GRID, "--status").stdout
    assert "4 keys: 2 done, 0 claimed, 0 failed, 2 left" in text


def test_db_progress_shows_every_registered_key_and_why_one_failed(env, monkeypatch):
    real = tuner.tune

    def failing(key, *args, **kwargs):
        if key.num_splits == 16 and key.rows == 8:
            raise RuntimeError("simulated launch failure")
        return real(key, *args, **kwargs)

    monkeypatch.setattr(tuner, "tune", failing)
    assert run_command("tune", *GRID, "--json").exit_code == 1
    for args in (["db", "progress", "--db", env.url, "--json"], ["--db", env.url, "db", "progress", "--json"]):
        result = run_command(*args)
        assert result.exit_code == 0, result.output
        progress = json.loads(result.stdout)
        assert (progress["keys"], progress["done"], progress["failed"], progress["left"]) == (4, 3, 1, 0)
        (failure,) = progress["failures"]
        assert failure["error"] == "RuntimeError: simulated launch failure"
        assert failure["owner"].endswith(f"/{os.getpid()}/cpu")
    text = run_command("db", "progress").stdout
    assert "failed on" in text and "simulated launch failure" in text
    # A new run tries the failed key again (the failure was before it started).
    monkeypatch.setattr(tuner, "tune", real)
    again = json.loads(run_command("tune", *GRID, "--json").stdout)
    assert (again["tuned"], again["skipped"], again["failed"]) == (1, 3, 0)


def test_tune_waits_for_a_live_claim_and_takes_it_over_once_its_lease_runs_out(env):
    from kvsplit.db import Claims

    key = cpu_key(64, 16, 8)
    with open_store(env.url) as store:
        claims = Claims(store)
        held = claims.claim_next([key], "lost-host/4242/cuda:0", 1.0, run_started=claims.now()).claim
    assert held is not None
    result = run_command("tune", *GRID, "--json", "--lease", "1")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert (summary["keys"], summary["tuned"]) == (4, 4)
    assert summary["taken_over"] == [{"key": json.loads(key.model_dump_json()), "from": "lost-host/4242/cuda:0"}]
    people = run_command("tune", *GRID, "--force", "--lease", "1")
    assert "taken over" not in people.stdout  # nothing to take over this time


@pytest.mark.parametrize("lease", ["0", "-1", "soon"])
def test_tune_refuses_a_lease_too_short_to_renew(env, lease):
    result = run_command("tune", *GRID, "--lease", lease)
    assert result.exit_code == 2 and "--lease" in result.output


# -- tune --pending -----------------------------------------------------------------------------

def test_tune_pending_tunes_the_pending_keys_and_clears_them(env):
    keys = [cpu_key(64, 8, 4), cpu_key(128, 24, 12, stats_format="lse")]
    for key in keys:
        pending.add(key)
    pending.add(keys[0])  # met again: written once
    assert pending.load() == keys
    summary = json.loads(run_command("tune", "--pending", "--devices", "cpu", "--json").stdout)
    assert (summary["keys"], summary["tuned"], summary["failed"]) == (2, 2, 0)
    assert sorted((r.key for r in stored(env.url)), key=lambda k: k.head_dim) == keys
    assert pending.load() == []

    nothing = json.loads(run_command("tune", "--pending", "--devices", "cpu", "--json").stdout)
    assert (nothing["keys"], nothing["tuned"]) == (0, 0)


def test_tune_pending_keeps_the_keys_that_failed(env):
    good, bad = cpu_key(64, 8, 4), cpu_key(100, 8, 4)  # 200 bytes: not whole 16-byte vectors
    pending.add(good)
    pending.add(bad)
    result = run_command("tune", "--pending", "--devices", "cpu", "--json")
    assert result.exit_code == 1
    summary = json.loads(result.stdout)
    assert (summary["tuned"], summary["failed"]) == (1, 1)
    assert summary["failures"][0]["key"]["head_dim"] == 100 and "head_dim" in summary["failures"][0]["error"]
    assert pending.load() == [bad]
    assert [r.key for r in stored(env.url)] == [good]


def test_tune_summary_for_people_has_no_none_and_failed_keys_in_words(env):
    pending.add(cpu_key(100, 8, 4))  # 200 bytes: not whole 16-byte vectors
    result = run_command("tune", "--pending", "--devices", "cpu")
    assert result.exit_code == 1
    assert "None" not in result.stdout and "ms_per_tuned_key" in result.stdout
    failed = [line for line in result.stderr.splitlines() if line.startswith("failed")]
    assert failed and failed[0].startswith("failed D=100 bfloat16->bfloat16 maxsum num_splits=8 rows=4 on ")
    assert "{" not in failed[0] and "head_dim" in failed[0]


def test_tune_takes_db_before_the_command_too(env, tmp_path):
    url = f"sqlite:///{tmp_path / 'elsewhere.sqlite'}"
    result = run_command("--db", url, "tune", "--devices", "cpu", "--head-dim", "64", "--num-splits", "8",
                     "--rows", "4", "--json")
    assert result.exit_code == 0, result.output
    assert len(stored(url)) == 1 and not (tmp_path / "tuning.sqlite").exists()


def test_tune_pending_does_not_store_another_devices_key_measured_here(env):
    """A key met on an H200 and tuned with --devices cpu must not get CPU timings under the H200."""
    h200 = cpu_key(64, 8, 4).model_copy(update={"device": DeviceInfo(
        name="NVIDIA H200", cc_major=9, cc_minor=0, sm_count=132)})
    pending.add(h200)
    run_command("tune", "--pending", "--devices", "cpu", "--json")
    with open_store(env.url) as store:
        assert store.get(h200) is None


# -- the CPU end-to-end flow ---------------------------------------------------------------------

def run_demo(env) -> subprocess.CompletedProcess:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("KVSPLIT_")}
    child_env.update(KVSPLIT_DB=env.url, KVSPLIT_PENDING=str(env.pending_path))
    return subprocess.run([sys.executable, "-P", "-m", "kvsplit", "demo", "--device", "cpu"],
                          env=child_env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_demo_tunes_once_then_a_new_process_reuses_the_stored_choice(env):
    first = run_demo(env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "(tuned)" in first.stdout and "profiled the candidate configs" in first.stdout
    assert f"stored in {shown_as_given(env.url)}" in first.stdout
    assert first.stdout.rstrip().endswith("OK")
    records = stored(env.url)
    assert len(records) == 1 and records[0].key.head_dim == 512

    second = run_demo(env)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "(database)" in second.stdout and "reused the stored choice" in second.stdout
    assert "profiled" not in second.stdout and "stored in" not in second.stdout
    assert second.stdout.rstrip().endswith("OK")
    chosen = [line for line in second.stdout.splitlines() if line.startswith("chosen config")]
    assert chosen and f"= {records[0].winner.label} " in chosen[0]
    assert len(stored(env.url)) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_demo_on_cuda_without_cuda_is_a_usage_error():
    result = run_command("demo", "--device", "cuda")
    assert result.exit_code == 2 and "torch sees no CUDA device" in result.stderr
    assert "internal error" not in result.output
