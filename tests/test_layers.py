"""The package's layers: every module imports only from lower layers or its own package.

Data flows one way (load -> type -> analyze -> plan -> rewrite -> validate -> report), and the
imports follow it: an analysis never reads the planner, the planner never reads a pass, a
validation never reads the report. Imports inside functions count too; ``TYPE_CHECKING``
imports (annotations only) do not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import mixprec

SRC = Path(mixprec.__file__).parent

# Lowest first. A top-level module or package name per entry.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("version", "dtypes", "tolerance", "progress", "host"),
    ("graphs", "config"),
    ("io", "runtime"),
    ("policy",),
    ("analysis",),
    ("plan",),
    ("passes",),
    ("validate",),
    ("report",),
    ("frontends",),
    ("pipeline",),
    ("api", "inspection", "demo_models"),
    ("tune",),
    ("cli", "__init__"),
    ("__main__",),
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _unit(path: Path) -> str:
    """The layer unit of a source file: its top-level package or module name."""
    parts = path.relative_to(SRC).with_suffix("").parts
    return parts[0]


def _imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, imported mixprec unit) of every import outside `if TYPE_CHECKING:` blocks."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "mixprec":
                found.append((node.lineno, parts[1] if len(parts) > 1 else "__init__"))
    return found


def layer_violations() -> list[str]:
    problems = []
    for path in sorted(SRC.rglob("*.py")):
        unit = _unit(path)
        assert unit in RANK, f"{path.relative_to(SRC)}: {unit!r} has no layer in tests/test_layers.py"
        for line, imported in _imports(ast.parse(path.read_text(), str(path))):
            if imported == unit:
                continue
            assert imported in RANK, f"{path.relative_to(SRC)}:{line}: unknown unit {imported!r}"
            if RANK[imported] >= RANK[unit]:
                problems.append(f"{path.relative_to(SRC)}:{line}: {unit} imports {imported}")
    return problems


def test_no_import_from_a_higher_layer() -> None:
    assert layer_violations() == []


def test_the_check_sees_an_upward_import() -> None:
    source = "from mixprec.plan.model import Category\n"
    assert _imports(ast.parse(source)) == [(1, "plan")]
    guarded = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mixprec.api import convert\n"
    assert _imports(ast.parse(guarded)) == []
