"""Lab 07's graded step: the students' ``ShardedOptimizer`` (ZeRO-1), ``ZeRO2`` and ``ZeRO3`` on real ranks.

    torchrun --standalone --nproc-per-node 4 -m lablib.labs.zero_from_scratch.run_zero_scratch --impl zero1_impl.py \\
        --exercise zero1 --runs 2:mlp,3:mlp,4:groups --out out.json

(zero3 also takes mixed-precision cases, "case@param_dtype[/reduce_dtype]": ``--runs 2:mlp,2:mlp@bf16/fp32``.)

One torchrun start checks several (world size, case) pairs, as lab 06's does: the job has as many processes
as the largest world size asked for, and for world size n the first n ranks form a group of their own that stands in as the default group while the
student's class runs (``lablib.probes.harness.default_group``); the other ranks wait at the next barrier. What each rank
does and records is ``lablib.labs.zero_from_scratch.zero12.probe_case`` (``zero3``: ``lablib.labs.zero_from_scratch.zero3.probe``, 4 steps of 2 samples
per rank, with FSDP2's losses on the same ranks for the GPT).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from lablib.jobs import script
from lablib.jobs.exercise import load_fresh as load_impl
from lablib.jobs.exercise import require_file
from lablib.labs.zero_from_scratch import zero3, zero12
from lablib.labs.zero_from_scratch.cases import CASES, CLASSES


@dataclass(frozen=True)
class Config:
    impl: str = "zero1_impl.py"          # the module file the notebook's exercise cell writes
    exercise: str = "zero1"              # zero1 (ShardedOptimizer), zero2 (ZeRO2) or zero3 (ZeRO3)
    runs: tuple[str, ...] = ("2:mlp",)   # "world size:case", each checked in turn; start the job with the
                                         # largest world size's number of ranks
    steps: int = 10
    per_rank: int = 4                    # samples per rank per step
    seed: int = 0

    def validate(self) -> None:
        if self.exercise not in CLASSES:
            raise ValueError(f"exercise={self.exercise!r} must be one of {sorted(CLASSES)}")
        pairs = [r.split(":") for r in self.runs]
        cases = zero3.CASES if self.exercise == "zero3" else CASES
        bad = [r for r, p in zip(self.runs, pairs) if len(p) != 2 or not p[0].isdigit() or int(p[0]) < 1
               or not self._known(p[1])]
        if bad or not self.runs:
            raise ValueError(f"runs={self.runs}: {bad or 'none'} not of the form 'world size:case', e.g. '2:mlp'; "
                             f"known cases are {sorted(cases)}" + (", for zero3 optionally with '@param_dtype' or "
                             "'@param_dtype/reduce_dtype' (e.g. '2:mlp@bf16/fp32')" if self.exercise == "zero3"
                             else ""))
        if self.steps < 1 or self.per_rank < 1:
            raise ValueError(f"steps={self.steps} and per_rank={self.per_rank} must be positive")
        require_file(self.impl)

    def _known(self, case: str) -> bool:
        if self.exercise != "zero3":
            return case in CASES
        try:
            zero3.parse_case(case)
        except ValueError:
            return False
        return True

    def pairs(self) -> list[tuple[int, str]]:
        return [(int(n), case) for n, case in (r.split(":") for r in self.runs)]

    def validate_world(self, world_size: int) -> None:
        largest = max(n for n, _ in self.pairs())
        if world_size != largest:
            raise ValueError(f"runs={self.runs} need exactly {largest} processes, got {world_size}; start it "
                             f"with nproc={largest}")


def run(env, config: Config) -> dict:
    impl = load_impl(config.impl, required=(CLASSES[config.exercise],))
    # Every rank creates every group in the same order (new_group is collective).
    sizes = sorted({n for n, _ in config.pairs()})
    groups = {n: dist.new_group(list(range(n))) if n < env.world_size else None for n in sizes}
    results = {}
    for i, (n, case) in enumerate(config.pairs()):
        if env.rank < n:   # the other ranks go on to the barrier and wait there
            if config.exercise == "zero3":
                results[f"{n}:{case}"] = zero3.probe(impl, case, env, groups[n], steps=min(config.steps, 4),
                                                            per_rank=min(config.per_rank, 2), seed=config.seed,
                                                            fsdp2=case == "gpt")
            else:
                results[f"{n}:{case}"] = zero12.probe_case(impl, config.exercise, case, env, groups[n],
                                                                steps=config.steps, per_rank=config.per_rank,
                                                                seed=config.seed)
        dist.barrier()
        script.progress(env, i + 1, len(config.runs))
    return {"runs": results if env.is_main else {}}


def main() -> None:
    script.main(Config, run)


if __name__ == "__main__":
    main()
