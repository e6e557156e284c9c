"""The collectives a student's ZeRO class calls, recorded where it calls them, and their graded check.

On torchrun ranks the recorder is ``lablib.measure.counting`` (torch's c10d ops, however the call is spelled). It
names a call by the ``torch.distributed`` function the student called and sizes it by the algorithm's message
(nccl-tests' conventions): gloo runs ``reduce_scatter_tensor`` as an all-reduce inside
(torch/csrc/distributed/c10d/ProcessGroupGloo.hpp, its ``_reduce_scatter_base`` override), so counting what gloo
moves would charge a correct ZeRO-2 for an all-reduce; counting the call does not. On ranks that are threads
(``lablib.probes.rehearsal``) the rehearsal's own collectives are wrapped to record the same names and bytes, so
a wrong collective fails in the rehearsal already.

Only the student's calls are recorded (``recording`` is opened around them); the probe's own collectives (its
references, gathering the shards to check them) are not.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

from lablib import checks
from lablib.measure import counting
from lablib.measure.collective_log import COURSE_NAMES, CollectiveLog
from lablib.jobs.distenv import DistEnv
from lablib.measure.rankcheck import formula_rtol
from lablib.probes import rehearsal

_thread = threading.local()      # per rank-thread of a rehearsal: whether it is one, and the log being recorded


def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


def _message_bytes(name: str, args, kwargs, world_size: int) -> int:
    """The message size S of a rehearsed call (as lablib.measure.counting sizes it)."""
    first = args[0] if args else next(iter(kwargs.values()))
    if name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        return _tensor_bytes(args[1] if len(args) > 1 else kwargs["input"])       # the full input
    if name == "all_gather":
        return sum(_tensor_bytes(t) for t in first)                               # every rank's piece
    return _tensor_bytes(first)        # all_gather_into_tensor's output; broadcast's, all_reduce's tensor


def _check_memory(name: str, args, kwargs) -> None:
    """A tensor whose storage holds fewer bytes than it spans (a freed buffer, resized to 0 and not back) would be
    written out of bounds: in this process that kills the notebook's kernel. Say so instead."""
    for t in [*args, *kwargs.values()]:
        for x in (t if isinstance(t, (list, tuple)) else [t]):
            if isinstance(x, torch.Tensor) and x.numel():
                needed = (x.storage_offset() + x.numel()) * x.element_size()
                if x.untyped_storage().nbytes() < needed:
                    raise ValueError(f"dist.{name} got a tensor of {x.numel()} elements whose storage holds "
                                     f"{x.untyped_storage().nbytes()} bytes of the {needed} it spans (a freed "
                                     f"buffer?): resize the storage back before a collective writes into it")


def _recorded(name: str, fake, world_size: int):
    def call(*args, **kwargs):
        _check_memory(name, args, kwargs)
        log = getattr(_thread, "log", None)
        if log is not None:
            log.record(COURSE_NAMES[name], _message_bytes(name, args, kwargs, world_size), world_size, name)
        return fake(*args, **kwargs)
    return call


_RECORDED = ("broadcast", "all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor",
             "all_gather_single", "all_gather")


def run_in_thread_ranks(world_size: int, fn) -> list:
    """``rehearsal.run_in_thread_ranks`` with its collectives recorded inside ``recording`` blocks."""
    original = rehearsal._fake_functions

    def fakes(world):
        out = original(world)
        return {**out, **{name: _recorded(name, out[name], world.n) for name in _RECORDED}}

    def rank_fn(rank):
        _thread.rehearsal = True
        try:
            return fn(rank)
        finally:
            _thread.rehearsal = False

    rehearsal._fake_functions = fakes
    try:
        return rehearsal.run_in_thread_ranks(world_size, rank_fn)
    finally:
        rehearsal._fake_functions = original


def rehearse_with(probe, runs, check=None) -> list[dict]:
    """probe(case, env) on thread ranks for each "world size:case" of runs (see ``rehearse``). With ``check``, each
    run's result is checked as soon as it exists: a wrong answer fails at its first wrong case, not after all."""
    out = []
    for n, case in (r.split(":") for r in runs):
        n = int(n)
        try:
            per_rank = run_in_thread_ranks(n, lambda rank: probe(case, DistEnv(rank, rank, n, n, torch.device("cpu"),
                                                                                "gloo")))
        except rehearsal.RehearsalUnsupported as exc:
            print(f"(rehearsal skipped: {exc}; the real run checks everything)")
            return out
        if any("RehearsalUnsupported" in (r["error"] or "") for r in per_rank):
            print("(rehearsal skipped: a collective it does not emulate; the real run checks everything)")
            return out
        first = [r for r in per_rank if r["error"] and "RehearsalDeadlock" not in r["error"]]
        out.append(first[0] if first else per_rank[0])
        if check is not None:
            check(out[-1])
    return out


@contextlib.contextmanager
def recording(log: CollectiveLog) -> Iterator[CollectiveLog]:
    """Record into log the collectives called inside (the student's), on thread ranks or torchrun ranks."""
    if getattr(_thread, "rehearsal", False):
        _thread.log = log
        try:
            yield log
        finally:
            _thread.log = None
    else:
        with counting.count_collectives(log):
            yield log


def bytes_by_kind(log: CollectiveLog) -> dict[str, int]:
    """{collective: message bytes summed over its calls} (JSON-ready)."""
    out: dict[str, int] = {}
    for c in log.calls:
        out[c.name] = out.get(c.name, 0) + c.bytes
    return out


def check_collectives(where: str, per_step: list[dict], expected: dict[str, int], what: str, hint: str) -> None:
    """Every step's collectives, by kind, with exactly the expected message bytes (whole bytes: no tolerance)."""
    for step, got in enumerate(per_step):
        checks.check_equal(dict(sorted(got.items())), dict(sorted(expected.items())),
                           f"{where}: the collectives your class called in step {step}, by kind, with their message "
                           f"bytes summed (reduce-scatter: its full input; all-gather: its full output); {what}",
                           hint=hint)


def bus_ratio_to_ddp(expected: dict[str, int], n_params_bytes: int, world_size: int) -> float:
    """Bus bytes (what each rank sends on a ring) of the expected collectives over DDP's all-reduce of every
    gradient (2 (N-1)/N x its bytes)."""
    sent = sum(b * counting.bus_factor(k, world_size) for k, b in expected.items())
    return sent / (counting.bus_factor("all_reduce", world_size) * n_params_bytes)


def check_bus_ratio(where: str, per_step: list[dict], n_params_bytes: int, world_size: int, want: float,
                    what: str) -> None:
    """The paper's comparison with DDP, in bus bytes: a float64 sum of a few terms and a division, so within
    formula_rtol(8) of the ratio the formula gives."""
    if world_size < 2:
        return
    for got in per_step:
        checks.check_close(bus_ratio_to_ddp(got, n_params_bytes, world_size), want, rtol=formula_rtol(8), atol=0,
                           what=f"{where}: bytes each rank sends per step over DDP's ({what})")
