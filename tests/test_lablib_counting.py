"""lablib.measure.counting: the one layer that counts collectives where the course calls them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed import all_reduce

from lablib.measure import counting
from lablib.jobs import launch

STEP = Path(__file__).parent / "steps" / "count_collectives.py"


def test_bus_factors_are_nccl_tests():
    assert counting.bus_factor("all_reduce", 4) == pytest.approx(1.5)
    for name in ("all_gather", "reduce_scatter", "all_to_all", "scatter", "gather"):
        assert counting.bus_factor(name, 4) == pytest.approx(0.75)
    for name in ("broadcast", "reduce", "send", "recv"):
        assert counting.bus_factor(name, 8) == 1.0
    assert counting.bus_factor("all_reduce", 1) == 0.0 and counting.bus_factor("barrier", 4) == 0.0
    for name in ("broadcast", "reduce", "send", "recv", "all_gather"):   # on one rank nothing leaves it
        assert counting.bus_factor(name, 1) == 0.0
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        counting.bus_factor("allreduce", 2)
    with pytest.raises(ValueError, match="positive integer"):
        counting.bus_factor("all_reduce", 0)


def test_nothing_is_patched_and_the_layer_is_there_only_inside_a_block():
    def intercepted():     # lablib.measure.counting's kernel, in front of the c10d op's CPU and CUDA kernels
        return torch._C._dispatch_has_kernel_for_dispatch_key("c10d::allreduce_", "BackendSelect")

    original, get_default_group = dist.all_reduce, c10d._get_default_group
    assert not intercepted()
    with counting.count_collectives() as outer, counting.count_collectives(outer), counting.count_collectives() as other:
        assert intercepted() and dist.all_reduce is original
        with counting.uncounted(), pytest.raises(ValueError):
            dist.all_reduce(torch.zeros(2))
        with pytest.raises(ValueError):        # no process group: it fails before any op, and is recorded (once)
            all_reduce(torch.zeros(3, dtype=torch.float64))
    assert not intercepted() and dist.all_reduce is original and c10d._get_default_group is get_default_group
    assert [(c.name, c.bytes, c.function) for c in outer.calls] == [("all_reduce", 24, "all_reduce")]
    assert other.count() == 1 and outer.calls[0].ranks is None


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


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    """tests/steps/count_collectives.py on 2 gloo ranks, once for the tests below: what rank 0 recorded."""
    run = launch.run_script(STEP, nproc=2, timeout_s=180, quiet=True)
    assert run.returncode == 0, run.rank_output
    return json.loads(next(line for line in run.output.splitlines() if line.startswith("{")))


def test_every_collective_and_ddp_on_two_ranks(two_ranks):
    out = two_ranks
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
    assert calls["isend"]["done_s"] >= calls["isend"]["launched_s"]     # gloo's send has no future: when waited for


# However a correct answer spells the collective, it is recorded, named by what the caller called (each of these
# but the module attribute spellings was missed when counting wrapped torch.distributed's module attributes).
ALL_REDUCE_64 = [{"name": "all_reduce", "function": "all_reduce", "bytes": 64, "ranks": [0, 1], "asynchronous": False,
                  "done": True}]


def test_a_name_imported_from_torch_distributed_is_counted(two_ranks):
    assert two_ranks["spellings"]["from_import"] == ALL_REDUCE_64        # from torch.distributed import all_reduce


def test_a_name_imported_from_distributed_c10d_is_counted(two_ranks):
    assert two_ranks["spellings"]["c10d_from_import"] == ALL_REDUCE_64


def test_every_spelling_of_the_module_attribute_is_counted(two_ranks):
    for spelling in ("module", "module_alias", "module_in_full", "c10d_module"):
        assert two_ranks["spellings"][spelling] == ALL_REDUCE_64, spelling


def test_a_process_group_method_is_counted(two_ranks):
    assert two_ranks["spellings"]["process_group_method"] == [
        {"name": "all_reduce", "function": "c10d.allreduce_", "bytes": 64, "ranks": [0, 1], "asynchronous": True,
         "done": True}]


def test_functional_collectives_are_counted_as_called(two_ranks):
    # done when waited for; gloo's reduce-scatter (an all-reduce inside gloo) is still the reduce-scatter called
    assert two_ranks["spellings"]["functional"] == [
        {"name": "all_reduce", "function": "_c10d_functional.all_reduce", "bytes": 64, "ranks": [0, 1],
         "asynchronous": True, "done": True}]
    assert two_ranks["spellings"]["functional_reduce_scatter"] == [
        {"name": "reduce_scatter", "function": "_c10d_functional.reduce_scatter_tensor", "bytes": 128,
         "ranks": [0, 1], "asynchronous": True, "done": True}]


def test_dtensor_redistribution_is_counted(two_ranks):
    # Shard(0) -> Replicate() of a (4, 4) float32 tensor: one all-gather whose output is the whole 64 bytes
    assert two_ranks["spellings"]["dtensor_redistribute"] == [
        {"name": "all_gather", "function": "_c10d_functional.all_gather_into_tensor", "bytes": 64, "ranks": [0, 1],
         "asynchronous": True, "done": True}]


def test_a_function_built_from_collectives_counts_once_and_ddp_is_left_to_its_hook(two_ranks):
    assert [c["function"] for c in two_ranks["spellings"]["object"]] == ["all_gather_object"]   # 2 all-gathers inside
    assert two_ranks["spellings"]["ddp_without_hook"] == []      # DDP's C++ reducer: count_ddp records it
