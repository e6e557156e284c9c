"""Point-to-point communication that counts its bytes, so traffic is measured instead of trusted.

Lab 02's ring all-reduce never calls ``torch.distributed`` directly: it receives a ``CountingComm`` and calls
``comm.isend / comm.irecv / comm.send / comm.recv``. Each call is forwarded unchanged to torch.distributed
and adds the tensor's size (``numel * element_size``, exact) to this rank's counters, in total and per peer.
A call is counted when it is posted: a posted receive is a promise to accept that many bytes.

    comm = CountingComm(env.rank, env.world_size)
    work = comm.isend(chunk, dst=(comm.rank + 1) % comm.world_size)   # returns torch's Work; .wait() it
    comm.counts()    # {"bytes_sent": ..., "bytes_received": ..., "sends": ..., "sent_to": {peer: bytes}, ...}

On gloo (and on NCCL, for large messages) a blocking ``send`` returns only once the peer has posted the
matching receive, so every rank calling ``send`` before ``recv`` deadlocks: post both with
``isend``/``irecv``, then wait.

``direct_calls()`` records the opposite: any ``torch.distributed`` communication function called *around*
the comm inside a block (a ``dist.all_reduce`` where a ring was asked for), so a check can require that
every byte went through the counters.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lablib.measure import counting

@dataclass
class TrafficCount:
    """What one rank posted: bytes and calls, in total and per peer rank."""
    bytes_sent: int = 0
    bytes_received: int = 0
    sends: int = 0
    recvs: int = 0
    largest_send: int = 0                     # bytes of the largest single message sent
    sent_to: dict = field(default_factory=lambda: defaultdict(int))
    received_from: dict = field(default_factory=lambda: defaultdict(int))

    def as_dict(self) -> dict:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received, "sends": self.sends,
                "recvs": self.recvs, "largest_send": self.largest_send, "sent_to": dict(self.sent_to),
                "received_from": dict(self.received_from)}


class CountingComm:
    """send/recv/isend/irecv between the ranks of one process group, with exact byte counters.

    rank, world_size: this process's place in the group (``group`` None = the default group). With a
    sub-group (``dist.new_group(ranks=...)``) both are the group's own, and so are the peers of every call:
    the comm passes them as ``group_dst`` / ``group_src``.
    A world size of 1 needs no process group at all: there is nobody to talk to, and any call is an error.
    """

    def __init__(self, rank: int, world_size: int, group=None):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of size {world_size} (ranks are 0..{world_size - 1})")
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.traffic = TrafficCount()

    # --- the four calls ------------------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Blocking send: returns once ``dst`` has received (so ``dst`` must post its receive first or concurrently)."""
        self._count_send(tensor, dst)
        with counting.uncounted():
            dist.send(tensor, group=self.group, group_dst=dst)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Blocking receive from ``src`` into ``tensor`` (its size says how many bytes are expected)."""
        self._count_recv(tensor, src)
        with counting.uncounted():
            dist.recv(tensor, group=self.group, group_src=src)

    def isend(self, tensor: torch.Tensor, dst: int):
        """Non-blocking send; returns a Work whose ``.wait()`` returns once the send completed.
        Do not modify ``tensor`` before then."""
        self._count_send(tensor, dst)
        with counting.uncounted():
            return dist.isend(tensor, group=self.group, group_dst=dst)

    def irecv(self, tensor: torch.Tensor, src: int):
        """Non-blocking receive into ``tensor``; read it only after ``.wait()`` on the returned Work."""
        self._count_recv(tensor, src)
        with counting.uncounted():
            return dist.irecv(tensor, group=self.group, group_src=src)

    # --- counters ------------------------------------------------------------------------------------

    def reset(self) -> None:
        self.traffic = TrafficCount()

    def counts(self) -> dict:
        return self.traffic.as_dict()

    def _check(self, tensor: torch.Tensor, peer: int, verb: str) -> int:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"comm.{verb} needs a torch.Tensor, got {type(tensor).__name__}")
        if not isinstance(peer, int) or not 0 <= peer < self.world_size:
            raise ValueError(f"rank {self.rank}: comm.{verb} to/from rank {peer!r}, but the ranks are "
                             f"0..{self.world_size - 1} (use % world_size to wrap around the ring)")
        if peer == self.rank:
            raise ValueError(f"rank {self.rank}: comm.{verb} with itself; a rank's neighbours in the ring are "
                             f"(rank + 1) % world_size and (rank - 1) % world_size")
        if not tensor.is_contiguous():
            raise ValueError(f"rank {self.rank}: comm.{verb} needs a contiguous tensor (got shape "
                             f"{tuple(tensor.shape)}, strides {tensor.stride()}); chunks of tensor.view(-1) are contiguous")
        return tensor.numel() * tensor.element_size()

    def _count_send(self, tensor: torch.Tensor, dst: int) -> None:
        n_bytes = self._check(tensor, dst, "send")
        self.traffic.bytes_sent += n_bytes
        self.traffic.sends += 1
        self.traffic.sent_to[dst] += n_bytes
        self.traffic.largest_send = max(self.traffic.largest_send, n_bytes)

    def _count_recv(self, tensor: torch.Tensor, src: int) -> None:
        n_bytes = self._check(tensor, src, "recv")
        self.traffic.bytes_received += n_bytes
        self.traffic.recvs += 1
        self.traffic.received_from[src] += n_bytes


@contextlib.contextmanager
def direct_calls():
    """Record the torch.distributed communication calls made inside the block other than through a CountingComm.

    Yields a ``lablib.measure.counting.CollectiveLog`` (``[c.function for c in log.calls]``: ``"all_reduce"``,
    ``"isend"``, ...); the calls still run unchanged. It is ``counting.count_collectives``, which the comm's
    own calls do not reach (they run inside ``counting.uncounted``). A name bound by ``from
    torch.distributed import all_reduce`` before the block is not seen (its traffic is then missing from the
    comm's counters, which a check also sees).
    """
    with counting.count_collectives() as log:
        yield log


# --- lab 02's ring check: the same cases in threads (a rehearsal) and in processes (lablib.labs.ring_allreduce.run)

def small_integers(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Integers in [-8, 8]: sums of a few are exact in every dtype, so any reduction order gives the same bits."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, (numel,), generator=g).to(dtype)


def summarise(per_rank: list[dict], world_size: int, shape, dtype_name: str) -> dict:
    """One row per checked case: per-rank lists in rank order (index = rank in the checked group)."""
    numel, element_size = math.prod(shape), per_rank[0]["element_size"]
    row = {
        "world_size": world_size, "numel": numel, "shape": list(shape), "dtype": dtype_name,
        "element_size": element_size, "n_bytes": numel * element_size,
        "max_abs_err": max(r["max_abs_err"] for r in per_rank),
        "returned_input": all(r["returned_input"] for r in per_rank),
        # torch.distributed functions the student's code called itself, on any rank (should be none)
        "direct_calls": sorted({name for r in per_rank for name in r["direct_calls"]}),
        **{key: [r["ring"][key] for r in per_rank]
           for key in ("bytes_sent", "bytes_received", "sends", "recvs", "largest_send")},
        # per rank: the ranks it sent to / received from (sorted), and the bytes per peer
        "sent_to_ranks": [sorted(r["ring"]["sent_to"]) for r in per_rank],
        "received_from_ranks": [sorted(r["ring"]["received_from"]) for r in per_rank],
        "sent_to": [r["ring"]["sent_to"] for r in per_rank],
    }
    if "naive" in per_rank[0]:
        row["naive_bytes_sent"] = [r["naive"]["bytes_sent"] for r in per_rank]
        row["naive_bytes_received"] = [r["naive"]["bytes_received"] for r in per_rank]
    return row


RING_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
               "float16": torch.float16, "int32": torch.int32, "int64": torch.int64}
