"""The layer ``lablib.measure.counting`` records at: torch's communication ops, under every way of calling them.

While a ``count_collectives`` block is open, a Python kernel at the dispatcher's BackendSelect key sees every
c10d and functional-collective op, names it by the outermost ``torch.distributed`` function on the stack,
sizes its message and records when its work completes. ``open_log`` / ``close_log`` install it with the first
open block and remove it with the last. The comment below gives the source lines this rests on.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from lablib.measure.collective_log import COURSE_NAMES, Call, CollectiveLog, _depth, _state, uncounted

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


def open_log(log: CollectiveLog) -> None:
    """Record into ``log`` from now on (the layer is installed with the first open log)."""
    with _lock:
        if not _open:
            _install()
        _open.append(log)


def close_log(log: CollectiveLog) -> None:
    """Stop recording into ``log`` (the layer is removed with the last open log)."""
    _state.composite = None
    with _lock:
        del _open[next(i for i, open_log in enumerate(_open) if open_log is log)]
        if not _open:
            _uninstall()
