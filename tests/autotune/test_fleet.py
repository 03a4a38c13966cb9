"""Fleet tuning: worker processes share one grid through the database, on SQLite and PostgreSQL.

Each worker is a process of its own running the real ``kvsplit tune`` command
line (tests/autotune/fleetlib.py), as a host of a fleet would, against one
database URL; they start together on a small CPU grid, each key made slower
to tune so that they overlap. What must hold: every key tuned exactly once
(the stored results, the claims' attempts and the workers' JSON summaries
agree), no lock errors; a worker killed with SIGKILL while it holds a claim
loses that key to another once its lease runs out, and nothing is lost or
tuned twice; a serving process started before the tuning uses the new
winner within its refresh bound. Each test prints its figures.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
import sqlalchemy as sa

from kvsplit.db import open_store

FLEETLIB = Path(__file__).resolve().parent / "fleetlib.py"
GRID = ["--devices", "cpu", "--head-dim", "64", "--num-splits", "4,8,16", "--rows", "1,2,4,8"]
KEYS = 12
LEASE_S = 2.0
REFRESH_S = 1.0
SERVED_SHAPE = (64, 16, 8)  # a key of the grid


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSPLIT_")}
    return env | {"KVSPLIT_PENDING": str(tmp / "pending.jsonl"), "XDG_CACHE_HOME": str(tmp / "cache")} | extra


class Fleet:
    """Processes of fleetlib.py, their job files and their output files, in ``tmp``."""

    def __init__(self, url: str, tmp: Path):
        self.url, self.tmp = url, tmp
        self.procs: dict[str, subprocess.Popen] = {}

    def spawn(self, name: str, job: dict, env: dict[str, str] | None = None) -> subprocess.Popen:
        path = self.tmp / f"{name}.json"
        path.write_text(json.dumps(job | {"ready": str(self.tmp / f"{name}.ready")}))
        with open(self.tmp / f"{name}.out", "w") as out, open(self.tmp / f"{name}.err", "w") as err:
            # -P and another directory: the installed kvsplit is imported, not the source tree.
            proc = subprocess.Popen([sys.executable, "-P", str(FLEETLIB), str(path)], stdout=out, stderr=err,
                                    env=env or _env(self.tmp), cwd=tempfile.gettempdir())
        self.procs[name] = proc
        return proc

    def worker(self, name: str, start: str, *, delay_s: float = 0.3, hold_s: float | None = None,
               force: bool = False) -> subprocess.Popen:
        argv = ["tune", "--db", self.url, *GRID, "--lease", str(LEASE_S), "--json", *(["--force"] if force else [])]
        return self.spawn(name, {"role": "worker", "start": str(self.tmp / start), "delay_s": delay_s,
                                 "hold_s": hold_s, "argv": argv})

    def wait_ready(self, *names: str, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        for name in names:
            while not (self.tmp / f"{name}.ready").exists():
                assert self.procs[name].poll() is None, self.output(name)
                assert time.monotonic() < deadline, f"{name} never got ready"
                time.sleep(0.05)

    def release(self, start: str) -> None:
        (self.tmp / start).write_text("go")

    def finish(self, *names: str, timeout_s: float = 240.0) -> dict[str, int]:
        return {name: self.procs[name].wait(timeout=timeout_s) for name in names}

    def output(self, name: str) -> str:
        return (self.tmp / f"{name}.out").read_text() + (self.tmp / f"{name}.err").read_text()

    def summary(self, name: str) -> dict:
        return json.loads((self.tmp / f"{name}.out").read_text())

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def fleet(db_url, tmp_path):
    running = Fleet(db_url, tmp_path)
    yield running
    running.close()


def _claims(url: str) -> list[dict]:
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        rows = [dict(r) for r in conn.execute(sa.text(
            "SELECT key, state, owner, attempts, claimed_at FROM tuning_claims ORDER BY id")).mappings()]
    engine.dispose()
    return rows


def _counts(url: str) -> tuple[int, int, int]:
    """(stored results, claim rows, attempts over all claims)."""
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        results = conn.exec_driver_sql("SELECT COUNT(*) FROM tuning_results").scalar_one()
        claims, attempts = conn.exec_driver_sql("SELECT COUNT(*), SUM(attempts) FROM tuning_claims").one()
    engine.dispose()
    return results, claims, attempts


def _assert_clean(fleet: Fleet, names) -> None:
    for name in names:
        text = fleet.output(name)
        assert "Traceback" not in text and "locked" not in text and "Error" not in text, f"{name}: {text}"


def _when(value) -> float:
    if isinstance(value, str):  # SQLite keeps text
        value = datetime.fromisoformat(value)
    return value.replace(tzinfo=timezone.utc).timestamp() if value.tzinfo is None else value.timestamp()


@pytest.mark.slow
@pytest.mark.parametrize("workers", [6])
def test_workers_on_one_database_tune_every_key_once_and_serving_sees_the_winners(fleet, db_url, workers, capsys):
    open_store(db_url).close()  # the schema first: racing creators are test_concurrency's business
    serve_env = _env(fleet.tmp, KVSPLIT_DB=db_url, KVSPLIT_MODE="cached", KVSPLIT_REFRESH_S=str(REFRESH_S))
    fleet.spawn("serve", {"role": "serve", "shape": SERVED_SHAPE, "timeout_s": 240}, env=serve_env)
    names = [f"worker{i}" for i in range(workers)]
    for name in names:
        fleet.worker(name, "start")
    fleet.wait_ready("serve", *names)  # the server has merged once (heuristic: nothing stored yet)
    began = time.monotonic()
    fleet.release("start")
    codes = fleet.finish(*names)
    wall = time.monotonic() - began
    assert codes == dict.fromkeys(names, 0), {n: fleet.output(n) for n in names}
    _assert_clean(fleet, names)

    summaries = {name: fleet.summary(name) for name in names}
    tuned = {name: s["tuned"] for name, s in summaries.items()}
    assert all(s["keys"] == KEYS and s["tuned"] + s["skipped"] == KEYS and s["failed"] == 0
               for s in summaries.values()), summaries
    assert sum(tuned.values()) == KEYS
    assert sum(1 for n in tuned.values() if n) >= 2, tuned  # they shared the grid
    results, claims, attempts = _counts(db_url)
    assert (results, claims, attempts) == (KEYS, KEYS, KEYS)
    assert {c["state"] for c in _claims(db_url)} == {"done"}

    assert fleet.finish("serve") == {"serve": 0}, fleet.output("serve")
    events = [json.loads(line) for line in (fleet.tmp / "serve.out").read_text().splitlines()]
    assert events[0]["source"] == "heuristic" and events[-1]["source"] == "database"
    with open_store(db_url) as store:
        head_dim, num_splits, rows = SERVED_SHAPE
        (record,) = store.query(head_dim=head_dim, num_splits=num_splits, rows=rows)
    assert events[-1]["config"] == record.winner.label and events[-1]["launches"] == [record.winner.label]
    lag = events[-1]["t"] - record.updated_at.timestamp()
    assert 0 <= lag <= REFRESH_S + 1.5, lag
    with capsys.disabled():
        backend = db_url.split(":", 1)[0]
        print(f"\n[fleet {backend}] {workers} workers, {KEYS} keys: tuned per worker {sorted(tuned.values())}, "
              f"{results} results stored, {attempts} attempts, {wall:.1f} s; the serving process used the "
              f"new winner of its shape {lag:.2f} s after it was stored (KVSPLIT_REFRESH_S={REFRESH_S:g})")


@pytest.mark.slow
def test_a_killed_workers_key_is_taken_over_once_its_lease_runs_out(fleet, db_url, capsys):
    workers = 6 if db_url.startswith("postgresql") else 2  # the shorter version on SQLite
    open_store(db_url).close()
    victim = fleet.worker("victim", "victim.start", hold_s=600.0)
    names = [f"worker{i}" for i in range(workers - 1)]
    for name in names:
        fleet.worker(name, "start")
    fleet.wait_ready("victim", *names)
    fleet.release("victim.start")  # a head start: it claims a key before the others take them all
    deadline = time.monotonic() + 60
    held = []
    while not held:
        assert time.monotonic() < deadline, fleet.output("victim")
        held = [c for c in _claims(db_url) if c["state"] == "claimed" and f"/{victim.pid}/" in c["owner"]]
        time.sleep(0.05)
    fleet.release("start")
    time.sleep(0.5)  # the others are at work: kill the victim in the middle of the grid
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.time()
    began = time.monotonic()
    codes = fleet.finish(*names)
    assert codes == dict.fromkeys(names, 0), {n: fleet.output(n) for n in names}
    assert victim.wait() == -signal.SIGKILL
    _assert_clean(fleet, names)

    summaries = [fleet.summary(name) for name in names]
    taken = [t for s in summaries for t in s["taken_over"]]
    assert len(taken) == 1 and f"/{victim.pid}/" in taken[0]["from"], taken
    assert sum(s["tuned"] for s in summaries) == KEYS  # the victim stored nothing
    results, claims, attempts = _counts(db_url)
    assert (results, claims, attempts) == (KEYS, KEYS, KEYS + 1)  # one more attempt: the victim's
    (victims_key,) = [c for c in _claims(db_url) if c["key"] == held[0]["key"]]
    assert victims_key["state"] == "done" and victims_key["attempts"] == 2
    takeover_s = _when(victims_key["claimed_at"]) - killed
    assert 0 < takeover_s <= LEASE_S + 2.0, takeover_s  # the lease, one poll, and a loaded machine
    with capsys.disabled():
        backend = db_url.split(":", 1)[0]
        print(f"\n[fleet kill {backend}] {workers} workers, {KEYS} keys, one killed holding a claim: "
              f"{sum(s['tuned'] for s in summaries)} tuned by the others, {results} results stored, "
              f"{attempts} attempts, its key taken over {takeover_s:.2f} s after the kill "
              f"(lease {LEASE_S:g} s); the rest finished {time.monotonic() - began:.1f} s after it")
