"""Reading and driving one notebook in a JupyterLab page, for tests/test_browser.py (Playwright, sync API).

The page must expose JupyterLab's app (jupyter lab --LabApp.expose_app_in_browser=True): what the cells hold is
read from JupyterLab's notebook model, the outputs as the kernel sent them, not guessed from the rendered page
(an error output and a warning printed on stderr render alike there).
"""

from __future__ import annotations

import re
import time
from contextlib import contextmanager

import pytest

import labkit

# A kernel idle this long with no cell running or queued while cells are left unrun: the run has stopped.
STOPPED_S = 5
# No cell running nor run this long after Run All: the cells were never sent.
START_LIMIT_S = 60
# The ipywidgets controls the labs create (`widgets.<Kind>(`), by how the test drives them; a lab with another
# kind fails the test until it is added here with a way to drive it. Containers and layouts are no controls.
SLIDER, DROPDOWN, TOGGLE = "slider", "dropdown", "toggle buttons"
CONTROLS = {**dict.fromkeys(("IntSlider", "FloatSlider", "FloatLogSlider", "SelectionSlider"), SLIDER),
            "Dropdown": DROPDOWN, "ToggleButtons": TOGGLE}
NOT_CONTROLS = {"Layout", "HBox", "VBox", "Box", "GridBox", "Output", "Label", "HTML", "Tab", "Accordion"}


# The notebook's code cells as JupyterLab's model holds them (what Ctrl+S would save): execution count, whether
# running or queued, and the error outputs (output_type 'error': an exception, never a warning printed on
# stderr nor the traceback of a torchrun worker that a cell prints on purpose), with the kernel's status.
PANEL_JS = "const panel = [...window.jupyterapp.shell.widgets('main')].find(w => w.context && w.context.path === path);"
RUN_STATE_JS = """path => {
  """ + PANEL_JS + """
  if (!panel || !panel.sessionContext) return null;
  const cells = [];
  panel.content.widgets.forEach((cell, index) => {
    const model = cell.model;
    if (model.type !== 'code') return;
    const errors = [];
    for (let i = 0; i < model.outputs.length; i++) {
      const output = model.outputs.get(i);
      if (output.type === 'error') errors.push(output.toJSON());
    }
    cells.push({index, count: model.executionCount, running: model.executionState === 'running', errors});
  });
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  return {kernel: kernel ? kernel.status : 'none', cells};
}"""
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def open_notebook(page, path: str) -> None:
    """Wait until the notebook shows its cells and its kernel is connected and idle. (The page's execution
    indicator says idle before then: cells run in that moment were never sent, seen in one Run All of three.)"""
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=90_000)
    page.wait_for_function(f"""path => {{ {PANEL_JS}
      const kernel = panel && panel.sessionContext.session && panel.sessionContext.session.kernel;
      return kernel && kernel.connectionStatus === 'connected' && kernel.status === 'idle'; }}""", arg=path, timeout=120_000)


def run_state(page, path: str) -> dict:
    state = page.evaluate(RUN_STATE_JS, path)
    assert state is not None, f"no notebook {path} open in the page (or window.jupyterapp missing)"
    return state


def error_report(state: dict, lines: int = 25) -> str:
    """Each cell that raised: its cell number, the exception and the end of its traceback (as the kernel sent it)."""
    reports = []
    for code_number, cell in enumerate(state["cells"], 1):
        for error in cell["errors"]:
            traceback = ANSI.sub("", "\n".join(error.get("traceback", []))).strip().splitlines()
            reports.append(f"cell {cell['index']} (code cell {code_number}, In [{cell['count']}]) raised "
                           f"{error.get('ename')}: {error.get('evalue')}\n" + "\n".join(traceback[-lines:]))
    return "\n\n".join(reports)


def wait_for_cells(page, path: str, count: int, limit_s: float, errors_fail: bool = True) -> float:
    """Until the first `count` code cells of notebook `path` have run and the kernel is idle; the seconds it took.
    Fails at once, naming the cell and its error, when a cell raised (unless errors_fail is False: a student's
    unwritten exercise), and after STOPPED_S s when, the run having started, the kernel is idle or dead with none
    of the cells left running or queued (Run All stops at an error; a kernel that died stops everything)."""
    t0 = time.monotonic()
    started, stopped_since = False, None
    while True:
        state = run_state(page, path)
        cells = state["cells"][:count]
        if errors_fail and any(cell["errors"] for cell in cells):
            failed = next(cell["index"] for cell in cells if cell["errors"])
            page.locator(".jp-NotebookPanel .jp-Cell").nth(failed).scroll_into_view_if_needed()
            pytest.fail(f"{path}: a cell raised after {time.monotonic() - t0:.0f} s of waiting:\n{error_report(state)}")
        unrun = [cell["index"] for cell in cells if cell["count"] is None]
        busy = state["kernel"] not in ("idle", "dead") or any(cell["running"] for cell in state["cells"])
        if not busy and len(cells) == count and not unrun:
            return time.monotonic() - t0
        started = started or any(cell["running"] for cell in cells) or len(unrun) < len(cells)
        stopped_since = None if busy or not started else stopped_since or time.monotonic()
        if stopped_since and time.monotonic() - stopped_since > STOPPED_S:
            pytest.fail(f"{path}: the run stopped (kernel {state['kernel']}, nothing running or queued) with cells "
                        f"{unrun} of {len(state['cells'])} code cells never run"
                        + (f"; errors:\n{error_report(state)}" if any(c["errors"] for c in cells) else ""))
        if not started and time.monotonic() - t0 > min(limit_s, START_LIMIT_S):
            pytest.fail(f"{path}: in {time.monotonic() - t0:.0f} s no cell started (kernel {state['kernel']})")
        if time.monotonic() - t0 > limit_s:
            pytest.fail(f"{path}: cells still running after {limit_s:.0f} s; not yet run: {unrun}")
        time.sleep(1)


def run_all(page, path: str) -> None:
    """Open the notebook and run all its cells, from JupyterLab's Run menu."""
    open_notebook(page, path)
    page.locator(".jp-NotebookPanel .jp-Cell").first.click()
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name=re.compile(r"^Run All Cells")).click()


def settled(page, path: str, code_cells: int, figure, quiet_s: float = 2.0) -> str:
    """The figure's src once the kernel is idle and the figure has not changed for quiet_s: a slider moved three
    steps asks for three redraws, and the kernel is briefly idle between them."""
    for _ in range(10):
        wait_for_cells(page, path, code_cells, 60)
        src = figure.get_attribute("src")
        time.sleep(quiet_s)
        if figure.get_attribute("src") == src and run_state(page, path)["kernel"] == "idle":
            return src
    pytest.fail(f"{path}: the figure kept changing for {10 * quiet_s:.0f} s after its control stopped moving")


@contextmanager
def shut_down_after(page, path: str):
    """Shut the notebook's kernel down at the end (with LABS_BROWSER_LAB=all, one kernel per lab would stay up)."""
    try:
        yield
    finally:
        page.evaluate(f"path => {{ {PANEL_JS} return panel && panel.sessionContext.shutdown(); }}", path)


def controls_of(lab: str) -> set[str]:
    """How the test drives each ipywidgets control that lab's solution creates (SLIDER, DROPDOWN, TOGGLE)."""
    source = "\n".join(c.source for c in labkit.read(lab).cells if c.cell_type == "code")
    kinds = set(re.findall(r"\bwidgets\.([A-Z]\w*)\(", source)) - NOT_CONTROLS
    unknown = kinds - CONTROLS.keys()
    assert not unknown, f"{lab} creates ipywidgets {sorted(unknown)}, which this test cannot drive yet: add them to CONTROLS"
    return {CONTROLS[kind] for kind in kinds}


def move(page, kind: str):
    """Change one control of that kind in an interact; the control and the action that changes it."""
    controls = page.locator(".jp-NotebookPanel .widget-interact")
    if kind == SLIDER:
        control = controls.locator(".widget-slider").first
        handle = control.locator(".noUi-handle").first
        now, top = handle.get_attribute("aria-valuenow"), handle.get_attribute("aria-valuemax")
        key = "ArrowLeft" if now is not None and top is not None and float(now) >= float(top) else "ArrowRight"

        def act():
            handle.focus()
            for _ in range(3):
                page.keyboard.press(key)
        return control, act
    if kind == DROPDOWN:   # the first one with a choice to make
        select = next((s for s in controls.locator(".widget-dropdown select").all() if s.locator("option").count() > 1), None)
        assert select is not None, "no dropdown with two options or more in an interact"
        current = select.evaluate("s => s.selectedIndex")
        return select, lambda: select.select_option(index=1 if current == 0 else 0)
    if kind == TOGGLE:
        button = controls.locator(".widget-toggle-buttons button:not(.mod-active)").first
        return button, button.click
    raise AssertionError(f"no way to drive a {kind}")
