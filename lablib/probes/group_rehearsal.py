"""Sub-groups and ``all_to_all_single`` on thread ranks: the rehearsal of labs 12 (Ulysses) and 13 (expert
parallelism), on top of ``lablib.probes.rehearsal``.

``lablib.probes.rehearsal`` runs ranks as threads and ignores the group argument (every thread is in it). Ulysses
and expert parallelism need two things more: ``all_to_all_single`` (equal pieces for lab 12, split sizes for lab
13) and collectives on sub-groups (lab 12: 4 thread ranks in two Ulysses groups of 2; lab 13: two expert-parallel
groups side by side, and a dp x ep mesh). ``ThreadGroup(ranks)`` stands for a group in a rehearsal, and
``fakes(world, local)`` (passed to ``run_in_thread_ranks(..., more_fakes=fakes)``) replaces ``get_rank``,
``get_world_size``, ``all_reduce`` and ``all_to_all_single`` by versions that honour it:

- every collective is still a rendezvous of *all* the threads (each calls it with its own group), so the ranks of
  different groups must call their collectives in the same order, as the exercises' code does (every rank runs the
  same case, reduces the same parameters in the same order); a thread whose group names ranks that called
  something else waits and then fails with ``RehearsalDeadlock``;
- a result is computed from the slots of the caller's group only, in the group's rank order;
- ``all_to_all_single`` without split sizes cuts both tensors into N equal pieces of their flat elements, as gloo
  does (2 torchrun ranks: an input of shape (3, 2) is exchanged, only the element counts must divide and agree);
  with split sizes it checks what gloo checks (the splits sum to the tensors' first dimension; rank s's
  input_split_sizes[r] equals rank r's output_split_sizes[s]) and raises the error a real run would (gloo:
  "Received data size doesn't match expected size") instead of a hang or a silent result;
- with ``async_op=True`` the result lands in the output tensor when the returned work's ``wait()`` (or
  ``is_completed()``) is called, not before: the latest a real backend may deliver it, so code that uses the tensor
  before waiting sees every time what a real run sees some of the time. NCCL enqueues an async collective on a
  separate CUDA stream (torch/distributed/distributed_c10d.py:5772-5777 in torch 2.13); on gloo (CPU, 2 ranks, one
  float tensor) dividing right after an async all_reduce gave 2.5 and 1.25 instead of 1.5 in 2 of 6 tries;
- ``fakes(world, local, log)`` also appends (name, bytes) to ``log[rank]`` for each call, named and sized as
  ``lablib.measure.counting`` does on real ranks (S = the tensor's bytes; for an all-to-all, the input's).

A group object of another kind (the real ``dist.group.WORLD``, None) means every thread.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from lablib.probes.rehearsal import RehearsalUnsupported, _local, _Pending, _reduce


class ThreadGroup:
    """A process group of the rehearsal: the threads (ranks) in it, in group-rank order."""

    def __init__(self, ranks):
        self.ranks = list(ranks)

    def rank(self) -> int:
        """This thread's rank in the group (-1 outside it), as ``ProcessGroup.rank()``."""
        return self.ranks.index(_local.rank) if _local.rank in self.ranks else -1

    def size(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"ThreadGroup({self.ranks})"


def _members(group, world) -> list[int]:
    return group.ranks if isinstance(group, ThreadGroup) else list(range(world.n))


def _splits(sizes, rows: int, n: int, what: str) -> list[int]:
    if sizes is None or len(sizes) == 0:
        if rows % n:
            raise ValueError(f"all_to_all_single: no {what} given and dim 0 ({rows}) does not divide by the group's "
                             f"{n} ranks")
        return [rows // n] * n
    sizes = [int(s) for s in sizes]
    if len(sizes) != n or sum(sizes) != rows:
        raise ValueError(f"all_to_all_single: {what}={sizes} must have one entry per rank of the group ({n}) "
                         f"and sum to the tensor's dim 0 ({rows})")
    return sizes


# The torch.distributed functions ``fakes`` replaces (a name bound to the real one before the rehearsal is not).
REHEARSED = ("get_rank", "get_world_size", "all_reduce", "all_to_all_single", "all_gather", "all_gather_into_tensor",
             "barrier")


@contextlib.contextmanager
def names_follow_fakes(module):
    """While it lasts, every name the student's module bound to one of torch.distributed's own REHEARSED functions
    (``from torch.distributed import all_to_all_single``) calls whatever ``torch.distributed`` holds under that name
    when called: the rehearsal's fake inside run_in_thread_ranks, the real function outside. So an answer in that import
    style is rehearsed like any other (its groups, world sizes and collectives checked), not waved through to a run on
    the world alone."""
    real = {getattr(dist, name): name for name in REHEARSED if hasattr(dist, name)}
    bound = {attr: real[value] for attr, value in vars(module).items() if callable(value) and value in real}

    def follower(name):
        def call(*args, **kwargs):
            return getattr(dist, name)(*args, **kwargs)
        return call

    for attr, name in bound.items():
        setattr(module, attr, follower(name))
    try:
        yield sorted(bound)
    finally:
        for attr, name in bound.items():
            setattr(module, attr, getattr(dist, name))


def fakes(world, local, log: list[list] | None = None) -> dict:
    def record(name: str, tensor: torch.Tensor) -> None:
        if log is not None:
            log[local.rank].append((name, tensor.numel() * tensor.element_size()))

    def get_rank(group=None):
        members = _members(group, world)
        return members.index(local.rank) if local.rank in members else -1

    def get_world_size(group=None):
        return len(_members(group, world))

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False, **_):
        members = _members(group, world)
        record("all_reduce", tensor)
        values = world.exchange("all_reduce", (tuple(members), tensor.detach().clone()))
        mine = [values[r] for r in members]
        if any(m[0] != tuple(members) for m in mine):
            raise RuntimeError(f"all_reduce: rank {local.rank} reduced over ranks {members}, but ranks of that group "
                               f"called it with other groups {[list(m[0]) for m in mine]} (on real ranks: a hang)")
        return _land(lambda: tensor.copy_(_reduce([m[1] for m in mine], op)), async_op, "all_reduce")

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False, **_):
        members = _members(group, world)
        n, me = len(members), members.index(local.rank)
        equal = all(sizes is None or len(sizes) == 0 for sizes in (input_split_sizes, output_split_sizes))
        if equal:        # N equal pieces of the flat elements, as gloo cuts them: one "row" per rank
            if input.numel() % n or output.numel() != input.numel():
                raise ValueError(f"all_to_all_single: input of {input.numel()} and output of {output.numel()} "
                                 f"elements; both must be equal and divisible by the group's {n} ranks")
            send, sent, expected = input.detach().reshape(n, -1), [1] * n, [1] * n
        else:
            send = input.detach()
            sent = _splits(input_split_sizes, input.shape[0], n, "input_split_sizes")
            expected = _splits(output_split_sizes, output.shape[0], n, "output_split_sizes")
        record("all_to_all", input)
        values = world.exchange("all_to_all_single", (tuple(members), sent, send.clone()))
        pieces = []
        for s, r in enumerate(members):
            their_group, their_sizes, their_input = values[r]
            if their_group != tuple(members):
                raise RuntimeError(f"all_to_all_single: rank {local.rank} and rank {r} called it on different groups")
            if their_sizes[me] != expected[s] or their_input.shape[1:] != send.shape[1:]:
                raise RuntimeError(f"all_to_all_single on rank {local.rank}: expected {expected[s]} rows from group "
                                   f"rank {s}, which sends {their_sizes[me]} (shape {tuple(their_input.shape)}); on "
                                   f"gloo: 'Received data size doesn't match expected size'. Exchange the counts "
                                   f"first and pass them as output_split_sizes")
            start = sum(their_sizes[:me])
            pieces.append(their_input[start:start + their_sizes[me]])
        received = torch.cat(pieces)
        return _land(lambda: output.copy_(received.view_as(output) if equal else received.to(output.dtype)), async_op,
                     "all_to_all_single")

    def barrier(group=None, async_op=False, **_):
        """Logged as ("barrier", 0), as lablib.measure.counting logs it on real ranks, so a check that counts the
        collectives sees the same calls in both."""
        if log is not None:
            log[local.rank].append(("barrier", 0))
        world.exchange("barrier", None)
        return _land(lambda: None, async_op, "barrier")

    def unsupported(name):
        def call(*args, **kwargs):
            raise RehearsalUnsupported(f"torch.distributed.{name} was called; the thread rehearsal stands in for "
                                       f"all_to_all_single, all_reduce and barrier only, and an exercise that asks for "
                                       f"an all-to-all (Ulysses' re-shard, the expert dispatch) uses "
                                       f"all_to_all_single and nothing else")
        return call

    return {"get_rank": get_rank, "get_world_size": get_world_size, "all_reduce": all_reduce,
            "all_to_all_single": all_to_all_single, "barrier": barrier, "all_gather": unsupported("all_gather"),
            "all_gather_into_tensor": unsupported("all_gather_into_tensor")}


def _land(write, async_op: bool, what: str = "a collective"):
    """Write a collective's result now (a blocking call), or when its work is waited on (``async_op=True``)."""
    def landed():
        with torch.no_grad():
            write()
    if not async_op:
        landed()
        return None
    return _Pending(what, landed)

