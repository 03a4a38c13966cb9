"""What importing kvsplit loads: the tuning store (SQLAlchemy, Alembic) only at its first use."""

from __future__ import annotations

import os
import subprocess
import sys


def loaded_after(code: str, db_path) -> set[str]:
    """Top-level modules present after running ``code`` in a fresh interpreter."""
    probe = code + "\nimport sys; print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    env = {**os.environ, "KVSPLIT_DB": str(db_path)}
    result = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True,
                            check=True, timeout=120, env=env)
    return set(result.stdout.split())


def test_importing_kvsplit_and_its_merges_loads_no_store(tmp_path):
    loaded = loaded_after("import kvsplit, kvsplit.merge, kvsplit.compat.vllm, kvsplit.dispatch",
                          tmp_path / "tuning.sqlite")
    assert {"torch", "kvsplit"} <= loaded
    assert not {"sqlalchemy", "alembic", "matplotlib", "rich", "click"} & loaded


def test_the_first_merge_opens_the_store(tmp_path):
    loaded = loaded_after("import torch, kvsplit\n"
                          "kvsplit.merge_lse(torch.randn(2, 4, 64).bfloat16(), torch.randn(2, 4))",
                          tmp_path / "tuning.sqlite")
    assert "sqlalchemy" in loaded
