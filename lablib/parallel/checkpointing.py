"""A training run that can be killed and resumed (lab 10): its data order, its seeds, its checkpoints, its faults.

What a resumed run needs to continue *exactly* is the students' ``AppState`` (lab 10's exercise 1, written in the
notebook, never here). This module is everything around it:

- ``ResumableSampler``: one permutation of the data per epoch (seeded with ``seed + epoch``, the same on every
  rank); its state is **global** (epoch, samples of this epoch already served to all ranks together), so it
  reshards: rank r of N takes the r-th slice of each global batch, whatever N was when the state was saved;
- ``seed_everything`` and ``per_rank`` / ``this_rank``: DCP keeps **one** copy of a key that every rank writes
  (it deduplicates what it takes for replicated state), so a value that differs per rank (its RNG states) is
  gathered into one list that every rank writes alike, and each rank takes its own entry back;
- ``Recipe`` and ``build``: the model (course GPT with dropout), the data (Tiny Shakespeare windows with a random
  shift, drawn from Python's ``random``), FSDP2 or DDP applied from outside, AdamW, warm-up + cosine schedule;
- ``train``: the loop, which calls the students' ``start`` (build the state, restore it from the latest complete
  checkpoint) and ``save`` (a DCP checkpoint every ``ckpt_every`` steps), logs every step (loss, learning rate,
  the batch it trained on, world size, attempt) to a JSON-lines file that outlives the processes, and plays
  the faults it is given: a rank that kills itself with SIGKILL, or one that stops responding (sleeps);
- ``simulate_waste``: failures drawn at random against a checkpoint interval, to check the Young/Daly formula.

A checkpoint is a folder ``step_000004`` written by ``torch.distributed.checkpoint``; it is complete once DCP's
``.metadata`` file is there (rank 0 writes it last, after every rank has written its shards).
"""

from __future__ import annotations

import functools
import json
import math
import os
import pickle
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from lablib.course import data, models
from lablib.jobs import distenv, processes

LOG_FILE = "log.jsonl"
MARKER = "checkpoint saved at step"   # rank 0 prints "checkpoint saved at step N" after each complete save
SAVE_ERROR = "save_error.txt"


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
    import numpy as np

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
    jitter: bool = True          # shift each window by random.randrange(block_size): Python's RNG matters too
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


@functools.lru_cache(maxsize=1)
def tokens() -> torch.Tensor:
    """Tiny Shakespeare's training text as token ids (character level)."""
    text = data.load_shakespeare()
    return data.train_val_split(data.CharTokenizer.from_text(text).encode(text))[0]


def windows(token_ids: torch.Tensor, indices: list[int], recipe: Recipe, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y), each (len(indices), block_size): sample i starts at i * block_size, shifted by a random 0..block_size-1
    (drawn from Python's random) when recipe.jitter, so the data of a step depends on the RNG too."""
    T = recipe.block_size
    starts = [i * T + (random.randrange(T) if recipe.jitter else 0) for i in indices]
    chunks = torch.stack([token_ids[s:s + T + 1] for s in starts]).to(device)
    return chunks[:, :-1], chunks[:, 1:]


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
    config = models.GPTConfig(vocab_size=65, block_size=recipe.block_size, n_layer=recipe.n_layer,
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


# --- one step, and the loop -----------------------------------------------------------------------------------------

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


@dataclass(frozen=True)
class Fault:
    """On attempt ``attempt``, rank ``rank`` kills itself (SIGKILL), stops responding (sleeps) or, in a run
    inside one process (``ft_probes.precheck``), raises ``Stopped``, right after step ``step`` (after its
    checkpoint, when that step writes one)."""

    kind: str
    rank: int
    step: int
    attempt: int

    @classmethod
    def parse(cls, text: str, attempt: int) -> "Fault":
        """'kill:1@5', 'hang:1@5' or 'stop:0@5' (rank 1, after step 5)."""
        try:
            kind, rest = text.split(":")
            rank, step = (int(v) for v in rest.split("@"))
        except ValueError:
            raise ValueError(f"fault {text!r}: write 'kill:RANK@STEP' or 'hang:RANK@STEP'") from None
        if kind not in ("kill", "hang", "stop"):
            raise ValueError(f"fault {text!r}: the kind is 'kill', 'hang' or 'stop'")
        return cls(kind, rank, step, attempt)


class Stopped(Exception):
    """A 'stop' fault: the run inside one process ends here, as a killed one would (nothing after it runs)."""


class RunLog:
    """The run's JSON-lines log in its checkpoint folder (rank 0 writes it): it outlives killed processes."""

    def __init__(self, folder, rank: int):
        self.path = Path(folder) / LOG_FILE
        self.rank = rank

    def write(self, kind: str, **fields) -> None:
        if self.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps({"kind": kind, "t": time.time(), **fields}) + "\n")

    def read(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines()] if self.path.exists() else []


def fault_file(folder, attempt: int, rank: int) -> Path:
    return Path(folder) / f"fault_attempt{attempt}_rank{rank}.json"


def play_fault(fault: Fault | None, step: int, rank: int, attempt: int, folder) -> None:
    """Kill or hang this rank here if the fault says so (it records when, for the restart's timeline)."""
    if fault is None or fault.rank != rank or fault.step != step or fault.attempt != attempt:
        return
    fault_file(folder, attempt, rank).write_text(json.dumps({"kind": fault.kind, "step": step, "t": time.time()}))
    if fault.kind == "kill":
        processes.record_deliberate_kill(os.getpid(), f"fault kill: rank {rank} at step {step} on attempt {attempt}")
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "stop":
        raise Stopped(f"stopped after step {step}")
    time.sleep(3600)    # "hang": alive, silent; the other ranks wait in their next collective until it times out


def _wait_for_every_rank(folder: Path, world_size: int, rank: int, wait_s: float) -> None:
    """After the students' save returned on this rank: every rank must have been in it (DCP's save is a collective).
    Each rank leaves a file and waits for the others' (the file system, not a collective: a rank still inside a
    save that its peers never called would pair our collective with DCP's, a crash instead of a message)."""
    folder.mkdir(parents=True, exist_ok=True)     # a save that wrote nothing on this rank left no folder
    (folder / f".returned_rank{rank}").write_text("")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if all((folder / f".returned_rank{r}").exists() for r in range(world_size)):
            return
        time.sleep(0.02)
    missing = [r for r in range(world_size) if not (folder / f".returned_rank{r}").exists()]
    message = (f"save() returned on rank {rank}, but rank(s) {missing} did not come back from it within {wait_s:g} s: "
               f"DCP's save is a collective, every rank must call it (each writes its own shards, rank 0 the "
               f"metadata); a save on rank 0 only waits for the others forever")
    (folder.parent / SAVE_ERROR).write_text(message)
    raise RuntimeError(message)


def train(impl, recipe: Recipe, env, folder, *, ckpt_every: int, faults: tuple[str, ...] = (),
          resume_from: str = "", reference: bool = False, save_wait_s: float = 10.0,
          attempt: int | None = None, announce: bool = True) -> None:
    """One attempt of a resumable run: (on attempt 0, if asked) an uninterrupted reference run with lablib's own
    parts; then the students' ``impl.start`` (restoring the latest complete checkpoint in folder, or resume_from)
    and the loop to recipe.steps, with ``impl.save`` every ckpt_every steps and the faults played. Everything
    goes to the log in folder; the caller reads it back (``RunLog.read``) when the last attempt is done.
    ``attempt``: torchrun's restart count by default (a run inside one process numbers its attempts itself);
    ``announce``: rank 0 prints "checkpoint saved at step N" after each save (what a supervisor can watch for)."""
    if attempt is None:
        attempt = distenv.restart_attempt()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    log = RunLog(folder, env.rank)
    if (folder / SAVE_ERROR).exists():
        raise RuntimeError((folder / SAVE_ERROR).read_text())
    t_group = time.time()
    token_ids = tokens()
    if reference and attempt == 0:
        parts = build(recipe, env.device, env.world_size, env.rank, token_ids)
        model = parts.shard(parts.model)
        optimizer = parts.make_optimizer(model.parameters())
        scheduler = parts.make_scheduler(optimizer)
        for step in range(1, recipe.steps + 1):
            log.write("reference", step=step, **train_step(model, optimizer, scheduler, parts.sampler, token_ids,
                                                           recipe, env.device))
        del model, optimizer, scheduler
    fault = Fault.parse(faults[attempt], attempt) if attempt < len(faults) else None
    parts = build(recipe, env.device, env.world_size, env.rank, token_ids)
    source = Path(resume_from) if resume_from and attempt == 0 else latest_checkpoint(folder)
    t_start = time.time()
    state = impl.start(parts.model, parts.shard, parts.make_optimizer, parts.make_scheduler, parts.sampler,
                       None if source is None else str(source))
    log.write("attempt", attempt=attempt, world_size=env.world_size, resumed_from=None if source is None else str(source),
              resumed_step=state.step, t_process=_process_start(), t_group=t_group, t_start=t_start, t_loaded=time.time())
    try:
        while state.step < recipe.steps:
            record = train_step(state.model, state.optimizer, state.scheduler, state.sampler, token_ids, recipe,
                                env.device)
            state.step += 1
            log.write("step", step=state.step, attempt=attempt, world_size=env.world_size, **record)
            if state.step % ckpt_every == 0:
                path = checkpoint_dir(folder, state.step)
                t0 = time.perf_counter()
                impl.save(state, str(path))
                seconds = time.perf_counter() - t0
                _wait_for_every_rank(path, env.world_size, env.rank, save_wait_s)
                if not (path / ".metadata").is_file():
                    raise RuntimeError(f"save() returned but {path} holds no DCP checkpoint (no .metadata file): "
                                       f"write it with torch.distributed.checkpoint.save(..., checkpoint_id=folder)")
                log.write("save", step=state.step, attempt=attempt, seconds=seconds)
                if env.is_main and announce:
                    print(f"{MARKER} {state.step} ({seconds:.2f} s)", flush=True)
            play_fault(fault, state.step, env.rank, attempt, folder)
    except RuntimeError:
        # A peer died or hung: this rank's collective failed. When it noticed is the detection time.
        (folder / f"detected_attempt{attempt}_rank{env.rank}.json").write_text(json.dumps({"t": time.time()}))
        raise


def _process_start() -> float:
    import psutil

    return psutil.Process().create_time()


def faults_seen(folder) -> list[dict]:
    """Every fault played and every detection recorded in folder, oldest first."""
    out = []
    for p in Path(folder).glob("fault_attempt*_rank*.json"):
        attempt, rank = (int(v) for v in p.stem[len("fault_attempt"):].split("_rank"))
        out.append({**json.loads(p.read_text()), "attempt": attempt, "rank": rank})
    detected = {}
    for p in Path(folder).glob("detected_attempt*_rank*.json"):
        attempt = int(p.stem[len("detected_attempt"):].split("_rank")[0])
        detected[attempt] = min(detected.get(attempt, math.inf), json.loads(p.read_text())["t"])
    for f in out:
        f["t_detected"] = detected.get(f["attempt"])
    return sorted(out, key=lambda f: f["t"])


# --- how often to checkpoint, simulated -----------------------------------------------------------------------------

def simulate_waste(interval_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0,
                   work_s: float = 3e6, seed: int = 0) -> float:
    """The seconds wasted per second of new work (wall / work - 1), for a job of work_s seconds of work that writes a
    checkpoint (checkpoint_s, blocking) after every interval_s of work and fails at exponentially distributed
    times (mean mtbf_s); after a failure it restarts (restart_s) from its last checkpoint. A failure can strike
    during a checkpoint (that checkpoint is lost too), not during a restart. A Monte Carlo reference for the
    Young/Daly formula (numbers only)."""
    rng = random.Random(seed)
    done, wall = 0.0, 0.0
    next_failure = rng.expovariate(1.0 / mtbf_s)
    while done < work_s:
        segment = min(interval_s, work_s - done) + checkpoint_s
        if wall + segment <= next_failure:          # the segment and its checkpoint are done
            wall += segment
            done += segment - checkpoint_s
            continue
        wall = next_failure + restart_s          # the segment's work is lost; restart from the last checkpoint
        next_failure = wall + rng.expovariate(1.0 / mtbf_s)
    return wall / work_s - 1.0
