"""lablib.scaling and the amdahl_scaling run script (lab 03): formulas on numbers, then two small torchrun runs."""

from __future__ import annotations

import math

import pytest
import torch

from lablib import config as cfg
from lablib import launch, scaling
from lablib.runs import amdahl_scaling


def test_speedups_and_efficiencies():
    s = scaling.speedups({4: 0.03, 1: 0.1, 2: 0.05})
    assert list(s) == [1, 2, 4]
    assert s == pytest.approx({1: 1.0, 2: 2.0, 4: 0.1 / 0.03})
    assert scaling.efficiencies(s) == pytest.approx({1: 1.0, 2: 1.0, 4: 0.1 / 0.03 / 4})


def test_speedups_need_the_single_rank_time():
    with pytest.raises(ValueError, match="world size 1"):
        scaling.speedups({2: 0.05, 4: 0.03})


def test_hidden_comm_fraction():
    # Without overlap the step takes 105 ms, of which 20 ms all-reduce; DDP took 95: half of it hidden.
    assert scaling.hidden_comm_fraction(0.105, 0.095, 0.020) == pytest.approx(0.5)
    assert scaling.hidden_comm_fraction(0.105, 0.105, 0.020) == pytest.approx(0.0)
    assert scaling.hidden_comm_fraction(0.105, 0.110, 0.020) < 0   # reported as measured, not clipped
    with pytest.raises(ValueError, match="t_comm"):
        scaling.hidden_comm_fraction(0.1, 0.09, 0.0)


def test_single_process_helpers_are_world_size_one():
    model = torch.nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    assert scaling.allreduce_gradients_(list(model.parameters())) == 0      # nothing to average, nothing sent
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))
    assert scaling.slowest_rank([0.1, 0.3], torch.device("cpu")) == [0.1, 0.3]
    assert scaling.median([3.0, 1.0, 100.0]) == 3.0
    times = []
    with scaling.stopwatch(times, torch.device("cpu")):
        pass
    assert len(times) == 1 and times[0] >= 0


@pytest.mark.parametrize("options, message", [
    ({"samples": 1000, "global_batch": 64}, "multiple of global_batch"),
    ({"samples": 128, "global_batch": 64, "warmup_steps": 2}, "no timed step"),
    ({"bucket_cap_mb": 0.0}, "bucket_cap_mb"),
    ({"global_batch": 0}, "at least 1"),
    ({"world_sizes": (1, 3), "global_batch": 64, "samples": 256}, "does not split over 3 ranks"),
    ({"world_sizes": (1, 1)}, "distinct positive"),
])
def test_config_is_validated_up_front(options, message):
    with pytest.raises(ValueError, match=message):
        cfg.from_options(amdahl_scaling.Config, options)


def test_the_job_needs_as_many_processes_as_the_largest_world_size():
    with pytest.raises(ValueError, match="need exactly 4 processes"):
        launch.run("amdahl_scaling", nproc=2, world_sizes=(1, 2, 4), timeout_s=5)


SMALL = dict(samples=512, global_batch=64, d_in=16, d_hidden=32, warmup_steps=1)


def test_world_sizes_one_and_two_in_one_job_give_the_same_training():
    result = launch.run("amdahl_scaling", nproc=2, threads_per_rank=1, world_sizes=(1, 2), timeout_s=120,
                        quiet=True, **SMALL)
    run = result["metrics"]
    assert run["processes"] == 2 and run["threads_per_rank"] == 1
    assert sorted(run["by_world_size"]) == ["1", "2"]
    one, two = run["by_world_size"]["1"], run["by_world_size"]["2"]
    for m in (one, two):
        # The explicit all-reduce averages exactly what DDP averages.
        assert m["max_abs_diff_explicit_vs_ddp"] <= 1e-6
        assert m["final_loss_ddp"] < run["initial_loss"]
        assert len(m["explicit"]["step_s"]) == len(m["ddp"]["step_s"]) == run["timed_steps"] == 512 // 64 - 1
        for key in ("median_compute_s", "median_wait_s", "median_comm_s", "median_opt_s", "median_step_s"):
            assert math.isfinite(m["explicit"][key]) and m["explicit"][key] >= 0
        # A step is at least the slowest rank's compute + comm + opt, and at most all four parts' maxima.
        e = m["explicit"]
        for step, compute, wait, comm, opt in zip(e["step_s"], e["compute_s"], e["wait_s"], e["comm_s"], e["opt_s"]):
            assert 0.9 * (compute + comm + opt) - 1e-3 <= step <= 1.1 * (compute + wait + comm + opt) + 1e-3
    # Same math split over two ranks: the same weights as one process, to float rounding.
    assert one["max_abs_diff_vs_smallest_world_size"] == 0.0
    assert two["max_abs_diff_vs_smallest_world_size"] <= 1e-5
    # One rank sends nothing; two ranks all-reduce every gradient once per step, in fp32.
    assert one["comm_bytes"] == 0
    assert two["comm_bytes"] == 4 * run["n_params"]


def test_a_single_process_without_torchrun_is_world_size_one(tmp_path):
    """The run script's own code path, in this process: no torchrun, no process group, world size 1."""
    from lablib import script
    out = tmp_path / "out.json"
    script.main(amdahl_scaling.Config, amdahl_scaling.train,
                ["--out", str(out), "--world_sizes", "1", *[f"--{k}={v}" for k, v in SMALL.items()]])
    import json
    run = json.loads(out.read_text())["metrics"]
    assert run["by_world_size"]["1"]["comm_bytes"] == 0
    assert run["by_world_size"]["1"]["max_abs_diff_explicit_vs_ddp"] == 0.0

