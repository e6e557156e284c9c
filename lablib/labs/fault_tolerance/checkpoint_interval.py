"""How often to checkpoint, simulated (lab 10): failures drawn at random against a checkpoint interval.

A Monte Carlo reference for the Young/Daly formulas the students write (numbers only, no process group): it
plays the job itself, so it holds for any interval, where the first-order formula holds only for tau << M.
"""

from __future__ import annotations

import random


def simulate_waste(interval_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0,
                   work_s: float = 3e6, seed: int = 0) -> float:
    """The seconds wasted per second of new work (wall / work - 1), for a job of work_s seconds of work that writes a
    checkpoint (checkpoint_s, blocking) after every interval_s of work and fails at exponentially distributed
    times (mean mtbf_s); after a failure it restarts (restart_s) from its last checkpoint. A failure can strike
    during a checkpoint (that checkpoint is lost too), not during a restart. A Monte Carlo reference for the
    Young/Daly formula (numbers only)."""
    rng = random.Random(seed)
    done, wall = 0.0, 0.0
    next_failure = rng.expovariate(1.0 / mtbf_s)
    while done < work_s:
        segment = min(interval_s, work_s - done) + checkpoint_s
        if wall + segment <= next_failure:          # the segment and its checkpoint are done
            wall += segment
            done += segment - checkpoint_s
            continue
        wall = next_failure + restart_s          # the segment's work is lost; restart from the last checkpoint
        next_failure = wall + rng.expovariate(1.0 / mtbf_s)
    return wall / work_s - 1.0
