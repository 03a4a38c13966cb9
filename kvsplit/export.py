"""The JSON export format of the tuning store: validated reading and stable writing.

``{"format": "kvsplit-tuning", "version": 1, "exported_at": ..., "tool_version": ...,
"records": [TuningRecord, ...]}``.  Reading validates the whole file before
anything is written anywhere, record by record (:mod:`.export_text`), configs
against the kernel layer's vocabulary (:class:`~kvsplit.config.KernelConfig`),
and reports the problems with the index of the record and the field.  The
store (:meth:`kvsplit.db.Store.import_records`) takes the records this returns.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import BinaryIO, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from .config import KernelConfig
from .db.schemas import Time, TuningRecord
from .export_text import ExportText
from .files import IMPORT_LIMIT, read_capped, read_regular
from .terminal import counted

__all__ = ["ExportFile", "InvalidExportError", "dump_export", "make_export", "parse_export", "read_export",
           "read_export_file", "tool_version"]
_KERNEL = {"config": KernelConfig}


def tool_version() -> str:
    """The installed kvsplit version, or ``"unknown"`` when running from a source tree."""
    try:
        return metadata.version("kvsplit")
    except metadata.PackageNotFoundError:
        return "unknown"


class ExportFile(BaseModel):
    """The JSON exchange format, ``{"format": "kvsplit-tuning", "version": 1, "records": [...]}``."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["kvsplit-tuning"] = "kvsplit-tuning"
    version: Literal[1] = 1
    exported_at: Time = None
    tool_version: str | None = None
    records: list[TuningRecord]


class InvalidExportError(ValueError):
    """An export file failed validation; nothing was written.

    Attributes
    ----------
    problems : list of str
        One line per problem, each naming the record index and the field;
        the first 100 problems only when there are more.
    total : int
        How many problems were found in all.
    invalid_records : int
        How many records have at least one.
    """

    def __init__(self, problems: list[str], *, total: int | None = None, invalid_records: int | None = None) -> None:
        self.problems = list(problems)
        self.total = len(self.problems) if total is None else total
        self.invalid_records = len(_records_named(self.problems)) if invalid_records is None else invalid_records
        super().__init__("invalid tuning export: " + "; ".join(self.report()))

    def report(self, shown: int = 5) -> list[str]:
        """The first ``shown`` problems, then one line counting the rest (and the records they are in)."""
        lines = self.problems[:shown]
        more = self.total - len(lines)
        if more > 0:
            records = self.invalid_records - len(_records_named(lines))
            lines.append(f"... and {counted(more, 'more problem')}"
                         + (f" in {counted(records, 'more record')}" if records > 0 else ""))
        return lines


_RECORD = re.compile(r"record (\d+)\b")


def _records_named(problems: list[str]) -> set[str]:
    return {match.group(1) for match in map(_RECORD.match, problems) if match}


def _where(loc: tuple) -> str:
    if len(loc) >= 2 and loc[0] == "records" and isinstance(loc[1], int):
        field = ".".join(str(part) for part in loc[2:])
        return f"record {loc[1]}: {field}" if field else f"record {loc[1]}"
    return ".".join(str(part) for part in loc) or "file"


class _Problems:
    """The first :data:`KEPT` problems as lines, and the count of all and of the records they are in.

    A file of a million bad records makes a million problems: keeping each
    would cost gigabytes, and no one reads them.
    """

    KEPT = 100
    # A record with more pydantic errors than this is one line (listing them costs ~1 kB each).
    LISTED = 1000

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.total = 0
        self.records = 0
        self._last_record: int | None = None

    def add(self, loc: tuple, message: str, count: int = 1) -> None:
        self.total += count
        if len(loc) >= 2 and loc[0] == "records" and isinstance(loc[1], int) and loc[1] != self._last_record:
            self.records += 1
            self._last_record = loc[1]
        if len(self.lines) < self.KEPT:
            self.lines.append(f"{_where(loc)}: {message}")

    def add_validation(self, error: ValidationError, prefix: tuple = ()) -> None:
        count = error.error_count()
        if len(self.lines) >= self.KEPT or count > self.LISTED:
            self.add(prefix, f"{count:,} problems, not listed one by one", count)
            return
        for item in error.errors(include_url=False):
            self.add((*prefix, *item["loc"]), item["msg"].removeprefix("Value error, "))

    def raise_any(self) -> None:
        if self.total:
            raise InvalidExportError(self.lines, total=self.total, invalid_records=self.records)


def _text(source: str | bytes) -> str:
    """The JSON text of ``source``: bytes must be UTF-8; a byte-order mark is dropped."""
    if isinstance(source, str):
        return source.removeprefix("\ufeff")
    try:
        return source.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise InvalidExportError(
            [f"file: not UTF-8 text (byte 0x{source[error.start]:02x} at offset {error.start:,})"]
        ) from None


# The members of the top-level object besides "records"; others are reported as extra.
_HEADER = frozenset(ExportFile.model_fields) - {"records"}


def parse_export(source: str | bytes | Path) -> ExportFile:
    """Validate an export given as JSON text, bytes or a file path.

    A ``str`` that starts with ``{`` (after a byte-order mark and blanks) is
    JSON text; any other ``str`` is a path, read as :func:`read_export_file`
    reads it.  Bytes must be UTF-8 (a byte-order mark is skipped).  Records
    are validated one at a time, so memory stays near the size of the text
    whatever it holds.

    Raises
    ------
    InvalidExportError
        Malformed JSON, text that is not UTF-8, a key twice in one object,
        wrong format or version, unknown or missing fields, bad configs or
        times, two records of one tuning key.  The first 100 problems are
        listed, each naming the record index and the field, and all are
        counted.
    kvsplit.files.InputRefused
        The path is not a regular file, or is larger than
        :data:`kvsplit.files.IMPORT_LIMIT`.
    OSError
        The file cannot be read.
    """
    if isinstance(source, Path) or (
        isinstance(source, str) and not source.removeprefix("\ufeff").lstrip().startswith("{")
    ):
        source = read_export_file(source)
    text = _text(source)
    del source  # the bytes: only the text is needed from here on
    problems = _Problems()
    walk = ExportText(text, problems.add)
    records = []
    for index, record_text in walk.records():
        try:
            records.append(TuningRecord.model_validate_json(record_text, context=_KERNEL))
        except ValidationError as error:
            problems.add_validation(error, ("records", index))
    # The other members, validated together; an unknown one as null (it is reported by name only).
    members = [f"{json.dumps(name)}: {value if name in _HEADER else 'null'}" for name, value in walk.header.items()]
    if walk.has_records and "records" not in walk.header:
        members.append('"records": []')
    del walk, text  # the records are models now
    try:
        export = ExportFile.model_validate_json("{" + ", ".join(members) + "}")
    except ValidationError as error:
        problems.add_validation(error)
    problems.raise_any()
    seen: dict[object, int] = {}
    for index, record in enumerate(records):
        first = seen.setdefault(record.key, index)
        if first != index:
            problems.add(("records", index, "key"), f"same key as record {first}")
    problems.raise_any()
    return export.model_copy(update={"records": records})


def read_export_file(path: str | Path, stdin: BinaryIO | None = None) -> bytes:
    """The bytes of an export file, or of ``stdin`` when ``path`` is ``"-"``, at most
    :data:`~kvsplit.files.IMPORT_LIMIT` of them.

    Raises
    ------
    kvsplit.files.InputRefused
        Not a regular file (refused unopened), or larger than the limit.
    OSError
        The file cannot be read.
    """
    if str(path) == "-" and stdin is not None:
        return read_capped(stdin, IMPORT_LIMIT, name="standard input", hint=_SPLIT_HINT)
    return read_regular(path, IMPORT_LIMIT, hint=_SPLIT_HINT)


_SPLIT_HINT = "; export less at a time (kvsplit db export --device/--build) and import the parts"


def read_export(source: str | bytes | Path) -> list[TuningRecord]:
    """The records of a validated export (see :func:`parse_export`).

    Also reads the tables shipped inside the package, e.g.
    ``read_export(importlib.resources.files("kvsplit").joinpath("tables/nvidia-h200.json").read_text())``.
    """
    return parse_export(source).records


def make_export(records: Iterable[TuningRecord]) -> ExportFile:
    """Wrap ``records`` as an export stamped with now and this kvsplit's version."""
    return ExportFile(exported_at=datetime.now(timezone.utc), tool_version=tool_version(), records=list(records))


def dump_export(export: ExportFile) -> str:
    """Stable JSON text of ``export`` (field order fixed, two-space indent, trailing newline)."""
    return export.model_dump_json(indent=2) + "\n"
