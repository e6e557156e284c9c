"""Lab 00's torchrun scripts watched. Exercise 2: pass-through wrappers around the calls a script's setup makes
(``init_process_group``, ``set_device``, ``torch.save`` / ``torch.load``, ``barrier``) record how they were made, with a
simulated ``torch.cuda`` and a slow file system (``run_collectives_job`` runs the scenarios); ``simulated_setup``
(simulated GPUs, a second node) runs on the torchrun ranks and, first, in the notebook's process (``rehearse_setups``,
one local rank at a time in a group of one). Exercise 3: ``rehearse_script`` runs the script on thread ranks."""

from __future__ import annotations

import contextlib
import datetime
import os
import time
import traceback

import torch
import torch.distributed as dist

from lablib.jobs import distenv
from lablib.jobs.exercise import load_module

REQUIRED = ("setup_distributed", "log0", "checkpoint_round_trip", "run_job")
JOB_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


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
        self.barriers_entered = 0

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
        """Tell rank 0's save that this rank has tried to load ("loading"; torchrun's store)."""
        if self.store is not None:
            self.store.set(self._key(f"reached/{self.rank}"), what)

    def _waits_for_rank0(self, rank: int) -> bool:
        """Rank ``rank`` can go no further without rank 0: it has tried to load, or it waits in a barrier that rank 0
        has not entered yet (it entered more barriers than rank 0 has). Counting barriers, not reading an "in the
        barrier" flag, keeps this exact however the ranks are scheduled: a flag set before a barrier that rank 0 has
        already passed can still read "in the barrier" for a moment after that barrier returned on rank ``rank``
        (a barrier before the save then kept full marks on a busy machine)."""
        reached, entered = self._key(f"reached/{rank}"), self._key(f"entered/{rank}")
        if self.store.check([reached]) and self.store.get(reached) == b"loading":
            return True
        return self.store.check([entered]) and int(self.store.get(entered)) > self.barriers_entered

    def save(self, obj, f, *args, **kwargs):
        self.saves.append(str(f))
        if self.store is not None and self.rank == 0:
            # write only once every other rank waits for rank 0 in a barrier or has tried to load (or after
            # save_delay_s)
            deadline = time.monotonic() + self.save_delay_s
            while time.monotonic() < deadline and not all(self._waits_for_rank0(r) for r in range(1, self.world_size)):
                time.sleep(0.02)
        try:
            return self.real["save"](obj, f, *args, **kwargs)
        finally:
            if self.store is not None:
                self.store.set(self._key("saved"), "1")

    def _barrier(self, real, *args, **kwargs):
        self.barriers_entered += 1
        if self.store is not None:
            self.store.set(self._key(f"entered/{self.rank}"), str(self.barriers_entered))
        return real(*args, **kwargs)

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
        self._distenv_real = {name: getattr(distenv, name) for name in ("from_env", "select_backend_and_device", "distributed")}
        dist.init_process_group, dist.destroy_process_group = self.init, self.destroy
        dist.barrier, dist.monitored_barrier = self.barrier, self.monitored_barrier
        torch.save, torch.load = self.save, self.load
        for name in self._distenv_real:
            setattr(distenv, name, self.refuse_lablib(name))

    def uninstall(self) -> None:
        """Put back what ``install`` replaced (a rehearsal in the notebook's own process ends so)."""
        dist.init_process_group, dist.destroy_process_group = self.real["init"], self.real["destroy"]
        dist.barrier, dist.monitored_barrier = self.real["barrier"], self.real["monitored_barrier"]
        torch.save, torch.load = self.real["save"], self.real["load"]
        for name, fn in self._distenv_real.items():
            setattr(distenv, name, fn)

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
        self._dist_real = get_rank, get_world_size = dist.get_rank, dist.get_world_size
        # the real call first: before init_process_group it raises, as it would in a real job
        dist.get_rank = lambda group=None: (get_rank(), rank)[1] if group is None else get_rank(group)
        dist.get_world_size = lambda group=None: (get_world_size(), world_size)[1] if group is None else get_world_size(group)


def describe_info(info) -> dict:
    """The student's info dict as JSON (device as text)."""
    if not isinstance(info, dict):
        return {"not_a_dict": repr(info)[:200]}
    return {k: (str(v) if isinstance(v, torch.device) else v if isinstance(v, (int, str, float)) else repr(v)[:100])
            for k, v in info.items()}


@contextlib.contextmanager
def job_environment(**values):
    """RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE set to ``values`` while the block runs, then put back."""
    saved = {name: os.environ.get(name) for name in JOB_ENV}
    os.environ.update({name: str(value) for name, value in values.items()})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def simulated_setup(impl, rec: Recorder, scenario: str, local_rank: int, local_world_size: int, timeout_s: float) -> dict:
    """``impl.setup_distributed(timeout_s)`` on local rank ``local_rank`` of ``local_world_size``, ``torch.cuda``
    reporting K GPUs: ``gpus:K`` on a job of one node, ``node2:K`` on the second node of two (RANK = w + r,
    WORLD_SIZE = 2 w, and ``dist.get_rank()`` / ``get_world_size()`` say so). What it returned (or raised), the
    ``init_process_group`` and ``set_device`` calls; the group it made is destroyed afterwards."""
    kind, _, gpus = scenario.partition(":")
    node = 1 if kind == "node2" else 0
    rank, world_size = node * local_world_size + local_rank, (node + 1) * local_world_size
    out = {}
    with job_environment(RANK=rank, LOCAL_RANK=local_rank, WORLD_SIZE=world_size, LOCAL_WORLD_SIZE=local_world_size):
        rec.simulate_node(rank, world_size)
        rec.simulate_gpus(int(gpus))
        try:
            out["info"] = describe_info(impl.setup_distributed(timeout_s))
        except BaseException as exc:  # noqa: BLE001 - the student's error is a finding
            out.update(error=f"{type(exc).__name__}: {str(exc).strip()[:300]}", traceback=traceback.format_exc()[-1500:])
        finally:
            rec.simulate_gpus(None)
            rec.simulate_node(None, None)
    if dist.is_initialized():
        rec.real["destroy"]()
    return {**out, "inits": rec.inits, "set_devices": rec.set_devices}


def rehearse_setups(path: str, scenarios, local_world_size: int, timeout_s: float) -> dict:
    """The ``gpus:K`` and ``node2:K`` scenarios of exercise 2 in this process: {scenario: {local rank: record}}, the
    records ``simulated_setup`` makes on the torchrun ranks. Each simulated rank joins a gloo group of one (its
    own store), so the rehearsal takes milliseconds; everything it replaced is put back afterwards."""
    if dist.is_initialized():
        raise RuntimeError("rehearse_setups needs this process without a process group (destroy it first)")
    rec = Recorder(0, 1, save_delay_s=0.0)
    rec.store = dist.HashStore()
    rec.install()
    found = {}
    try:
        impl = load_module(path, required=REQUIRED)
        for scenario in scenarios:
            for local_rank in range(local_world_size):
                rec.reset(f"rehearsal/{scenario}/{local_rank}", 1)
                found.setdefault(scenario, {})[local_rank] = simulated_setup(impl, rec, scenario, local_rank,
                                                                             local_world_size, timeout_s)
    finally:
        rec.uninstall()
        if dist.is_initialized():
            dist.destroy_process_group()
    return found


def rehearse_script(path: str, world_size: int) -> dict | None:
    """A whole torchrun script (lab 00's exercise 3) as ``__main__`` on ``world_size`` thread ranks of this process
    (``lablib.probes.rehearsal``; init and destroy do nothing): {"rank_output": {rank: its prints, then the "@@calls"
    line of ``run_collectives_job --counted``}, "deadlock": None or what hung}. One rank runs at a time between
    collectives (the global random generator is drawn as on separate processes); before each collective the ranks
    compare what they call, so another collective, another root or an ended script is the hang, named at once.
    None where threads cannot stand in for processes (a call not rehearsed, the script raised): the real run judges."""
    import io
    import json
    import runpy
    import sys
    import threading

    from lablib.probes import rehearsal

    baton, local, world_of = threading.Lock(), threading.local(), {}
    printed, calls = {r: io.StringIO() for r in range(world_size)}, {r: [] for r in range(world_size)}

    def agreed(name, src=None):
        seen = world_of["world"].exchange(name, (name, src))
        if len(set(seen)) > 1:
            said = ", ".join(f"rank {r}: " + ("its script ended" if n == "end" else f"{n}" + (f"(src={s})" if s is not None else ""))
                             for r, (n, s) in enumerate(seen))
            raise rehearsal.RehearsalDeadlock(f"the ranks' next collectives differ ({said}): on real ranks a hang until "
                                              f"the collective timeout")

    def more_fakes(world, _):
        world_of["world"], base = world, rehearsal._fake_functions(world)

        def turn(name):
            def call(*args, **kwargs):
                tensor = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("tensor")
                src = kwargs.get("src", args[1] if len(args) > 1 else 0) if name == "broadcast" else None
                baton.release()                               # the other ranks run while this one waits
                try:
                    agreed(name, src)
                    calls[local.rank].append([name, 0 if tensor is None else tensor.numel() * tensor.element_size()])
                    return base[name](*args, **kwargs)
                finally:
                    baton.acquire()
            return call

        fakes = {name: turn(name) for name in ("broadcast", "all_reduce", "barrier")}
        for name in set(base) - set(fakes) - {"get_rank", "get_world_size", "is_initialized"}:
            fakes[name] = base["new_group"]                   # not rehearsed here: RehearsalUnsupported
        return {**fakes, "init_process_group": lambda *a, **k: None, "destroy_process_group": lambda *a, **k: None}

    def run(rank):
        local.rank = rank
        baton.acquire()
        try:
            runpy.run_path(path, run_name="__main__")
        finally:
            baton.release()
        agreed("end")

    class Routed(io.TextIOBase):
        def write(self, text):
            printed[getattr(local, "rank", 0)].write(text)
            return len(text)

    saved_out, deadlock = sys.stdout, None
    try:
        with job_environment(WORLD_SIZE=world_size, LOCAL_WORLD_SIZE=world_size):
            os.environ.pop("RANK", None), os.environ.pop("LOCAL_RANK", None)   # no rank to read there (put back after)
            sys.stdout = Routed()
            try:
                rehearsal.run_in_thread_ranks(world_size, run, more_fakes=more_fakes)
            finally:
                sys.stdout = saved_out
    except rehearsal.RehearsalDeadlock as exc:
        deadlock = str(exc)
    except (Exception, SystemExit):  # noqa: BLE001 - not rehearsed (or the script raised): the real run shows it
        return None
    return {"deadlock": deadlock,
            "rank_output": {r: printed[r].getvalue() + f"@@calls {json.dumps(calls[r])}\n" for r in range(world_size)}}
