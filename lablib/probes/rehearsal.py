"""Ranks as threads of this process: an exercise rehearsed in a second, before any ``torchrun`` start.

A rehearsal is never a graded or measured result: the real run on processes follows it. It makes a wrong
answer fail, and a hang show as a named deadlock, before seconds of process start-up are spent. Two kinds:

- **Collectives** (lab 07): while ``run_in_thread_ranks(n, fn)`` runs, the ``torch.distributed`` functions the
  students' classes and their probe call (``get_rank``, ``get_world_size``, ``broadcast``, ``all_reduce``,
  ``reduce_scatter_tensor``, ``all_gather_into_tensor``, ``all_gather``, ``all_gather_object``, ``barrier``)
  are replaced by versions that exchange tensors between the threads: every collective is a rendezvous of all
  N threads, each puts its input in its slot, and each computes the result from all the slots in rank order (a
  sum adds rank 0's first). A thread that calls a collective the others do not call waits at the rendezvous
  until ``timeout_s``, then every thread gets a ``RehearsalDeadlock`` naming the collective. A function not
  listed raises ``RehearsalUnsupported`` (the caller then goes straight to the real run).
- **Point-to-point** (lab 02): ``ThreadWorld`` gives each thread a ``ThreadComm``, a ``lablib.measure.p2p.CountingComm``
  whose sends and receives are matched in posting order per pair of ranks, as gloo and MPI match them; the bytes
  are copied raw when both sides are posted, so ``isend`` + ``irecv`` + ``wait`` works and two blocking sends
  facing each other deadlock, as between processes. The deadlock is seen at once (every unfinished rank waits on
  an unmatched transfer) and described as who waits on whom. ``run_in_threads(n, fn)`` runs ``fn(comm)``.

gloo's own sums may add in another order than rank order: a rehearsal compares with an exact reference.
"""


from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict, deque
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from lablib.measure.p2p import CountingComm

_local = threading.local()


class RehearsalDeadlock(RuntimeError):
    """Every rank that has not finished waits for something no other rank will ever do."""


class RehearsalUnsupported(RuntimeError):
    pass


class _Done:
    """What an ``async_op=True`` call returns: the work is already complete."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


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
    def done(async_op):
        return _Done() if async_op else None

    def broadcast(tensor, src=0, group=None, async_op=False, **_):
        values = world.exchange("broadcast", tensor.detach().clone() if _local.rank == src else None)
        with torch.no_grad():
            tensor.copy_(values[src])
        return done(async_op)

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False, **_):
        values = world.exchange("all_reduce", tensor.detach().clone())
        with torch.no_grad():
            tensor.copy_(_reduce(values, op))
        return done(async_op)

    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False, **_):
        if input.numel() != world.n * output.numel():
            raise ValueError(f"reduce_scatter_tensor: input has {input.numel()} elements, output {output.numel()}; "
                             f"the input must be world_size x the output ({world.n} x {output.numel()})")
        values = world.exchange("reduce_scatter_tensor", input.detach().clone())
        with torch.no_grad():
            output.copy_(_reduce(values, op).flatten().chunk(world.n)[_local.rank].view_as(output))
        return done(async_op)

    def all_gather_into_tensor(output, input, group=None, async_op=False, **_):
        if output.numel() != world.n * input.numel():
            raise ValueError(f"all_gather_into_tensor: output has {output.numel()} elements, input {input.numel()}; "
                             f"the output must be world_size x the input ({world.n} x {input.numel()})")
        values = world.exchange("all_gather_into_tensor", input.detach().clone())
        with torch.no_grad():
            output.copy_(torch.cat([v.flatten() for v in values]).view_as(output))
        return done(async_op)

    def all_gather(tensor_list, tensor, group=None, async_op=False, **_):
        values = world.exchange("all_gather", tensor.detach().clone())
        with torch.no_grad():
            for out, v in zip(tensor_list, values):
                out.copy_(v)
        return done(async_op)

    def all_gather_object(object_list, obj, group=None, **_):
        object_list[:] = world.exchange("all_gather_object", obj)

    def barrier(group=None, async_op=False, **_):
        world.exchange("barrier", None)
        return done(async_op)

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


def run_in_thread_ranks(world_size: int, fn: Callable[[int], object], timeout_s: float = 20.0) -> list:
    """fn(rank) on world_size threads that stand in for ranks; [rank 0's return, rank 1's, ...]. An exception in
    any thread is raised here (a deadlock's, if that is all there is, or the first other one)."""
    if dist.is_initialized():
        raise RuntimeError("the thread rehearsal needs a process without a process group (it replaces "
                           "torch.distributed's functions for a moment)")
    world = _World(world_size, timeout_s)
    results: list = [None] * world_size
    errors: list = [None] * world_size

    def body(rank):
        _local.rank = rank
        try:
            results[rank] = fn(rank)
            if isinstance(results[rank], dict) and results[rank].get("error"):
                world.barrier.abort()  # a probe that caught an error: the other ranks stop waiting for it
        except BaseException as exc:  # noqa: BLE001 - collected and raised in the caller's thread
            errors[rank] = exc
            world.barrier.abort()      # the others stop waiting for this rank

    with _patched(_fake_functions(world)):
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

class RehearsalError(RuntimeError):
    """A rank's own error in a ThreadWorld, re-raised in the calling thread with the rank named."""


class _Transfer:
    """One posted send or receive; ``matched`` once its partner is posted (the bytes move then)."""

    def __init__(self, kind: str, rank: int, peer: int, tensor: torch.Tensor):
        self.kind, self.rank, self.peer, self.tensor = kind, rank, peer, tensor
        self.matched = False
        self.error: Exception | None = None


class ThreadWorld:
    """N ranks as threads of this process, talking through memory with gloo's point-to-point semantics.

    A send and a receive are matched in the order they are posted between the same two ranks (like gloo and
    MPI); the bytes are copied when both are posted, so ``isend`` + ``irecv`` + ``wait`` works as it does
    between processes, and two blocking ``send`` calls facing each other deadlock as they do there. Unlike
    processes, a deadlock is seen at once: when every rank that has not finished waits on an unmatched
    transfer, each waiting rank raises ``RehearsalDeadlock`` naming who waited on whom. Bytes are copied raw, so
    a receive buffer of another dtype gets the sender's bits, and a size mismatch is an error (gloo's too).

    It exists for quick checks before a torchrun start (``rehearse_ring``); measured results always come
    from real processes.
    """

    def __init__(self, world_size: int, timeout_s: float = 30.0):
        self.world_size, self.timeout_s = world_size, timeout_s
        self._cond = threading.Condition()
        self._pending: dict[tuple[str, int, int], deque] = defaultdict(deque)   # (kind, src, dst) -> transfers
        self._waiting: dict[int, _Transfer] = {}
        self._finished: set[int] = set()
        self._deadlock: str | None = None

    def comm(self, rank: int) -> "ThreadComm":
        return ThreadComm(self, rank)

    def post(self, kind: str, rank: int, peer: int, tensor: torch.Tensor) -> _Transfer:
        transfer = _Transfer(kind, rank, peer, tensor)
        src, dst = (rank, peer) if kind == "send" else (peer, rank)
        other = "recv" if kind == "send" else "send"
        with self._cond:
            queue = self._pending[(other, src, dst)]
            if queue:
                partner = queue.popleft()
                send, recv = (transfer, partner) if kind == "send" else (partner, transfer)
                self._move(send, recv)
                self._cond.notify_all()
            else:
                self._pending[(kind, src, dst)].append(transfer)
        return transfer

    @staticmethod
    def _move(send: _Transfer, recv: _Transfer) -> None:
        out, into = send.tensor.reshape(-1).view(torch.uint8), recv.tensor.reshape(-1).view(torch.uint8)
        if out.numel() != into.numel():
            error = ValueError(f"rank {send.rank} sent {out.numel()} bytes to rank {recv.rank}, which received them "
                               f"into a buffer of {into.numel()} bytes: sender and receiver must agree on the chunk "
                               f"(same size and dtype)")
            send.error = recv.error = error
        else:
            into.copy_(out)
        send.matched = recv.matched = True

    def wait(self, transfer: _Transfer) -> None:
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            self._waiting[transfer.rank] = transfer
            try:
                while not transfer.matched:
                    # stuck: every rank either finished or waits on a transfer nobody has matched
                    blocked = sum(not t.matched for t in self._waiting.values())
                    stuck = blocked + len(self._finished) == self.world_size
                    if self._deadlock is None and (stuck or time.monotonic() > deadline):
                        self._deadlock = self._describe(transfer.rank, stuck)   # as first seen, for every rank
                    if self._deadlock is not None:
                        raise RehearsalDeadlock(self._deadlock)
                    self._cond.wait(0.05)
            finally:
                del self._waiting[transfer.rank]
                self._cond.notify_all()
        if transfer.error is not None:
            raise transfer.error

    def finished(self, rank: int) -> None:
        with self._cond:
            self._finished.add(rank)
            self._cond.notify_all()

    def _describe(self, rank: int, stuck: bool) -> str:
        waits = "; ".join(f"rank {r} waits for its {t.kind} {'to' if t.kind == 'send' else 'from'} rank {t.peer}"
                          for r, t in sorted(self._waiting.items()) if not t.matched)
        done = f"; finished: ranks {sorted(self._finished)}" if self._finished else ""
        why = "no rank can make progress" if stuck else f"nothing moved for {self.timeout_s:g} s"
        return (f"deadlock on {self.world_size} ranks, seen at rank {rank} ({why}): {waits}{done}. A blocking "
                f"send returns only once the peer posts the matching receive: post both with comm.isend / "
                f"comm.irecv, then wait(), and check that what rank r sends to r+1 is what r+1 expects from r.")


class _ThreadWork:
    def __init__(self, world: ThreadWorld, transfer: _Transfer):
        self._world, self._transfer = world, transfer

    def wait(self, timeout=None) -> bool:
        self._world.wait(self._transfer)
        return True

    def is_completed(self) -> bool:
        return self._transfer.matched


class ThreadComm(CountingComm):
    """A CountingComm (same calls, same checks, same byte counters) for one thread of a ThreadWorld."""

    def __init__(self, world: ThreadWorld, rank: int):
        super().__init__(rank, world.world_size)
        self.world = world

    def isend(self, tensor: torch.Tensor, dst: int):
        self._count_send(tensor, dst)
        return _ThreadWork(self.world, self.world.post("send", self.rank, dst, tensor))

    def irecv(self, tensor: torch.Tensor, src: int):
        self._count_recv(tensor, src)
        return _ThreadWork(self.world, self.world.post("recv", self.rank, src, tensor))

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.isend(tensor, dst).wait()

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self.irecv(tensor, src).wait()


def run_in_threads(world_size: int, fn, timeout_s: float = 30.0) -> list:
    """``fn(comm)`` on ``world_size`` threads of one ThreadWorld; each rank's return value, in rank order.

    An exception on any rank is raised here, naming the rank (a deadlock is raised from a rank that saw it).
    """
    world = ThreadWorld(world_size, timeout_s)
    results, errors = [None] * world_size, [None] * world_size

    def body(rank):
        try:
            results[rank] = fn(world.comm(rank))
        except BaseException as error:   # noqa: BLE001 - handed to the caller below
            errors[rank] = error
        finally:
            world.finished(rank)

    threads = [threading.Thread(target=body, args=(r,), daemon=True, name=f"rank{r}") for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if any(t.is_alive() for t in threads):
        raise RehearsalDeadlock(f"{world_size} threads did not finish within {timeout_s + 5:g} s")
    if failed:   # the first rank whose own error it is; a deadlock is every waiting rank's
        rank, error = next(((r, e) for r, e in failed if not isinstance(e, RehearsalDeadlock)), failed[0])
        if isinstance(error, RehearsalDeadlock):
            raise RehearsalDeadlock(f"rehearsal in threads: {error}") from None
        raise RehearsalError(f"rank {rank} of {world_size} (rehearsal in threads) raised "
                             f"{type(error).__name__}: {error}") from error
    return results
