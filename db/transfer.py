"""The JSON export format: validated reading and stable writing.

``{"format": "kvsplit-tuning", "version": 1, "exported_at": ..., "tool_version": ...,
"records": [TuningRecord, ...]}``.  Reading validates the whole file before
anything is written anywhere, and reports every problem with the index of the
record and the field.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from pydantic import ValidationError

from .errors import InvalidExportError
from .schemas import ExportFile, TuningRecord


def tool_version() -> str:
    """The installed kvsplit version, or ``"unknown"`` when running from a source tree."""
    try:
        return metadata.version("kvsplit")
    except metadata.PackageNotFoundError:
        return "unknown"


def _where(loc: tuple) -> str:
    if len(loc) >= 2 and loc[0] == "records" and isinstance(loc[1], int):
        field = ".".join(str(part) for part in loc[2:])
        return f"record {loc[1]}: {field}" if field else f"record {loc[1]}"
    return ".".join(str(part) for part in loc) or "file"


def _problems(error: ValidationError) -> list[str]:
    lines = []
    for item in error.errors(include_url=False):
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"{_where(tuple(item['loc']))}: {message}")
    return lines


def parse_export(source: str | bytes | Path) -> ExportFile:
    """Validate an export given as JSON text, bytes or a file path.

    A ``str`` that starts with ``{`` (after blanks) is JSON text; any other
    ``str`` is a path.

    Raises
    ------
    InvalidExportError
        Malformed JSON, wrong format or version, unknown or missing fields,
        bad configs or times, a key that appears twice.  Every problem found
        is listed, each naming the record index and the field.
    OSError
        The file cannot be read.
    """
    if isinstance(source, Path) or (isinstance(source, str) and not source.lstrip().startswith("{")):
        source = Path(source).read_bytes()
    try:
        export = ExportFile.model_validate_json(source)
    except ValidationError as exc:
        raise InvalidExportError(_problems(exc)) from None
    seen: dict[object, int] = {}
    duplicates = []
    for index, record in enumerate(export.records):
        first = seen.setdefault(record.key, index)
        if first != index:
            duplicates.append(f"record {index}: key: same key as record {first}")
    if duplicates:
        raise InvalidExportError(duplicates)
    return export


def read_export(source: str | bytes | Path) -> list[TuningRecord]:
    """The records of a validated export (see :func:`parse_export`).

    Also reads the tables shipped inside the package, e.g.
    ``read_export(importlib.resources.files("kvsplit").joinpath("tables/h200.json").read_text())``.
    """
    return parse_export(source).records


def make_export(records: Iterable[TuningRecord]) -> ExportFile:
    """Wrap ``records`` as an export stamped with now and this kvsplit's version."""
    return ExportFile(exported_at=datetime.now(timezone.utc), tool_version=tool_version(), records=list(records))


def dump_export(export: ExportFile) -> str:
    """Stable JSON text of ``export`` (field order fixed, two-space indent, trailing newline)."""
    return export.model_dump_json(indent=2) + "\n"
