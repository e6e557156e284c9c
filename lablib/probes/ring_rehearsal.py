"""Lab 02's ring rehearsed on threads: point-to-point traffic between ranks that are threads of this process.

``ThreadWorld`` gives each thread a ``ThreadComm``, a ``lablib.measure.p2p.CountingComm`` whose sends and receives
are matched in posting order per pair of ranks, as gloo and MPI match them; the bytes are copied raw when both
sides are posted, so ``isend`` + ``irecv`` + ``wait`` works and two blocking sends facing each other deadlock, as
between processes. The deadlock is seen at once (every unfinished rank waits on an unmatched transfer) and
described as who waits on whom. ``run_in_threads(n, fn)`` runs ``fn(comm)``; ``rehearse_ring`` runs lab 02's
check cases that way. Like every rehearsal (``lablib.probes.rehearsal``), it is never a graded or measured
result: the real run on processes follows it.
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict, deque

import torch

from lablib.measure.p2p import (RING_DTYPES, CountingComm, TrafficCount, direct_calls, small_integers,
                                summarise)
from lablib.probes.rehearsal import RehearsalDeadlock


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


def rehearse_ring(ring_all_reduce, world_sizes=(2, 3, 4), sizes=(), shapes=(), dtypes=("float32",),
                  seed: int = 0, timeout_s: float = 30.0) -> list[dict]:
    """Lab 02's check cases run on threads (``ThreadWorld``) in this process, in a second: the rows have the
    format of ``lablib.labs.ring_allreduce.run``'s ``check`` rows (without the naive baseline), the reference
    being the exact sum of the ranks' small-integer tensors. A rank that raises (a deadlock included) raises
    here. A ``torch.distributed`` call made by the student's function fails in threads (there is no
    process group); it is reported in ``direct_calls`` of the row instead.
    """
    rows = []
    for world_size in world_sizes:
        for dtype_name in dtypes:
            dtype = RING_DTYPES[dtype_name]
            all_shapes = [(n,) for n in sizes] + [tuple(int(d) for d in s.split("x")) for s in shapes]
            for i, shape in enumerate(all_shapes):
                inputs = [small_integers(math.prod(shape), dtype, seed * 7919 + 1000 * i + r).view(shape)
                          for r in range(world_size)]
                expected = torch.stack([x.double() for x in inputs]).sum(0)

                def one_rank(comm, inputs=inputs):
                    got = inputs[comm.rank].clone()
                    returned = ring_all_reduce(got, comm)
                    err = (got.double() - expected).abs().max().item() if got.shape == expected.shape else float("inf")
                    return {"max_abs_err": err, "returned_input": returned is got, "direct_calls": [],
                            "element_size": got.element_size(), "ring": comm.counts()}

                with direct_calls() as called:
                    try:
                        per_rank = run_in_threads(world_size, one_rank, timeout_s)
                    except Exception:
                        if not called.calls:
                            raise
                        per_rank = [{"max_abs_err": float("inf"), "returned_input": False, "direct_calls": [],
                                     "element_size": inputs[0].element_size(), "ring": TrafficCount().as_dict()}
                                    ] * world_size
                row = summarise(per_rank, world_size, shape, dtype_name)
                row["direct_calls"] = sorted({c.function for c in called.calls})
                rows.append(row)
    return rows
