"""Lab 08's graded step: the students' f and g, tensor-parallel MLP or attention on real ranks.

    torchrun --standalone --nproc-per-node 4 -m lablib.labs.tensor_parallel.run --impl tp_mlp_impl.py \\
        --exercise mlp --groups 2x2,3,4 --cases bias,nobias,indivisible --steps 3 --out out.json

One torchrun start checks several tensor-parallel sizes (``groups``): "4" is ranks 0-3 as one group; "3" is
ranks 0-2 (rank 3 waits at the next barrier), with that group standing in as the default group so code that
forgets the group argument still runs there; "2x2" is two groups, ranks {0, 1} and {2, 3}, at the same time:
code that reduces over the default group instead of the group passed in sums over 4 ranks there and fails.
What each rank does and records is ``probe``; the records of a group's ranks are merged on its
first. Exercise 2 (``mlp``) grades ``ColumnParallelLinear``, ``RowParallelLinear`` and ``TensorParallelMLP``, each
alone (``tp_probes.KINDS``); its records are named "<groups>:<kind>:<case>".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from lablib.jobs import script
from lablib.labs.tensor_parallel import probe as tp_probes
from lablib.probes.harness import default_group

EXERCISES = tp_probes.REQUIRED
# layer cases (``layers.CASES``) and the refusal of a size the group does not divide; f and g's inputs
# (``f_g.INPUTS``)
LAYER_CASES = {"bias", "nobias", "nograd", "noncontig", "shape", "bf16", "indivisible"}
F_G_CASES = {"plain", "bf16", "noncontig", "nograd"}


@dataclass(frozen=True)
class Config:
    impl: str = "tp_comm_impl.py"     # the module file the notebook's exercise cell writes
    exercise: str = "f_g"             # f_g, mlp or attention
    groups: tuple[str, ...] = ("2",)  # tensor-parallel groups to check, in turn: "N" or "KxN" (K groups of N at once)
    cases: tuple[str, ...] = ()       # see LAYER_CASES (mlp, attention) and F_G_CASES (f_g); () = the first
    steps: int = 2                    # SGD steps compared with the single process
    seed: int = 0

    def validate(self) -> None:
        if self.exercise not in EXERCISES:
            raise ValueError(f"exercise={self.exercise!r} must be one of {sorted(EXERCISES)}")
        known = F_G_CASES if self.exercise == "f_g" else LAYER_CASES
        unknown = [c for c in self.checked_cases() if c not in known]
        if unknown:
            raise ValueError(f"cases={self.cases}: unknown {unknown} for exercise {self.exercise}; known cases are "
                             f"{sorted(known)}")
        for spec in self.groups:
            try:
                count, size = tp_probes.parse_groups(spec)
            except ValueError:
                raise ValueError(f"groups={self.groups}: {spec!r} is not 'N' or 'KxN' (e.g. '3', '2x2')") from None
            if count < 1 or size < 1:
                raise ValueError(f"groups={self.groups}: {spec!r} needs positive sizes")
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be at least 1")

    def checked_cases(self) -> tuple[str, ...]:
        return self.cases or (("plain",) if self.exercise == "f_g" else ("bias",))

    def nproc(self) -> int:
        return tp_probes.nproc_for(self.groups)

    def validate_world(self, world_size: int) -> None:
        if world_size != self.nproc():
            raise ValueError(f"groups={self.groups} need exactly {self.nproc()} processes, got {world_size}; "
                             f"start it with nproc={self.nproc()}")


def probe(impl, config: Config, kind: str, case: str, size: int, group, env, tp_rank: int) -> dict:
    if config.exercise == "f_g":
        return tp_probes.probe_f_g(impl, size, group, tp_rank, config.checked_cases())
    if case == "indivisible":
        return tp_probes.probe_indivisible(impl, "attention" if kind == "attention" else kind, size, group)
    return tp_probes.probe_layer(impl, kind, size, group, env, case=case, steps=config.steps, seed=config.seed)


def run(env, config: Config) -> dict:
    impl = tp_probes.load_impl(config.impl, EXERCISES[config.exercise], reference_comm=config.exercise != "f_g")
    results = {}
    for i, spec in enumerate(config.groups):
        count, size = tp_probes.parse_groups(spec)
        # Every rank creates every group in the same order (new_group is collective).
        groups = [dist.new_group(list(range(k * size, (k + 1) * size))) for k in range(count)]
        mine = env.rank // size if env.rank < count * size else None
        lenient = count == 1 and size < env.world_size       # some ranks idle: the group stands in as default
        for kind, case in tp_probes.runs_of(config.exercise, config.checked_cases()):
            record = None
            if mine is not None:
                group = groups[mine]
                with default_group(group if lenient else None):
                    record = probe(impl, config, kind, case, size, group, env, dist.get_rank(group))
                record = tp_probes.gather_record(record, env, group)
            if count > 1:
                # Rank 0 also needs the verdict of the other groups: gather every group's merged record.
                merged = [None] * env.world_size
                dist.all_gather_object(merged, record if env.rank % size == 0 else None)
                records = [r for r in merged if r is not None]
                record = tp_probes.merge_ranks(records) if env.is_main else record
            if env.is_main:
                results[f"{spec}:{kind}:{case}"] = record
            dist.barrier()
        script.progress(env, i + 1, len(config.groups))
    return {"runs": results}


def main() -> None:
    script.main(Config, run)


if __name__ == "__main__":
    main()
