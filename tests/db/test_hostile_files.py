"""``kvsplit db import`` of files that are not what they claim: special files, huge files, bad bytes.

What is promised: only a regular file (a symlink to one is fine) or stdin is
read, at most 64 MiB of it; a FIFO, a device or a directory is refused
without being opened; text that is not UTF-8, a key twice in one object or a
file over the limit is invalid input (exit 2, nothing written, not even the
database file); a byte-order mark is accepted; a file of many bad records
shows five problems and one line counting the rest.  Random bytes never make
an internal error.  The special files run in a subprocess with a timeout, so
that a regression fails instead of hanging or eating the machine's memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import unicodedata
from pathlib import Path
from types import SimpleNamespace

import pytest
from clirun import invoke
from dbtestlib import make_record
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvsplit import files
from kvsplit.db import open_store
from kvsplit.export import InvalidExportError, dump_export, make_export, parse_export
from kvsplit import export_text
from kvsplit.cli.db import db

LIMIT_TEXT = "64 MiB"
# Lines of a refused import: "Error: ...", five problems, the count of the rest.
MAX_ERROR_LINES = 7


def run(*args: str, input: bytes | None = None) -> SimpleNamespace:
    return invoke(db, *args, input=input)


def kvsplit_process(*args: str, stdin=None, timeout: float = 120) -> subprocess.CompletedProcess:
    """The real command in a child process: a regression that reads forever times out."""
    return subprocess.run([sys.executable, "-P", "-m", "kvsplit", *args], stdin=stdin if stdin is not None
                          else subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)


def export_bytes(records=None) -> bytes:
    records = records if records is not None else [make_record(rows=1), make_record(rows=2, winner=2)]
    return dump_export(make_export(records)).encode()


def no_control(text: str) -> bool:
    """Nothing a terminal would act on: no control character but the line break."""
    return not any(unicodedata.category(c) == "Cc" and c != "\n" for c in text)


def assert_refused(result, target: Path, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr
    assert not target.exists()  # nothing written, not even an empty database


# -- special files ----------------------------------------------------------------------------


def test_a_symlink_to_dev_zero_is_refused_unread(tmp_path):
    link = tmp_path / "tuning.json"
    link.symlink_to("/dev/zero")
    target = tmp_path / "t.sqlite"
    result = kvsplit_process("db", "--db", str(target), "import", str(link), timeout=60)
    assert_refused(result, target, "is a character device, not a regular file")


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "tuning.json"
    os.mkfifo(fifo)
    target = tmp_path / "t.sqlite"
    result = kvsplit_process("db", "--db", str(target), "import", str(fifo), timeout=60)
    assert_refused(result, target, "is a FIFO, not a regular file")


def test_a_fifo_is_never_opened(tmp_path, monkeypatch):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(path) or real_open(path, *a, **k))
    with pytest.raises(files.InputRefused, match="FIFO"):
        files.read_regular(fifo, files.IMPORT_LIMIT)
    with pytest.raises(files.InputRefused, match="FIFO"):
        files.open_regular_for_writing(fifo, append=True)
    assert opened == []


def test_a_directory_and_a_missing_file_are_invalid_input(tmp_path):
    target = tmp_path / "t.sqlite"
    directory = run("--db", str(target), "import", str(tmp_path))
    assert directory.exit_code == 2 and "is a directory, not a regular file" in directory.stderr
    missing = run("--db", str(target), "import", str(tmp_path / "missing.json"))
    assert missing.exit_code == 2 and "No such file or directory" in missing.stderr
    assert not target.exists()


def test_a_file_over_the_limit_is_refused_unread(tmp_path, monkeypatch):
    big = tmp_path / "big.json"
    with big.open("wb") as stream:  # sparse: no disk used
        stream.truncate(files.IMPORT_LIMIT + 1)
    monkeypatch.setattr(files, "read_capped", lambda *a, **k: pytest.fail("read a file over the limit"))
    target = tmp_path / "t.sqlite"
    result = run("--db", str(target), "import", str(big))
    assert result.exit_code == 2
    assert f"big.json is larger than {LIMIT_TEXT}, the most kvsplit reads of it" in result.stderr
    assert not target.exists()


def test_a_file_at_the_limit_is_read(tmp_path):
    # The limit is a size, not a format: 64 MiB of blanks around an empty export is accepted.
    text = b'{"records": []}'
    exact = tmp_path / "exact.json"
    exact.write_bytes(text + b" " * (files.IMPORT_LIMIT - len(text)))
    assert parse_export(exact).records == []


def test_stdin_from_dev_zero_stops_at_the_limit(tmp_path):
    target = tmp_path / "t.sqlite"
    with open("/dev/zero", "rb") as zero:
        result = kvsplit_process("db", "--db", str(target), "import", "-", stdin=zero, timeout=60)
    assert_refused(result, target, f"standard input is larger than {LIMIT_TEXT}")


def test_a_regular_file_longer_than_its_size_says_is_cut_at_the_limit():
    # /proc files are regular and say 0 bytes (as a file growing after the stat would):
    # the read itself stops at the limit plus one byte.
    assert os.stat("/proc/self/status").st_size == 0
    with pytest.raises(files.InputRefused, match="larger than 16 bytes"):
        files.read_regular("/proc/self/status", 16)


# -- bytes and JSON -----------------------------------------------------------------------------


def test_a_byte_order_mark_is_accepted_from_a_file_and_from_stdin(tmp_path):
    data = b"\xef\xbb\xbf" + export_bytes()
    path = tmp_path / "bom.json"
    path.write_bytes(data)
    target = f"sqlite:///{tmp_path / 't.sqlite'}"
    assert json.loads(run("--db", target, "import", str(path), "--json").stdout)["inserted"] == 2
    again = json.loads(run("--db", target, "import", "-", "--json", input=data).stdout)
    assert again["kept"] == 2
    assert len(parse_export(data.decode("utf-8")).records) == 2  # a str with U+FEFF too


def test_invalid_utf8_is_invalid_input(tmp_path):
    data = export_bytes().replace(b"NVIDIA H200", b"NVIDIA H\xff00", 1)
    path = tmp_path / "latin1.json"
    path.write_bytes(data)
    target = tmp_path / "t.sqlite"
    result = run("--db", str(target), "import", str(path))
    assert result.exit_code == 2 and "file: not UTF-8 text (byte 0xff at offset" in result.stderr
    assert not target.exists()


@pytest.mark.parametrize(("edit", "problem"), [
    # The probe: "records" twice, the last empty, was "inserted 0", exit 0.
    (lambda t: t.rstrip().removesuffix("}") + ', "records": []}', 'file: key "records" appears twice'),
    (lambda t: t.replace('"rows": 1}', '"rows": 1, "rows": 7}', 1), 'record 0: key: key "rows" appears twice'),
    (lambda t: t.replace('"name": "NVIDIA H200"', '"name": "x", "name": "NVIDIA H200"', 1),
     'record 0: key.device: key "name" appears twice'),
    (lambda t: t.replace('"kv_split": 2', '"kv_split": 2, "kv_split": 2', 1),
     'record 0: candidates.1.config.params: key "kv_split" appears twice'),
])
def test_a_key_twice_in_one_object_is_invalid(tmp_path, edit, problem):
    text = edit(json.dumps(json.loads(export_bytes())))
    with pytest.raises(InvalidExportError) as info:
        parse_export(text)
    assert problem in info.value.problems
    target = tmp_path / "t.sqlite"
    assert run("--db", str(target), "import", "-", input=text.encode()).exit_code == 2
    assert not target.exists()


def test_a_record_over_the_value_limit_is_not_parsed(monkeypatch):
    text = '{"records": [{"candidates": [' + ",".join(["0"] * (export_text.VALUE_LIMIT // 2)) + "]}]}"
    with pytest.raises(InvalidExportError) as info:
        parse_export(text)
    assert info.value.problems == ["record 0: larger than 256 KiB of JSON (a tuning record is a few KiB)"]


def test_an_unterminated_string_is_scanned_once():
    # Searching each of its 4 million quotes again for a string end was quadratic: hours, not a second.
    code = ("from kvsplit.export import InvalidExportError, parse_export\n"
            "try:\n    parse_export('{\"records\": [{\"a\": \"' + '\\\\\"' * 4_000_000)\n"
            "except InvalidExportError as error:\n    print(error.problems)\n")
    problems = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120,
                              check=True).stdout
    assert "record 0: larger than 256 KiB" in problems and "invalid JSON" in problems


def test_nesting_too_deep_is_invalid_json():
    with pytest.raises(InvalidExportError, match="nested too deeply"):
        parse_export('{"records": [' + "[" * 100_000 + "]" * 100_000 + "]}")


def test_many_bad_records_show_five_problems_and_a_count(tmp_path):
    good = json.loads(export_bytes())["records"][0]
    good["candidates"] = []  # a table of winners only: about 400 bytes a record
    records = [{**good, "key": {**good["key"], "rows": 1 + i}, "colour": "red"} for i in range(20_000)]
    data = json.dumps({"format": "kvsplit-tuning", "version": 1, "records": records}).encode()
    target = tmp_path / "t.sqlite"
    result = run("--db", str(target), "import", "-", input=data)
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert lines[0] == "Error: invalid tuning export, nothing was written:"
    assert lines[1:6] == [f"  record {i}: colour: Extra inputs are not permitted" for i in range(5)]
    assert lines[6:] == ["  ... and 19,995 more problems in 19,995 more records"]
    with pytest.raises(InvalidExportError) as info:
        parse_export(data)
    assert (len(info.value.problems), info.value.total, info.value.invalid_records) == (100, 20_000, 20_000)


def test_many_bad_records_take_little_memory():
    # One pydantic call over the whole file took about 1.5 GB for 2 MiB of this; record by record, ~0.
    code = (
        "import resource, sys\n"
        "from kvsplit.export import InvalidExportError, parse_export\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "text = '{\"records\": [' + ','.join(['0'] * 300_000) + ']}'\n"
        "try:\n    parse_export(text)\nexcept InvalidExportError as error:\n    assert error.total == 300_000\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)\n"
    )
    grown_mib = int(subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                                   timeout=300, check=True).stdout)
    assert grown_mib < 100


# -- random bytes --------------------------------------------------------------------------------


def _mutated(data: bytes, edits: list[tuple[int, int, bytes]]) -> bytes:
    for position, cut, insert in edits:
        at = position % (len(data) + 1)
        data = data[:at] + insert + data[at + cut:]
    return data


_VALID = export_bytes()
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
import_files = st.one_of(
    st.binary(max_size=512),
    st.lists(st.tuples(st.integers(0, len(_VALID)), st.integers(0, 8), st.binary(max_size=6)),
             min_size=1, max_size=4).map(lambda edits: _mutated(_VALID, edits)),
    _JSON.map(lambda v: json.dumps(v).encode()),
    st.lists(_JSON, max_size=6).map(
        lambda records: json.dumps({"format": "kvsplit-tuning", "version": 1, "records": records}).encode()),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=import_files, bom=st.booleans(), through_stdin=st.booleans())
def test_random_bytes_import_or_exit_2_with_nothing_written(data, bom, through_stdin):
    data = b"\xef\xbb\xbf" + data if bom else data
    with tempfile.TemporaryDirectory() as tmp:
        path, target = Path(tmp) / "random.json", Path(tmp) / "t.sqlite"
        path.write_bytes(data)
        source = "-" if through_stdin else str(path)
        result = run("--db", str(target), "import", source, "--json", input=data if through_stdin else None)
        assert result.exit_code in (0, 2), result.output
        event(f"exit {result.exit_code}")
        assert "Traceback" not in result.output and "internal error" not in result.output
        assert no_control(result.output)
        if result.exit_code == 2:
            assert not target.exists()
            assert len(result.stderr.splitlines()) <= MAX_ERROR_LINES, result.stderr
        else:
            expected = {r.key: r.winner for r in parse_export(data).records}
            assert json.loads(result.stdout)["inserted"] == len(expected)
            with open_store(f"sqlite:///{target}") as store:
                assert {r.key: r.winner for r in store.query()} == expected
