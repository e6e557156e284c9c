"""lablib.checks: how an unwritten exercise looks to a student in a kernel."""

from __future__ import annotations

import contextlib
import io

from IPython.core.interactiveshell import InteractiveShell

from lablib import checks


def _run(shell, source: str):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        result = shell.run_cell(source)
    return result, out.getvalue()


def test_a_stub_is_one_course_message_and_still_an_error():
    shell = InteractiveShell.instance()
    assert checks.show_unwritten_exercises_briefly(shell)
    _run(shell, "def accumulation_step(model):\n    # YOUR CODE HERE\n    raise NotImplementedError()\n")
    result, shown = _run(shell, "accumulation_step(None)")
    assert result.error_in_exec is not None                  # the cell fails: no points for a stub
    assert shown.strip().splitlines() == [
        "NotImplementedError: accumulation_step() is not written yet: in its exercise cell replace "
        "'raise NotImplementedError()' under '# YOUR CODE HERE' with your code, run that cell, then run this one again"]


def test_any_other_not_implemented_error_keeps_its_traceback():
    shell = InteractiveShell.instance()
    checks.show_unwritten_exercises_briefly(shell)
    result, shown = _run(shell, "def f():\n    raise NotImplementedError('gloo cannot do this')\nf()")
    assert result.error_in_exec is not None and "gloo cannot do this" in shown and "Traceback" in shown
    result, shown = _run(shell, "import torch\ntorch.autograd.Function.forward(None)")   # a library's own stub
    assert result.error_in_exec is not None and "is not written yet" not in shown
