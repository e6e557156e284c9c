"""Lab 09's answer-equal references: GPipe's and 1F1B's order by their rule, and the closed forms of exercise 3.

Instructor-only: the hidden test cells import it (``from instructor.references import pipeline as pipeline_ref``);
students install ``lablib``, which only plays a *given* order (``lablib.parallel.pipeline.play``) and never makes one.

``schedule(kind, p, m)`` does not write the phases down (warm-up, steady state, cool-down, exercise 1's recipe):
it lets every rank decide, event by event, with the schedule's rule, so it checks the recipe instead of
repeating it (t_f = 1, t_b = 2, as the lab draws them):

- ``gpipe`` (Huang et al., 2019): a forward whenever one is ready; a backward only once this rank has run every
  forward;
- ``1f1b`` (PipeDream-Flush, Narayanan et al., 2021; Megatron-LM's non-interleaved schedule): a backward whenever
  one is ready; a forward only while this rank holds fewer than ``in_flight_limit`` micro-batches (p - s).

Forward j on stage s is ready once stage s-1 finished forward j; backward j once stage s+1 finished backward j
(the last stage: once its own forward j finished). Both come in micro-batch order, so a rank's next forward and
next backward are the only candidates. tests/test_lablib_pipeline_probes.py checks the rule's orders, played by
``lablib.parallel.pipeline.play``, against ``bubble_fraction`` and ``peak_in_flight``.
"""

from __future__ import annotations

import heapq

KINDS = ("gpipe", "1f1b")
T_FORWARD, T_BACKWARD = 1, 2          # whole numbers: the event times are exact


def _validate(kind: str, n_stages: int, n_microbatches: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} must be one of {KINDS}")
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError(f"n_stages={n_stages} and n_microbatches={n_microbatches} must both be at least 1")


def in_flight_limit(kind: str, n_stages: int, stage: int) -> int:
    """How many micro-batches a stage may hold (forward run, backward not yet) before it must run a backward."""
    return 10**9 if kind == "gpipe" else n_stages - stage


def schedule(kind: str, n_stages: int, n_microbatches: int) -> list[list[tuple[str, int]]]:
    """Every stage's ("F", j) / ("B", j) operations in the order the rule picks them (see the module docstring)."""
    _validate(kind, n_stages, n_microbatches)
    p, m, never = n_stages, n_microbatches, float("inf")
    forward_end = [[never] * m for _ in range(p)]     # [stage][micro-batch] -> when its forward ended
    backward_end = [[never] * m for _ in range(p)]
    next_f, next_b, free_at = [0] * p, [0] * p, [0] * p
    orders: list[list[tuple[str, int]]] = [[] for _ in range(p)]
    events, seen = [0], {0}                           # the times at which an operation ends (or the step begins)
    while events:
        now = heapq.heappop(events)
        for s in range(p):
            if free_at[s] > now:
                continue
            f, b = next_f[s], next_b[s]
            forward_ready = f < m and (s == 0 or forward_end[s - 1][f] <= now)
            backward_ready = b < f and forward_end[s][b] <= now and (s == p - 1 or backward_end[s + 1][b] <= now)
            if kind == "gpipe":
                choice = "F" if forward_ready else ("B" if backward_ready and f == m else None)
            else:
                choice = "B" if backward_ready else \
                    ("F" if forward_ready and f - b < in_flight_limit(kind, p, s) else None)
            if choice is None:
                continue
            end = now + (T_FORWARD if choice == "F" else T_BACKWARD)
            if choice == "F":
                forward_end[s][f], next_f[s] = end, f + 1
            else:
                backward_end[s][b], next_b[s] = end, b + 1
            orders[s].append((choice, f if choice == "F" else b))
            free_at[s] = end
            if end not in seen:
                seen.add(end)
                heapq.heappush(events, end)
    return orders


def bubble_fraction(n_stages: int, n_microbatches: int) -> float:
    """The idle share of a GPipe or 1F1B step: (p - 1) / (m + p - 1)."""
    return (n_stages - 1) / (n_microbatches + n_stages - 1)


def peak_in_flight(kind: str, n_stages: int, n_microbatches: int, stage: int) -> int:
    """The most micro-batches stage ``stage`` holds at once: GPipe m, 1F1B min(p - s, m)."""
    _validate(kind, n_stages, n_microbatches)
    return n_microbatches if kind == "gpipe" else min(n_stages - stage, n_microbatches)


# What a student's answer may not run while it is checked (lablib.labs.pipeline_parallel.probe.answer_without_module).
REFERENCES = (schedule, bubble_fraction, peak_in_flight, in_flight_limit)
