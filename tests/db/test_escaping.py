"""Text from a database or a file is data: never rich markup, never terminal control.

A shared tuning file can name its device ``[link=http://x]y[/link]`` or hold
``\\x1b]0;title\\x07``.  Random names (markup, escape sequences, C0 and C1
controls, bidirectional overrides, any other Unicode but NUL) are imported
as a file and shown by every command that shows stored text (``db list``,
``show``, ``stats``, ``progress``, ``tune``'s failures, ``plot``'s titles,
error messages and warnings): the raw output holds no control character but
the line break, each name is visible literally with its control characters
as escapes (``\\x1b``), and ``--json`` gives back the exact string.  On both
backends.
"""

from __future__ import annotations

import io
import json
import re
import unicodedata
from itertools import count
from types import SimpleNamespace

import pytest
from clirun import invoke
from dbtestlib import make_record
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from kvsplit import info as info_module
from kvsplit.cli import main
from kvsplit.db import Claims, DeviceInfo, open_store
from kvsplit.export import dump_export, make_export
from kvsplit.cli import db as db_cli
from kvsplit.cli import plot as plot_module
from kvsplit.cli import render
from kvsplit.terminal import printable

MARKUP = "[bold red]MARKUP[/bold red] [link=http://x]y[/link]"
FRAGMENTS = [
    MARKUP, "[/]", "[red]", "\\", "$\\frac{$", "\x1b[31m", "\x1b]0;title\x07", "\x1b]8;;http://x\x1b\\",
    "\x1b[2J", "\r", "\n", "\t", "\x07", "\x7f", "\x85", "\x9b2J", "\x9d", "\u202e", "\u2028",
]
_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=8)
names = st.lists(st.sampled_from(FRAGMENTS) | _TEXT, min_size=1, max_size=5).map("".join).filter(
    lambda s: 1 <= len(s) <= 60)

_unique = count()


def run(*args: str, input: bytes | None = None) -> SimpleNamespace:
    return invoke(main, *args, input=input)


def no_control(text: str) -> bool:
    """Nothing a terminal would act on: no C0, DEL or C1 character but the line break, no bidi override."""
    return not any((unicodedata.category(c) == "Cc" and c != "\n") or c in "\u202e\u2028" for c in text)


@pytest.fixture
def wide(monkeypatch):
    """Tables as wide as their content: a long name then stays on one line, so it can be found whole."""
    wide_console = lambda: Console(width=4000, highlight=False)  # noqa: E731
    monkeypatch.setattr(db_cli, "console", wide_console)
    monkeypatch.setattr(render, "console", wide_console)


def _fill(url: str, name: str, build: str, tool: str, owner: str, error: str):
    """Import one record (as a file, through the command) and leave one failed and one live claim."""
    record = make_record(device=DeviceInfo(name=name, cc_major=9, cc_minor=0, sm_count=132),
                         build_hash=build, tool_version=tool)
    imported = run("--db", url, "db", "import", "-", input=dump_export(make_export([record])).encode())
    assert imported.exit_code == 0, imported.output
    failed, live = (record.key.model_copy(update={"rows": rows}) for rows in (7, 9))
    with open_store(url) as store:
        claims = Claims(store)
        claims.register([failed, live])
        claims.finish(claims.claim_next([failed], owner, 60.0, run_started=claims.now()).claim, error=error)
        claims.claim_next([live], owner + "-live", 600.0, run_started=claims.now())
    return record


@pytest.mark.slow
@settings(max_examples=50, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(name=names, build=names, tool=names, owner=names, error=names)
def test_random_names_are_shown_escaped_by_every_command_and_exact_in_json(db_url, wide, name, build, tool,
                                                                         owner, error):
    build = f"{build[:100]}#{next(_unique)}"  # one key per example, in a database they share
    record = _fill(db_url, name, build, tool, owner, error)
    label = record.key.device.label
    shown = {command: run("--db", db_url, "db", command, *([f"--build={build}"] if command in ("list", "show") else []))
             for command in ("list", "show", "stats", "progress")}
    for command, result in shown.items():
        assert result.exit_code == 0, (command, result.output)
        assert no_control(result.output), (command, result.output)
        assert printable(label) in result.stdout, (command, result.stdout)
    assert printable(build) in shown["show"].stdout and printable(tool) in shown["show"].stdout
    assert printable(build[:8]) in shown["list"].stdout and printable(build) in shown["stats"].stdout
    assert f"failed on {printable(owner)}: " in shown["progress"].stdout
    assert f": {printable(error)}" in shown["progress"].stdout
    assert printable(owner + "-live") in shown["progress"].stdout

    # --json: the exact strings, whatever they hold.
    listed = json.loads(run("--db", db_url, "db", "list", f"--build={build}", "--json").stdout)
    assert [(r["key"]["device"]["name"], r["key"]["build_hash"], r["tool_version"]) for r in listed] == [
        (name, build, tool)]
    assert json.loads(run("--db", db_url, "db", "show", f"--build={build}", "--json").stdout) == listed[0]
    stats = json.loads(run("--db", db_url, "db", "stats", "--json").stdout)
    assert name in {d["device"]["name"] for d in stats["devices"]}
    assert build in {b["build_hash"] for b in stats["builds"]}
    progress = json.loads(run("--db", db_url, "db", "progress", "--json").stdout)
    assert (name, owner, error) in {(f["key"]["device"]["name"], f["owner"], f["error"])
                                    for f in progress["failures"]}
    assert owner + "-live" in {w["owner"] for w in progress["workers"]}
    exported = json.loads(run("--db", db_url, "db", "export", f"--build={build}").stdout)
    assert exported["records"][0]["key"]["device"]["name"] == name


def test_markup_is_never_styled_nor_a_hyperlink_on_a_terminal(db_url, monkeypatch):
    # On a terminal rich writes its own styles (SGR sequences); a name must add none, and no link.
    _fill(db_url, MARKUP + " \x1b]8;;http://y\x1b\\z", "b[bold]1", "0.1", "[link=http://x]w[/link]",
          "[red]E[/red]")
    terminal = lambda: Console(force_terminal=True, color_system="standard", width=4000)  # noqa: E731
    monkeypatch.setattr(db_cli, "console", terminal)
    monkeypatch.setattr(render, "console", terminal)
    for command in ("list", "show", "stats", "progress"):
        result = run("--db", db_url, "db", command)
        assert result.exit_code == 0, result.output
        assert "\x1b]" not in result.stdout  # no OSC: no hyperlink, no window title
        plain = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout)
        assert no_control(plain), plain
        assert MARKUP in plain and "\\x1b]8;;http://y\\x1b\\z" in plain
    progress = re.sub(r"\x1b\[[0-9;]*m", "", run("--db", db_url, "db", "progress").stdout)
    assert "failed on [link=http://x]w[/link]: " in progress and ": [red]E[/red]" in progress


def test_error_messages_and_warnings_quote_values_escaped(tmp_path):
    target = str(tmp_path / "t.sqlite")
    export = json.loads(dump_export(make_export([make_record()])))
    export["records"][0]["\x1b]0;pwned\x07[link=http://x]"] = 1  # an unknown field, named by the error
    bad = run("--db", target, "db", "import", "-", input=json.dumps(export).encode())
    assert bad.exit_code == 2 and no_control(bad.output)
    assert "record 0: \\x1b]0;pwned\\x07[link=http://x]: Extra inputs are not permitted" in bad.stderr
    missing = run("--db", target, "db", "import", str(tmp_path / "\x1b[31mmissing.json"))
    assert missing.exit_code == 2 and no_control(missing.output) and "\\x1b[31mmissing.json" in missing.stderr


def test_a_warning_quoting_a_path_is_escaped(tmp_path, monkeypatch):
    path = tmp_path / "pending\x1b[31m\x07.jsonl"
    path.write_bytes(b"\xff not a key\n")
    monkeypatch.setenv("KVSPLIT_PENDING", str(path))
    result = run("--db", str(tmp_path / "t.sqlite"), "tune", "--pending", "--devices", "cpu", "--json")
    assert result.exit_code == 0 and no_control(result.output)
    assert "warning: the pending-keys file " in result.stderr and "pending\\x1b[31m\\x07.jsonl" in result.stderr


def test_info_shows_its_facts_escaped_and_json_exact(monkeypatch):
    facts = {"device": "\x1b]0;title\x07GPU [bold]x[/bold]\r", "database": "sqlite:///x"}
    monkeypatch.setattr(info_module, "collect", lambda url: (dict(facts), 0))
    shown = run("info")
    assert shown.exit_code == 0 and no_control(shown.output)
    assert "\\x1b]0;title\\x07GPU [bold]x[/bold]\\x0d" in shown.stdout
    assert json.loads(run("info", "--json").stdout) == facts


def test_tune_failures_show_the_key_and_error_as_data():
    from kvsplit.cli import tune as tune_cli

    key = make_record(device=DeviceInfo(name=MARKUP + "\x1b[31m", cc_major=9, cc_minor=0, sm_count=132)).key
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system="standard", width=4000)
    tune_cli._summarize([("failed", key.model_dump_json(), "boom [red]\x1b]8;;http://x\x07")], 1.0, False, console)
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue())
    assert "\x1b]" not in out.getvalue() and no_control(plain)
    assert f"on {MARKUP}\\x1b[31m: boom [red]\\x1b]8;;http://x\\x07" in plain


def test_plot_titles_are_data_not_mathtext(tmp_path, monkeypatch):
    name = "$\\frac{a$ \x1b[31m [bold]"
    records = [make_record(device=DeviceInfo(name=name, cc_major=9, cc_minor=0, sm_count=132))]
    drawn = []
    from matplotlib.figure import Figure

    real_savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig) or real_savefig(fig, *a, **k))
    assert plot_module.plot_records(records, tmp_path / "p.png") == 1
    titles = [ax.title for ax in drawn[0].axes if ax.get_title()]
    assert titles and all(printable(name) in t.get_text() and not t.get_parse_math() for t in titles)
