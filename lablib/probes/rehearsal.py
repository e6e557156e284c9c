"""Ranks as threads of this process: an exercise rehearsed in a second, before any ``torchrun`` start.

A rehearsal is never a graded or measured result: the real run on processes follows it. It makes a wrong
answer fail, and a hang show as a named deadlock, before seconds of process start-up are spent. This module
rehearses collectives; ``lablib.probes.ring_rehearsal`` rehearses point-to-point traffic (lab 02's ring).

- **Collectives** (labs 05, 07): while ``run_in_thread_ranks(n, fn)`` runs, the ``torch.distributed`` functions the
  students' classes and their probe call (``get_rank``, ``get_world_size``, ``broadcast``, ``all_reduce``,
  ``reduce_scatter_tensor``, ``all_gather_into_tensor``, ``all_gather``, ``all_gather_object``, ``barrier``)
  are replaced by versions that exchange tensors between the threads: every collective is a rendezvous of all
  N threads, each puts its input in its slot, and each computes the result from all the slots in rank order (a
  sum adds rank 0's first). A thread that calls a collective the others do not call waits at the rendezvous
  until ``timeout_s``, then every thread gets a ``RehearsalDeadlock`` naming the collective. A function not
  listed raises ``RehearsalUnsupported`` (the caller then goes straight to the real run).

gloo's own sums may add in another order than rank order: a rehearsal compares with an exact reference.
"""


from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


_local = threading.local()


class RehearsalDeadlock(RuntimeError):
    """Every rank that has not finished waits for something no other rank will ever do."""


class RehearsalUnsupported(RuntimeError):
    pass


class _Pending:
    """What an ``async_op=True`` call returns. The ranks met when it was called (its inputs are read then), but its
    output is written only when ``wait()`` (or ``is_completed()``) is called, as a real asynchronous collective's
    result can only be relied on after it: an answer that reads the output without waiting reads stale values
    here, and a work never waited is reported when the rank's function returns (on gloo a buffer freed under a
    collective still running can crash the process)."""

    def __init__(self, what: str, apply: Callable[[], None]):
        self.what, self._apply, self.done = what, apply, False
        pending = getattr(_local, "pending", None)    # None in a thread run_in_thread_ranks did not start
        if pending is not None:
            pending.append(self)

    def _finish(self) -> None:
        if not self.done:
            self.done = True
            self._apply()

    def wait(self, timeout=None) -> bool:
        self._finish()
        return True

    def is_completed(self) -> bool:
        self._finish()
        return True

    def get_future(self) -> torch.futures.Future:
        """A future already complete once the output is written (as ``wait()``), for answers that chain on it."""
        self._finish()
        future = torch.futures.Future()
        future.set_result(None)
        return future


class NeverWaited(RuntimeError):
    """A collective started with ``async_op=True`` whose work was never waited."""


class _World:
    def __init__(self, n: int, timeout_s: float):
        self.n = n
        self.slots: list = [None] * n
        self.barrier = threading.Barrier(n, timeout=timeout_s)

    def exchange(self, what: str, value) -> list:
        """Every rank's value, in rank order (each thread calls it with its own)."""
        try:
            self.slots[_local.rank] = value
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()              # nobody writes the next call's slot before all have read this one
            return out
        except threading.BrokenBarrierError:
            raise RehearsalDeadlock(f"rank {_local.rank} waited in {what} for ranks that never called it (on "
                                    f"real ranks: a hang until the collective timeout); every rank must call "
                                    f"the same collectives in the same order") from None


def _reduce(values: list[torch.Tensor], op) -> torch.Tensor:
    out = values[0].clone()
    for v in values[1:]:
        if op in (None, dist.ReduceOp.SUM):
            out += v
        elif op == dist.ReduceOp.MAX:
            out = torch.maximum(out, v)
        elif op == dist.ReduceOp.MIN:
            out = torch.minimum(out, v)
        else:
            raise RehearsalUnsupported(f"reduce op {op}")
    return out


def _fake_functions(world: _World) -> dict[str, Callable]:
    def done(async_op, what="a collective", apply=None):
        """Write the output now (a blocking call) or on the work's wait() (``async_op=True``)."""
        def write():
            if apply is not None:
                with torch.no_grad():
                    apply()
        if async_op:
            return _Pending(what, write)
        write()
        return None

    def broadcast(tensor, src=0, group=None, async_op=False, **_):
        values = world.exchange("broadcast", tensor.detach().clone() if _local.rank == src else None)
        return done(async_op, "broadcast", lambda: tensor.copy_(values[src]))

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False, **_):
        values = world.exchange("all_reduce", tensor.detach().clone())
        total = _reduce(values, op)
        return done(async_op, "all_reduce", lambda: tensor.copy_(total))

    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False, **_):
        if input.numel() != world.n * output.numel():
            raise ValueError(f"reduce_scatter_tensor: input has {input.numel()} elements, output {output.numel()}; "
                             f"the input must be world_size x the output ({world.n} x {output.numel()})")
        values = world.exchange("reduce_scatter_tensor", input.detach().clone())
        mine = _reduce(values, op).flatten().chunk(world.n)[_local.rank].view_as(output)
        return done(async_op, "reduce_scatter_tensor", lambda: output.copy_(mine))

    def all_gather_into_tensor(output, input, group=None, async_op=False, **_):
        if output.numel() != world.n * input.numel():
            raise ValueError(f"all_gather_into_tensor: output has {output.numel()} elements, input {input.numel()}; "
                             f"the output must be world_size x the input ({world.n} x {input.numel()})")
        values = world.exchange("all_gather_into_tensor", input.detach().clone())
        gathered = torch.cat([v.flatten() for v in values]).view_as(output)
        return done(async_op, "all_gather_into_tensor", lambda: output.copy_(gathered))

    def all_gather(tensor_list, tensor, group=None, async_op=False, **_):
        values = world.exchange("all_gather", tensor.detach().clone())

        def write():
            for out, v in zip(tensor_list, values):
                out.copy_(v)
        return done(async_op, "all_gather", write)

    def all_gather_object(object_list, obj, group=None, **_):
        object_list[:] = world.exchange("all_gather_object", obj)

    def barrier(group=None, async_op=False, **_):
        world.exchange("barrier", None)
        return done(async_op, "barrier")

    def unsupported(name):
        def call(*args, **kwargs):
            raise RehearsalUnsupported(f"torch.distributed.{name} is not rehearsed in threads")
        return call

    fakes = {"get_rank": lambda group=None: _local.rank, "get_world_size": lambda group=None: world.n,
             "is_initialized": lambda: True, "broadcast": broadcast, "all_reduce": all_reduce,
             "reduce_scatter_tensor": reduce_scatter_tensor, "reduce_scatter_single": reduce_scatter_tensor,
             "all_gather_into_tensor": all_gather_into_tensor, "all_gather_single": all_gather_into_tensor,
             "all_gather": all_gather, "all_gather_object": all_gather_object, "barrier": barrier}
    for name in ("reduce_scatter", "reduce", "scatter", "gather", "send", "recv", "isend", "irecv", "all_to_all",
                 "all_to_all_single", "broadcast_object_list", "new_group"):
        fakes[name] = unsupported(name)
    return fakes


def _bound_before(*args, **kwargs):
    """Stands in for c10d._get_default_group while the rehearsal runs. The fakes replace torch.distributed's module
    attributes, so a function bound by name before (``from torch.distributed import all_reduce``) is the real one;
    called with no process group it reaches _get_default_group (distributed_c10d.py:1420 in torch 2.13, as every
    torch.distributed function does), and the rehearsal steps aside for the real run instead of failing a correct
    answer."""
    raise RehearsalUnsupported("a torch.distributed function bound by name before the rehearsal (e.g. 'from "
                               "torch.distributed import all_reduce') is not rehearsed in threads")


@contextlib.contextmanager
def _patched(fakes: dict[str, Callable]):
    saved = {name: getattr(dist, name) for name in fakes if hasattr(dist, name)}
    saved_default_group = c10d._get_default_group
    for name, fake in fakes.items():
        setattr(dist, name, fake)
    c10d._get_default_group = _bound_before
    try:
        yield
    finally:
        c10d._get_default_group = saved_default_group
        for name in fakes:
            if name in saved:
                setattr(dist, name, saved[name])
            else:
                delattr(dist, name)


def run_in_thread_ranks(world_size: int, fn: Callable[[int], object], timeout_s: float = 20.0,
                        more_fakes: Callable | None = None) -> list:
    """fn(rank) on world_size threads that stand in for ranks; [rank 0's return, rank 1's, ...]. An exception in
    any thread is raised here (a deadlock's, if that is all there is, or the first other one). ``more_fakes(world,
    local)``: a lab's own fakes ({name: function}, e.g. lablib.probes.group_rehearsal's), over the ones above."""
    if dist.is_initialized():
        raise RuntimeError("the thread rehearsal needs a process without a process group (it replaces "
                           "torch.distributed's functions for a moment)")
    world = _World(world_size, timeout_s)
    results: list = [None] * world_size
    errors: list = [None] * world_size

    def body(rank):
        _local.rank, _local.pending = rank, []
        try:
            results[rank] = fn(rank)
            never = [work.what for work in _local.pending if not work.done]
            if never:
                raise NeverWaited(f"rank {rank} started {len(never)} collective(s) with async_op=True whose work was "
                                  f"never waited ({', '.join(sorted(set(never)))}): call .wait() on each work before "
                                  f"its output is read or its buffers are freed (on real ranks the result may not "
                                  f"have arrived, and gloo can crash the process when a buffer is freed under a "
                                  f"collective still running)")
            if isinstance(results[rank], dict) and results[rank].get("error"):
                world.barrier.abort()  # a probe that caught an error: the other ranks stop waiting for it
        except BaseException as exc:  # noqa: BLE001 - collected and raised in the caller's thread
            errors[rank] = exc
            world.barrier.abort()      # the others stop waiting for this rank

    fakes = _fake_functions(world)
    fakes.update(more_fakes(world, _local) if more_fakes else {})
    with _patched(fakes):
        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s * 4)
    real = [e for e in errors if e is not None and not isinstance(e, RehearsalDeadlock)]
    if real or any(errors):
        raise (real or [e for e in errors if e is not None])[0]
    return results


# --- point-to-point: a CountingComm per thread ---------------------------------------------------------------
