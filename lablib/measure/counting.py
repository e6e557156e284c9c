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
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
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
    "all_gather_coalesced": "all_gather", "_all_gather_base": "all_gather", "_reduce_scatter_base": "reduce_scatter",
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


# --- the layer: torch's communication ops, under every way of calling them ------------------------------------
#
# Every torch.distributed function ends in a ProcessGroup method (distributed_c10d.py:3245, all_reduce:
# ``work = group.allreduce([tensor], opts)``), and every ProcessGroup method calls a dispatcher op
# (include/torch/csrc/distributed/c10d/ProcessGroup.hpp:241-262, ProcessGroup::allreduce -> c10d::allreduce_; the
# others at 208-883). Functional collectives call their own ops (_functional_collectives.py:179, all_reduce ->
# _c10d_functional.all_reduce), and DTensor's redistribution calls functional collectives
# (tensor/placement_types.py:509, 609, 1534; tensor/_collective_utils.py:102, _dtensor.shard_dim_alltoall). So the
# dispatcher sees a collective however the caller spelled it: dist.all_reduce, ``from torch.distributed import
# all_reduce`` (the same function object, bound before any block), torch.distributed.distributed_c10d.all_reduce,
# a ProcessGroup method, funcol, DTensor. A backend's own algorithm runs below the op (gloo's reduce-scatter is
# its ``_reduce_scatter_base`` override, ProcessGroupGloo.hpp:353), so the op is what the caller called.
#
# The ops are intercepted by a Python kernel at the BackendSelect key (above the CPU and CUDA kernels, below
# autograd and Python modes), registered while a block is open: it runs for these ops only, in every thread.
# torch's CommDebugMode (tensor/debug/_comm_mode.py:642) sees the same ops from a TorchDispatchMode, which runs
# Python for every aten op of the block (measured: ~8 us per op, 10% of a small GPT step timed inside a block).
# The name is the outermost torch.distributed function on the Python stack (all_gather_object, not the two
# all_gathers it issues); an op with none is named by the op. A c10d op that no torch.distributed function and
# no code outside torch called is torch's C++ at work (DDP's reducer from autograd's engine, its constructor's
# checks): it is left to count_ddp, as before. A call made with no process group reaches no op: it is recorded
# where it fails, in c10d._get_default_group (distributed_c10d.py:1420, reached by every function then).

_BELOW = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OBJECTS = {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
            "send_object_list", "recv_object_list"}        # pickled objects: no message size (bus factor 0)
_COMPOSITE = _OBJECTS | {"batch_isend_irecv"}             # functions that issue several ops: one call
_ASYNC = {"isend", "irecv", "batch_isend_irecv"}
_FUNCTIONS = {inspect.unwrap(f).__code__: name for name in COURSE_NAMES
              if callable(f := getattr(c10d, name, None))}   # code object -> torch.distributed function

# op -> (course name, the argument whose bytes are the message S, times what); S as in the module docstring.
OPS = {"c10d::" + op: spec for op, spec in {
    "allreduce_": ("all_reduce", "tensors"), "allreduce_coalesced_": ("all_reduce", "tensors"),
    "broadcast_": ("broadcast", "tensors"), "reduce_": ("reduce", "tensors"),
    "allgather_": ("all_gather", "output_tensors"), "_allgather_base_": ("all_gather", "output_tensor"),
    "allgather_coalesced_": ("all_gather", "output_lists"),
    "allgather_into_tensor_coalesced_": ("all_gather", "outputs"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors"), "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "alltoall_": ("all_to_all", "input_tensors"), "alltoall_base_": ("all_to_all", "input"),
    "gather_": ("gather", "input_tensors", "world"), "scatter_": ("scatter", "output_tensors", "world"),
    "send": ("send", "tensors"), "recv_": ("recv", "tensors"), "recv_any_source_": ("recv", "tensors"),
    "barrier": ("barrier", None), "monitored_barrier_": ("barrier", None)}.items()} | {
    "_c10d_functional::" + op: spec for op, spec in {
    "all_reduce": ("all_reduce", "input"), "all_reduce_": ("all_reduce", "input"),
    "all_reduce_coalesced": ("all_reduce", "inputs"), "all_reduce_coalesced_": ("all_reduce", "inputs"),
    "all_gather_into_tensor": ("all_gather", "input", "group_size"),
    "all_gather_into_tensor_out": ("all_gather", "input", "group_size"),
    "all_gather_into_tensor_coalesced": ("all_gather", "inputs", "group_size"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"), "reduce_scatter_tensor_out": ("reduce_scatter", "input"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs"),
    "all_to_all_single": ("all_to_all", "input"), "broadcast": ("broadcast", "input"),
    "broadcast_": ("broadcast", "input"), "isend": ("send", "tensor"), "irecv": ("recv", "tensor"),
    "batch_p2p_ops": ("send_recv", "tensors")}.items()} | {
    "_dtensor::shard_dim_alltoall": ("all_to_all", "input")}

_lock = threading.Lock()
_open: list[CollectiveLog] = []      # the logs of the open blocks (every thread's calls go to all of them)
_libraries: list = []                # the kernels' registrations, while a block is open
_awaited: dict[int, list[Call]] = {}  # a functional collective's output (TensorImpl address) -> its calls
_waiting: dict[int, tuple] = {}      # id(Work) -> (the Work, its calls, whether it has a future)
_pending: dict[int, int] = {}        # id(call) -> its works not yet done
_get_default_group, _work_wait = c10d._get_default_group, c10d.Work.wait


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _message(function: str, a: dict, world_size: int) -> int:
    """The message size S of a torch.distributed function's call, from its arguments (nccl-tests' conventions)."""
    if function in ("all_gather_into_tensor", "all_gather_single", "_all_gather_base"):
        return _nbytes(a.get("output_tensor"))
    if function in ("all_gather", "all_gather_coalesced"):
        return _nbytes(a.get("tensor_list", a.get("output_tensor_lists")))
    if function in ("reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base", "all_to_all_single"):
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
    return 0 if function in _OBJECTS else _nbytes(a.get("tensor"))


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
    except (RuntimeError, ValueError, KeyError):   # not a group this rank belongs to: the call itself will say so
        return None


def _process_group(a: dict):
    """The op's group: a ProcessGroup (c10d ops), or its name (functional collectives)."""
    group = a.get("process_group", a.get("group_name"))
    if isinstance(group, str):
        return c10d._resolve_process_group(group)
    return dist.ProcessGroup.unbox(group) if isinstance(group, torch.ScriptObject) else group


def _outermost_function(frame):
    """The outermost frame on the stack running a torch.distributed function: what the caller called."""
    outer = None
    while frame is not None:
        if frame.f_code in _FUNCTIONS:
            outer = frame
        frame = frame.f_back
    return outer


def _record(name: str, n_bytes: int, group, function: str, peer, asynchronous: bool) -> list[Call]:
    """One call in the log of every open block (a log open twice records it once)."""
    world = group.size() if group is not None else 1
    calls = [log.record(name, n_bytes, world, function, peer, _group_ranks(group))
             for log in {id(log): log for log in list(_open)}.values()]
    for call in calls:
        call.asynchronous = asynchronous
    return calls


def _record_function(outer, group) -> list[Call]:
    """The calls of the torch.distributed function running in frame outer, recorded at its first op (one that
    issues several, all_gather_object or batch_isend_irecv, is one call), its bytes from its arguments."""
    function = _FUNCTIONS[outer.f_code]
    composite = getattr(_state, "composite", None)
    if composite is not None and composite[0] is outer:
        return composite[1]
    a = outer.f_locals
    world = group.size() if group is not None else 1
    calls = _record(COURSE_NAMES[function], _message(function, a, world), group, function, _peer(function, a),
                    function in _ASYNC or bool(a.get("async_op")))
    _state.composite = (outer, calls) if function in _COMPOSITE else None     # (held until the thread's next op)
    return calls


def _record_op(qualname: str, a: dict, frame) -> list[Call]:
    """The calls an op belongs to: a torch.distributed function's, else the op's own."""
    outer = _outermost_function(frame)
    group = _process_group(a)
    if outer is not None:
        return _record_function(outer, group)
    if qualname.startswith("c10d::") and (frame is None or frame.f_code.co_filename.startswith(_TORCH_DIR)):
        return []                                # torch's C++ called it (DDP's reducer): count_ddp's
    name, argument, *times = OPS[qualname]       # a functional collective, DTensor, a ProcessGroup method
    n_bytes = _nbytes(a.get(argument))
    if times:                                    # per-rank tensors of gather/scatter, funcol's all-gather input
        n_bytes *= group.size() if times[0] == "world" else a[times[0]]
    return _record(name, n_bytes, group, qualname.replace("::", "."), a.get("dst", a.get("src")), True)


# --- when a call is done -----------------------------------------------------------------------------------------
# A c10d op returns its Work: the call is done when that work is waited for (.wait() returns: the torch.distributed
# function's own wait for a synchronous call, the caller's for an asynchronous one) or its future completes,
# whichever is first (gloo's send and recv have no future). A functional collective is done when its output is
# waited for (wait_tensor). A work is waited for once: gloo's send would wait for a second send otherwise.

def _work_done(key: int) -> None:
    now = time.perf_counter()
    with _lock:
        _, calls, _ = _waiting.pop(key, (None, (), None))
        for call in calls:               # a call of several works (batch_isend_irecv) is done with its last
            left = _pending.pop(id(call), 1) - 1
            if left:
                _pending[id(call)] = left
            else:
                call.done_s = now


def _mark_done(calls: list[Call], result) -> None:
    if isinstance(result, (torch.Tensor, list)):          # a functional collective's output(s)
        for tensor in result if isinstance(result, list) else [result]:
            _awaited[tensor._cdata] = calls
        return
    found = [r for r in (result if isinstance(result, tuple) else [result]) if isinstance(r, torch.ScriptObject)]
    if not found:                                          # monitored_barrier: done when it returns
        for call in calls:
            call.done_s = time.perf_counter()
        return
    work = c10d.Work.unbox(found[0])     # the Work the caller gets (held here, the same object)
    try:
        future = work.get_future()
    except RuntimeError:
        future = None
    with _lock:
        _waiting[id(work)] = (work, calls, future is not None)
        for call in calls:
            _pending[id(call)] = _pending.get(id(call), 0) + 1
    if future is not None:
        future.add_done_callback(lambda _, key=id(work): _work_done(key))


def _waited(work, *args, **kwargs):
    """Work.wait while a block is open."""
    result = _work_wait(work, *args, **kwargs)
    if _waiting:
        _work_done(id(work))
    return result


def _awaited_tensor(op):
    def wait_tensor(keyset, tensor):
        result = op.redispatch(keyset & _BELOW, tensor)
        for call in _awaited.pop(tensor._cdata, ()):
            call.done_s = time.perf_counter()
        return result
    return wait_tensor


# --- installing the layer while a block is open ------------------------------------------------------------------

def _no_default_group():
    """c10d._get_default_group while a block is open. Every torch.distributed function called with no process
    group fails there, before any op (lab 02's rehearsal runs ranks as threads, and reports such calls)."""
    if not dist.is_initialized() and not _depth() and _open:
        outer = _outermost_function(sys._getframe(1))
        if outer is not None:
            _record_function(outer, None)
    return _get_default_group()


def _kernel(qualname: str, op):
    names = [argument.name for argument in op._schema.arguments]

    def counting(keyset, *args, **kwargs):
        if _depth() or not _open:
            return op.redispatch(keyset & _BELOW, *args, **kwargs)
        calls = _record_op(qualname, dict(zip(names, args)) | kwargs, sys._getframe(1))
        with uncounted():                   # a collective built from another is counted once
            result = op.redispatch(keyset & _BELOW, *args, **kwargs)
        if calls:
            _mark_done(calls, result)
        return result
    return counting


def _install() -> None:
    libraries = {}
    for qualname in (*OPS, "_c10d_functional::wait_tensor"):
        namespace, name = qualname.split("::")
        try:
            op = getattr(getattr(torch.ops, namespace), name).default
        except (AttributeError, RuntimeError):     # an op this torch does not have
            continue
        if namespace not in libraries:
            libraries[namespace] = torch.library.Library(namespace, "IMPL")
        kernel = _awaited_tensor(op) if name == "wait_tensor" else _kernel(qualname, op)
        libraries[namespace].impl(name, kernel, "BackendSelect", with_keyset=True)
    _libraries.extend(libraries.values())
    c10d._get_default_group, c10d.Work.wait = _no_default_group, _waited


def _uninstall() -> None:
    c10d._get_default_group, c10d.Work.wait = _get_default_group, _work_wait
    while _libraries:
        _libraries.pop()._destroy()
    _awaited.clear()
    for key in [key for key, (_, _, has_future) in _waiting.items() if not has_future]:
        for call in _waiting.pop(key)[1]:          # never waited for in the block: done_s stays None
            _pending.pop(id(call), None)


@contextlib.contextmanager
def count_collectives(log: CollectiveLog | None = None) -> Iterator[CollectiveLog]:
    """Record every communication call made inside the block, in this process (all its threads).

    Seen however the collective was called: ``dist.all_reduce``, a name bound by ``from torch.distributed import
    all_reduce``, ``torch.distributed.distributed_c10d.all_reduce``, a ProcessGroup method, functional
    collectives, DTensor's redistribution; DDP's reducer is not (``count_ddp``). The calls run unchanged.
    Blocks may nest: a call is recorded in the log of every open block.
    """
    log = CollectiveLog() if log is None else log
    with _lock:
        if not _open:
            _install()
        _open.append(log)
    try:
        yield log
    finally:
        _state.composite = None
        with _lock:
            del _open[next(i for i, open_log in enumerate(_open) if open_log is log)]
            if not _open:
                _uninstall()


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
