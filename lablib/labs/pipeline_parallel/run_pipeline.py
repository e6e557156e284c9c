"""Lab 09's step: the students' pipeline engine on real ranks, graded or timed.

    torchrun --standalone --nproc-per-node 2 -m lablib.labs.pipeline_parallel.run_pipeline --impl engine_impl.py --out out.json \\
        --cases gpipe:2:2,1f1b:2:3 --orders "F0 F1 B0 B1/F0 F1 B0 B1,F0 F1 B0 F2 B1 B2/F0 B0 F1 B1 F2 B2"

Each case is "schedule:stages:micro-batches" (a label: the schedule's name, p and m), and its entry in
``orders`` the op lists the engine runs, rank by rank ("/" between ranks; ``lablib.parallel.pipeline.orders_text``):
the run makes no schedule of its own. The job has as many processes as the largest case has stages, and a
case on p stages runs on ranks 0..p-1 (the others wait for it, lab 06's turns). What each rank does and
records is ``probe.probe_engine``: one step, on a process group of its own with a short
timeout, so a deadlock ends in a message instead of a hang. The graded run stops at the first case that
fails. With ``--repeat n`` (the measurement) the cases run in n rounds, each case once per round, the order rotated
by one case each round (over as many rounds as there are cases, each case runs once in each place of a round); the
first round warms up and is left out. With ``--floor CASE`` that case runs a second time in every round, half a
round away from its first run: the same code timed against itself, the noise floor of the comparisons between cases
(its steps are kept as ``floor_step_s`` and ``floor_idle_fractions``, round by round beside its own). Per case the
step of median idle share is kept (with an odd number of timed rounds the median itself; with an even number the
upper of the two middle ones, ``drawn_round`` says which), with every timed step's idle share, stopwatch time (per step the slowest rank, as ``run_pipeline_torch`` times
torch's schedules), per-stage costs (``costs.stage_costs``) and the idle share the timing model gives when fed that
step's own costs (``costs.simulate``); then one more step under
``lablib.measure.memory.MemoryTimeline`` gives the saved activations each rank really held at its peak.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lablib.jobs import script
from lablib.jobs.exercise import require_file
from lablib.course.models import GPTConfig
from lablib.parallel.pipeline import idle_fraction, parse_orders
from lablib.labs.pipeline_parallel.costs import simulate, stage_costs
from lablib.labs.pipeline_parallel.probe import SMALL, check_orders, load_engine, parse_case, probe_engine

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class Config:
    impl: str = "engine_impl.py"            # the module file the notebook's exercise cell writes
    cases: tuple[str, ...] = ("gpipe:2:2", "1f1b:2:3")
    orders: tuple[str, ...] = ("F0 F1 B0 B1/F0 F1 B0 B1", "F0 F1 B0 F2 B1 B2/F0 B0 F1 B1 F2 B2")   # one per case
    p2p_timeout_s: float = 15.0             # a send/recv waiting longer than this is a deadlock
    repeat: int = 1                          # rounds, each case one step per round (more: round 0 warms up)
    floor: str = ""                          # a case timed twice per round (the noise floor), or "" for none
    micro_batch: int = 2                     # sequences per micro-batch
    n_layer: int = SMALL.n_layer
    n_embd: int = SMALL.n_embd
    n_head: int = SMALL.n_head
    block_size: int = SMALL.block_size
    seed: int = 0
    dtype: str = "float32"                   # the GPT's parameters, so the activations that cross between ranks

    def validate(self) -> None:
        if not self.cases:
            raise ValueError("cases is empty; give at least one, e.g. gpipe:2:4")
        if len(self.orders) != len(self.cases):
            raise ValueError(f"{len(self.cases)} cases but {len(self.orders)} orders: give each case its op lists, "
                             f"e.g. --cases gpipe:2:2 --orders 'F0 F1 B0 B1/F0 F1 B0 B1'")
        for case, orders in zip(self.cases, self.orders):
            _, p, m = parse_case(case)
            if p < 1 or m < 1 or p > self.n_layer:
                raise ValueError(f"case {case!r}: needs 1 <= stages <= n_layer={self.n_layer} and micro-batches >= 1")
            check_orders(case, parse_orders(orders))
        if self.p2p_timeout_s <= 0 or self.repeat < 1 or self.micro_batch < 1:
            raise ValueError(f"p2p_timeout_s={self.p2p_timeout_s}, repeat={self.repeat} and micro_batch="
                             f"{self.micro_batch} must be positive")
        if self.floor and (self.floor not in self.cases or self.repeat < 2):
            raise ValueError(f"floor={self.floor!r}: give one of the cases {self.cases}, timed twice per round, and "
                             f"repeat >= 2 (round 0 warms up; repeat={self.repeat})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: use one of {sorted(DTYPES)}")
        require_file(self.impl)

    def validate_world(self, world_size: int) -> None:
        need = max(parse_case(c)[1] for c in self.cases)
        if world_size != need:
            raise ValueError(f"cases {self.cases} need exactly {need} processes (the most stages), got {world_size}")


def run(env, config: Config) -> dict:
    impl = load_engine(config.impl)
    model = GPTConfig(vocab_size=SMALL.vocab_size, block_size=config.block_size, n_layer=config.n_layer,
                      n_head=config.n_head, n_embd=config.n_embd)

    def probe(i: int, tag: str, memory: bool = False) -> dict:
        return probe_engine(impl, config.cases[i], parse_orders(config.orders[i]), env,
                            p2p_timeout_s=config.p2p_timeout_s, seed=config.seed, micro_batch=config.micro_batch,
                            config=model, tag=f"{i}.{tag}", memory=memory, dtype=DTYPES[config.dtype])

    # Rounds, not one case after another: round k runs every case once, the listed order rotated by k, so a burst
    # of load from another program falls on all cases of a round instead of on one case's steps, and no case always
    # runs first or last. The floor case's second copy ("again") sits half a round from its first in the list, so
    # the two are never parked together at one end of a round. Round 0 warms up and is left out. probe_engine
    # starts the ranks' step together (a barrier). The graded run (repeat 1) is one round in the listed order,
    # stopping at the first case that fails.
    arms: list = list(range(len(config.cases)))
    if config.floor:
        first = config.cases.index(config.floor)
        arms.insert((first + (len(arms) + 1) // 2) % len(arms) + 1, "again")
    steps: dict = {a: [] for a in arms}
    failed = None
    for step in range(config.repeat):
        k = step % len(arms)
        for a in arms[k:] + arms[:k]:
            i = config.cases.index(config.floor) if a == "again" else a
            steps[a].append(probe(i, f"{step}{'a' if a == 'again' else ''}"))
            if not steps[a][-1]["ok"]:   # every rank read every stage's record: all stop here together
                failed = i
                break
        script.progress(env, step + 1, config.repeat)
        if failed is not None:
            break
    results = {}
    for i, case in enumerate(config.cases):
        if not steps[i]:
            continue
        result = steps[i][-1]
        if failed is None and config.repeat > 1:   # every rank: one more step, its memory sampled (not timed)
            held = probe(i, "mem", memory=True)
            if env.is_main:                         # the step of median idle share, the warm-up round left out
                timed = steps[i][1:]
                by_idle = sorted(range(len(timed)), key=lambda k: idle_fraction(timed[k]["events"]))
                drawn = by_idle[len(by_idle) // 2]  # the median of an odd count; the upper middle of an even one
                result = dict(timed[drawn], drawn_round=drawn + 1, idle_fractions=[idle_fraction(s["events"]) for s in timed],
                              step_s=[s["step_s"] for s in timed],
                              stage_costs=[stage_costs(s["events"]) for s in timed],
                              model_idle_fractions=[idle_fraction(simulate(s["schedule"], stage_costs(s["events"])))
                                                    for s in timed],
                              peak_activation_bytes=held.get("peak_activation_bytes"))
                if config.floor == case:            # the same case again, round by round: the noise floor
                    result.update(floor_step_s=[s["step_s"] for s in steps["again"][1:]],
                                  floor_idle_fractions=[idle_fraction(s["events"]) for s in steps["again"][1:]])
        results[case] = result
        if i == failed:
            break
    return {"runs": results if env.is_main else {}}


def main() -> None:
    script.main(Config, run)


if __name__ == "__main__":
    main()
