"""Lab 00's check of the student's torchrun script skeleton: a plain torchrun script (the student's code sets
up the process group itself), run by ``lablib.jobs.launch.run_script``; every rank prints its findings.

    torchrun --standalone --nproc-per-node 3 lablib/runs/collectives_job.py --impl $PWD/job_setup_impl.py \\
        --checkpoint_dir /tmp/ckpt --scenarios ok@2,error@2,ok,error,gpus:1,gpus:3

The module ``--impl`` (written by the notebook) defines ``setup_distributed(timeout_s)``,
``log0(info, message)``, ``checkpoint_round_trip(state, path, info)`` and ``run_job(train, path, timeout_s)``.
Scenarios, in order, in one torchrun start:

- ``ok``: ``run_job`` with a ``train`` that returns rank-dependent tensors; rank 0's must come back on
  every rank, on the rank's device, after exactly one save (rank 0's) and one load per rank.
  Rank 0's ``torch.save`` does not write before every other rank has either reached a barrier or started to
  load (at most ``save_delay_s`` later), as a slow network file system would: a rank that loads without
  waiting for rank 0 then always finds no file, however the ranks happen to be scheduled.
- ``error``: ``train`` raises on every rank; the error must come out of ``run_job`` and the process group
  must be gone afterwards (``destroy_process_group`` in ``finally``).
- ``gpus:K``: ``torch.cuda`` reports K GPUs (simulated: nothing runs on them) and only ``setup_distributed``
  is called: the backend, device and ``init_process_group`` arguments it chose are recorded. An ``nccl``
  group is really made with gloo (this machine may have no NCCL), a CUDA device is never touched.

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
import datetime
import io
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from lablib.jobs import distenv, processes
from lablib.jobs.exercise import load_module

MARKER = "@@job "
REQUIRED = ("setup_distributed", "log0", "checkpoint_round_trip", "run_job")


@dataclass(frozen=True)
class Config:
    impl: str = "job_setup_impl.py"            # the module the notebook's exercise cell writes
    checkpoint_dir: str = "."             # where the ok scenario's checkpoint goes
    scenarios: tuple[str, ...] = ("ok", "error")
    timeout_s: float = 30.0               # passed to setup_distributed / run_job
    save_delay_s: float = 5.0             # the longest rank 0's torch.save waits for the others (see above)

    def validate(self) -> None:
        for s in self.scenarios:
            name, _, size = s.partition("@")
            if (name not in ("ok", "error") and not (name.startswith("gpus:") and name[5:].isdigit())
                    or (size and not (size.isdigit() and int(size) >= 1))):
                raise ValueError(f"scenario {s!r}: choose ok, error or gpus:K (K simulated GPUs), optionally "
                                 f"followed by @w to run it on w ranks")


class Recorder:
    """Pass-through wrappers around the calls the exercise must make, recording how they were made."""

    def __init__(self, rank: int, world_size: int, save_delay_s: float):
        self.rank, self.world_size, self.save_delay_s = rank, world_size, save_delay_s
        self.real = {"init": dist.init_process_group, "destroy": dist.destroy_process_group,
                     "save": torch.save, "load": torch.load, "barrier": dist.barrier,
                     "monitored_barrier": dist.monitored_barrier}
        self.store = None
        self.prefix, self.attempt = "", 0
        self.fake_gpus = None
        self.reset()

    def reset(self, prefix: str = "", world_size: int | None = None) -> None:
        """A new scenario: fresh records, its own rendezvous prefix, its world size."""
        self.prefix, self.attempt = prefix, 0
        self.world_size = world_size or self.world_size
        self.inits, self.destroys, self.saves, self.loads, self.set_devices, self.lablib_calls = [], 0, [], [], [], []

    def init(self, *args, **kwargs):
        names = ("backend", "init_method", "timeout", "world_size", "rank", "store", "group_name", "pg_options",
                 "device_id")
        given = {**dict(zip(names, args)), **kwargs}
        timeout = given.get("timeout")
        device_id = given.get("device_id")
        self.inits.append({"backend": str(given.get("backend")),
                           "timeout_s": timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else None,
                           "timeout_type": type(timeout).__name__,
                           "device_id": None if device_id is None else str(device_id),
                           "other": sorted(k for k in given if k not in ("backend", "timeout", "device_id"))})
        if self.store is None:
            self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), self.world_size,
                                       is_master=False, timeout=datetime.timedelta(seconds=60))
        self.attempt += 1
        backend = str(given.get("backend") or "gloo")
        if self.fake_gpus is not None or backend not in ("gloo", "nccl"):
            backend = "gloo" if self.fake_gpus is not None else backend
        if backend == "nccl" and not torch.cuda.is_available():
            raise RuntimeError("init_process_group(backend='nccl') on a machine without a GPU: NCCL only runs on "
                               "CUDA devices (this is what torch says, in its own words, on a CPU-only build)")
        real_kwargs = {"timeout": timeout} if isinstance(timeout, datetime.timedelta) else {}
        if backend == "nccl" and device_id is not None:
            real_kwargs["device_id"] = device_id
        return self.real["init"](backend, store=dist.PrefixStore(f"lab00/{self.prefix}/{self.attempt}", self.store),
                                 rank=self.rank, world_size=self.world_size, **real_kwargs)

    def destroy(self, *args, **kwargs):
        self.destroys += 1
        return self.real["destroy"](*args, **kwargs)

    def _mark(self, what: str) -> None:
        """Tell rank 0's save that this rank has reached a barrier or a load (a key in torchrun's store)."""
        if self.store is not None:
            self.store.set(f"lab00/{self.prefix}/reached/{self.rank}", what)

    def save(self, obj, f, *args, **kwargs):
        self.saves.append(str(f))
        if self.store is not None and self.rank == 0:
            # write only once every other rank waits in a barrier or has tried to load (or after save_delay_s)
            deadline = time.monotonic() + self.save_delay_s
            others = [f"lab00/{self.prefix}/reached/{r}" for r in range(1, self.world_size)]
            while time.monotonic() < deadline and not all(self.store.check([key]) for key in others):
                time.sleep(0.02)
        return self.real["save"](obj, f, *args, **kwargs)

    def barrier(self, *args, **kwargs):
        self._mark("barrier")
        return self.real["barrier"](*args, **kwargs)

    def monitored_barrier(self, *args, **kwargs):
        self._mark("barrier")
        return self.real["monitored_barrier"](*args, **kwargs)

    def load(self, f, *args, **kwargs):
        location = kwargs.get("map_location", args[0] if args else None)
        self.loads.append({"path": str(f), "map_location": None if location is None else str(location)})
        kwargs.setdefault("weights_only", True)
        try:
            return self.real["load"](f, *args, **kwargs)
        finally:
            self._mark("loaded")                 # only now may rank 0 write (if this rank never waited)

    def refuse_lablib(self, name):
        def refused(*args, **kwargs):
            self.lablib_calls.append(name)
            raise RuntimeError(f"lablib.jobs.distenv.{name} is lablib's own set-up; the exercise is to write it "
                               f"yourself with os.environ, torch.cuda and torch.distributed")
        return refused

    def install(self) -> None:
        dist.init_process_group, dist.destroy_process_group = self.init, self.destroy
        dist.barrier, dist.monitored_barrier = self.barrier, self.monitored_barrier
        torch.save, torch.load = self.save, self.load
        for name in ("from_env", "select_backend_and_device", "distributed"):
            setattr(distenv, name, self.refuse_lablib(name))

    def simulate_gpus(self, count: int | None) -> None:
        """torch.cuda reports ``count`` GPUs (None: the real answer)."""
        self.fake_gpus = count
        if count is None:
            for name, fn in self._cuda_real.items():
                setattr(torch.cuda, name, fn)
            return
        self._cuda_real = {n: getattr(torch.cuda, n) for n in ("is_available", "device_count", "set_device")}
        torch.cuda.is_available = lambda: count > 0
        torch.cuda.device_count = lambda: count
        torch.cuda.set_device = lambda device: self.set_devices.append(str(device))


def describe_info(info) -> dict:
    """The student's info dict as JSON (device as text)."""
    if not isinstance(info, dict):
        return {"not_a_dict": repr(info)[:200]}
    return {k: (str(v) if isinstance(v, torch.device) else v if isinstance(v, (int, str, float)) else repr(v)[:100])
            for k, v in info.items()}


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
    saved_env = {k: os.environ[k] for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    os.environ.update(WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size))     # a job of `size` ranks
    # a name of this run's own: a file left by an earlier run must not stand in for rank 0's save
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")[-8:]
    path = Path(config.checkpoint_dir) / f"checkpoint_{scenario.replace(':', '_').replace('@', '_')}_{run_id}.pt"
    try:
        if name.startswith("gpus:"):
            rec.simulate_gpus(int(scenario[5:]))
            try:
                out["info"] = describe_info(impl.setup_distributed(config.timeout_s))
            finally:
                rec.simulate_gpus(None)
        elif name == "ok":
            loaded = impl.run_job(train_ok, str(path), config.timeout_s)
            out["loaded"] = {k: {"values": v.tolist(), "device": str(v.device)} if isinstance(v, torch.Tensor)
                             else repr(v)[:100] for k, v in loaded.items()} if isinstance(loaded, dict) else repr(loaded)[:200]
        else:
            impl.run_job(train_error, str(path), config.timeout_s)
    except BaseException as exc:  # noqa: BLE001 - the student's error is a finding, reported to the notebook
        out["error"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
        out["traceback"] = traceback.format_exc()[-1500:]
    os.environ.update(saved_env)
    out.update(inits=rec.inits, destroys=rec.destroys, saves=rec.saves, loads=rec.loads,
               set_devices=rec.set_devices, lablib_calls=rec.lablib_calls,
               initialized_after=dist.is_initialized())
    if dist.is_initialized():                     # leave a clean slate for the next scenario
        rec.real["destroy"]()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", default=Config.impl)
    parser.add_argument("--checkpoint_dir", default=Config.checkpoint_dir)
    parser.add_argument("--scenarios", default=",".join(Config.scenarios))
    parser.add_argument("--timeout_s", type=float, default=Config.timeout_s)
    parser.add_argument("--save_delay_s", type=float, default=Config.save_delay_s)
    args = parser.parse_args(argv)
    config = Config(args.impl, args.checkpoint_dir, tuple(s for s in args.scenarios.split(",") if s),
                    args.timeout_s, args.save_delay_s)
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
