"""What importing kvsplit loads (the tuning store's SQLAlchemy and Alembic only at its first
use), and how its modules import each other: only down the layers, without cycles."""

from __future__ import annotations

import os
import subprocess
import sys

import import_graph  # tests/import_graph.py (tests/ is on sys.path: see conftest.py)


def loaded_after(code: str, db_path, *, top_level: bool = True) -> set[str]:
    """Modules present after running ``code`` in a fresh interpreter (top-level names only,
    unless ``top_level`` is False)."""
    names = "{m.split('.')[0] for m in sys.modules}" if top_level else "set(sys.modules)"
    probe = code + f"\nimport sys; print(' '.join(sorted({names})))"
    env = {**os.environ, "KVSPLIT_DB": str(db_path)}
    result = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True,
                            check=True, timeout=120, env=env)
    return set(result.stdout.split())


def test_importing_kvsplit_and_its_merges_loads_no_store(tmp_path):
    loaded = loaded_after("import kvsplit, kvsplit.merge, kvsplit.compat.vllm, kvsplit.dispatch",
                          tmp_path / "tuning.sqlite")
    assert {"torch", "kvsplit"} <= loaded
    assert not {"sqlalchemy", "alembic", "matplotlib", "rich", "click"} & loaded


def test_the_store_and_the_tuner_load_at_the_first_table_miss(tmp_path):
    imports = "import kvsplit, kvsplit.merge, kvsplit.compat.vllm, kvsplit.dispatch.dispatcher"
    loaded = loaded_after(imports, tmp_path / "tuning.sqlite", top_level=False)
    assert {"kvsplit.merge", "kvsplit.dispatch.dispatcher"} <= loaded
    # The store's plain data types (kvsplit.db.schemas) sit below the vocabulary; its
    # database side and the tuner wait for a table miss.
    assert not {"kvsplit.db.store", "kvsplit.db.engine", "kvsplit.autotune.tuner"} & loaded
    loaded = loaded_after(imports + "\nimport torch\n"
                          "kvsplit.merge_lse(torch.randn(2, 4, 64).bfloat16(), torch.randn(2, 4))",
                          tmp_path / "tuning.sqlite", top_level=False)
    assert {"kvsplit.db.store", "kvsplit.db.engine", "kvsplit.autotune.tuner"} <= loaded


def test_the_first_merge_opens_the_store(tmp_path):
    loaded = loaded_after("import torch, kvsplit\n"
                          "kvsplit.merge_lse(torch.randn(2, 4, 64).bfloat16(), torch.randn(2, 4))",
                          tmp_path / "tuning.sqlite")
    assert "sqlalchemy" in loaded
    # A library's merge, first-use tuning included, renders nothing: the commands' libraries stay out.
    assert not {"rich", "click", "matplotlib"} & loaded


# -- layers ---------------------------------------------------------------------------------
# Imports only look down. The layers, bottom to top, and the modules each holds (a name
# ending in ".*" takes a package's modules). A module may import modules of its own
# layer and of the layers below, never above; the check counts function-local imports
# too (tests/import_graph.py), so a lazy import is fine only when it points down.
LAYERS = (
    # The store: configs as plain data, nothing of the kernel extension or the layers above.
    ("store", ("kvsplit.db", "kvsplit.db.*")),
    ("vocabulary", ("kvsplit._native", "kvsplit.config", "kvsplit.files", "kvsplit.terminal",
                    "kvsplit.reference", "kvsplit.installed", "kvsplit.export",
                    "kvsplit.export_text")),
    ("op", ("kvsplit._kernel", "kvsplit.validation", "kvsplit.launches")),
    ("tuning", ("kvsplit.autotune", "kvsplit.autotune.*")),
    ("choice", ("kvsplit.dispatch", "kvsplit.dispatch.*")),
    ("api", ("kvsplit", "kvsplit.merge", "kvsplit._call", "kvsplit.compat", "kvsplit.compat.*")),
    ("cli", ("kvsplit.__main__", "kvsplit.cli", "kvsplit.cli.*", "kvsplit.info", "kvsplit.demo")),
)


def layer_of(module: str) -> int:
    """The index in LAYERS of the layer that holds ``module``."""
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            if module == member or (member.endswith(".*")
                                    and module.startswith(member.removesuffix("*"))):
                return index
    raise LookupError(f"{module} is in no layer of tests/test_imports.py's LAYERS: place it")


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a layer above its own, as text."""
    return [f"{source} ({LAYERS[layer_of(source)][0]}) imports {target} "
            f"({LAYERS[layer_of(target)][0]})"
            for source in sorted(edges) for target in sorted(edges[source])
            if layer_of(target) > layer_of(source)]


def test_every_module_is_in_one_layer():
    for module in import_graph.graph():
        layer_of(module)


def test_imports_only_look_down():
    assert upward_imports(import_graph.graph()) == []


def test_no_cycles_among_modules_or_folders():
    edges = import_graph.graph()
    assert import_graph.cycles(edges) == []
    assert import_graph.cycles(import_graph.packages(edges)) == []


def test_the_check_sees_an_upward_import_and_a_cycle():
    """The checks can fail: a function-local import of the dispatcher in the op layer is
    caught, and so is a cycle through it."""
    edges = {module: set(targets) for module, targets in import_graph.graph().items()}
    edges["kvsplit.launches"].add("kvsplit.dispatch.dispatcher")
    assert upward_imports(edges) == ["kvsplit.launches (op) imports kvsplit.dispatch.dispatcher "
                                     "(choice)"]
    assert ["kvsplit.dispatch.dispatcher", "kvsplit.launches"] in import_graph.cycles(edges)


def test_the_graph_counts_function_local_imports(tmp_path):
    (tmp_path / "kvsplit").mkdir()
    (tmp_path / "kvsplit" / "__init__.py").write_text("")
    (tmp_path / "kvsplit" / "low.py").write_text("def f():\n    from . import high\n")
    (tmp_path / "kvsplit" / "high.py").write_text("from .low import f\n")
    (tmp_path / "pyproject.toml").write_text(
        '[tool.scikit-build.wheel.packages]\n"kvsplit" = "kvsplit"\n')
    edges = import_graph.graph(tmp_path)
    assert edges["kvsplit.low"] == {"kvsplit.high"} and edges["kvsplit.high"] == {"kvsplit.low"}
    assert import_graph.cycles(edges) == [["kvsplit.high", "kvsplit.low"]]


def test_the_store_knows_nothing_of_the_kernel_extension(tmp_path):
    """Every module of kvsplit.db, used to read and write a store, loads no extension and no layer above."""
    probe = ("import pkgutil, sys, importlib, kvsplit.db as db\n"
             "for m in pkgutil.iter_modules(db.__path__):\n"
             "    importlib.import_module('kvsplit.db.' + m.name)\n"
             "store = db.open_store('sqlite://')\n"
             "store.query(); store.inventory(); store.repair(print, dry_run=True)\n"
             "print(' '.join(sorted(sys.modules)))")
    result = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True, check=True,
                            timeout=120, env={**os.environ, "KVSPLIT_DB": str(tmp_path / "t.sqlite")})
    loaded = set(result.stdout.split())
    assert "sqlalchemy" in loaded and "kvsplit.db.store" in loaded
    above = {"torch", "kvsplit._ext", "kvsplit.config", "kvsplit.installed", "kvsplit.dispatch", "kvsplit.autotune",
             "kvsplit.cli", "kvsplit.export", "matplotlib"}
    assert not above & loaded
