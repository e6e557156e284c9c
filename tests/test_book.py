"""The self-study book (launchers/book), built from the executions this test run already made.

Executing every lab again for the book would double the suite's cost, so the book is built from the
notebooks that tests/test_labs.py's live-kernel run of each solution leaves behind as files (labkit.EXECUTIONS):
executed top to bottom at the sizes a student runs (no NBGRADER_EXECUTION), as the book shows the labs. They are put
into the book's execution cache and the build executes nothing. That test therefore runs last (tests/conftest.py
orders it so) and only with those tests (it is `slow` like them). The built book stays in test-artifacts/book/html for a person to look at.
The staging of the sources (model answers in boxes, nbgrader's markers gone) is checked first, in seconds, and one
lab's page built without executing it (answers folded, hidden tests gone, code that fits in Chromium, folds open in
print). The whole book's check adds every page: no grader code anywhere in the site, no open answer, and no code line
cut at 1024 px or 1300 px.
"""

from __future__ import annotations

import os
import re
import shutil
from contextlib import contextmanager
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
HIDDEN = re.compile(r"(BEGIN|END) HIDDEN TESTS")
CHROMIUM = Path(os.environ.get("LABS_CHROMIUM", "/usr/bin/chromium"))
WINDOWS = ((1024, 768), (1300, 900))   # a laptop's window, and the default window (px)

# Every code line of a page that the reader cannot see whole: with every fold opened, each <pre> of the article
# (code cells, their outputs, code in the text and in the answers) is measured in the browser. A line is cut when its
# text runs past what is visible of its block: the block's content box (a block that scrolls sideways shows only
# that), the window, and any ancestor that clips. A line that wraps inside the block is not cut.
CUT_LINES_JS = r"""() => {
  document.querySelectorAll('details').forEach(d => { d.open = true; });
  const cut = [];
  for (const pre of document.querySelectorAll('article.bd-article pre')) {
    const rect = pre.getBoundingClientRect();
    if (!rect.width || !rect.height) continue;   // not rendered
    const style = getComputedStyle(pre);
    const probe = document.createElement('span');
    probe.style.whiteSpace = 'pre';
    probe.textContent = 'M'.repeat(100);
    pre.appendChild(probe);
    const charWidth = probe.getBoundingClientRect().width / 100;
    probe.remove();
    const left = rect.left + pre.clientLeft + parseFloat(style.paddingLeft);
    let clip = window.innerWidth;   // what the window and the clipping ancestors leave visible
    for (let up = pre.parentElement; up; up = up.parentElement) {
      if (getComputedStyle(up).overflowX !== 'visible') {
        const box = up.getBoundingClientRect();
        clip = Math.min(clip, box.left + up.clientLeft + up.clientWidth);
      }
    }
    const right = Math.min(rect.left + pre.clientLeft + pre.clientWidth - parseFloat(style.paddingRight), clip);
    const wraps = /^(pre-wrap|break-spaces)$/.test(style.whiteSpace) && pre.scrollWidth <= pre.clientWidth + 1;
    if (wraps && rect.right <= clip + 1) continue;
    for (const line of pre.textContent.split('\n')) {
      const width = line.replace(/\t/g, '        ').length * charWidth;
      if (left + width > right + 1) cut.push(line);
    }
  }
  return cut;
}"""


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


class _Unfolded(HTMLParser):
    """A page's text outside every <details> (what a reader sees before any click), and the text of each <details>."""

    VOID = {"br", "img", "hr", "input", "meta", "link", "col", "wbr", "source", "area", "base", "embed", "track"}

    def __init__(self):
        super().__init__()
        self.open_tags, self.depth, self.shown, self.folds, self.shown_classes = [], 0, [], [], set()

    def handle_starttag(self, tag, attrs):
        if tag in self.VOID:
            return
        if not self.depth:
            self.shown_classes.update((dict(attrs).get("class") or "").split())
        self.open_tags.append(tag)
        if tag == "details":
            self.depth += 1
            if self.depth == 1:
                self.folds.append({"class": dict(attrs).get("class") or "", "text": ""})

    def handle_endtag(self, tag):
        if tag not in self.open_tags:
            return
        while self.open_tags:   # close what the page left open inside (as a browser does)
            closed = self.open_tags.pop()
            if closed == "details":
                self.depth -= 1
            if closed == tag:
                break

    def handle_data(self, data):
        if self.depth:
            self.folds[-1]["text"] += data
        else:
            self.shown.append(data)


def unfolded(page: str) -> tuple[str, list[dict], set[str]]:
    """(the text outside any <details>, [{"class", "text"} of each outermost <details>], the CSS classes of the
    elements outside any <details>)."""
    parser = _Unfolded()
    parser.feed(page)
    return "".join(parser.shown), parser.folds, parser.shown_classes


def protected_lines(lab: str) -> tuple[set[str], set[str]]:
    """(lines of the lab's hidden tests, lines of its model-answer code) that appear nowhere else in the solution:
    substantial lines (instructor/student_repo.py's rule), compared without their indentation."""
    cells = labkit.read(lab).cells
    regions = {"hidden": [], "answer": []}
    elsewhere = set()
    for cell in cells:
        regions["hidden"] += labkit.HIDDEN_REGION.findall(cell.source)
        if cell.cell_type == "code":
            regions["answer"] += labkit.SOLUTION_REGION.findall(cell.source)
        rest = labkit.HIDDEN_REGION.sub("", labkit.SOLUTION_REGION.sub("", cell.source))
        elsewhere.update(line.strip() for line in rest.splitlines())
    hidden, answer = ({line.strip() for region in regions[kind] for line in region.splitlines()
                       if labkit.substantial(line) and line.strip() not in elsewhere} for kind in ("hidden", "answer"))
    return hidden, answer - hidden


def check_folds(lab: str, page: str) -> None:
    """No grader code on the page (hidden tests, in any form) and no open answer: every model answer, code or
    free-text, inside a folded <details>; a line saying what the grader checks for each removed test cell."""
    assert not HIDDEN.search(page), f"{lab}'s page shows the grader's hidden-test markers {len(HIDDEN.findall(page))} times"
    shown, folds, shown_classes = unfolded(page)
    everything = shown + "".join(fold["text"] for fold in folds)
    hidden, answer = protected_lines(lab)
    leaked = sorted(line for line in hidden if line in everything)
    assert not leaked, f"{lab}'s page shows {len(leaked)} lines of the grader's hidden tests, e.g. {leaked[:3]}"
    tests = [c for c in labkit.read(lab).cells if c.cell_type == "code" and HIDDEN.search(c.source)]
    said = shown.count("What the grader checks")
    assert said == len(tests), f"{lab}: {said} lines say what the grader checks, for {len(tests)} removed test cells"
    open_answers = sorted(line for line in answer if line in shown)
    assert not open_answers, f"{lab}'s page shows {len(open_answers)} model-answer lines unfolded, e.g. {open_answers[:3]}"
    missing = sorted(line for line in answer if line not in everything)
    assert not missing, f"{lab}'s page lacks {len(missing)} model-answer lines (they belong in a fold): {missing[:3]}"
    assert answers.CODE_MARKER_SHOWN["BEGIN"] not in shown, f"{lab}: a model-answer code cell is not folded"
    assert not shown_classes & {"model-answer", "grader-rubric"}, f"{lab}: a free-text model answer or rubric is not folded"
    code_cells = [c for c in labkit.read(lab).cells if c.cell_type == "code" and labkit.SOLUTION_REGION.search(c.source)]
    free_text = [f for f in folds if answers.FOLD_CLASS in f["class"].split()]
    code_folds = [f for f in folds if "above-input" in f["class"].split()]
    assert len(code_folds) == len(code_cells), f"{lab}: {len(code_folds)} folded code cells for {len(code_cells)} exercises"
    assert len(free_text) >= len(answer_cells(lab)), f"{lab}: {len(free_text)} folded answers for {len(answer_cells(lab))}"
    assert all(f["text"].lstrip().startswith(answers.SHOW_ANSWER) for f in free_text + code_folds), \
        f"{lab}: a fold is not labelled '{answers.SHOW_ANSWER}'"


@contextmanager
def chromium_browser():
    """Headless Chromium (Debian's chromium through Playwright, as tests/test_browser.py drives it)."""
    if not CHROMIUM.is_file():
        pytest.fail(f"no Chromium at {CHROMIUM}: the book's layout check needs Debian's chromium package "
                    f"(apt-get install chromium; .ci/run installs it) or LABS_CHROMIUM=/path/to/chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM))
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def chromium():
    with chromium_browser() as browser:
        yield browser


def cut_code_lines(browser, page_file: Path, width: int, height: int, shot: Path | None = None) -> list[str]:
    """The code lines of a book page that a reader at this window size cannot see whole (CUT_LINES_JS)."""
    page = browser.new_page(viewport={"width": width, "height": height})
    try:
        page.goto(page_file.resolve().as_uri(), wait_until="load")
        if shot:
            page.screenshot(path=str(shot), full_page=False)
        return page.evaluate(CUT_LINES_JS)
    finally:
        page.close()


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
    # Folded: the answer and the rubric each behind a "Show the model answer" control, the question and the text
    # after the answer outside it.
    folds = re.findall(r"<details[^>]*>(.*?)</details>", shown, re.S)
    assert len(folds) == 2 and "It all-reduces" in folds[0] and "Award 1" in folds[1], shown
    assert all(answers.SHOW_ANSWER in fold for fold in folds), shown
    assert "Why does" not in "".join(folds) and "After the answer" not in "".join(folds), shown
    assert answers.fold("x").startswith(f'<details class="admonition hide {answers.FOLD_CLASS}">')


def test_staged_labs_show_their_answers_in_boxes_and_no_markers():
    labs = labkit.labs()
    for lab in labs:
        staged = book.staged_notebook(lab, labs)
        leftover = [c.source for c in staged.cells if MARKERS.search(c.source)]
        assert not leftover, f"{lab}'s book page would show nbgrader's markers: {leftover[0][:300]}"
        shown = "\n".join(c.source for c in staged.cells if c.cell_type == "markdown").count("{admonition} Model answer")
        assert shown == len(answer_cells(lab)), f"{lab}: {shown} model-answer boxes for {len(answer_cells(lab))} answer cells"
        for i, cell in enumerate(staged.cells):
            tags = cell.metadata.get("tags", [])
            if HIDDEN.search(cell.source):
                assert cell.cell_type == "code" and "remove-cell" in tags, f"{lab}: a cell with hidden tests is not removed"
                line = staged.cells[i + 1]
                assert line.metadata.get("book", {}).get("grader_checks") == labkit.nbg(cell)["grade_id"], \
                    f"{lab}: no line says what {labkit.nbg(cell)['grade_id']} checks"
        answer_code = [c for c in staged.cells if c.cell_type == "code" and answers.CODE_MARKER_SHOWN["BEGIN"] in c.source]
        assert answer_code and all("hide-input" in c.metadata.get("tags", []) for c in answer_code), \
            f"{lab}: every model-answer code cell should be folded (hide-input)"
        assert all(c.metadata["mystnb"]["code_prompt_show"] == answers.SHOW_ANSWER for c in answer_code)
        markdown = [c.source for c in staged.cells if c.cell_type == "markdown"]
        assert sum(s.count("{admonition} Model answer") for s in markdown) == \
            sum(s.count(f'class="admonition hide {answers.FOLD_CLASS}"') for s in markdown), \
            f"{lab}: every free-text model answer should be folded"


def test_every_hidden_test_cell_is_said_in_words():
    """book/grader_checks.toml has one line for each solution cell with hidden tests, and none for a cell that is gone."""
    import tomllib

    written = tomllib.loads((labkit.REPO / "book" / "grader_checks.toml").read_text())
    for lab in labkit.labs():
        ids = [labkit.nbg(c)["grade_id"] for c in labkit.read(lab).cells if c.cell_type == "code" and HIDDEN.search(c.source)]
        lines = written.get(lab, {})
        assert sorted(lines) == sorted(ids), (f"{lab}: book/grader_checks.toml should say what each test cell with hidden "
                                              f"tests checks; missing {sorted(set(ids) - set(lines))}, "
                                              f"stale {sorted(set(lines) - set(ids))}")
        assert all(len(line.split()) >= 8 and not HIDDEN.search(line) for line in lines.values()), \
            f"{lab}: a line of book/grader_checks.toml is too short to say anything"


def test_no_hidden_test_line_is_also_a_model_answer_line():
    """The book folds model answers but shows them, so a line of a hidden test that is also a line of a model answer
    is on the page (tests/test_book.py::check_folds finds it only after every lab has run): caught here, statically."""
    for lab in labkit.labs():
        hidden, _ = protected_lines(lab)
        answer = {line.strip() for cell in labkit.read(lab).cells if cell.cell_type == "code"
                  for region in labkit.SOLUTION_REGION.findall(cell.source) for line in region.splitlines()}
        shared = sorted(hidden & answer)
        assert not shared, f"{lab}: hidden-test lines that the book shows as model-answer lines: {shared[:3]}; reword the test's"


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


def test_a_page_without_outputs_folds_answers_prints_them_and_fits(tmp_path, chromium):
    """One lab's page built in seconds without executing it (no outputs): answers folded and hidden tests gone,
    no code line cut at 1024 px or 1300 px, and every fold open in print."""
    lab = "01_gradient_accumulation"
    result = book.build(tmp_path, [lab], execute=False, quiet=True)
    assert not result.executed
    page_file = result.html / f"{lab}.html"
    check_answers(lab, page_file.read_text())
    check_folds(lab, page_file.read_text())
    check_site_has_no_grader_code(result.html)
    check_front_page(result.html)
    for width, height in WINDOWS:
        cut = cut_code_lines(chromium, page_file, width, height)
        assert not cut, f"at {width} px {len(cut)} code lines of {lab}'s page are cut, e.g. {cut[:2]}"
    page = chromium.new_page(viewport={"width": 1024, "height": 768})
    try:
        page.goto(page_file.resolve().as_uri(), wait_until="load")
        folded = page.locator("details.hide")
        visible = "() => Array.from(document.querySelectorAll('details.hide')).map(d => Array.from(d.children)" \
                  ".filter(c => c.tagName !== 'SUMMARY').every(c => c.checkVisibility()))"
        assert folded.count() and not any(page.evaluate(visible)), "a model answer is open before any click"
        folded.first.locator("summary").click()
        assert page.evaluate(visible)[0], "a click on 'Show the model answer' should open the answer"
        page.reload(wait_until="load")
        page.emulate_media(media="print")
        assert all(page.evaluate(visible)), "in print every model answer should be open"
    finally:
        page.close()


# --- the whole book, from the suite's executions -------------------------------------------------------

@pytest.mark.slow
def test_book_shows_every_lab_with_its_figures(request):
    """The whole book, built from the solutions that tests/test_labs.py executed in this run (files in
    labkit.EXECUTIONS). conftest.py puts this test last in the run's order, so every lab's test was handed to a
    worker before it: the ones on this test's worker are done, one on the other worker may still run (waited for)."""
    labs = labkit.labs()
    executed_here = [lab for lab in labs if any(f"{EXECUTING_TEST}[{lab}]" in item.nodeid for item in request.session.items)]
    if not executed_here:
        pytest.fail(f"no lab's solution was executed in this run, and the book test only reuses those executions: run it "
                    f"with {EXECUTING_TEST} (the whole suite does; by hand: launchers/test -k 'book or wrong_answers')")
    found = labkit.wait_for_executions(executed_here, labkit.scaled_timeout(labkit.LIVE_CHECK_LIMIT_S))
    seeds = {lab: path for lab, path in found.items() if isinstance(path, Path)}
    missing = {lab: found.get(lab, "still running past the live check's time limit") for lab in executed_here
               if lab not in seeds}
    assert not missing, f"{EXECUTING_TEST} ran for {sorted(missing)} but did not pass, so there is no execution to build from: {missing}"

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
    check_site_has_no_grader_code(site)
    check_front_page(site)
    check_code_fits(site, labs)

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
        check_folds(lab, page)
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


def check_front_page(site: Path) -> None:
    """The front page says, before anything else, that the book holds every answer and who should not get it."""
    article = re.search(r"<article[^>]*>(.*)</article>", (site / "index.html").read_text(), re.S).group(1)
    text = " ".join(re.sub(r"<[^>]+>", " ", article).split())
    first = text.find("This book holds every answer")
    assert first != -1 and "do not give the book" in text[first:first + 600], \
        "the front page should say plainly that the book holds every answer, and not to give it to graded students"
    assert first < text.find("The labs, in order"), "the warning belongs at the top of the front page"


def check_site_has_no_grader_code(site: Path) -> None:
    """No file of the published site holds the hidden tests (a page, the search index, a copied source)."""
    text_files = [p for p in site.rglob("*") if p.is_file() and p.suffix in (".html", ".js", ".txt", ".ipynb", ".json")]
    holding = [p.relative_to(site) for p in text_files if HIDDEN.search(p.read_text(errors="replace"))]
    assert not holding, f"the book's site holds the grader's hidden tests in {holding}"
    assert not any((site / "_sources").glob("*")), "the staged sources (with the hidden tests) must not be published"


def check_code_fits(site: Path, labs: list[str]) -> None:
    """Every code line of every page visible whole, in a laptop's 1024 px window and at 1300 px (Chromium); a
    screenshot of each window of the first lab in test-artifacts/book/."""
    with chromium_browser() as browser:
        for width, height in WINDOWS:
            cut = {lab: cut_code_lines(browser, site / f"{lab}.html", width, height,
                                       ARTEFACT / f"{lab}-{width}px.png" if lab == labs[0] else None) for lab in labs}
            cut = {lab: lines for lab, lines in cut.items() if lines}
            assert not cut, (f"at {width} px, {sum(map(len, cut.values()))} code lines are cut on "
                             f"{sorted(cut)}, e.g. {next(iter(cut.values()))[:2]}")


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
