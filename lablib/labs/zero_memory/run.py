"""Lab 04's distributed step: what each rank really holds under DDP, ZeRO-1, ZeRO-2 and ZeRO-3.

    torchrun --standalone --nproc-per-node 2 -m lablib.labs.zero_memory.run --out zero_memory.json

Trains the course GPT a few AdamW steps on Tiny Shakespeare four times, from the same initial weights on
the same batches, each time with the model states kept differently:

- ``ddp``            DistributedDataParallel + AdamW: everything replicated (the baseline);
- ``zero1``          DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer``: optimizer state sharded;
- ``fsdp_grad_op``   FSDP2 ``fully_shard(reshard_after_forward=False)`` on every layer: gradients and optimizer
                     state sharded, parameters kept whole from the forward to the backward (ZeRO-2-like);
- ``fsdp_full``      FSDP2 ``fully_shard`` (reshard_after_forward=True) on every layer: everything sharded (ZeRO-3);
- ``fsdp_grad_op_bf16`` (only when asked for) ``fsdp_grad_op`` with ``MixedPrecisionPolicy(param_dtype=bf16)``:
                     where the mixed-precision recipe's 2-byte weights show up.

In the last step each rank counts the bytes of its parameters, gradients and optimizer state (each storage
once, DTensors by their local shard; ``lablib.measure.memory``) at three moments: after the forward, after the
backward, after the optimizer step. Rank 0 gathers every rank's counts and writes them with the losses,
and with ``formula_slack_bytes``: how far above lab 04's formula the fullest rank may be, from what the formula
leaves out (AdamW's step counters, whole tensors and whole rows instead of exact 1/N shares).
The global batch is the same for every world size, so the losses must match across variants *and* N: bit for bit
where the arithmetic is the same, to float32 rounding of the loss's own mean at the first step (the notebook says
why AdamW allows no bound from the arithmetic after it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lablib.jobs.distenv import gather_objects
from lablib.measure import memory, rankcheck
from lablib.jobs import script
from lablib.course.models import GPT
# The setups lab 07's run counts too live in a library module both import (a run script is a leaf).
from lablib.parallel.zero_states import (Config, apply_ddp, batches, formula_slack_bytes, held_params,
                                         shard_every_layer)

PHASES = ("after_forward", "after_backward", "after_step")


def train_variant(env, config: Config, variant: str, steps) -> dict:
    torch.manual_seed(config.seed)  # the same initial weights on every rank and in every variant
    model = GPT(config.gpt()).to(env.device)
    if variant in ("ddp", "zero1"):
        wrapped, opt = apply_ddp(model, config, zero1=variant == "zero1")
        sharded = []
    else:
        wrapped = shard_every_layer(model, reshard_after_forward=variant == "fsdp_full",
                                    param_dtype=torch.bfloat16 if variant.endswith("_bf16") else None)
        opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        sharded = list(model.parameters())   # DTensors; FSDP2 keeps these objects for the whole run
    losses, counts = [], {}
    for step, (x, y) in enumerate(steps):
        last = step == len(steps) - 1
        opt.zero_grad(set_to_none=True)
        _, loss = wrapped(x.to(env.device), y.to(env.device))
        if last:
            counts["after_forward"] = memory.model_state_bytes(held_params(model, sharded), opt)
        loss.backward()
        if last:
            counts["after_backward"] = memory.model_state_bytes(held_params(model, sharded), opt)
        opt.step()
        if last:
            counts["after_step"] = memory.model_state_bytes(held_params(model, sharded), opt)
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, op=dist.ReduceOp.SUM)   # equal shards: the mean of the rank means
        losses.append(global_loss.item() / env.world_size)
        script.progress(env, step + 1, len(steps), variant=variant, loss=losses[-1])
    counts["peak"] = max((counts[p] for p in PHASES), key=lambda c: c["total"])
    counts["peak_phase"] = max(PHASES, key=lambda p: counts[p]["total"])
    counts["param_tensors"] = len(list(model.parameters()))
    return {"losses": losses, "memory": counts}


def run(env, config: Config) -> dict:
    steps = batches(config, env.rank, env.world_size)
    reference = GPT(config.gpt())
    result = {
        "n_params": sum(p.numel() for p in reference.parameters()),   # tied weights counted once
        "n_params_counting_tied_twice": sum(p.numel() for _, p in reference.named_parameters(remove_duplicate=False)),
        "param_shapes": {n: list(p.shape) for n, p in reference.named_parameters()},
        "variants": {},
    }
    result["formula_slack_bytes"] = formula_slack_bytes(list(result["param_shapes"].values()), env.world_size)
    # The first step's loss comes from the same weights: only the order of its mean's float32 sum differs (each
    # rank's tokens, then the ranks), at most tokens + ranks roundings of positive terms.
    tokens = config.global_batch * config.block_size
    result["first_loss_rtol"] = rankcheck.formula_rtol(tokens + env.world_size, unit_roundoff=rankcheck.FP32_UNIT_ROUNDOFF)
    for variant in config.variants:
        mine = train_variant(env, config, variant, steps)
        per_rank = gather_objects(mine["memory"], env)   # every rank's counts
        result["variants"][variant] = {"losses": mine["losses"], "memory_per_rank": per_rank}
        if env.is_main:
            peak = max(r["peak"]["total"] for r in per_rank)
            print(f"{variant:13s} N={env.world_size}: final loss {mine['losses'][-1]:.6f}, "
                  f"model states at the fullest of three moments {peak / 1e6:.3f} MB on the fullest rank")
    # Every rank leaves together: no rank tears the process group down while another still uses it.
    dist.barrier()
    return result


def main() -> None:
    script.main(Config, run)


if __name__ == "__main__":
    main()
