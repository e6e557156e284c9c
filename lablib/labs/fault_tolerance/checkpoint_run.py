"""Lab 10's run loop: the students' ``start`` and ``save`` in every attempt, the faults it plays, and its log.

- ``train``: one attempt of a resumable run. It calls the students' ``start`` (build the state, restore it from
  the latest complete checkpoint), trains to the recipe's steps with ``checkpointing.train_step``, calls the
  students' ``save`` (a DCP checkpoint every ``ckpt_every`` steps), logs every step (loss, learning rate, the
  batch it trained on, world size, attempt) to a JSON-lines file that outlives the processes, records after each
  save what the run held (``record_held``: the full weights, AdamW's moments, step, schedule and sampler; lablib's
  own record, read back by the resharding check), and plays the faults it is given;
- ``Fault``: a rank that kills itself with SIGKILL (after a step, or in the middle of a save: before it calls
  the students' ``save`` while the others are inside it), one that stops responding (sleeps), or, inside one
  process, one that stops (``Stopped``);
- ``faults_seen``: the faults played and when a peer noticed them, for the restart's timeline;
- ``reshard_runs``: section 3's runs at several world sizes (a checkpoint written by N ranks, resumed by M) in one
  torchrun start: for each run its ranks form a fresh default process group of its size and train as a new job.

A checkpoint is a folder ``step_000004`` written by ``torch.distributed.checkpoint``; it is complete once DCP's
``.metadata`` file is there (rank 0 writes it last, after every rank has written its shards):
``checkpointing.latest_checkpoint`` skips a folder without it, so a save cut short by a kill is never resumed from.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from lablib.jobs import distenv, processes
from lablib.labs.fault_tolerance.checkpointing import Recipe, build, checkpoint_dir, latest_checkpoint, tokens, train_step

LOG_FILE = "log.jsonl"
MARKER = "checkpoint saved at step"   # rank 0 prints "checkpoint saved at step N" after each complete save
SAVE_ERROR = "save_error.txt"


KINDS = ("kill", "hang", "stop", "savekill")


@dataclass(frozen=True)
class Fault:
    """On attempt ``attempt``, rank ``rank`` kills itself (SIGKILL: ``kill``), stops responding (sleeps: ``hang``)
    or, in a run inside one process (``ft_probes.precheck``), raises ``Stopped`` (``stop``), right after step
    ``step`` (after its checkpoint, when that step writes one). ``savekill``: rank ``rank`` is SIGKILLed in the
    middle of step ``step``'s save, as soon as its first shard file appears (its peers are inside the save too:
    DCP never writes ``.metadata``, and the restart resumes from the checkpoint before)."""

    kind: str
    rank: int
    step: int
    attempt: int

    @classmethod
    def parse(cls, text: str, attempt: int) -> "Fault":
        """'kill:1@5', 'hang:1@5', 'stop:0@5' (rank 1 or 0, after step 5) or 'savekill:1@4' (during step 4's save)."""
        try:
            kind, rest = text.split(":")
            rank, step = (int(v) for v in rest.split("@"))
        except ValueError:
            raise ValueError(f"fault {text!r}: write 'kill:RANK@STEP' or 'hang:RANK@STEP'") from None
        if kind not in KINDS:
            raise ValueError(f"fault {text!r}: the kind is one of {', '.join(KINDS)}")
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


def _record_fault(fault: Fault, folder) -> None:
    fault_file(folder, fault.attempt, fault.rank).write_text(
        json.dumps({"kind": fault.kind, "step": fault.step, "t": time.time()}))
    if fault.kind in ("kill", "savekill"):
        processes.record_deliberate_kill(os.getpid(), f"fault {fault.kind}: rank {fault.rank} at step {fault.step} "
                                                      f"on attempt {fault.attempt}")


def play_fault(fault: Fault | None, step: int, rank: int, attempt: int, folder) -> None:
    """Kill or hang this rank here if the fault says so (it records when, for the restart's timeline)."""
    if fault is None or fault.rank != rank or fault.step != step or fault.attempt != attempt or fault.kind == "savekill":
        return
    _record_fault(fault, folder)
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "stop":
        raise Stopped(f"stopped after step {step}")
    time.sleep(3600)    # "hang": alive, silent; the other ranks wait in their next collective until it times out


def kill_when_writing(folder: Path, rank: int, record) -> None:
    """SIGKILL this process as soon as a shard file of this rank appears in folder (a thread that watches while the
    students' save runs): a node lost in the middle of a checkpoint. DCP names each rank's data files
    ``__<rank>_<n>.distcp`` (torch/distributed/checkpoint/filesystem.py, ``_generate_uuid``/``gen_file``)."""
    import threading

    def watch() -> None:
        while True:
            if any(folder.glob(f"__{rank}_*.distcp")):
                record()
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.001)

    threading.Thread(target=watch, daemon=True).start()


def _whole(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def held(model, optimizer, scheduler, sampler, step: int) -> dict:
    """What a run holds now, whole (not sharded): per parameter name ('module.' of DDP dropped) the weight and
    AdamW's state, and the step, the schedule and the sampler. A collective under FSDP2 (every rank calls it:
    ``DTensor.full_tensor`` all-gathers); lablib's own record, written next to each checkpoint, against which a
    checkpoint resumed at another world size is checked."""
    weights, optim = {}, {}
    for name, p in model.named_parameters():
        name = name.removeprefix("module.")
        weights[name] = _whole(p)
        optim[name] = {k: _whole(v) if torch.is_tensor(v) else v for k, v in optimizer.state.get(p, {}).items()}
    return {"step": step, "weights": weights, "optimizer": optim, "last_epoch": scheduler.last_epoch,
            "lr": optimizer.param_groups[0]["lr"], "sampler": dict(sampler.state_dict())}


def held_file(folder, step: int) -> Path:
    return Path(folder) / f"held_step_{step:06d}.pt"


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
    if torch.device(env.device).type == "cuda":
        # bit for bit on a GPU too: deterministic kernels, and cuBLAS's workspace fixed before its first product
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
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
    if attempt == 0 and not resume_from and source is not None and env.is_main:
        print(f"[fault_tolerance] {folder} already holds a complete checkpoint ({source.name}): resuming from it. "
              f"A reused folder continues the old run; give a new run a fresh folder", flush=True)
    # start() shards the model, builds the optimizer and only then loads (the optimizer's state needs an optimizer to
    # load into): when make_optimizer returns splits start() into "shard + optimizer" and "load" (DCP's load and
    # whatever else start() does after it) for the restart's timeline.
    t_start, built = time.time(), {}

    def make_optimizer(params):
        optimizer = parts.make_optimizer(params)
        built.setdefault("t_optimizer", time.time())
        return optimizer

    state = impl.start(parts.model, parts.shard, make_optimizer, parts.make_scheduler, parts.sampler,
                       None if source is None else str(source))
    t_loaded = time.time()
    log.write("attempt", attempt=attempt, world_size=env.world_size, resumed_from=None if source is None else str(source),
              resumed_step=state.step, t_process=_process_start(), t_group=t_group, t_start=t_start,
              t_optimizer=built.get("t_optimizer", t_start), t_loaded=t_loaded)
    try:
        while state.step < recipe.steps:
            record = train_step(state.model, state.optimizer, state.scheduler, state.sampler, token_ids, recipe,
                                env.device)
            state.step += 1
            log.write("step", step=state.step, attempt=attempt, world_size=env.world_size, **record)
            if state.step % ckpt_every == 0:
                path = checkpoint_dir(folder, state.step)
                t0 = time.perf_counter()
                if fault is not None and fault.kind == "savekill" and (fault.rank, fault.step) == (env.rank, state.step):
                    kill_when_writing(path, env.rank, lambda: _record_fault(fault, folder))
                impl.save(state, str(path))
                seconds = time.perf_counter() - t0
                _wait_for_every_rank(path, env.world_size, env.rank, save_wait_s)
                if not (path / ".metadata").is_file():
                    raise RuntimeError(f"save() returned but {path} holds no DCP checkpoint (no .metadata file): "
                                       f"write it with torch.distributed.checkpoint.save(..., checkpoint_id=folder)")
                log.write("save", step=state.step, attempt=attempt, seconds=seconds)
                record = held(state.model, state.optimizer, state.scheduler, state.sampler, state.step)
                if env.is_main:
                    torch.save(record, held_file(folder, state.step))
                if env.is_main and announce:
                    print(f"{MARKER} {state.step} ({seconds:.2f} s)", flush=True)
            play_fault(fault, state.step, env.rank, attempt, folder)
    except RuntimeError:
        # A peer died or hung: this rank's collective failed. When it noticed is the detection time.
        (folder / f"detected_attempt{attempt}_rank{env.rank}.json").write_text(json.dumps({"t": time.time()}))
        raise


def _process_start() -> float:
    """When this process started, on the wall clock. psutil's create_time() adds the process's start ticks to the
    boot time of /proc/stat, which Linux gives in whole seconds: up to 1 s early (0.93 s measured), enough to put a
    new attempt's start before the fault that caused it. /proc/uptime gives the time since boot to 10 ms, so
    now - (uptime - start ticks / ticks per second) is the start to about 10 ms."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")          # field 22 of proc(5): starttime, in ticks
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - started)
    except (OSError, ValueError, IndexError):                          # no /proc (not Linux): psutil's estimate
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



# --- several world sizes in one torchrun start (section 3) -------------------------------------------------------

def parse_reshard(text: str) -> tuple[str, int, int]:
    """'fsdp2:4->2' -> ('fsdp2', 4, 2): a run of 4 FSDP2 ranks writes checkpoints, a run of 2 resumes one."""
    try:
        parallel, sizes = text.split(":")
        before, after = (int(v) for v in sizes.split("->"))
    except ValueError:
        before = after = parallel = None
    if parallel not in ("fsdp2", "ddp") or not 1 <= before != after >= 1:
        raise ValueError(f"reshard {text!r}: write 'PARALLEL:N->M' (fsdp2 or ddp; N != M, both >= 1), e.g. 'fsdp2:4->2'")
    return parallel, before, after


def reshard_runs(impl, recipe: Recipe, env, folder, reshards: tuple[str, ...], *, ckpt_every: int) -> dict:
    """Each reshard 'PARALLEL:N->M' as two jobs in this torchrun start of max(N, M) ranks: N ranks train from
    scratch (a checkpoint every ckpt_every steps), then M ranks resume from the first checkpoint. For each run, ranks
    0..size-1 form a new default process group of its size (the others wait for a later run) and train as a new
    job: ``build`` reseeds every generator and makes fresh parts, the students' ``start`` reads from disk what the
    other world size wrote, and FSDP2, DDP and DCP act on the group they are given. One start instead of one per
    run (each costs its agent's and every rank's Python and torch start-up). Returns rank 0's logs per run."""
    plan, runs = [], {}
    for text in reshards:
        parallel, before, after = parse_reshard(text)
        first, second = f"{parallel}_{before}", f"{parallel}_{before}_to_{after}"
        runs.setdefault(first, (parallel, before, ""))
        runs.setdefault(second, (parallel, after, str(checkpoint_dir(Path(folder) / first, ckpt_every))))
        plan.append({"parallel": parallel, "before": before, "after": after, "runs": (first, second)})
    timeout = datetime.timedelta(seconds=processes.rank_timeout_from_env())
    store = distenv.attempt_store(timeout)
    for i, (key, (parallel, size, source)) in enumerate(runs.items()):
        if env.rank < size:
            run_env = _new_group(env, size, dist.PrefixStore(f"reshard_run{i}", store), timeout)
            train(impl, dataclasses.replace(recipe, parallel=parallel), run_env, Path(folder) / key,
                  ckpt_every=ckpt_every, resume_from=source, attempt=0, announce=False)
            dist.barrier()                 # no rank leaves while a peer is in its last collective
            dist.destroy_process_group()
    _new_group(env, env.world_size, dist.PrefixStore("reshard_runs_end", store), timeout)   # the job's group again
    logs = {key: RunLog(Path(folder) / key, env.rank).read() for key in runs}
    return {"runs": {key: {"steps": [r for r in log if r["kind"] == "step"],
                           "attempts": [r for r in log if r["kind"] == "attempt"]} for key, log in logs.items()},
            "reshards": plan}


def _new_group(env, size: int, store, timeout):
    """This rank in a fresh default process group of ranks 0..size-1 (any group before it destroyed)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    kwargs = {"device_id": env.device} if env.backend == "nccl" else {}
    dist.init_process_group(env.backend, store=store, rank=env.rank, world_size=size, timeout=timeout, **kwargs)
    return dataclasses.replace(env, world_size=size)
