"""kvsplit's modules and the imports between them, as the package installs.

Reads every ``.py`` file of the folders that pyproject's
``[tool.scikit-build.wheel.packages]`` maps into ``kvsplit``, under the names
they install as, and every import statement in them: at module level and inside
functions alike (a function-local import is still a dependency). Only imports
of kvsplit's own modules are edges. ``from .pkg import name`` is an edge to
``pkg.name`` when that is a module, else to ``pkg``. A module's import of its
own parent packages (which Python runs first) is not counted.

Run as a script to print the graph's floors (longest chains of imports),
cycles and every edge: ``python tests/import_graph.py [--packages] [repository root]``
(``--packages``: each subpackage as one node).
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def package_folders(root: Path = ROOT) -> dict[str, Path]:
    """Installed package name -> source folder, from pyproject.toml."""
    with open(root / "pyproject.toml", "rb") as stream:
        table = tomllib.load(stream)["tool"]["scikit-build"]["wheel"]["packages"]
    return {name.replace("/", "."): root / folder for name, folder in table.items()}


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Installed module name -> source file (``pkg`` for ``pkg/__init__.py``)."""
    found = {}
    folders = package_folders(root)
    for package, folder in folders.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package,) + parts).removesuffix(".__init__")
            # A folder mapped under another package's name is that package's, not a copy.
            if any(path.is_relative_to(other) and other != folder and len(other.parts) > len(folder.parts)
                   for other in folders.values()):
                continue
            found[name] = path
    return found


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The kvsplit modules that ``name`` imports anywhere in its file."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, is_package, node.level, node.module)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # ``import kvsplit.db.x as y`` and the like
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the kvsplit modules it imports."""
    files = modules(root)
    known = set(files)
    return {name: imports(name, path, known) for name, path in files.items()}


def packages(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same graph with every subpackage of kvsplit (``kvsplit.db``, ``kvsplit.cli``, ...)
    collapsed into one node: the imports between folders."""
    subpackages = {".".join(m.split(".")[:2]) for m in edges if m.count(".") > 1}

    def node(module: str) -> str:
        top = ".".join(module.split(".")[:2])
        return top if top in subpackages else module

    collapsed: dict[str, set[str]] = {}
    for source, targets in edges.items():
        collapsed.setdefault(node(source), set()).update(
            node(t) for t in targets if node(t) != node(source))
    return collapsed


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in edges.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(groups)


def floors(edges: dict[str, set[str]]) -> dict[str, int]:
    """Floor of each module: 0 for a module that imports none of kvsplit, else one above
    the highest module it imports; the modules of a cycle share a floor (the cycle is
    collapsed into one node first)."""
    group_of = {m: m for m in edges}
    for group in cycles(edges):
        for member in group:
            group_of[member] = group[0]
    collapsed: dict[str, set[str]] = {}
    for node, targets in edges.items():
        collapsed.setdefault(group_of[node], set()).update(
            group_of[t] for t in targets if group_of[t] != group_of[node])
    memo: dict[str, int] = {}

    def floor(node: str) -> int:
        if node not in memo:
            memo[node] = 1 + max((floor(t) for t in collapsed.get(node, ())), default=-1)
        return memo[node]

    return {m: floor(group_of[m]) for m in edges}


def back_edges(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports that point up or sideways inside a cycle: for each cycle, the edges from a
    module to one that is not below it once the cycle's own edges are left out."""
    result = []
    for group in cycles(edges):
        members = set(group)
        inner = {m: edges[m] & members for m in group}
        # Order the cycle by how many of its members each imports: an edge to a module
        # that imports at least as many of them is counted as pointing back up.
        weight = {m: len(inner[m]) for m in group}
        for m in group:
            for t in sorted(inner[m]):
                if (weight[t], t) >= (weight[m], m):
                    result.append((m, t))
    return result


def main(argv: list[str]) -> None:
    paths = [a for a in argv[1:] if not a.startswith("--")]
    root = Path(paths[0]).resolve() if paths else ROOT
    edges = graph(root)
    if "--packages" in argv:
        edges = packages(edges)
    level = floors(edges)
    groups = cycles(edges)
    print(f"{len(edges)} modules, {sum(map(len, edges.values()))} imports, "
          f"{max(level.values()) + 1} floors, {len(groups)} cycles")
    for group in groups:
        print("cycle:", " <-> ".join(group))
    for top in range(max(level.values()), -1, -1):
        print(f"floor {top}: {' '.join(sorted(m for m in edges if level[m] == top))}")
    for source in sorted(edges):
        for target in sorted(edges[source]):
            print(f"  {source} -> {target}")


if __name__ == "__main__":
    main(sys.argv)
