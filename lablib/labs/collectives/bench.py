"""Lab 00's timings on gloo: each collective's time per call over message sizes (section 2), and what
TORCH_DISTRIBUTED_DEBUG=DETAIL adds to a small all-reduce (section 4). Both run inside the torchrun step
``collectives`` (``run``), on ranks 0..bench_ranks-1 while the other ranks wait in a barrier, so nothing else of
the lab runs beside them.

One rule for every window, derived from a measurement of the same run: the ranks leave a barrier some time apart
(``exit_skew``, on the machine's one wall clock), and the slowest rank's window starts that much before the first
call can: a window of one small call would time the skew. So a window times ``calls`` calls in a row, the fewest
(doubling from 1, in the warm-up: ``calls_for``) whose window lasts at least the median skew / SKEW_SHARE for every
arm, and the figure is the window / calls. The arms take turns in every round, in an order that rotates by one
place each round and runs backwards in odd rounds; the same code timed again (another arm, at another place of
the round) is the noise floor (``lablib.measure.timing.noise_verdict``).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from lablib.jobs import script
from lablib.measure import counting, timing

CPU = torch.device("cpu")
TIMED = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce")
# The sweep's arms: the collectives, and the all-reduce once more (the noise floor: the same code, timed again).
# In this cycle the floor stands two places from the all-reduce, as far as the reduce-scatter does, so as the
# order rotates, the floor's pair and the reduce-scatter/all-reduce pair lie as far apart in time.
FLOOR = "all_reduce_again"
ARMS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", FLOOR, "reduce")
# The skew at most a tenth of a window: the slowest rank's window then overstates its calls by at most 10 %, under
# the smallest time ratio the lab reads (reduce-scatter to all-gather, about 1.1 and more in the runs quoted).
SKEW_SHARE = 0.1
SKEW_ROUNDS = 9
MAX_CALLS = 4096
# What DETAIL costs: a plain group, a second plain group (the noise floor) and a group made under DETAIL.
DETAIL_ARMS = ("plain", "plain again", "DETAIL")
DETAIL_NUMEL = 4


def exit_skew(group, rounds: int = SKEW_ROUNDS) -> list[float]:
    """Seconds from the first to the last rank of group leaving a barrier, for each of rounds barriers (every rank
    reads the machine's one wall clock, time.time(), on leaving; one all-reduce gathers them)."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    left = torch.zeros(rounds, n, dtype=torch.float64)
    for k in range(rounds):
        dist.barrier(group=group)
        left[k, me] = time.time()
    dist.all_reduce(left, group=group)                 # every other rank's entries are zeros: the sum fills them in
    return (left.max(dim=1).values - left.min(dim=1).values).tolist()


def timed_call(name: str, x: torch.Tensor, out: dict, n: int, group) -> None:
    if name in ("all_reduce", FLOOR):
        dist.all_reduce(x, group=group)
    elif name == "all_gather":                        # S = the gathered output, n x the input
        dist.all_gather_single(out["all_gather"], x[: x.numel() // n], group=group)
    elif name == "reduce_scatter":                    # S = the full input
        dist.reduce_scatter_single(out["reduce_scatter"], x, group=group)
    elif name == "all_to_all":
        dist.all_to_all_single(out["all_to_all"], x, group=group)
    elif name == "broadcast":
        dist.broadcast(x, src=0, group=group)
    elif name == "reduce":
        dist.reduce(x, dst=0, group=group)
    else:
        raise ValueError(f"unknown collective {name!r}: choose one of {ARMS}")


def window(call, calls: int, group, times: list[float]) -> None:
    """One timed window: a barrier of group, then call() `calls` times in a row; appends this rank's seconds."""
    timing.barrier(CPU, group=group)
    with timing.stopwatch(times, CPU):
        for _ in range(calls):
            call()


def calls_for(target_s: float, arms: dict, group) -> int:
    """The fewest calls, doubling from 1, whose window lasts target_s on the slowest rank for every arm of
    arms ({name: call}); the same number on every rank (each window's time is the slowest rank's). Warms up."""
    calls = 1
    for call in arms.values():
        while calls < MAX_CALLS:
            times = []
            window(call, calls, group, times)
            if timing.slowest_rank(times, CPU, group=group)[0] >= target_s:
                break
            calls *= 2
    return calls


def rounds(arms: dict, calls: int, repeats: int, group) -> dict:
    """{name: [seconds per call, slowest rank, per round]}: the arms take turns, the order rotating by one place
    every round and running backwards in odd rounds."""
    names = list(arms)
    times = {name: [] for name in names}
    for rep in range(repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order if rep % 2 == 0 else order[::-1]:
            window(arms[name], calls, group, times[name])
    return {name: timing.slowest_rank([t / calls for t in times[name]], CPU, group=group) for name in names}


def sweep(env, n_bytes_list, n: int, repeats: int) -> dict | None:
    """Section 2: each collective's time per call on ranks 0..n-1 for each message size (rank 0 returns it)."""
    group = dist.new_group(list(range(n)), backend="gloo")
    result = {name: {"median_s": [], "step_s": [], "bus_bytes": [], "bytes": []} for name in ARMS}
    skew, calls_per_size = [], []
    if env.rank < n:
        skew = exit_skew(group)
        target_s = timing.median(skew) / SKEW_SHARE
        for k, n_bytes in enumerate(n_bytes_list):
            numel = n_bytes // 4 // n * n              # divisible by n: reduce_scatter and all_to_all split it
            # zeros: repeated in place, an all-reduce of other values would double them every call until they
            # overflow; gloo's sum costs the same for any (normal) float
            x = torch.zeros(numel)
            out = {"all_gather": torch.empty(numel), "reduce_scatter": torch.empty(numel // n),
                   "all_to_all": torch.empty(numel)}
            arms = {name: (lambda name=name: timed_call(name, x, out, n, group)) for name in ARMS}
            for name in ARMS:                          # what the course counts for one call
                with counting.count_collectives() as log:
                    arms[name]()
                result[name]["bus_bytes"].append(log.calls[0].bus_bytes)
                result[name]["bytes"].append(log.calls[0].bytes)
            calls = calls_for(target_s, arms, group)
            calls_per_size.append(calls)
            for name, per_call in rounds(arms, calls, repeats, group).items():
                result[name]["median_s"].append(timing.median(per_call))
                result[name]["step_s"].append(per_call)
            script.progress(env, k + 1, len(n_bytes_list), MB=n_bytes / 1e6, calls=calls)
    dist.barrier()                                     # the ranks outside the timed group wait here
    if not env.is_main:
        return None
    return {"world_size": n, "n_bytes": [n_bytes // 4 // n * n * 4 for n_bytes in n_bytes_list],
            "repeats": repeats, "floor": FLOOR, "order": list(ARMS),
            "exit_skew_s": skew, "skew_share": SKEW_SHARE, "calls": calls_per_size,
            "bus_factor": {name: counting.bus_factor(name, n) for name in TIMED}, **result}


def detail_cost(env, n: int, repeats: int) -> dict | None:
    """Section 4: seconds per all-reduce of DETAIL_NUMEL floats on ranks 0..n-1 on a plain gloo group, on a second
    plain group (the noise floor) and on a group made under DETAIL (a ProcessGroupWrapper), per round."""
    plain = dist.new_group(list(range(n)), backend="gloo")
    again = dist.new_group(list(range(n)), backend="gloo")
    before = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)       # as TORCH_DISTRIBUTED_DEBUG=DETAIL does for the groups
    try:                                               # made from now on
        checked = dist.new_group(list(range(n)), backend="gloo")
    finally:
        dist.set_debug_level(before)
    result = None
    if env.rank < n:
        x = torch.zeros(DETAIL_NUMEL)                  # zeros: stays finite, all-reduced in place again and again
        arms = {label: (lambda g=g: dist.all_reduce(x, group=g))
                for label, g in zip(DETAIL_ARMS, (plain, again, checked))}
        skew = exit_skew(plain)
        calls = calls_for(timing.median(skew) / SKEW_SHARE, arms, plain)
        result = {"per_call_s": rounds(arms, calls, repeats, plain), "calls": calls, "exit_skew_s": skew,
                  "numel": DETAIL_NUMEL, "repeats": repeats}
    dist.barrier()
    return result if env.is_main else None
