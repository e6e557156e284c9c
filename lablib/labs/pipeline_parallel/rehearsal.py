"""Lab 09's engine rehearsed on threads: exercise 2's ``pipeline_step`` on p thread ranks, before the torchrun start.

``rehearse(engine, orders)`` runs one step of each case ({"1f1b:2:3": per-rank op lists}) with one thread per stage
of the course GPT: ``torch.distributed``'s ``send``, ``recv``, ``isend``, ``irecv``, ``P2POp`` and
``batch_isend_irecv`` are replaced for the moment by ``lablib.probes.ring_rehearsal``'s ``ThreadWorld`` (sends and
receives matched in posting order per pair of ranks, a blocking send returns once the peer's receive is posted, as
on gloo; a deadlock is seen at once and named: who waited on whom), ``get_rank`` and ``get_world_size`` by the
thread's rank (replaced as ``lablib.probes.rehearsal`` replaces them). Each result is what
``probe.summarize`` makes of the real ranks' records, so ``check_engine`` judges it the same way (the order
each stage ran, losses and gradients against one process). A wrong gradient, a wrong order or a deadlock shows here in a second instead of after a
4-rank start.

Like every rehearsal it is never a graded or measured result: the real run on processes follows it. An engine this
cannot rehearse (a ``torch.distributed`` name bound before it, ``from torch.distributed import isend``; a receive
from any source; a process that already has a process group) gets ``None`` and goes straight to the real run.
"""

from __future__ import annotations

import threading
import time
import traceback

import torch
import torch.distributed as dist

from lablib import checks
from lablib.course.models import GPT, GPTConfig
from lablib.parallel import pipeline
from lablib.labs.pipeline_parallel.probe import SMALL, _op_lists, batch, check_engine, check_orders, parse_case, summarize
from lablib.labs.pipeline_parallel.recorder import StageRecorder
from lablib.probes.rehearsal import RehearsalDeadlock, RehearsalUnsupported, _patched
from lablib.probes.ring_rehearsal import run_in_threads


_local = threading.local()    # this thread's ThreadComm: the rank it stands in for


class _P2POp:
    """Stands in for ``torch.distributed.P2POp`` (torch's checks that ``op`` is its own isend/irecv)."""

    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        self.op, self.tensor, self.peer = op, tensor, peer if peer is not None else group_peer


def _peer(peer, group_peer, verb: str) -> int:
    peer = peer if peer is not None else group_peer
    if peer is None:
        raise RehearsalUnsupported(f"torch.distributed.{verb} from any source is not rehearsed in threads")
    return peer


def _isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    return _local.comm.isend(tensor, _peer(dst, group_dst, "isend"))


def _irecv(tensor, src=None, group=None, tag=0, group_src=None):
    return _local.comm.irecv(tensor, _peer(src, group_src, "irecv"))


def _send(tensor, dst=None, group=None, tag=0, group_dst=None):
    _local.comm.send(tensor, _peer(dst, group_dst, "send"))


def _recv(tensor, src=None, group=None, tag=0, group_src=None):
    src = _peer(src, group_src, "recv")
    _local.comm.recv(tensor, src)
    return src


# torch.distributed's names, each thread's own rank behind them (a name not here reaches the real function, which
# finds no process group: rehearsal._patched makes that a RehearsalUnsupported, and the real run decides)
_FAKES = {"get_rank": lambda group=None: _local.comm.rank, "get_world_size": lambda group=None: _local.comm.world_size,
          "is_initialized": lambda: True, "isend": _isend, "irecv": _irecv, "send": _send, "recv": _recv,
          "P2POp": _P2POp, "batch_isend_irecv": lambda p2p_op_list: [op.op(op.tensor, op.peer) for op in p2p_op_list]}


def _one_case(engine, case: str, orders, config: GPTConfig, seed: int, micro_batch: int,
              timeout_s: float, dtype: torch.dtype = torch.float32) -> dict | None:
    kind, p, m = parse_case(case)
    inputs, targets = batch(config, m, micro_batch, seed)
    shape = (micro_batch, config.block_size, config.n_embd)
    torch.manual_seed(seed)
    stages = pipeline.gpt_stages(GPT(config).to(dtype), p)     # built here, once: every thread's stage from one model
    unsupported = []

    def rank_body(comm) -> dict:
        _local.comm, rank = comm, comm.rank
        ops = [tuple(op) for op in orders[rank]]
        recorder = StageRecorder(stages[rank], count_saved=False)
        record = {"rank": rank, "ops": ops, "error": None, "traceback": None, "losses": None, "p2p": [],
                  "saved_bytes": [], "peak_activation_bytes": None, "t0": time.perf_counter()}
        try:
            record["losses"] = [float(x) for x in engine.pipeline_step(stages[rank], list(ops), inputs, targets, shape)]
        except RehearsalUnsupported as exc:
            unsupported.append(exc)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded for the check, which fails with it
            record["error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()[-600:]
            record["traceback"] = traceback.format_exc()[-2000:]
            record["deadlock"] = str(exc) if isinstance(exc, RehearsalDeadlock) else None
        record["t_end"] = time.perf_counter()
        record["events"] = [[k, j, a - record["t0"], (b or a) - record["t0"]] for k, j, a, b in recorder.close()]
        record["grads"] = pipeline.stage_gradients(stages[rank])
        return record

    with _patched(_FAKES):
        records = run_in_threads(p, rank_body, timeout_s=timeout_s)
    if unsupported:
        return None
    result = summarize(case, records, config, inputs, targets, seed, dtype)
    result["rehearsal_deadlock"] = next((r["deadlock"] for r in records if r.get("deadlock")), None)
    return result


def rehearse(engine, orders_by_case: dict, config: GPTConfig = SMALL, seed: int = 0, micro_batch: int = 2,
             timeout_s: float = 20.0, dtype: torch.dtype = torch.float32) -> list[dict] | None:
    """Each case of {case: per-rank op lists (or "F0 F1 B0 ..." strings)} on p thread ranks (the GPT's parameters in
    ``dtype``); the results in the cases' order, or ``None`` when the engine uses something the threads cannot
    stand in for."""
    if dist.is_initialized():   # the real functions would find this group: rehearse only without one
        return None
    results = []
    for case, orders in orders_by_case.items():
        orders = _op_lists(orders)
        check_orders(case, orders)
        result = _one_case(engine, case, orders, config, seed, micro_batch, timeout_s, dtype)
        if result is None:
            return None
        results.append(result)
    return results


def check_rehearsal(results: list[dict] | None) -> None:
    """``check_engine`` on each rehearsed case, a deadlock named as such; nothing when the rehearsal stepped aside."""
    for result in results or []:
        what = f"{result['kind']} on {result['n_stages']} stages, {result['n_microbatches']} micro-batches" + \
            ("" if result.get("dtype", "float32") == "float32" else f", the GPT in {result['dtype']}")
        raised = {r: e for r, e in result["errors"].items() if "RehearsalDeadlock" not in e}
        if raised:   # a rank that raised leaves its peers waiting: its error is the finding, not their wait
            rank = min(raised)
            lines = result["tracebacks"][rank].splitlines()
            start = next((i for i, line in enumerate(lines) if "_impl.py" in line), 0)
            checks.check_true(False, f"{what}, rehearsed with threads as ranks: rank {rank} raised "
                                     f"{raised[rank].splitlines()[-1][:400]}",
                              hint=f"rank {rank}'s traceback:\n" + "\n".join(lines[start:]))
        if result["rehearsal_deadlock"]:
            checks.check_true(False, f"{what}, rehearsed with threads as ranks: the step deadlocks "
                                     f"({result['rehearsal_deadlock'].split('. A blocking')[0][:500]})",
                              hint="a blocking send returns only once the peer posted its recv: post sends with "
                                   "dist.isend (or dist.batch_isend_irecv) and wait for them at the end")
        check_engine(result)
