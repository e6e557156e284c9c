"""Wrong answers for lab 09 (tests/labkit.py: the lab's answer files).

Most are the solution's own cell with one mistake put in (``_changed`` checks that the text it replaces is
there, so a change to the solution cannot silently turn a wrong answer into the right one). The others take
their answer from somewhere else: lablib (which no longer has a schedule to give), a table made when the cell
runs (of lablib's schedules, as the audit found; of the course's reference; of what the visible checks show),
or a copy of a reference's code object made before the check, which ``checks.answer_without`` would not see.
Each defines its functions whatever it finds, so the kernel's correct ones are replaced (an answer cell that
raised would leave them).
"""

from __future__ import annotations


from instructor.references import pipeline as _reference
from labkit import SolutionCells

# The red team's (a reviewer who had read only the released notebook): added to each list at the end.

LAB = "09_pipeline_parallel"
_changed = SolutionCells(LAB).changed

# What the visible checks of exercise 1 call (the worked example and three (p, m)), as a student could copy it.
_SHOWN = {(kind, p, m): _reference.schedule(kind, p, m) for kind in _reference.KINDS
          for p, m in ((2, 3), (2, 4), (4, 5), (4, 2))}


# Exercise 2's wrong answers fail before the torchrun start: at one stage in this process, or on threads as ranks
# (lablib.labs.pipeline_parallel.rehearsal; the deadlock the issue asks for is named there). Where the red team's answer
# makes the same mistake as one of the course's, the course's is dropped (the red team's is added at the end):
# 1F1B's warm-up p - s and p - s - 1 uncapped, no error below one micro-batch; the loss not divided by m, ops
# ignored; the bubble (p-1)/m, 1F1B's peak one short and p on every stage; answer (a).
WRONG_ANSWERS = {
    "schedules": [
        ("1F1B with the same warm-up on every stage (p - 1)", _changed(
            "schedules", ("warmup = min(n_stages - rank - 1, n_microbatches)", "warmup = min(n_stages - 1, n_microbatches)"))),
        ("GPipe that runs each micro-batch's backward right after its forward (no pipelining)", _changed(
            "schedules", ('one_rank = [("F", j) for j in range(n_microbatches)] + [("B", j) for j in range(n_microbatches)]',
                          'one_rank = [op for j in range(n_microbatches) for op in (("F", j), ("B", j))]'))),
        ("calls lablib's reference schedule (lablib has none now)", '''
from lablib.parallel import pipeline as _pipeline


def gpipe_schedule(n_stages, n_microbatches):
    return _pipeline.schedule("gpipe", n_stages, n_microbatches)


def one_f_one_b_schedule(n_stages, n_microbatches):
    return _pipeline.schedule("1f1b", n_stages, n_microbatches)
'''),
        ("tabulates lablib's schedules when the cell runs (the audit's exploit)", '''
from lablib.parallel import pipeline as _pipeline

_make = getattr(_pipeline, "schedule", None)
_TABLE = {} if _make is None else {(kind, p, m): _make(kind, p, m) for kind in ("gpipe", "1f1b")
                                   for p in range(1, 9) for m in range(1, 17)}


def gpipe_schedule(n_stages, n_microbatches):
    return _TABLE.get(("gpipe", n_stages, n_microbatches))


def one_f_one_b_schedule(n_stages, n_microbatches):
    return _TABLE.get(("1f1b", n_stages, n_microbatches))
'''),
        ("copies the code object of lablib's schedule when the cell runs (escapes checks.answer_without)", '''
import types
from lablib.parallel import pipeline as _pipeline

_original = getattr(_pipeline, "schedule", None) or getattr(_pipeline, "simulate", None)
_copy = None if _original is None else types.FunctionType(_original.__code__, _original.__globals__)


def gpipe_schedule(n_stages, n_microbatches):
    return _copy("gpipe", n_stages, n_microbatches)


def one_f_one_b_schedule(n_stages, n_microbatches):
    return _copy("1f1b", n_stages, n_microbatches)
'''),
        ("tabulates the course's reference when the cell runs (p <= 8, m <= 16: the grader's kernel has it)", '''
from instructor.references import pipeline as _ref

_TABLE = {(kind, p, m): _ref.schedule(kind, p, m)
          for kind in ("gpipe", "1f1b") for p in range(1, 9) for m in range(1, 17)}


def gpipe_schedule(n_stages, n_microbatches):
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError("at least one stage and one micro-batch")
    return _TABLE.get(("gpipe", n_stages, n_microbatches))


def one_f_one_b_schedule(n_stages, n_microbatches):
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError("at least one stage and one micro-batch")
    return _TABLE.get(("1f1b", n_stages, n_microbatches))
'''),
        ("copies the code object of the course's reference when the cell runs", '''
import types
from instructor.references import pipeline as _ref

_copy = types.FunctionType(_ref.schedule.__code__, _ref.schedule.__globals__)


def gpipe_schedule(n_stages, n_microbatches):
    return _copy("gpipe", n_stages, n_microbatches)


def one_f_one_b_schedule(n_stages, n_microbatches):
    return _copy("1f1b", n_stages, n_microbatches)
'''),
        ("hard-codes what the visible checks call, and all forwards then all backwards elsewhere", f'''
_SHOWN = {_SHOWN!r}


def _fallback(n_stages, n_microbatches):
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError("at least one stage and one micro-batch")
    return [[("F", j) for j in range(n_microbatches)] + [("B", j) for j in range(n_microbatches)]] * n_stages


def gpipe_schedule(n_stages, n_microbatches):
    return _fallback(n_stages, n_microbatches)


def one_f_one_b_schedule(n_stages, n_microbatches):
    return _SHOWN.get(("1f1b", n_stages, n_microbatches)) or _fallback(n_stages, n_microbatches)
'''),
        ("GPipe: one list object for every rank ([ops] * p): a caller that consumes one rank's list empties them all",
         _changed("schedules", ("    return [list(one_rank) for _ in range(n_stages)]\n", "    return [one_rank] * n_stages\n"))),
        ("1F1B memoised with functools.lru_cache: every call returns the same lists, emptied by the first caller",
         _changed("schedules", ("def one_f_one_b_schedule(n_stages, n_microbatches):\n",
                                "import functools\n\n\n@functools.lru_cache(maxsize=None)\n"
                                "def one_f_one_b_schedule(n_stages, n_microbatches):\n"))),
    ],
    "pipeline_engine": [
        ("blocking dist.send: 1F1B's steady state deadlocks", _changed(
            "pipeline_engine", ("sends.append(dist.isend(outputs[j].detach(), dst=rank + 1))", "dist.send(outputs[j].detach(), dst=rank + 1)"),
            ("sends.append(dist.isend(x.grad, dst=rank - 1))", "dist.send(x.grad, dst=rank - 1)"))),
        ("takes the micro-batches off the caller's lists (pop): the caller's batch is gone after the step", _changed(
            "pipeline_engine", ("                x = micro_inputs[j].to(device)\n", "                x = micro_inputs.pop(0).to(device)\n"),
            ("                loss = stage(x, micro_targets[j].to(device))\n",
             "                loss = stage(x, micro_targets.pop(0).to(device))\n"))),
    ],
    "bubble_formulas": [
        ("GPipe that frees activations before their backward (one micro-batch held)", _changed(
            "bubble_formulas", ("        return n_microbatches                       # every forward before any backward",
                                "        return 1"))),
        ("reads the bubble and the peak off lablib's simulation (lablib has none now)", '''
from lablib.parallel import pipeline as _pipeline

_simulate = getattr(_pipeline, "simulate", None)


def bubble_fraction(n_stages, n_microbatches):
    return _pipeline.idle_fraction(_simulate("gpipe", n_stages, n_microbatches))


def peak_in_flight(schedule, n_stages, n_microbatches, stage):
    return _pipeline.peak_held(_simulate(schedule, n_stages, n_microbatches)[stage])
'''),
        ("copies the code objects of the course's formulas when the cell runs", '''
import types
from instructor.references import pipeline as _ref

bubble_fraction = types.FunctionType(_ref.bubble_fraction.__code__, _ref.bubble_fraction.__globals__)
peak_in_flight = types.FunctionType(_ref.peak_in_flight.__code__, _ref.peak_in_flight.__globals__)
'''),
        # The red team's second round: the exercise asks for formulas of p and m, derived; the hidden checks run
        # them with lablib.parallel.pipeline refused (answer_without_module): a schedule played by lablib is none.
        ("the bubble and the peaks read off your own exercise-1 schedules, played by lablib.parallel.pipeline.play: "
         "no formula of p and m (once a correct variant here; the red team's second round kept full marks so)", '''
import functools
from lablib.parallel import pipeline as _pipeline


@functools.lru_cache(maxsize=8)
def _yours(kind, n_stages, n_microbatches):
    return (gpipe_schedule if kind == "gpipe" else one_f_one_b_schedule)(n_stages, n_microbatches)


def bubble_fraction(n_stages, n_microbatches):
    return _pipeline.idle_fraction(_pipeline.play(_yours("gpipe", n_stages, n_microbatches)))


def peak_in_flight(schedule, n_stages, n_microbatches, stage):
    return _pipeline.peak_held(_yours(schedule, n_stages, n_microbatches)[stage])
'''),
    ],
}

# A correct variant runs every test cell: 1F1B built from the three phases' counts differently. (Exercise 3 read off
# the student's own exercise-1 schedules played by lablib was one until the red team's second round: it is now a
# wrong answer, above: the exercise asks for formulas of p and m.)
CORRECT_VARIANTS = {
    "schedules": [
        ("1F1B built from the number of forwards in flight", '''
def gpipe_schedule(n_stages, n_microbatches):
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError("need at least one stage and one micro-batch")
    return [[("F", j) for j in range(n_microbatches)] + [("B", j) for j in range(n_microbatches)]
            for _ in range(n_stages)]

def one_f_one_b_schedule(n_stages, n_microbatches):
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError("need at least one stage and one micro-batch")
    out = []
    for s in range(n_stages):
        limit, f, b, ops = n_stages - s, 0, 0, []
        while b < n_microbatches:
            if f < n_microbatches and f - b < limit:
                ops.append(("F", f)); f += 1
            else:
                ops.append(("B", b)); b += 1
        out.append(ops)
    return out
'''),
    ],
}

# batch_isend_irecv, as torch's Schedule1F1B and Megatron-LM group the steady state's send and receive (the form a
# GPU engine needs on NCCL; gloo runs it too): pending sends go out in one batch with the next receive.
CORRECT_VARIANTS["pipeline_engine"] = [("sends batched with the next receive in dist.batch_isend_irecv", '''%%writefile engine_impl.py
"""Exercise 2 of lab 09: a pipeline engine (this file is written by the notebook)."""
import torch
import torch.distributed as dist


def pipeline_step(stage, ops, micro_inputs, micro_targets, activation_shape):
    """One training step of this rank's stage: run ops in order, activations forward and their gradients
    backward with send/recv. Returns the last rank's micro-batch losses ([] on the other ranks)."""
    rank, n_stages = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == n_stages - 1
    m = len(micro_inputs)
    inputs, outputs, losses = {}, {}, {}
    pending = []      # sends not yet fired: they go out batched with the next receive (Megatron, torch's 1F1B)
    sent = []

    def exchange(recv=None):
        """Fire the pending sends and this receive as one batch_isend_irecv; wait for the receive."""
        p2p = [dist.P2POp(dist.isend, t, peer) for t, peer in pending]
        if recv is not None:
            p2p.append(dist.P2POp(dist.irecv, *recv))
        if p2p:
            works = dist.batch_isend_irecv(p2p)
            sent.extend(works[:len(pending)])
            if recv is not None:
                works[-1].wait()
        pending.clear()

    for kind, j in ops:
        if kind == "F":
            if first:
                x = micro_inputs[j]
            else:
                x = torch.empty(activation_shape, dtype=next(stage.parameters()).dtype)
                exchange((x, rank - 1))
                x.requires_grad_()
            inputs[j] = x
            if last:
                loss = stage(x, micro_targets[j])
                losses[j] = loss.item()
                outputs[j] = loss / m
            else:
                outputs[j] = stage(x)
                pending.append((outputs[j].detach(), rank + 1))
        else:
            out = outputs.pop(j)
            if last:
                out.backward()
            else:
                grad = torch.empty_like(out)
                exchange((grad, rank + 1))
                out.backward(grad)
            x = inputs.pop(j)
            if not first:
                pending.append((x.grad, rank - 1))
    exchange()
    for w in sent:
        w.wait()
    return [losses[j] for j in range(m)] if last else []
''')]

