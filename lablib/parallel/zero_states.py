"""The model-state setups labs 04 and 07 count: lab 04's GPT, batches and AdamW settings, DDP with and without
ZeroRedundancyOptimizer, FSDP2 on every layer, and what the formula for bytes per rank leaves out.

Both run scripts (``lablib.labs.zero_memory.run``, lab 04; ``lablib.labs.zero_from_scratch.run_zero_stages``, lab 07) build their PyTorch
variants here, so they train the same model on the same batches from the same weights, and neither imports the
other (a run script is a leaf).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from lablib.course import data
from lablib.course.models import GPT, GPTConfig, gpt_config

VARIANTS = ("ddp", "zero1", "fsdp_grad_op", "fsdp_full", "fsdp_grad_op_bf16")   # lab 04's run
ADAM_STEP_BYTES = 4     # AdamW keeps each parameter tensor's step count in a float32 tensor of its own


@dataclass(frozen=True)
class Config:
    variants: tuple[str, ...] = VARIANTS[:4]
    steps: int = 4                 # optimizer steps per variant; memory is counted in the last one
    global_batch: int = 8          # sequences per step over all ranks (the same for every world size)
    # Small, and with 4 layers: ZeroRedundancyOptimizer hands out whole tensors, and 52 tensors of at most
    # 16 K elements split over 4 ranks within 0.5 %; 2 layers of width 128 would be 2 % off at N = 4.
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.1
    seed: int = 0

    def validate(self) -> None:
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or not self.variants:
            raise ValueError(f"variants={self.variants!r}: unknown {unknown}; choose from {', '.join(VARIANTS)}")
        if self.steps < 2:
            raise ValueError(f"steps={self.steps}: need at least 2, the optimizer state exists from the first step on")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")

    def validate_world(self, world_size: int) -> None:
        if self.global_batch % world_size:
            raise ValueError(f"global_batch={self.global_batch} does not split over {world_size} ranks; "
                             f"use a multiple of {world_size}")

    def gpt(self) -> GPTConfig:
        return gpt_config(self)


def batches(config: Config, rank: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (x, y) for each step: rows rank*b .. (rank+1)*b of the same global batch, b = G / N."""
    _, dataset, _ = data.shakespeare_datasets(config.block_size)
    per_rank = config.global_batch // world_size
    out = []
    for step in range(config.steps):
        rows = [dataset[step * config.global_batch + rank * per_rank + i] for i in range(per_rank)]
        out.append((torch.stack([x for x, _ in rows]), torch.stack([y for _, y in rows])))
    return out


def apply_ddp(model: torch.nn.Module, config: Config, zero1: bool):
    # gradient_as_bucket_view: the gradients *are* DDP's communication buckets, so the gradient storages
    # counted are all the gradient memory DDP holds (by default it keeps a second copy in its buckets).
    ddp = DDP(model, gradient_as_bucket_view=True)
    if zero1:
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=config.lr,
                                      weight_decay=config.weight_decay)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    return ddp, opt


def layers_with_weights(model: GPT) -> list[torch.nn.Module]:
    """Every Linear and LayerNorm inside the transformer blocks: the modules that own parameters directly."""
    return [m for block in model.h for m in block.modules() if any(True for _ in m.parameters(recurse=False))]


def shard_every_layer(model: GPT, reshard_after_forward: bool, param_dtype: torch.dtype | None = None,
                      reduce_dtype: torch.dtype | None = None) -> GPT:
    """Shard the model states for the memory count: each weight-holding layer of the blocks is its own FSDP2
    unit (the finest grain FSDP2 allows; the bytes held per parameter do not depend on the grouping, only the
    number of collectives does), and whatever is left (embeddings, the tied lm_head, ln_f) goes to the root.

    reshard_after_forward=False keeps every layer's gathered weights from its forward to its backward
    (ZeRO-2-like); True frees them after the forward (ZeRO-3). param_dtype=bf16 computes with bf16 copies of
    the gathered weights while the fp32 shards stay the master copy; reduce_dtype None reduces the gradients in
    param_dtype (MixedPrecisionPolicy's default: torch/distributed/fsdp/_fully_shard/_fsdp_api.py), float32 reduces
    them in float32 (lab 07's bf16 variant).
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in layers_with_weights(model) + [model]:   # inner units first: the root must come last
        fully_shard(layer, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    return model


def held_params(model: torch.nn.Module, sharded: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters a rank holds now: FSDP2's sharded ones (always) plus whatever its modules currently
    expose (for FSDP2, the unsharded parameters of every group that is not resharded; for DDP, all)."""
    return sharded + [p for p in model.parameters() if not hasattr(p, "to_local")]


def fsdp_rows_per_rank(d0: int, world_size: int) -> list[int]:
    """The rows of a parameter's dim 0 (d0 of them) each rank holds under FSDP2: chunks of ceil(d0 / N) rows
    (``torch.chunk``), rank r the r-th, none once the rows run out (the storages are padded, the shards are not)."""
    chunk = -(-d0 // world_size)
    return [max(0, min(chunk, d0 - r * chunk)) for r in range(world_size)]


def formula_slack_bytes(param_shapes: list[list[int]], world_size: int) -> dict[str, float]:
    """Bytes the fullest rank may hold above lab 04's fp32 + AdamW formula (4 + 4 + 8 bytes per parameter, each
    divided by N from the stage that shards it), per variant of this run. What the formula leaves out:

    - AdamW's step counter, 4 bytes per parameter tensor, kept with the state (every tensor's on every rank for
      DDP and FSDP2; at most all of them on ZeRO-1's fullest rank);
    - ZeRO-1 (``ZeroRedundancyOptimizer``) gives whole parameters to ranks, each to the least loaded so far, so
      its fullest rank holds at most one parameter's state (8 bytes per element, the largest) above 8 Phi / N;
    - FSDP2 shards dim 0 in ceil(d0 / N) rows (rank 0 holds that many of a parameter's d0 rows, the last rank
      fewer), in the parameters, the gradients and the state alike, and gathers a parameter padded to
      N ceil(d0 / N) rows, which ``fsdp_grad_op`` keeps from the forward to the backward.

    The measured fullest rank lies between the formula and the formula plus this (exact bytes, no rounding).
    """
    n = world_size
    counters = ADAM_STEP_BYTES * len(param_shapes)
    # padding rows of the gathered parameters, in elements: N ceil(d0/N) - d0 rows of prod(rest) elements each;
    # rank 0's shard exceeds the exact share d0/N by 1/N of that
    padding = sum((-(-shape[0] // n) * n - shape[0]) * math.prod(shape[1:]) for shape in param_shapes)
    largest = max(math.prod(shape) for shape in param_shapes)
    return {"ddp": counters, "zero1": counters + 8 * largest,
            "fsdp_grad_op": counters + 4 * padding + (4 + 8) * padding / n,
            "fsdp_full": counters + (4 + 4 + 8) * padding / n}
