"""Lab 00's check of the student's torchrun script skeleton: a plain torchrun script (the student's code sets
up the process group itself), run by ``lablib.jobs.launch.run_script``; every rank prints its findings.

    torchrun --standalone --nproc-per-node 3 lablib/runs/collectives_job.py --impl $PWD/job_setup_impl.py \\
        --checkpoint_dir /tmp/ckpt --scenarios ok@2,error@2,ok,error,gpus:1,gpus:3,node2:3
    torchrun --standalone --nproc-per-node 2 lablib/runs/collectives_job.py --counted $PWD/fixed_train_impl.py

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
CALLS_MARKER = "@@calls "
REQUIRED = ("setup_distributed", "log0", "checkpoint_round_trip", "run_job")


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
                           "device_id": None if device_id is None else device_text(device_id),
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

    def _key(self, what: str) -> str:
        return f"lab00/{self.prefix}/{what}"

    def _mark(self, what: str) -> None:
        """Tell rank 0's save where this rank is: "in_barrier", "left_barrier" or "loading" (torchrun's store)."""
        if self.store is not None:
            self.store.set(self._key(f"reached/{self.rank}"), what)

    def save(self, obj, f, *args, **kwargs):
        self.saves.append(str(f))
        if self.store is not None and self.rank == 0:
            # write only once every other rank waits inside a barrier or has tried to load (or after save_delay_s)
            deadline = time.monotonic() + self.save_delay_s
            others = [self._key(f"reached/{r}") for r in range(1, self.world_size)]
            while time.monotonic() < deadline and not all(
                    self.store.check([key]) and self.store.get(key) in (b"in_barrier", b"loading") for key in others):
                time.sleep(0.02)
        try:
            return self.real["save"](obj, f, *args, **kwargs)
        finally:
            if self.store is not None:
                self.store.set(self._key("saved"), "1")

    def _barrier(self, real, *args, **kwargs):
        self._mark("in_barrier")
        try:
            return real(*args, **kwargs)
        finally:
            self._mark("left_barrier")

    def barrier(self, *args, **kwargs):
        return self._barrier(self.real["barrier"], *args, **kwargs)

    def monitored_barrier(self, *args, **kwargs):
        return self._barrier(self.real["monitored_barrier"], *args, **kwargs)

    def load(self, f, *args, **kwargs):
        location = kwargs.get("map_location", args[0] if args else None)
        early = self.store is not None and self.rank != 0 and not self.store.check([self._key("saved")])
        self.loads.append({"path": str(f), "map_location": None if location is None else device_text(location),
                           "before_save": early})
        self._mark("loading")                    # only now may rank 0 write (if this rank never waited)
        if early:
            raise FileNotFoundError(f"{f}: rank {self.rank} called torch.load before rank 0's torch.save had returned "
                                    "(the check's file system is slow, as a network file system is: the file is "
                                    "not there yet)")
        kwargs.setdefault("weights_only", True)
        return self.real["load"](f, *args, **kwargs)

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
        torch.cuda.set_device = lambda device: self.set_devices.append(device_text(device))

    def simulate_node(self, rank: int, world_size: int):
        """dist.get_rank() / get_world_size() report the simulated job's numbers (None: the real ones)."""
        if rank is None:
            dist.get_rank, dist.get_world_size = self._dist_real
            return
        self._dist_real = dist.get_rank, dist.get_world_size
        dist.get_rank = lambda group=None: rank if group is None else self._dist_real[0](group)
        dist.get_world_size = lambda group=None: world_size if group is None else self._dist_real[1](group)


def device_text(device) -> str:
    """A device as torch names it: an int k is accelerator k (torch.distributed and torch.cuda read it so)."""
    if isinstance(device, int) and not isinstance(device, bool):
        return f"cuda:{device}"
    return str(device)


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
    saved_env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    os.environ.update(WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size))     # a job of `size` ranks
    node2 = name.startswith("node2:")
    if node2:                                     # the second node of two: RANK != LOCAL_RANK
        os.environ.update(RANK=str(size + rec.rank), LOCAL_RANK=str(rec.rank), WORLD_SIZE=str(2 * size))
        rec.simulate_node(size + rec.rank, 2 * size)
    # a name of this run's own: a file left by an earlier run must not stand in for rank 0's save
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")[-8:]
    path = Path(config.checkpoint_dir) / f"checkpoint_{scenario.replace(':', '_').replace('@', '_')}_{run_id}.pt"
    try:
        if name.startswith(("gpus:", "node2:")):
            rec.simulate_gpus(int(name.partition(":")[2]))
            try:
                out["info"] = describe_info(impl.setup_distributed(config.setup_timeout_s))
            finally:
                rec.simulate_gpus(None)
        elif name == "ok":
            loaded = impl.run_job(train_ok, str(path), config.timeout_s)
            out["loaded"] = {k: {"values": v.tolist(), "device": str(v.device), "dtype": str(v.dtype)}
                             if isinstance(v, torch.Tensor)
                             else repr(v)[:100] for k, v in loaded.items()} if isinstance(loaded, dict) else repr(loaded)[:200]
        else:
            impl.run_job(train_error, str(path), config.timeout_s)
    except BaseException as exc:  # noqa: BLE001 - the student's error is a finding, reported to the notebook
        out["error"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
        out["traceback"] = traceback.format_exc()[-1500:]
    finally:
        if node2:
            rec.simulate_node(None, None)
    os.environ.update(saved_env)
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
