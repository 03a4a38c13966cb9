"""The JSON text of a tuning export, walked one record at a time.

Validating a whole export in one pydantic call holds every error of every
record at once (2 MiB of bad records took 1.5 GB), and json and pydantic both
take the last of two equal keys without a word.  So the text is walked here:
the top-level object member by member, the ``records`` array element by
element.  json checks each element's syntax and keys (building ``None`` for
every object and number, not a tree) in a window of the text no larger than
:data:`VALUE_LIMIT`, so that no larger value is ever parsed, and the
element's text then goes to pydantic on its own.  Memory is the text plus
the valid records, whatever the file holds.

Locations are pydantic's: ``("records", 3, "key", "device")``, ``("format",)``,
or ``()`` for the file as a whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from json.decoder import scanstring

#: Characters of one record's (or one other member's) JSON text; a real record is a few KiB.
VALUE_LIMIT = 256 * 1024

Report = Callable[[tuple, str], None]

_SPACE = re.compile(r"[ \t\n\r]*")
# A JSON string (escapes included), and what to look at to find where a value ends.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_SPECIAL = re.compile(r'["\[\]{}]')
_SCALAR = re.compile(r"[^,\]}\s]*")


class _Duplicates(list):
    """The paths (tuples, the key last) of the keys that appear twice inside one JSON value."""


def _nothing(_literal: str) -> None:
    return None


def _object(pairs: list[tuple[str, object]]) -> _Duplicates | None:
    found = _Duplicates()
    if len({name for name, _ in pairs}) != len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                found.append((name,))
            seen.add(name)
    for name, value in pairs:
        if type(value) is list or type(value) is _Duplicates:  # anything else is clean
            found.extend((name, *path) for path in _inside(value))
    return found or None


def _inside(value: object) -> Iterator[tuple]:
    if type(value) is _Duplicates:
        yield from value  # type: ignore[misc]
    elif type(value) is list:
        for index, item in enumerate(value):  # type: ignore[arg-type]
            if type(item) is list or type(item) is _Duplicates:
                yield from ((index, *path) for path in _inside(item))


# Syntax and duplicate keys only: objects become None (or their duplicates), numbers None.
_CHECKER = json.JSONDecoder(object_pairs_hook=_object, parse_float=_nothing, parse_int=_nothing,
                            parse_constant=_nothing)


def syntax_problem(error: json.JSONDecodeError) -> str:
    return f"invalid JSON at line {error.lineno} column {error.colno}: {error.msg}"


def duplicate_problems(loc: tuple, duplicates: list[tuple]) -> Iterator[tuple[tuple, str]]:
    for path in duplicates:
        yield (*loc, *path[:-1]), f"key {json.dumps(path[-1])} appears twice"


class ExportText:
    """One walk over an export's text.

    Iterate :meth:`records` for ``(index, JSON text)`` of every record that
    passed the checks here; every other problem goes to ``report``.  After the
    walk, :attr:`header` holds the JSON text of each other member of the
    top-level object, :attr:`has_records` whether ``records`` was an array,
    and :attr:`count` how many elements it had.  A syntax error ends the walk
    (reported as ``JSONDecodeError`` through ``report`` at ``()``).
    """

    def __init__(self, text: str, report: Report) -> None:
        self.text = text
        self.report = report
        self.header: dict[str, str] = {}
        self.has_records = False
        self.count = 0
        self._window = 4096  # characters of text parsed for the next value (see _parse)

    def records(self) -> Iterator[tuple[int, str]]:
        try:
            yield from self._walk()
        except json.JSONDecodeError as error:
            self.report((), syntax_problem(error))
        except RecursionError:
            self.report((), "invalid JSON: nested too deeply")

    # -- the walk ------------------------------------------------------------------------

    def _skip(self, i: int) -> int:
        return _SPACE.match(self.text, i).end()  # type: ignore[union-attr]

    def _expect(self, i: int, what: str) -> None:
        if not self.text.startswith(what, i):
            raise json.JSONDecodeError(f"Expecting {what!r}", self.text, i)

    def _walk(self) -> Iterator[tuple[int, str]]:
        text = self.text
        i = self._skip(0)
        if i == len(text):
            self.report((), "empty: no JSON in it")
            return
        if not text.startswith("{", i):
            self.report((), 'not a JSON object (an export is {"format": "kvsplit-tuning", "version": 1, '
                            '"records": [...]})')
            return
        i = self._skip(i + 1)
        seen: set[str] = set()
        while not text.startswith("}", i):
            if seen:  # after a member: a comma, then the next one
                self._expect(i, ",")
                i = self._skip(i + 1)
            if not text.startswith('"', i):
                raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, i)
            name, i = scanstring(text, i + 1)
            i = self._skip(i)
            self._expect(i, ":")
            i = self._skip(i + 1)
            if name in seen:
                self.report((), f"key {json.dumps(name)} appears twice")
            seen.add(name)
            if name == "records" and text.startswith("[", i):
                self.has_records = True
                i = yield from self._records(i)
            else:
                start = i
                i, ok = self._value(i, (name,))
                if ok:
                    self.header[name] = text[start:i]
            i = self._skip(i)
        i = self._skip(i + 1)
        if i != len(text):
            raise json.JSONDecodeError("Extra data", text, i)

    def _records(self, i: int) -> Iterator[tuple[int, str]]:
        """Yield the records of the array at ``i``; return where it ends."""
        text = self.text
        i = self._skip(i + 1)
        if text.startswith("]", i):
            return i + 1
        while True:
            start = i
            i, ok = self._value(i, ("records", self.count))
            if ok:
                yield self.count, text[start:i]
            self.count += 1
            i = self._skip(i)
            if text.startswith("]", i):
                return i + 1
            self._expect(i, ",")
            i = self._skip(i + 1)

    def _value(self, i: int, loc: tuple) -> tuple[int, bool]:
        """Check the value at ``i``: where it ends, and whether it passed (else it was reported:
        too large, or holding a key twice)."""
        parsed = self._parse(i)
        if parsed is None:
            self.report(loc, f"larger than {VALUE_LIMIT // 1024} KiB of JSON (a tuning record is a few KiB)")
            return self._extent(i), False
        value, end = parsed
        duplicates = list(_inside(value))
        for where, message in duplicate_problems(loc, duplicates):
            self.report(where, message)
        return end, not duplicates

    def _parse(self, i: int) -> tuple[object, int] | None:
        """The checked value at ``i`` and its end; ``None`` when it is over :data:`VALUE_LIMIT`.

        An object or array is parsed in a window of the text twice the size of
        the last one, grown until the value fits (json stops at its end), so
        that nothing larger than the limit is ever parsed and no character is
        scanned in Python on the way; only a value that does not fit in the
        largest window has its extent found by :meth:`_extent`."""
        text = self.text
        if text.startswith(("[", "{"), i):
            window = self._window
            while True:
                stop = min(len(text), i + window)
                try:
                    value, used = _CHECKER.raw_decode(text[i:stop])
                except json.JSONDecodeError as error:
                    if stop == len(text):
                        raise json.JSONDecodeError(error.msg, text, i + error.pos) from None
                    if window > VALUE_LIMIT:
                        break
                    window = min(2 * window, VALUE_LIMIT + 1)
                    continue
                self._window = min(2 * used + 64, VALUE_LIMIT + 1)
                return value, i + used
        end = self._extent(i)
        if end - i > VALUE_LIMIT:
            return None
        try:
            value, used = _CHECKER.raw_decode(text[i:end])
        except json.JSONDecodeError as error:
            raise json.JSONDecodeError(error.msg, text, i + error.pos) from None
        if used != end - i:
            raise json.JSONDecodeError("Expecting ',' delimiter", text, i + used)
        return value, end

    def _extent(self, i: int) -> int:
        """Where the value at ``i`` ends, by its brackets and strings (nothing is built).

        A scalar ends at the next delimiter; brackets that never close, or a
        string that never ends, at the end of the text (json then reports the
        syntax error).  Each character is looked at once: a string that does
        not end stops the scan instead of being searched again from each of
        its quotes."""
        text = self.text
        if text.startswith('"', i):
            string = _STRING.match(text, i)
            return string.end() if string else len(text)
        if not text.startswith(("[", "{"), i):
            return _SCALAR.match(text, i).end()  # type: ignore[union-attr]
        depth = 0
        while (found := _SPECIAL.search(text, i)) is not None:
            char = found.group()
            if char == '"':
                string = _STRING.match(text, found.start())
                if string is None:
                    break
                i = string.end()
                continue
            i = found.end()
            depth += 1 if char in "[{" else -1
            if depth == 0:
                return i
        return len(text)
