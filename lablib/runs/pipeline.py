"""Lab 09's step: the students' pipeline engine on real ranks, graded or timed.

    torchrun --standalone --nproc-per-node 4 -m lablib.runs.pipeline --impl engine_impl.py \\
        --cases gpipe:2:4,1f1b:4:3 --out out.json

Each case is "schedule:stages:micro-batches"; the job has as many processes as the largest case has stages,
and a case on p stages runs on ranks 0..p-1 (the others wait for it, lab 06's turns). What each rank does
and records is ``lablib.pipeline_probes.probe_engine``: one step with the course's reference schedule, on a
process group of its own with a short timeout, so a deadlock ends in a message instead of a hang. The
graded run stops at the first case that fails. With ``--repeat n`` (the measurement) each case runs n times
and the step of median idle time is kept (the first one warms up and is left out).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from lablib import script
from lablib.exercise import require_file
from lablib.models import GPTConfig
from lablib.pipeline_probes import (SMALL, busy_and_step, load_engine, measured_idle_fraction, parse_case,
                                    probe_engine)


@dataclass(frozen=True)
class Config:
    impl: str = "engine_impl.py"            # the module file the notebook's exercise cell writes
    cases: tuple[str, ...] = ("gpipe:2:4", "1f1b:2:4")
    p2p_timeout_s: float = 15.0             # a send/recv waiting longer than this is a deadlock
    repeat: int = 1                          # steps per case (more than one: the median-idle step after the first)
    micro_batch: int = 2                     # sequences per micro-batch
    n_layer: int = SMALL.n_layer
    n_embd: int = SMALL.n_embd
    n_head: int = SMALL.n_head
    block_size: int = SMALL.block_size
    seed: int = 0

    def validate(self) -> None:
        if not self.cases:
            raise ValueError("cases is empty; give at least one, e.g. gpipe:2:4")
        for case in self.cases:
            _, p, m = parse_case(case)
            if p < 1 or m < 1 or p > self.n_layer:
                raise ValueError(f"case {case!r}: needs 1 <= stages <= n_layer={self.n_layer} and micro-batches >= 1")
        if self.p2p_timeout_s <= 0 or self.repeat < 1 or self.micro_batch < 1:
            raise ValueError(f"p2p_timeout_s={self.p2p_timeout_s}, repeat={self.repeat} and micro_batch="
                             f"{self.micro_batch} must be positive")
        require_file(self.impl)

    def validate_world(self, world_size: int) -> None:
        need = max(parse_case(c)[1] for c in self.cases)
        if world_size != need:
            raise ValueError(f"cases {self.cases} need exactly {need} processes (the most stages), got {world_size}")


def run(env, config: Config) -> dict:
    impl = load_engine(config.impl)
    model = GPTConfig(vocab_size=SMALL.vocab_size, block_size=config.block_size, n_layer=config.n_layer,
                      n_head=config.n_head, n_embd=config.n_embd)
    results = {}
    for i, case in enumerate(config.cases):
        steps = []
        for step in range(config.repeat):
            dist.barrier()                     # the ranks start the step together (the Gantt chart's zero)
            steps.append(probe_engine(impl, case, env, p2p_timeout_s=config.p2p_timeout_s, seed=config.seed,
                                      micro_batch=config.micro_batch, config=model, tag=f"{i}.{step}"))
            if not steps[-1]["ok"]:
                break
        result = steps[-1]
        if env.is_main and result["ok"] and len(steps) > 1:   # the step of median idle time, the first one left out
            timed = sorted(steps[1:], key=measured_idle_fraction)
            result = dict(timed[len(timed) // 2], idle_fractions=[measured_idle_fraction(s) for s in steps[1:]],
                          step_s=[busy_and_step(s)[1] for s in steps[1:]])
        results[case] = result
        script.progress(env, i + 1, len(config.cases))
        if not result["ok"]:                   # every rank read every stage's record: all stop here together
            break
    return {"runs": results if env.is_main else {}}


def main() -> None:
    script.main(Config, run)


if __name__ == "__main__":
    main()
