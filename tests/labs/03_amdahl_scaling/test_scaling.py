"""lablib.course.scaling and the amdahl_scaling run script (lab 03): formulas on numbers, then two small torchrun runs."""

from __future__ import annotations


import pytest
import torch

from lablib.jobs import config as cfg
from lablib.jobs import launch
from lablib.course import scaling
from lablib.measure import timing
from lablib.labs.amdahl_scaling import run as amdahl_scaling


def test_speedups():
    s = scaling.speedups({4: 0.03, 1: 0.1, 2: 0.05})
    assert list(s) == [1, 2, 4]
    assert s == pytest.approx({1: 1.0, 2: 2.0, 4: 0.1 / 0.03})


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


@pytest.mark.parametrize("options, message", [
    ({"samples": 1000, "global_batch": 64}, "multiple of global_batch"),
    ({"samples": 128, "global_batch": 64, "warmup_steps": 2}, "no timed step"),
    ({"bucket_cap_mb": -1.0}, "bucket_cap_mb"),
    ({"global_batch": 0}, "at least 1"),
    ({"world_sizes": (1, 3), "global_batch": 64, "samples": 256}, "does not split over 3 ranks"),
    ({"world_sizes": (1, 1)}, "distinct positive"),
])
def test_config_is_validated_up_front(options, message):
    with pytest.raises(ValueError, match=message):
        cfg.from_options(amdahl_scaling.Config, options)


def test_the_job_needs_as_many_processes_as_the_largest_world_size():
    with pytest.raises(ValueError, match="need exactly 4 processes"):
        launch.run("amdahl_scaling", {"world_sizes": (1, 2, 4)}, nproc=2, timeout_s=5)


# The lab's own MLP (256 -> 512 -> 512 -> 1, so that DDP's default buckets are the lab's), on few samples.
SMALL = dict(samples=512, global_batch=64, warmup_steps=1, lr=0.05)


def test_world_sizes_one_and_two_in_one_job_give_the_same_training():
    result = launch.run("amdahl_scaling", {"world_sizes": (1, 2), **SMALL}, nproc=2, threads_per_rank=1,
                        timeout_s=120, quiet=True)
    run = result["metrics"]
    assert run["processes"] == 2 and run["threads_per_rank"] == 1
    assert sorted(run["by_world_size"]) == [1, 2]                   # world sizes come back as ints
    # Every variant runs first, second and third in turn.
    assert run["order"][:3] == [["ddp", "again", "explicit"], ["again", "explicit", "ddp"], ["explicit", "ddp", "again"]]
    one, two = run["by_world_size"][1], run["by_world_size"][2]
    for m in (one, two):
        # The explicit all-reduce averages exactly what DDP averages.
        assert m["max_abs_diff_explicit_vs_ddp"] <= 1e-6
        assert m["final_loss_ddp"] < run["initial_loss"]
        assert len(m["explicit"]["step_s"]) == len(m["ddp"]["step_s"]) == run["timed_steps"] == 512 // 64 - 1
        # The noise floor's arm is the explicit step once more: the same training, bit for bit, timed as often.
        assert m["max_abs_diff_again_vs_explicit"] == 0.0 and len(m["again"]["step_s"]) == run["timed_steps"]
        # The work a rank did (CPU seconds) is no more than the wall time it took, plus the clocks' resolution.
        assert all(cpu <= wall + 1e-3 for cpu, wall in zip(m["explicit"]["compute_cpu_s"], m["explicit"]["compute_s"]))
        for part in ("compute", "wait", "comm", "opt", "step"):   # each median is lablib.measure.timing's, of its steps
            assert m["explicit"][f"median_{part}_s"] == timing.median(m["explicit"][f"{part}_s"])
        # A step is at least the slowest rank's compute + comm + opt. It can be longer than all four parts'
        # maxima when a rank loses its core between two parts (3 ranks' worth of load on 2 shared cores),
        # so that bound is checked on the median step only, with room for a preempted step or two.
        e = m["explicit"]
        parts = []
        for step, compute, wait, comm, opt in zip(e["step_s"], e["compute_s"], e["wait_s"], e["comm_s"], e["opt_s"]):
            assert 0.9 * (compute + comm + opt) - 1e-3 <= step
            parts.append(compute + wait + comm + opt)
        assert e["median_step_s"] <= 1.5 * timing.median(parts) + 5e-3
    # Same math split over two ranks: the same weights as one process, to float rounding.
    assert one["max_abs_diff_vs_smallest_world_size"] == 0.0
    assert two["max_abs_diff_vs_smallest_world_size"] <= 1e-5
    # One rank sends nothing; two ranks all-reduce every gradient once per step, in fp32.
    assert one["comm_bytes"] == 0
    assert two["comm_bytes"] == 4 * run["n_params"]
    # DDP's default buckets (bucket_cap_mb=None): the first is capped at 1 MiB, so the last layer and the
    # 1 MiB 512x512 weight fill it; the first layer is the second bucket. Seen by the hook, in bytes.
    assert two["ddp"]["bucket_bytes"] == [4 * (1 * 512 + 1 + 512 * 512 + 512), 4 * (256 * 512 + 512)]
    assert sum(two["ddp"]["bucket_bytes"]) == 4 * run["n_params"]
    # Every rank's own times, for the timeline: 8 steps, 1 of them warm-up.
    assert len(two["per_rank"]) == 2 and len(one["per_rank"]) == 1
    for rank in two["per_rank"]:
        assert all(len(v) == run["timed_steps"] for v in rank["explicit"].values())
        for step in rank["ddp"]:
            assert 0 < step["forward_end_s"] < step["backward_end_s"] <= step["end_s"]
            assert sorted(b[3] for b in step["buckets"]) == [0, 1]
            for launched, done, n_bytes, index in step["buckets"]:
                # backward() returns only once every bucket's all-reduce is done (and its callback ran)
                assert step["forward_end_s"] < launched <= done <= step["backward_end_s"] + 1e-3


def test_a_single_process_without_torchrun_is_world_size_one(tmp_path):
    """The run script's own code path, in this process: no torchrun, no process group, world size 1."""
    from lablib.jobs import script
    out = tmp_path / "out.json"
    script.main(amdahl_scaling.Config, amdahl_scaling.run,
                ["--out", str(out), "--world_sizes", "1", *[f"--{k}={v}" for k, v in SMALL.items()]])
    import json
    run = json.loads(out.read_text())["metrics"]
    assert run["by_world_size"]["1"]["comm_bytes"] == 0
    assert run["by_world_size"]["1"]["max_abs_diff_explicit_vs_ddp"] == 0.0



def test_bucketed_backward_schedule():
    ring = lambda n_bytes: 1e-3 + n_bytes * 1e-9           # alpha 1 ms, 1 GB/s
    # One bucket: its all-reduce starts when the backward ends, all of it exposed.
    one = scaling.bucketed_backward(0.010, 4e6, 4e6, ring)
    assert one["n_buckets"] == 1 and one["exposed_comm"] == pytest.approx(0.005) and one["done"] == pytest.approx(0.015)
    # Two buckets: the first (2 MB, ready at 5 ms) runs 5..8 ms, inside the backward; only the second is exposed.
    two = scaling.bucketed_backward(0.010, 4e6, 2e6, ring)
    assert two["n_buckets"] == 2 and two["comm"] == pytest.approx(0.006) and two["done"] == pytest.approx(0.013)
    # A bucket size that does not divide: the last bucket is the remainder.
    three = scaling.bucketed_backward(0.010, 5e6, 2e6, ring)
    assert three["n_buckets"] == 3 and three["comm"] == pytest.approx(3e-3 + 5e-3)
    # Tiny buckets: latency-bound, the stream falls behind the backward and the alphas add up.
    tiny = scaling.bucketed_backward(0.010, 4e6, 1e4, ring)
    assert tiny["n_buckets"] == 400 and tiny["done"] >= 400 * 1e-3
    # Free communication: done when the backward is done, whatever the buckets.
    assert scaling.bucketed_backward(0.010, 4e6, 1e5, lambda n: 0.0)["exposed_comm"] == 0.0
    # The U shape: some middle size beats both extremes.
    sizes = [1e4 * 2 ** k for k in range(10)]
    done = [scaling.bucketed_backward(0.010, 4e6, b, ring)["done"] for b in sizes]
    assert min(done) < done[0] and min(done) < scaling.bucketed_backward(0.010, 4e6, 4e6, ring)["done"]
    with pytest.raises(ValueError, match="bucket_bytes"):
        scaling.bucketed_backward(0.010, 4e6, 0, ring)
