"""lablib's and instructor's layout stays readable.

The import rules are import-linter contracts in pyproject.toml ([tool.importlinter]), run here as ``lint-imports``
(the same command a maintainer runs by hand): lablib never imports instructor, no library module imports a run
script, no run script imports another, the grading CLI sits over the class dispatcher over the three ways of
grading, and no import circle joins two sibling packages or modules (deferred imports inside functions included).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from lablib.jobs import launch

REPO = Path(__file__).resolve().parent.parent
LABLIB = REPO / "lablib"
# A module past this many lines is split by idea (each module one idea, its docstring a short story). A story that
# reads top to bottom in 400 lines beats five files that call each other, so the cap sits there, not lower.
MAX_LINES = 400


def _lint_imports(root: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}      # root's lablib and instructor, not the installed ones
    return subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_import_contracts_hold():
    result = _lint_imports()
    assert result.returncode == 0, "an import breaks the layers (pyproject.toml [tool.importlinter]):\n" + result.stdout[-4000:]
    assert "0 broken" in result.stdout and " kept" in result.stdout, result.stdout[-2000:]


def test_the_contracts_see_a_deferred_import(tmp_path):
    # The contracts are only as good as the import reader: in a copy of the tree, an import inside a function of a
    # library module that reaches a run script must break a contract.
    for name in ("lablib", "instructor"):
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    assert _lint_imports(tmp_path).returncode == 0
    (tmp_path / "lablib" / "measure" / "layout_probe.py").write_text(
        "def f():\n    from lablib.runs import hello\n    return hello\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0 and "library module imports one BROKEN" in result.stdout, result.stdout[-2000:]


def test_a_lab_packages_run_scripts_are_leaves():
    """The contract "a run script is a leaf" for the run scripts inside lab packages (import-linter's module
    expressions cannot name ``run_*``): no module of lablib imports a lab's ``run``/``run_<step>`` (a notebook may),
    and none of them imports another run script."""
    import grimp
    graph = grimp.build_graph("lablib")
    runs = {m for m in graph.modules if m.startswith("lablib.labs.") and m.rsplit(".", 1)[1].startswith("run")
            and m.rsplit(".", 1)[1] in ("run",) + tuple(f"run_{s}" for s in launch.available_steps())}
    assert len(runs) >= 14, sorted(runs)
    importers = {run: sorted(graph.find_modules_that_directly_import(run)) for run in runs}
    assert not {run: who for run, who in importers.items() if who}, "a library module imports a run script"


def test_every_module_holds_one_idea():
    long = {str(p.relative_to(REPO)): n for p in sorted(LABLIB.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split each by idea): {long}"


def _undefined_names(source: str, filename: str) -> list[str]:
    """pyflakes' findings of a name used where nothing defines it (the NameError a run would meet), nothing else."""
    import ast

    from pyflakes import checker, messages

    found = checker.Checker(ast.parse(source, filename=filename), filename=filename).messages
    kinds = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)
    return [str(m) for m in found if isinstance(m, kinds)]


def _notebook_code(path: Path) -> str:
    """A notebook's code cells in order, as one module (a line of IPython magic or shell becomes a comment)."""
    import json

    cells = json.loads(path.read_text())["cells"]
    code = ("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    return "\n\n".join("\n".join("pass  # " + line if line.lstrip().startswith(("%", "!")) else line
                                 for line in text.splitlines()) for text in code)


def test_no_name_is_used_where_nothing_defines_it():
    # The run scripts' measurement paths run only in a lab's live check (minutes); a name lost in a module split (an
    # import left behind) is caught here in seconds. pyflakes reads every module of lablib, instructor and the
    # tests, and each solution notebook's code cells in order.
    assert _undefined_names("def f():\n    return overlap_fraction(1)\n", "probe.py"), "the checker finds nothing"
    found = []
    for root in ("lablib", "instructor", "tests", "launchers"):
        for path in sorted((REPO / root).rglob("*.py")):
            found += _undefined_names(path.read_text(), str(path.relative_to(REPO)))
    for path in sorted((REPO / "solutions").glob("*/*.ipynb")):
        found += _undefined_names(_notebook_code(path), str(path.relative_to(REPO)))
    assert not found, "names used where nothing defines them:\n" + "\n".join(found)
