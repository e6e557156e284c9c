"""The self-study book (launchers/book), built from the executions this test run already made.

Executing every lab again for the book would double the suite's cost, so the book is built from the
notebooks that tests/test_labs.py's autograding of each solution leaves behind (nbgrader, reduced sizes):
they are put into the book's execution cache and the build executes nothing. The test therefore runs last
(pytest-order) and only with those tests (it is `slow` like them). The built book stays in
test-artifacts/book/html for a person to look at.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import nbformat
import pytest

import labkit
from book import build as book

pytestmark = pytest.mark.slow
ARTEFACT = labkit.REPO / "test-artifacts" / "book"
AUTOGRADE_TEST = "test_labs.py::test_solution_full_marks_and_release_zero"
SEEDED_BY = ("Executed headless by the test suite's nbgrader autograding of the solution "
             "(NBGRADER_EXECUTION set: reduced sizes)")
IMAGE_MIMES = ("image/png", "image/svg+xml", "image/jpeg")


def images_in(notebook) -> int:
    return sum(1 for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])
               if any(m in o.get("data", {}) for m in IMAGE_MIMES))


def linked_labs(lab: str, labs: list[str]) -> set[str]:
    """The other labs the solution's markdown names as 'Lab NN' outside code and math."""
    text = "".join(part for i, part in enumerate(book.CODE_OR_MATH.split(
        "\n".join(c.source for c in labkit.read(lab).cells if c.cell_type == "markdown"))) if i % 2 == 0)
    numbers = set(re.findall(r"\b[Ll]abs? (\d\d)\b", text))
    return {other for other in labs if other[:2] in numbers and other != lab}


@pytest.mark.order("last")
def test_book_shows_every_lab_with_its_figures(request, autograded_solutions):
    labs = labkit.labs()
    graded_here = {lab for lab in labs if any(f"{AUTOGRADE_TEST}[{lab}]" in item.nodeid for item in request.session.items)}
    seeds = {lab: path for lab, path in autograded_solutions.items() if lab in graded_here}
    if not graded_here:
        pytest.fail(f"no lab's solution was executed in this run, and the book test only reuses those executions: run it "
                    f"with {AUTOGRADE_TEST} (the whole suite does; by hand: launchers/test -k 'book or full_marks')")
    missing = graded_here - set(seeds)
    assert not missing, f"{AUTOGRADE_TEST} ran for {sorted(missing)} but did not pass, so there is no execution to build from"

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

    for lab in labs:
        page_file = site / f"{lab}.html"
        assert page_file.is_file(), f"no page for {lab}"
        page = page_file.read_text()
        text = re.sub(r"<[^>]+>", "", page)
        assert f"launchers/lab --execute {lab[:2]}" in text, f"{lab}'s page should say how to open it in JupyterLab"
        assert 'class="math notranslate nohighlight"' in page, f"{lab}'s formulas should be MathJax markup"
        for other in linked_labs(lab, labs):
            assert f'href="{other}.html' in page, f"{lab} names lab {other[:2]} but its page does not link to it"
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
        assert "reduced sizes" in text, f"{lab}'s page should say its execution was the suite's autograding"
