"""No function in dlrm/, embeddings/ or data/ is longer than MAX_LINES lines
(``def`` line to last line, docstring included): a longer one is several steps that
want names of their own."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

MAX_LINES = 80
PACKAGES = ("dlrm", "embeddings", "data")


def long_functions(root: Path, max_lines: int = MAX_LINES) -> list[str]:
    """``path:line name (n lines)`` for every function over ``max_lines``, nested ones too."""
    out = []
    for top in PACKAGES:
        for path in sorted((root / top).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    n = node.end_lineno - node.lineno + 1
                    if n > max_lines:
                        rel = path.relative_to(root)
                        out.append(f"{rel}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_over_80_lines() -> None:
    found = long_functions(REPO)
    assert not found, f"functions over {MAX_LINES} lines:\n" + "\n".join("  " + f for f in found)


def test_the_checker_counts_from_def_to_last_line(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES - 2))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "m.py").write_text(
        f'def ok():\n    """Doc."""\n{body}\n\n\ndef long():\n    """Doc."""\n{body}\n    return 0\n')
    assert long_functions(tmp_path) == ["data/m.py:83 long (81 lines)"]
