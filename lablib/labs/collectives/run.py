"""Lab 00's distributed step: every collective the course uses, each rank's tensor before and after, the
bytes the course counts for it, and its bus bandwidth on gloo over message sizes.

    torchrun --standalone --nproc-per-node 4 -m lablib.labs.collectives.run --world_sizes 2,3,4 --out out.json
    torchrun --standalone --nproc-per-node 4 -m lablib.labs.collectives.run --world_sizes 4 \\
        --bench_bytes 4096,65536,1048576 --bench_ranks 2 --detail_repeats 10 --out bench.json
    torchrun --standalone --nproc-per-node 4 -m lablib.labs.collectives.run --check_inputs inputs.json --out check.json

- pictures (for each of ``world_sizes``; ranks 0..w-1 form a gloo sub-group, the others wait, so several
  world sizes cost one torchrun start): rank r starts with ``[10 r, 10 r + 1, ...]`` (``per_rank`` x w
  elements; every value says where it came from) and runs broadcast, reduce, all_reduce, all_gather, reduce_scatter,
  all_to_all (``all_to_all_single``, also with uneven splits), scatter, gather, send/recv and a barrier
  (ranks arrive at different times). Rank 0 gathers each rank's input and output, and what
  ``lablib.measure.counting`` recorded for the call (message size S, bus bytes).
  It also tries ``reduce_scatter_single`` on an input that does not divide by the world size, and
  ``all_to_all_single`` with splits that do not add up, and keeps the errors PyTorch raises.
- checks (``check_inputs``, a JSON file, instead of everything else: lab 00's exercise 1 check, whose inputs the
  notebook draws once the student's predictions of them exist): for each case ``"w/name"`` of the file,
  ``collective`` (all_reduce, all_gather, reduce_scatter or all_to_all) on ranks 0..w-1, rank r's tensor being
  ``inputs[r]`` of ``dtype`` (and, for all_to_all, ``splits[r]`` its input split sizes when given); rank 0 returns
  every rank's output, and for each w the errors of ``expected_errors``.
- wire (``wire_bytes`` = S > 0, for each of those world sizes): the bytes each rank really wrote to its
  sockets during each timed collective of S bytes, read from Linux's ``/proc/self/io`` (``wchar``: every
  write-like system call of the process, gloo's socket sends included), divided by S. What gloo moves, next
  to what the algorithm needs (``lablib.measure.counting``'s bus factor). None where there is no ``/proc``.
- benchmark (``bench_bytes``, message sizes S in bytes, float32; ``lablib.labs.collectives.bench.sweep``): each
  collective's time per call on the first ``bench_ranks`` ranks, ``repeats`` rounds, windows of several calls as
  many as the ranks' skew leaving a barrier requires, the all-reduce timed again as the noise floor (see
  ``bench``). Ranks outside the timed group wait in a barrier (on gloo a waiting rank sleeps in a socket read,
  it does not spin).
- DETAIL's cost (``detail_repeats`` rounds; ``bench.detail_cost``): a small all-reduce on a plain gloo group, on a
  second plain group (the floor) and on a group made under TORCH_DISTRIBUTED_DEBUG=DETAIL, on the same ranks,
  after everything else.

The tensors live on the CPU and travel through gloo on every machine (a gloo group is made next to an
NCCL default group): the lab is about gloo's behaviour, and one backend keeps the numbers comparable.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from lablib.measure import counting, timing
from lablib.jobs import script
from lablib.jobs.distenv import gather_objects
from lablib.labs.collectives.bench import TIMED, detail_cost, sweep, timed_call
from lablib.labs.collectives.collective_cases import check_cases, expected_errors, one_rank

# The course's names, in the order the lab teaches them.
COLLECTIVES = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "scatter",
               "gather", "send_recv", "barrier")


@dataclass(frozen=True)
class Config:
    world_sizes: tuple[int, ...] = ()       # world sizes to draw (empty: every rank started)
    per_rank: int = 1                       # a rank's tensor holds per_rank x world_size elements
    bench_bytes: tuple[int, ...] = ()       # message sizes S to time (empty: no benchmark)
    bench_ranks: int = 2                    # ranks in the timed group
    repeats: int = 12                       # timed rounds per size (even: as many orders forwards as backwards)
    detail_repeats: int = 0                 # timed rounds of what DETAIL costs, on bench_ranks ranks (0: none)
    barrier_delay_s: float = 0.05           # rank r reaches the barrier r x this late
    wire_bytes: int = 0                     # message size S for counting the bytes gloo really sends (0: no)
    check_inputs: str = ""                  # a JSON file of exercise 1's check cases (see above); "": none

    def validate(self) -> None:
        if self.per_rank < 1 or any(w < 1 for w in self.world_sizes):
            raise ValueError(f"per_rank={self.per_rank} and world_sizes={self.world_sizes} must be positive")
        if any(b < 4 or b % 4 for b in self.bench_bytes):
            raise ValueError(f"bench_bytes={self.bench_bytes}: float32 messages need a multiple of 4 bytes")
        if self.wire_bytes < 0 or self.wire_bytes % 4:
            raise ValueError(f"wire_bytes={self.wire_bytes}: a float32 message needs a multiple of 4 bytes (0: none)")
        if self.check_inputs and not Path(self.check_inputs).is_file():
            raise ValueError(f"check_inputs={self.check_inputs!r} is not a file: give the JSON file of check cases")
        if self.bench_ranks < 2 or self.repeats < 1 or self.detail_repeats < 0 or self.barrier_delay_s < 0:
            raise ValueError(f"bench_ranks={self.bench_ranks} must be >= 2, repeats={self.repeats} >= 1, "
                             f"detail_repeats={self.detail_repeats} >= 0, barrier_delay_s={self.barrier_delay_s} >= 0")

    def validate_world(self, world_size: int) -> None:
        needed = max((*self.world_sizes, self.bench_ranks if self.bench_bytes or self.detail_repeats else 1))
        if needed > world_size:
            raise ValueError(f"world_sizes={self.world_sizes} / bench_ranks={self.bench_ranks} need {needed} "
                             f"ranks, but {world_size} were started; start nproc={needed}")


def bytes_written() -> int | None:
    """Bytes this process has written with write-like system calls so far (socket sends included); Linux only."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
    except (OSError, StopIteration, ValueError):
        return None


def wire(rank: int, n: int, n_bytes: int, group) -> dict:
    """{collective: bytes this rank wrote during it / S} for a message of S = n_bytes (None without /proc)."""
    numel = n_bytes // 4 // n * n
    x = torch.randn(numel)
    out = {"all_gather": torch.empty(numel), "reduce_scatter": torch.empty(numel // n), "all_to_all": torch.empty(numel)}
    ratios = {}
    for name in TIMED:
        buf = x.clone()
        dist.barrier(group=group)
        before = bytes_written()
        timed_call(name, buf, out, n, group)
        after = bytes_written()
        ratios[name] = None if before is None or after is None else (after - before) / (numel * 4)
    return ratios


def pictures(env, config: Config, world_size: int, default_group) -> dict | None:
    """Every collective on ranks 0..world_size-1; rank 0 returns {name: per-rank inputs/outputs, counts}."""
    sub = default_group if world_size == env.world_size else dist.new_group(list(range(world_size)), backend="gloo")
    member = env.rank < world_size
    numel = config.per_rank * world_size
    result = {}
    for name in (*COLLECTIVES, "all_to_all_uneven"):
        mine = None
        if member:
            with counting.count_collectives() as log:
                before, after, extra = one_rank(name, env.rank, world_size, numel, sub, config.barrier_delay_s)
            mine = {"before": None if before is None else before.tolist(),
                    "after": None if after is None else after.tolist(), "extra": extra,
                    "calls": [{"name": c.name, "bytes": c.bytes, "world_size": c.world_size, "bus_bytes": c.bus_bytes}
                              for c in log.calls]}
        per_rank = [r for r in gather_objects(mine, env, group=default_group) if r is not None]
        if env.is_main:
            result[name] = {"before": [r["before"] for r in per_rank], "after": [r["after"] for r in per_rank],
                            "calls": [r["calls"] for r in per_rank], **per_rank[0]["extra"]}
            if name == "barrier":
                result[name]["arrived_s"] = [r["extra"]["arrived_s"] for r in per_rank]
                result[name]["left_s"] = [r["extra"]["left_s"] for r in per_rank]
                result[name]["rounds"] = [r["extra"]["rounds"] for r in per_rank]     # [rank][round]
    errors = expected_errors(env.rank, world_size, sub) if member else None
    gathered = gather_objects(errors, env, group=default_group)
    sent = wire(env.rank, world_size, config.wire_bytes, sub) if member and config.wire_bytes else None
    sent = [r for r in gather_objects(sent, env, group=default_group) if r is not None]
    if not env.is_main:
        return None
    return {"world_size": world_size, "numel": numel, "collectives": result, "errors": gathered[0],
            # {collective: [bytes written / S, per rank]}, with the bus factor the algorithm needs
            "wire": {name: [r[name] for r in sent] for name in TIMED} if sent else {},
            "bus_factor": {name: counting.bus_factor(name, world_size) for name in TIMED}}


def run(env, config: Config) -> dict:
    # CPU tensors through gloo on every machine (see the module docstring).
    default_group = None if env.backend == "gloo" else dist.new_group(backend="gloo")
    if config.check_inputs:
        specs = json.loads(Path(config.check_inputs).read_text())      # {"w/case": spec}
        sizes = sorted({int(key.split("/")[0]) for key in specs})
        if sizes and sizes[-1] > env.world_size:
            raise ValueError(f"check_inputs has cases for {sizes[-1]} ranks, but {env.world_size} were started")
        checked = {w: check_cases(env, {key.split("/", 1)[1]: spec for key, spec in specs.items()
                                        if int(key.split("/")[0]) == w}, w, default_group) for w in sizes}
        if env.is_main:
            print(f"ran exercise 1's {len(specs)} check cases on {', '.join(map(str, sizes))} ranks")
        return {"checks": checked}
    result = {"pictures": {}}
    for world_size in config.world_sizes or (env.world_size,):
        drawn = pictures(env, config, world_size, default_group)
        if env.is_main:
            result["pictures"][world_size] = drawn
    if env.is_main:
        print(f"ran {len(COLLECTIVES)} collectives on {', '.join(map(str, result['pictures']))} ranks "
              f"({config.per_rank} float32 element(s) per rank of the group on each rank)")
    if config.bench_bytes:
        bench = sweep(env, config.bench_bytes, config.bench_ranks, config.repeats)
        if env.is_main:
            result["bench"] = bench
            print(f"timed {len(TIMED)} collectives (and the all-reduce again, the noise floor) on {config.bench_ranks} "
                  f"ranks for {len(config.bench_bytes)} message sizes, {config.repeats} rounds each, "
                  f"{'/'.join(map(str, bench['calls']))} calls per window")
    if config.detail_repeats:                          # last: it leaves the debug level as it found it
        cost = detail_cost(env, config.bench_ranks, config.detail_repeats)
        if env.is_main:
            result["detail_cost"] = cost
            print(f"timed a plain all-reduce, the same again and one under DETAIL on {config.bench_ranks} ranks, "
                  f"{config.detail_repeats} rounds of {cost['calls']} calls")
    return result


def main() -> None:
    script.main(Config, run)


if __name__ == "__main__":
    main()
