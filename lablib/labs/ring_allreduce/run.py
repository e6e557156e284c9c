"""Lab 02's distributed step: check a ring all-reduce against ``dist.all_reduce``, count its bytes, time it.

    torchrun --standalone --nproc-per-node 4 -m lablib.labs.ring_allreduce.run --impl ring_impl.py \\
        --world_sizes 2,3,4 --out out.json
    torchrun --standalone --nproc-per-node 2 -m lablib.labs.ring_allreduce.run --impl ring_impl.py \\
        --sizes "" --bench_bytes 1024,1048576,16777216 --out bench.json

The student's ``ring_all_reduce(tensor, comm)`` (from --impl) sums ``tensor`` over all ranks in place,
talking only through ``comm``, a ``lablib.measure.p2p.CountingComm`` that counts every byte it sends and receives.

- check (``sizes``, element counts, and ``shapes``, multi-dimensional, for each of ``dtypes``): every rank
  fills a tensor with small random integers (so every summation order gives the same bits), runs the
  student's function and ``dist.all_reduce`` on copies, and reports the largest difference, its exact byte
  counts per rank, the peers each rank sent to and received from, its largest message, and any
  ``torch.distributed`` function it called itself instead of going through the comm (``p2p.direct_calls``).
  The naive scheme (gather to rank 0, then broadcast) is counted on the same tensors, for comparison.
  ``world_sizes`` checks several world sizes in one launch: for each size w the ranks 0..w-1 form a gloo
  sub-group (the others wait), so 2, 3 and 4 ranks cost one torchrun start instead of three.
- benchmark (``bench_bytes``, message sizes in bytes, float32): the student's ring, the naive scheme,
  gloo's own ``dist.all_reduce``, and the ring and gloo once more (two noise floors: the same code against itself),
  taking turns with who goes first rotating, ``repetitions`` times each after one warm-up; each repetition's time is
  the slowest rank's. Per size the ratios per repetition (ring / gloo, naive / ring, and the floors gloo again /
  gloo and ring again / ring) and a verdict for each comparison against the floor of its own denominator
  (``timing.noise_verdict``): ring / gloo against gloo's, naive / ring against the ring's.
Each call runs under a watchdog: a rank stuck for ``deadlock_s`` (two blocking sends facing each other)
fails with a message instead of hanging until the launcher's timeout.

The tensors always live on the CPU and travel through gloo, also on a GPU machine (where the default group
may be NCCL, a gloo group is created next to it): gloo's send/recv handle only CPU tensors, and one backend
keeps the lab's counts and timings comparable everywhere.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lablib.jobs import processes, script
from lablib.measure import timing
from lablib.jobs.exercise import load_module
from lablib.measure.p2p import RING_DTYPES as DTYPES, CountingComm, direct_calls, small_integers, summarise
from lablib.jobs.distenv import gather_objects

@dataclass(frozen=True)
class Config:
    impl: str = "ring_impl.py"                      # the module file the notebook's exercise cell writes
    sizes: tuple[int, ...] = (12, 1001, 65536, 65537, 262144)   # element counts to check (empty: no check)
    shapes: tuple[str, ...] = ()                    # multi-dimensional tensors to check too, e.g. "3x1366"
    dtypes: tuple[str, ...] = ("float32",)
    world_sizes: tuple[int, ...] = ()               # world sizes to check, each <= nproc (empty: nproc only)
    bench_bytes: tuple[int, ...] = ()               # message sizes in bytes to time (empty: no benchmark)
    repeats: int = 5                                 # timed repetitions per size and method (x4 up to 1 MiB, x1.5 above)
    deadlock_s: float = 20.0                         # a single call taking longer than this is a deadlock
    seed: int = 0

    def validate(self) -> None:
        unknown = [d for d in self.dtypes if d not in DTYPES]
        if unknown:
            raise ValueError(f"dtypes {unknown} are not supported; choose from {', '.join(DTYPES)}")
        if any(n < 1 for n in self.sizes):
            raise ValueError(f"sizes={self.sizes}: every tensor needs at least one element")
        for shape in self.shapes:
            parse_shape(shape)
        if any(b < 4 or b % 4 for b in self.bench_bytes):
            raise ValueError(f"bench_bytes={self.bench_bytes}: float32 messages need a multiple of 4 bytes")
        if any(w < 1 for w in self.world_sizes):
            raise ValueError(f"world_sizes={self.world_sizes}: every world size needs at least one rank")
        if self.repeats < 1 or self.deadlock_s <= 0:
            raise ValueError(f"repeats={self.repeats} must be >= 1 and deadlock_s={self.deadlock_s} positive")

    def validate_world(self, world_size: int) -> None:
        too_big = [w for w in self.world_sizes if w > world_size]
        if too_big:
            raise ValueError(f"world_sizes={self.world_sizes}: {too_big} need more ranks than the {world_size} "
                             f"started; start at least {max(too_big)} (nproc={max(too_big)})")


def parse_shape(text: str) -> tuple[int, ...]:
    """ "3x1366" -> (3, 1366), with a clear error for anything else."""
    try:
        shape = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"shape {text!r}: write positive dimensions separated by x, e.g. '3x1366'")
    return shape


def naive_all_reduce(tensor: torch.Tensor, comm: CountingComm) -> torch.Tensor:
    """The baseline: every rank sends its whole tensor to rank 0, which sums and sends the result back.

    Rank 0 receives and sends (N-1) x M bytes, every other rank M each way: rank 0's link is the bottleneck.
    """
    if comm.world_size == 1:
        return tensor
    if comm.rank == 0:
        incoming = torch.empty_like(tensor)
        for src in range(1, comm.world_size):
            comm.recv(incoming, src)
            tensor += incoming
        for work in [comm.isend(tensor, dst) for dst in range(1, comm.world_size)]:
            work.wait()
    else:
        comm.send(tensor, 0)
        comm.recv(tensor, 0)
    return tensor


@contextlib.contextmanager
def watchdog(rank: int, seconds: float, what: str):
    """Fail this rank with a clear message when the block takes longer than ``seconds`` (a deadlock)."""
    def fire():
        message = (f"rank {rank}: {what} did not finish within {seconds:g} s. A deadlock? With blocking "
                   f"comm.send every rank waits for a receive that its neighbour never posts: post both "
                   f"with comm.isend / comm.irecv and then wait(), and check that what rank r sends to r+1 "
                   f"is what r+1 expects from r (same step, same chunk size).")
        processes.record_error(rank, TimeoutError(message))
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def check_sizes(env, config: Config, ring_all_reduce, group) -> list[dict]:
    """Every (world size, dtype, shape) case; rank 0 returns one row per case, the others an empty list."""
    shapes = [(n,) for n in config.sizes] + [parse_shape(s) for s in config.shapes]
    results = []
    for world_size in config.world_sizes or (env.world_size,):
        # Ranks 0..w-1 form the sub-group (every rank must call new_group, members or not).
        sub = group if world_size == env.world_size else dist.new_group(list(range(world_size)), backend="gloo")
        member = env.rank < world_size
        comm = CountingComm(env.rank, world_size, sub) if member else None
        for dtype_name in config.dtypes:
            for i, shape in enumerate(shapes):
                mine = check_one(env, config, ring_all_reduce, comm, sub, shape, dtype_name, i) if member else None
                per_rank = [r for r in gather_objects(mine, env, group=group) if r is not None]
                if env.is_main:
                    results.append(summarise(per_rank, world_size, shape, dtype_name))
    return results


def check_one(env, config: Config, ring_all_reduce, comm: CountingComm, sub, shape, dtype_name: str, i: int) -> dict:
    """One case on one member rank: the student's ring and dist.all_reduce on copies, then the naive scheme."""
    numel = math.prod(shape)
    x = small_integers(numel, DTYPES[dtype_name], config.seed * 7919 + 1000 * i + env.rank).view(shape)
    expected = x.clone()
    dist.all_reduce(expected, group=sub)
    got = x.clone()
    comm.reset()
    with watchdog(env.rank, config.deadlock_s,
                  f"ring_all_reduce on {comm.world_size} ranks, a {dtype_name} tensor of shape {tuple(shape)}"):
        with direct_calls() as called:
            returned = ring_all_reduce(got, comm)
    ring_counts = comm.counts()
    max_err = ((got.double() - expected.double()).abs().max().item() if got.shape == expected.shape
               else float("inf"))
    comm.reset()
    with watchdog(env.rank, config.deadlock_s, "naive_all_reduce"):
        naive_all_reduce(x.clone(), comm)
    return {"max_abs_err": max_err, "returned_input": returned is got, "direct_calls": sorted({c.function for c in called.calls}),
            "element_size": x.element_size(), "ring": ring_counts, "naive": comm.counts()}


# The ring and gloo twice: each comparison's noise floor is its denominator timed against itself (naive / ring is read
# against ring again / ring, not against gloo's floor: a Python ring of posts and waits spreads differently from one
# C++ call). Each "again" is kept away from its first run in the rotation.
BENCH_ARMS = ("ring", "naive", "gloo", "ring_again", "gloo_again")


def repetitions(n_bytes: int, repeats: int) -> int:
    """Timed repetitions of one size: 4x ``repeats`` up to 1 MiB (milliseconds, noisy on a shared machine), 1.5x
    above; rounded up to whole rotations of the arms, so that each arm goes first equally often."""
    wanted = math.ceil(repeats * (4 if n_bytes <= 2**20 else 1.5))
    return math.ceil(wanted / len(BENCH_ARMS)) * len(BENCH_ARMS)


def benchmark(env, config: Config, ring_all_reduce, group) -> dict:
    comm = CountingComm(env.rank, env.world_size, group)
    methods = {"ring": lambda t: ring_all_reduce(t, comm), "naive": lambda t: naive_all_reduce(t, comm),
               "gloo": lambda t: dist.all_reduce(t, group=group), "gloo_again": lambda t: dist.all_reduce(t, group=group),
               "ring_again": lambda t: ring_all_reduce(t, comm)}
    times = {name: [] for name in methods}                       # name -> [size index][repetition] seconds
    for k, n_bytes in enumerate(config.bench_bytes):
        x = torch.randn(n_bytes // 4)
        buf = torch.empty_like(x)
        per_rep = {name: [] for name in methods}
        for rep in range(repetitions(n_bytes, config.repeats) + 1):   # repetition 0 is a warm-up
            # The arms take turns, and who goes first rotates with the repetition: the first of a repetition pays
            # for what the machine did before (caches, a core just taken back), and that must not be one arm's.
            j = rep % len(BENCH_ARMS)
            for name in BENCH_ARMS[j:] + BENCH_ARMS[:j]:
                buf.copy_(x)
                timing.barrier(buf.device, group)
                with timing.stopwatch(per_rep[name], buf.device), \
                        watchdog(env.rank, config.deadlock_s, f"{name} all-reduce of {n_bytes} bytes"):
                    methods[name](buf)
        for name in methods:   # a collective ends with its slowest rank (lablib.measure.timing); repetition 0 is warm-up
            times[name].append(timing.slowest_rank(per_rep[name][1:], buf.device, group))
        script.progress(env, k + 1, len(config.bench_bytes), MB=n_bytes / 1e6)
    return {"n_bytes": list(config.bench_bytes),
            **{f"{name}_s": [timing.median(t) for t in times[name]] for name in methods},
            **{f"{name}_all_s": times[name] for name in methods},
            **compare(times)}


def compare(times: dict) -> dict:
    """Per size, per repetition: ring / gloo (= gloo's bus bandwidth over the ring's), naive / ring, and the noise
    floors gloo again / gloo and ring again / ring (the same code against itself, in the same units); each comparison
    judged by the course's one rule (``timing.noise_verdict``) against the floor of its denominator, over the whole
    table (two comparisons per size)."""
    ratio = lambda a, b: [[x / y for x, y in zip(ra, rb)] for ra, rb in zip(times[a], times[b])]
    ring_gloo, naive_ring = ratio("ring", "gloo"), ratio("naive", "ring")
    floor_gloo, floor_ring = ratio("gloo_again", "gloo"), ratio("ring_again", "ring")
    comparisons = 2 * len(floor_gloo)
    return {"ring_over_gloo": ring_gloo, "naive_over_ring": naive_ring, "floor_gloo_again_over_gloo": floor_gloo,
            "floor_ring_again_over_ring": floor_ring,
            "verdicts": [{"ring_vs_gloo": timing.noise_verdict(rg, fg, comparisons),
                          "naive_vs_ring": timing.noise_verdict(nr, fr, comparisons)}
                         for rg, nr, fg, fr in zip(ring_gloo, naive_ring, floor_gloo, floor_ring)]}


def run(env, config: Config) -> dict:
    impl = load_module(config.impl, required=("ring_all_reduce",))
    # CPU tensors through gloo on every machine (see the module docstring).
    group = None if env.backend == "gloo" else dist.new_group(backend="gloo")
    result = {"world_size": env.world_size, "comm_backend": "gloo"}
    if config.sizes or config.shapes:
        result["check"] = check_sizes(env, config, impl.ring_all_reduce, group)
        if env.is_main:
            worst = max(r["max_abs_err"] for r in result["check"])
            ranks = ", ".join(map(str, config.world_sizes or (env.world_size,)))
            print(f"{ranks} ranks: ring_all_reduce checked on {len(result['check'])} tensors "
                  f"(sizes {', '.join(map(str, config.sizes + config.shapes))}; {', '.join(config.dtypes)}), "
                  f"max |ring - dist.all_reduce| = {worst:g}")
    if config.bench_bytes:
        result["bench"] = benchmark(env, config, impl.ring_all_reduce, group)
        if env.is_main:
            b = result["bench"]
            print(f"timed {len(b['n_bytes'])} message sizes on {env.world_size} ranks; largest "
                  f"({b['n_bytes'][-1] / 2**20:g} MiB): ring {b['ring_s'][-1] * 1e3:.1f} ms, naive "
                  f"{b['naive_s'][-1] * 1e3:.1f} ms, dist.all_reduce {b['gloo_s'][-1] * 1e3:.1f} ms (medians)")
    return result


def main() -> None:
    script.main(Config, run)


if __name__ == "__main__":
    main()
