"""Lab 13's graded steps on real ranks: the students' dispatch and combine (exercise 3), or their gradient reduction
on a dp x ep mesh (exercise 4).

    torchrun --standalone --nproc-per-node 2 -m lablib.labs.expert_parallel.run --impl ep_dispatch_impl.py \\
        --exercise dispatch --cases uneven,empty,one \\
        --cases_json '[{"name": "top2", "k": 2, "dtype": "float64", "routing": "random", "seed": 5}]' --out out.json
    torchrun --standalone --nproc-per-node 4 -m lablib.labs.expert_parallel.run --impl ep_dp_impl.py \\
        --exercise ep_dp --mesh 2x2 --cases fp32,frozen --out out.json

What each rank does and records is ``lablib.labs.expert_parallel.ep_dispatch`` / ``lablib.labs.expert_parallel.ep_grads``; every rank's
records are gathered on rank 0 (``records``: one per case and rank). Collectives are counted where the student's
code calls them (``lablib.measure.counting``), with their bytes and their groups' ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from lablib.jobs import script
from lablib.jobs.distenv import gather_objects
from lablib.labs.expert_parallel import ep_dispatch, ep_grads
from lablib.labs.expert_parallel import probes as ep_probes


@dataclass(frozen=True)
class Config:
    impl: str = "ep_dispatch_impl.py"   # the module file the notebook's exercise cell writes
    exercise: str = "dispatch"          # dispatch or ep_dp
    cases: tuple[str, ...] = ()         # ep_dispatch.CASES or ep_grads.CASES; () = the first
    cases_json: str = ""                # more cases, a JSON list of case dicts with a "name" (the hidden tests' draws)
    mesh: str = "2x2"                   # ep_dp: data-parallel x expert-parallel degrees
    steps: int = 2                      # dispatch: steps compared with the single process

    def validate(self) -> None:
        known = {"dispatch": ep_dispatch.CASES, "ep_dp": ep_grads.CASES}
        if self.exercise not in known:
            raise ValueError(f"exercise={self.exercise!r} must be 'dispatch' or 'ep_dp'")
        unknown = [c for c in self.cases if c not in known[self.exercise]]
        if unknown:
            raise ValueError(f"cases={self.cases}: unknown {unknown}; known: {sorted(known[self.exercise])} (others "
                             f"go in cases_json)")
        resolve = ep_dispatch.resolve_case if self.exercise == "dispatch" else ep_grads.resolve_case
        for case in self.extra_cases():
            resolve(case)
        try:
            dp, ep = ep_grads.parse_mesh(self.mesh)
        except ValueError:
            raise ValueError(f"mesh={self.mesh!r} is not 'DPxEP', e.g. '2x2'") from None
        if dp < 1 or ep < 1:
            raise ValueError(f"mesh={self.mesh!r} needs positive degrees")
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be at least 1")

    def extra_cases(self) -> list[dict]:
        return script.case_dicts(self.cases_json)

    def checked_cases(self) -> list:
        cases = list(self.cases) + self.extra_cases()
        return cases or [("uneven" if self.exercise == "dispatch" else "fp32")]

    def validate_world(self, world_size: int) -> None:
        if self.exercise == "ep_dp":
            dp, ep = ep_grads.parse_mesh(self.mesh)
            if dp * ep != world_size:
                raise ValueError(f"mesh={self.mesh} needs {dp * ep} ranks, got {world_size}; start it with "
                                 f"nproc={dp * ep}")


def run(env, config: Config) -> dict:
    impl = ep_probes.load_impl(config.impl, config.exercise)
    records = []
    if config.exercise == "dispatch":
        group = dist.group.WORLD
        for case in config.checked_cases():
            records += gather_objects(ep_dispatch.probe(impl, case, env.rank, env.world_size, group,
                                                        steps=config.steps, device=env.device), env)
            dist.barrier()
    else:
        dp, ep = ep_grads.parse_mesh(config.mesh)
        dp_groups, _ = ep_grads.mesh_groups(dp, ep)
        groups = [dist.new_group(ranks) for ranks in dp_groups]     # every rank creates every group, in order
        for case in config.checked_cases():
            records += gather_objects(ep_grads.probe(impl, case, env.rank, dp, ep, groups[env.rank % ep],
                                                     dist.group.WORLD, device=env.device), env)
            dist.barrier()
    return {"records": records if env.is_main else []}


def main() -> None:
    script.main(Config, run)


if __name__ == "__main__":
    main()
