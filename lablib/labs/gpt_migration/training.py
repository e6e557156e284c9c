"""Lab 05's training loop, written once for a single process, DDP, DDP + accumulation and FSDP2.

What differs between those variants is handed to the loop as ``Parts`` (how the model is wrapped, where each
rank's batches come from, how a metric is combined across ranks); a single process is world size 1 with
the reference parts, not a second code path. The reference parts are lablib's own and independent of the
lab's exercises: no wrapper (or FSDP2 applied before the loop), ``data.GlobalBatchSampler`` (each rank a
contiguous slice of every global batch), and every rank evaluating the whole validation set, so a
reference curve needs no collective at all. The exercises' DDP parts plug into the same loop.

Every variant trains on the same global batch of ``config.batch_size`` sequences per optimizer step and
evaluates at the same steps (``evaluation_steps``), so their curves are comparable point by point.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from lablib.course import data
from lablib.measure import timing
from lablib.course.models import GPT, gpt_config

# The GPT of the source tutorial the lab checks (6 layers, 384 wide, 6 heads, context 256): ~10.7 M
# parameters with the character vocabulary. The lab trains it when CUDA is present; on a CPU it is far
# too slow for a 3-minute notebook, so the CPU workload is the course's small GPT.
SOURCE_GPT = dict(block_size=256, n_layer=6, n_head=6, n_embd=384)


@dataclass(frozen=True)
class Parts:
    """The pieces of a data-parallel loop that differ between variants.

    wrap_model(model, env) -> model           e.g. DistributedDataParallel; identity for the reference
    make_loader(dataset, batch_size, env, seed) an iterable of (x, y) batches of batch_size sequences per rank
    start_epoch(loader, epoch)                called before each pass over the loader
    mean_across_ranks(value, env) -> float    combines the ranks' validation means; None: every rank
                                              evaluates the whole validation set
    accumulate                                micro-batches per optimizer step (no_sync() on all but the last)
    """

    wrap_model: Callable
    make_loader: Callable
    start_epoch: Callable
    mean_across_ranks: Callable | None = None
    accumulate: int = 1


def reference_parts() -> Parts:
    """lablib's parts: no wrapper, GlobalBatchSampler batches (it reshuffles by itself), full evaluation."""
    def make_loader(dataset, batch_size, env, seed):
        return data.global_batch_loader(dataset, batch_size * env.world_size, env, seed)

    return Parts(wrap_model=lambda model, env: model, make_loader=make_loader,
                 start_epoch=lambda loader, epoch: None)


def new_model(vocab_size: int, config, device) -> GPT:
    """The lab's GPT from a run config's fields; torch.manual_seed(config.seed) first, so every rank and
    every variant starts from the same weights."""
    torch.manual_seed(config.seed)
    return GPT(gpt_config(config, vocab_size)).to(device)


def new_optimizer(model, config) -> torch.optim.AdamW:
    """The lab's optimizer for every variant: AdamW with config.lr, betas (0.9, 0.95), no weight decay."""
    return torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)


def evaluation_steps(steps: int, eval_every: int) -> list[int]:
    """The optimizer steps after which the loss is evaluated: every eval_every-th, and always the last."""
    return sorted(set(range(eval_every, steps + 1, eval_every)) | {steps})


def optimizer_steps(loader, start_epoch: Callable, accumulate: int, steps: int):
    """Yield ``steps`` lists of ``accumulate`` micro-batches each, starting a new epoch when the loader runs
    out (``start_epoch(loader, epoch)`` before every pass). Loads nothing beyond the last step."""
    epoch, pending = 0, []
    while True:
        start_epoch(loader, epoch)
        for batch in loader:
            pending.append(batch)
            if len(pending) == accumulate:
                yield pending
                pending, steps = [], steps - 1
                if steps == 0:
                    return
        epoch += 1


def train_loop(model, optimizer, train_set, val_set, config, env, parts: Parts, on_step: Callable):
    """Train config.steps optimizer steps of config.batch_size sequences (all ranks together).

    Returns ([(step, validation loss), ...], the model as trained: wrapped by parts.wrap_model).
    on_step(step, loss) is called after every optimizer step (lablib.measure.benchmark.StepMeter measures there).
    """
    model = parts.wrap_model(model, env)
    K = parts.accumulate
    micro = config.batch_size // (env.world_size * K)            # sequences per rank per forward
    loader = parts.make_loader(train_set, micro, env, config.seed)
    evaluate_at = evaluation_steps(config.steps, config.eval_every)
    curve = []
    for step, micro_batches in enumerate(optimizer_steps(loader, parts.start_epoch, K, config.steps), start=1):
        for k, (x, y) in enumerate(micro_batches):
            # Inside no_sync() DDP only accumulates into .grad; the last micro-batch's backward all-reduces.
            with model.no_sync() if k < K - 1 else contextlib.nullcontext():
                _, loss = model(x.to(env.device), y.to(env.device))     # x, y: (micro, block_size)
                (loss / K).backward()
        optimizer.step()
        optimizer.zero_grad()
        on_step(step, loss)
        if step in evaluate_at:
            curve.append((step, evaluate(model, val_set, config.val_batch_size, env, parts.mean_across_ranks)))
            if env.is_main:
                print(f"step {step}: val loss {curve[-1][1]:.4f}")
    return curve, model


@torch.no_grad()
def evaluate(model, val_set, batch_size: int, env, mean_across_ranks: Callable | None = None) -> float:
    """Mean loss per token over the validation sequences (all of equal length).

    mean_across_ranks None: every rank evaluates every sequence, batch_size per forward (no collective).
    Otherwise rank r evaluates its contiguous 1/world_size of them (batch_size / world_size per forward)
    and mean_across_ranks(its mean as a 0-dim tensor, env) combines the ranks' means.
    """
    n = len(val_set)
    if mean_across_ranks is None:
        indices, per_forward = list(range(n)), batch_size
    else:
        share = n // env.world_size
        indices, per_forward = list(range(env.rank * share, (env.rank + 1) * share)), batch_size // env.world_size
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=env.device)
    for start in range(0, len(indices), per_forward):
        items = [val_set[i] for i in indices[start:start + per_forward]]
        x = torch.stack([it[0] for it in items]).to(env.device)
        y = torch.stack([it[1] for it in items]).to(env.device)
        total += model(x, y)[1].double() * len(items)             # the batch's mean loss x its sequences
    model.train(was_training)
    mean = (total / len(indices)).float()
    return mean.item() if mean_across_ranks is None else float(mean_across_ranks(mean, env))


def _rank_batch(train_set, micro: int, env, pieces: int = 1):
    """This rank's share of the first global batch: (x, y), each split into pieces micro-batches of micro sequences."""
    first = env.rank * micro * pieces
    items = [train_set[i] for i in range(first, first + micro * pieces)]
    x = torch.stack([it[0] for it in items]).to(env.device)          # (pieces * micro, block_size)
    y = torch.stack([it[1] for it in items]).to(env.device)
    return x.split(micro), y.split(micro)


def _ddp_arms_in_turns(model, optimizer, ddp_log, env, x, y, arms: dict, rounds: int) -> dict:
    """One optimizer step per arm per round over the micro-batches x[k], y[k] (loss / K each), taking turns
    (``timing.take_turns``). arms: name -> skip(k, K), whether micro-batch k of K runs inside ``model.no_sync()``.
    Each arm's gradient all-reduces per step are counted (``ddp_log``)."""
    K, calls = len(x), {}

    def step(name: str, skip):
        def one():
            before = ddp_log.count()
            for k in range(K):
                with model.no_sync() if skip(k, K) else contextlib.nullcontext():
                    (model(x[k], y[k])[1] / K).backward()
            optimizer.step()
            optimizer.zero_grad()
            calls[name] = ddp_log.count() - before
        return one

    turns = timing.take_turns({name: step(name, skip) for name, skip in arms.items()}, rounds, env.device)
    for name in turns:
        turns[name]["allreduce_calls_per_step"] = calls[name]
    return turns


def _per_round(turns: dict, row: tuple[str, str], floor: tuple[str, str]) -> dict:
    """Per round the row's ratio (numerator, denominator arm) and the floor's, read by ``timing.noise_verdict``."""
    ratios, floors = ([a / b for a, b in zip(turns[n]["step_s"], turns[d]["step_s"])] for n, d in (row, floor))
    return {"rounds": len(ratios), "ratio_per_round": ratios, "floor_per_round": floors,
            "verdict": timing.noise_verdict(ratios, floors, 1)}


def time_exchange(model, optimizer, train_set, config, env, ddp_log, rounds: int) -> dict:
    """DDP's step against the same DDP model's step inside ``no_sync()`` (``no_exchange``: the identical model,
    wrapper, batch and optimizer step, only the gradient all-reduce left out; each rank then steps on its own
    gradient, so the ranks' weights drift apart: run after everything that reads them), and DDP a second time
    (``ddp_again``, the noise floor), taking turns. Per round DDP / no_exchange and the floor ddp_again / ddp.
    Each step trains this rank's B/N sequences of the first global batch."""
    x, y = _rank_batch(train_set, config.batch_size // env.world_size, env)
    turns = _ddp_arms_in_turns(model, optimizer, ddp_log, env, x, y, {
        "ddp": lambda k, K: False, "no_exchange": lambda k, K: True, "ddp_again": lambda k, K: False}, rounds)
    return {**turns, **_per_round(turns, ("ddp", "no_exchange"), ("ddp_again", "ddp"))}


def time_accumulation(model, optimizer, train_set, config, env, ddp_log, rounds: int) -> dict:
    """DDP accumulation steps of config.accum_steps micro-batches, all-reducing after every micro-batch
    (``sync_every``) and with no_sync() on all but the last (``no_sync``), and ``no_sync`` again (``no_sync_again``:
    the same code timed against itself, the noise floor of this run), taking turns: gradient all-reduces per step
    (counted), step times, and per round sync_every / no_sync and the floor no_sync_again / no_sync."""
    K, micro = config.accum_steps, config.batch_size // (env.world_size * config.accum_steps)
    x, y = _rank_batch(train_set, micro, env, pieces=K)
    turns = _ddp_arms_in_turns(model, optimizer, ddp_log, env, x, y, {
        "sync_every": lambda k, K: False, "no_sync": lambda k, K: k < K - 1, "no_sync_again": lambda k, K: k < K - 1},
        rounds)
    return {**turns, **_per_round(turns, ("sync_every", "no_sync"), ("no_sync_again", "no_sync"))}


def save_sharded_checkpoint(model, config, env, val_set) -> dict:
    """torch.distributed.checkpoint (DCP): every rank writes its own shards under config.ckpt_dir; rank 0
    also loads the gathered full state dict into a plain fp32 GPT and records its loss on the first
    validation sequence, for the notebook to compare with a single-process reload."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    path = Path(config.ckpt_dir) / "fsdp_dcp"
    dcp.save(get_model_state_dict(model), checkpoint_id=str(path))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = {"dcp_path": str(path.resolve())}
    if env.is_main:
        plain = new_model(model.config.vocab_size, config, "cpu")
        plain.load_state_dict(full)
        x, y = val_set[0]
        with torch.no_grad():
            out["plain_model_loss_first_val_block"] = plain(x[None], y[None])[1].item()
    return out


def traced_step(model, optimizer, train_set, config, env, persistent: dict | None = None,
                group_names: dict | None = None) -> dict:
    """Two more training steps, the second watched (after the measured run, so they change none of its
    figures): this rank's share of the first global batch, with ``memory.MemoryTimeline`` sampling what the
    rank holds at every module boundary and ``lablib.measure.counting`` recording the process group of every
    collective the step called (``CollectiveLog.by_group``, groups named by ``group_names``: {ranks: name}).
    DDP all-reduces its buckets in C++, which ``count_collectives`` does not see: a DDP model reports no groups."""
    from torch.nn.parallel import DistributedDataParallel

    from lablib.measure.counting import count_collectives
    from lablib.measure.memory import MemoryTimeline

    micro = config.batch_size // env.world_size
    items = [train_set[i] for i in range(env.rank * micro, (env.rank + 1) * micro)]
    x = torch.stack([it[0] for it in items]).to(env.device)          # (micro, block_size)
    y = torch.stack([it[1] for it in items]).to(env.device)
    model(x, y)[1].backward()          # a first step: after an evaluation FSDP2 keeps the root unit gathered
    optimizer.step()
    optimizer.zero_grad()
    with MemoryTimeline(model, optimizer, persistent) as timeline, count_collectives() as log:
        model(x, y)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    out = {"memory_timeline": timeline.samples}
    if not isinstance(model, DistributedDataParallel):
        out["collectives_by_group"] = log.by_group(group_names)
    return out


def train_in_this_process(train_loop: Callable, config, threads: int = 1) -> list[tuple[int, float]]:
    """An exercise's own ``train_loop(model, optimizer, train_set, val_set, config, on_step)`` run in this
    process (world size 1, no torchrun), from the run's initial weights with the lab's optimizer and, like
    every rank of the lab's runs, ``threads`` CPU threads: a look at a loop in seconds, before a
    multi-process run. Returns the loop's validation curve."""
    from lablib.jobs.distenv import from_env

    tokenizer, train_set, val_set = data.shakespeare_datasets(config.block_size, config.val_blocks)
    model = new_model(tokenizer.vocab_size, config, from_env().device)      # the device a rank 0 would use
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return train_loop(model, new_optimizer(model, config), train_set, val_set, config, lambda step, loss: None)
    finally:
        torch.set_num_threads(before)
