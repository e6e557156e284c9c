"""What a measured pipeline step cost, in the terms of ``lablib.parallel.pipeline.play``'s timing model.

A measured timeline (one list per rank of [kind, micro-batch, start, end], as ``probe`` records
it) gives, from the same run:

- per rank, the median forward and backward of one micro-batch (stages are not equal: the last one also
  computes the head and the loss);
- ``latency``: from the end of an operation on one rank to the start of the operation on the next rank that
  waited for it (the message, and the receiving rank waking up), the median over the operations that did wait;
- ``gap``: between two operations of one rank when nothing else held it back (the engine's own work between
  them: Python, a send posted, a receive's bookkeeping), the median.

``simulate(orders, costs)`` plays the schedule with those numbers: the bubble the timing model predicts for
this machine, to set beside the measured one and beside (p - 1)/(m + p - 1), which assumes free messages,
equal stages and no gap.
"""

from __future__ import annotations

from statistics import median

from lablib.parallel import pipeline


def stage_costs(events) -> dict:
    """{"t_forward": [per rank], "t_backward": [per rank], "latency": s, "gap": s} from one measured step."""
    p = len(events)
    ends = {(kind, r, j): end for r, rank_events in enumerate(events) for kind, j, _, end in rank_events}
    t_f, t_b, latency, gap = [], [], [], []
    for r, rank_events in enumerate(events):
        t_f.append(median([e - a for k, _, a, e in rank_events if k == "F"] or [0.0]))
        t_b.append(median([e - a for k, _, a, e in rank_events if k == "B"] or [0.0]))
        previous_end = None
        for kind, j, start, _ in sorted(rank_events, key=lambda e: e[2]):
            peer = r - 1 if kind == "F" else r + 1
            produced = ends.get((kind, peer, j)) if 0 <= peer < p else None
            if produced is not None and (previous_end is None or produced > previous_end):
                latency.append(start - produced)          # this operation waited for the message
            elif previous_end is not None:
                gap.append(start - previous_end)          # it waited only for its own rank
            previous_end = max(previous_end or start, ends[(kind, r, j)])
    return {"t_forward": t_f, "t_backward": t_b, "latency": max(0.0, median(latency or [0.0])),
            "gap": max(0.0, median(gap or [0.0]))}


def simulate(orders, costs: dict) -> list[list[pipeline.Op]]:
    """The per-rank op lists played with measured costs (``stage_costs``): the timing model's timeline."""
    return pipeline.play(orders, costs["t_forward"], costs["t_backward"], latency=costs["latency"],
                         gap=costs["gap"])
