"""Lab 09's comparison: the same GPT stages under ``torch.distributed.pipelining``'s schedules.

    torchrun --standalone --nproc-per-node 2 -m lablib.labs.pipeline_parallel.run_pipeline_torch --n-microbatches 8 --out out.json

For each schedule the GPT is cut into p x v chunks (``lablib.parallel.pipeline.gpt_stages``, the last one returning
logits; the loss is the schedule's ``loss_fn``), rank r holds chunks r, r + p, ... (ZBV: r and 2p - 1 - r,
its "V"; also DualPipeV, DeepSeek-V3's schedule), and PyTorch's ``PipelineStage`` and schedule run the steps: one to warm up (it also infers the
shapes), ``steps`` timed (``lablib.measure.timing.step_times``: per step the slowest rank, then the median), then one
more under ``lablib.measure.memory.MemoryTimeline`` for the saved activations each rank held at its peak. The last
rank's micro-batch losses are compared with one process's.
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
    steps: int = 4                      # timed steps per schedule (after one warm-up step)
    n_layer: int = SMALL.n_layer
    n_embd: int = 128
    n_head: int = SMALL.n_head
    block_size: int = 32
    seed: int = 0

    def validate(self) -> None:
        unknown = [s for s in self.schedules if s not in SCHEDULES]
        if unknown or not self.schedules:
            raise ValueError(f"schedules={self.schedules}: unknown {unknown}; known: {sorted(SCHEDULES)}")
        if self.n_microbatches < 1 or self.micro_batch < 1 or self.steps < 1:
            raise ValueError("n_microbatches, micro_batch and steps must be positive")

    def validate_world(self, world_size: int) -> None:
        if self.n_layer < 2 * world_size:
            raise ValueError(f"n_layer={self.n_layer} cannot give 2 chunks to each of {world_size} ranks")


def run_schedule(name: str, env, config: Config, model_config: GPTConfig, inputs, targets) -> dict:
    import torch.distributed.pipelining as pp

    cls_name, v = SCHEDULES[name]
    p = env.world_size
    torch.manual_seed(config.seed)
    chunks = pipeline.gpt_stages(GPT(model_config), p * v, loss=False)
    mine = [env.rank + k * p for k in range(v)] if name not in V_SHAPED else [env.rank, 2 * p - 1 - env.rank]
    stages = [pp.PipelineStage(chunks[i], i, p * v, env.device) for i in mine]
    schedule = getattr(pp, cls_name)(stages[0] if v == 1 else stages, config.n_microbatches, loss_fn=pipeline.token_loss)
    x, y = torch.cat(inputs).to(env.device), torch.cat(targets).to(env.device)
    holds_first, holds_last = 0 in mine, p * v - 1 in mine

    def step() -> list:
        for i in mine:
            chunks[i].zero_grad(set_to_none=True)
        losses = [] if holds_last else None
        args = (x,) if holds_first else ()
        kwargs = {"target": y, "losses": losses} if holds_last else {}
        schedule.step(*args, **kwargs)
        return losses or []

    per_step = []
    for i in range(config.steps + 1):
        timing.barrier(env.device)
        with timing.stopwatch(per_step, env.device):
            losses = step()
    times = timing.step_times(per_step, env.device, warmup=1)
    timing.barrier(env.device)
    with MemoryTimeline(nn.ModuleList(chunks[i] for i in mine)) as timeline:
        step()
    peak = max(s["activations"] for s in timeline.samples)
    per_rank = gather_objects({"rank": env.rank, "peak_activation_bytes": peak,
                               "losses": [float(t) for t in losses]}, env)
    return {"schedule": name, "torch_class": cls_name, "chunks_per_rank": v, **times,
            "peak_activation_bytes": [r["peak_activation_bytes"] for r in per_rank],
            "losses": next(r["losses"] for r in per_rank if r["losses"])}


def run(env, config: Config) -> dict:
    model_config = GPTConfig(vocab_size=SMALL.vocab_size, block_size=config.block_size, n_layer=config.n_layer,
                             n_head=config.n_head, n_embd=config.n_embd)
    inputs, targets = batch(model_config, config.n_microbatches, config.micro_batch, config.seed)
    _, reference_losses = reference(model_config, inputs, targets, config.seed)
    t0, results = time.perf_counter(), {}
    for i, name in enumerate(config.schedules):
        results[name] = run_schedule(name, env, config, model_config, inputs, targets)
        script.progress(env, i + 1, len(config.schedules))
    return {"schedules": results, "reference_losses": reference_losses, "n_stages": env.world_size,
            "seconds": time.perf_counter() - t0}


def main() -> None:
    script.main(Config, run)


if __name__ == "__main__":
    main()
