"""Count the collectives a training step really issues, instead of trusting a diagram.

DDP all-reduces gradients bucket by bucket through a *communication hook*; wrapping PyTorch's default
hook (``allreduce_hook``) lets us count calls and bytes without changing what is sent.
See https://pytorch.org/docs/stable/ddp_comm_hooks.html.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


@dataclass
class CommCounter:
    calls: int = 0
    bytes: int = 0

    def reset(self) -> None:
        self.calls = 0
        self.bytes = 0


def count_ddp_allreduces(ddp_model: torch.nn.parallel.DistributedDataParallel) -> CommCounter:
    """Register a hook on a DDP model that counts its gradient all-reduces (one per bucket per sync)."""
    counter = CommCounter()

    def counting_allreduce(process_group, bucket):
        counter.calls += 1
        counter.bytes += bucket.buffer().numel() * bucket.buffer().element_size()
        return default_hooks.allreduce_hook(process_group, bucket)

    # The hook's state is the group DDP reduces over, so a DDP model on a sub-group keeps using it.
    ddp_model.register_comm_hook(state=ddp_model.process_group, hook=counting_allreduce)
    return counter
