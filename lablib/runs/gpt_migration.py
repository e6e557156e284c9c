"""Lab 05's step: one GPT, one workload, trained single-process, with DDP, DDP + accumulation, FSDP2,
FSDP2 + activation checkpointing and Accelerate, each measured the same way (lablib.benchmark).

    torchrun --standalone --nproc-per-node 1 -m lablib.runs.gpt_migration --variants single --out single.json
    torchrun --standalone --nproc-per-node 2 -m lablib.runs.gpt_migration --variants ddp,ddp_accum \\
        --ddp_impl ddp_impl.py --out ddp.json

Variants (run in the order given, each from the same initial weights, on the same global batch of
``batch_size`` sequences per optimizer step, so every variant sees the same number of samples):
- ``single``      the plain one-process loop (world size 1 only): the reference;
- ``ddp``         the notebook's ddp_impl.py: wrap_model, make_loader, start_epoch, mean_across_ranks;
- ``ddp_accum``   the same, with ``accum_steps`` micro-batches per step and ``no_sync()`` on all but the last;
- ``fsdp``        the notebook's fsdp_impl.py: ``apply_fsdp(model, mesh)`` (FSDP2, bf16 mixed precision),
                  then a torch.distributed.checkpoint (DCP) checkpoint when ``ckpt_dir`` is set;
- ``fsdp_ac``     activation checkpointing on every block (lablib.checkpointing), then apply_fsdp;
- ``accelerate``  the notebook's accelerate_impl.py: ``train_loop(model, optimizer, train_set, val_set,
                  config, on_step)``; started by torchrun like every other variant (on a CPU the script
                  sets ACCELERATE_USE_CPU, which is what ``accelerate launch --cpu`` would set).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from lablib import data, script
from lablib.benchmark import StepMeter, count_ddp_models
from lablib.checkpointing import apply_activation_checkpointing
from lablib.impl import load_module, require_file
from lablib.memory import local_tensor
from lablib.models import GPT, GPTConfig
from lablib.rankcheck import RecordingDataset, gather_objects, shard_report, weight_spread

VARIANTS = ("single", "ddp", "ddp_accum", "fsdp", "fsdp_ac", "accelerate")


@dataclass(frozen=True)
class Config:
    variants: tuple[str, ...] = ("single",)
    ddp_impl: str = "ddp_impl.py"
    fsdp_impl: str = "fsdp_impl.py"
    accelerate_impl: str = "accelerate_impl.py"
    steps: int = 60                 # optimizer steps per variant
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
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or not self.variants:
            raise ValueError(f"variants={self.variants}: unknown {unknown}; choose from {VARIANTS}")
        for name in ("steps", "batch_size", "accum_steps", "val_batch_size", "val_blocks", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        impls = {"ddp": self.ddp_impl, "ddp_accum": self.ddp_impl, "fsdp": self.fsdp_impl,
                 "fsdp_ac": self.fsdp_impl, "accelerate": self.accelerate_impl}
        for variant in self.variants:
            if variant in impls:
                require_file(impls[variant])

    def validate_world(self, world_size: int) -> None:
        if "single" in self.variants and world_size != 1:
            raise ValueError(f"variant 'single' is the one-process baseline: run it with nproc=1, not {world_size}")
        for name, divisor in (("batch_size", world_size * (self.accum_steps if "ddp_accum" in self.variants else 1)),
                              ("val_batch_size", world_size), ("val_blocks", self.val_batch_size)):
            if getattr(self, name) % divisor:
                raise ValueError(f"{name}={getattr(self, name)} must be divisible by {divisor} "
                                 f"(world_size={world_size}, accum_steps={self.accum_steps})")


def load_data(config: Config):
    text = data.load_shakespeare()
    tokenizer = data.CharTokenizer.from_text(text)
    train_tokens, val_tokens = data.train_val_split(tokenizer.encode(text))
    val_tokens = val_tokens[: config.val_blocks * config.block_size + 1]
    return tokenizer, data.BlockDataset(train_tokens, config.block_size), data.BlockDataset(val_tokens, config.block_size)


def new_model(config: Config, vocab_size: int, device) -> GPT:
    torch.manual_seed(config.seed)  # the same initial weights on every rank and in every variant
    return GPT(GPTConfig(vocab_size=vocab_size, block_size=config.block_size, n_layer=config.n_layer,
                         n_head=config.n_head, n_embd=config.n_embd)).to(device)


# --- the loop every variant but Accelerate shares: world size 1 is the baseline, not another code path --

def ddp_loop(model, optimizer, train_set, val_set, config, env, parts, on_step):
    model = parts.wrap_model(model, env)
    K = config.accum_steps if parts.accumulate else 1
    loader = parts.make_loader(train_set, config.batch_size // (env.world_size * K), env, config.seed)
    val_loader = data.make_loader(val_set, config.val_batch_size // env.world_size, env, shuffle=False)
    curve, step, epoch = [], 0, 0
    while step < config.steps:
        parts.start_epoch(loader, epoch)            # a different shuffle every epoch, the same on all ranks
        for i, (x, y) in enumerate(loader):
            x, y = x.to(env.device), y.to(env.device)
            last = (i + 1) % K == 0                 # all-reduce only on the K-th micro-batch
            with contextlib.nullcontext() if last else model.no_sync():
                _, loss = model(x, y)
                (loss / K).backward()
            if not last:
                continue
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            on_step(step, loss)
            if step % config.eval_every == 0 or step == config.steps:
                curve.append((step, evaluate(model, val_loader, env, parts)))
                if env.is_main:
                    print(f"step {step}: val loss {curve[-1][1]:.4f}")
            if step == config.steps:
                break
        epoch += 1
    return curve, model


@torch.no_grad()
def evaluate(model, val_loader, env, parts):
    model.eval()
    losses = [model(x.to(env.device), y.to(env.device))[1].float() for x, y in val_loader]
    model.train()
    return parts.mean_across_ranks(torch.stack(losses).mean(), env)   # this rank's shard -> all ranks


def library_parts(accumulate: bool = False) -> SimpleNamespace:
    """The parts of the variants whose parallelism is applied before the loop (single process, FSDP2): no
    wrapper, lablib's loader, and the mean of the ranks' validation shards gathered with all_gather (the DDP
    exercise writes its own, with all_reduce)."""
    def mean_across_ranks(value, env):
        values = [torch.zeros_like(value) for _ in range(env.world_size)]
        if dist.is_initialized():
            dist.all_gather(values, value.detach())
        else:
            values = [value.detach()]
        return torch.stack(values).mean().item()

    def make_loader(dataset, batch_size, env, seed):
        return data.make_loader(dataset, batch_size, env, shuffle=True, seed=seed)

    return SimpleNamespace(wrap_model=lambda model, env: model, make_loader=make_loader,
                           start_epoch=lambda loader, epoch: loader.sampler.set_epoch(epoch),
                           mean_across_ranks=mean_across_ranks, accumulate=accumulate)


# --- the checks the notebook's graded cells read -----------------------------------------------------

def probe_ddp_parts(parts, env, config) -> dict:
    """Without training: the shards make_loader gives each rank in two epochs, and mean_across_ranks."""
    probe = list(range(10 * env.world_size * 4))       # 40 items per rank, batches of 4
    loader = parts.make_loader(probe, 4, env, config.seed)
    orders = []
    for epoch in (0, 1):
        parts.start_epoch(loader, epoch)
        orders.append([int(i) for batch in loader for i in batch])
    value = torch.tensor(float(env.rank) + 1.5, device=env.device)
    mean = parts.mean_across_ranks(value, env)
    orders = gather_objects(orders, env)
    return {"epoch_orders": orders, "probe_size": len(probe), "mean_of_rank_plus_1_5": float(mean),
            "expected_mean": (env.world_size - 1) / 2 + 1.5}


def save_fsdp_checkpoint(model, config, env, val_set) -> dict:
    """DCP: every rank writes its own shards; rank 0 also computes a plain fp32 model's loss to compare."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    path = Path(config.ckpt_dir) / "fsdp_dcp"
    dcp.save(get_model_state_dict(model), checkpoint_id=str(path))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = {"dcp_path": str(path.resolve())}
    if env.is_main:
        plain = new_model(config, model.config.vocab_size, "cpu")
        plain.load_state_dict(full)
        x, y = val_set[0]
        with torch.no_grad():
            out["plain_model_loss_first_val_block"] = plain(x[None], y[None])[1].item()
    return out


# --- variants ----------------------------------------------------------------------------------------

def run_variant(variant, env, config, tokenizer, train_set, val_set) -> dict:
    train_set = RecordingDataset(train_set)
    model = new_model(config, tokenizer.vocab_size, env.device)
    full_param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    result, parts = {"world_size": env.world_size, "n_params": model.num_params()}, library_parts()
    if variant in ("ddp", "ddp_accum"):
        ddp = load_module(config.ddp_impl, required=("wrap_model", "make_loader", "start_epoch", "mean_across_ranks"))
        parts = SimpleNamespace(wrap_model=ddp.wrap_model, make_loader=ddp.make_loader, start_epoch=ddp.start_epoch,
                                mean_across_ranks=ddp.mean_across_ranks, accumulate=variant == "ddp_accum")
        if variant == "ddp":
            result["probe"] = probe_ddp_parts(parts, env, config)
    elif variant in ("fsdp", "fsdp_ac"):
        from torch.distributed.device_mesh import init_device_mesh
        fsdp = load_module(config.fsdp_impl, required=("apply_fsdp",))
        if variant == "fsdp_ac":
            apply_activation_checkpointing(model)
        mesh = init_device_mesh(env.device.type, (env.world_size,))
        model = fsdp.apply_fsdp(model, mesh)
        result["fsdp_plan"] = fsdp_plan(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    with count_ddp_models() as counters:
        meter = StepMeter(env, model, optimizer, config.batch_size * config.block_size, config.steps,
                          config.eval_every, ddp_counters=counters)
        if variant == "accelerate":
            if env.device.type == "cpu":
                os.environ["ACCELERATE_USE_CPU"] = "true"   # what `accelerate launch --cpu` sets
            acc = load_module(config.accelerate_impl, required=("train_loop",))
            curve = acc.train_loop(model, optimizer, train_set, val_set, config, meter)
            trained = model
        else:
            curve, trained = ddp_loop(model, optimizer, train_set, val_set, config, env, parts, meter)
        result.update(meter.summary())
    result["val_curve"] = [[int(s), float(v)] for s, v in curve]
    result["samples_seen"] = shard_report(gather_objects(train_set.seen, env))
    result["weight_spread_across_ranks"] = weight_spread(model, env) if not variant.startswith("fsdp") else None
    result["param_bytes_per_rank"] = gather_objects(sum(local_tensor(p).numel() * local_tensor(p).element_size()
                                                for p in model.parameters()), env)
    result["full_param_bytes"] = full_param_bytes
    if variant == "ddp_accum":
        result["accum"] = time_sync_every(trained, optimizer, train_set, config, env, counters)
    if config.ckpt_dir and variant == "ddp" and env.is_main:
        path = Path(config.ckpt_dir) / "ddp_rank0.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(getattr(trained, "module", trained).state_dict(), path)   # rank 0 only, without 'module.'
        result["ddp_checkpoint"] = str(path.resolve())
    if config.ckpt_dir and variant == "fsdp":
        result["dcp"] = save_fsdp_checkpoint(model, config, env, val_set)
    return result


def fsdp_plan(model) -> dict:
    """Which modules are FSDP2 units, and their mixed-precision policy (read from FSDP2's module state)."""
    from torch.distributed.fsdp import FSDPModule
    plan = {"root_is_fsdp": isinstance(model, FSDPModule),
            "blocks_are_fsdp": [isinstance(b, FSDPModule) for b in model.h], "policy": None}
    if isinstance(model, FSDPModule):
        group = model._get_fsdp_state()._fsdp_param_group  # private, read-only: the policy as FSDP2 holds it
        policy = group.mp_policy if group is not None else None
        if policy is not None:
            plan["policy"] = {"param_dtype": str(policy.param_dtype), "reduce_dtype": str(policy.reduce_dtype)}
    return plan


def time_sync_every(model, optimizer, train_set, config, env, counters) -> dict:
    """A few more accumulation steps, with and without no_sync(): all-reduces and time per step."""
    K, micro = config.accum_steps, config.batch_size // (env.world_size * config.accum_steps)
    batches = [train_set[i] for i in range(K * micro)]
    x = torch.stack([b[0] for b in batches]).to(env.device)
    y = torch.stack([b[1] for b in batches]).to(env.device)
    out = {}
    for name, use_no_sync in (("sync_every", False), ("no_sync", True)):
        times, calls = [], []
        for _ in range(4):
            before = sum(c.calls for c in counters)
            dist.barrier()
            t0 = time.perf_counter()
            for k, (xb, yb) in enumerate(zip(x.split(micro), y.split(micro))):
                ctx = model.no_sync() if use_no_sync and k < K - 1 else contextlib.nullcontext()
                with ctx:
                    (model(xb, yb)[1] / K).backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - t0)
            calls.append(sum(c.calls for c in counters) - before)
        t = torch.tensor([sorted(times[1:])[len(times[1:]) // 2]], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[name] = {"allreduce_calls_per_step": calls[-1], "median_step_time_s": t.item()}
    return out


def train(env, config: Config) -> dict:
    torch.manual_seed(config.seed)
    tokenizer, train_set, val_set = load_data(config)
    results = {}
    for variant in config.variants:
        if env.is_main:
            print(f"--- {variant} on {env.world_size} rank(s), backend {env.backend}")
        results[variant] = run_variant(variant, env, config, tokenizer, train_set, val_set)
    return results


def main() -> None:
    script.main(Config, train)


if __name__ == "__main__":
    main()
