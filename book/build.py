"""Build the self-study book: a static website of every lab's solution, executed, with its outputs.

    python -m book.build              (launchers/book) -> book/_build/html/index.html

Sphinx with MyST-NB does the work (book/conf.py). This module stages the sources first, in lab order:
each solution notebook gets a header (the machine its figures were measured on, measured by a hidden
first cell in the kernel that executes it; how to open it in JupyterLab) and links where it names
another lab; its model answers, code and free-text, are folded behind a "Show the model answer" control, under the
exercise as a student's copy shows it, with nbgrader's markers gone (book/answers.py); the cells with the grader's
hidden tests are removed (they still run, so that the outputs are the solution's) and a line in words, from
book/grader_checks.toml, says what each one checks; index.md lists the labs with their objectives and run times.

The book shows the labs at the sizes a student runs: the executing kernels never see NBGRADER_EXECUTION
(it is removed from the environment they inherit, should the build be started from a grading shell).

Executions are cached by MyST-NB in jupyter-cache, keyed by the notebook's code and lablib's sources: a
rebuild after editing one lab re-executes only that lab (a markdown-only edit re-executes nothing; an edit of
lablib re-executes every lab). An execution made
elsewhere (the test suite's execution of the solution at a student's sizes) can be put into the cache with
``seed``, so that the build reuses it instead of executing the lab again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import time
import tomllib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import nbformat

from book.answers import (HIDE_ANSWER, SHOW_ANSWER, code_as_shown, fence_for, free_text_answer, is_answer_cell,
                          is_answer_code_cell, is_hidden_test_cell)
from instructor.course import LABS, REPO, SOLUTIONS, all_labs, find_lab

BOOK = Path(__file__).resolve().parent
BUILD = BOOK / "_build"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
EXECUTED_BY_BOOK = ("Executed headless by `launchers/book` at the sizes a student runs (no `NBGRADER_EXECUTION`; "
                    "widgets drawn once at their defaults)")


@dataclass(frozen=True)
class LabInfo:
    name: str           # 01_gradient_accumulation
    title: str          # Lab 01 · Gradient accumulation: ...
    objectives: list[str]
    run_time: str
    prerequisites: str


def _paragraph(text: str, label: str) -> str:
    """The paragraph that starts with **label** in a markdown cell, without the label ('' if none)."""
    match = re.search(rf"\*\*{re.escape(label)}\*\*(.*?)(?:\n\s*\n|\Z)", text, re.S)
    return " ".join(match.group(1).split()) if match else ""


def lab_info(lab: str, nb: nbformat.NotebookNode) -> LabInfo:
    """Title, objectives, run time and prerequisites, from the lab's first markdown cell (COURSE_STANDARD.md)."""
    intro = next((c.source for c in nb.cells if c.cell_type == "markdown"), "")
    title = next((line[2:].strip() for line in intro.splitlines() if line.startswith("# ")), lab)
    block = re.search(r"\*\*Learning objectives\.\*\*.*?\n((?:[-*] .*\n?(?:  .*\n?)*)+)", intro)
    objectives = [" ".join(item.split()) for item in re.split(r"\n[-*] ", "\n" + block.group(1))[1:]] if block else []
    return LabInfo(lab, title, objectives, _paragraph(intro, "Expected run time."),
                   _paragraph(intro, "Prerequisites."))


# --- staging -------------------------------------------------------------------------------------------

CODE_OR_MATH = re.compile(r"(```.*?```|`[^`\n]*`|\$\$.*?\$\$|\$[^$\n]*\$|\[[^\]\n]*\]\([^)\n]*\))", re.S)


def link_labs(markdown: str, labs: list[str], this: str) -> str:
    """'Lab 02' / 'lab 02' -> a link to lab 02's page, outside code, math and existing links."""
    by_number = {lab[:2]: lab for lab in labs if lab != this}

    def link(match: re.Match) -> str:
        lab = by_number.get(match.group(2))
        return f"[{match.group(0)}]({lab}.ipynb)" if lab else match.group(0)

    parts = CODE_OR_MATH.split(markdown)
    return "".join(part if i % 2 else re.sub(r"\b([Ll]abs? )(\d\d)\b", link, part) for i, part in enumerate(parts))


def lablib_digest() -> str:
    """A hash of lablib's sources: the labs' figures depend on them as much as on the notebook's own code."""
    digest = hashlib.sha256()
    for path in sorted((REPO / "lablib").rglob("*.py")):
        digest.update(path.relative_to(REPO).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def machine_cell_source(executed_by: str = EXECUTED_BY_BOOK) -> str:
    """The hidden first cell: book/machine.py, then a call that shows the description as markdown. The cache
    key is the code, so the cell also names lablib's version: a change to lablib re-executes every lab."""
    return ((BOOK / "machine.py").read_text()
            + f"\n\n# lablib sources {lablib_digest()}\nfrom IPython.display import Markdown\n"
            + f"Markdown(machine_markdown({executed_by!r}))\n")


def open_in_jupyterlab(lab: str) -> str:
    path = f"{lab}/{lab}.ipynb"
    return (f"**Open this lab in JupyterLab:** from the course repository run `launchers/lab --solutions` and open "
            f"[`{path}`](http://localhost:8888/lab/tree/{path}) (this solution), or `launchers/lab` for your own copy "
            f"with the exercises, `labs/{path}`. `launchers/lab --execute {lab[:2]}` runs it headless.")


def grader_checks(lab: str) -> dict[str, str]:
    """grade_id -> what that test cell checks, in words (book/grader_checks.toml; the book shows this line instead
    of the cell)."""
    return tomllib.loads((BOOK / "grader_checks.toml").read_text()).get(lab, {})


def grade_id(cell) -> str:
    return cell.metadata.get("nbgrader", {}).get("grade_id", "")


def released_exercises(lab: str) -> dict[str, str]:
    """grade_id -> the source of each exercise cell as the student's copy (labs/, made by nbgrader) has it."""
    path = LABS / lab / f"{lab}.ipynb"
    if not path.is_file():
        return {}
    return {grade_id(c): c.source for c in nbformat.read(path, as_version=4).cells
            if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("solution")}


def fenced(code: str, language: str = "ipython3") -> str:
    fence = fence_for(code)
    return f"{fence}{language}\n{code.rstrip()}\n{fence}"


def grader_line(cell, checks: dict[str, str]) -> nbformat.NotebookNode:
    points = cell.metadata.get("nbgrader", {}).get("points")
    said = checks.get(grade_id(cell), "further cases that this book does not list (book/grader_checks.toml has "
                                      f"no line for `{grade_id(cell)}`).")
    points_text = f" ({points:g} point{'s' if points != 1 else ''})" if isinstance(points, (int, float)) else ""
    return nbformat.v4.new_markdown_cell(f"**What the grader checks{points_text}:** {said}",
                                         metadata={"book": {"grader_checks": grade_id(cell)}})


def staged_notebook(lab: str, labs: list[str]) -> nbformat.NotebookNode:
    """The solution with the book's header cells, links between labs, model answers folded, the grader's hidden
    tests removed (said in words instead), no outputs."""
    nb = nbformat.read(SOLUTIONS / lab / f"{lab}.ipynb", as_version=4)
    checks, released = grader_checks(lab), released_exercises(lab)
    cells = []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            # Links first: link_labs leaves fenced text alone, and the boxes are fenced.
            cell.source = link_labs(cell.source, labs, lab)
            if is_answer_cell(cell):
                cell.source = free_text_answer(cell.source)
        elif cell.cell_type == "code":
            tags = cell.metadata.setdefault("tags", [])
            answer = is_answer_code_cell(cell)
            cell.source = code_as_shown(cell.source)
            cell.outputs, cell.execution_count = [], None
            if is_hidden_test_cell(cell):
                # Removed from the page (MyST-NB drops the cell, input and output) but executed like the rest, so the
                # cells after it see the state it leaves and the execution is the solution's, as seeded by the suite.
                tags.append("remove-cell")
                cells += [cell, grader_line(cell, checks)]
                continue
            if cell.metadata.get("book", {}).get("fold_output"):
                # a cell whose output shows a model answer (lab 05 prints the diff of the answer against the loop it
                # replaces): the output is folded like the answer itself
                tags.append("hide-output")
            if answer:
                if grade_id(cell) in released:
                    cells.append(nbformat.v4.new_markdown_cell(
                        "**Exercise** (the cell as your copy of the lab has it; try it before you open the answer):"
                        f"\n\n{fenced(released[grade_id(cell)])}", metadata={"book": {"exercise": grade_id(cell)}}))
                tags.append("hide-input")
                cell.metadata["mystnb"] = {"code_prompt_show": SHOW_ANSWER, "code_prompt_hide": HIDE_ANSWER}
        cells.append(cell)
    nb.cells = cells
    title_cell = next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown")
    machine = nbformat.v4.new_code_cell(machine_cell_source(), metadata={"tags": ["remove-input"]})
    opener = nbformat.v4.new_markdown_cell(open_in_jupyterlab(lab))
    # The title stays first (it names the page); the header goes right under it, split off the title cell.
    head, _, rest = nb.cells[title_cell].source.partition("\n")
    nb.cells[title_cell].source = head
    nb.cells[title_cell + 1:title_cell + 1] = [machine, opener, nbformat.v4.new_markdown_cell(rest.strip("\n"))]
    return nb


def index_page(infos: list[LabInfo]) -> str:
    lines = [(BOOK / "intro.md").read_text().rstrip(), "", "## The labs, in order", ""]
    for info in infos:
        lines += [f"### {info.title}", "", f"[Read lab {info.name[:2]} →]({info.name}.ipynb)", ""]
        if info.run_time:
            lines += [f"**Run time.** {info.run_time}", ""]
        if info.prerequisites:
            lines += [f"**Prerequisites.** {link_labs(info.prerequisites, [i.name for i in infos], info.name)}", ""]
        if info.objectives:
            lines += ["**After this lab you can**", ""] + [f"- {objective}" for objective in info.objectives] + [""]
    lines += ["```{toctree}", ":hidden:", ":caption: Labs", ""] + [info.name for info in infos]
    lines += ["```", "", "```{toctree}", ":hidden:", ":caption: About this book", "", "executions", "```", ""]
    return "\n".join(lines)


def _write_if_changed(path: Path, text: str) -> None:
    """Keep the file's mtime when nothing changed, so that Sphinx re-reads only the pages that did."""
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def stage(src: Path, labs: list[str]) -> list[LabInfo]:
    src.mkdir(parents=True, exist_ok=True)
    infos = []
    for lab in labs:
        infos.append(lab_info(lab, nbformat.read(SOLUTIONS / lab / f"{lab}.ipynb", as_version=4)))
        _write_if_changed(src / f"{lab}.ipynb", nbformat.writes(staged_notebook(lab, labs)) + "\n")
    for stale in set(src.glob("*.ipynb")) - {src / f"{lab}.ipynb" for lab in labs}:
        stale.unlink()
    _write_if_changed(src / "index.md", index_page(infos))
    _write_if_changed(src / "executions.md", (BOOK / "executions.md").read_text())
    return infos


# --- reusing an execution made elsewhere -----------------------------------------------------------------

def seed(cache_dir: Path, lab: str, staged: Path, executed: Path, executed_by: str) -> None:
    """Put an execution of ``lab`` made elsewhere into the book's cache, as if the book had executed it.

    ``executed`` holds the same code cells as the solution (compared as the book shows them, markers as comments);
    its outputs go into the staged notebook cell by cell, and the hidden machine cell is answered here, in
    this process, on the machine that made the execution.
    """
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    import book.machine as machine

    nb = nbformat.read(staged, as_version=4)
    done = [c for c in nbformat.read(executed, as_version=4).cells if c.cell_type == "code"]
    code = [c for c in nb.cells if c.cell_type == "code"][1:]   # [0] is the machine cell
    if [c.source for c in code] != [code_as_shown(c.source) for c in done]:
        differ = [i for i, (a, b) in enumerate(zip(code, done)) if a.source != code_as_shown(b.source)]
        raise ValueError(f"{executed} is not an execution of {lab}'s solution: {len(done)} code cells against "
                         f"{len(code)}, first different code cell: {differ[0] if differ else len(min(code, done, key=len))}")
    for cell, ran in zip(code, done):
        cell.outputs = [o for o in ran.outputs if WIDGET_MIME not in o.get("data", {})]
        cell.execution_count = ran.get("execution_count")
    header = nb.cells[next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")]
    header.outputs = [nbformat.v4.new_output("execute_result", data={
        "text/markdown": machine.machine_markdown(executed_by), "text/plain": "<machine>"}, execution_count=1)]
    get_cache(str(cache_dir)).cache_notebook_bundle(CacheBundleIn(nb, str(staged), data={"seeded_from": str(executed)}),
                                                    check_validity=False, overwrite=True)


# --- build ---------------------------------------------------------------------------------------------

@contextmanager
def kernel_environment(**changes: str | None):
    """os.environ with ``changes`` (None: removed) while the kernels the build starts inherit it, then as before."""
    saved = {name: os.environ.get(name) for name in changes}

    def apply(values: dict[str, str | None]) -> None:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    apply(changes)
    try:
        yield
    finally:
        apply(saved)


@dataclass
class BookBuild:
    html: Path
    labs: list[LabInfo]
    seconds: float
    executed: dict[str, float]    # lab -> seconds of the executions this build made (cache misses)


def build(out: Path = BUILD, labs: list[str] | None = None, seeds: dict[str, Path] | None = None,
          seeded_by: str = "", execute: bool = True, quiet: bool = False) -> BookBuild:
    """Stage, seed and build the book into out/html (cache in out/jupyter_cache, sources in out/src).

    execute=False renders labs that are neither cached nor seeded without outputs instead of running them.
    """
    from jupyter_cache import get_cache
    from sphinx.application import Sphinx

    t0 = time.perf_counter()
    labs = labs or all_labs()
    src, cache = out / "src", out / "jupyter_cache"
    infos = stage(src, labs)
    for lab, executed in (seeds or {}).items():
        seed(cache, lab, src / f"{lab}.ipynb", executed, seeded_by)
    before = {r.pk for r in get_cache(str(cache)).list_cache_records()}
    overrides = {"nb_execution_cache_path": str(cache)}
    if not execute:
        overrides["nb_execution_excludepatterns"] = [f"{lab}.ipynb" for lab in labs if lab not in (seeds or {})]
    app = Sphinx(str(src), str(BOOK), str(out / "html"), str(out / "doctrees"), "html",
                 confoverrides=overrides, status=None if quiet else sys.stdout, keep_going=True)
    # The executing kernels inherit the environment: each widget becomes one figure (LABLIB_HEADLESS), and the
    # labs run at a student's sizes, never nbgrader's reduced ones (NBGRADER_EXECUTION, from a grading shell).
    with kernel_environment(LABLIB_HEADLESS="1", NBGRADER_EXECUTION=None):
        app.build()
    if app.statuscode:
        raise SystemExit(f"the book's Sphinx build failed (exit {app.statuscode}); see the messages above")
    executed = {Path(r.uri).stem: r.data.get("execution_seconds", 0.0)
                for r in get_cache(str(cache)).list_cache_records() if r.pk not in before}
    return BookBuild(out / "html", infos, time.perf_counter() - t0, executed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="launchers/book", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("labs", nargs="*", help="only these labs ('00' or '00_collectives'; default: every lab)")
    parser.add_argument("--out", type=Path, default=BUILD, help="default: book/_build")
    parser.add_argument("--clean", action="store_true", help="forget the cached executions and build from scratch")
    args = parser.parse_args(argv)
    if args.clean:
        shutil.rmtree(args.out, ignore_errors=True)
    result = build(args.out, [find_lab(lab) for lab in args.labs] or None)
    ran = ", ".join(f"{lab} {s:.0f} s" for lab, s in result.executed.items()) or "none (all from the cache)"
    print(json.dumps({"labs": [i.name for i in result.labs], "seconds": round(result.seconds, 1)}))
    print(f"book built in {result.seconds:.0f} s; executed: {ran}\nopen {result.html / 'index.html'}")


if __name__ == "__main__":
    main()
