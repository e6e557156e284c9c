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
