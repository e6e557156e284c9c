"""How long a step takes across ranks: the course's one definition, and the tools that measure it.

A distributed step is over when its slowest rank is over. So every multi-rank measurement in the course:

1. times each step on every rank with ``stopwatch`` (which waits for the GPU first, when there is one),
   starting after a ``barrier`` when the ranks' steps are to be compared;
2. takes, step by step, the maximum over the ranks (``slowest_rank``: one all-reduce of the whole list):
   that is how long the job took for that step;
3. reports the median of those per-step maxima (``median``), under the JSON key ``median_step_s``, with
   the per-step list under ``step_s``. The median keeps the odd step slowed by another process on a shared
   machine from moving the figure.

``step_times`` does 2 and 3. The order matters: the maximum of each rank's median can be smaller than any
step really took when the ranks are slow at different steps (rank 0 slow at odd steps, rank 1 at even
ones), because every step waits for whichever rank is slow in it.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import random
import statistics
import time
from typing import Iterator, Sequence

import torch
import torch.distributed as dist


@contextlib.contextmanager
def stopwatch(times: list[float], device: torch.device) -> Iterator[None]:
    """Append the wall-clock seconds of the block to times (waiting for the GPU first, when there is one)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times.append(time.perf_counter() - t0)


def barrier(device: torch.device, group=None) -> None:
    """All ranks of group meet here (no-op without a process group)."""
    if dist.is_initialized():
        # NCCL needs to know the rank's GPU for its barrier; gloo's barrier is a CPU operation.
        nccl = dist.get_backend(group) == "nccl"
        dist.barrier(group=group, device_ids=[device.index] if nccl and device.type == "cuda" else None)


def slowest_rank(values: Sequence[float], device: torch.device, group=None) -> list[float]:
    """Element-wise maximum over the ranks of a per-step list (one all-reduce for the whole list). Every rank
    of group must call it with a list of the same length."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def median(values: Sequence[float]) -> float:
    """Median: robust to the odd step slowed by another process on a shared machine."""
    if len(values) == 0:
        raise ValueError("no timed steps: time at least one step after the warm-up")
    return float(statistics.median(values))


def step_times(per_step_s: Sequence[float], device: torch.device, group=None, warmup: int = 0) -> dict:
    """This rank's per-step seconds -> ``{"median_step_s", "step_s"}`` of the job (see the module docstring).

    The first ``warmup`` steps are left out (DDP builds its buckets in the first step, caches warm up).
    Every rank of group must call it, with the same number of steps.
    """
    if warmup < 0 or warmup >= len(per_step_s):
        raise ValueError(f"warmup={warmup} must leave at least one of the {len(per_step_s)} timed steps")
    slowest = slowest_rank(per_step_s[warmup:], device, group)
    return {"median_step_s": median(slowest), "step_s": slowest}


def turn_order(arms: Sequence, index: int, seed: int = 0) -> list:
    """The order in which ``arms`` take their turn in round (or step) ``index``: the same on every rank (no
    randomness that differs between processes). With up to 3 arms, all their orders in turn (over any multiple of 6
    rounds, of 2 for two arms, each arm goes first, and right after each other arm, as often as any other);
    with more, a fresh shuffle from a generator seeded by ``seed`` and ``index``. A rotation (A B C, B C A, C A B)
    would keep the arm that runs right before each arm the same in every round, and a carry-over effect (caches, a
    burst of load that outlasts a step) would then bias one ratio the same way every time."""
    arms = list(arms)
    if len(arms) <= 3:
        orders = list(itertools.permutations(arms))
        return list(orders[index % len(orders)])
    return random.Random(seed * 1_000_003 + index).sample(arms, len(arms))


def beyond_all_chance(n_row: int, n_floor: int, k: int) -> float:
    """The chance that at least ``k`` of a row's ``n_row`` per-round ratios lie above every one of ``n_floor`` noise-
    floor ratios when both are draws of one distribution (the row costs what DDP costs). Then every order of the
    n_row + n_floor values is equally likely, and "k of the row's above all the floor's" is "the k largest values
    are all the row's": C(n_row + n_floor - k, n_row - k) / C(n_row + n_floor, n_row). The same holds below every
    one. With 6 and 6: k = 6 gives 1/924, k = 5 gives 7/924."""
    if not (0 <= k <= n_row and n_floor >= 1):
        raise ValueError(f"k={k} must lie in 0..n_row={n_row}, and n_floor={n_floor} must be at least 1")
    return math.comb(n_row + n_floor - k, n_row - k) / math.comb(n_row + n_floor, n_row)


def noise_verdict(ratios: Sequence[float], floor: Sequence[float], comparisons: int, alpha: float = 0.05) -> dict:
    """Whether a row's per-round ratios to DDP tell it from DDP, against DDP timed against itself (``floor``).

    The rule (rank-based, no assumption on the shape of the noise): "slower" when at least ``needed`` of the row's
    rounds lie above the floor's highest ratio, "faster" when that many lie below its lowest, otherwise "within
    noise". ``needed`` is the fewest rounds whose ``beyond_all_chance`` stays at or under alpha / (2 comparisons):
    over a table of ``comparisons`` rows, each read both ways, the chance that noise alone prints any verdict is
    then at most alpha (Bonferroni). ``needed`` is None when no count of rounds gets there (too few rounds). With
    many rounds (12 against 12 needs only 5) enough rounds can lie above the floor and enough below it at once: the
    row is then noisier than the floor (or drifted during the run) but on neither side of it, and the verdict is
    "within noise" with ``both_ways`` set, never the first direction checked."""
    if not ratios or not floor or comparisons < 1:
        raise ValueError(f"{len(ratios)} ratios and {len(floor)} floor ratios (need both), comparisons={comparisons}")
    level = alpha / (2 * comparisons)
    needed = next((k for k in range(1, len(ratios) + 1) if beyond_all_chance(len(ratios), len(floor), k) <= level),
                  None)
    above = sum(r > max(floor) for r in ratios)
    below = sum(r < min(floor) for r in ratios)
    verdict = "within noise"
    slower, faster = needed is not None and above >= needed, needed is not None and below >= needed
    if slower and not faster:
        verdict = "slower"
    elif faster and not slower:
        verdict = "faster"
    return {"verdict": verdict, "above": above, "below": below, "needed": needed, "both_ways": slower and faster,
            "chance": beyond_all_chance(len(ratios), len(floor), needed) if needed else None, "level": level}


def against_reference(row_s: Sequence[float], reference_s: Sequence[float], comparisons: int = 1) -> dict:
    """A variant's timed steps against a reference's, when the two ran one after the other (not in turns).

    Each of the row's steps is divided by the reference's median, and so is each of the reference's own steps: the
    latter are the same code timed against itself, the noise floor of this run. ``noise_verdict`` then reads the
    row's ratios against that floor. Returns the medians' ratio, the range of the row's and of the floor's ratios,
    and the verdict. Run one after the other, a change of the machine's load between the two runs moves the
    ratio as well, which no floor measured inside one of them can show: read a verdict with that in mind."""
    if not row_s or not reference_s:
        raise ValueError(f"{len(row_s)} row steps and {len(reference_s)} reference steps (need both)")
    ref = median(reference_s)
    ratios = [t / ref for t in row_s]
    floor = [t / ref for t in reference_s]
    return {"ratio": median(row_s) / ref, "ratio_range": [min(ratios), max(ratios)],
            "floor_range": [min(floor), max(floor)], **noise_verdict(ratios, floor, comparisons)}


def take_turns(arms: dict, rounds: int, device: torch.device, group=None) -> dict:
    """Time arms (name -> a callable doing one step) taking turns: one untimed warm-up call each, then ``rounds``
    rounds in ``turn_order`` (round r's order), each call after a ``barrier``. Every rank of group must call it with
    the same arms.

    Returns, per arm, ``step_times`` of its calls in round order (``step_s[r]`` is round r's slowest rank) and the
    CPU time of the process per call (``time.process_time``; the busiest rank's per round, ``cpu_s``, with its
    median ``median_cpu_s``): CPU time leaves out what a rank waited for (a core another process held, the other
    rank, a transfer), wall time includes it."""
    if rounds < 1 or len(arms) < 2:
        raise ValueError(f"rounds={rounds}, {len(arms)} arms: need at least 1 round and 2 arms to take turns")
    wall = {name: [] for name in arms}
    cpu = {name: [] for name in arms}
    for name, step in arms.items():              # warm-up: caches, DDP's buckets, the allocator
        barrier(device, group)
        step()
    for r in range(rounds):
        for name in turn_order(list(arms), r):
            barrier(device, group)
            c0 = time.process_time()
            with stopwatch(wall[name], device):
                arms[name]()
            cpu[name].append(time.process_time() - c0)
    out = {}
    for name in arms:
        busiest = slowest_rank(cpu[name], device, group)
        out[name] = {**step_times(wall[name], device, group), "cpu_s": busiest, "median_cpu_s": median(busiest)}
    return out


def allreduce_times(env, sizes_bytes: Sequence[int], repeats: int) -> list[list[float]]:
    """Seconds of standalone all-reduces of each size (the slowest rank per repeat): ``[size][repeat]``.

    The sizes take turns, repeat by repeat (which size goes first rotates), so a burst of load falls on all
    sizes alike instead of on whichever size was being timed; one untimed warm-up round first."""
    tensors = [torch.ones(max(1, n // 4), device=env.device) for n in sizes_bytes]
    times = [[] for _ in sizes_bytes]
    for rep in range(repeats + 1):
        k = rep % len(sizes_bytes)
        for i in list(range(k, len(sizes_bytes))) + list(range(k)):
            barrier(env.device)
            with stopwatch(times[i], env.device):
                dist.all_reduce(tensors[i])
    return [slowest_rank(t[1:], env.device) for t in times]
