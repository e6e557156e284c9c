"""The process environment of one rank, built once from torchrun's variables and passed down.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE for every worker. A plain Python
process (a notebook, a test) has none of them and is simply world size 1: the same code path.

Backend and device are chosen here and nowhere else:
- one GPU (or more) per local rank  -> nccl, rank r uses cuda:r            (a real multi-GPU box)
- fewer GPUs than local ranks       -> gloo, all ranks share cuda:0      (simulating on one GPU;
                                       NCCL refuses two ranks on one device)
- no GPU                            -> gloo on the CPU                    (a laptop, CI)
``LABLIB_DEVICE=cpu`` forces the CPU path on a GPU machine.

gloo serves CUDA tensors only in part. When ranks share one GPU over gloo, ``distributed`` tries the
collectives the labs use on tiny GPU tensors once, right after init; if gloo cannot run one of them there,
the step runs on the CPU instead and rank 0 says why (``DistEnv.fallback``, also in the result JSON).

``gather_objects`` brings every rank's object to each rank: the course's one way to put per-rank figures together.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from dataclasses import dataclass, replace
from typing import Iterator

import torch
import torch.distributed as dist

from lablib.jobs import processes
from lablib.jobs.processes import restart_attempt  # noqa: F401 - part of this module's interface


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str
    fallback: str = ""      # why this step runs on the CPU although a GPU was chosen, if it does

    @property
    def is_main(self) -> bool:
        """Rank 0 is the only rank that prints and writes files."""
        return self.rank == 0

    def describe(self) -> dict:
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "device": str(self.device),
            "backend": self.backend,
            "torch": torch.__version__,
            "cuda_devices": torch.cuda.device_count(),
            "threads_per_rank": torch.get_num_threads(),
            "fallback": self.fallback,
        }


def select_backend_and_device(local_rank: int, local_world_size: int) -> tuple[str, torch.device]:
    """nccl with one GPU per rank; gloo otherwise (sharing GPU 0, or on the CPU)."""
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if os.environ.get("LABLIB_DEVICE", "").lower() == "cpu" or n_gpus == 0:
        return "gloo", torch.device("cpu")
    if n_gpus >= local_world_size:
        return "nccl", torch.device("cuda", local_rank)
    return "gloo", torch.device("cuda", 0)


def _int_env(name: str, default: int) -> int:
    return processes.number_from_env(name, default, int, "; it is set by torchrun, do not set it by hand")


def from_env() -> DistEnv:
    """The DistEnv of this process, from torchrun's variables (world size 1 when there are none)."""
    rank = _int_env("RANK", 0)
    world_size = _int_env("WORLD_SIZE", 1)
    local_rank = _int_env("LOCAL_RANK", 0)
    local_world_size = _int_env("LOCAL_WORLD_SIZE", world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world_size}; start the script with torchrun")
    backend, device = select_backend_and_device(local_rank, local_world_size)
    return DistEnv(rank, local_rank, world_size, local_world_size, device, backend)


# The collectives the course's steps call (FSDP2 all-gathers and reduce-scatters; DDP all-reduces and
# broadcasts), tried on the GPU when ranks share it over gloo.
GLOO_CUDA_PROBES = ("all_reduce", "broadcast", "all_gather_single", "reduce_scatter_single")


def gloo_gaps(device: torch.device, world_size: int) -> list[str]:
    """The collectives of GLOO_CUDA_PROBES that the initialised group cannot run on tensors of ``device``,
    each with the first line of its error. Every rank tries the same ones in the same order: whether gloo
    supports a collective on a device is the same on every rank, so they stay in step."""
    gaps = []
    for name in GLOO_CUDA_PROBES:
        x = torch.ones(world_size, device=device)
        try:
            if name == "all_reduce":
                dist.all_reduce(x)
            elif name == "broadcast":
                dist.broadcast(x, src=0)
            elif name == "all_gather_single":        # torch 2.13's name of all_gather_into_tensor
                dist.all_gather_single(torch.empty(world_size * world_size, device=device), x)
            else:                                     # reduce_scatter_single: reduce_scatter_tensor's
                dist.reduce_scatter_single(torch.empty(1, device=device), x)
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            gaps.append(f"{name} ({str(exc).strip().splitlines()[0][:100]})")
    return gaps


def attempt_store(timeout: datetime.timedelta) -> dist.Store:
    """torchrun's rendezvous store, with a key namespace of its own for this attempt of the worker group.

    ``torchrun --max-restarts N`` starts a new worker group after a failure, against the same store. The
    new ranks would find the keys the dead ranks wrote (gloo's addresses among them) and try to connect to
    processes that no longer exist ("Gloo connectFullMesh failed ... Connection refused"). Prefixing every
    key with the attempt number (``TORCHELASTIC_RESTART_COUNT``, 0 on the first start) keeps each attempt's
    keys apart; the first attempt is unchanged in every other way.
    """
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    return dist.PrefixStore(f"attempt{restart_attempt()}", store)


@contextlib.contextmanager
def distributed(timeout_s: float | None = None) -> Iterator[DistEnv]:
    """Initialise the process group (with a timeout), yield the DistEnv, always destroy the group.

    Under torchrun the group is initialised even for world size 1, so that a single process runs the
    same code (collectives on one rank are cheap no-ops). A plain process without torchrun's variables
    gets world size 1 and no group. ``timeout_s`` bounds init and every collective, so a crashed or
    diverged rank ends in an error instead of a hang; by default it is the one the launcher derived from
    the run's own timeout (``lablib.jobs.processes.rank_timeout_s``).
    """
    timeout_s = processes.rank_timeout_from_env() if timeout_s is None else timeout_s
    env = from_env()
    under_torchrun = "MASTER_ADDR" in os.environ and "RANK" in os.environ
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    if under_torchrun and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        kwargs = {"backend": env.backend, "timeout": timeout, "store": attempt_store(timeout),
                  "rank": env.rank, "world_size": env.world_size}
        if env.backend == "nccl":
            kwargs["device_id"] = env.device
        dist.init_process_group(**kwargs)
    if dist.is_initialized() and env.backend == "gloo" and env.device.type == "cuda":
        gaps = gloo_gaps(env.device, env.world_size)
        if gaps:
            env = replace(env, device=torch.device("cpu"),
                          fallback=f"{env.world_size} ranks share {env.device} over gloo, which cannot run "
                                   f"{'; '.join(gaps)} on GPU tensors: this step runs on the CPU")
            if env.is_main:
                print(f"[lablib] {env.fallback}", flush=True)
    try:
        yield env
        if dist.is_initialized():
            # Every rank finishes its last collective before any rank tears the group down (a rank that
            # left early would break a peer's last send).
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # Objects that still hold the group (a DDP reducer, an FSDP2 mesh) sit in reference cycles: collect
        # them now, so the group's worker threads are joined while the interpreter is alive (see
        # lablib.jobs.processes.end_rank for what happens when they are not).
        gc.collect()


def gather_objects(obj, env, group=None) -> list:
    """[rank 0's obj, rank 1's obj, ...] of ``group`` (default: every rank) on each of its ranks; a
    one-element list without a process group. The course's one way to bring per-rank figures together."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * (env.world_size if group is None else dist.get_world_size(group))
    dist.all_gather_object(out, obj, group=group)
    return out
