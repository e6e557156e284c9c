"""Lab 02's distributed step: check a ring all-reduce against ``dist.all_reduce``, count its bytes, time it.

    torchrun --standalone --nproc-per-node 3 -m lablib.runs.ring_allreduce --impl ring_impl.py --out out.json
    torchrun --standalone --nproc-per-node 2 -m lablib.runs.ring_allreduce --impl ring_impl.py \\
        --sizes "" --bench_bytes 1024,1048576,16777216 --out bench.json

The student's ``ring_all_reduce(tensor, comm)`` (from --impl) sums ``tensor`` over all ranks in place,
talking only through ``comm``, a ``lablib.p2p.CountingComm`` that counts every byte it sends and receives.

- check (``sizes``, element counts, for each of ``dtypes``): every rank fills a tensor with small random
  integers (so every summation order gives the same bits), runs the student's function and
  ``dist.all_reduce`` on copies, and reports the largest difference and its exact byte counts per rank.
  The naive scheme (gather to rank 0, then broadcast) is counted on the same tensors, for comparison.
- benchmark (``bench_bytes``, message sizes in bytes, float32): the student's ring, the naive scheme and
  gloo's own ``dist.all_reduce``, interleaved, ``repeats`` times each after one warm-up; each repetition's
  time is the slowest rank's.
Each call runs under a watchdog: a rank stuck for ``deadlock_s`` (two blocking sends facing each other)
fails with a message instead of hanging until the launcher's timeout.

The tensors always live on the CPU and travel through gloo, also on a GPU machine (where the default group
may be NCCL, a gloo group is created next to it): gloo's send/recv handle only CPU tensors, and one backend
keeps the lab's counts and timings comparable everywhere.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lablib import script
from lablib.impl import load_module
from lablib.p2p import CountingComm

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "int32": torch.int32, "int64": torch.int64}


@dataclass(frozen=True)
class Config:
    impl: str = "ring_impl.py"                      # the module file the notebook's exercise cell writes
    sizes: tuple[int, ...] = (12, 1001, 65536, 65537, 262144)   # element counts to check (empty: no check)
    dtypes: tuple[str, ...] = ("float32",)
    bench_bytes: tuple[int, ...] = ()               # message sizes in bytes to time (empty: no benchmark)
    repeats: int = 5                                 # timed repetitions per size and method (x4 up to 1 MiB)
    deadlock_s: float = 20.0                         # a single call taking longer than this is a deadlock
    seed: int = 0

    def validate(self) -> None:
        unknown = [d for d in self.dtypes if d not in DTYPES]
        if unknown:
            raise ValueError(f"dtypes {unknown} are not supported; choose from {', '.join(DTYPES)}")
        if any(n < 1 for n in self.sizes):
            raise ValueError(f"sizes={self.sizes}: every tensor needs at least one element")
        if any(b < 4 or b % 4 for b in self.bench_bytes):
            raise ValueError(f"bench_bytes={self.bench_bytes}: float32 messages need a multiple of 4 bytes")
        if self.repeats < 1 or self.deadlock_s <= 0:
            raise ValueError(f"repeats={self.repeats} must be >= 1 and deadlock_s={self.deadlock_s} positive")


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
        script._record_error(os.environ.get("LABLIB_RUN_DIR"), rank, TimeoutError(message))
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


def small_integers(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Integers in [-8, 8]: sums of a few are exact in every dtype, so any reduction order gives the same bits."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, (numel,), generator=g).to(dtype)


def gather_to_rank0(value, world_size: int, group) -> list:
    gathered = [None] * world_size
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def check_sizes(env, config: Config, ring_all_reduce, group) -> list[dict]:
    comm = CountingComm(env.rank, env.world_size, group)
    results = []
    for dtype_name in config.dtypes:
        for i, numel in enumerate(config.sizes):
            x = small_integers(numel, DTYPES[dtype_name], config.seed * 7919 + 1000 * i + env.rank)
            expected = x.clone()
            dist.all_reduce(expected, group=group)
            got = x.clone()
            comm.reset()
            with watchdog(env.rank, config.deadlock_s, f"ring_all_reduce on {numel} {dtype_name} elements"):
                returned = ring_all_reduce(got, comm)
            ring_counts = comm.counts()
            max_err = (got.double() - expected.double()).abs().max().item()
            comm.reset()
            with watchdog(env.rank, config.deadlock_s, "naive_all_reduce"):
                naive_all_reduce(x.clone(), comm)
            per_rank = gather_to_rank0({"max_abs_err": max_err, "returned_input": returned is got,
                                        "ring": ring_counts, "naive": comm.counts()}, env.world_size, group)
            results.append({
                "numel": numel, "dtype": dtype_name, "element_size": x.element_size(),
                "n_bytes": numel * x.element_size(),
                "max_abs_err": max(r["max_abs_err"] for r in per_rank),
                "returned_input": all(r["returned_input"] for r in per_rank),
                **{f"{key}": [r["ring"][key] for r in per_rank]
                   for key in ("bytes_sent", "bytes_received", "sends", "recvs")},
                "sent_to": [r["ring"]["sent_to"] for r in per_rank],
                "naive_bytes_sent": [r["naive"]["bytes_sent"] for r in per_rank],
                "naive_bytes_received": [r["naive"]["bytes_received"] for r in per_rank],
            })
    return results


def benchmark(env, config: Config, ring_all_reduce, group) -> dict:
    comm = CountingComm(env.rank, env.world_size, group)
    methods = {"ring": lambda t: ring_all_reduce(t, comm), "naive": lambda t: naive_all_reduce(t, comm),
               "gloo": lambda t: dist.all_reduce(t, group=group)}
    times = {name: [] for name in methods}                       # name -> [size index][repetition] seconds
    for k, n_bytes in enumerate(config.bench_bytes):
        x = torch.randn(n_bytes // 4)
        buf = torch.empty_like(x)
        per_rep = {name: [] for name in methods}
        # Small messages take milliseconds and are noisy on a shared machine: repeat them more often.
        repeats = config.repeats * (4 if n_bytes <= 2**20 else 1)
        for rep in range(repeats + 1):                          # repetition 0 is a warm-up
            for name, fn in methods.items():                     # interleaved: all three see the same noise
                buf.copy_(x)
                dist.barrier(group=group)
                t0 = time.perf_counter()
                with watchdog(env.rank, config.deadlock_s, f"{name} all-reduce of {n_bytes} bytes"):
                    fn(buf)
                if rep > 0:
                    per_rep[name].append(time.perf_counter() - t0)
        for name in methods:
            slowest = torch.tensor(per_rep[name], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)   # a collective ends with its slowest rank
            times[name].append(slowest.tolist())
        script.progress(env, k + 1, len(config.bench_bytes), MB=n_bytes / 1e6)
    return {"n_bytes": list(config.bench_bytes),
            **{f"{name}_s": [statistics.median(t) for t in times[name]] for name in methods},
            **{f"{name}_all_s": times[name] for name in methods}}


def train(env, config: Config) -> dict:
    impl = load_module(config.impl, required=("ring_all_reduce",))
    # CPU tensors through gloo on every machine (see the module docstring).
    group = None if env.backend == "gloo" else dist.new_group(backend="gloo")
    result = {"world_size": env.world_size, "comm_backend": "gloo"}
    if config.sizes:
        result["check"] = check_sizes(env, config, impl.ring_all_reduce, group)
        if env.is_main:
            worst = max(r["max_abs_err"] for r in result["check"])
            print(f"{env.world_size} ranks: ring_all_reduce checked on {len(result['check'])} tensors "
                  f"(sizes {', '.join(map(str, config.sizes))}; {', '.join(config.dtypes)}), "
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
    script.main(Config, train)


if __name__ == "__main__":
    main()
