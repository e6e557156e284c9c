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
communication; every per-step time is the slowest rank's (``lablib.measure.timing``: the step is done when the last
rank is done).
DDP's own all-reduces are timed by a communication hook (``BucketTimer``): when each bucket's all-reduce
was launched and when it finished, which shows how much of it ran during the backward.

Buckets and overlap are from the DDP paper: S. Li et al., "PyTorch Distributed: Experiences on Accelerating
Data Parallel Training", VLDB 2020 (section 3.2: "Gradient Bucketing" and "Overlap Computation with
Communication"). ``bucketed_backward`` is a schedule of that idea in the alpha-beta cost model.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist


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


class BucketTimer:
    """A DDP communication hook that all-reduces each bucket (sum, then divide by N, as DDP does) and
    records, on this rank, (launch s, done s, bytes, bucket index) for every bucket, with perf_counter
    times. ``start_step()`` empties the record; ``spans`` holds it.

    Register it with ``ddp.register_comm_hook(timer, BucketTimer.hook)``. DDP's built-in all-reduce does
    the same work in C++; a Python hook adds a few microseconds per bucket.

    The "done" time is taken in the future's callback. On gloo that runs when the all-reduce has finished; for CUDA
    tensors it "might be invoked while the async kernels ... haven't yet finished executing on the device"
    (torch/futures/__init__.py:114-119), so on NCCL the spans are launch times, not the device's.
    """

    def __init__(self, group=None):
        self.group = group
        self.spans: list[tuple[float, float, int, int]] = []

    def start_step(self) -> None:
        self.spans = []

    @staticmethod
    def hook(timer, bucket):  # no annotations: DDP checks them, and this module postpones them (strings)
        launched = time.perf_counter()
        buffer = bucket.buffer()                      # (bucket's numel,) the flat gradients of this bucket
        future = dist.all_reduce(buffer, group=timer.group, async_op=True).get_future()

        def finished(f):
            # On gloo this runs when the all-reduce completes (in its worker thread): the "done" time (not on CUDA).
            timer.spans.append((launched, time.perf_counter(), buffer.numel() * buffer.element_size(),
                                bucket.index()))
            return f.value()[0].div_(dist.get_world_size(timer.group))

        return future.then(finished)


# --- pure functions of measured numbers (no process group) ------------------------------------------------

def speedups(step_time_by_world_size: dict[int, float]) -> dict[int, float]:
    """Strong-scaling speedup S(N) = t(1) / t(N) for the same global batch; needs the N = 1 time."""
    if 1 not in step_time_by_world_size:
        raise ValueError(f"speedups need the time at world size 1; got world sizes "
                         f"{sorted(step_time_by_world_size)}")
    t1 = step_time_by_world_size[1]
    return {n: t1 / t for n, t in sorted(step_time_by_world_size.items())}


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


def bucketed_backward(t_backward: float, grad_bytes: float, bucket_bytes: float,
                      allreduce_time: Callable[[float], float], n_buckets: int | None = None) -> dict:
    """When the backward and its bucketed gradient all-reduces are done, in a simple schedule of DDP.

    Assumptions (Li et al., VLDB 2020, section 3.2): gradients become ready at a steady rate
    during the backward (grad_bytes over t_backward seconds, last layer first); a bucket of bucket_bytes
    is all-reduced as soon as it is full and the previous bucket's all-reduce has finished (one
    communication stream, buckets in order); a tensor is never split (not modelled: buckets here are
    exactly bucket_bytes, the last one smaller). allreduce_time(n_bytes) is one all-reduce's seconds,
    e.g. the ring's alpha-beta time from lab 02.

    ``n_buckets``, when the count is known (a measured run's), is taken as given (the last bucket takes what is left):
    ``ceil(grad_bytes / (grad_bytes / n))`` is n + 1 for some n in floating point (n = 29 at 1,653,248 B), which
    would charge one more latency for a bucket of a few bytes.

    Returns seconds from the start of the backward: ``done`` (backward and all communication finished),
    ``exposed_comm`` (done - t_backward: communication nothing hid), ``comm`` (all all-reduces together)
    and ``n_buckets``. Small buckets pay the latency once per bucket; one big bucket starts only when the
    backward is over, so nothing overlaps.
    """
    if t_backward < 0 or grad_bytes <= 0:
        raise ValueError(f"t_backward={t_backward} must be >= 0 and grad_bytes={grad_bytes} positive")
    if not bucket_bytes > 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be positive (DDP's bucket_cap_mb, in bytes)")
    if n_buckets is None:
        n_buckets = math.ceil(grad_bytes / bucket_bytes)
    elif n_buckets < 1:
        raise ValueError(f"n_buckets={n_buckets} must be at least 1")
    comm_free, comm = 0.0, 0.0
    for i in range(n_buckets):
        filled = grad_bytes if i == n_buckets - 1 else min(grad_bytes, (i + 1) * bucket_bytes)
        ready = t_backward * filled / grad_bytes                 # the bucket's last gradient is computed
        cost = allreduce_time(filled - i * bucket_bytes)
        comm_free = max(ready, comm_free) + cost                 # waits for its data and for the stream
        comm += cost
    done = max(t_backward, comm_free)
    return {"done": done, "exposed_comm": done - t_backward, "comm": comm, "n_buckets": n_buckets}
