"""lablib.counting: the one layer that counts collectives where the course calls them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lablib import counting, launch

STEP = Path(__file__).parent / "steps" / "count_collectives.py"


def test_bus_factors_are_nccl_tests():
    assert counting.bus_factor("all_reduce", 4) == pytest.approx(1.5)
    for name in ("all_gather", "reduce_scatter", "all_to_all", "scatter", "gather"):
        assert counting.bus_factor(name, 4) == pytest.approx(0.75)
    for name in ("broadcast", "reduce", "send", "recv"):
        assert counting.bus_factor(name, 8) == 1.0
    assert counting.bus_factor("all_reduce", 1) == 0.0 and counting.bus_factor("barrier", 4) == 0.0
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        counting.bus_factor("allreduce", 2)
    with pytest.raises(ValueError, match="positive integer"):
        counting.bus_factor("all_reduce", 0)


def test_calls_are_recorded_once_and_functions_put_back():
    original = dist.all_reduce
    with counting.count_collectives() as log:
        with counting.uncounted():
            with pytest.raises(ValueError):          # no process group: the call runs and fails, unrecorded
                dist.all_reduce(torch.zeros(2))
        with pytest.raises(ValueError):
            dist.all_reduce(torch.zeros(3, dtype=torch.float64))
    assert [(c.name, c.bytes, c.function) for c in log.calls] == [("all_reduce", 24, "all_reduce")]
    assert dist.all_reduce is original and log.count("all_reduce") == 1 and log.bytes() == 24


def test_calls_are_grouped_by_their_group_ranks():
    log = counting.CollectiveLog()
    log.record("all_gather", 100, 2, ranks=(0, 1))
    log.record("all_gather", 50, 2, ranks=(0, 1))
    log.record("all_reduce", 40, 2, ranks=(0, 2))
    log.record("barrier", 0, 4)
    assert log.by_group({(0, 1): "mesh_shard"}) == {
        "mesh_shard": {"all_gather": {"calls": 2, "bytes": 150}},
        "ranks 0,2": {"all_reduce": {"calls": 1, "bytes": 40}},
        "?": {"barrier": {"calls": 1, "bytes": 0}}}


def test_every_collective_and_ddp_on_two_ranks():
    run = launch.run_script(STEP, nproc=2, timeout_s=120, quiet=True)
    assert run.returncode == 0, run.rank_output
    out = json.loads(next(line for line in run.output.splitlines() if line.startswith("{")))
    calls = {c["function"]: c for c in out["calls"]}
    # message sizes S (nccl-tests): the tensor, the gathered output, the full input
    assert calls["all_reduce"]["bytes"] == 64 and calls["all_reduce"]["bus_bytes"] == 64
    assert calls["all_gather_into_tensor"]["bytes"] == 128 and calls["all_gather_into_tensor"]["bus_bytes"] == 64
    assert calls["all_gather"]["bytes"] == 128
    assert calls["reduce_scatter_tensor"]["bytes"] == 128 and calls["reduce_scatter_tensor"]["bus_bytes"] == 64
    assert calls["all_to_all_single"]["bytes"] == 64 and calls["broadcast"]["bytes"] == 64
    assert calls["scatter"]["bytes"] == 128 and calls["gather"]["bytes"] == 128
    assert calls["isend"]["name"] == "send" and calls["isend"]["peer"] == 1 and calls["isend"]["bytes"] == 64
    assert calls["barrier"]["bytes"] == 0
    assert all(c["world_size"] == 2 and c["ranks"] == [0, 1] for c in out["calls"])
    # FSDP2, two units: forward and backward all-gathers, one reduce-scatter per unit; each recorded once
    assert out["fsdp"] == {"all_gather": 4, "reduce_scatter": 2}
    # DDP's C++ reducer: one bucket, recorded by the hook, and its hook's own all-reduce not a second time
    assert out["ddp_hook"] == {"all_reduce": 1} and out["ddp_bytes"] == 4 * (8 * 8 + 8)
    assert out["ddp_seen_by_wrapper"] == {}
    # when: a bucket's all-reduce is launched and done during the backward (it returns after it), and an
    # asynchronous call is done when its work completes
    assert out["ddp_bucket"] == {"phase": "backward", "asynchronous": True, "in_order": True}
    assert out["async"] == {"asynchronous": True, "phase": "async", "done": True}
    assert all(c["launched_s"] <= c["done_s"] for c in out["calls"] if not c["asynchronous"])
