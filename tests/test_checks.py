"""lablib.checks: how an unwritten exercise looks to a student in a kernel."""

from __future__ import annotations

import contextlib
import io

import pytest
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


def test_a_guarded_reference_refuses_inside_the_block_and_works_after():
    from lablib.course import commcost
    from lablib.course.commcost import alpha_beta_time as bound_before   # the way a student's module could import it

    before = commcost.alpha_beta_time(1e-5, 1e-9, 1e6)
    with checks.answer_without(commcost.alpha_beta_time, reason="write the formula yourself"):
        with pytest.raises(checks.CheckFailed, match="write the formula yourself"):
            bound_before(1e-5, 1e-9, 1e6)
        with pytest.raises(checks.CheckFailed):
            commcost.alpha_beta_time(alpha_s=1e-5, beta_s_per_byte=1e-9, n_bytes=1e6)
    assert commcost.alpha_beta_time(1e-5, 1e-9, 1e6) == before == bound_before(1e-5, 1e-9, 1e6)


def test_warnings_go_to_stdout_only_while_autograding(capsys):
    import warnings

    saved = warnings.showwarning
    try:
        assert not checks.warnings_on_stdout_while_autograding({})
        assert checks.warnings_on_stdout_while_autograding({"NBGRADER_EXECUTION": "autograde"})
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = checks._warning_to_stdout     # catch_warnings restores the hook on exit
            warnings.warn("reduce_scatter_tensor is deprecated", FutureWarning)
        out, err = capsys.readouterr()
        assert "FutureWarning: reduce_scatter_tensor is deprecated" in out and err == ""
    finally:
        warnings.showwarning = saved
