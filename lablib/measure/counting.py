"""Count the communication a step really issues, at the one place the course calls it.

Every lab counts collectives the same way, here:

    with counting.count_collectives() as log:        # every collective called inside is recorded
        train_step()
    log.count("all_gather"), log.bytes("reduce_scatter"), log.calls[0]   # Call(name, bytes, world_size, ...)

A ``Call`` is recorded when the course (or a library it uses: FSDP2, DTensor, Accelerate) calls a collective,
however it is spelled (``dist.all_reduce``, ``from torch.distributed import all_reduce``, a functional
collective, DTensor's redistribution: see "the layer" below), named by the ``torch.distributed`` function
called, with the bytes of the *algorithm* it asked for, not of what the backend moved: gloo implements
``reduce_scatter_tensor`` with an all-reduce (about twice the bytes NCCL moves), so its own traffic would
mislead. Sizes follow nccl-tests' conventions (github.com/NVIDIA/nccl-tests,
doc/PERFORMANCE.md):

- ``bytes`` is the message size S: the tensor of all_reduce, broadcast, reduce, all_to_all, send and recv;
  the gathered *output* of all_gather and gather; the full *input* of reduce_scatter and scatter;
- ``bus_bytes`` = S x ``bus_factor(name, n)``: what each rank sends on a ring (point-to-point) algorithm,
  the quantity whose rate is comparable across collectives and world sizes (the "bus bandwidth").

Only the outermost call counts (a collective built from another is counted once), and calls inside
``uncounted()`` are not recorded (a communicator that does its own accounting, lablib.measure.p2p). DDP's gradient
all-reduces are issued by its C++ reducer, not through ``torch.distributed``'s Python functions; register
``count_ddp(model, log)`` (a communication hook, https://pytorch.org/docs/stable/ddp_comm_hooks.html) to
record them, or open ``count_ddp_models(log)`` around the code that builds the DDP model (e.g. Accelerate's
``prepare``).

torch's own ``CommDebugMode`` (torch.distributed.tensor.debug) sees the same c10d ops on torch 2.13 and gloo
(for one ``dist.all_reduce`` and an FSDP2 step of two units: 1 ``allreduce_``, 4 ``_allgather_base_``,
2 ``_reduce_scatter_base_``), but it keeps counts per op only: no bytes, no group, no times, and names of the
implementation, not of the collective the course called. This layer adds those.

Three modules: this one (what a caller uses), ``lablib.measure.collective_log`` (what a count records) and
``lablib.measure.c10d_ops`` (the layer: torch's communication ops, and the source lines it rests on).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lablib.measure import c10d_ops
from lablib.measure.c10d_ops import _group_ranks
from lablib.measure.collective_log import (COURSE_NAMES, Call, CollectiveLog, bus_factor,  # noqa: F401 - interface
                                           uncounted)

@contextlib.contextmanager
def count_collectives(log: CollectiveLog | None = None) -> Iterator[CollectiveLog]:
    """Record every communication call made inside the block, in this process (all its threads).

    Seen however the collective was called: ``dist.all_reduce``, a name bound by ``from torch.distributed import
    all_reduce``, ``torch.distributed.distributed_c10d.all_reduce``, a ProcessGroup method, functional
    collectives, DTensor's redistribution; DDP's reducer is not (``count_ddp``). The calls run unchanged.
    Blocks may nest: a call is recorded in the log of every open block.
    """
    log = CollectiveLog() if log is None else log
    c10d_ops.open_log(log)
    try:
        yield log
    finally:
        c10d_ops.close_log(log)


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
