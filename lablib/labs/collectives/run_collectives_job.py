"""Lab 00's check of the student's torchrun script skeleton: a plain torchrun script (the student's code sets
up the process group itself), run by ``lablib.jobs.launch.run_script``; every rank prints its findings.

    torchrun --standalone --nproc-per-node 3 lablib/labs/collectives/run_collectives_job.py --impl $PWD/job_setup_impl.py \\
        --checkpoint_dir /tmp/ckpt --scenarios ok@2,error@2,ok,error,gpus:1,gpus:3,node2:3
    torchrun --standalone --nproc-per-node 2 lablib/labs/collectives/run_collectives_job.py --counted $PWD/fixed_train_impl.py

The module ``--impl`` (written by the notebook) defines ``setup_distributed(timeout_s)``,
``log0(info, message)``, ``checkpoint_round_trip(state, path, info)`` and ``run_job(train, path, timeout_s)``.
Scenarios, in order, in one torchrun start:

- ``ok``: ``run_job`` with a ``train`` that returns rank-dependent tensors; rank 0's must come back on
  every rank, on the rank's device, after exactly one save (rank 0's) and one load per rank.
  The file system is made slow, as a network file system is, so that a missing or misplaced barrier fails
  every time, however the ranks happen to be scheduled: rank 0's ``torch.save`` does not write before every
  other rank either waits inside a barrier or has tried to load (at most ``save_delay_s`` later), and a
  ``torch.load`` on another rank before rank 0's save has returned finds no file (FileNotFoundError). A
  barrier *before* the save does not help: the other ranks have left it when rank 0 saves.
- ``error``: ``train`` raises on every rank; the error must come out of ``run_job`` and the process group
  must be gone afterwards (``destroy_process_group`` in ``finally``).
- ``gpus:K``: ``torch.cuda`` reports K GPUs (simulated: nothing runs on them) and only ``setup_distributed``
  is called (with ``setup_timeout_s``, not the default): the backend, device, ``torch.cuda.set_device`` calls
  and ``init_process_group`` arguments it chose are recorded. An ``nccl`` group is really made with gloo (this
  machine may have no NCCL), a CUDA device is never touched.
- ``node2:K``: the same, with the ranks playing the second node of a job of two nodes of w ranks each:
  ``RANK`` = w + r, ``LOCAL_RANK`` = r, ``WORLD_SIZE`` = 2 w, ``LOCAL_WORLD_SIZE`` = w (and
  ``dist.get_rank()`` / ``get_world_size()`` say so), so that ``cuda:RANK`` and ``WORLD_SIZE`` show.

``--counted SCRIPT`` instead runs SCRIPT as ``__main__`` (lab 00's exercise 3) inside
``lablib.measure.counting.count_collectives`` and prints ``@@calls <json>``: every collective this rank called,
in order, as [name, bytes], also when the script raised.

A scenario written ``name@w`` runs on ranks 0..w-1 only, as a job of w ranks (``WORLD_SIZE`` and
``LOCAL_WORLD_SIZE`` read w while it runs; the other ranks sit it out), so several world sizes cost one
torchrun start.

Every ``init_process_group`` call goes through a recorder that keeps its arguments and joins a fresh
rendezvous prefix, so one process can set up and tear down a group several times. The student's code may
not use ``lablib.jobs.distenv`` (whose backend choice is the exercise): the recorder refuses it.
Each rank prints one line ``@@job <json>`` per scenario; the notebook reads every rank's output.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from lablib.jobs import processes
from lablib.jobs.exercise import load_module
from lablib.labs.collectives.job_setup import REQUIRED, Recorder, job_environment, simulated_setup

MARKER = "@@job "
CALLS_MARKER = "@@calls "


@dataclass(frozen=True)
class Config:
    impl: str = "job_setup_impl.py"            # the module the notebook's exercise cell writes
    checkpoint_dir: str = "."             # where the ok scenario's checkpoint goes
    scenarios: tuple[str, ...] = ("ok", "error")
    timeout_s: float = 30.0               # passed to run_job
    setup_timeout_s: float = 12.5         # passed to setup_distributed in the gpus and node2 scenarios
    save_delay_s: float = 5.0             # the longest rank 0's torch.save waits for the others (see above)

    def validate(self) -> None:
        for s in self.scenarios:
            name, _, size = s.partition("@")
            kind, _, gpus = name.partition(":")
            if (name not in ("ok", "error") and not (kind in ("gpus", "node2") and gpus.isdigit())
                    or (size and not (size.isdigit() and int(size) >= 1))):
                raise ValueError(f"scenario {s!r}: choose ok, error, gpus:K or node2:K (K simulated GPUs), "
                                 f"optionally followed by @w to run it on w ranks")


def train_ok(info) -> dict:
    rank = info["rank"] if isinstance(info, dict) else dist.get_rank()
    return {"weights": torch.full((3,), float(rank) + 0.5), "step": torch.tensor(7 + rank)}


def train_error(info) -> dict:
    raise RuntimeError("injected failure inside train (the error scenario)")


def run_scenario(scenario: str, impl, config: Config, rec: Recorder, world_size: int) -> dict:
    """One scenario on this rank; what the student's code printed meanwhile is recorded, not shown."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        out = _run_scenario(scenario, impl, config, rec, world_size)
    out["printed"] = printed.getvalue().splitlines()[:10]
    return out


def _run_scenario(scenario: str, impl, config: Config, rec: Recorder, world_size: int) -> dict:
    name, _, size = scenario.partition("@")
    size = int(size) if size else world_size
    out = {"scenario": scenario, "rank": rec.rank, "world_size": size}
    if rec.rank >= size:
        return {**out, "sat_out": True}
    rec.reset(scenario, size)
    if name.startswith(("gpus:", "node2:")):
        out.update(simulated_setup(impl, rec, name, rec.rank, size, config.setup_timeout_s))
    else:
        # a name of this run's own: a file left by an earlier run must not stand in for rank 0's save
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")[-8:]
        path = Path(config.checkpoint_dir) / f"checkpoint_{scenario.replace(':', '_').replace('@', '_')}_{run_id}.pt"
        with job_environment(RANK=rec.rank, LOCAL_RANK=rec.rank, WORLD_SIZE=size, LOCAL_WORLD_SIZE=size):
            try:
                if name == "ok":
                    loaded = impl.run_job(train_ok, str(path), config.timeout_s)
                    out["loaded"] = {k: {"values": v.tolist(), "device": str(v.device), "dtype": str(v.dtype)}
                                     if isinstance(v, torch.Tensor)
                                     else repr(v)[:100] for k, v in loaded.items()} if isinstance(loaded, dict) else repr(loaded)[:200]
                else:
                    impl.run_job(train_error, str(path), config.timeout_s)
            except BaseException as exc:  # noqa: BLE001 - the student's error is a finding, reported to the notebook
                out["error"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
                out["traceback"] = traceback.format_exc()[-1500:]
    out.update(inits=rec.inits, destroys=rec.destroys, saves=rec.saves, loads=rec.loads,
               set_devices=rec.set_devices, lablib_calls=rec.lablib_calls,
               initialized_after=dist.is_initialized())
    if dist.is_initialized():                     # leave a clean slate for the next scenario
        rec.real["destroy"]()
    return out


def run_counted(path: str) -> None:
    """Run the script at ``path`` as ``__main__``, counting every collective it calls; print them at the end."""
    import runpy

    from lablib.measure import counting

    with counting.count_collectives() as log:
        try:
            runpy.run_path(str(Path(path).resolve()), run_name="__main__")
        finally:
            print(CALLS_MARKER + json.dumps([[c.name, c.bytes] for c in log.calls]), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counted", default="", help="run this script, counting its collectives (exercise 3)")
    parser.add_argument("--impl", default=Config.impl)
    parser.add_argument("--checkpoint_dir", default=Config.checkpoint_dir)
    parser.add_argument("--scenarios", default=",".join(Config.scenarios))
    parser.add_argument("--timeout_s", type=float, default=Config.timeout_s)
    parser.add_argument("--setup_timeout_s", type=float, default=Config.setup_timeout_s)
    parser.add_argument("--save_delay_s", type=float, default=Config.save_delay_s)
    args = parser.parse_args(argv)
    if args.counted:
        return run_counted(args.counted)
    config = Config(args.impl, args.checkpoint_dir, tuple(s for s in args.scenarios.split(",") if s),
                    args.timeout_s, args.setup_timeout_s, args.save_delay_s)
    config.validate()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rec = Recorder(rank, world_size, config.save_delay_s)
    rec.install()
    try:
        impl = load_module(config.impl, required=REQUIRED)
    except Exception as exc:  # noqa: BLE001 - reported, then the rank ends
        print(MARKER + json.dumps({"scenario": "load", "rank": rank, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        processes.end_rank(1)
    for scenario in config.scenarios:
        result = run_scenario(scenario, impl, config, rec, world_size)
        print(MARKER + json.dumps(result), flush=True)
    processes.end_rank(0)


if __name__ == "__main__":
    main(sys.argv[1:])
