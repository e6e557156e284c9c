"""How long a step takes across ranks: the course's one definition, and the tools that measure it.

A distributed step is over when its slowest rank is over. So every multi-rank measurement in the course:

1. times each step on every rank with ``stopwatch`` (which waits for the GPU first, when there is one),
   starting after a ``barrier`` when the ranks' steps are to be compared;
2. takes, step by step, the maximum over the ranks (``slowest_rank``: one all-reduce of the whole list):
   that is how long the job took for that step;
3. reports the median of those per-step maxima (``median``), under the JSON key ``median_step_s``, with
   the per-step list under ``step_s``. The median keeps the odd step slowed by another process on a shared
   machine from moving the figure.

``step_times`` does 2 and 3. The order matters: the maximum of each rank's median can be smaller than any
step really took when the ranks are slow at different steps (rank 0 slow at odd steps, rank 1 at even
ones), because every step waits for whichever rank is slow in it.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Iterator, Sequence

import torch
import torch.distributed as dist


@contextlib.contextmanager
def stopwatch(times: list[float], device: torch.device) -> Iterator[None]:
    """Append the wall-clock seconds of the block to times (waiting for the GPU first, when there is one)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times.append(time.perf_counter() - t0)


def barrier(device: torch.device, group=None) -> None:
    """All ranks of group meet here (no-op without a process group)."""
    if dist.is_initialized():
        # NCCL needs to know the rank's GPU for its barrier; gloo's barrier is a CPU operation.
        nccl = dist.get_backend(group) == "nccl"
        dist.barrier(group=group, device_ids=[device.index] if nccl and device.type == "cuda" else None)


def slowest_rank(values: Sequence[float], device: torch.device, group=None) -> list[float]:
    """Element-wise maximum over the ranks of a per-step list (one all-reduce for the whole list). Every rank
    of group must call it with a list of the same length."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def median(values: Sequence[float]) -> float:
    """Median: robust to the odd step slowed by another process on a shared machine."""
    if len(values) == 0:
        raise ValueError("no timed steps: time at least one step after the warm-up")
    return float(statistics.median(values))


def step_times(per_step_s: Sequence[float], device: torch.device, group=None, warmup: int = 0) -> dict:
    """This rank's per-step seconds -> ``{"median_step_s", "step_s"}`` of the job (see the module docstring).

    The first ``warmup`` steps are left out (DDP builds its buckets in the first step, caches warm up).
    Every rank of group must call it, with the same number of steps.
    """
    if warmup < 0 or warmup >= len(per_step_s):
        raise ValueError(f"warmup={warmup} must leave at least one of the {len(per_step_s)} timed steps")
    slowest = slowest_rank(per_step_s[warmup:], device, group)
    return {"median_step_s": median(slowest), "step_s": slowest}
