"""lablib.measure.timing: the one definition of a step's time across ranks."""

from __future__ import annotations

import itertools
import json
import time

import pytest
import torch

from lablib.jobs import launch
from lablib.measure import timing

CPU = torch.device("cpu")


def test_stopwatch_times_the_block():
    times = []
    with timing.stopwatch(times, CPU):
        time.sleep(0.05)
    with timing.stopwatch(times, CPU):
        pass
    assert len(times) == 2 and 0.05 <= times[0] < 0.5 and times[1] < times[0]


def test_median_and_its_empty_case():
    assert timing.median([3.0, 1.0, 100.0]) == 3.0
    with pytest.raises(ValueError, match="no timed steps"):
        timing.median([])


def test_step_times_in_one_process_leave_out_the_warmup():
    out = timing.step_times([9.0, 0.2, 0.1, 0.3], CPU, warmup=1)
    assert out == {"median_step_s": 0.2, "step_s": [0.2, 0.1, 0.3]}
    with pytest.raises(ValueError, match="warmup=2"):
        timing.step_times([0.1, 0.2], CPU, warmup=2)


def test_per_step_maximum_then_median_across_ranks(tmp_path):
    # Rank 0 is slow at even steps, rank 1 at odd ones: every step of the job took 0.3 s, while each rank's
    # own median is 0.1 s (the other definition, a maximum of medians, would report 0.1).
    script = tmp_path / "steps.py"
    script.write_text(
        "import json, torch, torch.distributed as dist\n"
        "from lablib.measure import timing\n"
        "dist.init_process_group('gloo')\n"
        "r = dist.get_rank()\n"
        "mine = [0.3 if (k + r) % 2 == 0 else 0.1 for k in range(5)] + [0.1]\n"
        "out = timing.step_times(mine, torch.device('cpu'))\n"
        "print(json.dumps({'rank': r, **out}))\n"
        "dist.destroy_process_group()\n")
    run = launch.run_script(script, nproc=2, timeout_s=90, quiet=True)
    assert run.returncode == 0, run.rank_output
    for rank in (0, 1):
        out = json.loads(next(line for line in run.rank_output[rank].splitlines() if line.startswith("{")))
        assert out["step_s"] == [0.3, 0.3, 0.3, 0.3, 0.3, 0.1] and out["median_step_s"] == 0.3


def test_against_reference_reads_a_row_against_the_reference_timed_against_itself():
    reference = [0.10, 0.11, 0.09, 0.10, 0.12, 0.10]
    slower = timing.against_reference([0.20, 0.21, 0.19, 0.22, 0.20, 0.18], reference)
    assert slower["verdict"] == "slower" and slower["above"] == 6 and slower["ratio"] == pytest.approx(2.0)
    assert slower["floor_range"] == pytest.approx([0.9, 1.2])
    alike = timing.against_reference([0.10, 0.115, 0.095, 0.105, 0.10, 0.11], reference)
    assert alike["verdict"] == "within noise"
    with pytest.raises(ValueError, match="need both"):
        timing.against_reference([], reference)


def test_turn_order_balances_which_arm_runs_right_before_which():
    """A rotation (A B C, B C A, C A B) keeps each arm's predecessor the same in every round; turn_order's six orders
    of three arms put each arm first twice and right after each other arm twice (it is the same on every rank:
    no per-process randomness); more arms get a seeded shuffle, repeatable."""
    orders = [timing.turn_order("ABC", r) for r in range(6)]
    assert sorted(map(tuple, orders)) == sorted(itertools.permutations("ABC"))
    follows = {}
    for o in orders:
        for a, b in zip(o, o[1:]):
            follows[a, b] = follows.get((a, b), 0) + 1
    assert len(follows) == 6 and set(follows.values()) == {2}
    assert [timing.turn_order("AB", r) for r in range(2)] == [["A", "B"], ["B", "A"]]
    seven = [timing.turn_order(range(7), r, seed=3) for r in range(9)]
    assert seven == [timing.turn_order(range(7), r, seed=3) for r in range(9)] and all(sorted(o) == list(range(7)) for o in seven)
    assert len({tuple(o) for o in seven}) > 1


def test_turn_order_puts_every_arm_in_every_place():
    orders = [tuple(timing.turn_order("ABC", r)) for r in range(6)]
    assert len(set(orders)) == 6                       # every order of three arms once: none parked at the ends
    for place in range(3):
        assert sorted(o[place] for o in orders) == list("AABBCC")


def test_take_turns_times_wall_and_cpu_in_round_order():
    log = []

    def sleeper():                                      # wall time without CPU time
        log.append("sleep")
        time.sleep(0.02)

    def spinner():                                      # CPU time, as long as the process gets a core
        log.append("spin")
        t0 = time.process_time()
        while time.process_time() - t0 < 0.01:
            pass

    out = timing.take_turns({"sleep": sleeper, "spin": spinner}, rounds=4, device=CPU)
    # warm-up, then the rounds A B, B A, A B, B A (turn_order)
    assert log == ["sleep", "spin"] + ["sleep", "spin", "spin", "sleep", "sleep", "spin", "spin", "sleep"]
    for name in ("sleep", "spin"):
        assert len(out[name]["step_s"]) == len(out[name]["cpu_s"]) == 4
    assert min(out["sleep"]["step_s"]) >= 0.02 and out["sleep"]["median_cpu_s"] < 0.01
    assert out["spin"]["median_cpu_s"] >= 0.01
    with pytest.raises(ValueError, match="2 arms"):
        timing.take_turns({"sleep": sleeper}, rounds=4, device=CPU)
