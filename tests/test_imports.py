"""The import graph of dlrm/, embeddings/ and data/: every module imports in a fresh
interpreter, no two modules import each other (even through function-local imports),
and the layers point one way: data ◄── embeddings ◄── dlrm.

The graph is read from the source with ast, so a cycle hidden in a function body
(imported late, at call time, so Python never complains) is found too. Imports under
``if TYPE_CHECKING:`` never run, so they make no runtime cycle, but a type-only cycle
still ties two modules together: it is refused too (test_no_type_only_cycles), and
such imports count for the layering.
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGES = ("data", "embeddings", "dlrm")
# What each package must not import (the layers: data ◄── embeddings ◄── dlrm).
FORBIDDEN = {"data": ("embeddings", "dlrm"), "embeddings": ("dlrm",)}

_IMPORT_ALL = """
import importlib, json, pkgutil, sys, traceback
failed = {}
def note(name):
    failed[name] = traceback.format_exc(limit=-3)
for top in sys.argv[1:]:
    pkg = importlib.import_module(top)
    for info in pkgutil.walk_packages(pkg.__path__, top + ".", onerror=note):
        if info.name.rsplit(".", 1)[-1] == "__main__":  # runs the CLI when imported
            continue
        try:
            importlib.import_module(info.name)
        except BaseException:
            note(info.name)
print(json.dumps(failed))
"""


@pytest.mark.slow
def test_every_module_imports_in_a_fresh_interpreter() -> None:
    proc = subprocess.run([sys.executable, "-c", _IMPORT_ALL, *PACKAGES], cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not failed, "\n".join(f"{name}:\n{tb}" for name, tb in failed.items())


# --------------------------------------------------------------------------- the graph


def module_files(root: Path) -> dict[str, Path]:
    """Module name → file, for every .py file of PACKAGES below ``root``."""
    out = {}
    for top in PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
             known: set[str]) -> set[str]:
    """Our modules that an import statement loads (``from x import y``: x.y if a module)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([base] if base else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                 for alias in node.names]
    return {name for name in names if name in known}


@functools.cache
def import_graph(root: Path) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(runtime edges, all edges): module → our modules it imports, anywhere in its file.

    Runtime edges leave out ``if TYPE_CHECKING:`` imports; all edges keep them.
    """
    files = module_files(root)
    known = set(files)
    runtime: dict[str, set[str]] = {m: set() for m in files}
    every: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        typing_only = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                targets = _targets(node, module, path.name == "__init__.py", known) - {module}
                every[module] |= targets
                if id(node) not in typing_only:
                    runtime[module] |= targets
    return runtime, every


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a → b → ... → a) through each strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(graph, group) for group in groups]


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest cycle through the group's first module, staying inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in strongly connected {group}")


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for module, targets in sorted(graph.items()):
        banned = FORBIDDEN.get(module.split(".")[0], ())
        out += [f"{module} imports {t}" for t in sorted(targets) if t.split(".")[0] in banned]
    return out


def test_no_import_cycles() -> None:
    runtime, _ = import_graph(REPO)
    found = cycles(runtime)
    assert not found, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in found)


def test_no_type_only_cycles() -> None:
    """A cycle closed only by an ``if TYPE_CHECKING:`` import (dlrm.config ↔
    dlrm.config_rules was one) still makes two modules one: none is left."""
    _, every = import_graph(REPO)
    found = cycles(every)
    assert not found, "type-only import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in found)


def test_layering() -> None:
    _, every = import_graph(REPO)
    bad = layering_violations(every)
    assert not bad, "data ◄── embeddings ◄── dlrm broken:\n" + "\n".join("  " + b for b in bad)


def test_the_graph_sees_local_relative_and_submodule_imports(tmp_path: Path) -> None:
    """The checker itself, on a made-up tree: a cycle through a function-local
    ``from pkg import submodule`` and a relative import is found; TYPE_CHECKING is not."""
    files = {
        "data/__init__.py": "",
        "data/a.py": "def f():\n    from data import b\n",
        "data/b.py": "from .c import x\n",
        "data/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from data import b\n"
                     "import data.a\nx = 1\n",
        "data/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import dlrm.x\n",
        "embeddings/__init__.py": "",
        "dlrm/__init__.py": "",
        "dlrm/x.py": "import data.d\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    runtime, every = import_graph(tmp_path)
    assert cycles(runtime) == [["data.a", "data.b", "data.c", "data.a"]]
    assert layering_violations(every) == ["data.d imports dlrm.x"]
