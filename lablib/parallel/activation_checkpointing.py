"""Activation checkpointing, applied to a plain model from outside (the model knows nothing about it).

A checkpointed block keeps only its input for the backward pass; its inner activations (attention
scores, the 4 x n_embd MLP hidden layer, LayerNorm outputs) are recomputed when the backward reaches
it: about one extra forward of the block, in exchange for its saved activations
(Chen et al., 2016, "Training Deep Nets with Sublinear Memory Cost", arXiv:1604.06174).
Non-reentrant ``torch.utils.checkpoint`` (``use_reentrant=False``) is the variant PyTorch recommends, and
the one that composes with FSDP2 (https://pytorch.org/docs/stable/checkpoint.html).
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint


class CheckpointedBlock(torch.nn.Module):
    """Wraps one block: its forward runs under torch.utils.checkpoint (x: (B, T, n_embd) in and out)."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def apply_activation_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    """Wrap every transformer block of a GPT (``model.h``) in place; apply it before FSDP2, as torchtitan does."""
    for i, block in enumerate(model.h):
        if not isinstance(block, CheckpointedBlock):
            model.h[i] = CheckpointedBlock(block)
    return model
