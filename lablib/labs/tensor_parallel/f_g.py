"""Lab 08's exercise 1 probed and graded: Megatron's f and g (Shoeybi et al., 2019, arXiv:1909.08053, section 3).

f is the identity forward and an all-reduce of the gradient backward; g the all-reduce forward and the identity
backward. Checked directly: rank r feeds its own x_r and its own upstream gradient w_r, so the sums are visible
(f must give x_r and sum_r w_r, g sum_r x_r and w_r), and the all-reduces are counted where the student's code
calls torch.distributed (``lablib.measure.counting``). The exercise asks for autograd Functions: f's and g's
outputs must come from ``CopyToTensorParallel``'s and ``ReduceFromTensorParallel``'s own autograd nodes.

Inputs (``INPUTS``): fp32 (3, 5) requiring grad; and, in the hidden cases, bf16, a non-contiguous 3-D view, and one
that does not require grad (f and g still run; no gradient to check). Tolerances: a sum of N values in another
order, gamma_N u-bounded (``lablib.measure.rankcheck.gamma``) against sum_r |x_r|, in the input's precision.
"""

from __future__ import annotations

from collections import Counter

import torch

from lablib import checks
from lablib.measure import counting
from lablib.measure.rankcheck import gamma

UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}
FUNCTIONS = {"f": "CopyToTensorParallel", "g": "ReduceFromTensorParallel"}
# input case -> (dtype, shape, as a non-contiguous view, requires grad)
INPUTS = {"plain": (torch.float32, (3, 5), False, True), "bf16": (torch.bfloat16, (3, 5), False, True),
          "noncontig": (torch.float32, (2, 3, 4), True, True), "nograd": (torch.float32, (3, 5), False, False)}


def _inputs(case: str, r: int):
    """Rank r's x_r and upstream gradient w_r for an input case (the same on every rank that asks for rank r)."""
    dtype, shape, noncontig, _ = INPUTS[case]
    g = torch.Generator().manual_seed(1000 + r)
    x, w = torch.randn(shape[::-1] if noncontig else shape, generator=g), torch.randn(shape, generator=g)
    if noncontig:                              # a permuted view: strides reversed, not contiguous
        x = x.permute(*reversed(range(x.dim())))
    return x.to(dtype), w.to(dtype)


def _autograd_node(impl, name: str, y: torch.Tensor) -> str | None:
    """None when y came out of the exercise's own autograd Function for ``name``; else what is wrong."""
    cls_name = FUNCTIONS[name]
    cls = getattr(impl, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
        return f"{cls_name} is not a torch.autograd.Function subclass in your file"
    node = type(y.grad_fn).__name__ if y.grad_fn is not None else None
    if node != f"{cls_name}Backward":
        return (f"{name}(x, group)'s output has grad_fn {node}, not {cls_name}'s node ({cls_name}Backward): "
                f"{name} must return {cls_name}.apply(x, group)")
    return None


def probe_f_g(impl, tp: int, group, rank: int, cases: tuple[str, ...] = ("plain",)) -> dict:
    """f and g on their own, for each input case: rank r feeds x_r and receives the upstream gradient w_r.
    Collectives are counted by name where torch.distributed is called; functional collectives (DTensor's, as in
    ``DTensorFG``) are listed apart, by torch's op."""
    out = {"tp": tp, "error": None, "cases": {}}
    log = counting.CollectiveLog()

    def called():
        return (dict(Counter(c.name for c in log.calls if not c.functional)),
                [c.function for c in log.calls if c.functional])
    try:
        for case in cases:
            dtype, _, _, needs_grad = INPUTS[case]
            xs, ws = zip(*(_inputs(case, r) for r in range(tp)))
            exact = {"x": torch.stack([x.double() for x in xs]).sum(0), "w": torch.stack([w.double() for w in ws]).sum(0)}
            abs_sum = {"x": torch.stack([x.double().abs() for x in xs]).sum(0).max().item(),
                       "w": torch.stack([w.double().abs() for w in ws]).sum(0).max().item()}
            # N values summed in any order, each partial sum rounded in the input's precision, plus one rounding
            # of the exact sum to compare with: gamma_{N+1} u times sum_r |x_r|.
            rounding = gamma(tp + 1, UNIT_ROUNDOFF[dtype])
            record = {}
            for name, fn, want_y, want_grad, y_bound, grad_bound in (
                    ("f", impl.f, xs[rank].double(), exact["w"], 0.0, rounding * abs_sum["w"]),
                    ("g", impl.g, exact["x"], ws[rank].double(), rounding * abs_sum["x"], 0.0)):
                # a leaf of this rank's own (a detached permuted view keeps its strides: still non-contiguous)
                x = xs[rank].detach() if INPUTS[case][2] else xs[rank].detach().clone()
                x.requires_grad_(needs_grad)
                before = x.detach().clone()
                with counting.count_collectives(log):
                    log.reset()
                    y = fn(x, group)
                    forward, functional = called()
                    log.reset()
                    if needs_grad:
                        y.backward(ws[rank])
                    backward, functional_backward = called()
                record[name] = {
                    "forward": forward, "backward": backward, "functional": functional + functional_backward,
                    "form": _autograd_node(impl, name, y) if needs_grad else None,
                    "dtype": str(y.dtype), "want_dtype": str(dtype), "shape": list(y.shape), "want_shape": list(x.shape),
                    "y_diff": _diff(y, want_y), "y_bound": y_bound,
                    "grad_diff": (_diff(x.grad, want_grad) if x.grad is not None else float("inf")) if needs_grad else 0.0,
                    "grad_bound": grad_bound, "needs_grad": needs_grad,
                    "input_changed": not torch.equal(x.detach(), before), "bytes": x.numel() * x.element_size()}
            out["cases"][case] = record
    except Exception as exc:  # noqa: BLE001 - a wrong answer is a result to report, not a crash of the run
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a is None or tuple(a.shape) != tuple(b.shape):
        return float("inf")
    return (a.detach().double() - b.detach().double()).abs().max().item()


def merge_f_g(merged: dict, per_rank: list[dict]) -> None:
    """The worst of the ranks' differences and changed inputs, into rank 0's record (in place)."""
    for case, record in merged.get("cases", {}).items():
        for op in record:
            mine = [r["cases"][case][op] for r in per_rank if case in r.get("cases", {})]
            record[op] = {**record[op], "y_diff": max(m["y_diff"] for m in mine),
                          "grad_diff": max(m["grad_diff"] for m in mine),
                          "input_changed": any(m["input_changed"] for m in mine),
                          "form": next((m["form"] for m in mine if m["form"]), None)}


def check_f_g(r: dict) -> None:
    where = f"f and g on {r['tp']} rank(s)"
    checks.check_true(r["error"] is None, f"{where}: raised {r['error']}", hint="the traceback names the line")
    for case, record in r["cases"].items():
        dtype, shape, noncontig, needs_grad = INPUTS[case]
        here = f"{where}, input {case} ({str(dtype).replace('torch.', '')} {tuple(shape)}" \
               f"{', non-contiguous' if noncontig else ''}{', requires_grad=False' if not needs_grad else ''})"
        for name, fwd, bwd, what in (("f", 0, 1, "identity forward, all-reduce of the gradient backward"),
                                     ("g", 1, 0, "all-reduce forward, identity backward")):
            rec = record[name]
            if r.get("rehearsal"):             # threads: the collectives are not counted, the rest is checked
                rec = {**rec, "forward": {"all_reduce": fwd}, "backward": {"all_reduce": bwd if needs_grad else 0}}
            bwd = bwd if needs_grad else 0
            checks.check_equal(list(rec["functional"]), [], f"{here}: {name}'s functional collectives (DTensor's, or "
                               f"torch.distributed._functional_collectives)",
                               hint="write f and g as autograd functions whose forward or backward calls "
                                    "torch.distributed's all_reduce; DTensor's own f and g are what exercises 2 and 3 "
                                    "run, not this answer")
            checks.check_true(rec["form"] is None, f"{here}: {rec['form']}",
                              hint="the exercise asks for two torch.autograd.Function subclasses, used by f and g")
            checks.check_equal((rec["forward"].get("all_reduce", 0), rec["backward"].get("all_reduce", 0)), (fwd, bwd),
                               f"{here}: {name}'s all-reduces (forward, backward); {name} is the {what}",
                               hint="f and g are conjugate: each communicates in one direction only")
            checks.check_equal(sum(rec["forward"].values()) + sum(rec["backward"].values()), fwd + bwd,
                               f"{here}: {name}'s collectives in all", hint="only all-reduces, one in all")
            checks.check_true(not rec["input_changed"], f"{here}: {name} changed its input tensor in place",
                              hint="all-reduce a copy; the input belongs to the caller (autograd saves it)")
            checks.check_equal((rec["dtype"], list(rec["shape"])), (rec["want_dtype"], list(rec["want_shape"])),
                               f"{here}: {name}(x)'s dtype and shape", hint="return a tensor like x: same dtype and shape")
            checks.check_true(rec["y_diff"] <= rec["y_bound"],
                              f"{here}: max |{name}(x_r) - expected| = {rec['y_diff']:.3g} > {rec['y_bound']:.3g} "
                              f"(f: x_r, g: the sum over ranks of x_r; the bound is gamma_(N+1) u sum_r |x_r|)",
                              hint="reduce over the group passed in (group=group), with the sum")
            checks.check_true(rec["grad_diff"] <= rec["grad_bound"],
                              f"{here}: max |x_r.grad - expected| = {rec['grad_diff']:.3g} > {rec['grad_bound']:.3g} "
                              f"(f: the sum of the ranks' upstream gradients, g: this rank's own)",
                              hint="backward returns one gradient per input of forward: (grad, None) for (x, group)")
