"""Lab 06's measurements: the students' DDP classes against PyTorch's DDP on the course GPT, on 2 ranks.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m lablib.labs.ddp_from_scratch.run_ddp_overlap --out out.json

Four parts, one torchrun start, every variant trained from the same initial weights on the same batches
(Tiny Shakespeare, each rank its contiguous half of every global batch):

- ``timeline``: steps of ``DDPIndividualParameters``, ``DDPBucketed`` and PyTorch's DDP (with a Python hook that
  timestamps its buckets), the three taking turns step by step, per rank (``timeline``: perf_counter on the CPU, a
  profiler trace on GPUs), and the hidden fraction by DDP's own definition: per step (median and range) and as
  DDP's logger computes it (mean overlap over mean communication, iterations 1-10), next to what DDP's reducer
  reports about itself.
- ``sweep``: median step time of ``DDPBucketed`` at bucket caps from one bucket per parameter to one bucket,
  all caps taking turns step by step (who goes first rotates), the benchmark's cap twice (the noise floor: each
  cap's per-step ratio to that cap is judged against the twin's by ``timing.noise_verdict``), with the parts the
  alpha-beta model needs measured in the same run: forward, backward and optimizer time with no communication,
  and standalone all-reduces of several sizes (``allreduce_repeats`` each, the sizes taking turns);
  and, per cap, the same phases timed inside its own steps (what the model is not fed: hooks, copies, gloo's
  threads on the cores the backward runs on). Buckets are counted apart from the one usage-map all-reduce.
- ``benchmark``: ``DDPBucketed`` against DDP at the same cap, paired: ``rounds`` rounds, each a few steps of
  three arms taking turns step by step on the same batches (yours, DDP, and a second DDP: the noise floor, the
  same code timed against itself; which arm goes first rotates by round), the ratios of the medians per round,
  then the median and the range of the ratios.
  Bytes per step are counted where the collective is called (``lablib.measure.counting``).
- ``compression``: DDP with communication hooks (none, ``fp16_compress_hook``, PowerSGD rank 1): all-reduce
  bytes per step and the loss after the same number of steps.
"""

from __future__ import annotations

import math
import statistics
import time
from types import SimpleNamespace
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from lablib.course import commcost, scaling
from lablib.measure import counting, timing
from lablib.labs.ddp_from_scratch.timeline import (BlockTimes, ddp_style_fraction, grad_bytes_and_count,  # noqa: F401
                                                   overlap_fraction, record_step, without_usage_map,
                                                   grad_ready_hook)
from lablib.jobs import script
from lablib.jobs import config as cfg
from lablib.jobs.exercise import load_fresh, require_file
from lablib.jobs.distenv import gather_objects
from lablib.labs.ddp_from_scratch.order import buckets_and_usage_map
from lablib.labs.ddp_from_scratch.training import PHASES, Batches, finish, new_gpt, train_step, wrap  # noqa: F401


COMPRESSION_CAP_MB = 1000.0


@dataclass(frozen=True)
class Config:
    individual_impl: str = "ddp_individual_impl.py"   # exercise 1's module file
    bucketed_impl: str = "ddp_bucketed_impl.py"       # exercise 3's (it imports exercise 2's buckets_impl.py)
    parts: tuple[str, ...] = ("timeline", "sweep", "benchmark", "compression")
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    batch_per_rank: int = 8                   # sequences per rank per step
    bucket_size_mb: float = 0.5               # the timeline's and the benchmark's cap, both classes and DDP
    sweep_caps_mb: tuple[float, ...] = (1e-6, 0.05, 0.1, 0.25, 0.5, 100.0)
    sweep_rounds: int = 8                     # steps per cap (taking turns, who goes first rotating)
    allreduce_repeats: int = 30               # standalone all-reduces per size (sizes taking turns)
    timeline_steps: int = 12                  # DDP's logger averages iterations 1-10: at least 11
    rounds: int = 6                           # benchmark rounds (median of the per-round ratios; 3 orders x 2)
    steps_per_round: int = 4
    compression_steps: int = 40
    lr: float = 3e-3                          # SGD, timeline, sweep and benchmark
    compression_lr: float = 1e-3              # AdamW, compression
    seed: int = 0

    def validate(self) -> None:
        cfg.require_at_least_one(self, "n_layer", "n_head", "n_embd", "block_size", "batch_per_rank", "sweep_rounds",
                                 "rounds", "steps_per_round", "compression_steps", "allreduce_repeats")
        known = {"timeline", "sweep", "benchmark", "compression"}
        if not set(self.parts) <= known:
            raise ValueError(f"parts={self.parts}: each must be one of {sorted(known)}")
        if self.timeline_steps < 11:
            raise ValueError(f"timeline_steps={self.timeline_steps} must be at least 11: DDP's logger reports the "
                             f"average of its iterations 1-10")
        if self.bucket_size_mb <= 0 or min(self.sweep_caps_mb) <= 0:
            raise ValueError(f"bucket caps must be positive MiB, got {self.bucket_size_mb} and {self.sweep_caps_mb}")
        if "sweep" in self.parts and self.bucket_size_mb not in self.sweep_caps_mb:
            raise ValueError(f"bucket_size_mb={self.bucket_size_mb} must be one of sweep_caps_mb={self.sweep_caps_mb}: "
                             f"the sweep times that cap twice, as its noise floor")
        require_file(self.individual_impl)
        require_file(self.bucketed_impl)

    def validate_world(self, world_size: int) -> None:
        if world_size < 2:
            raise ValueError(f"this step compares data-parallel ranks: start it with nproc >= 2, got {world_size}")


# --- timeline ----------------------------------------------------------------------------------------------------

TIMELINE_VARIANTS = ("individual", "bucketed", "ddp")


def timeline(env, config: Config, impl, batches: Batches) -> dict:
    setups = {}
    for variant in TIMELINE_VARIANTS:
        gpt = new_gpt(config, env)
        blocks = BlockTimes(gpt)
        recorder = counting.CollectiveLog()
        with counting.count_collectives(recorder):
            model = wrap(variant, impl, gpt, config.bucket_size_mb)
        # When each gradient became final (after the wrapper's own hook): the last one ends the backward's
        # compute, DDP's kBackwardComputeEnd; DDP's backward() returns only after its all-reduces are done.
        grad_ready: list[float] = []
        for p in gpt.parameters():
            p.register_post_accumulate_grad_hook(grad_ready_hook(grad_ready, profiled=env.device.type == "cuda"))
        bucket_timer = None
        if variant == "ddp":
            # A Python communication hook that timestamps each bucket's all-reduce (the benchmark's DDP has none).
            bucket_timer = scaling.BucketTimer()
            model.register_comm_hook(bucket_timer, scaling.BucketTimer.hook)
        setups[variant] = SimpleNamespace(gpt=gpt, blocks=blocks, recorder=recorder, model=model, grad_ready=grad_ready,
                                          bucket_timer=bucket_timer, steps=[],
                                          optimizer=torch.optim.SGD(model.parameters(), lr=config.lr))
    # The variants take turns step by step, in all six orders in turn (timing.turn_order), so a burst of load from
    # another program falls on all three rather than on whichever ran its steps at that moment, and none always
    # runs right after the same one. DDP's logger averages its iterations 1-10; every variant gets as many steps.
    for step in range(config.timeline_steps):
        batch = batches.rank_batch(step)
        for variant in timing.turn_order(TIMELINE_VARIANTS, step):
            v = setups[variant]
            v.optimizer.zero_grad()
            v.recorder.reset()
            v.grad_ready.clear()
            if v.bucket_timer is not None:
                v.bucket_timer.start_step()
            timing.barrier(env.device)
            v.steps.append(record_step(env, v.model, batch, lambda m=v.model: finish(m), v.optimizer, v.recorder,
                                       v.grad_ready, v.blocks, v.bucket_timer))
    out = {}
    for variant, v in setups.items():
        # Iteration 0 builds buckets and warms caches; DDP *rebuilds* its buckets at the start of iteration 1
        # (reducer.hpp's rebuild_buckets, in its second forward), so that step is left out too, for every variant
        # alike. DDP's own logger still averages its iterations 1-10, the rebuild included.
        timed = v.steps[2:]
        if variant == "bucketed":
            timed = [without_usage_map(s, *grad_bytes_and_count(v.gpt)) for s in timed]
        fractions = [s["overlap_fraction"] for s in timed]
        mine = {"clock": "gpu profiler trace" if env.device.type == "cuda" else "cpu perf_counter",
                "median_overlap_fraction": statistics.median(fractions), "overlap_fractions": fractions,
                # DDP's own statistic on the same iterations it averages (1-10): mean overlap / mean communication
                "ddp_style_overlap_fraction": ddp_style_fraction(v.steps[1:11]),
                # this rank's own forward + backward compute (the last gradient final): the ranks' imbalance
                "median_compute_s": statistics.median(s["compute_end"] for s in timed),
                # from the last gradient final to the gradients synchronized: what the backward did not hide
                "median_tail_s": statistics.median(s["finish_end"] - s["compute_end"] for s in timed),
                # the drawn step: the middle one in time order (timed step len // 2), not the median step
                "step": timed[len(timed) // 2], "step_index": len(timed) // 2 + 2,
                "rank_median_step_s": statistics.median(s["end"] for s in timed),
                "rank_step_s": [s["end"] for s in timed]}   # this rank's own: the timeline is per rank
        if variant == "ddp":
            logged = v.model._get_ddp_logging_data()   # what DDP's logger reports about itself (ns)
            comm_ns = logged.get("avg_backward_comm_time", 0)
            mine["ddp_self_report"] = {k: logged.get(k) for k in (
                "avg_forward_compute_time", "avg_backward_compute_time", "avg_backward_comm_time",
                "avg_backward_compute_comm_overlap_time", "iteration", "rebuilt_bucket_sizes")}
            mine["ddp_self_report"]["overlap_fraction"] = (
                logged.get("avg_backward_compute_comm_overlap_time", 0) / comm_ns if comm_ns else None)
        out[variant] = gather_objects(mine, env)
    return out


# --- bucket-size sweep ------------------------------------------------------------------------------------------

def sweep(env, config: Config, impl, batches: Batches) -> dict:
    caps = list(config.sweep_caps_mb)
    # The arms: one per cap, and the benchmark's cap once more (a second model at the same cap): the noise floor,
    # the same code timed against itself, its per-step ratio to its twin.
    arms = list(range(len(caps))) + ["again"]
    arm_cap = {**{i: c for i, c in enumerate(caps)}, "again": config.bucket_size_mb}
    models = {a: wrap("bucketed", impl, new_gpt(config, env), arm_cap[a]) for a in arms}
    optimizers = {a: torch.optim.SGD(m.parameters(), lr=config.lr) for a, m in models.items()}
    plain = new_gpt(config, env)                    # no communication: forward, backward, step timed apart
    plain_opt = torch.optim.SGD(plain.parameters(), lr=config.lr)
    times = {a: [] for a in arms}
    phases = {a: {k: [] for k in PHASES} for a in arms}   # the same phases inside each cap's own steps
    parts = {"forward_s": [], "backward_s": [], "opt_s": []}
    buckets, usage_map = {}, {}
    grad_bytes, n_params = grad_bytes_and_count(plain)
    for step in range(config.sweep_rounds + 1):     # the first round is warm-up
        batch = batches.rank_batch(step)
        for a in timing.turn_order(arms, step, config.seed):   # the arms take turns step by step, shuffled each step
            timing.barrier(env.device)
            if step == 0:                            # warm-up: count the buckets (not timed), the usage map apart
                with counting.count_collectives() as log:
                    train_step(models[a], optimizers[a], batch)
                sent = [c.bytes for c in log.calls if c.name == "all_reduce"]
                positions, j = buckets_and_usage_map(sent, grad_bytes, n_params)
                buckets[a], usage_map[a] = len(positions), j is not None
            with timing.stopwatch(times[a], env.device):
                train_step(models[a], optimizers[a], batch, phases[a] if step > 0 else None)
        plain_opt.zero_grad(set_to_none=True)
        timing.barrier(env.device)
        with timing.stopwatch(parts["forward_s"], env.device):
            loss = plain(*batch)[1]
        with timing.stopwatch(parts["backward_s"], env.device):
            loss.backward()
        with timing.stopwatch(parts["opt_s"], env.device):
            plain_opt.step()
    sizes = [2**k for k in range(10, 23, 2)]        # 1 kB .. 4 MB
    steps = {a: timing.step_times(times[a], env.device, warmup=1) for a in arms}
    # Per step, each cap's time over the reference cap's (the benchmark's), and the reference's twin over it: the
    # floor. The same rule as lab 01's table and the benchmark (timing.noise_verdict) decides what this run tells apart.
    ref = caps.index(config.bucket_size_mb)
    per_step = lambda a: [x / y for x, y in zip(steps[a]["step_s"], steps[ref]["step_s"])]
    floor = per_step("again")
    others = [i for i in range(len(caps)) if i != ref]
    verdicts = [None if i == ref else timing.noise_verdict(per_step(i), floor, comparisons=len(others))
                for i in range(len(caps))]
    ar = timing.allreduce_times(env, sizes, config.allreduce_repeats)
    return {"caps_mb": caps, "n_buckets": [buckets[i] for i in range(len(caps))],
            "usage_map": [usage_map[i] for i in range(len(caps))],
            "grad_bytes": grad_bytes, "n_params": n_params, "reference_cap_mb": config.bucket_size_mb,
            "median_step_s": [steps[i]["median_step_s"] for i in range(len(caps))],
            "step_s": [steps[i]["step_s"] for i in range(len(caps))],
            "ratio_to_reference": [per_step(i) for i in range(len(caps))], "floor_ratios": floor,
            "again_step_s": steps["again"]["step_s"], "verdicts": verdicts,
            # per cap, each phase's median over its steps of the slowest rank. The phases need not add up to the
            # step: where one rank computes longer, the other waits for it in finish (the all-reduces pair them)
            "phases_s": [{k: timing.step_times(v, env.device)["median_step_s"] for k, v in phases[i].items()}
                         for i in range(len(caps))],
            **{k: timing.step_times(v, env.device, warmup=1)["median_step_s"] for k, v in parts.items()},
            "allreduce_bytes": sizes, "allreduce_all_s": ar, "allreduce_s": [timing.median(t) for t in ar]}


# --- benchmark ----------------------------------------------------------------------------------------------------

ARMS = ("bucketed", "ddp", "ddp_again")   # yours, DDP, and DDP again: the noise floor (DDP against itself)


def benchmark(env, config: Config, impl, batches: Batches) -> dict:
    variants = {v: wrap(v.removesuffix("_again"), impl, new_gpt(config, env), config.bucket_size_mb) for v in ARMS}
    optimizers = {v: torch.optim.SGD(m.parameters(), lr=config.lr) for v, m in variants.items()}
    for _ in range(2):                              # warm-up: DDP builds its buckets at step 0, rebuilds them at step 1
        for v in variants:
            train_step(variants[v], optimizers[v], batches.rank_batch(0))
    rounds = []
    for r in range(config.rounds):
        order = timing.turn_order(ARMS, r)         # the six orders of the three arms, one per round
        times = {v: [] for v in variants}
        for i in range(config.steps_per_round):   # step by step, A B C C B A ...: a burst of load hits all three
            batch = batches.rank_batch(1 + r * config.steps_per_round + i)   # the same batch for all
            for v in (order if i % 2 == 0 else order[::-1]):
                timing.barrier(env.device)
                with timing.stopwatch(times[v], env.device):
                    train_step(variants[v], optimizers[v], batch)
        medians = {v: timing.median(timing.slowest_rank(t, env.device)) for v, t in times.items()}
        rounds.append({**medians, "ratio": medians["bucketed"] / medians["ddp"],
                       "noise_ratio": medians["ddp_again"] / medians["ddp"],
                       # against both DDP copies (their geometric mean): the reference's own noise halved in the log
                       "ratio_to_both": medians["bucketed"] / math.sqrt(medians["ddp"] * medians["ddp_again"])})
    # Bytes per step, counted where the collective is called: the students' class through torch.distributed,
    # DDP's reducer through a communication hook (on a separate copy, so the timed DDP has no Python hook).
    with counting.count_collectives() as mine:
        train_step(variants["bucketed"], optimizers["bucketed"], batches.rank_batch(0))
    counted = DDP(new_gpt(config, env), bucket_cap_mb=config.bucket_size_mb)
    theirs = counting.count_ddp(counted)
    opt = torch.optim.SGD(counted.parameters(), lr=config.lr)
    for _ in range(2):                               # the second step, after DDP's bucket rebuild
        theirs.reset()
        train_step(counted, opt, batches.rank_batch(0))
    grad_bytes, n_params = grad_bytes_and_count(counted.module)
    mine_sent = [c.bytes for c in mine.calls if c.name == "all_reduce"]
    positions, j = buckets_and_usage_map(mine_sent, grad_bytes, n_params)
    ratios, noise = [r["ratio"] for r in rounds], [r["noise_ratio"] for r in rounds]
    return {"cap_mb": config.bucket_size_mb, "rounds": rounds, "median_ratio": statistics.median(ratios),
            "median_ratio_to_both": statistics.median(r["ratio_to_both"] for r in rounds),
            "ratio_range": [min(ratios), max(ratios)], "median_noise_ratio": statistics.median(noise),
            "noise_ratio_range": [min(noise), max(noise)],
            "bucket_bytes": {"bucketed": [mine_sent[i] for i in positions],
                             "ddp": [c.bytes for c in theirs.calls if c.name == "all_reduce"]},
            "usage_map_bytes": None if j is None else mine_sent[j],
            "median_step_s": {v: statistics.median(r[v] for r in rounds) for v in variants},
            "step_range_s": {v: [min(r[v] for r in rounds), max(r[v] for r in rounds)] for v in variants},
            "bytes_per_step": {"bucketed": mine.bytes("all_reduce"), "ddp": theirs.bytes("all_reduce")},
            "all_reduces_per_step": {"bucketed": mine.count("all_reduce"), "ddp": theirs.count("all_reduce")},
            "bus_bytes_per_step": {"bucketed": mine.bus_bytes("all_reduce"), "ddp": theirs.bus_bytes("all_reduce")}}


# --- compression hooks -------------------------------------------------------------------------------------------

def compression(env, config: Config, batches: Batches) -> dict:
    out, weights = {}, {}
    eval_batch = [batches.rank_batch(10**6 + i) for i in range(2)]
    for name in ("none", "fp16", "powersgd"):
        # One bucket: PowerSGD chains its all-reduces in completion callbacks, which gloo runs on its own
        # threads; with several buckets the ranks can then issue them in different orders (seen here: gloo
        # aborts with "collective mismatch"). With one bucket there is one chain, the same on every rank.
        model = DDP(new_gpt(config, env), bucket_cap_mb=COMPRESSION_CAP_MB)
        if name == "none":
            log = counting.count_ddp(model)          # DDP's default all-reduce, recorded by a hook
        elif name == "fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        else:
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                start_powerSGD_iter=2)
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.compression_lr)
        losses, per_step = [], []
        for step in range(config.compression_steps):
            with counting.count_collectives() as calls:
                if name == "none":
                    log.reset()
                losses.append(train_step(model, optimizer, batches.rank_batch(step)))
            per_step.append(log.bytes("all_reduce") if name == "none" else calls.bytes("all_reduce"))
        with torch.no_grad():
            val = statistics.mean(model.module(*b)[1].item() for b in eval_batch)
        t = torch.tensor([val], device=env.device)
        dist.all_reduce(t)
        # Was the hook applied? The same steps without it end on other weights (identical only if it did nothing).
        weights[name] = [p.detach().clone() for p in model.module.parameters()]
        diff = max((a - b).abs().max().item() for a, b in zip(weights[name], weights["none"]))
        out[name] = {"bytes_per_step": per_step, "losses": losses, "final_loss": t.item() / env.world_size,
                     "max_abs_weight_diff_vs_none": diff}
    return out


def run(env, config: Config) -> dict:
    impl = SimpleNamespace(
        DDPIndividualParameters=load_fresh(config.individual_impl, ("DDPIndividualParameters",)).DDPIndividualParameters,
        DDPBucketed=load_fresh(config.bucketed_impl, ("DDPBucketed",)).DDPBucketed)
    batches = Batches(config, env)
    result = {"threads_per_rank": torch.get_num_threads(), "n_params": new_gpt(config, env).num_params()}
    parts = {"timeline": lambda: timeline(env, config, impl, batches),
             "sweep": lambda: sweep(env, config, impl, batches),
             "benchmark": lambda: benchmark(env, config, impl, batches),
             "compression": lambda: compression(env, config, batches)}
    for i, name in enumerate(config.parts):
        t0 = time.perf_counter()
        result[name] = parts[name]()
        result[f"{name}_s"] = time.perf_counter() - t0
        script.progress(env, i + 1, len(config.parts))
    if env.is_main and "sweep" in result:
        s = result["sweep"]
        s["alpha_s"], s["beta_s_per_byte"] = commcost.fit_alpha_beta(s["allreduce_bytes"], s["allreduce_s"])
        # The fit's spread: the same fit on every third repeat, three ways (repeats 1, 4, 7, ...; 2, 5, 8, ...; ...).
        thirds = [[statistics.median(t[j::3]) for t in s["allreduce_all_s"]] for j in range(3)]
        s["alpha_beta_thirds"] = [commcost.fit_alpha_beta(s["allreduce_bytes"], t) for t in thirds]
    return result


def main() -> None:
    script.main(Config, run)


if __name__ == "__main__":
    main()
