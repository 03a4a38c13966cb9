"""The ``kvsplit`` command: info, demo, and the tuning database commands."""

from __future__ import annotations

import json

import click

from .autotune.cli import tune
from .db.cli import db


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvsplit")
def main() -> None:
    """Split-KV attention merge with a per-GPU tuned kernel config."""


main.add_command(db)
main.add_command(tune)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON for programs.")
def info(as_json: bool) -> None:
    """Device, compiled architectures, build hash, database and dispatch mode."""
    from .info import collect

    facts = collect()
    if as_json:
        click.echo(json.dumps(facts, indent=2))
        return
    width = max(map(len, facts))
    for key, value in facts.items():
        click.echo(f"{key:<{width}}  {value}")


@main.command()
@click.option("--device", default=None, help="cuda or cpu [default: cuda when available].")
@click.option("--seed", default=0, show_default=True, help="Seed of the random attention problem.")
def demo(device: str | None, seed: int) -> None:
    """Merge a real decode step with kv_split=None: tune at first use, store, reuse; check the result."""
    from .demo import run

    raise SystemExit(run(device, seed))
