"""Runs a kvsplit command in-process with stdout and stderr apart (click 8.1 and 8.2+)."""

from __future__ import annotations

from types import SimpleNamespace

from click.testing import CliRunner


def invoke(command, *args: str, input=None, catch: bool = False) -> SimpleNamespace:
    """``command`` (a click command or group) with ``args``; ``output`` is stdout + stderr."""
    try:
        runner = CliRunner(mix_stderr=False)  # click < 8.2 mixes them by default
    except TypeError:
        runner = CliRunner()  # click >= 8.2 always keeps them apart
    result = runner.invoke(command, list(args), input=input, catch_exceptions=catch)
    return SimpleNamespace(exit_code=result.exit_code, stdout=result.stdout, stderr=result.stderr,
                           output=result.stdout + result.stderr, exception=result.exception)
