"""Rich tables for ``kvsplit db`` (people) and stable JSON (programs).

Every value from the database reaches rich as a :class:`~rich.text.Text` made
by :func:`kvsplit.terminal.text` (control characters escaped, markup not
parsed), never inside a markup string; JSON is the exact data.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from typing import Any

from pydantic import BaseModel
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..terminal import counted, labelled, text
from ..db.schemas import BASELINE, ImportSummary, PruneResult, RepairResult, TuningRecord
from .reports import Progress, StoreStats


def _key_cells(k) -> tuple[Text, ...]:
    """A tuning key as table cells: device, build, D, dtypes, stats, num_splits, rows."""
    return tuple(text(v) for v in (k.device.label, k.build_hash[:12], k.head_dim,
                                   f"{k.partial_dtype}->{k.out_dtype}", k.stats_format, k.num_splits, k.rows))

def console() -> Console:
    # Wide when piped, so tables don't wrap in logs and captured output.
    return Console(width=None if sys.stdout.isatty() else 160, highlight=False)


def to_json(value: BaseModel | list[BaseModel] | dict[str, Any]) -> str:
    """JSON text with fields in model order and two-space indent."""
    if isinstance(value, BaseModel):
        data: Any = value.model_dump(mode="json")
    elif isinstance(value, list):
        data = [v.model_dump(mode="json") for v in value]
    else:
        data = value
    return json.dumps(data, indent=2)


def _when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M") if value is not None else "-"


def _x(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


_SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def records_table(records: list[TuningRecord]) -> Table:
    # Nothing is ever cut and the winner stays on one line: only the device
    # label wraps. From 120 columns up everything fits, thanks to no vertical
    # rules, short dtypes, N for num_splits, an 8-digit build prefix and the date alone
    # (`kvsplit db show` has the rest).
    table = Table(
        title=counted(len(records), "tuning result"), box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True
    )
    for name in ("device", "build", "D", "dtype", "stats", "N", "rows", "winner", "vs K=1", "updated"):
        table.add_column(
            name,
            justify="right" if name in ("D", "N", "rows", "vs K=1") else "left",
            no_wrap=name != "device",
            overflow="fold",
            min_width=8 if name == "device" else None,
        )
    for r in records:
        k = r.key
        table.add_row(*map(text, (
            k.device.label,
            k.build_hash[:8],
            k.head_dim,
            f"{_SHORT_DTYPES.get(k.partial_dtype, k.partial_dtype)}->{_SHORT_DTYPES.get(k.out_dtype, k.out_dtype)}",
            k.stats_format,
            k.num_splits,
            k.rows,
            r.winner.label,
            _x(r.speedup),
            r.updated_at.strftime("%Y-%m-%d") if r.updated_at is not None else "-",
        )))
    return table


def show_record(out: Console, record: TuningRecord) -> None:
    k, p = record.key, record.policy
    out.print(labelled("device", k.device.label))
    out.print(labelled("build", k.build_hash))
    out.print(labelled("shape", k.shape_label))
    out.print(labelled("winner", f"{record.winner.label}  ({_x(record.speedup)} vs kv_split=1)"))
    out.print(labelled("policy", f"l2={p.l2_state} repeats={p.repeats} noise_margin={p.noise_margin:g}"))
    out.print(labelled(
        "tuned",
        f"by kvsplit {record.tool_version}, created {_when(record.created_at)},"
        f" updated {_when(record.updated_at)} UTC",
    ))
    base = record.candidate(BASELINE)
    table = Table(title="candidates (microseconds)")
    for name in ("config", "median", "p10", "p90", "samples", "matched", "vs K=1", ""):
        table.add_column(name, justify="left" if name in ("config", "matched", "") else "right")
    for c in sorted(record.candidates, key=lambda c: (c.failed, c.median_us)):
        if c.failed:  # raised before it could be timed
            table.add_row(text(c.config.label), "-", "-", "-", "0", Text("FAILED", "red"), "-", "")
            continue
        ratio = base.median_us / c.median_us if base and not base.failed and c.median_us > 0 else None
        table.add_row(
            text(c.config.label),
            f"{c.median_us:.3f}",
            f"{c.p10_us:.3f}",
            f"{c.p90_us:.3f}",
            str(c.samples),
            "yes" if c.matched else Text("NO", "red"),
            _x(ratio),
            "winner" if c.config == record.winner else "",
        )
    out.print(table)


def show_stats(out: Console, stats: StoreStats, installed: tuple[str, ...] = ()) -> None:
    out.print(
        text(f"{stats.url}: {counted(stats.keys, 'tuning result')}, "
             f"oldest {_when(stats.oldest)}, newest {_when(stats.newest)} UTC")
    )
    devices = Table(title="per device (speed-up of the winner over kv_split=1)")
    for name in ("device", "keys", "mean speed-up", "max speed-up", "oldest", "newest"):
        devices.add_column(name)
    for d in stats.devices:
        devices.add_row(*map(text, (
            d.device.label, d.keys, _x(d.mean_speedup), _x(d.max_speedup), _when(d.oldest), _when(d.newest)
        )))
    out.print(devices)
    if stats.current_build and set(stats.current_build.split(",")) == set(installed):
        rule = "not an installed build"
    else:
        rule = f"not {stats.current_build}" if stats.current_build else "all but the most recently tuned"
    builds = Table(title=text(f"kernel builds (stale = {rule})"))
    for name in ("build", "library version", "keys", "newest", "stale", "installed"):
        builds.add_column(name)
    for b in stats.builds:
        builds.add_row(*map(text, (
            b.build_hash,
            b.library_version,
            b.keys,
            _when(b.newest),
            "stale" if b.stale else "",
            "installed" if b.build_hash in installed else "",
        )))
    out.print(builds)


def show_prune(out: Console, result: PruneResult) -> None:
    verb = "would delete" if result.dry_run else "deleted"
    out.print(text(f"{verb} {counted(result.count, 'tuning result')}"))
    if result.keys:
        table = Table()
        for name in ("device", "build", "D", "dtype", "stats", "num_splits", "rows"):
            table.add_column(name)
        for k in result.keys:
            table.add_row(*_key_cells(k))
        out.print(table)


def show_import(out: Console, summary: ImportSummary) -> None:
    prefix = "dry run: would have " if summary.dry_run else ""
    out.print(text(
        f"{prefix}inserted {summary.inserted}, replaced {summary.replaced}, "
        f"kept {summary.kept} existing (rule: {summary.rule})"
    ))


def show_repair(out: Console, result: RepairResult) -> None:
    verb = "would" if result.dry_run else ""
    for line in result.schema_repairs:
        out.print(text(f"schema: {'would have ' + line if result.dry_run else line}"))
    if not result.count:
        out.print("every row parses: nothing to quarantine" if not result.schema_repairs else "no row to quarantine")
        return
    per_table = ", ".join(f"{table} {n}" for table, n in result.quarantined.items())
    moved = f"{verb} move" if verb else "moved"
    out.print(text(f"{moved} {counted(result.count, 'row')} ({per_table}) to {result.quarantine_file}"))
    for problem in result.problems:
        out.print(text(f"  {problem}"))


def _ago(now: datetime, then: datetime | None) -> str:
    return f"{(now - then).total_seconds():.0f} s ago" if then is not None else "-"


def show_progress(out: Console, progress: Progress) -> None:
    """A grid's progress: the counts, who holds claims since when, what failed and why."""
    if not progress.keys:
        out.print(text(f"{progress.url}: no key registered by `kvsplit tune` (results of first "
                       "use and of imports are not registered: `kvsplit db stats` counts them)"))
        return
    out.print(text(
        f"{progress.url}: {counted(progress.keys, 'key')}: {progress.done} done, {progress.claimed} claimed, "
        f"{progress.failed} failed, {progress.left} left"
        + (f" ({progress.expired} with an expired lease, claimable)" if progress.expired else "")
        + f"; {counted(progress.attempts, 'attempt')}"
    ))
    if progress.workers:
        workers = Table(title="workers holding claims (owner = host/pid/device)", box=box.SIMPLE_HEAD)
        for name in ("owner", "keys", "since (UTC)", "last heartbeat"):
            workers.add_column(name)
        for w in progress.workers:
            workers.add_row(*map(text, (w.owner, w.claimed, _when(w.since), _ago(progress.now, w.heartbeat_at))))
        out.print(workers)
    for claim in progress.failures:
        cells = " ".join(cell.plain for cell in _key_cells(claim.key))
        out.print(text(f"failed on {claim.owner}: {cells}: {claim.error or '?'}"), soft_wrap=True)
