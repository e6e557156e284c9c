"""Lab 07's ZeRO-3 cases (``lablib.labs.zero_from_scratch.zero3``): the models cut into units (the course GPT's blocks, the stacks'
layers; whatever is left is the root's), each rank's batch, the loss, and FSDP2 trained on the same batches from
the same weights (``fully_shard`` on every block, then the root, FSDP2's defaults otherwise).
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lablib.course.models import GPT, GPTConfig
from lablib.labs.zero_from_scratch.cases import CASES as STACK_CASES, LR, WEIGHT_DECAY, Case, batch, build

GPT_CASE = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)   # 28,576 parameters; padding at N = 3
CASES = ("mlp", "uneven", "gpt", "float64", "accum", "frozen", "frozen_middle")   # "gpt": the course GPT; the others: cases.CASES
# Mixed precision: "case@param" or "case@param/reduce" (e.g. "mlp@bf16", "gpt@fp16/fp32"): ZeRO3 is built with
# param_dtype (and reduce_dtype; FSDP2's default: param_dtype) over the case's fp32 parameters.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# "order3102": a stack of 16-wide layers whose forward runs them in the order given (3, 1, 0, 2), not the order they
# were registered (and handed to ZeRO3) in: the units' gradients become ready in neither that order nor its reverse.
ORDERED = "order"
_SEEDED = threading.Lock()           # the rehearsal's ranks are threads sharing torch's global generator


def parse_case(case: str) -> tuple[str, torch.dtype | None, torch.dtype | None]:
    """(the model's case, param_dtype, reduce_dtype) of "case", "case@param" or "case@param/reduce"; None: not given.
    An unknown name is an error that lists the known ones."""
    base, _, dtypes = case.partition("@")
    names = dtypes.split("/") if dtypes else []
    if (base not in CASES and _ordered(base) is None) or len(names) > 2 or any(n not in DTYPES for n in names):
        raise ValueError(f"case {case!r}: expected one of {CASES} or '{ORDERED}' and a permutation of 0..k-1 "
                         f"(e.g. '{ORDERED}3102'), optionally followed by '@param' or '@param/reduce' with dtypes "
                         f"from {sorted(DTYPES)} (e.g. 'mlp@bf16/fp32')")
    param = DTYPES[names[0]] if names else None
    return base, param, (DTYPES[names[1]] if len(names) == 2 else None)


def _ordered(case: str) -> Case | None:
    """The stack of an "order..." case (None for any other name): 16-wide layers run in the order its digits give."""
    digits = case[len(ORDERED):] if case.startswith(ORDERED) else ""
    order = tuple(int(c) for c in digits if c.isdigit())
    if not digits or len(order) != len(digits) or sorted(order) != list(range(len(order))):
        return None
    return Case(16, (16,) * len(order), order=order, steps=3)


def stack_case(case: str) -> Case | None:
    """The stack behind a case name (None for the GPT)."""
    return STACK_CASES.get(case) or _ordered(case)


def build_case(case: str, seed: int):
    """(model, blocks): the same initial weights on every rank. A block is a unit of ZeRO-3; the model's other
    parameters (GPT: embeddings, final norm, tied head; the stack: its head) are the root's."""
    if case == "gpt":
        with _SEEDED:
            torch.manual_seed(seed)
            model = GPT(GPT_CASE)
        return model, list(model.h)
    model = build(stack_case(case), seed)
    return model, list(model.layers)        # in registration order, whatever order the forward runs them in


def my_batch(case: str, step: int, rank: int, world_size: int, per_rank: int, seed: int):
    """This rank's rows of the step's global batch (world_size * per_rank samples)."""
    if case == "gpt":   # random tokens: the losses are compared, not learned (and no text to load on every rank)
        g = torch.Generator().manual_seed(seed * 1000 + step)
        tokens = torch.randint(GPT_CASE.vocab_size, (world_size * per_rank, GPT_CASE.block_size + 1), generator=g)
        mine = tokens[rank * per_rank:(rank + 1) * per_rank]
        return mine[:, :-1], mine[:, 1:]                      # (per_rank, block_size): inputs, next tokens
    x, y = batch(stack_case(case), step, world_size * per_rank, seed)   # the course's regression task
    return x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]


def loss_of(model, case: str, x, y) -> torch.Tensor:
    """The loss in the dtype the model computes in (a regression target is cast to the output's dtype)."""
    if case == "gpt":
        return model(x, y)[1]
    out = model(x)
    return F.mse_loss(out, y.to(out.dtype))


def mean_over_ranks(value: float, world_size: int, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)   # on the rank's device: NCCL needs it there
    if world_size > 1:
        dist.all_reduce(t)
    return t.item() / world_size


def fsdp2_losses(case: str, env, group, steps: int, per_rank: int, seed: int) -> list[float]:
    """FSDP2 (``fully_shard`` on every block, then the root) on the same batches from the same weights."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    device = env.device.type
    mesh = DeviceMesh.from_group(group, device) if group is not None else init_device_mesh(device, (world_size,))
    model, blocks = build_case(case, seed)
    model.to(env.device)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(steps):
        x, y = my_batch(case, step, rank, world_size, per_rank, seed)
        opt.zero_grad()
        loss = loss_of(model, case, x.to(env.device), y.to(env.device))
        loss.backward()
        opt.step()
        t = loss.detach().double().reshape(1)
        dist.all_reduce(t, group=group)
        losses.append(t.item() / world_size)
    return losses
