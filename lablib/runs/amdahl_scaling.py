"""Lab 03's distributed step: the same training at world size N, its compute and communication timed apart.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m lablib.runs.amdahl_scaling --out out.json

Strong scaling: the global batch (``global_batch`` samples per step) and the total work (``samples``) are
fixed; with N ranks each rank computes on global_batch / N samples per step. An MLP is trained twice from
the same initial weights on the same synthetic regression data (see ``lablib.scaling`` for why):
- ``explicit``: plain model; forward+backward, then ONE explicit all-reduce of all gradients, then the
  optimizer step, each timed on its own (compute / comm / opt), with a barrier before each;
- ``ddp``: DistributedDataParallel (bucketed all-reduces overlapped with the backward), timed per step.
The first ``warmup_steps`` steps of each are not timed. Every per-step time is the slowest rank's; the
result holds their medians. Rank 0 also reports the final loss on all samples, which must not depend on N
(the same math, split differently).
Start it with 1 thread per rank (``launch.run(..., threads_per_rank=1)`` does) so that N ranks use N cores.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from lablib import scaling, script
from lablib.models import MLP


@dataclass(frozen=True)
class Config:
    samples: int = 40960         # total samples trained at every world size (the fixed work)
    global_batch: int = 2048     # samples per optimizer step, over all ranks
    warmup_steps: int = 2        # first steps of each variant, not timed (allocations, DDP bucket rebuild)
    d_in: int = 256
    d_hidden: int = 512
    n_hidden: int = 2
    lr: float = 0.05
    bucket_cap_mb: float = 25.0
    seed: int = 0

    def validate(self) -> None:
        for name in ("samples", "global_batch", "d_in", "d_hidden", "n_hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.samples % self.global_batch:
            raise ValueError(f"samples={self.samples} must be a multiple of global_batch={self.global_batch} "
                             f"(every world size trains the same whole steps)")
        if not 0 <= self.warmup_steps < self.samples // self.global_batch:
            raise ValueError(f"warmup_steps={self.warmup_steps} leaves no timed step out of "
                             f"{self.samples // self.global_batch}; lower it or raise samples")
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb={self.bucket_cap_mb} must be positive (DDP's default is 25)")

    def validate_world(self, world_size: int) -> None:
        if self.global_batch % world_size:
            raise ValueError(f"global_batch={self.global_batch} does not split over {world_size} ranks; "
                             f"use a global_batch divisible by the world size (e.g. {world_size * 32})")


def dataset(config: Config, device) -> tuple[torch.Tensor, torch.Tensor]:
    """All samples, identical on every rank: x (samples, d_in), y (samples, 1). Built before any timing."""
    g = torch.Generator().manual_seed(config.seed)
    x = torch.randn(config.samples, config.d_in, generator=g)
    y = torch.sin(x[:, :8].sum(dim=1, keepdim=True))  # a smooth target the MLP can learn
    return x.to(device), y.to(device)


def rank_batch(x, y, step: int, config: Config, env) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's contiguous share of step's global batch: (global_batch / N, d_in) and (..., 1)."""
    per_rank = config.global_batch // env.world_size
    start = step * config.global_batch + env.rank * per_rank
    return x[start:start + per_rank], y[start:start + per_rank]


def new_model(config: Config, device) -> torch.nn.Module:
    torch.manual_seed(config.seed)  # identical initial weights on every rank and at every world size
    return MLP(config.d_in, config.d_hidden, 1, config.n_hidden).to(device)


def train_explicit(env, config: Config, x, y) -> tuple[dict, torch.nn.Module]:
    """No overlap: compute, then one all-reduce, then the optimizer step, each timed on its own."""
    model = new_model(config, env.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    parts = {"compute_s": [], "wait_s": [], "comm_s": [], "opt_s": []}
    steps, comm_bytes = config.samples // config.global_batch, 0
    t_start = time.perf_counter()
    for step in range(steps):
        xb, yb = rank_batch(x, y, step, config, env)
        optimizer.zero_grad(set_to_none=True)
        scaling.barrier(env.device)
        with scaling.stopwatch(parts["compute_s"], env.device):
            F.mse_loss(model(xb), yb).backward()
        with scaling.stopwatch(parts["wait_s"], env.device):
            scaling.barrier(env.device)       # the slowest rank's compute decides when comm can start
        with scaling.stopwatch(parts["comm_s"], env.device):
            comm_bytes = scaling.allreduce_gradients_(list(model.parameters()))
        with scaling.stopwatch(parts["opt_s"], env.device):
            optimizer.step()
        script.progress(env, step + 1, 2 * steps)
    total_s = time.perf_counter() - t_start
    timed = {k: scaling.slowest_rank(v[config.warmup_steps:], env.device) for k, v in parts.items()}
    step_s = [sum(p) for p in zip(*timed.values())]
    metrics = {**{f"median_{k}": scaling.median(v) for k, v in timed.items()},
               "median_step_s": scaling.median(step_s), "step_s": step_s, "comm_bytes": comm_bytes,
               "total_s": total_s}
    return metrics, model


def train_ddp(env, config: Config, x, y) -> tuple[dict, torch.nn.Module]:
    """DDP as in practice: bucketed all-reduces start during the backward. Timed per whole step."""
    model = DDP(new_model(config, env.device), bucket_cap_mb=config.bucket_cap_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    times: list[float] = []
    steps = config.samples // config.global_batch
    t_start = time.perf_counter()
    for step in range(steps):
        xb, yb = rank_batch(x, y, step, config, env)
        optimizer.zero_grad(set_to_none=True)
        scaling.barrier(env.device)
        with scaling.stopwatch(times, env.device):
            F.mse_loss(model(xb), yb).backward()   # all-reduces overlap this backward
            optimizer.step()
        script.progress(env, steps + step + 1, 2 * steps)
    total_s = time.perf_counter() - t_start
    step_s = scaling.slowest_rank(times[config.warmup_steps:], env.device)
    return {"median_step_s": scaling.median(step_s), "step_s": step_s, "total_s": total_s}, model.module


def full_loss(model: torch.nn.Module, x, y) -> float:
    with torch.no_grad():
        return F.mse_loss(model(x), y).item()


def train(env, config: Config) -> dict:
    x, y = dataset(config, env.device)
    explicit, model_explicit = train_explicit(env, config, x, y)
    ddp, model_ddp = train_ddp(env, config, x, y)
    result = {"explicit": explicit, "ddp": ddp, "world_size": env.world_size,
              "threads_per_rank": torch.get_num_threads(),
              "n_params": sum(p.numel() for p in model_ddp.parameters()),
              "steps": config.samples // config.global_batch}
    if env.is_main:
        result["final_loss_explicit"] = full_loss(model_explicit, x, y)
        result["final_loss_ddp"] = full_loss(model_ddp, x, y)
        e = explicit
        print(f"N={env.world_size} ({torch.get_num_threads()} thread(s)/rank): explicit step "
              f"{e['median_step_s'] * 1e3:.1f} ms = compute {e['median_compute_s'] * 1e3:.1f} + wait "
              f"{e['median_wait_s'] * 1e3:.1f} + comm {e['median_comm_s'] * 1e3:.1f} + opt "
              f"{e['median_opt_s'] * 1e3:.1f} ms; DDP step {ddp['median_step_s'] * 1e3:.1f} ms; "
              f"final loss {result['final_loss_ddp']:.4f}")
    return result


def main() -> None:
    script.main(Config, train)


if __name__ == "__main__":
    main()
