"""Text read from a database or a file, shown as data: never markup, never terminal control.

A device name, a build hash, a worker's name, an error text or a path may come
from a tuning file someone shared.  Every command shows such text through
:func:`printable` (plain output) or :func:`text` (rich output): control
characters (C0 such as ESC, BEL and CR, DEL, C1, the bidirectional overrides,
line separators, lone surrogates) become visible escapes like ``\\x1b``, and
rich markup such as ``[link=...]`` is never parsed in them, since a
:class:`rich.text.Text` is not markup.  ``--json`` output does not come here:
json writes the exact string, escaped by JSON's rules.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.text import Text

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(value: object) -> str:
    """``str(value)`` with every control character written as an escape (``\\x1b``, ``\\u202e``)."""
    return _CONTROL.sub(_escape, str(value))


def printable_lines(value: object) -> str:
    """:func:`printable` line by line: the line breaks of a message of several lines stay."""
    return "\n".join(printable(line) for line in str(value).split("\n"))


def counted(number: int, noun: str) -> str:
    """``number`` and ``noun``, plural unless it is one: "1 key", "1,024 tuning results"."""
    return f"{number:,} {noun}{'' if number == 1 else 's'}"


def text(value: object, style: str = "") -> Text:
    """``value`` as a rich :class:`~rich.text.Text`: shown literally, markup and all."""
    from rich.text import Text  # rich loads with the commands that render, not with the plain helpers above

    return Text(printable(value), style=style)


def labelled(label: str, value: object, width: int = 12) -> Text:
    """``label`` in bold, padded to ``width``, then ``value`` as data."""
    from rich.text import Text

    return Text.assemble((label, "bold"), " " * max(1, width - len(label)), text(value))
