"""Lab 12's multi-process steps: the students' ring attention (forward, backward) and Ulysses re-shard checked on
real ranks, and the idle time of the contiguous and zigzag splits measured.

    torchrun --standalone --nproc-per-node 2 -m lablib.runs.context_parallel --exercise ring_forward \\
        --impl cp_ring_impl.py --cases causal,shuffled --out out.json
    torchrun --standalone --nproc-per-node 2 -m lablib.runs.context_parallel --exercise idle \\
        --impl cp_split_impl.py --seq_len 1024 --out out.json

Checking (``ring_forward``, ``ring_backward``, ``ulysses``): every rank runs lablib.probes.cp_ring's (or cp_ulysses')
probe on each case and rank 0 gathers the records, [case][rank]. ``idle``: one causal ring pass per split
(lablib.measure.cp_idle), the contiguous split and the zigzag split of the students' ``zigzag_positions``
(``impl``), after a barrier; each rank's compute seconds, span and pairs per step, gathered.

The tensors live on the CPU and travel through gloo on every machine (on GPUs the default group is NCCL, and a
gloo group is made next to it, as lab 02 does): gloo's send/recv take CPU tensors only, and one backend keeps the
counts and times comparable; the check sizes are far too small for a GPU to matter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch.distributed as dist

from lablib.course.cp_model import contiguous_positions
from lablib.jobs import exercise, script
from lablib.measure import cp_idle
from lablib.measure.p2p import CountingComm
from lablib.measure.rankcheck import gather_objects
from lablib.probes import cp_ring, cp_ulysses

EXERCISES = {"ring_forward": ("ring_attention_forward",), "ring_backward": ("ring_attention_backward",),
             "ulysses": ("seq_to_head", "head_to_seq", "ulysses_attention"), "idle": ("zigzag_positions",)}


@dataclass(frozen=True)
class Config:
    impl: str = "cp_ring_impl.py"      # the module file the notebook's exercise cell writes
    exercise: str = "ring_forward"     # ring_forward, ring_backward, ulysses or idle
    cases: tuple[str, ...] = ()        # names in lablib.probes.cp_ring.CASES (ring) or cp_ulysses.CASES
    cases_json: str = ""               # more cases, a JSON list of case dicts with a "name" (the hidden tests' draws)
    seq_len: int = 1024                # idle: the sequence length
    n_head: int = 4                    # idle: heads (batch 1, head size head_dim)
    head_dim: int = 32
    repeats: int = 2                   # idle: how often each score block is computed (longer steps)
    seed: int = 0

    def extra_cases(self) -> list[dict]:
        cases = json.loads(self.cases_json) if self.cases_json else []
        if not isinstance(cases, list) or not all(isinstance(c, dict) and "name" in c for c in cases):
            raise ValueError(f"cases_json={self.cases_json!r} must be a JSON list of case dicts, each with a 'name'")
        return cases

    def validate(self) -> None:
        if self.exercise not in EXERCISES:
            raise ValueError(f"exercise={self.exercise!r} must be one of {sorted(EXERCISES)}")
        known = cp_ulysses.CASES if self.exercise == "ulysses" else cp_ring.CASES
        unknown = [c for c in self.cases if c not in known]
        if self.exercise != "idle" and unknown:
            raise ValueError(f"cases={self.cases}: unknown {unknown}; known: {sorted(known)} (others go in cases_json)")
        resolve = cp_ulysses.resolve_case if self.exercise == "ulysses" else cp_ring.resolve_case
        extra = [resolve(c) for c in self.extra_cases()]
        threads_only = [c["name"] for c in extra if c.get("groups", 1) > 1]
        if self.exercise != "idle" and threads_only:
            raise ValueError(f"cases_json: {threads_only} cut the world into groups and run on thread ranks only "
                             f"(cp_ulysses.rehearse_ulysses); leave them out here")
        if min(self.seq_len, self.n_head, self.head_dim, self.repeats) < 1:
            raise ValueError("seq_len, n_head, head_dim and repeats must be at least 1")


def run(env, config: Config) -> dict:
    module = exercise.load_module(config.impl, EXERCISES[config.exercise])
    group = dist.group.WORLD if env.backend == "gloo" else dist.new_group(backend="gloo")
    comm = CountingComm(env.rank, env.world_size, group=None if env.backend == "gloo" else group)
    if config.exercise == "idle":
        splits = {"contiguous": contiguous_positions(config.seq_len, env.world_size),
                  "zigzag": module.zigzag_positions(config.seq_len, env.world_size)}
        result = {}
        for name, positions in splits.items():
            cp_idle.timed_ring(comm, positions, 1, config.n_head, config.head_dim, 1, config.seed)   # warm-up
            dist.barrier(group=group)
            rows = cp_idle.timed_ring(comm, positions, 1, config.n_head, config.head_dim, config.repeats, config.seed)
            result[name] = gather_objects(rows, env, group)
        return {"idle": result}
    cases = list(config.cases) + config.extra_cases()
    if not cases:
        cases = list(cp_ulysses.CASES if config.exercise == "ulysses" else cp_ring.CASES)[:1]
    records = {}
    for i, case in enumerate(cases):
        if config.exercise == "ulysses":
            record = cp_ulysses.probe_ulysses(module, group, case, config.seed)
        else:
            comm.reset()
            record = cp_ring.probe_ring(module, config.exercise, comm, case, config.seed)
        records[record["case"]] = gather_objects(record, env, group)
        script.progress(env, i + 1, len(cases))
    return {"records": records}


def main() -> None:
    script.main(Config, run)


if __name__ == "__main__":
    main()
