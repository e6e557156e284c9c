"""A training run that can be killed and resumed (lab 10): its data order, its seeds, what it trains, one step.

What a resumed run needs to continue *exactly* is the students' ``AppState`` (lab 10's exercise 1, written in the
notebook, never here). This module is everything it saves and restores; ``checkpoint_run`` is the
loop around it (the students' ``start`` and ``save``, the faults, the log).

- ``ResumableSampler``: one permutation of the data per epoch (seeded with ``seed + epoch``, the same on every
  rank); its state is **global** (epoch, samples of this epoch already served to all ranks together), so it
  reshards: rank r of N takes the r-th slice of each global batch, whatever N was when the state was saved;
- ``seed_everything`` and ``per_rank`` / ``this_rank``: DCP keeps **one** copy of a key that every rank writes
  (it deduplicates what it takes for replicated state), so a value that differs per rank (its RNG states) is
  gathered into one list that every rank writes alike, and each rank takes its own entry back;
- ``Recipe`` and ``build``: the model (course GPT with dropout: torch's generator), the data (Tiny Shakespeare
  windows shifted at random by Python's ``random``, and a share of their input tokens replaced by random ones
  drawn from numpy), FSDP2 or DDP applied from outside, AdamW, warm-up + cosine schedule; ``train_step``.
"""

from __future__ import annotations

import functools
import math
import pickle
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from lablib.course import data, models


# --- data order that reshards ----------------------------------------------------------------------------------

class ResumableSampler:
    """Global batches of ``global_batch`` sample indices, this rank's contiguous slice of each.

    State = (epoch, position): position counts the samples of this epoch already served to *all* ranks. A
    per-rank counter ("rank 1 has seen 12 samples") would not reshard: at another world size rank 1's slice is
    somewhere else. The global position does; each rank recomputes its slice from it (``first`` below).
    """

    def __init__(self, n_items: int, global_batch: int, world_size: int, rank: int, seed: int = 0):
        if global_batch < 1 or global_batch % world_size:
            raise ValueError(f"global_batch={global_batch} must be a positive multiple of world_size={world_size}")
        if n_items < global_batch:
            raise ValueError(f"{n_items} samples are too few for one global batch of {global_batch}")
        self.n_items, self.global_batch, self.seed = n_items, global_batch, seed
        self.rank_batch = global_batch // world_size
        self.first = rank * self.rank_batch          # this rank's offset inside every global batch
        self.epoch, self.position = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        return self.n_items // self.global_batch     # an incomplete last global batch is dropped

    def next_indices(self) -> list[int]:
        """This rank's sample indices for the next global batch (and advance the global position)."""
        if self.position + self.global_batch > self.batches_per_epoch * self.global_batch:
            self.epoch, self.position = self.epoch + 1, 0
        order = torch.randperm(self.n_items, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        start = self.position + self.first
        self.position += self.global_batch
        return order[start:start + self.rank_batch].tolist()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if state["position"] % self.global_batch:
            raise ValueError(f"position {state['position']} is not a whole number of global batches of "
                             f"{self.global_batch}: the checkpoint was written with another global batch")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


# --- seeds, and values that differ per rank ---------------------------------------------------------------------

def seed_everything(seed: int) -> None:
    """torch (CPU and every GPU), Python's random and numpy, as a fresh process of a run would seed them."""
    torch.manual_seed(seed)   # also seeds every CUDA device
    random.seed(seed)
    np.random.seed(seed % 2**32)


class _PerRank:
    """A list of every rank's value, pickled as one opaque object: DCP stores it whole (a list or dict holding
    tensors would be split into one entry per tensor, whose keys depend on the world size)."""

    def __init__(self, values: list):
        self.blob = pickle.dumps(values)

    def values(self) -> list:
        return pickle.loads(self.blob)


def per_rank(value) -> _PerRank:
    """Every rank's ``value``, gathered (a collective: call it on every rank), to store under one DCP key.

    DCP deduplicates a key that every rank writes (it keeps one rank's copy: right for replicated state, wrong
    for per-rank state such as RNG states); after the gather every rank writes the same list."""
    values = [value]
    if dist.is_initialized() and dist.get_world_size() > 1:
        values = [None] * dist.get_world_size()
        dist.all_gather_object(values, value)
    return _PerRank(values)


def this_rank(stored: _PerRank):
    """This rank's entry of what ``per_rank`` stored, or None when the checkpoint was written at another world
    size (then there is no "own" entry: a resharded run cannot repeat the old ranks' random draws)."""
    values = stored.values()
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    return values[rank] if len(values) == world else None


# --- what the run trains ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Recipe:
    """The training run (a run script's Config has these fields): small enough for 2 CPU cores."""

    steps: int = 8
    global_batch: int = 8
    n_items: int = 24            # samples per epoch: 3 global batches, so a run crosses epochs
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.1         # random per step: a resumed run must restore the RNG to repeat it
    jitter: bool = True          # random shifts (Python's random) and noise_share of the input tokens replaced
    noise_share: float = 0.1     # by random ones (numpy): with dropout, all three generators matter
    lr: float = 3e-3
    warmup_steps: int = 3
    seed: int = 1234
    parallel: str = "fsdp2"      # "fsdp2" (sharded state) or "ddp" (replicated)


def lr_factor(step: int, recipe: Recipe) -> float:
    """Linear warm-up over warmup_steps, then cosine decay to 10% at recipe.steps (LambdaLR's factor)."""
    if step < recipe.warmup_steps:
        return (step + 1) / recipe.warmup_steps
    progress = min(1.0, (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


VOCAB_SIZE = 65   # Tiny Shakespeare's characters


@functools.lru_cache(maxsize=1)
def tokens() -> torch.Tensor:
    """Tiny Shakespeare's training text as token ids (character level)."""
    text = data.load_shakespeare()
    return data.train_val_split(data.CharTokenizer.from_text(text).encode(text))[0]


def windows(token_ids: torch.Tensor, indices: list[int], recipe: Recipe, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y), each (len(indices), block_size): sample i starts at i * block_size. With recipe.jitter the start is
    shifted by a random 0..block_size-1 (drawn from Python's random) and about noise_share of the input tokens x
    are replaced by random token ids (drawn from numpy's global generator; the targets y stay clean), so the data
    of a step depends on both generators."""
    T = recipe.block_size
    starts = [i * T + (random.randrange(T) if recipe.jitter else 0) for i in indices]
    chunks = torch.stack([token_ids[s:s + T + 1] for s in starts])
    x, y = chunks[:, :-1].clone(), chunks[:, 1:]
    if recipe.jitter and recipe.noise_share > 0:
        noisy = torch.from_numpy(np.random.random_sample(tuple(x.shape)) < recipe.noise_share)    # (B, T) bool
        x[noisy] = torch.from_numpy(np.random.randint(0, VOCAB_SIZE, size=tuple(x.shape)))[noisy].to(x.dtype)
    return x.to(device), y.to(device)


@dataclass
class Parts:
    """What the students' ``start`` receives: a plain model and how to parallelize it, build its optimizer and
    schedule; plus the sampler and the data."""

    model: torch.nn.Module
    shard: object             # model -> the model to train (FSDP2: the same module, sharded in place; DDP: a wrapper)
    make_optimizer: object    # parameters -> AdamW
    make_scheduler: object    # optimizer -> LambdaLR
    sampler: ResumableSampler
    token_ids: torch.Tensor


def build(recipe: Recipe, device, world_size: int, rank: int, token_ids: torch.Tensor) -> Parts:
    """The parts of a run, seeded as a fresh process seeds them: the model's initial weights from recipe.seed (the
    same on every rank), then every RNG from recipe.seed + 1000 (rank + 1) (dropout and shifts differ per rank)."""
    seed_everything(recipe.seed)
    config = models.GPTConfig(vocab_size=VOCAB_SIZE, block_size=recipe.block_size, n_layer=recipe.n_layer,
                              n_head=recipe.n_head, n_embd=recipe.n_embd, dropout=recipe.dropout)
    model = models.GPT(config).to(device)
    seed_everything(recipe.seed + 1000 * (rank + 1))
    return Parts(model=model, shard=lambda m: parallelize(m, recipe.parallel, device),
                 make_optimizer=lambda params: torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.1),
                 make_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, recipe)),
                 sampler=ResumableSampler(recipe.n_items, recipe.global_batch, world_size, rank, recipe.seed),
                 token_ids=token_ids)


def parallelize(model: torch.nn.Module, parallel: str, device) -> torch.nn.Module:
    """FSDP2 (each block a unit, then the root; in place) or DDP (a wrapper) over every rank of the default group."""
    if parallel == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
        for block in model.h:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    raise ValueError(f"parallel={parallel!r}: use 'fsdp2' or 'ddp'")


# --- one step, and where checkpoints are -----------------------------------------------------------------------------------------

def train_step(model, optimizer, scheduler, sampler: ResumableSampler, token_ids, recipe: Recipe, device) -> dict:
    """One optimizer step on the next global batch; returns what the log records (loss: the global batch's mean)."""
    batch = dict(sampler.state_dict())                    # which global batch this step trains on
    lr = optimizer.param_groups[0]["lr"]
    x, y = windows(token_ids, sampler.next_indices(), recipe, device)
    _, loss = model(x, y)
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()                        # (set_to_none=True is the default)
    loss = loss.detach().float()
    if dist.is_initialized():
        dist.all_reduce(loss)
        loss /= dist.get_world_size()
    return {"loss": loss.item(), "lr": lr, "batch": batch}


def checkpoint_dir(folder, step: int) -> Path:
    return Path(folder) / f"step_{step:06d}"


def latest_checkpoint(folder) -> Path | None:
    """The newest complete checkpoint in folder (DCP's .metadata written), or None."""
    done = sorted(p for p in Path(folder).glob("step_*") if (p / ".metadata").is_file())
    return done[-1] if done else None
