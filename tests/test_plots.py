"""plots.explore: widgets for a person at a front end, one static figure in every headless run."""

import types

import IPython

from lablib.course import plots


def fake_shell(metadata):
    kernel = types.SimpleNamespace(get_parent=lambda: {"metadata": metadata})
    return lambda: types.SimpleNamespace(kernel=kernel)


def test_headless_draws_defaults_and_makes_no_widget(monkeypatch):
    for name in ("NBGRADER_EXECUTION", "LABLIB_HEADLESS", "LABLIB_WIDGETS"):
        monkeypatch.delenv(name, raising=False)
    calls = []

    def make_controls():
        raise AssertionError("no widget may be created headless")

    assert plots.headless()  # pytest: no kernel, no front end
    plots.explore(lambda p=0.5: calls.append(p), make_controls)
    assert calls == [0.5]


def test_front_end_detection(monkeypatch):
    for name in ("NBGRADER_EXECUTION", "LABLIB_HEADLESS", "LABLIB_WIDGETS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(IPython, "get_ipython", fake_shell({"cellId": "abc"}))
    assert not plots.headless()                       # JupyterLab / Notebook 7 / VS Code
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    assert plots.headless()                           # grading always wins
    monkeypatch.delenv("NBGRADER_EXECUTION")
    monkeypatch.setattr(IPython, "get_ipython", fake_shell({}))
    assert plots.headless()                           # nbclient sends no cellId
    monkeypatch.setenv("LABLIB_WIDGETS", "1")
    assert not plots.headless()


def test_widgets_redraw_into_the_output_from_the_kernel(monkeypatch):
    """With a front end, explore shows the controls and one Output whose outputs are set from the kernel on each
    change (printed text, then the traceback of a function that raises), never caught by message id."""
    import ipywidgets
    import IPython.display

    monkeypatch.setenv("LABLIB_WIDGETS", "1")
    for name in ("NBGRADER_EXECUTION", "LABLIB_HEADLESS"):
        monkeypatch.delenv(name, raising=False)
    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda *objs, **kw: shown.extend(objs))
    slider = ipywidgets.IntSlider(value=2, min=0, max=5)

    def draw(n=2):
        print(f"n is {n}")
        if n == 0:
            raise ValueError("n must be positive")
        return n * 10

    assert plots.explore(draw, lambda: {"n": slider}) == 20
    (box,) = shown
    out = box.children[-1]
    assert "widget-interact" in box._dom_classes and box.children[0] is slider and slider.description == "n"
    assert [(o["output_type"], o["text"]) for o in out.outputs] == [("stream", "n is 2\n")]
    slider.value = 4
    assert [o["text"] for o in out.outputs] == ["n is 4\n"]
    slider.value = 0
    assert [o.get("name") for o in out.outputs] == ["stdout", "stderr"]
    assert "ValueError: n must be positive" in out.outputs[1]["text"]


def test_every_lab_draws_its_widgets_through_explore():
    """ipywidgets.interact in a lab would bring back the dropped figures and create widgets headless (nbgrader)."""
    import re

    import labkit

    found = [f"{lab}: {line.strip()}" for lab in labkit.labs() for cell in labkit.read(lab).cells
             if cell.cell_type == "code"
             for line in cell.source.splitlines() if re.search(r"\binteract(ive|ive_output)?\(", line)]
    assert not found, "use lablib.course.plots.explore(func, lambda: {name: widget}) instead of:\n" + "\n".join(found)
