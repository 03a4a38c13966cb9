"""benchmarks/compare_records.py compares two builds' candidate timings config by config."""

from __future__ import annotations

import importlib.util
import math
import pathlib
import random

from kvsplit.export import dump_export, make_export, read_export

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("compare_records", ROOT / "benchmarks/compare_records.py")
compare_records = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_records)

SHIPPED = ROOT / "kvsplit/tables/nvidia-h200.json"


def _scaled(records, build: str, factor_of) -> list:
    """The records under another build hash, each candidate's times multiplied by factor_of(config)."""
    out = []
    for record in records:
        copy = record.model_copy(deep=True)
        copy.key = copy.key.model_copy(update={"build_hash": build})
        for candidate in copy.candidates:
            factor = factor_of(candidate.config)
            candidate.median_us *= factor
            candidate.p10_us *= factor
            candidate.p90_us *= factor
        out.append(copy)
    return out


def test_each_family_reports_the_ratio_its_candidates_moved_by(tmp_path):
    """Base: shipped records under one build; new: the same under another build with every
    DSplit candidate 0.9x and every other 1.1x, over three files whose medians are those
    (the middle one scaled, the others far off on either side). The report's family lines
    carry 0.900 and 1.100 and the count of candidates each family has."""
    records = read_export(SHIPPED)[:12]
    fast, slow = 0.9, 1.1
    factor = lambda config: fast if config.family == "dsplit" else slow  # noqa: E731
    (tmp_path / "base.json").write_text(dump_export(make_export(_scaled(records, "base", lambda c: 1.0))))
    jitter = random.Random(7).uniform(1.5, 3.0)
    for name, spread in (("a", 1 / jitter), ("b", 1.0), ("c", jitter)):
        scaled = _scaled(records, "new", lambda c, s=spread: factor(c) * s)
        (tmp_path / f"new_{name}.json").write_text(dump_export(make_export(scaled)))
    base = compare_records._timings([tmp_path / "base.json"])
    new = compare_records._timings(sorted(tmp_path.glob("new_*.json")))
    lines = compare_records.compare(base, new)
    counts = {}
    for record in records:
        for candidate in record.candidates:
            if candidate.matched and candidate.samples:
                counts[candidate.config.family] = counts.get(candidate.config.family, 0) + 1
    for family, count in counts.items():
        line = next(line for line in lines if line.startswith(f"| {family} | all |"))
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert int(cells[2]) == count
        assert math.isclose(float(cells[3]), fast if family == "dsplit" else slow, abs_tol=5e-4)


def test_no_candidate_in_common_says_so(tmp_path):
    records = read_export(SHIPPED)[:1]
    (tmp_path / "a.json").write_text(dump_export(make_export(records)))
    other = [r.model_copy(update={"key": r.key.model_copy(update={"head_dim": r.key.head_dim + 8})})
             for r in records]
    (tmp_path / "b.json").write_text(dump_export(make_export(other)))
    lines = compare_records.compare(compare_records._timings([tmp_path / "a.json"]),
                                    compare_records._timings([tmp_path / "b.json"]))
    assert lines == ["no candidate was timed in both groups"]
