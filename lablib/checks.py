"""Assertions for the notebooks' graded test cells: each failure says what was expected, what came back,
and a hint. They compare against references (autograd, PyTorch's own implementations, formulas); the
answers to the exercises are not here.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import warnings

import torch


class CheckFailed(AssertionError):
    pass


def _fail(what: str, expected, got, hint: str) -> None:
    raise CheckFailed(f"{what}\n  expected: {expected}\n  got:      {got}" + (f"\n  hint: {hint}" if hint else ""))


def check_close(got, expected, what: str, rtol: float = 1e-5, atol: float = 1e-6, hint: str = "") -> None:
    """Tensors or numbers equal within |got - expected| <= atol + rtol * |expected| (torch.allclose)."""
    got_t = torch.as_tensor(got, dtype=torch.float64)
    exp_t = torch.as_tensor(expected, dtype=torch.float64)
    if got_t.shape != exp_t.shape:
        _fail(f"{what}: wrong shape", tuple(exp_t.shape), tuple(got_t.shape), hint)
    if not torch.isfinite(got_t).all():
        _fail(f"{what}: contains NaN or inf", "finite values", got_t.flatten()[:6].tolist(), hint)
    if not torch.allclose(got_t, exp_t, rtol=rtol, atol=atol):
        err = (got_t - exp_t).abs().max().item()
        scale = exp_t.abs().max().item()
        summary = (f"{exp_t.item():.6g}" if exp_t.numel() == 1 else f"max |expected| = {scale:.3g}")
        found = (f"{got_t.item():.6g}" if got_t.numel() == 1 else
                 f"max |got - expected| = {err:.3g} (tolerance atol={atol:g}, rtol={rtol:g})")
        _fail(what, summary, found, hint)


def check_equal(got, expected, what: str, hint: str = "") -> None:
    if got != expected:
        _fail(what, repr(expected), repr(got), hint)


def check_true(condition: bool, what: str, hint: str = "") -> None:
    if not condition:
        raise CheckFailed(what + (f"\n  hint: {hint}" if hint else ""))


def check_finite_number(value, what: str, hint: str = "") -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        _fail(what, "a finite number", repr(value), hint)


# --- a reference the answer may not call -----------------------------------------------------------------------

_REFUSAL = ""


def _refused(*args, **kwargs):
    # Runs as the code of a guarded function, with that function's module globals: it names nothing but
    # builtins, and finds the reason in this module.
    import lablib.checks as checks_module
    raise checks_module.CheckFailed(checks_module._REFUSAL)


@contextlib.contextmanager
def answer_without(*functions, reason: str):
    """Inside the block, each of ``functions`` (lablib's references, e.g. a simulated schedule) raises
    ``CheckFailed(reason)`` instead of running: a graded answer that only calls the reference it is graded
    against fails. The function objects themselves are changed (their code), so a name bound by ``from lablib.x
    import f`` before the block is caught too. Call the student's code inside, the references outside.
    """
    global _REFUSAL
    for f in functions:
        if f.__code__.co_freevars:
            raise TypeError(f"answer_without cannot guard {f.__qualname__}: it is a closure")
    saved = [(f, f.__code__, f.__defaults__, f.__kwdefaults__) for f in functions]
    _REFUSAL = reason
    try:
        for f, *_ in saved:
            f.__code__, f.__defaults__, f.__kwdefaults__ = _refused.__code__, None, None
        yield
    finally:
        for f, code, defaults, kwdefaults in saved:
            f.__code__, f.__defaults__, f.__kwdefaults__ = code, defaults, kwdefaults


# --- an unwritten exercise, as the student sees it in JupyterLab ---------------------------------------------

def _is_student_code(filename: str) -> bool:
    """A notebook cell (ipykernel's /tmp/ipykernel_*/N.py, or <ipython-input-...>) or an exercise module file."""
    return "ipykernel_" in filename or filename.startswith("<ipython-input") or filename.endswith("_impl.py")


def unwritten_exercise_message(error: BaseException) -> str | None:
    """The course's one-line message for a NotImplementedError raised by a released exercise stub (no message,
    raised in a notebook cell or an exercise module): which function and what to do. None for any other
    NotImplementedError (a library's, or one with its own message), which keeps its full traceback."""
    if not isinstance(error, NotImplementedError) or str(error):
        return None
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None or not _is_student_code(tb.tb_frame.f_code.co_filename):
        return None
    name = tb.tb_frame.f_code.co_name
    what = "this cell" if name == "<module>" else f"{name}()"
    return (f"{what} is not written yet: in its exercise cell replace 'raise NotImplementedError()' under "
            f"'# YOUR CODE HERE' with your code, run that cell, then run this one again")


def show_unwritten_exercises_briefly(shell=None) -> bool:
    """In an IPython kernel, show a stub's NotImplementedError as the course's short message instead of a
    traceback wall. It is still an error (the cell fails, nbgrader gives no points); any other exception keeps
    IPython's traceback. Installed when this module is imported in a kernel; returns whether it is active."""
    if shell is None:
        try:
            from IPython import get_ipython
        except ImportError:
            return False
        shell = get_ipython()
    if shell is None:
        return False

    def handler(shell, etype, value, tb, tb_offset=None):
        message = unwritten_exercise_message(value)
        if message is None:
            shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
            return None
        shell._showtraceback(etype, value, [f"NotImplementedError: {message}"])
        return None

    shell.set_custom_exc((NotImplementedError,), handler)
    return True


# --- warnings while autograding ----------------------------------------------------------------------------------

def _warning_to_stdout(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stdout.write(f"[warning, shown on stdout while autograding] "
                     f"{warnings.formatwarning(message, category, filename, lineno, line)}")


def warnings_on_stdout_while_autograding(environ=os.environ) -> bool:
    """nbgrader 0.9.6 gives a graded cell no points when it wrote anything to stderr, and Python prints warnings
    there (torch 2.13 warns, for one, on the first in-process ``reduce_scatter_tensor``). While autograding
    (``NBGRADER_EXECUTION`` set), warnings are printed on stdout instead: still shown in the feedback, never a
    lost point. Installed when this module is imported; returns whether it is active."""
    if not environ.get("NBGRADER_EXECUTION"):
        return False
    warnings.showwarning = _warning_to_stdout
    return True


show_unwritten_exercises_briefly()
warnings_on_stdout_while_autograding()
