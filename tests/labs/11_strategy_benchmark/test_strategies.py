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
from lablib.measure import rankcheck, timing
from lablib.labs.strategy_benchmark.strategies import merge_qkv
from lablib.course.models import GPTConfig
from lablib.labs.strategy_benchmark.rows import DeepSpeedZeRO, TorchDDPIndividualStandIn, TorchDDPStandIn
from lablib.labs.strategy_benchmark.shards import dtensor_shards, fsdp2_tp_layout, refuse_layout_helpers
from lablib.labs.strategy_benchmark.run import Config, weight_bound


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


def _link_after_compute(m, forward_s, backward_s, grads, bucket, seconds_per_byte):
    """m micro-batches, each a forward then a backward that makes ``grads`` bytes at a steady rate; every micro-batch's
    gradients reduced in buckets on one link, in order, a bucket as soon as it is full and the link free (lab 03's
    bucketed_backward over m backwards): how long the link runs past the last backward."""
    n, link_free = round(grads / bucket), 0.0
    for i in range(m):
        start = i * (forward_s + backward_s) + forward_s
        for k in range(n):
            link_free = max(link_free, start + backward_s * (k + 1) / n) + bucket * seconds_per_byte
    return max(bucket * seconds_per_byte, link_free - m * (forward_s + backward_s))


@pytest.mark.parametrize("bw", [1e12, 1e11, 3e10, 1e10, 3e9])
@pytest.mark.parametrize("mbs", [1, 2, 4])
def test_planner_zero2_reduces_once_per_micro_batch_on_one_link(bw, mbs):
    # ZeRO-2 shards the gradients (memory b_g / d), so each of the m micro-batches is reduce-scattered: m reductions
    # queue on one link. The reference's closed form against that schedule simulated bucket by bucket (equal buckets).
    model = {"params": 1.2e9, "layers": 4, "hidden": 1024, "heads": 8, "seq": 512, "batch": 16, "vocab": 1000}
    cluster = {"gpus": 4, "gpus_per_node": 4, "memory_bytes": 80e9, "reserve_bytes": 8e9, "flops": 1e14,
               "bw_intra": bw, "bw_inter": bw}
    got = planner.predict(model, cluster, 4, 2, 1, 1, mbs, "selective", state_bytes=(2, 25 * 2**20 * 40 / 1.2e9, 12))
    m, grads = 16 // (4 * mbs), 25 * 2**20 * 40                    # 40 buckets of gradients
    forward, backward = 2 * 1.2e9 * mbs * 512 / 1e14, 4 * 1.2e9 * mbs * 512 / 1e14
    simulated = _link_after_compute(m, forward, backward, grads, 25 * 2**20, 3 / 4 / bw)
    gather = 3 / 4 * 2 * 1.2e9 / bw                                 # then the updated parameters all-gathered
    assert got["dp_exposed_s"] == pytest.approx(simulated + gather, rel=1e-9)
    # one reduction per step (what z <= 1 does with whole gradients) is less whenever the link falls behind
    once = planner.predict(model, cluster, 4, 1, 1, 1, mbs, "selective", state_bytes=(2, 25 * 2**20 * 40 / 1.2e9, 12))
    assert once["dp_exposed_s"] <= got["dp_exposed_s"] * (1 + 1e-12)


def test_planner_zero3_puts_gathers_and_reduce_scatters_on_one_link():
    # 2 gathers (forward, backward) and 1 reduce-scatter per micro-batch, hidden at most behind m micro-batches' compute
    model = {"params": 1e9, "layers": 4, "hidden": 1024, "heads": 8, "seq": 512, "batch": 16, "vocab": 1000}
    cluster = {"gpus": 4, "gpus_per_node": 4, "memory_bytes": 80e9, "reserve_bytes": 8e9, "flops": 1e14,
               "bw_intra": 1e10, "bw_inter": 1e10}
    p = planner.predict(model, cluster, 4, 3, 1, 1, 1, "selective")     # m = 4 micro-batches of one sequence
    gather = reduce_scatter = 3 / 4 * 2e9 / 1e10                         # 2-byte weights and gradients
    compute = 6 * 1e9 * 512 / 1e14
    assert p["micro_batches"] == 4
    assert p["dp_exposed_s"] == pytest.approx(4 * (2 * gather + reduce_scatter) - 4 * compute, rel=1e-12)


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


def test_beyond_all_chance_counts_orders():
    # 6 row and 6 floor ratios from one distribution: how often at least k of the row's lie above all the floor's,
    # drawn 200,000 times (seeded) against the closed form, within 5 binomial standard errors
    draws = torch.rand(200_000, 12, generator=torch.Generator().manual_seed(0))
    above = (draws[:, :6] > draws[:, 6:].max(dim=1, keepdim=True).values).sum(dim=1)
    for k, exact in ((4, 28 / 924), (5, 7 / 924), (6, 1 / 924)):
        assert timing.beyond_all_chance(6, 6, k) == pytest.approx(exact, rel=1e-12)
        frequency = (above >= k).double().mean().item()
        assert abs(frequency - exact) <= 5 * (exact * (1 - exact) / 200_000) ** 0.5


def test_noise_verdict_needs_enough_rounds_beyond_the_floor():
    floor = [0.98, 0.84, 1.40, 0.99, 0.90, 0.82]
    # 11 rows read both ways at 5% for the table: all 6 of 6 rounds (1/924 <= 0.05 / 22; 7/924 is not)
    assert timing.noise_verdict([4.57, 4.43, 4.08, 3.18, 5.37, 3.32], floor, 11)["verdict"] == "slower"
    five = timing.noise_verdict([1.74, 1.54, 1.47, 1.45, 1.42, 1.04], floor, 11)
    assert (five["verdict"], five["above"], five["needed"]) == ("within noise", 5, 6)
    assert timing.noise_verdict([1.74, 1.54, 1.47, 1.45, 1.42, 1.04], floor, 1)["verdict"] == "slower"   # 7/924 <= 2.5%
    assert timing.noise_verdict([0.5] * 6, floor, 11)["verdict"] == "faster"
    assert timing.noise_verdict([9.0] * 4, floor[:4], 11)["needed"] is None      # 4 rounds can never reach 0.23%
    with pytest.raises(ValueError):
        timing.noise_verdict([], floor, 11)


def test_noise_verdict_on_both_sides_of_the_floor_orders_nothing():
    # 12 against 12 rounds need 5 beyond the floor: 5 above and 7 below it at once is a row noisier than the floor (or
    # drifting), on neither side of it; the verdict once read "slower" because that side was checked first (a review
    # of lab 07 met it: 5 rounds above, the last three 26-39 % faster)
    floor = [0.95, 1.05] * 6
    both = timing.noise_verdict([1.2] * 5 + [0.9] * 7, floor, 1)
    assert (both["needed"], both["above"], both["below"]) == (5, 5, 7)
    assert both["verdict"] == "within noise" and both["both_ways"]
    one = timing.noise_verdict([1.2] * 5 + [1.0] * 7, floor, 1)
    assert one["verdict"] == "slower" and not one["both_ways"]
