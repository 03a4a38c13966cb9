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


def test_the_store_knows_nothing_of_the_kernel_extension(tmp_path):
    """Every module of kvsplit.db, used to read and write a store, loads no extension and no layer above."""
    probe = ("import pkgutil, sys, importlib, kvsplit.db as db\n"
             "for m in pkgutil.iter_modules(db.__path__):\n"
             "    importlib.import_module('kvsplit.db.' + m.name)\n"
             "store = db.open_store('sqlite://')\n"
             "store.query(); store.stats(); store.repair(dry_run=True)\n"
             "print(' '.join(sorted(sys.modules)))")
    result = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True, check=True,
                            timeout=120, env={**os.environ, "KVSPLIT_DB": str(tmp_path / "t.sqlite")})
    loaded = set(result.stdout.split())
    assert "sqlalchemy" in loaded and "kvsplit.db.store" in loaded
    above = {"torch", "kvsplit._ext", "kvsplit.config", "kvsplit.installed", "kvsplit.dispatch", "kvsplit.autotune",
             "kvsplit.cli", "kvsplit.export", "matplotlib"}
    assert not above & loaded
