"""Lab 05's step: one GPT, one workload, trained single-process, with DDP, DDP + accumulation, FSDP2,
FSDP2 + activation checkpointing, HSDP and Accelerate, each measured the same way (lablib.measure.benchmark).

    torchrun --standalone --nproc-per-node 1 -m lablib.labs.gpt_migration.run --variants single --out single.json
    torchrun --standalone --nproc-per-node 2 -m lablib.labs.gpt_migration.run --variants ddp,ddp_accum \\
        --ddp_impl ddp_impl.py --exchange_rounds 12 --out ddp.json
    torchrun --standalone --nproc-per-node 4 -m lablib.labs.gpt_migration.run \\
        --variants fsdp,hsdp --fsdp_impl fsdp_impl.py --steps 5 --trace_step true --out hsdp.json

Variants (run in the order given, each from the same initial weights, on the same global batch of
``batch_size`` sequences per optimizer step): see ``SETUPS``. The loop is ``training.train_loop``
(Accelerate's is the notebook's own); this file only sets each variant up and reports.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from lablib.jobs import config as cfg
from lablib.course import data
from lablib.jobs import script
from lablib.measure.benchmark import StepMeter
from lablib.measure.counting import count_ddp_models
from lablib.parallel.activation_checkpointing import apply_activation_checkpointing
from lablib.jobs.exercise import load_module, require_file
from lablib.measure.memory import local_tensor
from lablib.measure.rankcheck import (FP32_UNIT_ROUNDOFF, RecordingDataset, formula_rtol, samples_per_step,
                                      shard_report, weight_spread)
from lablib.jobs.distenv import gather_objects
from lablib.parallel.zero_states import fsdp_rows_per_rank
from lablib.labs.gpt_migration import training
from lablib.labs.gpt_migration.probes import fsdp_plan, probe_loader, probe_mean

DDP_FUNCTIONS = ("wrap_model", "make_loader", "start_epoch", "mean_across_ranks")


@dataclass(frozen=True)
class Config:
    variants: tuple[str, ...] = ("single",)
    ddp_impl: str = "ddp_impl.py"
    fsdp_impl: str = "fsdp_impl.py"
    accelerate_impl: str = "accelerate_impl.py"
    steps: int = 60                 # optimizer steps per variant
    measure_steps: int = 0          # steps of the variant only measured, not compared by loss (fsdp_ac); 0: steps
    exchange_rounds: int = 0        # after ddp: DDP against DDP inside no_sync() and DDP again, rounds taken in
                                    # turns (training.time_exchange); 0: not timed
    accum_rounds: int = 12          # after ddp_accum: sync_every, no_sync, no_sync again in turns (time_accumulation)
    trace_step: bool = False        # one more step watched: memory at every module boundary, collectives' groups
    batch_size: int = 16            # sequences per optimizer step, all ranks together (the global batch)
    accum_steps: int = 4            # micro-batches per step in ddp_accum
    val_batch_size: int = 32        # validation sequences per forward, all ranks together
    val_blocks: int = 64            # validation sequences (the first ones of the validation split)
    eval_every: int = 10
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    lr: float = 3e-3
    seed: int = 0
    ckpt_dir: str = ""              # DDP's rank-0 checkpoint and FSDP2's DCP checkpoint go here ('' = none)

    def validate(self) -> None:
        unknown = [v for v in self.variants if v not in SETUPS]
        if unknown or not self.variants:
            raise ValueError(f"variants={self.variants}: unknown {unknown}; choose from {tuple(SETUPS)}")
        cfg.require_at_least_one(self, "steps", "batch_size", "accum_steps", "val_batch_size", "val_blocks", "eval_every")
        if self.exchange_rounds < 0 or self.accum_rounds < 1:
            raise ValueError(f"exchange_rounds={self.exchange_rounds} must be 0 (not timed) or positive, "
                             f"accum_rounds={self.accum_rounds} at least 1")
        if self.measure_steps < 0:
            raise ValueError(f"measure_steps={self.measure_steps} must be 0 (the same as steps) or positive")
        impls = {"ddp": self.ddp_impl, "ddp_accum": self.ddp_impl, "fsdp": self.fsdp_impl,
                 "fsdp_ac": self.fsdp_impl, "hsdp": self.fsdp_impl, "accelerate": self.accelerate_impl}
        for variant in self.variants:
            if variant in impls:
                require_file(impls[variant])

    def validate_world(self, world_size: int) -> None:
        if "single" in self.variants and world_size != 1:
            raise ValueError(f"variant 'single' is the one-process baseline: run it with nproc=1, not {world_size}")
        if "hsdp" in self.variants and (world_size < 4 or world_size % 2):
            raise ValueError(f"variant 'hsdp' shards over a (2, world_size / 2) mesh: it needs an even world size "
                             f"of at least 4, not {world_size}")
        # lablib's evaluation splits the validation set into equal contiguous shares; an Accelerate-only run
        # evaluates with the answer's own loop (Accelerate pads the last batch), so any val_blocks is allowed there
        accelerate_only = set(self.variants) == {"accelerate"}
        for name, divisor in (("batch_size", world_size * (self.accum_steps if "ddp_accum" in self.variants else 1)),
                              ("val_batch_size", world_size), ("val_blocks", self.val_batch_size)):
            if name == "val_blocks" and accelerate_only:
                continue
            if getattr(self, name) % divisor:
                raise ValueError(f"{name}={getattr(self, name)} must be divisible by {divisor} "
                                 f"(world_size={world_size}, accum_steps={self.accum_steps})")


@contextlib.contextmanager
def count_gather_for_metrics():
    """Counts calls of accelerate.Accelerator.gather_for_metrics (the one gather that drops the duplicates
    Accelerate pads an uneven last batch with) while the block runs; yields {"calls": n}."""
    from accelerate import Accelerator
    original, seen = Accelerator.gather_for_metrics, {"calls": 0}

    @functools.wraps(original)
    def counted(self, *args, **kwargs):
        seen["calls"] += 1
        return original(self, *args, **kwargs)

    Accelerator.gather_for_metrics = counted
    try:
        yield seen
    finally:
        Accelerator.gather_for_metrics = original


# --- set-up per variant: (model, env, config) -> (model, training.Parts or None for Accelerate, extras) ---

def setup_reference(model, env, config):
    """single: world size 1, the baseline. (Two ranks without gradient exchange are timed as DDP inside no_sync(),
    in turns with DDP: training.time_exchange.)"""
    return model, training.reference_parts(), {}


def setup_ddp(model, env, config, accumulate: int = 1):
    """The notebook's ddp_impl.py in lablib's loop; ddp also probes its functions without training, and stops
    there (no variant trains) when mean_across_ranks returns anything but the mean: the check fails on it
    in seconds instead of after the training."""
    impl = load_module(config.ddp_impl, required=DDP_FUNCTIONS)
    parts = training.Parts(impl.wrap_model, impl.make_loader, impl.start_epoch, impl.mean_across_ranks, accumulate)
    if accumulate > 1:
        return model, parts, {}
    mean = probe_mean(impl.mean_across_ranks, env)             # gathered: every rank takes the same decision
    # The probe's values are small dyadic numbers: their float32 sum is exact; N roundings at most (a division, or
    # one per term when each is divided first), against the expected float64 value's one: formula_rtol(N) in float32.
    rtol = formula_rtol(env.world_size, unit_roundoff=FP32_UNIT_ROUNDOFF)
    wrong = [name for name, m in mean.items() if not all(abs(v - m["expected"]) <= rtol * abs(m["expected"])
                                                         for v in m["per_rank"])]
    extras = {"probe": {"loader": probe_loader(impl.make_loader, impl.start_epoch, env, config.seed), "mean": mean}}
    if wrong:
        extras["stopped_early"] = f"mean_across_ranks did not return the mean ({', '.join(wrong)}): nothing trained"
    return model, parts, extras


def setup_fsdp(model, env, config, checkpoint_activations: bool = False, hybrid: bool = False):
    """The notebook's apply_fsdp (after activation checkpointing of every block for fsdp_ac), lablib's parts.
    hybrid (HSDP): the same apply_fsdp on a 2-D mesh, replicas x shards = (2, world_size / 2): fully_shard
    shards over the mesh's last dimension and replicates over the first."""
    from torch.distributed.device_mesh import init_device_mesh
    if checkpoint_activations:
        apply_activation_checkpointing(model)
    impl = load_module(config.fsdp_impl, required=("apply_fsdp",))
    mesh = (init_device_mesh(env.device.type, (2, env.world_size // 2), mesh_dim_names=("replicate", "shard"))
            if hybrid else init_device_mesh(env.device.type, (env.world_size,)))
    model = impl.apply_fsdp(model, mesh)
    # this rank's group along each mesh dimension, by name (traced_step names the collectives' groups with it)
    groups = {f"mesh_{name}": dist.get_process_group_ranks(mesh.get_group(name)) for name in mesh.mesh_dim_names} \
        if hybrid else {"mesh": dist.get_process_group_ranks(mesh.get_group())}
    return model, training.reference_parts(), {"fsdp_plan": fsdp_plan(model), "mesh": list(mesh.shape),
                                               "mesh_groups": groups}


def setup_accelerate(model, env, config):
    """The notebook's accelerate_impl.train_loop runs its own loop (parts None)."""
    if env.device.type == "cpu":
        os.environ["ACCELERATE_USE_CPU"] = "true"   # what `accelerate launch --cpu` sets
    return model, None, {}


SETUPS = {
    "single": setup_reference,
    "ddp": setup_ddp,
    "ddp_accum": lambda model, env, config: setup_ddp(model, env, config, accumulate=config.accum_steps),
    "fsdp": setup_fsdp,
    "fsdp_ac": lambda model, env, config: setup_fsdp(model, env, config, checkpoint_activations=True),
    "hsdp": lambda model, env, config: setup_fsdp(model, env, config, hybrid=True),
    "accelerate": setup_accelerate,
}


# Variants whose loss is not compared with the baseline's: they may train only measure_steps steps.
MEASURED_ONLY = ("fsdp_ac",)
SHARDED = ("fsdp", "fsdp_ac", "hsdp")    # each rank holds other shards: no weight spread across ranks
# Variants a graded run may carry along for an ungraded section: a set-up that fails is reported, not raised.
CARRIED_ALONG = ("hsdp",)


def run_variant(variant, env, config, vocab_size, train_set, val_set) -> dict:
    if variant in MEASURED_ONLY and config.measure_steps:
        config = replace(config, steps=config.measure_steps)
    train_set = RecordingDataset(train_set)
    model = training.new_model(vocab_size, config, env.device)
    n_params, full_param_bytes = model.num_params(), sum(p.numel() * p.element_size() for p in model.parameters())
    # FSDP2 over all ranks: each parameter's dim 0 in chunks of ceil(d0 / N) rows, rank r the r-th (exact bytes)
    fsdp_bytes = [sum(rows[r] * (p.numel() // p.shape[0]) * p.element_size()
                      for p in model.parameters() for rows in [fsdp_rows_per_rank(p.shape[0], env.world_size)])
                  for r in range(env.world_size)]
    try:
        model, parts, result = SETUPS[variant](model, env, config)
    except Exception as exc:                      # raised alike on every rank, before any collective of it
        if variant not in CARRIED_ALONG:
            raise
        return {"error": f"{type(exc).__name__}: {exc}"}
    if "stopped_early" in result:
        return result
    optimizer = training.new_optimizer(model, config)
    with count_ddp_models() as ddp_log:
        meter = StepMeter(env, model, optimizer, config.batch_size * config.block_size, config.steps,
                          config.eval_every, ddp_log=ddp_log)
        if parts is None:
            accelerate = load_module(config.accelerate_impl, required=("train_loop",))
            # gather_for_metrics counted by name: accelerator.gather also all-gathers, but keeps Accelerate's padding
            with count_gather_for_metrics() as metric_gathers:
                curve, trained = accelerate.train_loop(model, optimizer, train_set, val_set, config, meter), model
            result["gather_for_metrics_calls"] = metric_gathers["calls"]
        else:
            curve, trained = training.train_loop(model, optimizer, train_set, val_set, config, env, parts, meter)
        result.update(meter.summary())
    if variant in SHARDED:   # after an evaluation FSDP2 keeps the root unit gathered: count the shards a rank keeps
        for module in model.modules():
            if hasattr(module, "reshard"):
                module.reshard()
    local_bytes = sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in model.parameters())
    seen = gather_objects(train_set.seen, env)
    result.update(world_size=env.world_size, n_params=n_params,
                  val_curve=[[int(s), float(v)] for s, v in curve],
                  samples_seen=shard_report(seen),
                  samples_per_step=samples_per_step(seen, config.steps, config.batch_size // env.world_size),
                  weight_spread_across_ranks=None if variant in SHARDED else weight_spread(model, env),
                  param_bytes_per_rank=gather_objects(local_bytes, env), full_param_bytes=full_param_bytes,
                  fsdp_param_bytes_per_rank=fsdp_bytes,
                  evaluation_steps=training.evaluation_steps(config.steps, config.eval_every))
    if variant == "accelerate":   # lablib's own evaluation of the trained weights, every rank the whole set
        result["reference_final_val_loss"] = training.evaluate(model, val_set, config.val_batch_size, env)
    if variant == "ddp_accum":
        result["accum"] = training.time_accumulation(trained, optimizer, train_set, config, env, ddp_log,
                                                     config.accum_rounds)
    if config.ckpt_dir and variant == "ddp" and env.is_main:
        path = Path(config.ckpt_dir) / "ddp_rank0.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(getattr(trained, "module", trained).state_dict(), path)   # rank 0 only, without 'module.'
        result["ddp_checkpoint"] = str(path.resolve())
    if config.ckpt_dir and variant == "fsdp":
        result["dcp"] = training.save_sharded_checkpoint(model, config, env, val_set)
    if config.trace_step and variant in ("ddp", "fsdp", "hsdp"):
        traced = training.traced_step(trained, optimizer, train_set, config, env,
                                      {"ddp_buckets": result["memory"].get("ddp_buckets", 0)},
                                      {tuple(ranks): name for name, ranks in result.get("mesh_groups", {}).items()})
        result.update(traced if env.is_main else {})   # rank 0's timeline; the groups are the same on every rank
    if config.exchange_rounds and variant == "ddp":     # last: its no_sync() steps let the ranks' weights drift apart
        result["exchange"] = training.time_exchange(trained, optimizer, train_set, config, env, ddp_log,
                                                    config.exchange_rounds)
    return result


def run(env, config: Config) -> dict:
    tokenizer, train_set, val_set = data.shakespeare_datasets(config.block_size, config.val_blocks)
    results = {}
    for variant in config.variants:
        if env.is_main:
            print(f"--- {variant} on {env.world_size} rank(s), backend {env.backend}")
        results[variant] = run_variant(variant, env, config, tokenizer.vocab_size, train_set, val_set)
        if "stopped_early" in results[variant]:
            if env.is_main:
                print(f"stopped early: {results[variant]['stopped_early']}")
            break
    return results


def main() -> None:
    script.main(Config, run)


if __name__ == "__main__":
    main()
