"""Check the distributed set-up: every rank reports itself, and one all-reduce proves they talk.

    torchrun --standalone --nproc-per-node 2 -m lablib.runs.hello --out hello.json

The fault options exist to show (and test) what the launcher does when things go wrong:
``fail_rank`` raises on that rank, ``hang_rank`` sleeps on that rank for ``hang_s`` seconds (the other
ranks then wait in the all-reduce until their collective timeout, or the launcher's, stops everything),
``abort_rank`` kills that rank with SIGABRT after its work is done, as a C++ library abort would (the
launcher must report a death by signal as such, never as the code's error). With ``fail_attempts`` > 0,
``fail_rank`` fails only on torchrun's first ``fail_attempts`` attempts (``launch.run(..., max_restarts=)``
then restarts the group, and the result says which attempt finished). ``rounds`` more all-reduces, one every
``round_s`` seconds, each announced by rank 0 ("round k of n, world size w"), keep a job alive long enough for a
node to leave it (``lablib.jobs.multinode.run_nodes(leave=...)``); each rank reports its node (torchrun's
``GROUP_RANK``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lablib.jobs import distenv, processes, script
from lablib.jobs.distenv import gather_objects


@dataclass(frozen=True)
class Config:
    fail_rank: int = -1
    hang_rank: int = -1
    hang_s: float = 3600.0
    abort_rank: int = -1
    fail_attempts: int = 0
    rounds: int = 0
    round_s: float = 0.2

    def validate_world(self, world_size: int) -> None:
        for name in ("fail_rank", "hang_rank", "abort_rank"):
            value = getattr(self, name)
            if value >= world_size:
                raise ValueError(f"{name}={value} does not exist with {world_size} ranks "
                                 f"(ranks are 0..{world_size - 1}); use -1 for none")


def run(env, config: Config) -> dict:
    attempt = distenv.restart_attempt()
    if env.rank == config.fail_rank and (config.fail_attempts == 0 or attempt < config.fail_attempts):
        raise RuntimeError(f"rank {env.rank} failed on purpose (fail_rank={config.fail_rank}) "
                           f"on attempt {attempt}")
    if env.rank == config.hang_rank:
        time.sleep(config.hang_s)
    # Each rank contributes rank+1; the all-reduced sum must be N(N+1)/2 on every rank.
    value = torch.tensor([float(env.rank + 1)], device=env.device)
    if dist.is_initialized():
        dist.all_reduce(value)
    for k in range(config.rounds):
        time.sleep(config.round_s)
        dist.all_reduce(torch.ones(1, device=env.device))
        if env.is_main:
            print(f"round {k + 1} of {config.rounds}, world size {env.world_size}", flush=True)
    info = {**env.describe(), "pid": os.getpid(), "agent_pid": os.getppid(), "hostname": os.uname().nodename,
            "node": int(os.environ.get("GROUP_RANK", "0")), "slurm_node": os.environ.get("SLURMD_NODENAME", "")}
    gathered = gather_objects(info, env)
    if env.is_main:
        print(f"{env.world_size} rank(s) on backend {env.backend}; all-reduce sum = {value.item():.0f}")
    if env.rank == config.abort_rank:
        os.abort()
    return {"all_reduce_sum": value.item(), "expected_sum": env.world_size * (env.world_size + 1) / 2,
            "rank_timeout_s": processes.rank_timeout_from_env(), "attempt": attempt, "ranks": gathered}


def main() -> None:
    script.main(Config, run)


if __name__ == "__main__":
    main()
