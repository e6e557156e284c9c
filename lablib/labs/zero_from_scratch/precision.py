"""Lab 07, section 4b's measurements of mixed precision (not graded): the student's ``ZeRO3`` trained in fp32, bf16
and fp16 over the same steps, and what an fp16 backward does to small gradients, with and without loss scaling.

Everything runs on ranks that are threads of the notebook's process (``comm.run_in_thread_ranks``): seconds,
no torchrun start. The model is ``zero3_cases``' course GPT (2 blocks of width 32) on Tiny Shakespeare's characters;
every rank trains on its own rows of the same global batches.

``loss_curves``: per policy (param_dtype, reduce_dtype) the mean loss over the ranks at every step. The loss is
the cross entropy of the logits cast to fp32 (as ``torch.autocast`` computes it): the printed losses are fp32
numbers, and a loss scale of 2^16 multiplies an fp32 seed gradient, which reaches the fp16 logits divided by the
batch's B * T. With loss scaling the scaler is ``ShardedGradScaler``: each rank checks only its own shards'
gradients for inf/NaN (torch/amp/grad_scaler.py:246-300 has no collective), so the ranks' answers are combined
by an all-reduce (fsdp/sharded_grad_scaler.py:275-281) before any rank decides to step or to skip.

``fp16_zeros_per_step``: along one fp16 run (one process, fp32 master weights), at every step the fp16 backward
and an fp32 backward from the same weights (the master, and the master cast to fp16): the share of the fp32
gradient's nonzero elements that come out exactly 0 in fp16.

``underflow``: one backward of the GPT, in fp32 and in fp16 from the same weights (one process, no ZeRO): how many
gradient elements of the fp32 backward are nonzero but come out 0 in fp16, without loss scaling and with
``torch.amp.GradScaler``'s initial scale (2^16, on an fp32 loss), and how many are below fp16's smallest positive
number.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from lablib.labs.zero_from_scratch.zero3_cases import GPT_CASE, build_case
from lablib.labs.zero_from_scratch.cases import LR, WEIGHT_DECAY
from lablib.labs.zero_from_scratch.comm import run_in_thread_ranks

# name -> (param_dtype, reduce_dtype, loss scaling with ShardedGradScaler)
POLICIES = {"fp32": (None, None, False), "bf16 (fp32 reduce)": (torch.bfloat16, torch.float32, False),
            "fp16 (fp32 reduce)": (torch.float16, torch.float32, False),
            "fp16 (fp32 reduce) + ShardedGradScaler": (torch.float16, torch.float32, True)}


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


def fp32_loss(model, x, y) -> torch.Tensor:
    """The GPT's mean cross entropy computed in fp32 from its logits, whatever dtype they are in (as autocast runs
    cross_entropy in fp32): x, y (B, T) -> a 0-dim fp32 tensor."""
    logits, _ = model(x)                                       # (B, T, vocab_size) in the compute dtype
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))


def loss_curves(impl, steps: int = 20, world_size: int = 2, per_rank: int = 4, policies=None, seed: int = 0,
                lr: float = LR) -> dict:
    """{policy: {"losses": [mean fp32 loss over the ranks per step], "skipped": steps the scaler skipped}} for the
    student's ZeRO3."""
    policies = policies or POLICIES
    batches = shakespeare_batches(steps, world_size * per_rank, seed)
    out = {}
    for name, (param_dtype, reduce_dtype, scaled) in policies.items():
        def train(rank, param_dtype=param_dtype, reduce_dtype=reduce_dtype, scaled=scaled):
            model, blocks = build_case("gpt", seed)
            mixed = {"param_dtype": param_dtype, "reduce_dtype": reduce_dtype} if param_dtype else {}
            student = impl.ZeRO3(model, blocks, torch.optim.AdamW, **mixed, lr=lr, weight_decay=WEIGHT_DECAY)
            # The scaler multiplies the loss by its scale (2^16 at first) before the backward and divides the fp32
            # shard gradients by it before the step; a plain GradScaler would decide from this rank's shards alone
            # whether to skip the step, so one rank could step while another skips and halves its scale (their
            # scales then differ, and so do the terms of the next sum over ranks). ShardedGradScaler all-reduces
            # found_inf over process_group first (SUM of 0/1 flags: > 0 on every rank if any rank overflowed).
            # On the thread ranks here torch.distributed.all_reduce is the rehearsal's, which ignores the group.
            scaler = ShardedGradScaler("cpu", process_group=None) if scaled else None
            losses, skipped = [], 0
            for x, y in batches:
                student.zero_grad()
                loss = fp32_loss(model, x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank])
                if scaler is None:
                    loss.backward()
                    student.step()
                else:           # the inner optimizer steps the fp32 shards: the scaler unscales their gradients
                    scaler.scale(loss).backward()
                    before = scaler.get_scale()
                    scaler.step(student.optimizer)
                    scaler.update()
                    skipped += scaler.get_scale() < before
                losses.append(loss.item())
            return losses, skipped

        with warnings.catch_warnings():      # the threads share the filters: set once, around all of them
            warnings.simplefilter("ignore", FutureWarning)          # torch 2.13's new names for the collectives
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            per_rank_results = run_in_thread_ranks(world_size, train)
        skipped = {r[1] for r in per_rank_results}
        if len(skipped) != 1:                # the all-reduced found_inf makes every rank skip the same steps
            raise RuntimeError(f"{name}: the ranks skipped different numbers of steps: {sorted(skipped)}")
        out[name] = {"losses": [sum(r[0][s] for r in per_rank_results) / world_size for s in range(steps)],
                     "skipped": skipped.pop()}
    return out


def fp16_zeros_per_step(steps: int = 20, per_rank: int = 4, seed: int = 0, lr: float = LR,
                        measured: tuple[int, ...] = (0, 4, 9, 14, 19)) -> dict[int, float]:
    """One process trains fp16 with fp32 master weights (no scaling, AdamW on the fp32 master) for ``steps``; at each
    step of ``measured``, {step: the share of the fp32 backward's nonzero gradient elements, from the same master
    weights, that the fp16 backward (the master cast to fp16) gives as exactly 0}."""
    if not all(0 <= s < steps for s in measured):
        raise ValueError(f"measured steps {measured} must lie in [0, {steps})")
    master, _ = build_case("gpt", seed)
    half, _ = build_case("gpt", seed)
    half.to(torch.float16)
    opt = torch.optim.AdamW(master.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
    out = {}
    for step, (x, y) in enumerate(shakespeare_batches(steps, per_rank, seed)):
        with torch.no_grad():                  # this step's weights: the fp32 master cast to fp16
            for p, q in zip(master.parameters(), half.parameters()):
                q.copy_(p)
                q.grad = None
        fp32_loss(half, x, y).backward()
        if step in measured:
            master.zero_grad()
            fp32_loss(master, x, y).backward()
            ref = torch.cat([p.grad.flatten() for p in master.parameters()])
            got = torch.cat([q.grad.flatten() for q in half.parameters()])
            out[step] = ((ref != 0) & (got == 0)).sum().item() / max(1, (ref != 0).sum().item())
        with torch.no_grad():                  # the fp16 run's update: its gradients, cast to the master's fp32
            for p, q in zip(master.parameters(), half.parameters()):
                p.grad = q.grad.float()
        opt.step()
    return out


def _grads(dtype, factor: float, x, y, seed: int) -> torch.Tensor:
    """The GPT's gradient, flat, of factor x its loss, computed in dtype, then divided by factor in fp32."""
    model, _ = build_case("gpt", seed)
    model.to(dtype)
    (fp32_loss(model, x, y) * factor).backward()      # the seed gradient is fp32; the logits' is divided by B * T
    return torch.cat([p.grad.flatten().float() / factor for p in model.parameters()])


def underflow(seed: int = 0, batch: int = 8, scale: float = 2.0 ** 16) -> dict:
    """One backward of the GPT from the same weights in fp32 and in fp16 (the loss in fp32 from the logits), without
    and with loss scaling as ``torch.amp.GradScaler`` does it: the loss times ``scale`` (its initial 2^16), halved
    while any gradient is not finite (GradScaler skips that step and multiplies the scale by its backoff factor, 0.5): counts of gradient
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

