"""``kvsplit tune``: offline tuning of a grid of keys (or the pending ones)."""

from __future__ import annotations

import json
import math
import multiprocessing
import time
from collections import Counter

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..clikit import DatabaseProblem, db_option
from ..clikit import db_url as given_db_url

_OUT_DTYPE = {"bfloat16": "bfloat16", "float16": "float16", "float32": "bfloat16"}


def _ints(ctx, param, value: str) -> list[int]:
    try:
        numbers = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not numbers or min(numbers) < 1:
        raise click.BadParameter("expected positive integers")
    return numbers


def _head_dims(ctx, param, value: str) -> list[int]:
    from ..installed import head_dims

    numbers = _ints(ctx, param, value)
    supported = head_dims()
    bad = [d for d in numbers if d not in supported]
    if bad:
        raise click.BadParameter(f"head dim {', '.join(map(str, bad))} is not supported by the installed "
                                 f"kernels; use {', '.join(map(str, supported))}")
    return numbers


def _words(choices):
    def parse(ctx, param, value: str) -> list[str]:
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


def _work(device: str, keys: list[str], db_url: str | None, l2: str, force: bool, report) -> None:
    """Tune ``keys`` (JSON) on ``device``, storing each result; report each outcome."""
    import torch

    from ..db import StoreError, TuningKey, open_store
    from ..dispatch.constraints import configs_for_key
    from ..dispatch.device import device_facts
    from ..dispatch.keys import device_info
    from .tuner import tune

    # A stored row that does not parse counts as not stored: the key is tuned
    # again and the new row replaces it (with a warning naming the row).
    store = open_store(db_url, on_damage="warn")
    target = torch.device(device)
    here = device_info(device_facts(target))
    for raw in keys:
        key = TuningKey.model_validate_json(raw)
        try:
            if key.device != here:  # timings from this device must not go under another's key
                report(("skipped", raw, f"key is for {key.device.label}, not {here.label}"))
                continue
            if not force and store.get(key) is not None:
                report(("skipped", raw, None))
                continue
            record = tune(key, target, configs_for_key(key, is_cuda=target.type == "cuda"),
                          l2_state=l2)
            store.upsert(record)
            report(("tuned", raw, record.model_dump_json()))
        except StoreError:
            raise  # the database, not the key: the whole run stops with exit 3
        except Exception as error:  # one failed key must not stop the grid
            report(("failed", raw, f"{type(error).__name__}: {error}"))


def _worker_main(device, keys, db_url, l2, force, queue) -> None:
    try:
        _work(device, keys, db_url, l2, force, queue.put)
    except Exception as error:  # noqa: BLE001 - the parent reports it; no traceback from a child
        queue.put(("stopped", None, str(error)))


@click.command()
@click.option("--head-dim", "head_dims", default="512,128", show_default=True, callback=_head_dims,
              help="Head dims, comma-separated, each one the installed kernels support.")
@click.option("--dtype", "dtypes", default="bfloat16", show_default=True,
              callback=_words(("bfloat16", "float16", "float32")),
              help="Partial dtypes (float32 partials produce bfloat16).")
@click.option("--format", "formats", default="maxsum", show_default=True,
              callback=_words(("maxsum", "lse", "maxsum:scattered", "lse:scattered")),
              help="Stats formats; ':scattered' keys the layouts whose adjacent rows' stats are "
                   "apart (vLLM's head-major LSE, FlashAttention 3's combine).")
@click.option("--num-splits", default="16,32,64,132,264", show_default=True, callback=_ints)
@click.option("--rows", default="32,64,128,256,512,2048", show_default=True, callback=_ints)
@click.option("--pending", is_flag=True, help="Tune the keys met during CUDA-graph capture instead of a grid.")
@click.option("--force", is_flag=True, help="Re-tune keys that the database already has.")
@click.option("--devices", default=None, help="cpu, all, or CUDA indices like 0,1 (one worker each) [default: cuda:0, else cpu].")
@click.option("--l2", type=click.Choice(["warm", "cold"]), default="warm", show_default=True,
              help="L2 state while timing.")
@db_option
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.pass_context
def tune(ctx, head_dims, dtypes, formats, num_splits, rows, pending, force, devices, l2,
         as_json) -> None:
    """Profile the candidate kernel configs for a grid of shapes and store the winners.

    Candidates: both kernel families, pruned, on a GPU; every KvSplit K on the CPU.

    Rows and num_splits are bucketed as the dispatcher does, so the grid fills
    exactly the keys that calls will look up. Resumable: keys already stored
    are skipped unless --force; a stored row that does not parse is tuned
    again (with a warning). Exits 1 if any key failed, 3 on a database problem.
    """
    import warnings

    from ..config import build_hash
    from ..db import DbWarning, open_store
    from ..db.errors import REPAIR_HINT
    from ..dispatch import pending as pending_keys
    from ..dispatch.device import device_facts
    from ..dispatch.keys import tuning_key

    console = Console(stderr=True)
    targets = _devices(devices)
    db_url = given_db_url(ctx)
    with open_store(db_url) as store:  # fail fast, with the store's message, on a bad database
        damage = store.damage()
    if damage:
        warnings.warn(f"{store.url}: {len(damage)} rows do not parse; tuning goes on and re-tunes any "
                      f"key among them; {REPAIR_HINT}", DbWarning, stacklevel=1)
    work: dict[str, list[str]] = {str(d): [] for d in targets}
    if pending:
        # Each pending key goes to a target of its own device model (others are skipped).
        keys = pending_keys.load()
        labels = {str(t): device_facts(t).name for t in targets}
        for i, key in enumerate(keys):
            matching = [t for t, name in labels.items() if name[:128] == key.device.name]
            work[(matching or list(labels))[i % len(matching or labels)]].append(
                key.model_dump_json())
    else:
        # Grid keys are spread over the targets, each keyed by the device that tunes it.
        shapes = list(dict.fromkeys(
            (d, dtype, fmt, n, r) for d in head_dims for dtype in dtypes for fmt in formats
            for n in num_splits for r in rows))
        keys = []
        for i, (d, dtype, fmt, n, r) in enumerate(shapes):
            target = targets[i % len(targets)]
            facts = device_facts(target)
            key = tuning_key(facts, build_hash(facts.is_cuda), d, dtype, _OUT_DTYPE[dtype], fmt,
                             n, r)
            if key not in keys:
                keys.append(key)
                work[str(target)].append(key.model_dump_json())

    outcomes: list[tuple] = []
    started = time.perf_counter()
    with Progress(TextColumn("[bold]tune"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=console, disable=as_json) as progress:
        task = progress.add_task("", total=len(keys))

        def report(outcome) -> None:
            outcomes.append(outcome)
            progress.update(task, advance=1, description=f"{outcome[0]}")

        if len(targets) == 1:
            _work(str(targets[0]), work[str(targets[0])], db_url, l2, force, report)
        else:
            ctx = multiprocessing.get_context("spawn")
            queue = ctx.Queue()
            procs = [ctx.Process(target=_worker_main, args=(d, k, db_url, l2, force, queue))
                     for d, k in work.items() if k]
            for proc in procs:
                proc.start()
            for _ in range(len(keys)):
                outcome = queue.get()
                if outcome[0] == "stopped":  # a worker met a database problem or crashed
                    for proc in procs:
                        proc.terminate()
                    raise DatabaseProblem(outcome[2])
                report(outcome)
            for proc in procs:
                proc.join()
    elapsed = time.perf_counter() - started
    if pending:
        pending_keys.clear([k for k in keys if any(
            o[0] != "failed" and o[1] == k.model_dump_json() for o in outcomes)])
    _summarize(outcomes, elapsed, as_json, console)
    if any(o[0] == "failed" for o in outcomes):
        raise SystemExit(1)


def _key_text(key: dict) -> str:
    """A failed key for people: shape first, then the device."""
    device = key.get("device", {})
    return (f"D={key.get('head_dim')} {key.get('partial_dtype')}->{key.get('out_dtype')} "
            f"{key.get('stats_format')} num_splits={key.get('num_splits')} rows={key.get('rows')} "
            f"on {device.get('name', '?')}")


def _summarize(outcomes, elapsed: float, as_json: bool, console: Console) -> None:
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
    }
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    table = Table(title="kvsplit tune", show_header=False)
    for name in ("keys", "tuned", "skipped", "failed", "seconds", "ms_per_tuned_key"):
        value = summary[name]
        table.add_row(name, "-" if value is None else str(value))
    table.add_row("winners", ", ".join(f"{w}: {n}" for w, n in sorted(winners.items())) or "-")
    table.add_row("speed-up over K=1 (geomean)", f"{geomean:.2f}x" if geomean else "-")
    Console().print(table)
    for failure in summary["failures"]:
        # One line per key, unwrapped, the error as it is (no markup in it).
        console.print(f"[red]failed[/red] {_key_text(failure['key'])}: ", end="", soft_wrap=True)
        console.print(failure["error"], markup=False, highlight=False, soft_wrap=True)
