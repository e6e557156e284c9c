"""Lab 07's measurement: the students' ZeRO-1, 2 and 3 next to DDP, ZeroRedundancyOptimizer and FSDP2.

    torchrun --standalone --nproc-per-node 2 -m lablib.labs.zero_from_scratch.run_zero_stages --zero1-impl zero1_impl.py \\
        --zero2-impl zero2_impl.py --zero3-impl zero3_impl.py --out zero_stages.json

Lab 04's GPT, batches and PyTorch variants (``lablib.parallel.zero_states``, which lab 04's run uses too: DDP,
DDP + ZeroRedundancyOptimizer, FSDP2 with and without resharding after the forward, and FSDP2 gathering bf16
copies of its fp32 shards and reducing the gradients in fp32), plus the students' classes:

- ``zero1_yours``  DDP (``gradient_as_bucket_view=True``, not DDP's default) + the student's
                   ``ShardedOptimizer(AdamW)``;
- ``zero2_yours``  the student's ``ZeRO2(model, AdamW)``: no DDP, its own reduce-scatter and all-gather;
- ``zero3_yours``  the student's ``ZeRO3(model, model.h, AdamW)``: each transformer block a unit, gathered in
                   its hooks (the blocks' shards count as parameters);
- ``zero3_yours_bf16``  the same with ``param_dtype=torch.bfloat16, reduce_dtype=torch.float32``: FSDP2 bf16's
                   policy, so the two's collectives compare.

Every variant trains the same AdamW steps from the same weights on the same batches. In the last step each rank
counts what it holds after the forward, the backward and the step (storages, each once: ``memory.model_state_bytes``
for PyTorch's variants, ``held.held_bytes`` for the students', which also finds state kept under any
name; DDP's buckets, which exist from its construction, at every moment once a backward has shown them) and
records every collective it calls (``lablib.measure.counting``; DDP's bucket all-reduces through its communication
hook), with when each was called and completed (rank 0's, for the per-call timeline); one more step is sampled at every module boundary (``HeldTimeline``). Each step is timed
(``lablib.measure.timing``), and the two ZeRO-1s (yours and PyTorch's) are timed again taking turns
(``paired_step_times``); rank 0 writes losses, bytes, collectives, the timelines and times, and with them
``formula_slack_bytes``: how far above lab 04's formula each variant's fullest rank may be, from what the formula
leaves out (AdamW's step counters, whole tensors, padded rows and shards).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lablib.jobs.distenv import gather_objects
from lablib.measure import counting, memory, rankcheck, timing
from lablib.jobs import script
from lablib.jobs.exercise import load_fresh as load_impl
from lablib.jobs.exercise import require_file
from lablib.course.models import GPT
from lablib.parallel import zero_states
from lablib.parallel.zero_states import Config as Lab04Config, apply_ddp, batches, held_params, shard_every_layer
from lablib.labs.zero_from_scratch.held import held_bytes

VARIANTS = ("ddp", "zero1_torch", "zero1_yours", "zero2_yours", "zero3_yours", "fsdp2_grad_op", "fsdp2_full",
            "fsdp2_bf16", "zero3_yours_bf16")
STAGE = {"ddp": 0, "zero1_torch": 1, "zero1_yours": 1, "zero2_yours": 2, "zero3_yours": 3, "fsdp2_grad_op": 2,
         "fsdp2_full": 3, "fsdp2_bf16": 3, "zero3_yours_bf16": 3}
MEASURED = VARIANTS[:-2]     # compared with lab 04's fp32 formula (the bf16 variants are there for their collectives)
PHASES = ("after_forward", "after_backward", "after_step")


@dataclass(frozen=True)
class Config:
    zero1_impl: str = "zero1_impl.py"   # the exercise files the notebook writes
    zero2_impl: str = "zero2_impl.py"
    zero3_impl: str = "zero3_impl.py"
    variants: tuple[str, ...] = VARIANTS
    steps: int = 4                      # AdamW steps per variant; bytes and collectives from the last one
    warmup: int = 1                     # steps left out of the step time
    rounds: int = 12                    # paired timing of the two ZeRO-1s and a self pair: rounds of turns
    round_steps: int = 2                # steps of each arm per round, the arms alternating step by step
    timeline: bool = True               # one more step per variant, memory sampled at every module boundary

    def validate(self) -> None:
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or not self.variants:
            raise ValueError(f"variants={self.variants!r}: unknown {unknown}; choose from {', '.join(VARIANTS)}")
        if self.steps < 2 or not 0 <= self.warmup < self.steps:
            raise ValueError(f"steps={self.steps} (at least 2) and warmup={self.warmup} (fewer than steps)")
        if not 1 <= self.round_steps <= self.steps or self.rounds < 0:
            raise ValueError(f"round_steps={self.round_steps} must lie in 1..steps={self.steps} (each round reuses the "
                             f"first batches) and rounds={self.rounds} must be at least 0")
        for v, path in (("zero1_yours", self.zero1_impl), ("zero2_yours", self.zero2_impl),
                        ("zero3_yours", self.zero3_impl)):
            if v in self.variants:
                require_file(path)

    def lab04(self) -> Lab04Config:
        """Lab 04's model, batch and AdamW settings, for as many steps as this run takes."""
        return Lab04Config(steps=self.steps)

    def validate_world(self, world_size: int) -> None:
        self.lab04().validate_world(world_size)


class _Stepper:
    """One interface over the variants: forward-backward, then the update, then clearing the gradients."""

    def __init__(self, env, config: Config, variant: str):
        lab04 = config.lab04()
        torch.manual_seed(lab04.seed)       # the same initial weights on every rank and in every variant
        self.model = GPT(lab04.gpt()).to(env.device)
        self.log = counting.CollectiveLog()
        self.sharded, self.students, self.shards, self.buckets = [], None, [], []
        hyper = {"lr": lab04.lr, "weight_decay": lab04.weight_decay}
        if variant in ("ddp", "zero1_torch"):
            self.wrapped, self.opt = apply_ddp(self.model, lab04, zero1=variant == "zero1_torch")
            counting.count_ddp(self.wrapped, self.log)
        elif variant == "zero1_yours":
            self.wrapped, _ = apply_ddp(self.model, lab04, zero1=False)
            counting.count_ddp(self.wrapped, self.log)
            impl = load_impl(config.zero1_impl, ("ShardedOptimizer",))
            self.opt = self.students = impl.ShardedOptimizer(self.wrapped.parameters(), torch.optim.AdamW, **hyper)
        elif variant == "zero2_yours":
            impl = load_impl(config.zero2_impl, ("ZeRO2",))
            self.wrapped = self.model
            self.opt = self.students = impl.ZeRO2(self.model, torch.optim.AdamW, **hyper)
        elif variant in ("zero3_yours", "zero3_yours_bf16"):
            impl = load_impl(config.zero3_impl, ("ZeRO3",))
            self.wrapped = self.model
            # the bf16 variant: fsdp2_bf16's policy (bf16 gathers of the fp32 master shards, fp32 reduction)
            mixed = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if variant.endswith("bf16") else {}
            self.opt = self.students = impl.ZeRO3(self.model, list(self.model.h), torch.optim.AdamW, **mixed, **hyper)
            self.shards = [u.shard for u in self.students.all_units()]   # its parameters at rest
        elif variant == "fsdp2_bf16":     # bf16 copies gathered, fp32 shards the master copy, fp32 reduction
            self.wrapped = shard_every_layer(self.model, reshard_after_forward=True, param_dtype=torch.bfloat16,
                                             reduce_dtype=torch.float32)
            self.opt = torch.optim.AdamW(self.model.parameters(), **hyper)
            self.sharded = list(self.model.parameters())
        else:
            self.wrapped = shard_every_layer(self.model, reshard_after_forward=variant == "fsdp2_full")
            self.opt = torch.optim.AdamW(self.model.parameters(), **hyper)
            self.sharded = list(self.model.parameters())

    def keep_buckets(self) -> None:
        """DDP's gradient buckets: allocated when DDP is constructed (its Reducer, torch/nn/parallel/distributed.py:1437;
        measured: the process grows by the gradients' size at construction, with either gradient_as_bucket_view),
        seen here once the gradients are views of them (after a backward, gradient_as_bucket_view=True), and kept
        in the count from then on: zero_grad(set_to_none) drops the views, not the buckets."""
        if isinstance(self.wrapped, torch.nn.parallel.DistributedDataParallel) and not self.buckets:
            self.buckets = [p.grad for p in self.model.parameters() if p.grad is not None]

    def held(self) -> dict:
        if self.students is not None:
            out = held_bytes(self.model, self.students, self.shards)
        else:
            out = memory.model_state_bytes(held_params(self.model, self.sharded), self.opt)
        if self.buckets:            # the buckets' storages, each once, whether a gradient points into them or not
            out["grads"] = memory.unique_storage_bytes(self.buckets)
            out["total"] = out["params"] + out["grads"] + out["optimizer"]
        return out


class HeldTimeline(memory.MemoryTimeline):
    """``memory.MemoryTimeline`` (samples at every module's forward and backward boundary) with the stepper's own
    count of the model states: ``held.held_bytes`` for the students' classes (state kept under any name,
    a shard's gradient included), ``memory.model_state_bytes`` for PyTorch's. The optimizer step is sampled by
    the caller (the students' ZeRO2 is no ``torch.optim.Optimizer``, so it has no step hooks)."""

    def __init__(self, stepper: "_Stepper"):
        super().__init__(stepper.wrapped, None)
        self.stepper = stepper

    def sample(self, event: str, phase: str) -> None:
        row = {"event": event, "phase": phase,
               **{k: v for k, v in self.stepper.held().items() if k != "total"},
               "activations": memory.unique_storage_bytes(self.saved.alive())}
        row["total"] = row["params"] + row["grads"] + row["optimizer"] + row["activations"]
        self.samples.append(row)


def one_step(s: "_Stepper", env, x, y) -> torch.Tensor:
    s.opt.zero_grad()
    _, loss = s.wrapped(x.to(env.device), y.to(env.device))
    loss.backward()
    s.keep_buckets()
    s.opt.step()
    return loss


def paired_step_times(env, config: Config, steps) -> dict:
    """Your ShardedOptimizer, ZeroRedundancyOptimizer and a second ShardedOptimizer (the noise floor: a strategy
    timed against itself) taking turns step by step: in a round each arm runs ``round_steps`` steps, one at a time,
    the arms alternating, in one of the six orders of the three (``timing.turn_order``: each used twice in 12 rounds),
    reversed at every other step (A B C, C B A, ...) so that no arm always follows the same one. A burst of load
    then lasts long enough to fall on all three arms of a step. Per round the ratios of the medians (each step the
    slowest rank's), then the median of each ratio over the rounds and its range, and ``timing.noise_verdict``'s
    reading of the ratios against the self ratios (a verdict only when enough rounds lie beyond every self-ratio
    round that noise alone would print one less than 5 % of the time, and not both ways). Costs the same steps as
    running the arms in blocks: only their order differs."""
    trio = {"zero1_yours": _Stepper(env, config, "zero1_yours"), "zero1_torch": _Stepper(env, config, "zero1_torch"),
            "zero1_yours_again": _Stepper(env, config, "zero1_yours")}
    for s in trio.values():                    # warm-up: the first step builds buckets and optimizer state
        one_step(s, env, *steps[0])
    rounds = []
    for r in range(config.rounds):
        per_step = {v: [] for v in trio}
        order = timing.turn_order(trio, r)
        for i, (x, y) in enumerate(steps[:config.round_steps]):
            for v in (order if i % 2 == 0 else order[::-1]):
                timing.barrier(env.device)
                with timing.stopwatch(per_step[v], env.device):
                    one_step(trio[v], env, x, y)
        times = {v: timing.median(timing.slowest_rank(t, env.device)) for v, t in per_step.items()}
        rounds.append({**times, "ratio": times["zero1_yours"] / times["zero1_torch"],
                       "self_ratio": times["zero1_yours"] / times["zero1_yours_again"]})
    ratios, selfs = [r["ratio"] for r in rounds], [r["self_ratio"] for r in rounds]
    return {"rounds": rounds, "median_ratio": timing.median(ratios), "ratio_range": [min(ratios), max(ratios)],
            "median_self_ratio": timing.median(selfs), "self_ratio_range": [min(selfs), max(selfs)],
            "verdict": timing.noise_verdict(ratios, selfs, comparisons=1)}


def train_variant(env, config: Config, variant: str, steps) -> dict:
    s = _Stepper(env, config, variant)
    losses, held, times = [], {}, []
    timeline = None
    for i, (x, y) in enumerate(steps):
        last = i == len(steps) - 1
        s.log.reset()
        timing.barrier(env.device)
        with counting.count_collectives(s.log), timing.stopwatch(times, env.device):
            s.opt.zero_grad()
            s.log.phase = "forward"
            _, loss = s.wrapped(x.to(env.device), y.to(env.device))
            if last:
                held["after_forward"] = s.held()
            s.log.phase = "backward"
            loss.backward()
            s.keep_buckets()
            if last:
                held["after_backward"] = s.held()
            s.log.phase = "step"
            s.opt.step()
        if last:
            held["after_step"] = s.held()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)            # equal shares: the mean of the ranks' means
        losses.append(global_loss.item() / env.world_size)
    calls, t0 = {}, min((c.launched_s for c in s.log.calls), default=0.0)
    # The last step's calls in order, for the per-unit timeline: when each was launched and done, from the first.
    timeline_calls = [{"name": c.name, "bytes": c.bytes, "phase": c.phase, "launched_s": c.launched_s - t0,
                       "done_s": (c.done_s - t0) if c.done_s is not None else None} for c in s.log.calls]
    for c in s.log.calls:                       # the last step's collectives, by name
        entry = calls.setdefault(c.name, {"calls": 0, "bytes": 0, "bus_bytes": 0.0})
        entry["calls"] += 1
        entry["bytes"] += c.bytes
        entry["bus_bytes"] += c.bus_bytes
    held["peak_phase"] = max(PHASES, key=lambda p: held[p]["total"])
    if config.timeline:        # one more step, after the counts above: untimed, sampled at every module boundary
        x, y = steps[-1]
        s.opt.zero_grad()
        with HeldTimeline(s) as timeline:
            s.wrapped(x.to(env.device), y.to(env.device))[1].backward()
            timeline.sample("optimizer.step", "optimizer")
            s.opt.step()
            timeline.sample("optimizer.step done", "optimizer")
    return {"losses": losses, "memory": held, "collectives": calls, "calls": timeline_calls if env.is_main else None,
            "timeline": timeline.samples if timeline is not None and env.is_main else None,   # rank 0's
            **timing.step_times(times, env.device, warmup=config.warmup)}


def formula_slack_bytes(model: GPT, world_size: int) -> dict[str, float]:
    """Bytes each variant's fullest rank may hold above lab 04's fp32 + AdamW formula, at the moment the notebook
    compares it (between steps; the peak for FSDP2 and ZeRO3). PyTorch's variants and ShardedOptimizer (whole
    parameters, largest first to the least loaded rank): ``zero_states.formula_slack_bytes``. ZeRO2: one flat buffer
    of N ceil(Phi/N) elements holds the parameters, and a shard of ceil(Phi/N) its gradient and its two moments, with
    one 4-byte step. ZeRO3: per unit (each block, then the root's parameters) shards of ceil(n_u/N) in parameters,
    gradients and moments, and a step per unit."""
    n = world_size
    slack = zero_states.formula_slack_bytes([list(p.shape) for p in model.parameters()], n)
    phi = sum(p.numel() for p in model.parameters())
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.h]
    units = blocks + [phi - sum(blocks)]
    padding = -(-phi // n) * n - phi                                  # ZeRO2's flat buffer, in elements
    unit_padding = sum(-(-u // n) * n - u for u in units)              # ZeRO3's, over the units
    return {"ddp": slack["ddp"], "zero1_torch": slack["zero1"], "zero1_yours": slack["zero1"],
            "zero2_yours": zero_states.ADAM_STEP_BYTES + 4 * padding + (4 + 8) * padding / n,
            "zero3_yours": zero_states.ADAM_STEP_BYTES * len(units) + (4 + 4 + 8) * unit_padding / n,
            "fsdp2_grad_op": slack["fsdp_grad_op"], "fsdp2_full": slack["fsdp_full"], "fsdp2_bf16": slack["fsdp_full"],
            "zero3_yours_bf16": zero_states.ADAM_STEP_BYTES * len(units) + (4 + 4 + 8) * unit_padding / n}


def run(env, config: Config) -> dict:
    steps = batches(config.lab04(), env.rank, env.world_size)
    model = GPT(config.lab04().gpt())
    n_params = sum(p.numel() for p in model.parameters())
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.h]
    result = {"n_params": n_params, "world_size": env.world_size, "stage": STAGE, "variants": {},
              "formula_slack_bytes": formula_slack_bytes(model, env.world_size),
              # ZeRO3's collectives move every unit padded to N ceil(n_u / N) elements (blocks, then the root's rest)
              "zero3_padded_numel": sum(-(-u // env.world_size) * env.world_size
                                        for u in blocks + [n_params - sum(blocks)])}
    for i, variant in enumerate(config.variants):
        mine = train_variant(env, config, variant, steps)
        result["variants"][variant] = {**mine, "memory_per_rank": gather_objects(mine.pop("memory"), env)}
        script.progress(env, i + 1, len(config.variants), variant=variant, loss=mine["losses"][-1])
    if {"zero1_yours", "zero1_torch"} <= set(config.variants) and config.rounds > 0:
        result["paired"] = paired_step_times(env, config, steps)
    dist.barrier()   # every rank leaves together
    return result


def main() -> None:
    script.main(Config, run)


if __name__ == "__main__":
    main()
