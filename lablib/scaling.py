"""Measuring strong scaling: time the parts of a data-parallel training step separately.

A data-parallel step has three parts (lab 03 explains why they scale differently):
- **compute**: forward + backward on this rank's share of the global batch (shrinks as 1/N);
- **communication**: the all-reduce that averages the gradients over the N ranks (does not shrink);
- **optimizer step**: every rank updates the whole model (does not shrink).

DDP overlaps the communication with the backward (each bucket of gradients is all-reduced as soon as it
is ready), which makes the parts impossible to time apart. So the measurement trains the same model
twice: once *without* overlap - a plain model, then one explicit all-reduce of all gradients, then the
optimizer step, each part timed on its own - and once with DDP, timed as a whole. The difference between
the two step times is the communication DDP managed to hide behind the backward.

Every timed part starts after a barrier, so a rank waiting for a slower rank is booked as "wait", not as
communication; every per-step time is the slowest rank's (the step is done when the last rank is done).
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


def allreduce_gradients_(params: Sequence[torch.nn.Parameter], group=None) -> int:
    """Average the gradients over the ranks with ONE all-reduce of a flat buffer; returns its size in bytes.

    This is what DDP does, minus buckets and overlap: concatenate all .grad tensors (P numbers),
    all-reduce the sum, divide by the world size, copy back. One big message is the cheapest way to send
    P numbers (one latency), so this is a lower bound on DDP's communication time without overlap.
    With one rank there is nothing to average and nothing is sent (the single-process baseline).
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return 0
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])        # (P,)
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return flat.numel() * flat.element_size()


def slowest_rank(values: Sequence[float], device: torch.device, group=None) -> list[float]:
    """Element-wise maximum over the ranks of a per-step list (one all-reduce for the whole list)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def median(values: Sequence[float]) -> float:
    """Median: robust to the odd step slowed by another process on a shared machine."""
    return float(statistics.median(values))


# --- pure functions of measured numbers (no process group) ------------------------------------------------

def speedups(step_time_by_world_size: dict[int, float]) -> dict[int, float]:
    """Strong-scaling speedup S(N) = t(1) / t(N) for the same global batch; needs the N = 1 time."""
    if 1 not in step_time_by_world_size:
        raise ValueError(f"speedups need the time at world size 1; got world sizes "
                         f"{sorted(step_time_by_world_size)}")
    t1 = step_time_by_world_size[1]
    return {n: t1 / t for n, t in sorted(step_time_by_world_size.items())}


def efficiencies(speedup_by_world_size: dict[int, float]) -> dict[int, float]:
    """Parallel efficiency E(N) = S(N) / N: the fraction of N ranks' time spent on useful work."""
    return {n: s / n for n, s in sorted(speedup_by_world_size.items())}


def hidden_comm_fraction(t_step_no_overlap: float, t_step_overlap: float, t_comm: float) -> float:
    """The fraction of the communication DDP hid behind the backward, from two measured step times.

    The same training step takes t_step_no_overlap when the all-reduce (t_comm) runs after the backward
    and t_step_overlap with DDP's bucketed overlap. The time saved, divided by t_comm, is the hidden
    fraction: 0 = no overlap, 1 = all communication hidden. On a noisy, oversubscribed CPU it can come out
    below 0 (DDP's extra work, or gloo's threads taking CPU from the backward, cost more than it hid) or
    above 1 (noise); it is returned as measured, not clipped.
    """
    if t_comm <= 0:
        raise ValueError(f"t_comm={t_comm} must be positive (there is no communication at world size 1)")
    return (t_step_no_overlap - t_step_overlap) / t_comm
