"""``kvsplit db``: inspect, share, clean and repair the tuning database.

The lead attaches :data:`db` to the main group with ``main.add_command(db)``.
"""

from __future__ import annotations

import re
import typing
from datetime import timedelta
from pathlib import Path
from typing import Any

import click

from .kit import (EXIT_DATABASE, EXIT_INVALID, EXIT_NOT_FOUND, InvalidInput, MappedErrors, NotFound, db_option,
                      db_url, storing_db_url)
from ..config import OUT_DTYPES, PARTIAL_DTYPES, SCATTERED, STATS_FORMAT_CODES, KernelConfig
from ..terminal import counted, printable
from ..db.claims import Claims
from .render import (
    console,
    records_table,
    show_import,
    show_progress,
    show_prune,
    show_record,
    show_repair,
    show_stats,
    to_json,
)
from .quarantine import default_quarantine, quarantine_writer
from .reports import fleet_progress, store_stats
from ..db.schemas import ImportRule
from ..db.engine import parse_target
from ..db.store import Store, open_store, open_store_for_repair
from ..export import InvalidExportError, dump_export, make_export, parse_export, read_export_file

__all__ = ["EXIT_DATABASE", "EXIT_INVALID", "EXIT_NOT_FOUND", "db"]


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


class Duration(click.ParamType):
    """A duration like ``30d``, ``12h``, ``90m``, ``2w``, ``45s``."""

    name = "duration"

    def convert(self, value: Any, param: Any, ctx: Any) -> timedelta:
        if isinstance(value, timedelta):
            return value
        match = _DURATION.match(str(value))
        if not match:
            self.fail(f"{value!r} is not a duration like 30d, 12h, 90m, 2w or 45s", param, ctx)
        return timedelta(**{_UNITS[match.group(2)]: float(match.group(1))})


def _open(ctx: click.Context, *, create: bool = False, stores: bool = False) -> Store:
    """The database, strictly: it must exist (unless ``create``) and every row must parse.

    ``stores``: the command writes, so an in-memory database is refused (exit 2).
    """
    store = open_store(storing_db_url(ctx) if stores else db_url(ctx), create=create, config_type=KernelConfig)
    ctx.call_on_close(store.close)
    store.check()
    return store


def _bucketed(filters: dict[str, Any]) -> dict[str, Any]:
    """--rows / --num-splits match the stored value and the bucket a call of that size looks up."""
    if filters.get("rows") is None and filters.get("num_splits") is None:
        return filters
    from ..dispatch.keys import bucket, bucket_num_splits  # imports torch: only when asked

    out = dict(filters)
    for name, to_bucket in (("rows", bucket), ("num_splits", bucket_num_splits)):
        if out.get(name) is not None:
            out[name] = sorted({out[name], to_bucket(out[name])})
    return out


#: A key's stats formats: each of the kernels', alone and with the scattered layout's suffix.
_STATS_FORMATS = [*STATS_FORMAT_CODES, *(name + SCATTERED for name in STATS_FORMAT_CODES)]


def _filters(function: Any) -> Any:
    """The filters shared by list, show, export and plot."""
    options = [
        click.option("--device", help="Part of the device name, any case (e.g. h200)."),
        click.option("--build", "build_hash", help="Kernel build hash."),
        click.option("--head-dim", type=int, help="Head dimension D."),
        click.option("--dtype", type=click.Choice(PARTIAL_DTYPES), help="Dtype of the partials."),
        click.option("--out-dtype", type=click.Choice(OUT_DTYPES), help="Output dtype."),
        click.option("--stats-format", type=click.Choice(_STATS_FORMATS),
                     help="Stats format of the key (':scattered': stats of adjacent rows apart)."),
        click.option(
            "--num-splits", type=click.IntRange(min=1), help="Number of partials N (also finds its bucket's key)."
        ),
        click.option("--rows", type=click.IntRange(min=1), help="Number of output rows (also finds its bucket's key)."),
    ]
    for option in reversed(options):
        function = option(function)
    return db_option(function)


def _installed_builds() -> tuple[str, ...]:
    from ..installed import build_hashes

    return build_hashes()


def _json_flag(function: Any) -> Any:
    return click.option("--json", "as_json", is_flag=True, help="Print stable JSON for programs.")(function)


@click.group(cls=MappedErrors)
@db_option
def db() -> None:
    """Inspect, share, clean and repair the tuning database.

    --db goes before or after the subcommand: a URL when it has a scheme
    (sqlite://, postgresql+psycopg://), else an SQLite file path taken as
    written (~ expanded). Only import creates a database: the others, given a
    path that does not exist, say so (exit 3). import, prune and repair
    refuse an in-memory database (:memory:, sqlite://, ?mode=memory): nothing
    would be saved (exit 2).
    Every command but repair refuses a database with rows that do not parse
    (exit 3) and says to run `kvsplit db repair`, which moves them to a
    quarantine file.

    \b
    Exit codes:
      0  success
      1  nothing matched (show, plot)
      2  usage error or invalid input (bad option, invalid import file)
      3  database problem (bad URL or path, driver not installed,
         unreachable server, missing, corrupt or read-only file, locked,
         damaged rows or version table, schema newer than this kvsplit)
    """


@db.command("list")
@_filters
@_json_flag
@click.pass_context
def list_(ctx: click.Context, as_json: bool, **filters: Any) -> None:
    """List tuning results (winner and speed-up over kv_split=1)."""
    records = _open(ctx).query(**_bucketed(filters))
    if as_json:
        click.echo(to_json(records))
    else:
        console().print(records_table(records))


@db.command()
@_filters
@_json_flag
@click.pass_context
def show(ctx: click.Context, as_json: bool, **filters: Any) -> None:
    """Show one tuning result with every candidate; the filters must pick exactly one."""
    records = _open(ctx).query(**_bucketed(filters))
    if not records:
        raise NotFound("no tuning result matches")
    if len(records) > 1:
        raise InvalidInput(
            f"{counted(len(records), 'tuning result')} match; narrow with --device, --build, --head-dim, "
            f"--dtype, --out-dtype, --stats-format, --num-splits, --rows (see `kvsplit db list`)"
        )
    if as_json:
        click.echo(to_json(records[0]))
    else:
        show_record(console(), records[0])


@db.command()
@click.option("--current-build", metavar="HASH",
              help="Builds other than this are stale [default: the installed builds, CUDA and CPU].")
@_json_flag
@db_option
@click.pass_context
def stats(ctx: click.Context, current_build: str | None, as_json: bool) -> None:
    """Keys per device, mean speed-up over kv_split=1, oldest/newest, stale builds.

    A build is stale, as for `kvsplit db prune --stale-builds`, when it is not an
    installed build of this kvsplit (CUDA or CPU) or, with --current-build, not that
    one; the builds table and --json also mark the installed ones.
    """
    installed = _installed_builds()
    result = store_stats(_open(ctx), current_build or installed, installed)
    if as_json:
        click.echo(to_json(result))
    else:
        show_stats(console(), result, installed=_installed_builds())


@db.command("export")
@_filters
@click.option(
    "--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), help="File to write [default: stdout]."
)
@click.pass_context
def export_(ctx: click.Context, out_path: Path | None, **filters: Any) -> None:
    """Export tuning results as JSON (format kvsplit-tuning, version 1)."""
    export = make_export(_open(ctx).query(**_bucketed(filters)))
    text = dump_export(export)
    if out_path is None:
        click.echo(text, nl=False)
        return
    try:
        out_path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise InvalidInput(f"cannot write {out_path}: {exc.strerror or exc}") from None
    click.echo(f"exported {counted(len(export.records), 'tuning result')} to {printable(out_path)}", err=True)


def _read_export(file: str) -> bytes:
    # Bytes, never a str: parse_export would take a non-JSON str for a path.
    try:
        return read_export_file(file, click.open_file("-", "rb") if file == "-" else None)
    except OSError as exc:
        raise InvalidInput(f"cannot read {file}: {exc.strerror or exc}") from None


@db.command("import")
@click.argument("file", type=click.Path(allow_dash=True, path_type=str))
@click.option(
    "--rule",
    type=click.Choice(typing.get_args(ImportRule)),
    default="newer",
    show_default=True,
    help="For a key already stored: newer = take the import only if its updated_at is later "
    "(ties keep the stored one); replace = always take the import; keep = never.",
)
@click.option("--replace", is_flag=True, help="Same as --rule replace.")
@click.option("--keep", is_flag=True, help="Same as --rule keep.")
@click.option("--dry-run", is_flag=True, help="Validate and count; write nothing.")
@_json_flag
@db_option
@click.pass_context
def import_(
    ctx: click.Context, file: str, rule: str, replace: bool, keep: bool, dry_run: bool, as_json: bool
) -> None:
    """Merge a JSON export (FILE, or - for stdin) into the database, all or nothing.

    The whole file is validated first; any problem (not UTF-8, a key twice,
    unknown field, unknown config, bad times, missing key, a head dim the
    installed kernels do not support) is listed, the first five and a count
    of the rest, and nothing is written. FILE must be a regular file (or a
    symlink to one) of at most 64 MiB. Creates the database if needed.
    """
    if replace and keep:
        raise click.UsageError("--replace and --keep exclude each other")
    rule = "replace" if replace else "keep" if keep else rule
    storing_db_url(ctx)  # a target that cannot take the records is said so before the file is read
    export = parse_export(_read_export(file))  # no reference left to the bytes: parsing frees them
    from ..installed import head_dim_rule, head_dim_supported

    unsupported = [
        f"record {i}: key.head_dim: {r.key.head_dim} is not supported with {r.key.partial_dtype} "
        f"partials by the installed kernels (use {head_dim_rule(r.key.partial_dtype)})"
        for i, r in enumerate(export.records)
        if not head_dim_supported(r.key.head_dim, r.key.partial_dtype)
    ]
    if unsupported:
        raise InvalidExportError(unsupported)
    summary = _open(ctx, create=True, stores=True).import_records(export.records, rule=rule, dry_run=dry_run)
    if as_json:
        click.echo(to_json(summary))
    else:
        show_import(console(), summary)


@db.command()
@click.option("--stale-builds", is_flag=True, help="Delete results of stale builds.")
@click.option(
    "--current-build",
    metavar="HASH",
    help="With --stale-builds: builds other than this are stale [default: the installed builds, CUDA and CPU].",
)
@click.option(
    "--other-devices-than",
    metavar="DEVICE",
    help="Delete results of every device whose name does not contain DEVICE (any case).",
)
@click.option("--older-than", type=Duration(), help="Delete results last updated longer ago than this (30d, 12h, 2w).")
@click.option("--dry-run", is_flag=True, help="Only show what would be deleted.")
@_json_flag
@db_option
@click.pass_context
def prune(
    ctx: click.Context,
    stale_builds: bool,
    current_build: str | None,
    other_devices_than: str | None,
    older_than: timedelta | None,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Delete results matching ANY of the criteria given.

    Rows that do not parse are not pruning's business: see `kvsplit db repair`.
    """
    if not (stale_builds or other_devices_than or older_than is not None):
        raise click.UsageError("give at least one of --stale-builds, --other-devices-than, --older-than")
    if current_build and not stale_builds:
        raise click.UsageError("--current-build only applies with --stale-builds")
    try:
        store = _open(ctx, stores=True)
        result = store.prune(
            stale_builds=stale_builds,
            current_build=current_build if current_build is not None else _installed_builds(),
            other_devices_than=other_devices_than,
            older_than=older_than,
            dry_run=dry_run,
        )
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    if as_json:
        click.echo(
            to_json(
                {
                    "dry_run": result.dry_run,
                    "count": result.count,
                    "keys": [k.model_dump(mode="json") for k in result.keys],
                }
            )
        )
    else:
        show_prune(console(), result)


@db.command()
@_json_flag
@db_option
@click.pass_context
def progress(ctx: click.Context, as_json: bool) -> None:
    """Fleet tuning: every key any `kvsplit tune` registered, done / claimed / failed / left.

    Shows who holds claims (host/pid/device) since when, with their last
    heartbeat, and why keys failed. For one grid, give `kvsplit tune` its grid
    options and --status instead.
    """
    result = fleet_progress(Claims(_open(ctx)))
    if as_json:
        click.echo(to_json(result))
    else:
        show_progress(console(), result)


@db.command()
@click.option(
    "--quarantine",
    "quarantine_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="JSON-lines file the removed rows are appended to "
    "[default: DB.quarantine.jsonl beside an SQLite file, else quarantine.jsonl in the user cache dir].",
)
@click.option("--dry-run", is_flag=True, help="Only list what would be moved; change nothing.")
@_json_flag
@db_option
@click.pass_context
def repair(ctx: click.Context, quarantine_path: Path | None, dry_run: bool, as_json: bool) -> None:
    """Move rows that do not parse to a quarantine file; restore a damaged version table.

    A row does not parse when a column holds the wrong type, a value out of
    range, bad JSON, a bad timestamp or an unknown kernel config. Such rows go,
    with every stored value, to the quarantine file, together with the rows
    that cannot stand without them (results of a damaged device or build,
    candidates of a removed result); every other row stays. A missing, empty
    or duplicated version table is stamped again when the tables are those of
    this kvsplit's schema, and missing tables are created. Never creates a
    database; a newer schema is left alone (exit 3).
    """
    url = storing_db_url(ctx)
    store, schema_repairs = open_store_for_repair(url, dry_run=dry_run, config_type=KernelConfig)
    ctx.call_on_close(store.close)
    path = quarantine_path or default_quarantine(parse_target(url).path)
    try:
        result = store.repair(quarantine_writer(path, store.url), dry_run=dry_run)
    except OSError as exc:
        where = quarantine_path or "the quarantine file"
        raise InvalidInput(
            f"cannot write {where}: {exc.strerror or exc}; nothing was removed (give another path with --quarantine)"
        ) from None
    result = result.model_copy(update={"schema_repairs": schema_repairs,
                                       "quarantine_file": str(path) if result.count else None})
    if as_json:
        click.echo(to_json(result))
    else:
        show_repair(console(), result)


@db.command()
@_filters
@click.option(
    "--out",
    "out_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default="kvsplit-tuning.png",
    show_default=True,
    help="File to write: .png, .svg or .pdf (its directory must exist).",
)
@click.pass_context
def plot(ctx: click.Context, out_path: Path, **filters: Any) -> None:
    """Draw the winner config and its speed-up over kv_split=1 (PNG, SVG or PDF).

    One row of two heat maps (num_splits x rows) per device, build, head dim,
    dtypes and stats format.
    """
    from .plot import FORMATS, MAX_GROUPS, matplotlib, plot_records

    try:
        matplotlib()
    except ImportError as exc:
        raise InvalidInput(str(exc)) from None
    if out_path.suffix.lower() not in FORMATS:
        raise InvalidInput(f"--out {printable(out_path)}: name a {', '.join(FORMATS)} file (the "
                           "suffix is the format written)")
    if not out_path.parent.is_dir():
        raise InvalidInput(f"--out {printable(out_path)}: the directory {printable(out_path.parent)} "
                           "does not exist")
    records = _open(ctx).query(**_bucketed(filters))
    if not records:
        raise NotFound("no tuning result matches; nothing to plot")
    try:
        groups = plot_records(records, out_path)
    except OSError as exc:
        raise InvalidInput(f"cannot write {out_path}: {exc.strerror or exc}") from None
    more = f" (first {MAX_GROUPS} groups only; use filters)" if groups == MAX_GROUPS else ""
    click.echo(f"wrote {printable(out_path)}: {counted(groups, 'group')}, {counted(len(records), 'result')}{more}", err=True)
