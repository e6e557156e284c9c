"""The self-study book (launchers/book), built from the executions this test run already made.

Executing every lab again for the book would double the suite's cost, so the book is built from the
notebooks that tests/test_labs.py's live-kernel run of each solution leaves behind: executed top to bottom at
the sizes a student runs (no NBGRADER_EXECUTION), as the book shows the labs. They are put into the book's
execution cache and the build executes nothing. That test therefore runs last (pytest-order) and only with
those tests (it is `slow` like them). The built book stays in test-artifacts/book/html for a person to look at.
The staging of the sources (model answers in boxes, nbgrader's markers gone) is checked first, in seconds.
"""

from __future__ import annotations

import os
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest

import labkit
from book import answers
from book import build as book

ARTEFACT = labkit.REPO / "test-artifacts" / "book"
EXECUTING_TEST = "test_labs.py::test_wrong_answers_lose_points"
SEEDED_BY = ("Executed headless by the test suite, top to bottom in one kernel, at the sizes a student runs "
             "(no `NBGRADER_EXECUTION`)")
IMAGE_MIMES = ("image/png", "image/svg+xml", "image/jpeg")
MARKERS = re.compile(r"(BEGIN|END) (SOLUTION|MARK SCHEME)")


def images_in(notebook) -> int:
    return sum(1 for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])
               if any(m in o.get("data", {}) for m in IMAGE_MIMES))


def linked_labs(lab: str, labs: list[str]) -> set[str]:
    """The other labs the solution's markdown names as 'Lab NN' outside code and math."""
    text = "".join(part for i, part in enumerate(book.CODE_OR_MATH.split(
        "\n".join(c.source for c in labkit.read(lab).cells if c.cell_type == "markdown"))) if i % 2 == 0)
    numbers = set(re.findall(r"\b[Ll]abs? (\d\d)\b", text))
    return {other for other in labs if other[:2] in numbers and other != lab}


def answer_cells(lab: str) -> list:
    """The lab's free-text answers: markdown cells nbgrader treats as solutions."""
    return [c for c in labkit.read(lab).cells if c.cell_type == "markdown" and labkit.nbg(c).get("solution")]


def words(text: str) -> str:
    """The words of markdown or of a page's text (link targets, markup, math delimiters and short tokens gone)."""
    return " ".join(re.findall(r"[A-Za-z]{3,}", re.sub(r"\]\([^)]*\)", "]", text)))


class _Boxes(HTMLParser):
    """The text of every <div> with a given CSS class (an admonition), nested divs included."""

    def __init__(self, css_class: str):
        super().__init__()
        self.css_class, self.depth, self.texts = css_class, 0, []

    def handle_starttag(self, tag, attrs):
        if tag != "div":
            return
        if self.depth:
            self.depth += 1
        elif self.css_class in (dict(attrs).get("class") or "").split():
            self.depth = 1
            self.texts.append("")

    def handle_endtag(self, tag):
        if tag == "div" and self.depth:
            self.depth -= 1

    def handle_data(self, data):
        if self.depth:
            self.texts[-1] += data


def boxes(page: str, css_class: str) -> list[str]:
    parser = _Boxes(css_class)
    parser.feed(page)
    return parser.texts


# --- the staging, without a build ----------------------------------------------------------------------

def test_free_text_answer_becomes_labelled_boxes_without_headings():
    from docutils import nodes
    from docutils.core import publish_doctree
    from myst_parser.parsers.docutils_ import Parser

    cell = ("**Q9.** Why does gloo's reduce-scatter cost more?\n\n### BEGIN SOLUTION\n**Model answer.** It all-reduces, "
            "see [Lab 02](02_ring_allreduce.ipynb):\n```python\nx = 1\n```\n\n**Rubric (2 points).**\n- 1: the cause.\n"
            "### END SOLUTION\n=== BEGIN MARK SCHEME ===\nAward 1 for a number.\n=== END MARK SCHEME ===\nAfter the answer.\n")
    shown = answers.free_text_answer(cell)
    assert not MARKERS.search(shown), shown
    assert shown.startswith("**Q9.** Why does") and shown.rstrip().endswith("After the answer."), shown
    doctree = publish_doctree(shown, parser=Parser(), settings_overrides={"report_level": 5})
    titled = {box.next_node(nodes.title).astext(): box.astext() for box in doctree.findall(nodes.admonition)}
    assert list(titled) == ["Model answer", "Rubric for the grader (2 points)", "Rubric for the grader"], titled
    assert "It all-reduces" in titled["Model answer"] and "x = 1" in titled["Model answer"], titled
    assert "Model answer." not in titled["Model answer"] and "the cause" not in titled["Model answer"], titled
    assert "the cause" in titled["Rubric for the grader (2 points)"] and "Award 1" in titled["Rubric for the grader"]
    assert not list(doctree.findall(nodes.section)), "an answer cell must not open a section (a heading in the contents)"
    assert "{admonition} Model answer" in answers.free_text_answer("No markers: nbgrader takes the whole cell.")


def test_staged_labs_show_their_answers_in_boxes_and_no_markers():
    labs = labkit.labs()
    for lab in labs:
        staged = book.staged_notebook(lab, labs)
        leftover = [c.source for c in staged.cells if MARKERS.search(c.source)]
        assert not leftover, f"{lab}'s book page would show nbgrader's markers: {leftover[0][:300]}"
        shown = "\n".join(c.source for c in staged.cells if c.cell_type == "markdown").count("{admonition} Model answer")
        assert shown == len(answer_cells(lab)), f"{lab}: {shown} model-answer boxes for {len(answer_cells(lab))} answer cells"


def test_seed_takes_an_execution_of_the_solution_as_written(tmp_path):
    """Executions are made from the solution itself (nbgrader's markers in its code); the book shows the code
    with the markers as comments, and must still recognise the execution as one of the same code."""
    lab, labs = "00_collectives", labkit.labs()
    staged = tmp_path / f"{lab}.ipynb"
    staged.write_text(nbformat.writes(book.staged_notebook(lab, labs)))
    book.seed(tmp_path / "cache", lab, staged, labkit.SOLUTIONS / lab / f"{lab}.ipynb", "by this test")
    other = tmp_path / "other.ipynb"
    shutil.copy(labkit.SOLUTIONS / "07_zero_from_scratch" / "07_zero_from_scratch.ipynb", other)
    with pytest.raises(ValueError, match="is not an execution of"):
        book.seed(tmp_path / "cache", lab, staged, other, "by this test")


def test_book_kernels_run_at_a_students_sizes(tmp_path, monkeypatch):
    """launchers/book started from a grading shell: the kernels the build starts do not see NBGRADER_EXECUTION."""
    import sphinx.application

    seen = {}

    class Recorder:   # stands in for Sphinx: records the environment the executing kernels would inherit
        statuscode = 0

        def __init__(self, *args, **kwargs):
            pass

        def build(self):
            seen.update(os.environ)

    monkeypatch.setattr(sphinx.application, "Sphinx", Recorder)
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    book.build(tmp_path, ["00_collectives"], quiet=True)
    assert seen and "NBGRADER_EXECUTION" not in seen and seen.get("LABLIB_HEADLESS") == "1"
    assert os.environ["NBGRADER_EXECUTION"] == "autograde", "the build should give the environment back as it found it"


# --- the whole book, from the suite's executions -------------------------------------------------------

@pytest.mark.slow
@pytest.mark.order("last")
def test_book_shows_every_lab_with_its_figures(request, interactive_solutions):
    labs = labkit.labs()
    executed_here = {lab for lab in labs if any(f"{EXECUTING_TEST}[{lab}]" in item.nodeid for item in request.session.items)}
    seeds = {lab: path for lab, path in interactive_solutions.items() if lab in executed_here}
    if not executed_here:
        pytest.fail(f"no lab's solution was executed in this run, and the book test only reuses those executions: run it "
                    f"with {EXECUTING_TEST} (the whole suite does; by hand: launchers/test -k 'book or wrong_answers')")
    missing = executed_here - set(seeds)
    assert not missing, f"{EXECUTING_TEST} ran for {sorted(missing)} but did not pass, so there is no execution to build from"

    check_book(labs, seeds)


def check_book(labs: list[str], seeds: dict[str, Path]) -> None:
    """Build the book from these executions into test-artifacts/book and check every page."""
    shutil.rmtree(ARTEFACT, ignore_errors=True)
    result = book.build(ARTEFACT, labs, seeds=seeds, seeded_by=SEEDED_BY, execute=False, quiet=True)
    print(f"book of {len(labs)} labs built in {result.seconds:.0f} s from {len(seeds)} reused executions "
          f"-> {result.html / 'index.html'}")
    assert not result.executed, f"the book executed {result.executed} again instead of reusing the suite's executions"

    site = result.html
    index = (site / "index.html").read_text()
    positions = [index.find(f'href="{lab}.html"') for lab in labs]
    assert -1 not in positions and positions == sorted(positions), "the table of contents must list every lab, in lab order"
    for info in result.labs:
        assert info.objectives and info.run_time, f"{info.name}'s first cell should give its objectives and run time"
    assert index.count("After this lab you can") == index.count("Run time.") == len(labs), \
        "the contents page should give every lab's objectives and run time"
    assert (site / "search.html").is_file() and all(lab in (site / "searchindex.js").read_text() for lab in labs), \
        "the book's search index should cover every lab"
    assert (site / "_static" / "mathjax" / "tex-chtml.js").is_file(), "MathJax should ship with the book (offline formulas)"
    assert not MARKERS.search((site / "searchindex.js").read_text()), "nbgrader's markers should not be searchable titles"

    for lab in labs:
        page_file = site / f"{lab}.html"
        assert page_file.is_file(), f"no page for {lab}"
        page = page_file.read_text()
        text = re.sub(r"<[^>]+>", "", page)
        assert f"launchers/lab --execute {lab[:2]}" in text, f"{lab}'s page should say how to open it in JupyterLab"
        assert 'class="math notranslate nohighlight"' in page, f"{lab}'s formulas should be MathJax markup"
        for other in linked_labs(lab, labs):
            assert f'href="{other}.html' in page, f"{lab} names lab {other[:2]} but its page does not link to it"
        check_answers(lab, page)
        if lab not in seeds:
            continue
        assert "Measured on:" in text.split("Learning objectives.", 1)[0], \
            f"{lab}'s page should open with the machine its figures were measured on"
        executed = nbformat.read(seeds[lab], as_version=4)
        errors = [o.get("ename") for c in executed.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
        assert not errors, f"{lab}'s executed solution holds errors {errors}: the book would show them"
        pictures = re.findall(r'<img[^>]+src="(_images/[^"]+)"', page)
        assert len(pictures) == images_in(executed) > 0, \
            f"{lab}'s page shows {len(pictures)} figures, its executed notebook has {images_in(executed)}"
        assert all((site / p).stat().st_size > 1000 for p in pictures), f"{lab}: an image file is missing or empty"
        assert "the sizes a student runs" in text.split("Learning objectives.", 1)[0], \
            f"{lab}'s page should say its execution was at a student's sizes"


def check_answers(lab: str, page: str) -> None:
    """No nbgrader marker as text or heading (or in the page's contents); each free-text answer in a box."""
    headings = [re.sub(r"<[^>]+>", "", h) for h in re.findall(r"<h[1-6][^>]*>(.*?)</h[1-6]>", page, re.S)]
    assert not MARKERS.search(page), (f"{lab}'s page shows nbgrader's markers {len(MARKERS.findall(page))} times, "
                                      f"as headings: {[h for h in headings if MARKERS.search(h)]}")
    cells, shown = answer_cells(lab), boxes(page, "model-answer")
    assert len(shown) == len(cells), f"{lab} has {len(cells)} free-text answers, its page {len(shown)} Model answer boxes"
    assert all(box.lstrip().startswith("Model answer") for box in shown), f"{lab}: a box is not titled Model answer"
    rubrics = [c for c in cells if "**Rubric" in c.source or "MARK SCHEME" in c.source]
    assert len(boxes(page, "grader-rubric")) == len(rubrics), f"{lab}: each of its {len(rubrics)} rubrics belongs in a box"
    shown_words = [words(box) for box in shown]
    for cell in cells:
        region = labkit.SOLUTION_REGION.search(cell.source)   # none: nbgrader takes the whole cell
        opening = " ".join(words(region.group(1) if region else cell.source).split()[:8])
        assert any(opening in box for box in shown_words), f"{lab}: the answer starting '{opening}' is not in a box"
