"""Lab 01's distributed step: gradient accumulation under DDP, with and without ``no_sync()``.

    torchrun --standalone --nproc-per-node 2 -m lablib.labs.gradient_accumulation.run_grad_accum \\
        --impl accum_impl.py --out out.json

The student's ``accumulation_step(model, optimizer, micro_batches, loss_fn)`` (from --impl) trains an
MLP on a synthetic regression task three times, from the same initial weights and data, the three arms taking
turns step by step:
- ``no_sync``: the function as written (it should skip the all-reduce on all but the last micro-batch);
- ``sync_every``: the same function with ``model.no_sync`` replaced by a do-nothing context, so every
  backward all-reduces. Same math, K times the communication;
- ``no_sync_again``: ``no_sync`` once more, the noise floor: the same code timed against itself.
Each arm's all-reduces are counted with a DDP communication hook and its steps timed; ``rounds`` holds, per timed
step, sync_every / no_sync and no_sync_again / no_sync, and whether the first lies beyond the second.
Rank 0 also trains a plain single-process copy on each whole global batch (world_size * K micro-batches
in one backward) - the reference the accumulated DDP weights must equal, to within the rounding estimate of
``rankcheck.sgd_rounding_bound`` (an estimate, not a bound: see its docstring; over all ``steps``, the untimed first
included; the MLP uses GELU: with ReLU's kink a rounding-sized difference can flip one
sample's activation and part the two runs by far more than rounding, as it did from step 8 at lr 0.05). With ``--last-micro-batch-size``
each rank's last micro-batch is smaller than the others (the end of an epoch), so the micro-batch losses
must be weighted by their share of the samples, not by 1/K.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from lablib.jobs import config as cfg
from lablib.course import data
from lablib.jobs import script
from lablib.measure import timing
from lablib.measure.counting import count_ddp
from lablib.jobs.exercise import load_module, require_file
from lablib.course.models import ACTIVATIONS, MLP
from lablib.measure.rankcheck import max_abs_diff, sgd_rounding_bound, weight_spread


@dataclass(frozen=True)
class Config:
    impl: str = "accum_impl.py"     # the module file the notebook's exercise cell writes
    accum_steps: int = 4            # K micro-batches per optimizer step
    micro_batch_size: int = 32      # samples per micro-batch, per rank
    last_micro_batch_size: int = 0  # samples in each rank's last micro-batch (0: micro_batch_size, all equal)
    steps: int = 8                  # optimizer steps per variant (the first is warm-up, not timed)
    d_in: int = 256
    d_hidden: int = 1024
    n_hidden: int = 2
    lr: float = 0.05
    activation: str = "gelu"        # smooth, so DDP and one process stay within rounding (see models.MLP)
    # MiB per DDP bucket, the first bucket included. DDP's default (bucket_cap_mb=None) is different: the
    # first bucket is capped at 1 MiB (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES), the others at 25 MiB.
    bucket_cap_mb: float = 25.0
    seed: int = 0

    def validate(self) -> None:
        cfg.require_at_least_one(self, "accum_steps", "micro_batch_size", "steps", "d_in", "d_hidden")
        if self.last_micro_batch_size < 0:
            raise ValueError(f"last_micro_batch_size={self.last_micro_batch_size} must be at least 1 (or 0: the same "
                             f"as micro_batch_size={self.micro_batch_size})")
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb={self.bucket_cap_mb} must be positive (MiB per bucket, e.g. 25)")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r} must be one of {sorted(ACTIVATIONS)}")
        require_file(self.impl)


def micro_batch_sizes(config: Config) -> list[int]:
    """Samples in each of a rank's K micro-batches: K - 1 of micro_batch_size, then the last one."""
    return [config.micro_batch_size] * (config.accum_steps - 1) + [config.last_micro_batch_size or config.micro_batch_size]


def global_batch(config: Config, step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's whole batch, identical on every rank: (world_size * samples per rank, d_in) and (..., 1)."""
    g = torch.Generator().manual_seed(config.seed * 1000 + step)
    n = world_size * sum(micro_batch_sizes(config))
    return data.regression_task(n, config.d_in, g)


def rank_micro_batches(x, y, config: Config, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's contiguous slice of the global batch, cut into K micro-batches (every rank holds as many
    samples, so DDP's mean over ranks of the rank means is the global batch's mean)."""
    sizes = micro_batch_sizes(config)
    per_rank = sum(sizes)
    xs, ys = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
    return list(zip(xs.split(sizes), ys.split(sizes)))


def new_model(config: Config, device) -> torch.nn.Module:
    torch.manual_seed(config.seed)  # identical initial weights on every rank and for the reference
    return MLP(config.d_in, config.d_hidden, 1, config.n_hidden, activation=config.activation).to(device)


# The arms, in the order of the first step: (name, no_sync disabled). "no_sync_again" is the student's function run
# again exactly as "no_sync": the same code timed against itself, the noise floor of the comparison.
ARMS = (("sync_every", True), ("no_sync", False), ("no_sync_again", False))


def train_arms(env, config: Config, step_fn) -> tuple[dict, dict]:
    """Every arm trained from the same weights on the same data, the arms taking turns step by step (the first arm
    moves to the back each step), so a burst of load from another program falls on all of them alike.
    Returns ({arm: metrics}, {arm: the trained module})."""
    models, logs, optimizers = {}, {}, {}
    for name, disable in ARMS:
        model = DDP(new_model(config, env.device), bucket_cap_mb=config.bucket_cap_mb)
        if disable:
            model.no_sync = contextlib.nullcontext  # every backward now all-reduces
        models[name], logs[name] = model, count_ddp(model)
        optimizers[name] = torch.optim.SGD(model.parameters(), lr=config.lr)
    step_times = {name: [] for name, _ in ARMS}
    calls = {name: [] for name, _ in ARMS}
    losses = {name: [] for name, _ in ARMS}
    names = [name for name, _ in ARMS]
    for step in range(config.steps):
        x, y = global_batch(config, step, env.world_size)
        micro = [(a.to(env.device), b.to(env.device)) for a, b in rank_micro_batches(x, y, config, env.rank)]
        for name in names[step % len(names):] + names[:step % len(names)]:
            logs[name].reset()
            timing.barrier(env.device)
            with timing.stopwatch(step_times[name], env.device):
                loss = step_fn(models[name], optimizers[name], micro, F.mse_loss)
            calls[name].append(logs[name].count())
            losses[name].append(float(loss))
        script.progress(env, step + 1, config.steps, loss=losses["no_sync"][-1])
    # Step 0 includes DDP's bucket rebuild: warm-up (left out unless it is the only step).
    warmup = 1 if config.steps > 1 else 0
    metrics = {name: {"allreduce_calls_per_step": calls[name], "allreduce_bytes_last_step": logs[name].bytes(),
                      **timing.step_times(step_times[name], env.device, warmup=warmup), "losses": losses[name]}
               for name in names}
    return metrics, {name: model.module for name, model in models.items()}


def paired_rounds(metrics: dict, accum_steps: int) -> dict:
    """Per timed step (a round: the three arms one after another), syncing every micro-batch against no_sync, and
    no_sync run again against no_sync (the noise floor), each the slowest rank's time; their medians and ranges, and
    whether this run tells the two apart (``timing.noise_verdict``: the rounds beyond every floor round).
    ``saved_per_allreduce_s``: per round, the time no_sync saved divided by the K - 1 syncs it avoided (what one
    avoided sync cost in that round; its range says how well one run pins it down)."""
    every, once, again = (metrics[name]["step_s"] for name in ("sync_every", "no_sync", "no_sync_again"))
    ratio = [a / b for a, b in zip(every, once)]
    floor = [a / b for a, b in zip(again, once)]
    saved = [(a - b) / (accum_steps - 1) for a, b in zip(every, once)] if accum_steps > 1 else []
    return {"ratio": ratio, "floor": floor, "median_ratio": timing.median(ratio),
            "median_floor": timing.median(floor), "verdict": timing.noise_verdict(ratio, floor, comparisons=1),
            "saved_per_allreduce_s": saved}


def reference_weights(config: Config, world_size: int, device) -> tuple[torch.nn.Module, float]:
    """Plain single-process training on each whole global batch: one forward, one backward, one step.
    Returns the model and the largest |gradient element| seen over the steps (the rounding estimate's scale)."""
    model = new_model(config, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    max_grad = 0.0
    for step in range(config.steps):
        x, y = global_batch(config, step, world_size)
        optimizer.zero_grad()
        F.mse_loss(model(x.to(device)), y.to(device)).backward()
        max_grad = max(max_grad, *(p.grad.abs().max().item() for p in model.parameters()))
        optimizer.step()
    return model, max_grad


def run(env, config: Config) -> dict:
    impl = load_module(config.impl, required=("accumulation_step",))
    result, models = train_arms(env, config, impl.accumulation_step)
    for name, model in models.items():
        result[name]["weight_spread_across_ranks"] = weight_spread(model, env)
    model = models["no_sync"]
    result["rounds"] = paired_rounds(result, config.accum_steps)
    if env.is_main:
        reference, max_grad = reference_weights(config, env.world_size, env.device)
        result["max_abs_diff_vs_single_process"] = max_abs_diff(model, reference)
        result["max_abs_weight"] = max(p.abs().max().item() for p in reference.parameters())
        result["max_abs_grad"] = max_grad
        # The longest float32 sum behind one gradient element: the global batch's samples (the batch reduction
        # of the weight gradient) plus a hidden layer's width (the dot products of the backward).
        result["longest_sum"] = env.world_size * sum(micro_batch_sizes(config)) + config.d_hidden
        result["rounding_bound"] = sgd_rounding_bound(config.steps, config.lr, result["longest_sum"], max_grad,
                                                      result["max_abs_weight"])
        result["n_params"] = sum(p.numel() for p in reference.parameters())
        t_every, t_no = result["sync_every"]["median_step_s"], result["no_sync"]["median_step_s"]
        rounds = result["rounds"]
        print(f"all-reduces per step: sync_every={result['sync_every']['allreduce_calls_per_step'][-1]}, "
              f"no_sync={result['no_sync']['allreduce_calls_per_step'][-1]}; median step "
              f"{t_every * 1e3:.1f} ms -> {t_no * 1e3:.1f} ms (ratio {rounds['median_ratio']:.2f}, rounds "
              f"{min(rounds['ratio']):.2f}-{max(rounds['ratio']):.2f}; no_sync against itself "
              f"{min(rounds['floor']):.2f}-{max(rounds['floor']):.2f}); max |w_ddp - w_single| = "
              f"{result['max_abs_diff_vs_single_process']:.2e} (rounding estimate {result['rounding_bound']:.2e})")
    return result


def main() -> None:
    script.main(Config, run)


if __name__ == "__main__":
    main()
