"""What a count records: the course's names of the collectives, their message sizes and bus factors, one
``Call`` per call and the ``CollectiveLog`` that holds them (``lablib.measure.counting`` records them; its
docstring says what is counted and how bytes are sized, following nccl-tests' conventions).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

# torch.distributed function -> the course's name for the collective.
COURSE_NAMES = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_gather": "all_gather", "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "all_to_all": "all_to_all", "all_to_all_single": "all_to_all",
    "broadcast": "broadcast", "reduce": "reduce", "scatter": "scatter", "gather": "gather",
    "send": "send", "isend": "send", "recv": "recv", "irecv": "recv", "batch_isend_irecv": "send_recv",
    "all_gather_coalesced": "all_gather", "_all_gather_base": "all_gather", "_reduce_scatter_base": "reduce_scatter",
    "barrier": "barrier", "monitored_barrier": "barrier",
    "all_gather_object": "all_gather_object", "broadcast_object_list": "broadcast_object_list",
    "gather_object": "gather_object", "scatter_object_list": "scatter_object_list",
    "send_object_list": "send_object_list", "recv_object_list": "recv_object_list",
}


def bus_factor(name: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor f (doc/PERFORMANCE.md): bytes per rank per byte of message S.

    From the least time on n links of bandwidth B: the bytes that must cross links, spread evenly over the n
    ranks (the average a rank sends; a ring sends exactly that from every rank), or where they cannot be spread,
    the bottleneck rank's (the root of a broadcast or a reduce). all_reduce 2(n-1)/n (a reduce-scatter then an
    all-gather); all_gather, reduce_scatter, all_to_all (n-1)/n, and scatter and gather (n-1)/n (the course's:
    the document lists none); broadcast, reduce, send and recv 1; barrier and object collectives 0. On one rank
    nothing leaves it: 0 for every collective.
    """
    n = world_size
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"world_size must be a positive integer, got {n!r}")
    if name in COURSE_NAMES.values() and n == 1:
        return 0.0
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
    when it ran (``time.perf_counter`` seconds): ``launched_s`` when it was called, ``done_s`` when its work
    completed: ``.wait()`` returned on it (a synchronous call's own wait, as it returns) or its future completed,
    whichever first; a functional collective's when its output was waited for (None while pending).
    ``asynchronous``: ``async_op=True``, isend/irecv, a functional collective. ``phase`` is the log's ``phase`` at
    launch (a label the caller sets, e.g. "backward"), for timelines. ``ranks``: the global ranks of the call's
    group."""

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

    @property
    def functional(self) -> bool:
        """A functional collective's op (torch.distributed._functional_collectives, DTensor's redistribution)."""
        return self.function.startswith(("_c10d_functional.", "_dtensor."))


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

_state = threading.local()     # per thread: depth of uncounted(), the composite call being issued


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
