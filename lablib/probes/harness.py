"""What a probe wraps around a student's code on the ranks, shared by labs 06-09: a sub-group standing in as the
default process group, and plain SGD (the same arithmetic as ``torch.optim.SGD`` without momentum)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed.distributed_c10d as c10d
import torch.nn as nn


@contextlib.contextmanager
def default_group(group):
    """Let ``group`` stand in as the default process group (None: leave it). Code that calls collectives
    without a group argument then runs on group's ranks; its ranks are 0..n-1, so ranks agree."""
    if group is None:
        yield
        return
    world = c10d._world
    saved = world.default_pg
    world.default_pg = group
    try:
        yield
    finally:
        world.default_pg = saved


def zero_grad_(params) -> None:
    for p in params:
        p.grad = None


LR = 0.1   # the probes' SGD learning rate (the student's model and the reference alike)


def sgd_step_(params, lr: float = LR) -> None:
    """Plain SGD, p <- p - lr * grad, the same arithmetic as torch.optim.SGD without momentum. Not torch.optim
    itself: its first use imports torch._dynamo, seconds of CPU in every rank of every graded run."""
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)


def unique_trainable(model: nn.Module) -> list[torch.nn.Parameter]:
    """Trainable parameters, each once (a tied weight is one parameter), in registration order."""
    return [p for p in model.parameters() if p.requires_grad]
