"""Lab 08's graded step: the students' f and g, tensor-parallel MLP or attention on real ranks.

    torchrun --standalone --nproc-per-node 4 -m lablib.runs.tensor_parallel --impl tp_mlp_impl.py \\
        --exercise mlp --groups 2x2,3,4 --cases bias,nobias --steps 3 --out out.json

One torchrun start checks several tensor-parallel sizes (``groups``): "4" is ranks 0-3 as one group; "3" is
ranks 0-2 (rank 3 waits at the next barrier), with that group standing in as the default group so code that
forgets the group argument still runs there; "2x2" is two groups, ranks {0, 1} and {2, 3}, at the same time:
code that reduces over the default group instead of the group passed in sums over 4 ranks there and fails.
What each rank does and records is ``lablib.probes.tensor_parallel``; the records of a group's ranks are merged on its first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from lablib.jobs import script
from lablib.probes import tensor_parallel as tp_probes
from lablib.probes.ddp import default_group

EXERCISES = {"f_g": ("f", "g"), "mlp": ("TensorParallelMLP",), "attention": ("TensorParallelAttention",)}
CASES = {"bias", "nobias", "indivisible"}


@dataclass(frozen=True)
class Config:
    impl: str = "tp_comm_impl.py"     # the module file the notebook's exercise cell writes
    exercise: str = "f_g"             # f_g, mlp or attention
    groups: tuple[str, ...] = ("2",)  # tensor-parallel groups to check, in turn: "N" or "KxN" (K groups of N at once)
    cases: tuple[str, ...] = ("bias",)  # bias, nobias (mlp, attention), indivisible (attention: n_head = N + 1)
    steps: int = 2                    # SGD steps compared with the single process
    seed: int = 0

    def validate(self) -> None:
        if self.exercise not in EXERCISES:
            raise ValueError(f"exercise={self.exercise!r} must be one of {sorted(EXERCISES)}")
        unknown = [c for c in self.cases if c not in CASES]
        if unknown or not self.cases:
            raise ValueError(f"cases={self.cases}: unknown {unknown}; known cases are {sorted(CASES)}")
        for spec in self.groups:
            try:
                count, size = tp_probes.parse_groups(spec)
            except ValueError:
                raise ValueError(f"groups={self.groups}: {spec!r} is not 'N' or 'KxN' (e.g. '3', '2x2')") from None
            if count < 1 or size < 1:
                raise ValueError(f"groups={self.groups}: {spec!r} needs positive sizes")
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be at least 1")

    def nproc(self) -> int:
        return tp_probes.nproc_for(self.groups)

    def validate_world(self, world_size: int) -> None:
        if world_size != self.nproc():
            raise ValueError(f"groups={self.groups} need exactly {self.nproc()} processes, got {world_size}; "
                             f"start it with nproc={self.nproc()}")


def probe(impl, config: Config, case: str, size: int, group, env, tp_rank: int) -> dict:
    if config.exercise == "f_g":
        return tp_probes.probe_f_g(impl, size, group, tp_rank)
    if case == "indivisible":
        return tp_probes.probe_indivisible(impl, size, group)
    return tp_probes.probe_layer(impl, config.exercise, size, group, env, bias=case == "bias", steps=config.steps,
                                 seed=config.seed)


def run(env, config: Config) -> dict:
    impl = tp_probes.load_impl(config.impl, EXERCISES[config.exercise], reference_comm=config.exercise != "f_g")
    cases = ("bias",) if config.exercise == "f_g" else \
        [c for c in config.cases if c != "indivisible" or config.exercise == "attention"]
    results = {}
    for i, spec in enumerate(config.groups):
        count, size = tp_probes.parse_groups(spec)
        # Every rank creates every group in the same order (new_group is collective).
        groups = [dist.new_group(list(range(k * size, (k + 1) * size))) for k in range(count)]
        mine = env.rank // size if env.rank < count * size else None
        lenient = count == 1 and size < env.world_size       # some ranks idle: the group stands in as default
        for case in cases:
            record = None
            if mine is not None:
                group = groups[mine]
                with default_group(group if lenient else None):
                    record = probe(impl, config, case, size, group, env, dist.get_rank(group))
                record = tp_probes.gather_record(record, env, group)
            if count > 1:
                # Rank 0 also needs the verdict of the other groups: gather every group's merged record.
                merged = [None] * env.world_size
                dist.all_gather_object(merged, record if env.rank % size == 0 else None)
                records = [r for r in merged if r is not None]
                record = tp_probes.merge_ranks(records) if env.is_main else record
            if env.is_main:
                results[f"{spec}:{case}"] = record
            dist.barrier()
        script.progress(env, i + 1, len(config.groups))
    return {"runs": results}


def main() -> None:
    script.main(Config, run)


if __name__ == "__main__":
    main()
