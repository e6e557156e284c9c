"""Lab 12's ring, watched: a comm that records when each receive was posted and waited, and how many matrix
products ran in between (``OverlapComm``), so a check can ask whether the next K/V block was already on its way
while this block was computed (the overlap ring attention is built on).

The matrix products are seen by a ``torch.overrides.TorchFunctionMode`` (every ``torch.*`` function and tensor
method passes through it, in the thread that calls it: the mode stack is thread-local, so thread ranks each see
their own). A product is any of ``MATRIX_PRODUCTS`` (``q @ k.transpose(-2, -1)`` is ``Tensor.__matmul__``).

The same mode watches the memory the ring promises: ``largest_score``, the most elements of any tensor that goes
into or comes out of a matrix product, a softmax, an exponential or a log-sum-exp (``SCORE_FUNCTIONS``). A ring holds
one (T_r, T_j) block of scores at a time; a rank that keeps every block and runs one softmax at the end holds
(T_r, T). (A ``TorchDispatchMode`` would see the same at the aten level, but a second mode on every op made the
rehearsal 2-3x slower.)
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

MATRIX_PRODUCTS = {"matmul", "__matmul__", "__rmatmul__", "bmm", "baddbmm", "mm", "addmm", "einsum", "tensordot",
                   "linear", "scaled_dot_product_attention", "addbmm", "inner", "dot"}
SCORE_FUNCTIONS = MATRIX_PRODUCTS | {"softmax", "log_softmax", "_softmax", "exp", "exp_", "exp2", "logsumexp",
                                     "logaddexp", "special_softmax", "special_logsumexp"}


class _Work:
    def __init__(self, work, on_wait):
        self._work, self._on_wait = work, on_wait

    def wait(self, timeout=None):
        result = self._work.wait() if timeout is None else self._work.wait(timeout)
        self._on_wait()
        return result

    def is_completed(self):
        return self._work.is_completed()


class OverlapComm:
    """Wraps a ``CountingComm`` (or a thread rank's ``ThreadComm``): the same four calls, counted by it, plus a log
    of every receive: ``receives[i] = {"products_between": n, "data": ...}``, the matrix products this rank ran after
    posting receive i and before its first wait (0 for a blocking ``recv``) and a copy of what arrived. A send or
    receive with any rank but the ring neighbours is refused at once, naming the direction. Use it as the mode's
    owner:

        comm = OverlapComm(counting_comm)
        with comm.watching():
            student_function(..., comm, ...)
    """

    def __init__(self, inner):
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size
        self.products = 0
        self.receives: list[dict] = []
        self.largest_score, self.largest_score_function = 0, ""

    def _direction(self, peer: int, kind: str) -> None:
        """The ring's direction, checked before anything moves: at N >= 3 a transfer the wrong way round would
        otherwise surface as a size mismatch or a deadlock that never says which way the ring should run."""
        n, rank = self.world_size, self.rank
        want = (rank + 1) % n if kind == "send" else (rank - 1) % n
        if n > 1 and peer != want:
            left, right = (rank - 1) % n, (rank + 1) % n
            raise ValueError(f"rank {rank} of {n} called {kind} {'to' if kind == 'send' else 'from'} rank {peer}: "
                             f"wrong direction. The ring passes blocks to the right neighbour (rank + 1) % N = {right} "
                             f"and receives from the left neighbour (rank - 1) % N = {left} (at N = 2 the two are the "
                             f"same rank, so only N >= 3 shows it)")

    def isend(self, tensor, dst):
        self._direction(dst, "send")
        return _Work(self.inner.isend(tensor, dst), lambda: None)

    def irecv(self, tensor, src):
        self._direction(src, "receive")
        record = {"posted_at": self.products, "products_between": None, "data": None}
        self.receives.append(record)

        def waited():
            if record["products_between"] is None:
                record["products_between"] = self.products - record["posted_at"]
                record["data"] = tensor.detach().clone()          # what arrived: is it a K/V block? (cp_ring)
        return _Work(self.inner.irecv(tensor, src), waited)

    def send(self, tensor, dst):
        self._direction(dst, "send")
        self.inner.send(tensor, dst)

    def recv(self, tensor, src):
        self._direction(src, "receive")
        record = {"posted_at": self.products, "products_between": 0, "data": None}
        self.receives.append(record)
        self.inner.recv(tensor, src)
        record["data"] = tensor.detach().clone()

    def counts(self) -> dict:
        return self.inner.counts()

    def overlapped_receives(self) -> int:
        """Receives with at least one matrix product between their posting and their wait."""
        return sum(1 for r in self.receives if (r["products_between"] or 0) > 0)

    def watching(self) -> "_ProductCounter":
        return _ProductCounter(self)


class _ProductCounter(TorchFunctionMode):
    def __init__(self, comm: OverlapComm):
        super().__init__()
        self.comm = comm

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in MATRIX_PRODUCTS:
            self.comm.products += 1
        out = func(*args, **(kwargs or {}))
        if name in SCORE_FUNCTIONS:
            for t in (*args, *(kwargs or {}).values(), *(out if isinstance(out, (tuple, list)) else (out,))):
                if isinstance(t, torch.Tensor) and t.numel() > self.comm.largest_score:
                    self.comm.largest_score, self.comm.largest_score_function = t.numel(), name
        return out

