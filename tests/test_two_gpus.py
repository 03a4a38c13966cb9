"""Two GPUs of one host. Every test here skips on a machine with fewer than two.

- a merge of tensors on cuda:1 while cuda:0 is current runs on device 1's
  current stream (ordered after earlier work there) and is right; the same
  merge captured in a CUDA graph on device 1 and replayed on new values;
- ``kvsplit tune --devices 0,1`` runs a worker per GPU: no key tuned twice,
  the JSON summary agrees with the database;
- two workers on the two GPUs and a third process share one grid through the
  fleet claims.
(Tensors on two GPUs in one call are refused in tests/test_merge_validation.py.)
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile

import pytest
import sqlalchemy as sa
import torch

import kvsplit

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two GPUs")]

CONFIGS = ["4", "dsplit:2:4:8", "few:2"]  # KVSPLIT_MODE: one config of each family, no tuning


def problem(seed: int, num_splits=16, rows=64, head_dim=128):
    """bf16 partials and base-2 LSE on the CPU, with their float64 merge."""
    gen = torch.Generator().manual_seed(seed)
    o = torch.randn(num_splits, rows, head_dim, generator=gen).bfloat16()
    lse = 3 * torch.randn(num_splits, rows, generator=gen)
    weights = torch.softmax(lse.double() * math.log(2.0), dim=0)
    return o, lse, (weights.unsqueeze(-1) * o.double()).sum(0)


def assert_merged(out: torch.Tensor, reference: torch.Tensor) -> None:
    torch.testing.assert_close(out.cpu().double(), reference, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("mode", CONFIGS)
def test_a_merge_on_cuda1_runs_on_its_current_stream_while_cuda0_is_current(mode, monkeypatch):
    monkeypatch.setenv("KVSPLIT_MODE", mode)
    o, lse, reference = problem(1)
    source_o, source_lse = o.to("cuda:1"), lse.to("cuda:1")
    o1, lse1 = torch.zeros_like(source_o), torch.zeros_like(source_lse)
    out = torch.zeros(o.shape[1:], dtype=torch.bfloat16, device="cuda:1")
    torch.cuda.synchronize(1)
    side = torch.cuda.Stream(device=1)
    torch.cuda.set_stream(side)  # device 1's current stream (this makes device 1 current too)
    torch.cuda.set_device(0)
    try:
        assert torch.cuda.current_device() == 0 and torch.cuda.current_stream(1) == side
        with torch.cuda.device(1):  # on `side`: a long wait, then the real inputs
            torch.cuda._sleep(200_000_000)
            o1.copy_(source_o)
            lse1.copy_(source_lse)
        torch.cuda.set_device(0)
        kvsplit.merge_lse(o1, lse1, base=2.0, out=out)
        assert torch.cuda.current_device() == 0
        side.synchronize()
        # On any other stream the merge would have read the zeros before the copies.
        assert_merged(out, reference)
    finally:
        torch.cuda.set_stream(torch.cuda.default_stream(1))
        torch.cuda.set_device(0)


@pytest.mark.parametrize("mode", CONFIGS)
def test_a_merge_captured_in_a_graph_on_cuda1_replays_on_new_values(mode, monkeypatch):
    monkeypatch.setenv("KVSPLIT_MODE", mode)
    o, lse, _ = problem(2)
    with torch.cuda.device(1):
        o1, lse1 = o.to("cuda:1"), lse.to("cuda:1")
        out = torch.empty(o.shape[1:], dtype=torch.bfloat16, device="cuda:1")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture (launches, allocations)
            kvsplit.merge_lse(o1, lse1, base=2.0, out=out)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            kvsplit.merge_lse(o1, lse1, base=2.0, out=out)
        new_o, new_lse, new_reference = problem(3)
        o1.copy_(new_o)
        lse1.copy_(new_lse)
        graph.replay()
        torch.cuda.synchronize(1)
    assert_merged(out, new_reference)


GRID = ["--head-dim", "128", "--dtype", "bfloat16", "--format", "lse", "--num-splits", "16,32",
        "--rows", "32,64,128"]
KEYS = 6


def tune(db_url: str, devices: str, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSPLIT_")}
    return subprocess.Popen([sys.executable, "-P", "-m", "kvsplit", "tune", "--db", db_url,
                             "--devices", devices, *GRID, "--json", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=tempfile.gettempdir())


def finish(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "locked" not in err, err
    return json.loads(out)


def counts(db_url: str) -> tuple[int, int]:
    """(stored results, claim attempts over all keys)."""
    engine = sa.create_engine(db_url)
    with engine.connect() as conn:
        results = conn.exec_driver_sql("SELECT COUNT(*) FROM tuning_results").scalar_one()
        attempts = conn.exec_driver_sql("SELECT COALESCE(SUM(attempts), 0) FROM tuning_claims").scalar_one()
    engine.dispose()
    return results, attempts


def test_tune_on_both_gpus_tunes_every_key_once(tmp_path, capsys):
    db_url = f"sqlite:///{tmp_path / 'two.sqlite'}"
    summary = finish(tune(db_url, "0,1"))
    assert (summary["keys"], summary["tuned"], summary["failed"]) == (KEYS, KEYS, 0)
    assert counts(db_url) == (KEYS, KEYS)
    with capsys.disabled():
        print(f"\ntune --devices 0,1: {summary['tuned']} tuned, {summary['skipped']} skipped, "
              f"{KEYS} stored, {KEYS} claim attempts, {summary['seconds']} s")


def test_two_gpus_and_a_third_process_share_one_grid(tmp_path, capsys):
    db_url = f"sqlite:///{tmp_path / 'fleet.sqlite'}"
    finish(tune(db_url, "0", "--status"))  # creates the schema before the workers race
    workers = [tune(db_url, "0"), tune(db_url, "1"), tune(db_url, "0")]
    summaries = [finish(proc) for proc in workers]
    tuned = [s["tuned"] for s in summaries]
    assert sum(tuned) == KEYS and all(s["failed"] == 0 for s in summaries)
    assert all(s["tuned"] + s["skipped"] == KEYS for s in summaries)
    assert counts(db_url) == (KEYS, KEYS)
    with capsys.disabled():
        print(f"\nthree workers (cuda:0, cuda:1, cuda:0) on one database: tuned {tuned}, "
              f"{KEYS} stored, {KEYS} claim attempts")
