"""``kvsplit tune``: offline tuning of a grid of keys (or the pending ones)."""

from __future__ import annotations

import json
import itertools
import math
import multiprocessing
import os
import time
from collections import Counter

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from .. import installed
from ..config import KernelConfig
from .kit import DatabaseProblem, db_option, storing_db_url
from ..terminal import counted, text

def _ints(ctx, param, value: str) -> list[int]:
    try:
        numbers = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not numbers or min(numbers) < 1:
        raise click.BadParameter("expected positive integers")
    return numbers


def _check_head_dims(head_dims: list[int], dtypes: list[str]) -> None:
    from ..installed import head_dim_rule, head_dim_supported

    for dtype in dtypes:
        bad = [d for d in head_dims if not head_dim_supported(d, dtype)]
        if bad:
            raise click.BadParameter(
                f"head dim {', '.join(map(str, bad))} is not supported with {dtype} partials by the "
                f"installed kernels; use {head_dim_rule(dtype)}", param_hint="'--head-dim'")


def _words(choices):
    """A comma-separated list parser; ``choices`` a tuple, or a function giving one (read
    at parse time, so that the compiled module is loaded only when the command runs)."""
    def parse(ctx, param, value: str) -> list[str]:
        nonlocal choices
        if callable(choices):
            choices = choices()
        words = [v.strip() for v in value.split(",") if v.strip()]
        bad = [w for w in words if w not in choices]
        if bad or not words:
            raise click.BadParameter(f"choose from {', '.join(choices)}; got {value!r}")
        return words
    return parse


def _devices(value: str | None) -> list:
    import torch

    if value in (None, ""):
        return [torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")]
    if value == "cpu":
        return [torch.device("cpu")]
    if not torch.cuda.is_available():
        raise click.BadParameter("no CUDA device is visible; use --devices cpu", param_hint="--devices")
    count = torch.cuda.device_count()
    try:
        indices = list(range(count)) if value == "all" else [int(v) for v in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"expected cpu, all, or CUDA indices like 0,1; got {value!r}",
                                 param_hint="--devices") from None
    if any(i < 0 or i >= count for i in indices):
        raise click.BadParameter(f"this machine has CUDA devices 0..{count - 1}", param_hint="--devices")
    return [torch.device("cuda", i) for i in indices]


def _work(device: str, keys: list[str], db_url: str | None, l2: str, force: bool, lease_s: float,
          report, shapes: dict[str, tuple[int, int]] | None = None) -> None:
    """Tune ``keys`` (JSON, all of this device's model) on ``device`` as one fleet worker, each
    at the (rows, num_splits) that ``shapes`` gives for it (the grid's own values), else at
    the key's own.

    Outcomes go to ``report``: ("tuned"|"failed", key, detail) for the keys
    tuned here, ("taken_over", key, previous owner), ("standings", None,
    counts) after every claim, and ("finished", None, None) at the end.
    """
    import torch

    from ..db import Claims, TuningKey, open_store
    from ..dispatch.constraints import configs_for_key
    from ..autotune import timing
    from ..autotune.fleet import owner_name, run_worker
    from ..autotune.tuner import tune

    # A stored row that does not parse counts as not stored: the key is tuned
    # again and the new row replaces it (with a warning naming the row).
    store = open_store(db_url, on_damage="warn", config_type=KernelConfig)
    target = torch.device(device)
    warm = target.type != "cuda"

    def tune_one(key: TuningKey):
        nonlocal warm
        if not warm:
            # An idle GPU's clocks ramp up during its first milliseconds of work, which
            # would slow the first key's timings (docs/history.md, "Spinning the GPU up").
            with torch.cuda.device(target):
                timing.spin_up_gpu()
            warm = True
        shape = (shapes or {}).get(key.model_dump_json())
        shape = None if shape is None else tuple(shape)
        return tune(key, target, configs_for_key(key, is_cuda=target.type == "cuda", shape=shape),
                    l2_state=l2, shape=shape)

    grid = [TuningKey.model_validate_json(k) for k in keys]
    model = grid[0].device.label if grid else ""
    try:
        done = run_worker(Claims(store), grid, tune_one, report, owner=owner_name(device), lease_s=lease_s,
                          force=force,
                          on_standings=lambda counts: report(("standings", None, {**counts, "model": model})))
    finally:
        store.close()
    for key, previous in done.taken_over:
        report(("taken_over", key.model_dump_json(), previous))
    report(("finished", None, None))


def _worker_main(device, keys, db_url, l2, force, lease_s, queue, shapes=None) -> None:
    try:
        _work(device, keys, db_url, l2, force, lease_s, queue.put, shapes)
    except Exception as error:  # noqa: BLE001 - the parent reports it; no traceback from a child
        queue.put(("stopped", None, str(error)))


def _grid(targets: list, head_dims, dtypes, formats, num_splits, rows,
          out_dtypes=(None,)) -> tuple[list, dict]:
    """The grid's keys: every shape once per device model among ``targets`` (bucketed as the
    dispatcher buckets calls, so the grid fills exactly the keys that calls look up), and the
    (rows, num_splits) each is profiled at: the first grid values that fall in its buckets."""
    from ..config import build_hash
    from ..dispatch.device import device_facts
    from ..dispatch.keys import tuning_key

    models = list(dict.fromkeys(device_facts(t) for t in targets))
    shapes: dict = {}
    for d, dtype, out, fmt, n, r, facts in itertools.product(head_dims, dtypes, out_dtypes,
                                                              formats, num_splits, rows, models):
        key = tuning_key(facts, build_hash(facts.is_cuda), d, dtype,
                         out or installed.default_out_dtype(dtype), fmt, n, r)
        shapes.setdefault(key, (r, n))
    return list(shapes), {key.model_dump_json(): shape for key, shape in shapes.items()}


def _assign(keys: list, targets: list) -> tuple[dict[str, list[str]], list[tuple]]:
    """Each key to every target of its device model (they share it through claims); the keys of
    no target's model as skipped outcomes."""
    from ..dispatch.device import device_facts
    from ..dispatch.keys import device_info

    here = {str(t): device_info(device_facts(t)) for t in targets}
    work: dict[str, list[str]] = {t: [] for t in here}
    foreign = []
    for key in keys:
        mine = [t for t, info in here.items() if info == key.device]
        for target in mine:
            work[target].append(key.model_dump_json())
        if not mine:  # timings from this machine must not go under another device's key
            foreign.append(("skipped", key.model_dump_json(),
                            f"key is for {key.device.label}, not {', '.join(sorted({i.label for i in here.values()}))}"))
    return work, foreign


def _run_workers(work: dict[str, list[str]], db_url, l2: str, force: bool, lease_s: float, report,
                 shapes: dict | None = None) -> None:
    """One fleet worker per target: in this process for one, in spawned processes for several."""
    busy = {target: keys for target, keys in work.items() if keys}
    if len(busy) <= 1:
        for target, keys in busy.items():
            _work(target, keys, db_url, l2, force, lease_s, report, shapes)
        return
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker_main, args=(d, k, db_url, l2, force, lease_s, queue, shapes))
             for d, k in busy.items()]
    for proc in procs:
        proc.start()
    running = len(procs)
    while running:
        message = queue.get()
        if message[0] == "stopped":  # a worker met a database problem or crashed
            for proc in procs:
                proc.terminate()
            raise DatabaseProblem(message[2])
        running -= message[0] == "finished"
        report(message)
    for proc in procs:
        proc.join()


@click.command()
@click.option("--head-dim", "head_dims", default="512,128", show_default=True, callback=_ints,
              help="Head dims, comma-separated: any whole number of 16-byte vectors of the "
                   "partial dtype, up to 1024.")
@click.option("--dtype", "dtypes", default="bfloat16", show_default=True,
              callback=_words(installed.partial_dtypes),
              help="Partial dtypes.")
@click.option("--out-dtype", "out_dtypes", default="same", show_default=True,
              callback=_words(lambda: ("same",) + installed.out_dtypes()),
              help="Output dtypes; 'same': the partial dtype, bfloat16 for float32 partials.")
@click.option("--format", "formats", default="maxsum", show_default=True,
              callback=_words(installed.stats_formats),
              help="Stats formats; ':scattered' keys the layouts whose adjacent rows' stats are "
                   "apart (vLLM's head-major LSE, FlashAttention 3's combine).")
@click.option("--num-splits", default="16,32,64,132,264", show_default=True, callback=_ints)
@click.option("--rows", default="32,64,128,256,512,2048", show_default=True, callback=_ints)
@click.option("--pending", is_flag=True, help="Tune the keys met during CUDA-graph capture instead of a grid.")
@click.option("--force", is_flag=True,
              help="Re-tune keys that the database already has (each once, across the fleet, per run).")
@click.option("--devices", default=None, help="cpu, all, or CUDA indices like 0,1 (one worker each) [default: cuda:0, else cpu].")
@click.option("--l2", type=click.Choice(["warm", "cold"]), default="warm", show_default=True,
              help="L2 state while timing.")
@click.option("--lease", "lease_s", type=click.FloatRange(min=0.5), default=60.0, show_default=True,
              metavar="SECONDS",
              help="Lease of a claim; renewed every third of it while a key is tuned. A worker that "
                   "stops renewing (killed, host lost) loses its key to another after this long.")
@click.option("--status", is_flag=True,
              help="Only show how far the grid is (done, claimed by whom, failed, left); tune nothing.")
@db_option
@click.option("--json", "as_json", is_flag=True, help="Print the summary (or --status) as JSON.")
@click.pass_context
def tune(ctx, head_dims, dtypes, out_dtypes, formats, num_splits, rows, pending, force, devices, l2,
         lease_s, status, as_json) -> None:
    """Profile the candidate kernel configs for a grid of shapes and store the winners.

    Candidates: both kernel families, pruned, on a GPU; on the CPU every KvSplit K
    the head dim allows.

    Rows and num_splits are bucketed as the dispatcher does, so the grid fills
    exactly the keys that calls will look up; each key is profiled at the
    grid's own values that fall in it (the first, if several). Resumable:
    keys already stored are skipped unless --force; a stored row that does
    not parse is tuned again (with a warning). Exits 1 if any key failed, 2 for an in-memory
    --db (nothing would be saved), 3 on a database problem.

    Fleet: run the same command on any number of hosts against one --db URL
    (PostgreSQL). Each worker claims a key before it tunes it, so every key
    is tuned once; a worker that dies loses its claims after --lease seconds
    and another worker finishes its key. --status shows the grid's progress.
    """
    import warnings

    from ..db import DbWarning, open_store
    from ..db.schemas import REPAIR_HINT
    from ..dispatch import pending as pending_keys

    from ..dispatch.dispatcher import pdl_enabled, read_settings

    _check_head_dims(head_dims, dtypes)
    # The variables the merges read: a value they would refuse is refused here too.
    read_settings(os.environ.get("KVSPLIT_MODE"), os.environ.get("KVSPLIT_MAX_SPLIT"))
    pdl_enabled()
    console = Console(stderr=True)
    targets = _devices(devices)
    db_url = storing_db_url(ctx)
    # Fail fast, with the store's message, on a bad database; --status only reads (no new file).
    with open_store(db_url, create=not status, config_type=KernelConfig) as store:
        damage = store.damage()
    if damage:
        verb = "does" if len(damage) == 1 else "do"
        warnings.warn(f"{store.url}: {counted(len(damage), 'row')} {verb} not parse; tuning goes on and re-tunes any "
                      f"key among them; {REPAIR_HINT}", DbWarning, stacklevel=1)
    # Pending keys are profiled at their own values; a grid's at the values it names.
    keys, shapes = ((pending_keys.load(), {}) if pending
                    else _grid(targets, head_dims, dtypes, formats, num_splits, rows,
                               [None if o == "same" else o for o in out_dtypes]))
    if status:
        _status(db_url, keys, as_json)
        return
    work, foreign = _assign(keys, targets)

    outcomes: dict[str, tuple] = {o[1]: o for o in foreign}
    taken_over: list[tuple[str, str]] = []
    finished: dict[str, int] = {}
    started = time.perf_counter()
    with Progress(TextColumn("[bold]tune"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=console, disable=as_json) as progress:
        task = progress.add_task("", total=len(keys), completed=len(foreign))

        def report(message) -> None:
            kind, raw, detail = message
            if kind in ("tuned", "failed"):
                outcomes[raw] = message
                progress.update(task, description=kind)
            elif kind == "taken_over":
                taken_over.append((raw, detail))
            elif kind == "standings":  # the fleet's progress on this device model's keys
                finished[detail["model"]] = detail["done"] + detail["failed"]
                waiting = (not detail["left"] and not detail["expired"]
                           and detail.get("claimed", 0) > 0)  # others still hold keys
                progress.update(task, completed=len(foreign) + sum(finished.values()),
                                description="waiting for other workers" if waiting else "")

        _run_workers(work, db_url, l2, force, lease_s, report, shapes)
    elapsed = time.perf_counter() - started
    for key in keys:  # finished by other workers, or stored already
        outcomes.setdefault(key.model_dump_json(), ("skipped", key.model_dump_json(), None))
    ordered = [outcomes[k.model_dump_json()] for k in keys]
    if pending:
        _clear_pending(db_url, keys, outcomes)
    _summarize(ordered, elapsed, as_json, console, taken_over)
    if any(o[0] == "failed" for o in ordered):
        raise SystemExit(1)


def _clear_pending(db_url, keys: list, outcomes: dict[str, tuple]) -> None:
    """Pending keys leave the file once stored (here or by another worker), or when no device here
    can tune them."""
    from ..db import open_store
    from ..dispatch import pending as pending_keys

    with open_store(db_url, on_damage="warn", config_type=KernelConfig) as store:
        pending_keys.clear([k for k in keys if outcomes[k.model_dump_json()][0] == "tuned"
                            or (outcomes[k.model_dump_json()][0] == "skipped"
                                and (outcomes[k.model_dump_json()][2] or store.get(k) is not None))])


def _status(db_url, keys: list, as_json: bool) -> None:
    """``kvsplit tune --status``: the progress of this grid (or of the pending keys)."""
    from ..db import Claims, open_store
    from .render import console as table_console
    from .render import show_progress, to_json
    from .reports import fleet_progress

    # It only reads: a database that is not there is exit 3, never a new file.
    with open_store(db_url, create=False, on_damage="warn", config_type=KernelConfig) as store:
        result = fleet_progress(Claims(store), keys)
    if as_json:
        click.echo(to_json(result))
    else:
        show_progress(table_console(), result)


def _key_text(key: dict) -> str:
    """A failed key for people: shape first, then the device."""
    device = key.get("device", {})
    return (f"D={key.get('head_dim')} {key.get('partial_dtype')}->{key.get('out_dtype')} "
            f"{key.get('stats_format')} num_splits={key.get('num_splits')} rows={key.get('rows')} "
            f"on {device.get('name', '?')}")


def _summarize(outcomes, elapsed: float, as_json: bool, console: Console,
               taken_over: list[tuple[str, str]] = ()) -> None:
    from ..db import TuningRecord

    counts = Counter(o[0] for o in outcomes)
    records = [TuningRecord.model_validate_json(o[2]) for o in outcomes if o[0] == "tuned"]
    speedups = [r.speedup for r in records if r.speedup]
    winners = Counter(r.winner.label for r in records)
    geomean = math.exp(sum(map(math.log, speedups)) / len(speedups)) if speedups else None
    summary = {
        "keys": len(outcomes), "tuned": counts["tuned"], "skipped": counts["skipped"],
        "failed": counts["failed"], "winners": dict(winners),
        "geomean_speedup_over_k1": geomean, "seconds": round(elapsed, 2),
        "ms_per_tuned_key": round(1e3 * elapsed / counts["tuned"], 1) if counts["tuned"] else None,
        "failures": [{"key": json.loads(o[1]), "error": o[2]} for o in outcomes if o[0] == "failed"],
        # Keys this run took over from a worker whose lease ran out (fleet tuning).
        "taken_over": [{"key": json.loads(raw), "from": owner} for raw, owner in taken_over],
    }
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    table = Table(title="kvsplit tune", show_header=False)
    for name in ("keys", "tuned", "skipped", "failed", "seconds", "ms_per_tuned_key"):
        value = summary[name]
        table.add_row(name, "-" if value is None else str(value))
    table.add_row("winners", text(", ".join(f"{w}: {n}" for w, n in sorted(winners.items())) or "-"))
    table.add_row("speed-up over K=1 (geomean)", f"{geomean:.2f}x" if geomean else "-")
    if taken_over:
        table.add_row("taken over (lease ran out)", str(len(taken_over)))
    Console().print(table)
    for failure in summary["failures"]:
        # One line per key, unwrapped; the key (from a pending file) and the error are data.
        console.print(Text.assemble(("failed", "red"), " ", text(f"{_key_text(failure['key'])}: {failure['error']}")),
                      soft_wrap=True)
