"""Lab 09's exercise 1 graded by what a schedule must do, with no reference order (``check_schedule``).

Every forward and backward once per stage, in micro-batch order, F j before B j, GPipe's forwards first,
1F1B's stage s holding at most min(p - s, m) micro-batches, and, played by ``lablib.parallel.pipeline.play``, no
deadlock and the step over in (m + p - 1)(t_f + t_b). (For p <= 4 and m <= 5 these leave exactly one 1F1B
order; the tests count them.) ``check_same_schedule`` compares two schedules stage by stage (the hidden tests,
against the course's reference), and ``answer_without_module`` keeps a student's function from calling that
reference while it is checked.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import sys
from collections import Counter

from lablib import checks
from lablib.parallel import pipeline

FUNCTIONS = {"gpipe": "gpipe_schedule", "1f1b": "one_f_one_b_schedule"}


def check_schedule(kind: str, orders, n_stages: int, n_microbatches: int, what: str = "") -> None:
    """The graded properties of a student's GPipe or 1F1B schedule for (p, m) (the module docstring); raises
    ``checks.CheckFailed`` at the first that fails, saying which stage and what came back."""
    p, m = n_stages, n_microbatches
    what = what or f"{FUNCTIONS[kind]}({p}, {m})"
    checks.check_true(isinstance(orders, (list, tuple)) and len(orders) == p,
                      f"{what}: one list of operations per stage, {p} in all; got {_short(orders)}")
    all_ops = sorted([("F", j) for j in range(m)] + [("B", j) for j in range(m)])
    for s, rank_ops in enumerate(orders):
        ops = _as_ops(rank_ops, f"{what}, stage {s}")
        extra = sorted(set(ops) - set(all_ops)) + [op for op, n in Counter(ops).items() if n > 1]
        missing = sorted(set(all_ops) - set(ops))
        checks.check_true(not extra and not missing, f"{what}, stage {s}: every ('F', j) and ('B', j) for j in "
                          f"0..{m - 1} exactly once; missing {pipeline.ops_text(missing) or 'none'}, not wanted or "
                          f"twice {pipeline.ops_text(sorted(set(extra))) or 'none'}  ({pipeline.ops_text(ops)})")
        for k, name in (("F", "forwards"), ("B", "backwards")):
            checks.check_equal([j for kind_, j in ops if kind_ == k], list(range(m)),
                               f"{what}, stage {s}: the {name}' micro-batches, in the order the stage runs them",
                               hint="micro-batches go through the pipeline in order, 0 first")
        at = {op: i for i, op in enumerate(ops)}
        early = [j for j in range(m) if at[("B", j)] < at[("F", j)]]
        checks.check_true(not early, f"{what}, stage {s}: the backward of micro-batch {early[0] if early else ''} before its "
                          f"forward ({pipeline.ops_text(ops)})", hint="the backward of j needs the activations "
                          "forward j saved")
        first_backward = min(at[("B", j)] for j in range(m))
        if kind == "gpipe":
            checks.check_true(first_backward == m, f"{what}, stage {s}: GPipe runs every forward before the first "
                              f"backward ({pipeline.ops_text(ops)})")
        else:   # 1F1B's steady state: from the first backward on, one forward and one backward in turn
            after = "".join(k for k, _ in ops[first_backward:])
            checks.check_true("FF" not in after, f"{what}, stage {s}: two forwards in a row after the first backward "
                              f"({pipeline.ops_text(ops)})", hint="1F1B: once a backward has run, one forward, one "
                              "backward, until the forwards run out")
    try:
        played = pipeline.play([_as_ops(o, what) for o in orders])
    except pipeline.Deadlock as exc:
        raise checks.CheckFailed(f"{what}: played in order (lablib.parallel.pipeline.play), the ranks wait for each other: "
                                 f"{'; '.join(exc.waits)}") from None
    end, best = max(op.end for rank_ops in played for op in rank_ops), (m + p - 1) * 3
    checks.check_true(end <= best + 1e-9, f"{what}: played in order with t_f = 1, t_b = 2 the step takes {end:g}, "
                      f"not (m + p - 1)(t_f + t_b) = {best}: a stage waits where it could compute",
                      hint="start each backward as early as its gradient can arrive")
    if kind == "1f1b":
        for s, rank_ops in enumerate(orders):
            checks.check_true(not _warmup_longer_than_needed(orders, s), f"{what}, stage {s}: runs more forwards "
                              f"before its first backward than the step needs (with one fewer, the first backward "
                              f"one place earlier, the step is as short), so it holds more activations than it must "
                              f"({pipeline.ops_text(_as_ops(rank_ops, what))})",
                              hint="1F1B: as few warm-up forwards as keep the step at (m + p - 1)(t_f + t_b)")


def _warmup_longer_than_needed(orders, stage: int) -> bool:
    """True when ``stage``'s first backward moved one place earlier (one warm-up forward fewer) still plays in
    (m + p - 1)(t_f + t_b): the rule behind 1F1B's memory is the fewest warm-up forwards that keep the step short."""
    lists = [_as_ops(o, "") for o in orders]
    ops = lists[stage]
    i = next(i for i, (k, _) in enumerate(ops) if k == "B")
    if i == 0 or ops[i - 1][0] != "F":
        return False
    lists[stage] = ops[:i - 1] + [ops[i], ops[i - 1]] + ops[i + 1:]
    p, m = len(lists), len(ops) // 2
    try:
        played = pipeline.play(lists)
    except pipeline.Deadlock:
        return False
    return max(op.end for rank_ops in played for op in rank_ops) <= (m + p - 1) * 3 + 1e-9


def check_same_schedule(got, expected, what: str, hint: str = "") -> None:
    """got equals expected stage by stage (both lists of ("F"/"B", j) per stage); a failure names the first stage
    and position that differ and shows a few operations around it, not the whole lists."""
    checks.check_true(isinstance(got, (list, tuple)) and len(got) == len(expected),
                      f"{what}: one list of operations per stage, {len(expected)} in all; got {_short(got)}")
    for s, (mine, theirs) in enumerate(zip(got, expected)):
        mine, theirs = _as_ops(mine, f"{what}, stage {s}"), [tuple(op) for op in theirs]
        if mine != theirs:
            i = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            lo = max(0, i - 4)
            checks.check_true(False, f"{what}, stage {s}: differs at operation {i} of {len(theirs)}\n"
                              f"  expected: ... {pipeline.ops_text(theirs[lo:i + 5])} ...\n"
                              f"  got:      ... {pipeline.ops_text(mine[lo:i + 5])} ...", hint)


def _as_ops(rank_ops, what: str) -> list[tuple[str, int]]:
    """A stage's operations as ("F"/"B", j) tuples, or a check failure that says what came back."""
    try:
        ops = [(op[0], op[1]) for op in rank_ops if len(op) == 2]
        if len(ops) == len(rank_ops) and all(k in ("F", "B") and isinstance(j, numbers.Integral)
                                             and not isinstance(j, bool) for k, j in ops):
            return [(str(k), int(j)) for k, j in ops]             # numpy's ints and strings are fine too
    except (TypeError, KeyError, IndexError):
        pass
    raise checks.CheckFailed(f"{what}: a list of ('F', j) / ('B', j) pairs, j an int; got {_short(rank_ops)}")


def _short(value, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + " ..."


@contextlib.contextmanager
def answer_without_module(*modules, reason: str):
    """Inside the block, any Python code compiled from one of ``modules``' files raises ``checks.CheckFailed(reason)``
    instead of running: a call of its functions, and a copy of one's code object made before the block, which
    ``checks.answer_without`` (it swaps the functions' code) does not see. The hidden checks call the students'
    functions in it, with the reference they are compared with as a module, and the reference outside. Several
    modules go in one block (a nested block would replace the outer one's trace function, not add to it)."""
    if not modules:
        raise ValueError("answer_without_module: name at least one module")
    paths = {path for module in modules for path in (module.__file__, os.path.realpath(module.__file__))}
    previous = sys.gettrace()

    def refuse(frame, event, arg):   # called at every Python call inside the block: kept to a set lookup
        if frame.f_code.co_filename in paths:
            raise checks.CheckFailed(reason)
        return None

    sys.settrace(refuse)
    try:
        yield
    finally:
        sys.settrace(previous)
