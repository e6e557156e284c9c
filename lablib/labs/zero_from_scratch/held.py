"""What a rank holds under lab 07's exercises, counted from storages (``lablib.measure.memory.StorageCounter``: each
storage once, views included in their base): ``held_bytes`` walks everything reachable from the student's object
(attributes, lists, dicts, inner optimizers and their state, ``.grad`` of every tensor found), so a copy of the state
kept anywhere counts, whatever it is named. ``gather_shards`` brings every rank's shard together with the probe's
own all-gather (never the student's).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn as nn

from lablib.measure.memory import StorageCounter


def reachable_tensors(obj, depth: int = 8):
    """Every tensor reachable from obj, as (tensor, is_a_grad): through attributes, dicts (keys and values),
    lists, tuples, sets, optimizers' state and param_groups, and the ``.grad`` of every tensor found."""
    seen: set[int] = set()
    stack = [(obj, depth, False)]
    while stack:
        x, d, is_grad = stack.pop()
        if x is None or id(x) in seen or d < 0:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            yield x, is_grad
            if x.grad is not None:
                stack.append((x.grad, d, True))
        elif isinstance(x, dict):
            stack.extend((v, d - 1, False) for kv in x.items() for v in kv)
        elif isinstance(x, (list, tuple, set, frozenset)):
            stack.extend((v, d - 1, False) for v in x)
        elif isinstance(x, (types.ModuleType, types.FunctionType, types.MethodType, type, str, bytes, int, float)):
            continue
        elif hasattr(x, "__dict__"):
            stack.extend((v, d - 1, False) for v in vars(x).values())


def held_bytes(model: nn.Module, obj, shards=()) -> dict:
    """Bytes this rank holds: the model's parameters (their storages: a flat buffer they are views of counts
    whole, padding included; a freed one, resized to 0, counts nothing) and ``shards`` (ZeRO-3's parameters at
    rest), the gradients (any ``.grad`` reachable from the model or from obj) and everything else reachable from
    obj (the optimizer state, wherever kept). Each storage once."""
    counter = StorageCounter()
    params = list(model.parameters())
    out = {"params": counter.add([*params, *shards])}
    found = list(reachable_tensors(obj))
    out["grads"] = counter.add([p.grad for p in params] + [t for t, is_grad in found if is_grad])
    out["optimizer"] = counter.add(t for t, is_grad in found if not is_grad)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def gather_shards(shard: torch.Tensor | None, world_size: int, numel: int) -> torch.Tensor:
    """Every rank's shard (S,), gathered by the probe (not by the student's code) into (N * S,) and cut to the first
    numel elements; NaN when this rank has no shard tensor (e.g. a gradient that was never set)."""
    if shard is None:
        return torch.full((numel,), float("nan"), dtype=torch.float64)
    shard = shard.detach().contiguous()
    out = torch.empty(world_size * shard.numel(), dtype=shard.dtype, device=shard.device)
    if world_size > 1:
        dist.all_gather_into_tensor(out, shard)
    else:
        out.copy_(shard)
    return out[:numel]


def adamw_state_bytes(params) -> int:
    """AdamW's state for these parameters: exp_avg and exp_avg_sq (their dtype and size) and a step each (a float32
    tensor of 4 bytes: torch/optim/adam.py creates it with ``_get_scalar_dtype()``, the default dtype)."""
    return sum(2 * p.numel() * p.element_size() + 4 for p in params)
