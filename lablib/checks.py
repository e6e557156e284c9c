"""Assertions for the notebooks' graded test cells: each failure says what was expected, what came back,
and a hint. They compare against references (autograd, PyTorch's own implementations, formulas); the
answers to the exercises are not here.
"""

from __future__ import annotations

import math

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
