"""The pending-keys file (``KVSPLIT_PENDING``) when it is not what kvsplit wrote.

A FIFO or a device is never opened, for reading (``kvsplit tune --pending``,
exit 2) or for appending (a capture's key: skipped, the in-memory set still
has it); more than 16 MiB is not read; a line that is not a key (not UTF-8,
not JSON) is skipped with one warning.  The special files run the real
command in a subprocess with a timeout, so that a regression fails instead
of hanging or reading /dev/zero into memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch

from kvsplit import files
from kvsplit.config import build_hash
from kvsplit.dispatch import pending
from kvsplit.dispatch.device import device_facts
from kvsplit.dispatch.keys import tuning_key


def cpu_key(rows: int):
    return tuning_key(device_facts(torch.device("cpu")), build_hash(False), 64, "bfloat16", "bfloat16",
                      "maxsum", 8, rows)


def tune_pending(tmp_path, pending_file, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVSPLIT_PENDING": str(pending_file), "KVSPLIT_DB": str(tmp_path / "t.sqlite")}
    return subprocess.run([sys.executable, "-P", "-m", "kvsplit", "tune", "--pending", "--devices", "cpu"],
                          env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("kind", ["dev-zero", "fifo"])
def test_tune_pending_refuses_a_device_or_a_fifo(tmp_path, kind):
    path = tmp_path / "pending.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    result = tune_pending(tmp_path, path, timeout=90)
    assert result.returncode == 2, result.stderr
    what = "a FIFO" if kind == "fifo" else "a character device"
    assert f"the pending-keys file {path} is {what}, not a regular file" in result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr


def test_a_pending_file_over_the_limit_is_refused(isolated):
    with isolated.pending_path.open("wb") as stream:
        stream.truncate(files.PENDING_LIMIT + 1)
    with pytest.raises(files.InputRefused, match="is larger than 16 MiB"):
        pending.load()
    pending.add(cpu_key(4))  # a full file takes no more keys; memory still has it
    assert isolated.pending_path.stat().st_size == files.PENDING_LIMIT + 1
    assert cpu_key(4) in pending._keys


def test_lines_that_are_not_keys_are_skipped_with_one_warning(isolated):
    keys = [cpu_key(4), cpu_key(8)]
    lines = [b"\xef\xbb\xbf" + keys[0].model_dump_json().encode(), b"\xff\xfe not UTF-8 \x9b",
             b'{"head_dim": 64}', b"", keys[1].model_dump_json().encode(), b"[1, 2"]
    isolated.pending_path.write_bytes(b"\n".join(lines) + b"\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert pending.load() == keys
    assert [str(w.message) for w in caught] == [
        f"the pending-keys file {isolated.pending_path}: skipped 3 lines that are not tuning keys "
        f"(clearing the tuned keys drops them)"]


def test_tune_pending_with_invalid_utf8_is_no_internal_error(tmp_path):
    path = tmp_path / "pending.jsonl"
    path.write_bytes(b"\xff\xfe\x00garbage\n" + cpu_key(4).model_dump_json().encode() + b"\n")
    result = tune_pending(tmp_path, path)
    assert result.returncode == 0, result.stderr
    assert "internal error" not in result.stderr and "skipped 1 line that is not a tuning key" in result.stderr
    assert path.read_bytes() == b""  # the key was tuned, the garbage dropped


@pytest.mark.parametrize("kind", ["fifo", "dev-null"])
def test_a_capture_never_blocks_on_or_writes_to_a_special_pending_file(isolated, kind):
    path = isolated.pending_path
    if kind == "fifo":
        os.mkfifo(path)  # no reader: opening it to write would block forever
    else:
        path.symlink_to("/dev/null")
    adder = threading.Thread(target=pending.add, args=(cpu_key(4),), daemon=True)
    adder.start()
    adder.join(timeout=30)
    assert not adder.is_alive(), "pending.add blocked on a FIFO"
    assert cpu_key(4) in pending._keys
    pending.clear([])  # rewriting the file is refused the same way
    assert path.is_fifo() if kind == "fifo" else path.is_symlink()


def test_the_pending_file_round_trips_through_a_symlink(isolated, tmp_path):
    real = tmp_path / "real.jsonl"
    real.write_bytes(b"")
    isolated.pending_path.symlink_to(real)
    pending.add(cpu_key(4))
    assert [json.loads(line)["rows"] for line in real.read_text().splitlines()] == [4]
    assert pending.load() == [cpu_key(4)]
