"""Lab 07's test cases, shared by the probes of its three exercises (``lablib.labs.zero_from_scratch.zero12`` for ZeRO-1 and ZeRO-2,
``lablib.labs.zero_from_scratch.zero3`` for ZeRO-3): the models, their batches, the optimizer's settings and the learning-rate
schedule the probe applies between steps, and how an error in a student's file is reported.
"""

from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass

import torch
import torch.nn as nn

from lablib.course import data

CLASSES = {"zero1": "ShardedOptimizer", "zero2": "ZeRO2", "zero3": "ZeRO3"}


class Stack(nn.Module):
    """d_in -> widths... -> 1, tanh between: a weight (big) and a bias (small) per layer, so assigning
    parameters round-robin by count puts the weights on some ranks and the biases on the others. ``order``: the
    forward runs the layers in that order (all of width d_in), not the order they were registered in, so their
    gradients become ready in the reverse of it."""

    def __init__(self, d_in: int, widths: tuple[int, ...], order: tuple[int, ...] = ()):
        super().__init__()
        dims = (d_in, *widths)
        if order and (sorted(order) != list(range(len(widths))) or set(widths) != {d_in}):
            raise ValueError(f"order {order} must be a permutation of the {len(widths)} layers, all of width d_in "
                             f"{d_in} (widths {widths})")
        self.order = tuple(order) or tuple(range(len(widths)))
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(dims[-1], 1)

    def forward(self, x):                      # x: (batch, d_in) -> (batch, 1)
        for i in self.order:
            x = torch.tanh(self.layers[i](x))
        return self.head(x)


@dataclass(frozen=True)
class Case:
    d_in: int
    widths: tuple[int, ...]
    groups: bool = False      # weights / biases in two groups with their own lr and weight decay
    late_head: int = -1       # >= 0: the head joins through add_param_group before this step
    dtype: str = "float32"    # the model's dtype, so the flat buffers' and the shards'
    micro_batches: int = 1    # backwards per optimizer step (gradient accumulation), each on a part of the batch
    frozen: tuple[int, ...] = ()   # layers that do not require gradients (not trained): (0,) the first, (1,) one
                                   # after a trained layer, whose backward still runs (its input's gradient)
    steps: int = 10           # optimizer steps (at most): the hidden cases' properties show in 3
    order: tuple[int, ...] = ()    # the order the forward runs the layers in (Stack's), when not registration order


CASES = {
    "mlp": Case(32, (32,) * 6),                                  # 6,369 parameters: odd, padding at N = 2 and 4
    "uneven": Case(16, (200, 3, 61, 7)),                         # sizes from 1 to 3,200; 4,689: padding at N = 2 and 4
    "groups": Case(16, (48, 48, 48, 48), groups=True, late_head=3),
    "float64": Case(12, (24, 5, 24), dtype="float64", steps=3),           # 606 parameters of 8 bytes: padding at N = 4
    "accum": Case(16, (24, 7, 24), micro_batches=2, steps=3),             # 800 parameters, two micro-batches per step
    "frozen": Case(16, (24, 9, 24), frozen=(0,), steps=3),                # 408 frozen, 490 trained
    "frozen_middle": Case(16, (24, 9, 24), frozen=(1,), steps=3),         # 225 frozen after 408 trained
}
LR, WEIGHT_DECAY = 1e-2, 0.1
LATE_GROUP = {"lr": LR / 2, "weight_decay": 0.05}
_SEEDED = threading.Lock()   # the rehearsal's ranks are threads sharing torch's global generator


def dtype_of(case: Case) -> torch.dtype:
    return getattr(torch, case.dtype)


def build(case: Case, seed: int) -> Stack:
    with _SEEDED:
        torch.manual_seed(seed)
        model = Stack(case.d_in, case.widths, case.order).to(dtype_of(case))
    for i in case.frozen:
        model.layers[i].requires_grad_(False)
    return model


def param_groups(model: Stack, case: Case) -> list[dict]:
    """The groups the optimizer is built with (the late head is left out; it is added later)."""
    body = [p for n, p in model.named_parameters() if not (case.late_head >= 0 and n.startswith("head"))]
    if not case.groups:
        return [{"params": body}]
    return [{"params": [p for p in body if p.dim() > 1]},                                   # weights: decayed
            {"params": [p for p in body if p.dim() == 1], "lr": 2 * LR, "weight_decay": 0.0}]  # biases: not


def lr_factor(step: int) -> float:
    """The probe's schedule: every group's lr is its own times this before each step (a schedule changes the
    outer optimizer's groups; an inner optimizer that never sees the change steps with the old lr)."""
    return 1.0 / (1 + step)


def batch(case: Case, step: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    x, y = data.regression_task(n, case.d_in, g)    # the course's synthetic task (labs 01, 03, 06)
    return x.to(dtype_of(case)), y.to(dtype_of(case))


def micro_batches(x, y, case: Case):
    """This rank's batch cut into case.micro_batches parts (one backward each before the step)."""
    return list(zip(x.chunk(case.micro_batches), y.chunk(case.micro_batches)))


def error_in_impl(exc: BaseException) -> str:
    """The exception in one line, with the line of the student's ``*_impl.py`` it came from (if any)."""
    mine = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.endswith("_impl.py")]
    where = f" (at {mine[-1].filename.rsplit('/', 1)[-1]} line {mine[-1].lineno}: {mine[-1].line})" if mine else ""
    return f"{type(exc).__name__}: {exc}{where}"
