"""Lab 12's multi-process steps: the students' ring attention (forward, backward) and Ulysses re-shard checked on
real ranks, and the idle time of the contiguous and zigzag splits measured.

    torchrun --standalone --nproc-per-node 2 -m lablib.runs.context_parallel --exercise ring_forward \\
        --impl cp_ring_impl.py --cases causal,shuffled --out out.json
    torchrun --standalone --nproc-per-node 2 -m lablib.runs.context_parallel --exercise idle \\
        --impl cp_split_impl.py --seq_len 1024 --flex_seq_len 512 --gather_rounds 4 --out out.json

Checking (``ring_forward``, ``ring_backward``, ``ulysses``): every rank runs lablib.probes.cp_ring's (or cp_ulysses')
probe on each case and rank 0 gathers the records, [case][rank]. ``idle``: one causal ring pass per split
(lablib.measure.cp_idle), the contiguous split and the zigzag split of the students' ``zigzag_positions``
(``impl``), after a barrier; each rank's compute seconds, span and pairs per step, gathered. With ``flex_seq_len``
> 0 the same start then runs torch's own FlexAttention context parallelism (K/V all-gathered) on the CPU ranks and
compares it with one process (``lablib.measure.cp_torch``), uncompiled block mask unless ``flex_compile``; with
``gather_rounds`` > 0, before that, rounds of the ring, the gathered-K/V variant (cp_idle.timed_gather) and the ring
again: span, bytes sent and largest K/V held per rank.

The tensors live on the CPU and travel through gloo on every machine (on GPUs the default group is NCCL, and a
gloo group is made next to it, as lab 02 does): gloo's send/recv take CPU tensors only, and one backend keeps the
counts and times comparable; the check sizes are far too small for a GPU to matter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from lablib.course.cp_model import contiguous_positions
from lablib.jobs import exercise, script
from lablib.measure import cp_idle, cp_torch
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
    flex_seq_len: int = 0              # idle: then torch's FlexAttention context parallelism at this T (0: not run)
    flex_compile: bool = False         # build its block mask with torch.compile, as torch does (gcc, slow on a CPU)
    gather_rounds: int = 0             # idle: then rounds of ring, gathered K/V, ring again (0: not run)

    def extra_cases(self) -> list[dict]:
        return script.case_dicts(self.cases_json)

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
        if self.flex_seq_len < 0 or (self.flex_seq_len and self.exercise != "idle"):
            raise ValueError(f"flex_seq_len={self.flex_seq_len} must be 0 or positive, and runs with exercise 'idle'")
        if self.gather_rounds < 0 or (self.gather_rounds and self.exercise != "idle"):
            raise ValueError(f"gather_rounds={self.gather_rounds} must be 0 or positive, and runs with exercise 'idle'")
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
        out = {"idle": result}
        if config.gather_rounds:
            out["gather_vs_ring"] = gather_vs_ring(env, comm, group, config)
        if config.flex_seq_len:
            out["flex"] = cp_torch.flex_cp_compare(env, group, config.flex_seq_len, config.n_head, config.head_dim,
                                                   config.flex_compile, config.seed)
        return out
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


def gather_vs_ring(env, comm, group, config: Config) -> list[dict]:
    """``gather_rounds`` rounds of: the ring, the gathered-K/V variant, the ring again (its difference from the first
    ring is the noise floor), each after a barrier, on the contiguous split; per round and rank the span, the bytes
    sent and the largest K/V held, gathered to rank 0."""
    positions = contiguous_positions(config.seq_len, env.world_size)
    args = (positions, 1, config.n_head, config.head_dim, config.repeats, config.seed)
    rounds = []
    for _ in range(config.gather_rounds):
        row = {}
        for name in ("ring", "gather", "ring_again"):
            dist.barrier(group=group)
            comm.reset()
            got = cp_idle.timed_gather(group, *args) if name == "gather" else cp_idle.timed_ring(comm, *args)
            if name != "gather":
                got["bytes_sent"] = comm.counts()["bytes_sent"]
            row[name] = {key: got[key] for key in ("span_s", "bytes_sent", "largest_kv_bytes")}
        rounds.append(gather_objects(row, env, group))
    return rounds


def main() -> None:
    script.main(Config, run)


if __name__ == "__main__":
    main()
