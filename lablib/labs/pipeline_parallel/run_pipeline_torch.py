"""Lab 09's comparison: the same GPT stages under ``torch.distributed.pipelining``'s schedules.

    torchrun --standalone --nproc-per-node 2 -m lablib.labs.pipeline_parallel.run_pipeline_torch --n-microbatches 8 --rounds 10 --out out.json

For each schedule the GPT is cut into p x v chunks (``lablib.parallel.pipeline.gpt_stages``, the last one returning
logits; the loss is the schedule's ``loss_fn``), rank r holds chunks r, r + p, ... (ZBV: r and 2p - 1 - r,
its "V"; also DualPipeV, DeepSeek-V3's schedule), and PyTorch's ``PipelineStage`` and schedule run the steps: one to warm up (it also infers the
shapes), then ``rounds`` timed rounds in which every schedule, and the floor schedule (1F1B) a second time on its own
copy, takes one step, the order rotated by one each round and the copy half a round from the first (``timed_rounds``:
per step the slowest rank; per round each schedule's step over 1F1B's, beside 1F1B's second copy over its first, the
noise floor), then one more step each under
``lablib.measure.memory.MemoryTimeline`` for the saved activations each rank held at its peak. The last rank's
micro-batch losses are compared with one process's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from lablib.parallel import pipeline
from lablib.jobs import script
from lablib.measure import timing
from lablib.measure.memory import MemoryTimeline
from lablib.course.models import GPT, GPTConfig
from lablib.labs.pipeline_parallel.probe import SMALL, batch, reference
from lablib.jobs.distenv import gather_objects

# name -> (class name in torch.distributed.pipelining, chunks per rank)
SCHEDULES = {"gpipe": ("ScheduleGPipe", 1), "1f1b": ("Schedule1F1B", 1),
             "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2),
             "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", 2), "zbv_zero_bubble": ("ScheduleZBVZeroBubble", 2),
             "dualpipev": ("ScheduleDualPipeV", 2)}
V_SHAPED = ("zbv_zero_bubble", "dualpipev")     # rank r holds chunks r and 2p - 1 - r


@dataclass(frozen=True)
class Config:
    schedules: tuple[str, ...] = tuple(SCHEDULES)
    n_microbatches: int = 8
    micro_batch: int = 4
    rounds: int = 10                    # timed rounds: every schedule one step per round (after one warm-up step)
    floor: str = "1f1b"                 # timed twice per round: against itself, the noise floor of the ratios
    n_layer: int = SMALL.n_layer
    n_embd: int = 128
    n_head: int = SMALL.n_head
    block_size: int = 32
    seed: int = 0

    def validate(self) -> None:
        unknown = [s for s in self.schedules if s not in SCHEDULES]
        if unknown or not self.schedules:
            raise ValueError(f"schedules={self.schedules}: unknown {unknown}; known: {sorted(SCHEDULES)}")
        if self.floor not in self.schedules:
            raise ValueError(f"floor={self.floor!r} must be one of the timed schedules {self.schedules}: the ratios "
                             "are each schedule's step over the floor schedule's, beside it timed against itself")
        if self.n_microbatches < 1 or self.micro_batch < 1 or self.rounds < 1:
            raise ValueError(f"n_microbatches={self.n_microbatches}, micro_batch={self.micro_batch} and rounds="
                             f"{self.rounds} must be positive")

    def validate_world(self, world_size: int) -> None:
        if self.n_layer < 2 * world_size:
            raise ValueError(f"n_layer={self.n_layer} cannot give 2 chunks to each of {world_size} ranks")


class _Runner:
    """One schedule of torch.distributed.pipelining on this rank's chunks of its own copy of the GPT (same weights)."""

    def __init__(self, name: str, env, config: Config, model_config: GPTConfig, inputs, targets):
        import torch.distributed.pipelining as pp

        self.cls_name, v = SCHEDULES[name]
        self.v, p = v, env.world_size
        torch.manual_seed(config.seed)
        self.chunks = pipeline.gpt_stages(GPT(model_config), p * v, loss=False)
        self.mine = [env.rank + k * p for k in range(v)] if name not in V_SHAPED else [env.rank, 2 * p - 1 - env.rank]
        stages = [pp.PipelineStage(self.chunks[i], i, p * v, env.device) for i in self.mine]
        self.schedule = getattr(pp, self.cls_name)(stages[0] if v == 1 else stages, config.n_microbatches,
                                                   loss_fn=pipeline.token_loss)
        self.x, self.y = torch.cat(inputs).to(env.device), torch.cat(targets).to(env.device)
        self.holds_first, self.holds_last = 0 in self.mine, p * v - 1 in self.mine

    def step(self) -> list:
        for i in self.mine:
            self.chunks[i].zero_grad(set_to_none=True)
        losses = [] if self.holds_last else None
        args = (self.x,) if self.holds_first else ()
        kwargs = {"target": self.y, "losses": losses} if self.holds_last else {}
        self.schedule.step(*args, **kwargs)
        return losses or []


def timed_rounds(runners: dict, env, config: Config) -> dict:
    """Every schedule, and the floor schedule a second time (its own copy), one step each per round, the order
    rotated by one each round (over as many rounds as there are arms, each arm runs once in each place of a round;
    the copy half a round from the first, never parked beside it at one end); each step after a barrier, on a
    stopwatch, per round the slowest rank (``timing.slowest_rank``). Per round each schedule's step over the floor
    schedule's, and the floor's second copy over its first: the same code timed against itself, the noise floor
    (``timing.noise_verdict``)."""
    arms = [a for a in runners if a != config.floor + "_again"]
    first = arms.index(config.floor)
    arms.insert((first + (len(arms) + 1) // 2) % len(arms) + 1, config.floor + "_again")
    per_arm = {a: [] for a in arms}
    for r in range(config.rounds):
        for a in arms[r % len(arms):] + arms[:r % len(arms)]:
            timing.barrier(env.device)
            with timing.stopwatch(per_arm[a], env.device):
                runners[a].step()
    slowest = {a: timing.slowest_rank(t, env.device) for a, t in per_arm.items()}
    base, again = slowest[config.floor], slowest[config.floor + "_again"]
    floor = [x / y for x, y in zip(again, base)]
    out = {"floor_ratios": floor, "floor_median_ratio": timing.median(floor)}
    compared = [a for a in config.schedules if a != config.floor]
    for a in config.schedules:
        ratios = [x / y for x, y in zip(slowest[a], base)]
        out[a] = {"step_s": slowest[a], "median_step_s": timing.median(slowest[a]), "ratios": ratios,
                  "median_ratio": timing.median(ratios),
                  "vs_floor": timing.noise_verdict(ratios, floor, len(compared)) if a != config.floor else None}
    return out


def run(env, config: Config) -> dict:
    model_config = GPTConfig(vocab_size=SMALL.vocab_size, block_size=config.block_size, n_layer=config.n_layer,
                             n_head=config.n_head, n_embd=config.n_embd)
    inputs, targets = batch(model_config, config.n_microbatches, config.micro_batch, config.seed)
    _, reference_losses = reference(model_config, inputs, targets, config.seed)
    t0 = time.perf_counter()
    names = list(config.schedules) + [config.floor + "_again"]
    runners = {n: _Runner(n.removesuffix("_again"), env, config, model_config, inputs, targets) for n in names}
    losses = {}
    for n, runner in runners.items():          # warm-up: the first step also infers the stages' shapes
        timing.barrier(env.device)
        losses[n] = runner.step()
    script.progress(env, 1, 3)
    timed = timed_rounds(runners, env, config)
    script.progress(env, 2, 3)
    results = {}
    for name in config.schedules:              # one more step each, its saved activations sampled (not timed)
        runner = runners[name]
        timing.barrier(env.device)
        with MemoryTimeline(nn.ModuleList(runner.chunks[i] for i in runner.mine)) as timeline:
            step_losses = runner.step()
        peak = max(s["activations"] for s in timeline.samples)
        per_rank = gather_objects({"peak_activation_bytes": peak, "losses": [float(t) for t in step_losses]}, env)
        results[name] = {"schedule": name, "torch_class": runner.cls_name, "chunks_per_rank": runner.v, **timed[name],
                         "peak_activation_bytes": [r["peak_activation_bytes"] for r in per_rank],
                         "losses": next(r["losses"] for r in per_rank if r["losses"])}
    script.progress(env, 3, 3)
    return {"schedules": results, "reference_losses": reference_losses, "n_stages": env.world_size,
            "floor": config.floor, "floor_ratios": timed["floor_ratios"],
            "floor_median_ratio": timed["floor_median_ratio"], "rounds": config.rounds,
            "seconds": time.perf_counter() - t0}


def main() -> None:
    script.main(Config, run)


if __name__ == "__main__":
    main()
