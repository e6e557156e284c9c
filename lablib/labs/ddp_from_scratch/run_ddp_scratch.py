"""Lab 06's graded step: the students' ``DDPIndividualParameters`` and ``DDPBucketed`` on real ranks.

    torchrun --standalone --nproc-per-node 3 -m lablib.labs.ddp_from_scratch.run_ddp_scratch --impl ddp_bucketed_impl.py \\
        --wrapper bucketed --world-sizes 2,3 --cases mlp,tied --out out.json

One torchrun start checks several world sizes: the job has max(world_sizes) processes, and for world size
n the first n ranks form a group of their own that stands in as the default group while the student's
class runs (``lablib.probes.harness.default_group``; the full world size gets its own group too), so code written for ``dist.all_reduce(t)`` without a group
argument runs on n ranks; the other ranks wait at the next barrier (lab 03 takes turns the same way). What
each rank does and records is ``probe.probe_case``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from lablib.jobs import script
from lablib.jobs.exercise import load_fresh, require_file
from lablib.labs.ddp_from_scratch.probe import CASES, WRAPPERS, probe_case
from lablib.parallel.ddp_buckets import load_bucketed_impl


GROUP_TIMEOUT_S = 60   # a collective of the student's class on a case's group: an error after this, never a hang


# --- the run ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    impl: str = "ddp_individual_impl.py"  # the module file the notebook's exercise cell writes
    wrapper: str = "individual"          # individual (DDPIndividualParameters) or bucketed (DDPBucketed)
    world_sizes: tuple[int, ...] = (2,)  # each checked in turn; start the job with max(world_sizes) ranks
    cases: tuple[str, ...] = ("mlp",)
    bucket_size_mb: float = 0.002        # DDPBucketed's cap where a case sets none (2 kB: several buckets)
    steps: int = 3
    per_rank: int = 8                    # samples per rank per step
    seed: int = 0

    def validate(self) -> None:
        if self.wrapper not in WRAPPERS:
            raise ValueError(f"wrapper={self.wrapper!r} must be one of {sorted(WRAPPERS)}")
        unknown = [c for c in self.cases if c not in CASES]
        if unknown or not self.cases:
            raise ValueError(f"cases={self.cases}: unknown {unknown}; known cases are {sorted(CASES)}")
        if not self.world_sizes or min(self.world_sizes) < 1:
            raise ValueError(f"world_sizes={self.world_sizes} must be positive integers, e.g. (2, 3)")
        if self.bucket_size_mb <= 0 or self.steps < 1 or self.per_rank < 1:
            raise ValueError(f"bucket_size_mb={self.bucket_size_mb}, steps={self.steps} and per_rank={self.per_rank} "
                             f"must be positive")
        require_file(self.impl)

    def validate_world(self, world_size: int) -> None:
        if world_size != max(self.world_sizes):
            raise ValueError(f"world_sizes={self.world_sizes} need exactly {max(self.world_sizes)} processes, got "
                             f"{world_size}; start it with nproc={max(self.world_sizes)}")


def run(env, config: Config) -> dict:
    impl = load_bucketed_impl(config.impl) if config.wrapper == "bucketed" else \
        load_fresh(config.impl, required=(WRAPPERS[config.wrapper],))
    # Every rank creates every group in the same order (new_group is collective). A group of its own for every
    # world size, the full one too: a wrong answer whose ranks issue mismatched all-reduces may leave its group
    # broken, never the default group the barriers use; its timeout turns a hang into an error within a minute.
    groups = {n: dist.new_group(list(range(n)), timeout=timedelta(seconds=GROUP_TIMEOUT_S)) for n in config.world_sizes}
    results = {}
    for i, n in enumerate(config.world_sizes):
        for case in config.cases:
            if env.rank < n:   # the other ranks go on to the barrier and wait there
                results[f"{n}:{case}"] = probe_case(impl, config.wrapper, case, env, groups[n], steps=config.steps,
                                                    bucket_size_mb=config.bucket_size_mb, per_rank=config.per_rank,
                                                    seed=config.seed)
            dist.barrier()
        script.progress(env, i + 1, len(config.world_sizes))
    return {"runs": results if env.is_main else {}}


def main() -> None:
    script.main(Config, run)


if __name__ == "__main__":
    main()
