"""Wrong answers for lab 09 (see tests/wrong_answers/__init__.py).

Each is the solution's own cell with one mistake put in (``_changed`` checks that the text it replaces is
there, so a change to the solution cannot silently turn a wrong answer into the right one).
"""

from __future__ import annotations

from wrong_answers import SolutionCells

LAB = "09_pipeline_parallel"
_changed = SolutionCells(LAB).changed


# Exercise 2's wrong answers that pass the one-stage pre-check cost a torchrun start each (and a deadlock the
# run's 10 s send/recv timeout): one of them, the deadlock the issue asks for; the others fail in-process.
WRONG_ANSWERS = {
    "schedules": [
        ("1F1B with the warm-up count off by one (p - s forwards before the first backward)", _changed(
            "schedules", ("warmup = min(n_stages - rank - 1, n_microbatches)", "warmup = min(n_stages - rank, n_microbatches)"))),
        ("1F1B with the same warm-up on every stage (p - 1)", _changed(
            "schedules", ("warmup = min(n_stages - rank - 1, n_microbatches)", "warmup = min(n_stages - 1, n_microbatches)"))),
        ("GPipe that runs each micro-batch's backward right after its forward (no pipelining)", _changed(
            "schedules", ('one_rank = [("F", j) for j in range(n_microbatches)] + [("B", j) for j in range(n_microbatches)]',
                          'one_rank = [op for j in range(n_microbatches) for op in (("F", j), ("B", j))]'))),
        ("1F1B that forgets the warm-up is capped at m (m < p)", _changed(
            "schedules", ("warmup = min(n_stages - rank - 1, n_microbatches)", "warmup = n_stages - rank - 1"))),
        ("no error for zero micro-batches (returns empty schedules)", _changed(
            "schedules", ("    if n_stages < 1 or n_microbatches < 1:\n", "    if n_stages < 1:\n"))),
        ("returns lablib's reference simulation instead of building the schedule", '''
from lablib import pipeline as _pipeline


def gpipe_schedule(n_stages, n_microbatches):
    return _pipeline.schedule("gpipe", n_stages, n_microbatches)


def one_f_one_b_schedule(n_stages, n_microbatches):
    return _pipeline.schedule("1f1b", n_stages, n_microbatches)
'''),
    ],
    "pipeline_engine": [
        ("blocking dist.send: 1F1B's steady state deadlocks", _changed(
            "pipeline_engine", ("sends.append(dist.isend(outputs[j].detach(), dst=rank + 1))", "dist.send(outputs[j].detach(), dst=rank + 1)"),
            ("sends.append(dist.isend(x.grad, dst=rank - 1))", "dist.send(x.grad, dst=rank - 1)"))),
        ("each micro-batch's loss not divided by m: gradients m times too large", _changed(
            "pipeline_engine", ("outputs[j] = loss / n_microbatches", "outputs[j] = loss"))),
        ("ignores ops: always all forwards, then all backwards", _changed(
            "pipeline_engine", ("    for kind, j in ops:\n", "    for kind, j in sorted(ops, key=lambda op: op[0] == 'B'):\n"))),
    ],
    "bubble_formulas": [
        ("the bubble as (p-1)/m (over the busy time, not the step)", _changed(
            "bubble_formulas", ("return (n_stages - 1) / (n_microbatches + n_stages - 1)", "return (n_stages - 1) / n_microbatches"))),
        ("GPipe that frees activations before their backward (one micro-batch held)", _changed(
            "bubble_formulas", ("        return n_microbatches                       # every forward before any backward",
                                "        return 1"))),
        ("1F1B with the warm-up count off by one (p - s - 1 held)", _changed(
            "bubble_formulas", ("return min(n_stages - stage, n_microbatches)", "return min(n_stages - stage - 1, n_microbatches)"))),
        ("reads the bubble and the peak off lablib's simulation instead of a formula", '''
from lablib.pipeline import idle_fraction, peak_held, simulate


def bubble_fraction(n_stages, n_microbatches):
    return idle_fraction(simulate("gpipe", n_stages, n_microbatches))


def peak_in_flight(schedule, n_stages, n_microbatches, stage):
    return peak_held(simulate(schedule, n_stages, n_microbatches)[stage])
'''),
        ("1F1B holds p on every stage", _changed(
            "bubble_formulas", ("return min(n_stages - stage, n_microbatches)", "return min(n_stages, n_microbatches)"))),
    ],
    "microbatch_answer": [
        ("believes the bubble is (p-1)/m and 1F1B's memory grows with m", 'microbatch_answer = "a"'),
    ],
}

# A correct variant runs every test cell; this one builds 1F1B from the three phases' counts differently.
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
