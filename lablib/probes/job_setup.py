"""Lab 00's exercise 2 watched on the ranks: pass-through wrappers around the calls a torchrun script's setup makes
(``init_process_group``, ``set_device``, ``torch.save`` / ``torch.load``, ``barrier``), recording how they were made, with
a simulated ``torch.cuda`` and a slow file system (``lablib.runs.collectives_job`` runs the scenarios)."""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from lablib.jobs import distenv


def device_text(device) -> str:
    """A device as torch names it: an int k is accelerator k (torch.distributed and torch.cuda read it so)."""
    if isinstance(device, int) and not isinstance(device, bool):
        return f"cuda:{device}"
    return str(device)


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
        self.real["init"](backend, store=dist.PrefixStore(f"lab00/{self.prefix}/{self.attempt}", self.store),
                          rank=self.rank, world_size=self.world_size, **real_kwargs)
        # Every rank's connections are made before any rank goes on. torch 2.13 has no barrier after init unless
        # TORCH_DIST_INIT_BARRIER=1 (distributed_c10d.py:1412-1417, 1940), so a rank whose train raised at once tore
        # its group down while a peer was still connecting: "Gloo connectFullMesh failed ... Connection closed by
        # peer" there (seen on a busy machine: a correct answer lost its points).
        self.real["barrier"]()

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
