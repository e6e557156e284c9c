"""The labs in a real browser: headless Chromium (Debian's `chromium`, driven by Playwright for Python)
against the JupyterLab that launchers/lab starts, with the widgets on, as a student and an instructor see it.

launchers/lab runs in a copy of the repository's course files (same launcher, same .venv), so the cells the
browser runs write their files there, never into labs/ or solutions/. Screenshots go to test-artifacts/browser/.
A missing Chromium fails these tests (it does not skip them): .ci/run installs it.

Which labs' solutions run in the browser (each takes 1.5-3 min, too much for all fourteen in every CI run):
- by default one lab, rotating: the git commit of HEAD (as a hexadecimal number) modulo the number of labs, so
  every commit runs a lab, the same lab each time for that commit, and the labs take turns over the commits;
- LABS_BROWSER_LAB=03 (or 3, 03_amdahl_scaling, or a list 00,03) runs those; LABS_BROWSER_LAB=all runs them all.
The test prints which lab runs and why.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from contextlib import contextmanager
from datetime import date
from pathlib import Path

import nbformat
import pytest

import labkit
from jupyterpage import (STOPPED_S, controls_of, move, open_notebook, run_all, run_state, settled, shut_down_after,
                         wait_for_cells)
from instructor.course import find_lab
from lablib.jobs.job import kill_run
from lablib.jobs.processes import RUN_MARKER
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from test_jupyter import free_port, get

CHROMIUM = Path(os.environ.get("LABS_CHROMIUM", "/usr/bin/chromium"))
SHOTS = labkit.REPO / "test-artifacts" / "browser"
COURSE_FILES = ("labs", "solutions", "launchers", "instructor", "requirements.txt", "pyproject.toml", "nbgrader_config.py")
# JupyterLab settings for the test: every cell in the page (no virtual scrolling), no news pop-ups.
SETTINGS = {"@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
            "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                               "checkForUpdates": False}}
RUN_LIMIT_S = 600
STAMP = ".lablib-installed"   # launchers/_setup.sh's record of what .venv was installed from
STDERR = ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"


def browser_labs() -> tuple[list[str], str]:
    """The labs whose solutions run in the browser in this test run, and why (see the module's docstring)."""
    labs = labkit.labs()
    chosen = os.environ.get("LABS_BROWSER_LAB", "").strip()
    if chosen == "all":
        return labs, "LABS_BROWSER_LAB=all"
    if chosen:
        return [find_lab(name.strip()) for name in chosen.split(",")], f"LABS_BROWSER_LAB={chosen}"
    head = subprocess.run(["git", "-c", f"safe.directory={labkit.REPO}", "rev-parse", "HEAD"], cwd=labkit.REPO,
                          capture_output=True, text=True).stdout.strip()
    if re.fullmatch(r"[0-9a-f]{40,64}", head):
        turn, why = int(head, 16) % len(labs), f"commit {head[:12]}"
    else:   # no git history (an unpacked archive): the day takes turns instead
        turn, why = date.today().toordinal() % len(labs), f"no git commit, so today's date ({date.today()})"
    return [labs[turn]], (f"rotation: {why} modulo {len(labs)} labs = {turn} "
                          f"(LABS_BROWSER_LAB=NN or =all chooses)")


BROWSER_LABS, BROWSER_WHY = browser_labs()


@pytest.fixture(scope="module")
def course(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("browser") / "course"
    for name in COURSE_FILES:
        src = labkit.REPO / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__", "*_impl.py"))
        else:
            root.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, root / name)
    shared_venv(root / ".venv")
    assert not (root / "grading").exists(), "the copy must start like a fresh clone, without grading/"
    for name, value in SETTINGS.items():
        (root.parent / "settings" / name).parent.mkdir(parents=True, exist_ok=True)
        (root.parent / "settings" / name).write_text(json.dumps(value))
    return root


def shared_venv(venv: Path) -> None:
    """The repository's .venv for the copy, entry by entry, with a stamp of the copy's own. launchers/lab
    reinstalls the environment whenever .venv/.lablib-installed differs from the hash of requirements.txt and
    pyproject.toml; with the whole .venv linked, a stale stamp made the copy's launchers/lab reinstall the shared
    .venv with lablib and instructor installed from the copy (seen twice: every kernel started outside the
    repository then lacked lablib, until pip install -e of the repository). Its own stamp says the copy's files,
    so the copy never installs anything; keeping .venv up to date is the repository's launchers' work."""
    venv.mkdir()
    for entry in (labkit.REPO / ".venv").iterdir():
        if entry.name != STAMP:
            (venv / entry.name).symlink_to(entry)
    course = venv.parent
    digest = hashlib.sha256((course / "requirements.txt").read_bytes() + (course / "pyproject.toml").read_bytes())
    (venv / STAMP).write_text(digest.hexdigest() + "\n")   # as launchers/_setup.sh's _want_stamp computes it


@contextmanager
def jupyterlab(course: Path, *args: str):
    """launchers/lab [args] in the course copy; yields (base URL, token). Widgets are on, as for a student.
    The page exposes JupyterLab's app object (window.jupyterapp) so the test can read the cells' outputs as the
    kernel sent them. Its log goes to a file beside the copy; on exit it and every kernel and torchrun it
    started are ended."""
    port, token, marker = free_port(), os.urandom(16).hex(), uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k not in ("LABLIB_HEADLESS", "NBGRADER_EXECUTION")}
    env.update({RUN_MARKER: marker}, JUPYTERLAB_SETTINGS_DIR=str(course.parent / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(course.parent / "workspaces"))
    log = course.parent / f"jupyterlab-{port}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", str(course / "launchers" / "lab"), *args, "--no-browser", f"--port={port}", "--LabApp.expose_app_in_browser=True",
                                 "--ip=127.0.0.1", f"--IdentityProvider.token={token}"], env=env, cwd=course,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    try:
        while not _answers(f"{base}/api/status", token):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"launchers/lab {' '.join(args)} did not serve:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        assert "creating the course environment" not in log.read_text(), \
            f"launchers/lab reinstalled .venv from the copy (see shared_venv):\n{log.read_text()[-2000:]}"
        yield base, token
    finally:
        kill_run(proc, marker)


def _answers(url: str, token: str) -> bool:
    try:
        return get(url, token)[0] == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.is_file():
        pytest.fail(f"no Chromium at {CHROMIUM}: the browser tests need Debian's chromium package "
                    f"(apt-get install chromium; .ci/run installs it) or LABS_CHROMIUM=/path/to/chromium")
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM))
        yield chromium
        chromium.close()


@contextmanager
def page_of(browser, base: str, token: str, path: str):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(60_000)
    page.goto(f"{base}{path}?token={token}")
    try:
        yield page
    finally:
        page.close()


def shoot(page, name: str, element=None) -> Path:
    path = SHOTS / f"{name}.png"
    (element or page).screenshot(path=str(path))
    print(f"screenshot: {path}")
    return path


@pytest.fixture(scope="module")
def instructor_lab(course):
    """launchers/lab --solutions, shared by the instructor's checks (one JupyterLab start)."""
    with jupyterlab(course, "--solutions") as server:
        yield server


@pytest.fixture(scope="module")
def student_check(course, browser) -> str:
    """A student opens lab 01 in labs/ and runs the cells up to the first exercise's check (Shift+Enter, one by
    one): the text of the error under that check, the stub being unwritten."""
    lab = find_lab("01")
    released = labkit.read(lab, released=True)
    exercises = labkit.exercises(released)   # grade_id -> cell index
    first = min(exercises, key=exercises.get)
    exercise, check = exercises[first], min(i for i, _ in labkit.test_cells(released, first).values())
    with jupyterlab(course) as (base, token), page_of(browser, base, token, f"/lab/tree/{lab}/{lab}.ipynb") as page:
        open_notebook(page, f"{lab}/{lab}.ipynb")
        page.locator(".jp-NotebookPanel .jp-Cell").first.click()
        for _ in range(check + 1):
            page.keyboard.press("Shift+Enter")
            time.sleep(0.3)
        wait_for_cells(page, f"{lab}/{lab}.ipynb", sum(1 for c in released.cells[:check + 1] if c.cell_type == "code"),
                       300, errors_fail=False)
        cell = page.locator(".jp-NotebookPanel .jp-Cell").nth(check)
        cell.scroll_into_view_if_needed()
        shoot(page, "student_lab01_stub")
        written = page.locator(".jp-NotebookPanel .jp-Cell").nth(exercise).locator(STDERR)
        assert not written.count(), f"the exercise cell itself (it writes the module) failed: {written.last.inner_text()}"
        error = cell.locator(STDERR)
        assert error.count(), f"the check of the unwritten exercise should fail; it printed {cell.inner_text()[-2000:]!r}"
        text = error.last.inner_text()
        print(f"what the student sees under the check ({len(text.splitlines())} lines):\n{text}")
        return text


def test_student_runs_lab01_and_the_stub_fails(student_check):
    assert "NotImplementedError" in student_check, f"the stub should fail with NotImplementedError, not {student_check[-500:]!r}"


# Found on the first run: a 32-line IPython traceback ending in a bare 'NotImplementedError: '. Fixed:
# lablib.checks shows an unwritten exercise as one short course message.
def test_student_sees_the_course_message_not_a_traceback_wall(student_check):
    """The course's message: the last line names the unwritten function and says what to do; a short error."""
    last = student_check.strip().splitlines()[-1]
    assert re.search(r"NotImplementedError: .*\w+.*(exercise|YOUR CODE HERE)", last), \
        f"the error's last line should name the unwritten exercise and what to do, it is {last!r}"
    assert len(student_check.splitlines()) <= 15, f"a traceback wall of {len(student_check.splitlines())} lines"


@pytest.mark.slow
@pytest.mark.parametrize("lab", BROWSER_LABS)
def test_solution_runs_in_the_browser_with_plots_and_live_widgets(course, browser, instructor_lab, lab):
    """A lab's solution, top to bottom in JupyterLab (Run All): no error output, plots as images, and each kind of
    ipywidgets control it has (slider, dropdown, toggle buttons) redraws its figure when changed. A cell that
    raises fails the test as soon as its error arrives, with the cell's number and traceback."""
    print(f"browser lab {lab}: {BROWSER_WHY}")
    path, t0 = f"{lab}/{lab}.ipynb", time.perf_counter()
    base, token = instructor_lab
    # A workspace of its own: JupyterLab would otherwise reopen the notebooks of the labs run before it.
    with page_of(browser, base, token, f"/lab/workspaces/browser-{lab}/tree/{path}") as page, shut_down_after(page, path):
        run_all(page, path)
        code_cells = sum(1 for c in labkit.read(lab).cells if c.cell_type == "code")
        try:
            wait_for_cells(page, path, code_cells, RUN_LIMIT_S)
        except pytest.fail.Exception:
            print(f"{lab}: the browser test failed after {time.perf_counter() - t0:.0f} s")
            shoot(page, f"solution_{lab}_failed")
            raise
        print(f"{lab}'s solution ran in the browser in {time.perf_counter() - t0:.0f} s")
        page.keyboard.press("Control+s")
        time.sleep(2)
        shoot(page, f"solution_{lab}_end")

        saved = nbformat.read(course / "solutions" / lab / f"{lab}.ipynb", as_version=4)
        errors = [(i, o.get("ename"), o.get("evalue", "")[:200]) for i, c in enumerate(saved.cells)
                  for o in c.get("outputs", []) if o.get("output_type") == "error"]
        assert not errors, f"{lab}'s solution raised in the browser: {errors}"
        images = page.locator(".jp-NotebookPanel .jp-OutputArea-output img")
        assert images.count() > 0, f"{lab}'s plots should render as images"
        broken = page.evaluate("() => [...document.querySelectorAll('.jp-OutputArea-output img')]"
                               ".filter(i => !(i.complete && i.naturalWidth > 0)).length")
        assert broken == 0, f"{broken} of {images.count()} plots did not load as images"

        kinds = controls_of(lab)
        if not kinds:
            print(f"{lab} has no ipywidgets control: nothing to move")
            assert not page.locator(".jp-NotebookPanel .widget-interact").count()
            return
        assert page.locator(".jp-NotebookPanel .widget-interact").count(), \
            f"{lab}'s solution shows none of its widgets {sorted(kinds)} in the browser (widgets off?)"
        for kind in sorted(kinds):
            t1 = time.perf_counter()
            control, act = move(page, kind)
            widget = control.locator("xpath=ancestor::div[contains(@class,'widget-interact')][1]")
            widget.scroll_into_view_if_needed()
            figure = widget.locator("img").first
            try:
                figure.wait_for()
            except PlaywrightTimeout:
                shoot(page, f"solution_{lab}_{kind.replace(' ', '_')}_no_figure", widget)
                pytest.fail(f"{lab}: the widget with its {kind} shows no figure within 60 s; it shows "
                            f"{' '.join(widget.inner_text().split())[-800:]!r}")
            before = settled(page, path, code_cells, figure)
            name = kind.replace(" ", "_")
            shoot(page, f"solution_{lab}_{name}_before", widget)
            act()
            try:
                page.wait_for_function("([el, src]) => { const i = el.querySelector('img'); return i && i.src !== src; }",
                                       arg=[widget.element_handle(), before], timeout=60_000)
            except PlaywrightTimeout:
                shoot(page, f"solution_{lab}_{name}_after", widget)
                same = figure.count() and figure.get_attribute("src") == before
                pytest.fail(f"{lab}: changing its {kind} did not redraw the figure within 60 s (kernel "
                            f"{run_state(page, path)['kernel']}; {widget.locator('img').count()} image(s) in the "
                            f"widget{', the same as before' if same else ''}); the widget shows "
                            f"{' '.join(widget.inner_text().split())[-500:]!r}")
            settled(page, path, code_cells, figure)   # every redraw the change asked for has arrived
            shoot(page, f"solution_{lab}_{name}_after", widget)
            print(f"{lab}: its {kind} redrew the figure in {time.perf_counter() - t1:.1f} s")


# Before: a cell that raised stopped Run All and the test waited out RUN_LIMIT_S (600 s) for prompts that never came.
PLANTED = {"raises": ("raise ValueError('planted in the browser test')",
                      "cell 1 (code cell 2, In [2]) raised ValueError: planted in the browser test"),
           # the pause lets the kernel send the first cell's reply before it dies
           "kernel_dies": ("import os, time; time.sleep(1); os._exit(1)", "cells [1, 2] of 3 code cells never run")}


@pytest.mark.parametrize("case", PLANTED)
def test_a_stopped_run_fails_the_wait_at_once(course, browser, instructor_lab, case):
    """A notebook whose second cell raises (or kills its kernel), run all in the browser: wait_for_cells fails
    within seconds, naming the cell and the error, instead of waiting out its limit."""
    planted, expected = PLANTED[case]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in
                                               ("print('first')", planted, "print('never reached')")],
                                        metadata={"kernelspec": labkit.read(labkit.labs()[0]).metadata.kernelspec})
    path = f"failfast_{case}.ipynb"   # beside the labs, not in one: Formgrader takes folders for assignments
    nbformat.write(notebook, course / "solutions" / path)
    base, token = instructor_lab
    try:
        with page_of(browser, base, token, f"/lab/workspaces/failfast-{case}/tree/{path}") as page, \
                shut_down_after(page, path):
            run_all(page, path)
            t0 = time.monotonic()
            with pytest.raises(pytest.fail.Exception) as failed:
                wait_for_cells(page, path, 3, limit_s=120)
            seconds = time.monotonic() - t0
    finally:
        (course / "solutions" / path).unlink()
    print(f"{case}: reported in {seconds:.1f} s:\n{failed.value}")
    assert expected in str(failed.value), f"the failure should say {expected!r}; it said {failed.value}"
    assert seconds < STOPPED_S + 20, f"the wait took {seconds:.0f} s to see the run had stopped"


# Found on the first run: on a fresh clone grading/ did not exist, the gradebook could not be opened,
# /formgrader/api/assignments answered 500 and the page said 'Loading, please wait...' for ever. Fixed:
# nbgrader_config.py creates grading/ when the server reads it (the copy below starts without one).
@pytest.mark.parametrize("graded_before", [False, True], ids=["fresh_clone", "after_grading"])
def test_instructor_sees_the_labs_in_formgrader(course, browser, instructor_lab, graded_before):
    """The instructor starts launchers/lab --solutions and opens Formgrader: every lab is an assignment."""
    if graded_before:   # what launchers/grade leaves: the course's grading folder (and its gradebook)
        (course / "grading").mkdir(exist_ok=True)
    labs = labkit.labs()
    base, token = instructor_lab
    with page_of(browser, base, token, "/formgrader") as page:
        with page.expect_response(lambda r: "/formgrader/api/assignments" in r.url, timeout=60_000) as answer:
            page.reload()   # the page asks its API for the assignments once it has loaded
        if answer.value.ok:
            try:
                page.wait_for_selector(f"td:has-text('{labs[-1]}')", timeout=60_000)
            except PlaywrightTimeout:
                pass   # the assertion below says what the page shows instead
        else:
            time.sleep(2)  # for the screenshot: what the instructor is left looking at
        shoot(page, f"formgrader_{'after_grading' if graded_before else 'fresh_clone'}")
        assert answer.value.ok, (f"Formgrader's assignment list answered HTTP {answer.value.status}; the page shows: "
                                 f"{' '.join(page.inner_text('body').split())[-300:]}")
        rows = page.locator("table tbody tr").all_inner_texts()
        missing = [lab for lab in labs if not any(row.startswith(lab) for row in rows)]
        assert not missing, f"Formgrader's assignment list lacks {missing}: {rows}"
