"""Lab 12's multi-process steps: the students' ring attention (forward, backward) and Ulysses re-shard checked on
real ranks, and the idle time of the contiguous and zigzag splits measured.

    torchrun --standalone --nproc-per-node 2 -m lablib.labs.context_parallel.run --exercise ring_forward \\
        --impl cp_ring_impl.py --cases causal,shuffled --out out.json
    torchrun --standalone --nproc-per-node 2 -m lablib.labs.context_parallel.run --exercise idle \\
        --impl cp_split_impl.py --seq_len 1024 --flex_seq_len 512 --gather_rounds 4 --out out.json

Checking (``ring_forward``, ``ring_backward``, ``ulysses``): every rank runs lablib.labs.context_parallel.cp_ring's (or cp_ulysses')
probe on each case and rank 0 gathers the records, [case][rank]. ``idle``: ``idle_rounds`` rounds of one causal
ring pass per split (lablib.labs.context_parallel.cp_idle), the contiguous split and the zigzag split of the students'
``zigzag_positions`` (``impl``), the order alternating by round (A B, B A, ...), each after a barrier and after one
warm-up pass of each; each rank's compute seconds (wall and this thread's CPU), span and pairs per step, gathered,
[split][round][rank]. With ``flex_seq_len``
> 0 the same start then runs torch's own FlexAttention context parallelism (K/V all-gathered) on the CPU ranks and
compares it with one process (``lablib.labs.context_parallel.cp_torch``), uncompiled block mask unless ``flex_compile``; with
``gather_rounds`` > 0, before that, rounds of the ring, the gathered-K/V variant (cp_idle.timed_gather) twice and
the ring again: span, seconds waiting for K/V, bytes sent and largest K/V held per rank.

The tensors live on the CPU and travel through gloo on every machine (on GPUs the default group is NCCL, and a
gloo group is made next to it, as lab 02 does): gloo's send/recv take CPU tensors only, and one backend keeps the
counts and times comparable; the check sizes are far too small for a GPU to matter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from lablib.labs.context_parallel.cp_model import contiguous_positions
from lablib.jobs import exercise, script
from lablib.labs.context_parallel import cp_idle, cp_torch
from lablib.measure.p2p import CountingComm
from lablib.jobs.distenv import gather_objects
from lablib.labs.context_parallel import cp_ring, cp_ulysses

EXERCISES = {"ring_forward": ("ring_attention_forward",), "ring_backward": ("ring_attention_backward",),
             "ulysses": ("seq_to_head", "head_to_seq", "ulysses_attention"), "idle": ("zigzag_positions",)}


@dataclass(frozen=True)
class Config:
    impl: str = "cp_ring_impl.py"      # the module file the notebook's exercise cell writes
    exercise: str = "ring_forward"     # ring_forward, ring_backward, ulysses or idle
    cases: tuple[str, ...] = ()        # names in lablib.labs.context_parallel.cp_ring.CASES (ring) or cp_ulysses.CASES
    cases_json: str = ""               # more cases, a JSON list of case dicts with a "name" (the hidden tests' draws)
    seq_len: int = 1024                # idle: the sequence length
    n_head: int = 4                    # idle: heads (batch 1, head size head_dim)
    head_dim: int = 32
    repeats: int = 2                   # idle: how often each score block is computed (longer steps)
    seed: int = 0
    flex_seq_len: int = 0              # idle: then torch's FlexAttention context parallelism at this T (0: not run)
    flex_compile: bool = False         # build its block mask with torch.compile, as torch does (gcc, slow on a CPU)
    gather_rounds: int = 0             # idle: then rounds of ring, gathered K/V, gathered K/V, ring (0: not run)
    idle_rounds: int = 1               # idle: timed passes of each split, alternating which goes first

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
        threads_only = [c["name"] for c in extra if c.get("groups", 1) != 1]
        if self.exercise != "idle" and threads_only:
            raise ValueError(f"cases_json: {threads_only} cut the world into groups and run on thread ranks only "
                             f"(cp_ulysses.rehearse_ulysses); leave them out here")
        if self.flex_seq_len < 0 or (self.flex_seq_len and self.exercise != "idle"):
            raise ValueError(f"flex_seq_len={self.flex_seq_len} must be 0 or positive, and runs with exercise 'idle'")
        if self.idle_rounds < 1:
            raise ValueError(f"idle_rounds={self.idle_rounds} must be at least 1")
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
        for positions in splits.values():
            cp_idle.timed_ring(comm, positions, 1, config.n_head, config.head_dim, 1, config.seed)   # warm-up
        result = {name: [] for name in splits}
        for r in range(config.idle_rounds):              # A B, B A, A B, ...: neither split always goes first
            for name in (list(splits) if r % 2 == 0 else list(splits)[::-1]):
                dist.barrier(group=group)
                rows = cp_idle.timed_ring(comm, splits[name], 1, config.n_head, config.head_dim, config.repeats,
                                          config.seed)
                result[name].append(gather_objects(rows, env, group))
        out = {"idle": result}      # [split][round][rank]
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
    """``gather_rounds`` rounds of: the ring, the gathered-K/V variant twice, the ring again (A B B A: the two rings'
    difference is the noise floor, and neither variant always runs first or last), each after a barrier, on the
    contiguous split, after a warm-up of both; per round and rank the span, the seconds spent waiting for K/V (the
    ring's waits after its products, the gather's exposed collective), the bytes sent (the ring's counted where it
    sends, the gather's from the formula) and the largest K/V held, gathered to rank 0."""
    positions = contiguous_positions(config.seq_len, env.world_size)
    args = (positions, 1, config.n_head, config.head_dim, config.repeats, config.seed)
    cp_idle.timed_gather(group, positions, 1, config.n_head, config.head_dim, 1, config.seed)     # warm-ups
    cp_idle.timed_ring(comm, positions, 1, config.n_head, config.head_dim, 1, config.seed)
    rounds = []
    for _ in range(config.gather_rounds):
        row = {}
        for name in ("ring", "gather", "gather_again", "ring_again"):
            dist.barrier(group=group)
            comm.reset()
            if name.startswith("gather"):
                got = cp_idle.timed_gather(group, *args)
                got["kv_wait_s"] = got["gather_s"]
            else:
                got = cp_idle.timed_ring(comm, *args)
                got["bytes_sent"], got["kv_wait_s"] = comm.counts()["bytes_sent"], sum(got["wait_s"])
            row[name] = {key: got[key] for key in ("span_s", "kv_wait_s", "bytes_sent", "largest_kv_bytes")}
        rounds.append(gather_objects(row, env, group))
    return rounds


def main() -> None:
    script.main(Config, run)


if __name__ == "__main__":
    main()
