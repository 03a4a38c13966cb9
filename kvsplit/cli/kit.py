"""What every ``kvsplit`` command shares: exit codes, ``--db``, ``--debug``, and error mapping.

Exit codes: 0 success; 1 nothing matched (``db show``, ``db plot``) or a
tuning key failed; 2 usage error or invalid input (bad option, invalid import
file, a ``KVSPLIT_*`` variable kvsplit cannot use); 3 database problem.  An
error kvsplit did not foresee is one line on stderr and exit 1; only
``kvsplit --debug`` shows its traceback.
"""

from __future__ import annotations

import traceback
import warnings
from typing import Any

import click

from ..db.engine import parse_target, visible
from ..db.schemas import DbWarning, StoreError
from ..dispatch import InvalidSetting
from ..export import InvalidExportError
from ..files import InputRefused
from ..terminal import printable, printable_lines

EXIT_NOT_FOUND = 1
EXIT_INTERNAL = 1
EXIT_INVALID = 2
EXIT_DATABASE = 3

_DB_KEY = "kvsplit.db_url"
_DEBUG_KEY = "kvsplit.debug"


class _Message(click.ClickException):
    """A message that may quote a file, a database or a path: control characters shown as escapes."""

    def format_message(self) -> str:
        return printable_lines(self.message)


class InvalidInput(_Message):
    """Bad input that click itself did not catch: exit 2, like a usage error."""

    exit_code = EXIT_INVALID


class DatabaseProblem(_Message):
    exit_code = EXIT_DATABASE


class NotFound(_Message):
    exit_code = EXIT_NOT_FOUND


class InternalError(_Message):
    exit_code = EXIT_INTERNAL


def _remember_db(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    # ctx.meta is shared by the whole command chain, and options are handled
    # outer command first: the --db given nearest the end of the line wins.
    if value is not None:
        ctx.meta[_DB_KEY] = value


def db_option(function: Any) -> Any:
    """``--db URL``, accepted on the main command, on ``db`` and on every subcommand."""
    return click.option(
        "--db",
        metavar="URL",
        expose_value=False,
        is_eager=True,
        callback=_remember_db,
        help="SQLAlchemy URL (it has a scheme: sqlite://, postgresql+psycopg://) or SQLite file path, taken as "
        "written [env KVSPLIT_DB; default: tuning.sqlite in the user cache dir].",
    )(function)


def db_url(ctx: click.Context) -> str | None:
    """The ``--db`` given anywhere on the command line, else ``None`` (then ``KVSPLIT_DB`` or the default)."""
    return ctx.meta.get(_DB_KEY)


def storing_db_url(ctx: click.Context) -> str | None:
    """:func:`db_url` for a command that stores: an in-memory database is refused (exit 2).

    Such a database starts empty in every process and is gone at its exit:
    nothing the command stores would be saved.  A target that names no
    database at all is a database problem (exit 3), as for every command.
    """
    url = ctx.meta.get(_DB_KEY)
    target = parse_target(url)
    if target.memory:
        raise InvalidInput(
            f"{target.shown} is an in-memory database: nothing would be saved; give an SQLite file path "
            f"or a server URL with --db or KVSPLIT_DB"
        )
    return url


def debug_option(function: Any) -> Any:
    def remember(ctx: click.Context, param: click.Parameter, value: bool) -> None:
        if value:
            ctx.meta[_DEBUG_KEY] = True

    return click.option(
        "--debug",
        is_flag=True,
        expose_value=False,
        is_eager=True,
        callback=remember,
        help="Show the traceback behind an error (for bug reports).",
    )(function)


class MappedErrors(click.Group):
    """Turns every exception into one line and an exit code; prints warnings as ``warning: ...`` lines."""

    def invoke(self, ctx: click.Context) -> Any:
        debug = ctx.meta.get(_DEBUG_KEY, False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", DbWarning)
            try:
                return super().invoke(ctx)
            except (click.exceptions.Exit, click.Abort, click.ClickException, SystemExit):
                raise
            except Exception as exc:  # noqa: BLE001 - no traceback reaches a user
                if ctx.meta.get(_DEBUG_KEY, debug):
                    traceback.print_exception(exc)
                raise mapped(exc) from None
            finally:
                for w in caught:
                    click.echo(f"warning: {printable(w.message)}", err=True)


def mapped(exc: Exception) -> click.ClickException:
    """The click exception (message and exit code) that stands for ``exc``."""
    if isinstance(exc, StoreError):
        return DatabaseProblem(visible(str(exc)))  # one line, whatever a name or a driver put in it
    if isinstance(exc, InvalidExportError):
        lines = "\n".join(f"  {printable(p)}" for p in exc.report())
        return InvalidInput(f"invalid tuning export, nothing was written:\n{lines}")
    if isinstance(exc, (InvalidSetting, InputRefused)):
        return InvalidInput(str(exc))
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return InternalError(
        f"internal error: {type(exc).__name__}{': ' + text if text else ''}; "
        f"run again with `kvsplit --debug ...` for the traceback and report it"
    )
