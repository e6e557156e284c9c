"""Count the communication a step really issues, at the one place the course calls it.

Every lab counts collectives the same way, here:

    with counting.count_collectives() as log:        # every torch.distributed call inside is recorded
        train_step()
    log.count("all_gather"), log.bytes("reduce_scatter"), log.calls[0]   # Call(name, bytes, world_size, ...)

A ``Call`` is recorded when the course (or a library it uses: FSDP2, DTensor, Accelerate) calls a
``torch.distributed`` function, with the bytes of the *algorithm* it asked for, not of what the backend
moved: gloo implements ``reduce_scatter_tensor`` with an all-reduce (about twice the bytes NCCL moves), so
its own traffic would mislead. Sizes follow nccl-tests' conventions (github.com/NVIDIA/nccl-tests,
doc/PERFORMANCE.md):

- ``bytes`` is the message size S: the tensor of all_reduce, broadcast, reduce, all_to_all, send and recv;
  the gathered *output* of all_gather and gather; the full *input* of reduce_scatter and scatter;
- ``bus_bytes`` = S x ``bus_factor(name, n)``: what each rank sends on a ring (point-to-point) algorithm,
  the quantity whose rate is comparable across collectives and world sizes (the "bus bandwidth").

Only the outermost call counts (a collective built from another is counted once), and calls inside
``uncounted()`` are not recorded (a communicator that does its own accounting, lablib.p2p). DDP's gradient
all-reduces are issued by its C++ reducer, not through ``torch.distributed``'s Python functions; register
``count_ddp(model, log)`` (a communication hook, https://pytorch.org/docs/stable/ddp_comm_hooks.html) to
record them, or open ``count_ddp_models(log)`` around the code that builds the DDP model (e.g. Accelerate's
``prepare``).

torch's own ``CommDebugMode`` (torch.distributed.tensor.debug) was checked for this job on torch 2.13 and
gloo: it sees the c10d ops under the dispatcher (for one ``dist.all_reduce`` and an FSDP2 step of two
units: 1 ``allreduce_``, 4 ``_allgather_base_``, 2 ``_reduce_scatter_base_``, the same calls this layer
records), but it keeps counts per op only: no bytes, no group size, and names of the implementation, not of
the collective the course called. This layer adds those.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

# torch.distributed function -> the course's name for the collective.
COURSE_NAMES = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_gather": "all_gather", "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "all_to_all": "all_to_all", "all_to_all_single": "all_to_all",
    "broadcast": "broadcast", "reduce": "reduce", "scatter": "scatter", "gather": "gather",
    "send": "send", "isend": "send", "recv": "recv", "irecv": "recv", "batch_isend_irecv": "send_recv",
    "barrier": "barrier", "monitored_barrier": "barrier",
    "all_gather_object": "all_gather_object", "broadcast_object_list": "broadcast_object_list",
    "gather_object": "gather_object", "scatter_object_list": "scatter_object_list",
    "send_object_list": "send_object_list", "recv_object_list": "recv_object_list",
}


def bus_factor(name: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor: bytes each rank sends per byte of message, on a ring.

    all_reduce 2(n-1)/n (a reduce-scatter then an all-gather); all_gather, reduce_scatter, all_to_all,
    scatter and gather (n-1)/n; broadcast, reduce, send and recv 1; barrier and object collectives 0.
    """
    n = world_size
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"world_size must be a positive integer, got {n!r}")
    if name == "all_reduce":
        return 2 * (n - 1) / n
    if name in ("all_gather", "reduce_scatter", "all_to_all", "scatter", "gather"):
        return (n - 1) / n
    if name in ("broadcast", "reduce", "send", "recv", "send_recv"):
        return 1.0
    if name in COURSE_NAMES.values():
        return 0.0
    raise ValueError(f"unknown collective {name!r}; known: {sorted(set(COURSE_NAMES.values()))}")


@dataclass
class Call:
    """One recorded call: the course's ``name``, torch's ``function``, the message size ``bytes`` (S, see the
    module docstring), the ranks in its group, ``bus_bytes`` = S x bus_factor, the peer of a send/recv, and
    when it ran (``time.perf_counter`` seconds): ``launched_s`` when it was called, ``done_s`` when it
    returned or, for an asynchronous call (``async_op=True``, isend/irecv), when its work completed (None
    while pending, or when the backend's work has no future). ``phase`` is the log's ``phase`` at launch (a
    label the caller sets, e.g. "backward"), for timelines. ``ranks``: the global ranks of the call's group."""

    name: str
    bytes: int
    world_size: int
    bus_bytes: float
    function: str
    peer: int | None = None
    launched_s: float | None = None
    done_s: float | None = None
    asynchronous: bool = False
    phase: str | None = None
    ranks: tuple[int, ...] | None = None     # the group's global ranks (tells apart groups of equal size)


@dataclass
class CollectiveLog:
    """The calls recorded while a ``count_collectives`` block (or a ``count_ddp`` hook) was active.
    Set ``phase`` to label the calls launched from then on."""

    calls: list[Call] = field(default_factory=list)
    phase: str | None = None

    def record(self, name: str, n_bytes: int, world_size: int, function: str | None = None,
               peer: int | None = None, ranks: tuple[int, ...] | None = None) -> Call:
        call = Call(name, int(n_bytes), world_size, n_bytes * bus_factor(name, world_size), function or name, peer,
                    launched_s=time.perf_counter(), phase=self.phase, ranks=ranks)
        self.calls.append(call)
        return call

    def _select(self, name: str | None) -> list[Call]:
        return [c for c in self.calls if name is None or c.name == name]

    def count(self, name: str | None = None) -> int:
        """Calls of collective ``name`` (all calls when None)."""
        return len(self._select(name))

    def bytes(self, name: str | None = None) -> int:
        """Sum of the message sizes S of the calls of ``name`` (all calls when None)."""
        return sum(c.bytes for c in self._select(name))

    def bus_bytes(self, name: str | None = None) -> float:
        """Sum of S x bus_factor: bytes each rank sends on a ring, over the calls of ``name``."""
        return sum(c.bus_bytes for c in self._select(name))

    def counts(self) -> dict[str, int]:
        """Calls per collective name."""
        return dict(Counter(c.name for c in self.calls))

    def by_group(self, names: dict[tuple[int, ...], str] | None = None) -> dict[str, dict[str, dict]]:
        """{group: {collective: {"calls", "bytes"}}}: which process group each call ran in (a DeviceMesh's
        dimensions, HSDP's shard and replicate groups). A group is named ``names[its ranks]`` when given,
        else by its ranks ("ranks 0,1"). Bytes are message sizes S, as everywhere in this module."""
        out: dict[str, dict[str, dict]] = {}
        for c in self.calls:
            ranks = tuple(c.ranks) if c.ranks is not None else None
            group = (names or {}).get(ranks) or ("ranks " + ",".join(map(str, ranks)) if ranks else "?")
            row = out.setdefault(group, {}).setdefault(c.name, {"calls": 0, "bytes": 0})
            row["calls"] += 1
            row["bytes"] += c.bytes
        return out

    def reset(self) -> None:
        self.calls.clear()


# --- not counting twice ------------------------------------------------------------------------------------

_state = threading.local()


def _depth() -> int:
    return getattr(_state, "depth", 0)


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Calls inside are part of an outer one (or accounted for elsewhere): not recorded."""
    _state.depth = _depth() + 1
    try:
        yield
    finally:
        _state.depth -= 1


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _message(function: str, a: dict, world_size: int) -> int:
    """The message size S of one call from its bound arguments (nccl-tests' conventions)."""
    if function in ("all_gather_into_tensor", "all_gather_single"):
        return _nbytes(a.get("output_tensor"))
    if function == "all_gather":
        return _nbytes(a.get("tensor_list"))
    if function in ("reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single"):
        return _nbytes(a.get("input"))
    if function == "reduce_scatter":
        return _nbytes(a.get("input_list"))
    if function == "all_to_all":
        return _nbytes(a.get("input_tensor_list"))
    if function in ("scatter", "gather"):
        return _nbytes(a.get("tensor")) * world_size
    if function == "batch_isend_irecv":
        return sum(_nbytes(op.tensor) for op in a.get("p2p_op_list", ()))
    if function == "all_reduce_coalesced":
        return _nbytes(a.get("tensors"))
    return _nbytes(a.get("tensor"))


def _peer(function: str, a: dict) -> int | None:
    if function in ("send", "isend"):
        return a.get("dst") if a.get("dst") is not None else a.get("group_dst")
    if function in ("recv", "irecv"):
        return a.get("src") if a.get("src") is not None else a.get("group_src")
    return None


def _group_ranks(group) -> tuple[int, ...] | None:
    if not dist.is_initialized():
        return None
    try:
        return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    except (RuntimeError, ValueError):     # not a group this rank belongs to: the call itself will say so
        return None


def _mark_done(call: Call, result) -> None:
    """done_s now for a blocking call; when its work's future completes for an asynchronous one."""
    if not hasattr(result, "get_future"):
        call.done_s = time.perf_counter()
        return
    call.asynchronous = True
    try:
        result.get_future().add_done_callback(lambda _, c=call: setattr(c, "done_s", time.perf_counter()))
    except RuntimeError:             # a backend whose work has no future (done_s stays None)
        pass


@contextlib.contextmanager
def count_collectives(log: CollectiveLog | None = None) -> Iterator[CollectiveLog]:
    """Record every torch.distributed communication call made inside the block (in this process).

    Both ``torch.distributed.<name>`` and ``torch.distributed.distributed_c10d.<name>`` are wrapped, so
    ``dist.all_reduce(...)`` and library code are seen; a function bound by ``from torch.distributed import
    all_reduce`` before the block is not. The calls run unchanged. Blocks do not nest.
    """
    log = CollectiveLog() if log is None else log
    replaced = []
    for module in (dist, c10d):
        for function in COURSE_NAMES:
            original = getattr(module, function, None)
            if original is None or getattr(original, "_lablib_counting", False):
                continue
            signature = inspect.signature(original)

            def counting(*args, _function=function, _original=original, _signature=signature, **kwargs):
                try:
                    bound = _signature.bind_partial(*args, **kwargs).arguments
                except TypeError:          # a wrong call: torch's own error says what is wrong with it
                    bound = None
                call = None
                if _depth() == 0 and bound is not None:
                    group = bound.get("group")
                    world = dist.get_world_size(group) if dist.is_initialized() else 1
                    name = COURSE_NAMES[_function]
                    call = log.record(name, _message(_function, bound, world), world, _function,
                                      _peer(_function, bound), _group_ranks(group))
                with uncounted():
                    result = _original(*args, **kwargs)
                if call is not None:
                    _mark_done(call, result)
                return result

            counting._lablib_counting = True
            setattr(module, function, counting)
            replaced.append((module, function, original))
    try:
        yield log
    finally:
        for module, function, original in reversed(replaced):
            setattr(module, function, original)


# --- DDP: its reducer all-reduces in C++, so a communication hook records each bucket ------------------------

def count_ddp(ddp_model: torch.nn.parallel.DistributedDataParallel, log: CollectiveLog | None = None) -> CollectiveLog:
    """Register a hook on a DDP model that records its gradient all-reduces (one per bucket per sync) in log.

    The hook runs PyTorch's default ``allreduce_hook``: what is sent does not change.
    """
    log = CollectiveLog() if log is None else log

    def counting_allreduce(process_group, bucket):
        buffer = bucket.buffer()
        call = log.record("all_reduce", buffer.numel() * buffer.element_size(), dist.get_world_size(process_group),
                          "ddp_bucket", ranks=_group_ranks(process_group))
        call.asynchronous = True
        with uncounted():
            future = default_hooks.allreduce_hook(process_group, bucket)

        def done(f):                  # runs when the bucket's all-reduce is complete (gloo: on its thread)
            call.done_s = time.perf_counter()
            return f.value()

        return future.then(done)

    # The hook's state is the group DDP reduces over, so a DDP model on a sub-group keeps using it.
    ddp_model.register_comm_hook(state=ddp_model.process_group, hook=counting_allreduce)
    return log


@contextlib.contextmanager
def count_ddp_models(log: CollectiveLog | None = None) -> Iterator[CollectiveLog]:
    """``count_ddp`` on every DDP model constructed inside the block (also the one Accelerate's ``prepare``
    builds), all recording into one log."""
    log = CollectiveLog() if log is None else log
    DDP = torch.nn.parallel.DistributedDataParallel
    original = DDP.__init__

    def counting_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        count_ddp(self, log)

    DDP.__init__ = counting_init
    try:
        yield log
    finally:
        DDP.__init__ = original
