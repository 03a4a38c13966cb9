"""benchmarks/lab/labkit.py's ctypes MergeParams has params.h's layout and defaults.

The lab drivers hand kernels a MergeParams built in Python; a field missing or out
of place there reads as garbage in the kernel (a zero pass_through_tokens passes
every row through). The host compiler states the layout: offsetof and sizeof of
every field, compiled from params.h itself.
"""

from __future__ import annotations

import importlib.util
import math
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("kvsplit_labkit", ROOT / "benchmarks/lab/labkit.py")
labkit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(labkit)

COMPILER = shutil.which("c++") or shutil.which("g++")
DEFAULTS = ("heads", "seqlen", "row_mask_stride", "pass_through_tokens", "pass_through_split",
            "group_scales_stride", "group_scales_dtype", "log2_scale", "export_scale",
            "empty_stat", "stats_in_place", "flat_rows")


@pytest.mark.skipif(COMPILER is None, reason="no C++ compiler")
def test_the_lab_params_are_params_h(tmp_path):
    names = [name for name, _ in labkit.Params._fields_]
    source = tmp_path / "layout.cpp"
    source.write_text(
        "#include <cstddef>\n#include <cstdio>\n#include \"kvsplit/params.h\"\n"
        "int main() {\n  kvsplit::MergeParams p;\n"
        "  std::printf(\"size %zu\\n\", sizeof(kvsplit::MergeParams));\n"
        + "".join(f"  std::printf(\"default_{n} %.17g\\n\", (double)p.{n});\n"
                  for n in DEFAULTS)
        + "".join(f"  std::printf(\"{n} %zu\\n\", offsetof(kvsplit::MergeParams, {n}));\n"
                  for n in names) + "}\n")
    binary = tmp_path / "layout"
    subprocess.run([COMPILER, "-std=c++17", f"-I{ROOT / 'csrc/include'}", str(source), "-o",
                    str(binary)], check=True)
    facts = dict(line.split() for line in subprocess.run(
        [str(binary)], check=True, capture_output=True, text=True).stdout.splitlines())
    assert int(facts["size"]) == labkit.ctypes.sizeof(labkit.Params)
    for name in names:
        assert int(facts[name]) == getattr(labkit.Params, name).offset, name
    made = labkit.Params()
    for name in DEFAULTS:
        want, got = float(facts[f"default_{name}"]), float(getattr(made, name))
        assert want == got or (math.isnan(want) and math.isnan(got)), name
