"""Lab 07's hidden kinds for exercises 1 and 2 (instructor-only; the solution notebook's hidden cells call it).

The student's ``ShardedOptimizer`` or ``ZeRO2`` on two ranks that are threads of the notebook's process
(``lablib.probes.rehearsal``): built through ``HiddenCheck.call`` (the constructor leaves the caller's parameters as
they were), then driven three steps on the same object (``HiddenCheck.steps``), once from each state a training loop
may leave ``.grad`` in besides None (``HiddenCheck.gradient_starts``): zero tensors after
``zero_grad(set_to_none=False)``, and the sum of two backwards of the step's loss (as a loop accumulating over
micro-batches leaves it).
After every step each parameter, on every rank, must equal plain ``torch.optim.AdamW``'s bit for bit, stepped on the
gradient the loop left: rank 0's for ``ShardedOptimizer`` (every rank gets the same one, as in the probe), the mean
over the ranks for ``ZeRO2``. On 2 ranks that mean, (a + b) / 2, has one rounding in any order of adding (the sum of
two numbers is commutative, and the division by 2 is exact unless the result is subnormal, which these gradients,
7e-6 to 0.7 in magnitude where not 0, never are), so any correct reduce-scatter gives these bits, dividing before or
after the sum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lablib import checks
from lablib.labs.zero_from_scratch import cases
from lablib.probes import rehearsal

WORLD_SIZE = 2
PER_RANK = 4
# A frozen first layer (no .grad, never stepped) and 490 trained parameters: padding on 4 ranks, none on 2.
CASE = cases.CASES["frozen"]


def three_steps_from_each_gradient_start(hk, impl, exercise: str) -> bool:
    """For each gradient start, a new object of the student's class driven three steps on 2 thread ranks (see the
    module's docstring). False when the class binds a collective by name before the rehearsal (threads cannot stand in
    for it): the kinds are then stepped aside, and the torchrun runs decide."""
    try:
        for start in hk.gradient_starts():
            rehearsal.run_in_thread_ranks(WORLD_SIZE, lambda rank: _rank(hk, impl, exercise, start, rank))
    except rehearsal.RehearsalUnsupported:
        hk.stepped_aside(("inputs", "aliasing", "steps", "gradients"),
                         "a torch.distributed function bound by name cannot be rehearsed on thread ranks; the torchrun "
                         "runs of the same cases decide")
        return False
    return True


def _rank(hk, impl, exercise: str, start: str, rank: int) -> None:
    model, reference = cases.build(CASE, 0), cases.build(CASE, 0)
    kw = dict(lr=cases.LR, weight_decay=cases.WEIGHT_DECAY)
    if exercise == "zero1":
        student = hk.call(impl.ShardedOptimizer, list(model.parameters()), torch.optim.AdamW, **kw,
                          what="ShardedOptimizer(params, torch.optim.AdamW, ...)")
        clears = student        # the loop clears through the optimizer: opt.zero_grad(set_to_none=False)
    else:                       # the model is re-pointed at the flat buffer: its values must stay what they were
        student = hk.call(impl.ZeRO2, model, torch.optim.AdamW, **kw, what="ZeRO2(model, torch.optim.AdamW, ...)")
        clears = model          # the loop clears through the model: model.zero_grad(set_to_none=False)
    ref_opt = torch.optim.AdamW(reference.parameters(), **kw)
    trained = [p for p in model.parameters() if p.requires_grad]
    ref_trained = [q for q in reference.parameters() if q.requires_grad]

    def loss(step):
        x, y = cases.batch(CASE, step, WORLD_SIZE * PER_RANK, 0)
        if exercise == "zero2":                       # data parallel: this rank's share of the batch
            x, y = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
        return F.mse_loss(model(x), y)

    def step(i):
        if start == "accumulated":
            student.zero_grad()                       # the class's own, then two micro-batches' backwards
        try:
            hk.leave_gradients(clears, start, lambda: loss(i))
        except TypeError as exc:                      # e.g. zero_grad overridden without set_to_none
            checks.check_true(False, f"a training loop's {type(clears).__name__}.zero_grad(set_to_none=False) "
                              f"failed: {exc}", hint="ShardedOptimizer is a torch.optim.Optimizer: keep "
                              "zero_grad(set_to_none=True) as torch's (inherit it, or take and pass on set_to_none)")
        if start == "set_to_none=False":              # zero tensors from the loop, then this step's backward
            loss(i).backward()
        with torch.no_grad():                         # the gradient the loop left, as AdamW is to step on it
            flat = torch.cat([p.grad.flatten() for p in trained])
            if exercise == "zero1":
                dist.broadcast(flat, src=0)           # every rank the same gradient: rank 0's
                for p, g in zip(trained, flat.split([p.numel() for p in trained])):
                    p.grad = g.view_as(p).clone()
            else:
                dist.all_reduce(flat)
                flat.div_(WORLD_SIZE)                 # the mean: one rounding on 2 ranks, whatever the order
            for q, g in zip(ref_trained, flat.split([q.numel() for q in ref_trained])):
                q.grad = g.view_as(q).clone()
        student.step()
        ref_opt.step()
        return [p.detach().clone() for p in model.parameters()]

    def same_as_adamw(i, params):
        differ = [n for (n, q), p in zip(reference.named_parameters(), params) if not torch.equal(p, q.detach())]
        checks.check_equal(differ, [], f"{cases.CLASSES[exercise]} on {WORLD_SIZE} ranks, rank {rank}, the loop's "
                           f"gradients left as {start!r} would leave them: parameters not bit-for-bit equal to "
                           f"AdamW's stepped on the same gradient",
                           hint="step on whatever .grad holds when step() is called (zeros after "
                                "zero_grad(set_to_none=False), the sum of several backwards), and keep nothing from "
                                "one step to the next but the optimizer's state")

    hk.steps(step, same_as_adamw)
