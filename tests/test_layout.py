"""lablib's layout stays readable: no import circle, no library module importing a run script, no run script
importing another, and no module so long that it holds more than one idea.

Imports are read from the source (every ``import`` and ``from ... import`` at any depth, functions included:
an import deferred into a function is still a circle, only a hidden one).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LABLIB = Path(__file__).resolve().parent.parent / "lablib"
# A module past this many lines is split by idea (each module one idea, its docstring a short story).
MAX_LINES = 330


def _module_name(path: Path) -> str:
    parts = path.relative_to(LABLIB.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(LABLIB.rglob("*.py"))}


def _target(name: str) -> str | None:
    """The lablib module that ``name`` (a dotted import path) loads, or None outside lablib."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """The lablib modules that ``module`` imports anywhere in its source (packages' ``__init__`` excluded)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from lablib.probes import zero3`` imports the module lablib.probes.zero3.
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            target = _target(name)
            if target and target != module and MODULES[target].name != "__init__.py":
                found.add(target)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def _circles() -> list[list[str]]:
    """Every strongly connected group of two or more modules (Tarjan's algorithm)."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return groups


def test_the_import_reader_sees_deferred_and_from_imports():
    # The checks below are only as good as the reader: it must see an import inside a function and a
    # ``from package import module``.
    assert "lablib.jobs.processes" in GRAPH["lablib.jobs.distenv"]
    assert "lablib.measure.counting" in GRAPH["lablib.measure.benchmark"]
    assert any(node for node in GRAPH.values()), "no lablib import found at all"


def test_lablib_has_no_import_circle():
    circles = _circles()
    assert not circles, "import circles (move the shared part into a module both import):\n" + "\n".join(
        " <-> ".join(group) for group in circles)


def test_no_library_module_imports_a_run_script_and_no_run_script_imports_another():
    wrong = [f"{module} imports {target}" for module, targets in GRAPH.items() for target in sorted(targets)
             if target.startswith("lablib.runs.")]
    assert not wrong, ("a run script is a leaf: what two steps share lives in a library module\n" + "\n".join(wrong))


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_holds_one_idea(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[module].relative_to(LABLIB.parent)} has {lines} lines: split it by idea"
