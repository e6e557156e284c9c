"""Lab 12's ring, watched: a comm that records when each receive was posted and waited, and how many matrix
products ran in between (``OverlapComm``), so a check can ask whether the next K/V block was already on its way
while this block was computed (the overlap ring attention is built on).

The matrix products are seen by a ``torch.overrides.TorchFunctionMode`` (every ``torch.*`` function and tensor
method passes through it, in the thread that calls it: the mode stack is thread-local, so thread ranks each see
their own). A product is any of ``MATRIX_PRODUCTS`` (``q @ k.transpose(-2, -1)`` is ``Tensor.__matmul__``).
"""

from __future__ import annotations

from torch.overrides import TorchFunctionMode

MATRIX_PRODUCTS = {"matmul", "__matmul__", "__rmatmul__", "bmm", "baddbmm", "mm", "addmm", "einsum", "tensordot",
                   "linear", "scaled_dot_product_attention", "addbmm", "inner", "dot"}


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
    of every receive: ``receives[i] = {"products_between": n}``, the matrix products this rank ran after posting
    receive i and before its first wait (0 for a blocking ``recv``). Use it as the mode's owner:

        comm = OverlapComm(counting_comm)
        with comm.watching():
            student_function(..., comm, ...)
    """

    def __init__(self, inner):
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size
        self.products = 0
        self.receives: list[dict] = []

    def isend(self, tensor, dst):
        return _Work(self.inner.isend(tensor, dst), lambda: None)

    def irecv(self, tensor, src):
        record = {"posted_at": self.products, "products_between": None}
        self.receives.append(record)

        def waited():
            if record["products_between"] is None:
                record["products_between"] = self.products - record["posted_at"]
        return _Work(self.inner.irecv(tensor, src), waited)

    def send(self, tensor, dst):
        self.inner.send(tensor, dst)

    def recv(self, tensor, src):
        self.receives.append({"posted_at": self.products, "products_between": 0})
        self.inner.recv(tensor, src)

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
        if getattr(func, "__name__", "") in MATRIX_PRODUCTS:
            self.comm.products += 1
        return func(*args, **(kwargs or {}))
