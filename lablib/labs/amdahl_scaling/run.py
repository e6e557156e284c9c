"""Lab 03's distributed step: the same training at world sizes 1, 2 and 4, compute and communication timed apart.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 -m lablib.labs.amdahl_scaling.run --out out.json

Strong scaling: the global batch (``global_batch`` samples per step) and the total work (``samples``) are
fixed; at world size N each of N ranks computes on global_batch / N samples per step.

One torchrun job with max(world_sizes) processes measures every world size N: the first N ranks form a
process group of their own and train on it; the other ranks wait, blocked in a collective (no CPU used).
The world sizes take turns step by step - step 0 at N=1, then at N=2, then at N=4, then step 1 ... - so
a burst of load from another program on a shared machine slows all of them alike, and the processes
start once instead of once per world size (torchrun's start-up is seconds on a small machine).

At each N an MLP is trained three times from the same initial weights on the same synthetic data (see
``lablib.course.scaling`` for why), again taking turns step by step, in an order that rotates from step to step
(explicit, DDP, again; then DDP, again, explicit; ...) so that no variant always runs first:
- ``explicit``: plain model; forward+backward, then ONE explicit all-reduce of all gradients, then the
  optimizer step, each timed on its own (compute / wait / comm / opt), with a barrier before each;
- ``ddp``: DistributedDataParallel (bucketed all-reduces overlapped with the backward), timed per step;
  a communication hook (``scaling.BucketTimer``) records when each bucket's all-reduce ran, so the
  overlap with the backward is seen, not assumed (its Python hook also costs a little per bucket, which the
  step times include);
- ``again``: the explicit variant a second time, on a model of its own: the same code timed against itself, in the
  same rounds, is the noise floor a DDP / explicit ratio is read against (``timing.noise_verdict``).
Each rank also records the CPU time it used during the compute (``compute_cpu_s``, ``time.thread_time``: with one thread per rank the forward and the backward run on the calling thread):
the work, which shrinks as 1/N whatever the machine does, beside the wall time, which also shows how much of a core
the rank got. The first ``warmup_steps`` steps are not timed. Every per-step time is the slowest rank's; the result
holds their medians (see ``explicit_step`` for how compute, wait and step relate), and every rank's own
times per step (``per_rank``, for a timeline). Rank 0, a member of every group, also reports how far the weights trained at each
N are from those trained by one process: float rounding only (the same math, split differently).
Start it with 1 thread per rank (``launch.run(..., threads_per_rank=1)`` does) so that N ranks use N cores.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from lablib.jobs import config as cfg
from lablib.course import data, scaling
from lablib.jobs import script
from lablib.measure import timing
from lablib.course.models import MLP
from lablib.measure.rankcheck import max_abs_diff
from lablib.jobs.distenv import gather_objects

PARTS = ("compute_s", "wait_s", "comm_s", "opt_s", "compute_cpu_s")
VARIANTS = ("explicit", "ddp", "again")
EVAL_SAMPLES = 4096   # the loss reported before and after training is measured on the first 4096 samples


@dataclass(frozen=True)
class Config:
    world_sizes: tuple[int, ...] = (1, 2, 4)  # measured in turn; start the job with max(world_sizes) ranks
    samples: int = 24576         # total samples trained at every world size (the fixed work)
    global_batch: int = 2048     # samples per optimizer step, over all ranks of a world size
    warmup_steps: int = 2        # first steps, not timed (allocations, DDP's bucket rebuild)
    d_in: int = 256
    d_hidden: int = 512
    n_hidden: int = 2
    lr: float = 0.2
    # 0 = DDP's default (bucket_cap_mb=None): since torch 2.x the FIRST bucket is capped at 1 MiB
    # (dist._DEFAULT_FIRST_BUCKET_BYTES), later ones at 25 MiB. This MLP's 1.58 MB of gradients then form
    # 2 buckets (1.05 MB: the last two layers; 0.53 MB: the first), measured by the hook. An explicit
    # bucket_cap_mb=25 would give ONE bucket, all-reduced only after the whole backward.
    bucket_cap_mb: float = 0.0
    seed: int = 0

    def validate(self) -> None:
        cfg.require_at_least_one(self, "samples", "global_batch", "d_in", "d_hidden", "n_hidden")
        if not self.world_sizes or min(self.world_sizes) < 1 or len(set(self.world_sizes)) != len(self.world_sizes):
            raise ValueError(f"world_sizes={self.world_sizes} must be distinct positive integers, e.g. (1, 2, 4)")
        if self.samples % self.global_batch:
            raise ValueError(f"samples={self.samples} must be a multiple of global_batch={self.global_batch} "
                             f"(every world size trains the same whole steps)")
        if not 0 <= self.warmup_steps < self.samples // self.global_batch:
            raise ValueError(f"warmup_steps={self.warmup_steps} leaves no timed step out of "
                             f"{self.samples // self.global_batch}; lower it or raise samples")
        if self.bucket_cap_mb < 0:
            raise ValueError(f"bucket_cap_mb={self.bucket_cap_mb} must be positive, or 0 for DDP's default "
                             f"(a 1 MiB first bucket, then 25 MiB)")
        for n in self.world_sizes:
            if self.global_batch % n:
                raise ValueError(f"global_batch={self.global_batch} does not split over {n} ranks; use a "
                                 f"global_batch divisible by every world size in {self.world_sizes}")

    def validate_world(self, world_size: int) -> None:
        if world_size != max(self.world_sizes):
            raise ValueError(f"world_sizes={self.world_sizes} need exactly {max(self.world_sizes)} processes "
                             f"(the largest world size), got {world_size}; start it with nproc={max(self.world_sizes)}")


@dataclass
class Replica:
    """What one rank holds to train at one world size: both variants, their optimizers, their timings."""
    world_size: int
    group: object                 # the process group of ranks 0..world_size-1 (None without torchrun)
    plain: torch.nn.Module
    ddp: torch.nn.Module
    opt_plain: torch.optim.Optimizer
    opt_ddp: torch.optim.Optimizer
    again: torch.nn.Module                             # the explicit variant once more: the noise floor
    opt_again: torch.optim.Optimizer
    parts: dict = field(default_factory=lambda: {k: [] for k in PARTS})
    step_times: list = field(default_factory=list)     # the explicit step as a whole, this rank
    again_times: list = field(default_factory=list)    # the same, for the second explicit model
    again_parts: dict = field(default_factory=lambda: {k: [] for k in PARTS})
    ddp_times: list = field(default_factory=list)
    ddp_spans: list = field(default_factory=list)      # per step: this rank's DDP timeline (seconds from step start)
    timer: object = None                               # scaling.BucketTimer registered on ddp (None without torchrun)
    comm_bytes: int = 0


def dataset(config: Config, device) -> tuple[torch.Tensor, torch.Tensor]:
    """All samples, identical on every rank: x (samples, d_in), y (samples, 1). Built before any timing."""
    g = torch.Generator().manual_seed(config.seed)
    x, y = data.regression_task(config.samples, config.d_in, g)
    return x.to(device), y.to(device)


def rank_batch(x, y, step: int, config: Config, rank: int, world_size: int):
    """This rank's contiguous share of step's global batch: (global_batch / N, d_in) and (..., 1)."""
    per_rank = config.global_batch // world_size
    start = step * config.global_batch + rank * per_rank
    return x[start:start + per_rank], y[start:start + per_rank]


def new_model(config: Config, device) -> torch.nn.Module:
    torch.manual_seed(config.seed)  # identical initial weights on every rank and at every world size
    return MLP(config.d_in, config.d_hidden, 1, config.n_hidden).to(device)


def new_replica(env, config: Config, world_size: int, group) -> Replica:
    plain = new_model(config, env.device)
    ddp = new_model(config, env.device)
    timer = None
    if dist.is_initialized():
        ddp = DDP(ddp, process_group=group, bucket_cap_mb=config.bucket_cap_mb or None)
        timer = scaling.BucketTimer(group)
        ddp.register_comm_hook(timer, scaling.BucketTimer.hook)
    again = new_model(config, env.device)
    return Replica(world_size, group, plain, ddp, torch.optim.SGD(plain.parameters(), lr=config.lr),
                   torch.optim.SGD(ddp.parameters(), lr=config.lr), again,
                   torch.optim.SGD(again.parameters(), lr=config.lr), timer=timer)


def rotation(step: int) -> tuple[str, ...]:
    """The order the three variants run in at ``step``: rotated by one each step, so each runs first, second and
    third equally often over every three steps (a variant that always ran first would always meet the load or the
    cache state the previous world size left)."""
    k = step % len(VARIANTS)
    return VARIANTS[k:] + VARIANTS[:k]


def explicit_step(env, r: Replica, xb, yb, again: bool = False) -> None:
    """No overlap: compute, then one all-reduce, then the optimizer step, each timed on its own.

    On a fast rank compute + wait is about the slowest rank's compute (it waits for it at the barrier), so the step
    is about (slowest compute) + comm + opt; ``wait`` shows the imbalance. Only about: the slowest rank's own pass
    through the barrier is not free (the others must be scheduled to answer, which with more ranks than cores takes
    tens of milliseconds), and the parts' medians need not add up to the whole step's median.
    ``again``: the same step on the second explicit model (the noise floor), into its own lists.
    """
    model, opt = (r.again, r.opt_again) if again else (r.plain, r.opt_plain)
    parts, times = (r.again_parts, r.again_times) if again else (r.parts, r.step_times)
    opt.zero_grad(set_to_none=True)
    timing.barrier(env.device, r.group)
    with timing.stopwatch(times, env.device):
        cpu = time.thread_time()
        with timing.stopwatch(parts["compute_s"], env.device):
            F.mse_loss(model(xb), yb).backward()
        parts["compute_cpu_s"].append(time.thread_time() - cpu)
        with timing.stopwatch(parts["wait_s"], env.device):
            timing.barrier(env.device, r.group)   # the slowest rank's compute decides when comm can start
        with timing.stopwatch(parts["comm_s"], env.device):
            r.comm_bytes = scaling.allreduce_gradients_(list(model.parameters()), r.group)
        with timing.stopwatch(parts["opt_s"], env.device):
            opt.step()


def ddp_step(env, r: Replica, xb, yb) -> None:
    """DDP as in practice: bucketed all-reduces start during the backward. Timed as a whole."""
    r.opt_ddp.zero_grad(set_to_none=True)
    if r.timer is not None:
        r.timer.start_step()
    marks = []
    timing.barrier(env.device, r.group)
    with timing.stopwatch(r.ddp_times, env.device):
        t0 = time.perf_counter()
        loss = F.mse_loss(r.ddp(xb), yb)
        marks.append(time.perf_counter())
        loss.backward()                            # the all-reduces overlap this backward; it returns when all are done
        marks.append(time.perf_counter())
        r.opt_ddp.step()
    marks.append(time.perf_counter())
    buckets = [(a - t0, b - t0, n, i) for a, b, n, i in (r.timer.spans if r.timer is not None else [])]
    r.ddp_spans.append({"forward_end_s": marks[0] - t0, "backward_end_s": marks[1] - t0, "end_s": marks[2] - t0,
                        "buckets": sorted(buckets, key=lambda b: b[0])})   # (launch s, done s, bytes, index)


def summarize(env, r: Replica, config: Config) -> dict:
    """Medians of the slowest rank's per-step times (a collective among this world size's ranks)."""
    w = config.warmup_steps
    # Per part and per step the largest value over the ranks: "compute" is the slowest rank's, "wait" the
    # longest any rank waited for it (the imbalance, already inside the slowest rank's compute time).
    timed = {k: timing.slowest_rank(v[w:], env.device, r.group) for k, v in r.parts.items()}
    # Every rank's own times, for a per-rank timeline (gathered; small: a few numbers per step and rank).
    mine = {"explicit": {k: v[w:] for k, v in r.parts.items()}, "ddp": r.ddp_spans[w:]}
    per_rank = gather_objects(mine, env, group=r.group)
    last = r.ddp_spans[-1]["buckets"] if r.ddp_spans else []
    return {"explicit": {**{f"median_{k}": timing.median(v) for k, v in timed.items()},
                         **timing.step_times(r.step_times, env.device, r.group, warmup=w), **timed},
            "ddp": {**timing.step_times(r.ddp_times, env.device, r.group, warmup=w),
                    "bucket_bytes": [b[2] for b in sorted(last, key=lambda b: b[3])]},   # by bucket index
            "again": timing.step_times(r.again_times, env.device, r.group, warmup=w),
            "per_rank": per_rank, "comm_bytes": r.comm_bytes}


def full_loss(model: torch.nn.Module, x, y) -> float:
    with torch.no_grad():
        return F.mse_loss(model(x), y).item()


def run(env, config: Config) -> dict:
    x, y = dataset(config, env.device)
    # Every rank creates every group, in the same order (new_group is collective); ranks 0..n-1 form group n.
    groups = {n: dist.new_group(list(range(n))) if dist.is_initialized() else None for n in config.world_sizes}
    # Largest world size first: every rank then builds its first DDP (whose first use imports
    # torch._dynamo, ~2 s of CPU) at the same time, instead of one rank after another.
    mine = {n: new_replica(env, config, n, groups[n]) for n in sorted(config.world_sizes, reverse=True) if env.rank < n}
    mine = {n: mine[n] for n in config.world_sizes if n in mine}     # back to the order they take turns in
    steps = config.samples // config.global_batch
    load = [os.getloadavg()[0]]
    for step in range(steps):
        for n, r in mine.items():   # world sizes take turns; ranks outside group n go on and wait at its next barrier
            xb, yb = rank_batch(x, y, step, config, env.rank, n)
            variants = {"explicit": lambda: explicit_step(env, r, xb, yb), "ddp": lambda: ddp_step(env, r, xb, yb),
                        "again": lambda: explicit_step(env, r, xb, yb, again=True)}
            for name in rotation(step):
                variants[name]()
        script.progress(env, step + 1, steps)
    load.append(os.getloadavg()[0])
    by_world_size = {n: summarize(env, r, config) for n, r in mine.items()}
    result = {"by_world_size": by_world_size, "processes": env.world_size,
              "threads_per_rank": torch.get_num_threads(), "steps": steps,
              "timed_steps": steps - config.warmup_steps, "load_1min": load,
              "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
              "order": [list(rotation(s)) for s in range(config.warmup_steps, steps)]}
    if env.is_main:
        # Rank 0 is in every group, so it holds the weights trained at every world size: compare them.
        x_eval, y_eval = x[:EVAL_SAMPLES], y[:EVAL_SAMPLES]
        initial = new_model(config, env.device)
        result["n_params"] = sum(p.numel() for p in initial.parameters())
        result["initial_loss"] = full_loss(initial, x_eval, y_eval)
        reference = mine[min(mine)].plain     # the smallest world size's explicit run (N=1: one process)
        for n, r in mine.items():
            ddp_module = r.ddp.module if isinstance(r.ddp, DDP) else r.ddp
            m = by_world_size[n]
            m["final_loss_explicit"] = full_loss(r.plain, x_eval, y_eval)
            m["final_loss_ddp"] = full_loss(ddp_module, x_eval, y_eval)
            m["max_abs_diff_explicit_vs_ddp"] = max_abs_diff(r.plain, ddp_module)
            m["max_abs_diff_again_vs_explicit"] = max_abs_diff(r.again, r.plain)   # the same code: 0
            m["max_abs_diff_vs_smallest_world_size"] = max(max_abs_diff(r.plain, reference),
                                                           max_abs_diff(ddp_module, reference))
            e = m["explicit"]
            print(f"N={n} ({torch.get_num_threads()} thread(s)/rank): explicit step {e['median_step_s'] * 1e3:.1f} ms "
                  f"= compute {e['median_compute_s'] * 1e3:.1f} + wait {e['median_wait_s'] * 1e3:.1f} + comm "
                  f"{e['median_comm_s'] * 1e3:.1f} + opt {e['median_opt_s'] * 1e3:.1f} ms; DDP step "
                  f"{m['ddp']['median_step_s'] * 1e3:.1f} ms; loss {result['initial_loss']:.4f} -> "
                  f"{m['final_loss_ddp']:.4f}")
    return result


def main() -> None:
    script.main(Config, run)


if __name__ == "__main__":
    main()
