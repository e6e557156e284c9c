"""Lab 11's library pieces without a real process group: the bound, q/k/v merged back, the stand-ins' validation and
configuration, DTensor's shard layout as the exercise's probe makes it (fake ranks) against the instructor's plain
arithmetic, FSDP2 x TP's real placements, the guard against DTensor's layout code, the harness's refusals, and the
planner's reference on cases worked by hand."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from instructor.references import strategy_planner as planner
from instructor.references.strategy_shards import expected_shards
from lablib.measure import rankcheck
from lablib.parallel.strategies import merge_qkv
from lablib.course.models import GPTConfig
from lablib.parallel.strategy_rows import DeepSpeedZeRO, TorchDDPIndividualStandIn, TorchDDPStandIn
from lablib.probes.strategy_shards import dtensor_shards, fsdp2_tp_layout, refuse_layout_helpers
from lablib.runs.strategy_benchmark import Config, weight_bound


def test_weight_bound_is_the_momentum_scaled_sgd_bound():
    c = Config()
    u = rankcheck.FP32_UNIT_ROUNDOFF
    lr_eff = c.lr / (1 - c.momentum)
    n = c.global_batch * c.block_size + 4 * c.n_embd
    expected = c.steps * (lr_eff * rankcheck.gamma(n) * 0.5 + 2 * u * 1.0 + lr_eff * 2 * u * 0.5 / (1 - c.momentum))
    assert weight_bound(c, 0.5, 1.0, 2) == pytest.approx(expected, rel=1e-12)
    # a gradient summed instead of averaged moves the weights by about lr * |g|: far outside the bound
    assert c.lr * 0.5 > 100 * weight_bound(c, 0.5, 1.0, 2)


def test_merge_qkv_puts_q_k_v_back_in_order():
    q, k, v = torch.full((2, 3), 1.0), torch.full((2, 3), 2.0), torch.full((2, 3), 3.0)
    merged = merge_qkv({"h.0.attn.c_attn.q.weight": q, "h.0.attn.c_attn.k.weight": k, "h.0.attn.c_attn.v.weight": v,
                        "wte.weight": torch.zeros(1)})
    assert set(merged) == {"h.0.attn.c_attn.weight", "wte.weight"}
    assert torch.equal(merged["h.0.attn.c_attn.weight"], torch.cat([q, k, v]))


@pytest.mark.parametrize("bucket_size_mb", [0, -1.0])
def test_lab06_standin_refuses_a_bucket_size_that_is_not_positive(bucket_size_mb):
    # checked before DDP is built: no process group needed to see the message
    with pytest.raises(ValueError, match="must be positive"):
        TorchDDPStandIn(torch.nn.Linear(2, 2), bucket_size_mb=bucket_size_mb)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_rows_are_fp32_and_unclipped_like_the_loop(stage):
    # DeepSpeed clips the global gradient norm to 1.0 unless the config says 0.0 (its GRADIENT_CLIPPING_DEFAULT);
    # the loop's other rows never clip, and no fp16/bf16 section keeps DeepSpeed in fp32
    config = DeepSpeedZeRO(SimpleNamespace(), stage).ds_config()
    assert config["gradient_clipping"] == 0.0 and config["zero_optimization"]["stage"] == stage
    assert not {"fp16", "bf16", "amp"} & set(config)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="DeepSpeed is optional (launchers/deepspeed installs it): the rows are checked where it is installed")
def test_deepspeed_rows_end_where_one_process_does():
    import torch

    from lablib.jobs import launch

    env = {} if torch.cuda.is_available() else {"DS_ACCELERATOR": "cpu"}
    rows = ("single", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3")
    result = launch.run("strategy_benchmark", {"impl": "", "rounds": 0, "rows": rows}, nproc=2, timeout_s=540,
                        env=env, quiet=True, show_progress=False).metrics
    for row in rows[1:]:
        r = result.rows[row]
        assert "error" not in r, r.get("error")
        assert r.max_abs_diff <= result.bound and r.rank_spread == 0.0, (row, r.max_abs_diff, result.bound)


@pytest.mark.parametrize("rows, n, sizes", [(65, 4, [17, 17, 17, 14]), (5, 4, [2, 2, 1, 0]), (8, 2, [4, 4])])
def test_dtensor_shards_follow_torch_chunk(rows, n, sizes):
    shards = dtensor_shards(torch.arange(rows * 2.0).view(rows, 2), (n,), (Shard(0),))
    assert [shards[(i,)].shape[0] for i in range(n)] == sizes
    assert torch.equal(torch.cat([shards[(i,)] for i in range(n)]), torch.arange(rows * 2.0).view(rows, 2))


def test_dtensor_shards_nest_on_a_2d_mesh():
    full = torch.arange(7.0)
    shards = dtensor_shards(full, (2, 2), (Shard(0), Shard(0)))      # 4 + 3 rows, then 2 + 2 and 2 + 1
    assert [shards[c].tolist() for c in ((0, 0), (0, 1), (1, 0), (1, 1))] == [[0, 1], [2, 3], [4, 5], [6]]
    replicated = dtensor_shards(full, (2,), (Replicate(),))
    assert all(torch.equal(s, full) for s in replicated.values())


def test_planner_reference_on_a_case_worked_by_hand():
    model = {"params": 1e9, "layers": 4, "hidden": 1024, "heads": 8, "seq": 512, "batch": 8, "vocab": 1000}
    cluster = {"gpus": 4, "gpus_per_node": 4, "memory_bytes": 80e9, "reserve_bytes": 8e9, "flops": 1e14,
               "bw_intra": 1e11, "bw_inter": 1e10}
    ddp = planner.predict(model, cluster, 4, 0, 1, 1, 2, "selective")      # one micro-batch of 2 sequences per rank
    assert ddp["states_bytes"] == 16e9                                      # 16 bytes per parameter on every GPU
    assert ddp["activation_bytes"] == 4 * 512 * 2 * 1024 * 34 + 4 * 512 * 2 * 1000    # 4 layers + fp32 logits
    assert planner.predict(model, cluster, 4, 3, 1, 1, 2, "selective")["states_bytes"] == 4e9
    assert planner.predict(model, cluster, 4, 1, 1, 1, 2, "selective")["states_bytes"] == 1e9 * (4 + 12 / 4)
    assert ddp["compute_s"] == pytest.approx(6 * 1e9 * 8 * 512 / (4 * 1e14))
    # the backward (4 P b s / F = 41 ms) outlasts the 2 GB all-reduce (30 ms): only the last 25 MiB bucket is exposed
    assert ddp["dp_exposed_s"] == pytest.approx(2 * 3 / 4 * 25 * 2**20 / 1e11)
    # 2 micro-batches of 1: the last one's backward (20 ms) hides only part of it
    acc = planner.predict(model, cluster, 4, 0, 1, 1, 1, "selective")
    backward, comm = 4 * 1e9 * 512 / 1e14, 2 * 3 / 4 * 2e9 / 1e11
    assert acc["dp_exposed_s"] == pytest.approx(comm - backward * (1 - 25 * 2**20 / 2e9))
    with pytest.raises(ValueError):
        planner.predict(model, cluster, 2, 0, 3, 1, 1, "selective")         # 2 * 3 != 4 GPUs
    with pytest.raises(ValueError):
        planner.predict(model, cluster, 2, 2, 1, 2, 1, "selective")         # ZeRO-2 with a pipeline
    assert planner.best(model, dict(cluster, memory_bytes=1e6, reserve_bytes=0)) is None


@pytest.mark.parametrize("backward_s", [0.0, 0.01, 0.02, 0.05, 1.0])
def test_planner_exposed_reduction_is_the_bucket_schedule(backward_s):
    # the closed form max(T(c), T(G) - t_b (1 - c/G)) is lab 03's bucketed_backward with equal buckets
    from lablib.course.scaling import bucketed_backward

    grads, bucket, seconds_per_byte = 40 * 25 * 2**20, 25 * 2**20, 1e-11
    simulated = bucketed_backward(backward_s, grads, bucket, lambda n: n * seconds_per_byte)["exposed_comm"]
    closed = max(bucket * seconds_per_byte, grads * seconds_per_byte - backward_s * (1 - bucket / grads))
    assert closed == pytest.approx(simulated, rel=1e-12, abs=1e-15)


def test_planner_reproduces_megatrons_layouts_without_zero():
    # Narayanan et al. (2021), Table 1: 7.5B on 128 A100s with t=4, p=1; 145.6B on 1536 with t=8, p=8
    a100s = {"gpus_per_node": 8, "memory_bytes": 80e9, "reserve_bytes": 8e9, "flops": 156e12, "bw_intra": 300e9,
             "bw_inter": 25e9}
    for (P, a, h, L, N, B), (tp, pp) in (((7.5e9, 32, 4096, 36, 128, 512), (4, 1)),
                                         ((145.6e9, 96, 12288, 80, 1536, 2304), (8, 8))):
        model = {"params": P, "layers": L, "hidden": h, "heads": a, "seq": 2048, "batch": B, "vocab": 51200}
        (dp, zero, t, p, mbs, recompute), _ = planner.best(model, dict(a100s, gpus=N), zero_stages=(0,))
        assert (t, p) == (tp, pp)


@pytest.mark.parametrize("shape, mesh, placements", [
    ((65, 3), (4,), (Shard(0),)), ((5, 7), (4,), (Shard(0),)), ((5, 7), (2, 2), (Shard(0), Shard(1))),
    ((5, 3), (2, 2), (Shard(0), Shard(0))), ((7, 3), (2, 2), (_StridedShard(0, split_factor=2), Shard(0))),
    ((11, 2), (2, 3), (_StridedShard(0, split_factor=3), Shard(0))), ((4, 9), (2, 2), (_StridedShard(1, split_factor=2), Shard(1))),
    ((6, 5), (2, 3), (Replicate(), Shard(1))), ((9, 2, 5), (3, 2), (Shard(2), Shard(0)))])
def test_instructor_shards_are_dtensors_own(shape, mesh, placements):
    # the hidden cases' expected shards (plain arithmetic) against DTensor's (distribute_tensor in fake ranks)
    full = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    mine, torchs = expected_shards(full, mesh, placements), dtensor_shards(full, mesh, placements)
    assert mine.keys() == torchs.keys() and all(torch.equal(mine[c], torchs[c]) for c in mine)


def test_fsdp2_x_tp_is_strided_on_the_dp_dimension():
    # torch/distributed/fsdp/_fully_shard/_fsdp_param.py:409-421: _StridedShard(0, split_factor=tp) on dp
    layout = fsdp2_tp_layout(GPTConfig(block_size=32, n_layer=1, n_head=4, n_embd=64), mesh_shape=(2, 2))
    assert layout["placements"]["h.0.mlp.c_fc.weight"] == (_StridedShard(0, split_factor=2), Shard(0))
    assert {c: b["first_row"] for c, b in layout["blocks"].items()} == {(0, 0): 0, (0, 1): 128, (1, 0): 64, (1, 1): 192}


def test_the_guard_sees_dtensors_layout_code_and_nothing_else():
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset as private

    with refuse_layout_helpers() as used:
        private((4, 4), (2,), [0], [Shard(0)])
    assert any("_compute_local_shape_and_global_offset" in u for u in used)
    with refuse_layout_helpers() as used:
        torch.cat(torch.chunk(torch.arange(5), 2))
        Shard(0).is_shard() and Shard(0).dim == 0 and isinstance(Shard(0), Shard)
        _StridedShard(0, split_factor=2).split_factor + _StridedShard(0, split_factor=2).dim   # attributes are fine
    assert used == []


def test_individual_standin_is_one_bucket_per_parameter():
    assert TorchDDPIndividualStandIn.ONE_BYTE_MB * 2**20 == 1.0


@pytest.mark.parametrize("changes, message", [({"rounds": 5}, "must be even"), ({"timed_steps": 0}, ">= 1")])
def test_harness_refuses_odd_rounds_and_empty_windows(changes, message):
    with pytest.raises(ValueError, match=message):
        Config(impl="", **changes).validate()
