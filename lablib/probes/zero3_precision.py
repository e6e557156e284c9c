"""Lab 07, section 4b's measurements of mixed precision (not graded): the student's ``ZeRO3`` trained in fp32, bf16
and fp16 over the same steps, and what an fp16 backward does to small gradients, with and without loss scaling.

Everything runs on ranks that are threads of the notebook's process (``zero_comm.run_in_thread_ranks``): seconds,
no torchrun start. The model is ``zero3_cases``' course GPT (2 blocks of width 32) on Tiny Shakespeare's characters;
every rank trains on its own rows of the same global batches.

``loss_curves``: per policy (param_dtype, reduce_dtype) the mean loss over the ranks at every step, and the
fraction of the local gradient's elements (as the ranks' backward left them in ``p.grad``, before the
reduce-scatter) that are exactly zero where the fp32 run's gradient of the same step is not.

``underflow``: one backward of the GPT, in fp32 and in fp16 from the same weights (one process, no ZeRO): how many
gradient elements of the fp32 backward are nonzero but come out 0 in fp16, without loss scaling and with
``torch.amp.GradScaler``'s initial scale (2^16), and how many are below fp16's smallest positive number.
"""

from __future__ import annotations

import warnings

import torch

from lablib.probes.zero3_cases import GPT_CASE, build_case
from lablib.probes.zero_cases import LR, WEIGHT_DECAY
from lablib.probes.zero_comm import run_in_thread_ranks

# name -> (param_dtype, reduce_dtype, loss scaling with torch.amp.GradScaler)
POLICIES = {"fp32": (None, None, False), "bf16 (fp32 reduce)": (torch.bfloat16, torch.float32, False),
            "fp16 (fp32 reduce)": (torch.float16, torch.float32, False),
            "fp16 (fp32 reduce) + GradScaler": (torch.float16, torch.float32, True)}


def shakespeare_batches(steps: int, global_batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of (inputs, next tokens), each (global_batch, block_size), of Tiny Shakespeare."""
    from lablib.course.data import shakespeare_datasets

    _, train, _ = shakespeare_datasets(GPT_CASE.block_size)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    out = []
    for s in range(steps):
        rows = [train[int(i)] for i in order[s * global_batch:(s + 1) * global_batch]]
        out.append((torch.stack([x for x, _ in rows]), torch.stack([y for _, y in rows])))
    return out


def loss_curves(impl, steps: int = 20, world_size: int = 2, per_rank: int = 4, policies=None, seed: int = 0) -> dict:
    """{policy: {"losses": [mean loss per step], "zero_grad_fraction": [per step]}} for the student's ZeRO3."""
    policies = policies or POLICIES
    batches = shakespeare_batches(steps, world_size * per_rank, seed)
    fp32_nonzero: dict[int, list[torch.Tensor]] = {}         # rank -> per step, the fp32 run's nonzero elements
    out = {}
    for name, (param_dtype, reduce_dtype, scaled) in policies.items():
        def train(rank, param_dtype=param_dtype, reduce_dtype=reduce_dtype, scaled=scaled):
            model, blocks = build_case("gpt", seed)
            mixed = {"param_dtype": param_dtype, "reduce_dtype": reduce_dtype} if param_dtype else {}
            student = impl.ZeRO3(model, blocks, torch.optim.AdamW, **mixed, lr=LR, weight_decay=WEIGHT_DECAY)
            # GradScaler multiplies the loss by its scale (2^16 at first) before the backward, and divides the fp32
            # shard gradients by it before the step (skipping a step whose gradients overflowed, halving the scale)
            scaler = torch.amp.GradScaler("cpu") if scaled else None
            grads: list[torch.Tensor] = []
            hooks = [p.register_hook(lambda g: grads.append(g.detach().flatten())) for p in model.parameters()]
            losses, zeros = [], []
            for x, y in batches:
                grads.clear()
                student.zero_grad()
                _, loss = model(x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank])
                if scaler is None:
                    loss.backward()
                    student.step()
                else:           # the inner optimizer steps the fp32 shards: GradScaler unscales their gradients
                    scaler.scale(loss).backward()
                    scaler.step(student.optimizer)
                    scaler.update()
                losses.append(loss.item())
                nonzero = torch.cat(grads) != 0
                if param_dtype is None:
                    fp32_nonzero.setdefault(rank, []).append(nonzero)
                    zeros.append(0.0)
                else:          # the same step's fp32 gradient was nonzero, this one is exactly 0
                    ref = fp32_nonzero[rank][len(losses) - 1]
                    zeros.append(((~nonzero) & ref).sum().item() / max(1, ref.sum().item()))
            for h in hooks:
                h.remove()
            return losses, zeros

        with warnings.catch_warnings():      # the threads share the filters: set once, around all of them
            warnings.simplefilter("ignore", FutureWarning)          # torch 2.13's new names for the collectives
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            per_rank_results = run_in_thread_ranks(world_size, train)
        out[name] = {"losses": [sum(r[0][s] for r in per_rank_results) / world_size for s in range(steps)],
                     "zero_grad_fraction": [max(r[1][s] for r in per_rank_results) for s in range(steps)]}
    return out


def _grads(dtype, factor: float, x, y, seed: int) -> torch.Tensor:
    """The GPT's gradient, flat, of factor x its loss, computed in dtype, then divided by factor in fp32."""
    model, _ = build_case("gpt", seed)
    model.to(dtype)
    _, loss = model(x, y)
    (loss * factor).backward()
    return torch.cat([p.grad.flatten().float() / factor for p in model.parameters()])


def underflow(seed: int = 0, batch: int = 8, scale: float = 2.0 ** 16) -> dict:
    """One backward of the GPT from the same weights in fp32 and in fp16, without and with loss scaling as
    ``torch.amp.GradScaler`` does it: the loss times ``scale`` (its initial 2^16), halved while any gradient is not
    finite (GradScaler skips that step and multiplies the scale by its backoff factor, 0.5): counts of gradient
    elements (see the module docstring)."""
    x, y = shakespeare_batches(1, batch, seed)[0]
    grads = {"fp32": _grads(torch.float32, 1.0, x, y, seed), "fp16": _grads(torch.float16, 1.0, x, y, seed)}
    skipped = 0
    while True:
        grads["fp16, scaled"] = _grads(torch.float16, scale, x, y, seed)
        if bool(grads["fp16, scaled"].isfinite().all()) or scale < 1:
            break
        scale, skipped = scale / 2, skipped + 1
    ref = grads["fp32"]
    tiny = torch.finfo(torch.float16).smallest_normal * 2.0 ** -10     # 2^-24, fp16's smallest subnormal
    return {"elements": ref.numel(), "nonzero_fp32": int((ref != 0).sum()),
            "below_fp16_smallest": int(((ref != 0) & (ref.abs() < tiny)).sum()),
            "below_fp16_normal": int(((ref != 0) & (ref.abs() < torch.finfo(torch.float16).smallest_normal)).sum()),
            "zero_in_fp16": int(((ref != 0) & (grads["fp16"] == 0)).sum()),
            "zero_in_fp16_scaled": int(((ref != 0) & (grads["fp16, scaled"] == 0)).sum()),
            "not_finite_in_fp16_scaled": int((~grads["fp16, scaled"].isfinite()).sum()), "skipped_steps": skipped,
            "scale": scale}

