"""The ``kvsplit`` command: info, demo, and the tuning database commands."""

from __future__ import annotations

import json
import os

import click

from ..terminal import printable
from . import db, tune
from .kit import EXIT_DATABASE, EXIT_INVALID, MappedErrors, db_option, db_url, debug_option


@click.group(cls=MappedErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvsplit")
@db_option
@debug_option
def main() -> None:
    """Split-KV attention merge with a per-GPU tuned kernel config.

    --db URL may come before the command or after it. Exit codes: 0 success,
    1 nothing matched or a tuning key failed, 2 usage error or invalid input
    (including a KVSPLIT_* variable kvsplit cannot use), 3 database problem.
    No error shows a traceback unless --debug is given.
    """


main.add_command(db.db)
main.add_command(tune.tune)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON for programs.")
@db_option
@click.pass_context
def info(ctx: click.Context, as_json: bool) -> None:
    """Device, compiled architectures, build hash, database and dispatch mode.

    Exits 2 if KVSPLIT_MODE or KVSPLIT_MAX_SPLIT is invalid and 3 if the
    database has a problem, after printing everything.
    """
    from ..info import collect

    facts, exit_code = collect(db_url(ctx))
    if as_json:
        click.echo(json.dumps(facts, indent=2))
    else:
        width = max(map(len, facts))
        for key, value in facts.items():
            click.echo(f"{key:<{width}}  {printable(value)}")
    if exit_code:
        ctx.exit(exit_code)


@main.command()
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None,
              help="cuda or cpu [default: cuda when available].")
@click.option("--seed", default=0, show_default=True, help="Seed of the random attention problem.")
@db_option
@click.pass_context
def demo(ctx: click.Context, device: str | None, seed: int) -> None:
    """Merge a real decode step with kv_split=None: tune at first use, store, reuse; check the result."""
    import torch  # not at import: `kvsplit db ...` needs no torch

    from ..demo import run

    if device == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("--device cuda: torch sees no CUDA device here (a CPU build of "
                               "torch, or no GPU); run without --device to use the CPU")
    url = db_url(ctx)
    saved = os.environ.get("KVSPLIT_DB")
    if url is not None:  # the library reads the database URL from the environment
        os.environ["KVSPLIT_DB"] = url
    try:
        code = run(device, seed)
    finally:
        if url is not None:
            if saved is None:
                os.environ.pop("KVSPLIT_DB", None)
            else:
                os.environ["KVSPLIT_DB"] = saved
    ctx.exit(code)


__all__ = ["EXIT_DATABASE", "EXIT_INVALID", "main"]
