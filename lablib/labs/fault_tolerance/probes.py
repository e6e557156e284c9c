"""Lab 10's graded checks: a killed-and-resumed run against the uninterrupted one, and the time a restart costs.

- ``precheck(impl)``: the students' ``start``/``save``/``AppState`` at world size 1 inside this process (a gloo
  group of one): the run is stopped after a step, "restarted" with freshly built parts and fresh seeds, and
  resumed from its last checkpoint, in seconds, before any torchrun start;
- ``check_resumed(metrics, faults)``: the graded comparison of a run's log (``run``'s
  metrics, or the precheck's): every step of every attempt equal to the uninterrupted run's step, bit for bit
  (loss, learning rate, the global batch it trained on), each attempt resumed from the last checkpoint before
  its fault, and steps 1..N all there. A failure names the first step that differs and what differs;
- ``check_reshard(impl, folder, step, metrics)``: the graded reshard: the students' ``start`` at world size 1
  (in this process) on a checkpoint that 2 FSDP2 ranks wrote; what it restores, whole, must equal what the
  2-rank run held when it saved (lablib's own record, ``checkpoint_run.held``), bit for bit (DCP copies bytes),
  and the next step must train the uninterrupted run's batch at its learning rate;
- ``restart_timeline(metrics)``: per fault, where the time went (detection, new processes, start-up, building,
  loading the checkpoint, replaying the lost steps).
The answers (the students' ``AppState``, ``start`` and ``save``) are not here.
"""

from __future__ import annotations

import atexit
import contextlib
import random
import shutil
import tempfile

import torch
import torch.distributed as dist

from lablib.labs.fault_tolerance import checkpoint_run, checkpointing
from lablib import checks
from lablib.jobs.distenv import DistEnv
from lablib.jobs.exercise import load_module


def load_impl(path: str = "ft_impl.py"):
    return load_module(path, ("AppState", "start", "save"))


def fresh_dir(name: str) -> str:
    """A new, empty folder for one run's checkpoints and log, removed when this process (the kernel) exits."""
    folder = tempfile.mkdtemp(prefix=f"lab10-{name}-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


def precheck(impl, recipe: checkpointing.Recipe | None = None, stop_after: int = 3, ckpt_every: int = 2) -> dict:
    """The students' code at world size 1 in this process: an uninterrupted reference run, then the run with
    checkpoints, stopped after step ``stop_after``, then a fresh start resumed from its last checkpoint (by default
    6 steps of a one-block GPT, stopped after step 3, resumed from step 2's checkpoint, across the epoch boundary
    after step 3).
    Returns the log as the run script returns it (for ``check_resumed``). This process's RNG states are kept."""
    recipe = recipe or checkpointing.Recipe(steps=6, n_layer=1, parallel="fsdp2")
    env = DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo")
    folder = fresh_dir("precheck")
    faults = (f"stop:0@{stop_after}",)
    with _one_rank_group():
        try:
            checkpoint_run.train(impl, recipe, env, folder, ckpt_every=ckpt_every, faults=faults, reference=True,
                                 attempt=0, announce=False)
            checks.check_true(False, f"the run was to stop after step {stop_after} and did not")
        except checkpoint_run.Stopped:
            pass
        checkpoint_run.train(impl, recipe, env, folder, ckpt_every=ckpt_every, faults=faults, attempt=1, announce=False)
    log = checkpoint_run.RunLog(folder, 0).read()
    return {"reference": [r for r in log if r["kind"] == "reference"],
            "steps": [r for r in log if r["kind"] == "step"],
            "attempts": [r for r in log if r["kind"] == "attempt"],
            "faults": [{"kind": "stop", "rank": 0, "step": stop_after, "attempt": 0}], "ckpt_every": ckpt_every}


def check_resumed(metrics, faults=None, ckpt_every: int | None = None, where: str = "") -> None:
    """The graded checks of a killed-and-resumed run (see the module docstring)."""
    where = where or (f"the run on {metrics['attempts'][0]['world_size']} rank(s)" if metrics["attempts"] else "the run")
    ckpt_every = ckpt_every or metrics.get("ckpt_every", 2)
    reference = {r["step"]: r for r in metrics["reference"]}
    steps = sorted(reference)
    checks.check_true(bool(steps) and steps == list(range(1, len(steps) + 1)),
                      f"{where}: the uninterrupted reference steps are {steps}, expected 1..N")
    faults = [checkpoint_run.Fault.parse(f, i) for i, f in enumerate(faults)] if faults is not None else [
        checkpoint_run.Fault(f["kind"], f["rank"], f["step"], f["attempt"]) for f in metrics["faults"]]
    attempts = metrics["attempts"]
    checks.check_equal(len(attempts), len(faults) + 1, f"{where}: attempts (one per fault, then the one that finished)",
                       hint="a fault that was not played, or an attempt that failed: read the output above")
    for a in attempts[1:]:
        fault = faults[a["attempt"] - 1]
        # a save cut short by a kill left no .metadata: the one before it is the last complete checkpoint
        last_ckpt = (fault.step - (fault.kind == "savekill")) // ckpt_every * ckpt_every
        checks.check_equal(a["resumed_step"], last_ckpt,
                           f"{where}: attempt {a['attempt']} after the fault after step {fault.step}: the step start() "
                           f"resumed at (state.step; the last checkpoint was written after step {last_ckpt})",
                           hint="start() must load the checkpoint it is given, and load_state_dict must restore step"
                                if a["resumed_step"] == 0 else "load_state_dict must restore the step counter")
    records = metrics["steps"]
    for r in sorted(records, key=lambda r: (r["step"], r["attempt"])):
        ref = reference.get(r["step"])
        what = f"{where}: step {r['step']} (attempt {r['attempt']})"
        checks.check_true(ref is not None, f"{what}: the uninterrupted run has no such step (it ran {len(steps)})")
        if r["batch"] != ref["batch"]:
            seen = [s["step"] for s in metrics["reference"] if s["batch"] == r["batch"]]
            checks.check_true(False, f"{what} trained on global batch {dict(r['batch'])}, the uninterrupted run on "
                                     f"{dict(ref['batch'])}" + (f" (its step {seen[0]}'s: data seen twice)" if seen else ""),
                              hint="the sampler's epoch and position must be saved and restored")
        checks.check_equal(r["lr"], ref["lr"], f"{what}: learning rate",
                           hint="the learning-rate schedule (the scheduler's state) must be saved and restored")
        if r["loss"] != ref["loss"]:
            checks.check_true(False, f"{what}: loss {r['loss']!r}, the uninterrupted run's {ref['loss']!r} "
                                     f"(|diff| {abs(r['loss'] - ref['loss']):.3g}; it must be equal, bit for bit)",
                              hint="same batch and learning rate, different result: the model or optimizer state, "
                                   "or a random generator (dropout: torch; the windows' shifts: Python's random) was "
                                   "not restored, or not this rank's own (DCP keeps one copy of a key every rank "
                                   "writes; lablib.labs.fault_tolerance.checkpointing.per_rank)")
    final = {}
    for r in records:
        final[r["step"]] = r
    checks.check_equal(sorted(final), steps, f"{where}: the steps trained (each step's last attempt)",
                       hint="no step may be lost or trained twice on different data")
    for a in attempts[1:]:
        mine = [r["step"] for r in records if r["attempt"] == a["attempt"]]
        checks.check_equal(mine, list(range(a["resumed_step"] + 1, len(steps) + 1))[:len(mine)],
                           f"{where}: the steps attempt {a['attempt']} trained")


@contextlib.contextmanager
def _one_rank_group():
    """A gloo group of one in this process (unless one is there) for the students' code; this process's RNG states
    (torch, Python's, numpy's) are put back afterwards, and the group is destroyed if this made it."""
    import numpy as np

    saved_rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if owned:
            dist.destroy_process_group()
        torch.set_rng_state(saved_rng[0])
        random.setstate(saved_rng[1])
        np.random.set_state(saved_rng[2])


def check_reshard(impl, folder, step: int, metrics, recipe: checkpointing.Recipe | None = None) -> dict:
    """The students' ``start`` at world size 1 on the checkpoint of ``step`` in ``folder`` (written by more ranks):
    weights, AdamW's state, step, schedule and sampler equal to what the writing run held (bit for bit), and the
    next step trains the uninterrupted run's next batch (``metrics``: that run's log) at its learning rate.
    Returns what was compared (for the notebook). This process's RNG states are kept."""
    recipe = recipe or checkpointing.Recipe()
    source = checkpointing.checkpoint_dir(folder, step)
    truth = torch.load(checkpoint_run.held_file(folder, step), weights_only=False)
    written_by = {a["world_size"] for a in metrics["attempts"]}
    where = f"resumed at 1 rank from the checkpoint of step {step} written by {sorted(written_by)} FSDP2 ranks"
    with _one_rank_group():
        parts = checkpointing.build(recipe, "cpu", 1, 0, checkpointing.tokens())
        try:
            state = impl.start(parts.model, parts.shard, parts.make_optimizer, parts.make_scheduler, parts.sampler,
                               str(source))
        except Exception as e:  # noqa: BLE001 - the student's load failing is the finding
            checks.check_true(False, f"{where}: start() raised {type(e).__name__}: {str(e)[:400]}",
                              hint="a checkpoint must be readable at another world size: save the model's and the "
                                   "optimizer's state with get_state_dict (DTensor shards, keyed by parameter "
                                   "name) through dcp.save, not per-rank files or per-rank keys")
        now = checkpoint_run.held(state.model, state.optimizer, state.scheduler, state.sampler, state.step)
        checks.check_equal(now["step"], truth["step"], f"{where}: state.step")
        checks.check_equal(sorted(now["weights"]), sorted(truth["weights"]), f"{where}: the parameters")
        for name, w in truth["weights"].items():
            got = now["weights"][name]
            checks.check_true(got.shape == w.shape and torch.equal(got, w),
                              f"{where}: weight {name!r} differs from the 2-rank run's at step {step}"
                              + (f" (max |diff| {(got - w).abs().max().item():.3g})" if got.shape == w.shape else
                                 f" (shape {tuple(got.shape)}, expected {tuple(w.shape)})"),
                              hint="the model's state must be saved so that DCP can reshard it (get_state_dict: "
                                   "DTensor shards with their offsets) and loaded at the new world size")
            for key, v in truth["optimizer"][name].items():
                mine = now["optimizer"][name].get(key)
                ok = mine is not None and (torch.equal(mine, v) if torch.is_tensor(v) else mine == v)
                checks.check_true(ok, f"{where}: AdamW's {key!r} of {name!r} differs from the 2-rank run's",
                                  hint="the optimizer's state (get_state_dict's second value) must come back whole "
                                       "at another world size")
        checks.check_equal(now["last_epoch"], truth["last_epoch"], f"{where}: the scheduler's last_epoch")
        checks.check_equal(now["lr"], truth["lr"], f"{where}: the learning rate")
        checks.check_equal(now["sampler"], truth["sampler"], f"{where}: the sampler's (epoch, position)")
        record = checkpointing.train_step(state.model, state.optimizer, state.scheduler, state.sampler,
                                          parts.token_ids, recipe, "cpu")
    ref = {r["step"]: r for r in metrics["reference"]}[step + 1]
    checks.check_equal(record["batch"], ref["batch"], f"{where}: the global batch of step {step + 1}")
    checks.check_equal(record["lr"], ref["lr"], f"{where}: the learning rate of step {step + 1}")
    return {"step": step, "parameters": len(truth["weights"]), "loss": record["loss"], "uninterrupted": ref["loss"]}


def max_abs_diff(metrics) -> float:
    """The largest |loss - uninterrupted loss| over every step of every attempt."""
    reference = {r["step"]: r["loss"] for r in metrics["reference"]}
    return max(abs(r["loss"] - reference[r["step"]]) for r in metrics["steps"])


def restart_timeline(metrics) -> list[dict]:
    """Per fault (kill or hang), seconds from the fault until the new attempt is back where the fault struck:
    detected (a peer's collective failed, or torchrun saw the exit), new processes (torchrun stops the group and
    starts a new one), start-up (Python, torch, rendezvous, process group), build (data, model), shard + optimizer
    (the students' start() up to its optimizer: FSDP2's fully_shard, AdamW), load (the rest of start(): DCP's load and
    whatever start() does after it), replay (the steps after the last checkpoint, again). ``lost_s`` is their sum.
    A log without ``t_optimizer`` (written before it was recorded) counts the whole of start() as load."""
    out = []
    attempts = {a["attempt"]: a for a in metrics["attempts"]}
    for f in metrics["faults"]:
        new = attempts.get(f["attempt"] + 1)
        if new is None or "t" not in f:
            continue
        t_detected = min(v for v in (f.get("t_detected"), new["t_process"]) if v is not None)
        back = [r["t"] for r in metrics["steps"] if r["attempt"] == new["attempt"] and r["step"] == f["step"]]
        t_back = back[0] if back else new["t_loaded"]
        parts = {"detect": t_detected - f["t"], "new processes": new["t_process"] - t_detected,
                 "start-up": new["t_group"] - new["t_process"], "build": new["t_start"] - new["t_group"],
                 "shard + optimizer": new.get("t_optimizer", new["t_start"]) - new["t_start"],
                 "load": new["t_loaded"] - new.get("t_optimizer", new["t_start"]), "replay": t_back - new["t_loaded"]}
        parts = {k: max(0.0, v) for k, v in parts.items()}
        out.append({"kind": f["kind"], "step": f["step"], "rank": f["rank"], "attempt": f["attempt"],
                    "replayed_steps": f["step"] - new["resumed_step"], "parts": parts,
                    "lost_s": sum(parts.values())})
    return out


def checkpoint_seconds(metrics) -> list[float]:
    """How long each save took (rank 0, the students' save call: DCP's plan, write and metadata), leaving out each
    attempt's first save when the attempt made more than one: a process's first DCP save also imports and plans
    (0.14-0.15 s against 0.06-0.10 s for the later ones in one run), which is not what every checkpoint costs."""
    saves = metrics.get("saves", [])
    by_attempt: dict = {}
    for s in saves:
        by_attempt.setdefault(s.get("attempt"), []).append(s["seconds"])
    return [t for times in by_attempt.values() for t in (times[1:] if len(times) > 1 else times)]


def resharded(before, after) -> dict:
    """A run resumed at another world size against the run that wrote its checkpoint and went on: per step after
    the resume, both losses and their difference."""
    ref = {r["step"]: r["loss"] for r in before["steps"]}
    rows = [(r["step"], r["loss"], ref[r["step"]]) for r in after["steps"] if r["step"] in ref]
    return {"steps": [s for s, _, _ in rows], "loss": [a for _, a, _ in rows], "uninterrupted": [b for _, _, b in rows],
            "max_abs_diff": max(abs(a - b) for _, a, b in rows) if rows else float("nan"),
            "world_sizes": (before["attempts"][0]["world_size"], after["attempts"][0]["world_size"])}

