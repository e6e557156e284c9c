"""Lab 07's probes (lablib.labs.zero_from_scratch.zero12, zero3 and the modules they share) and its run scripts' configs: what a rank
holds, counted from storages, the collectives recorded on thread ranks, the graded checks on hand-made results,
lab 04's formula loaded from its notebook. No torchrun start here (the
lab's own tests run them); the optimizers below are the test's own, not the exercise's answer.
"""

from __future__ import annotations

import pytest
import torch

from lablib.jobs import config as cfg
from lablib.measure import memory
from lablib.labs.zero_from_scratch import zero12 as zero_probes, zero3 as zero3_probes, held as zero_held
from lablib.labs.zero_from_scratch.lab04_formula import lab04_bytes_per_rank
from lablib.labs.zero_from_scratch import run_zero_scratch as zero_scratch, run_zero_stages as zero_stages

SOLUTIONS = __import__("pathlib").Path(__file__).resolve().parents[3] / "solutions"


class _StateUnderAnOddName:
    """Keeps an AdamW, and a copy of its moments under a name no counter would guess."""

    def __init__(self, params):
        self.inner = {"x": [torch.optim.AdamW(params)]}
        self.stash = (torch.zeros(100),)


def test_held_bytes_finds_state_wherever_it_is_kept():
    model = torch.nn.Linear(10, 5)                       # 55 parameters
    holder = _StateUnderAnOddName(model.parameters())
    model(torch.ones(2, 10)).sum().backward()
    holder.inner["x"][0].step()
    held = zero_held.held_bytes(model, holder)
    assert held["params"] == 55 * 4
    assert held["grads"] == 55 * 4
    assert held["optimizer"] == zero_held.adamw_state_bytes(model.parameters()) + 400
    assert held["total"] == held["params"] + held["grads"] + held["optimizer"]


def test_held_bytes_counts_a_view_once_and_a_shard_gradient_as_a_gradient():
    flat = torch.zeros(12)
    model = torch.nn.Linear(2, 3)                        # 9 parameters, views of the flat buffer below
    offset = 0
    for p in model.parameters():
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    shard = torch.nn.Parameter(flat[6:12])
    shard.grad = torch.ones(6)
    held = zero_held.held_bytes(model, {"shard": shard, "flat": flat})
    assert held == {"params": 48, "grads": 24, "optimizer": 0, "total": 72}


def _zero1_result(state_per_rank, world_size=2):
    sizes = [8 * 1024 + 4] * 6 + [8 * 32 + 4] * 6
    return {"case": "mlp", "world_size": world_size, "steps": 10, "error": None, "is_optimizer": True, "element_size": 4,
            "param_groups": [{"n_params": 12}], "reference_groups": [{"n_params": 12}], "steps_not_bit_equal": [],
            "full_state_bytes": sum(sizes), "param_state_bytes": sizes,
            "held_per_rank": [{"optimizer": s} for s in state_per_rank],
            "state_entries_per_rank": [6, 6], "greedy_state_bytes": [sum(sizes) // 2, sum(sizes) - sum(sizes) // 2]}


def test_zero1_checks_pass_a_balanced_sharding_and_reject_round_robin_and_replication():
    total = 6 * (8 * 1024 + 4) + 6 * (8 * 32 + 4)
    zero_probes.check_probe(_zero1_result([total // 2, total - total // 2]), "zero1")
    with pytest.raises(AssertionError, match="fullest rank"):        # every weight on rank 0
        zero_probes.check_probe(_zero1_result([6 * (8 * 1024 + 4), 6 * (8 * 32 + 4)]), "zero1")
    with pytest.raises(AssertionError, match="summed over the ranks"):  # plain AdamW on every rank
        zero_probes.check_probe(_zero1_result([total, total]), "zero1")
    with pytest.raises(AssertionError, match="self.state"):             # self.state left empty
        zero_probes.check_probe({**_zero1_result([total // 2, total - total // 2]), "state_entries_per_rank": [0, 0]},
                                "zero1")


def test_lab04_formula_is_lab04s_notebook_cell_beside_lab07_never_a_solutions_path(tmp_path):
    bytes_per_rank, where = lab04_bytes_per_rank(SOLUTIONS / "07_zero_from_scratch")   # the notebook's folder
    assert bytes_per_rank is not None, where
    assert where.endswith("04_zero_memory.ipynb")
    lab07 = tmp_path / "07_zero_from_scratch"        # a student's folder with no lab 04 beside it: labs/ only
    lab07.mkdir()
    bytes_unwritten, why = lab04_bytes_per_rank(lab07)
    assert bytes_unwritten is None and "/solutions/" not in why, why
    phi = 208_320
    assert [bytes_per_rank(phi, 4, s, memory.FP32_ADAM) for s in range(4)] == pytest.approx(
        [16 * phi, 10 * phi, 7 * phi, 4 * phi])


def test_run_configs_refuse_bad_options(tmp_path):
    impl = tmp_path / "zero1_impl.py"
    impl.write_text("class ShardedOptimizer: pass\n")
    config = cfg.from_options(zero_scratch.Config, {"impl": str(impl), "runs": ("2:mlp", "4:groups")})
    assert config.pairs() == [(2, "mlp"), (4, "groups")]
    config.validate_world(4)
    with pytest.raises(ValueError, match="nproc=4"):
        config.validate_world(3)
    with pytest.raises(ValueError, match="world size:case"):
        cfg.from_options(zero_scratch.Config, {"impl": str(impl), "runs": ("mlp",)})
    with pytest.raises(ValueError, match="unknown"):
        cfg.from_options(zero_stages.Config, {"variants": ("zero4",)})


def test_rehearsal_sums_in_rank_order_and_names_a_collective_only_some_ranks_call():
    import torch.distributed as dist

    from lablib.probes.rehearsal import RehearsalDeadlock, run_in_thread_ranks

    def gathered(rank):
        out = torch.empty(4)
        dist.all_gather_into_tensor(out, torch.full((2,), float(rank)))
        shard = torch.empty(2)
        dist.reduce_scatter_tensor(shard, torch.arange(4.0))
        return dist.get_world_size(), out.tolist(), shard.tolist()

    assert run_in_thread_ranks(2, gathered) == [(2, [0, 0, 1, 1], [0, 2]), (2, [0, 0, 1, 1], [4, 6])]

    def owner_only(rank):
        if rank == 0:
            dist.broadcast(torch.zeros(3), src=0)

    with pytest.raises(RehearsalDeadlock, match="broadcast"):
        run_in_thread_ranks(2, owner_only, timeout_s=1.0)
    assert not dist.is_initialized()     # torch.distributed's own functions are back


def test_rehearse_with_checks_each_run_as_it_ends():
    """With check, the first run whose check fails ends the rehearsal: a wrong answer costs one case, not all."""
    from lablib.labs.zero_from_scratch.comm import rehearse_with

    probed = []

    def probe(case, env):
        probed.append((env.world_size, case))
        return {"error": None, "case": case, "world_size": env.world_size}

    def check(r):
        assert r["case"] != "bad", "the bad case"

    with pytest.raises(AssertionError, match="the bad case"):
        rehearse_with(probe, ("1:good", "2:bad", "3:good"), check)
    assert sorted(set(probed)) == [(1, "good"), (2, "bad")]
    assert len(rehearse_with(probe, ("1:good", "3:good"), check)) == 2


def test_held_bytes_counts_zero3_shards_as_parameters_and_a_freed_buffer_as_nothing():
    model = torch.nn.Linear(3, 2)                        # 8 parameters, views of a full buffer that is then freed
    full = torch.zeros(8)
    offset = 0
    for p in model.parameters():
        p.data = full[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    full.untyped_storage().resize_(0)
    shard = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.AdamW([shard])
    shard.grad = torch.ones(4)
    opt.step()
    held = zero_held.held_bytes(model, {"optimizer": opt}, shards=[shard])
    assert held == {"params": 16, "grads": 16, "optimizer": 36, "total": 68}


def _zero3_result(forward_peak, params_at_rest=12_740, backward_peak=4224, **changes):
    collectives = {"all_gather": 2 * 4 * 2 * 3185, "reduce_scatter": 4 * 2 * 3185}
    r = {"case": "mlp", "world_size": 2, "steps": 4, "error": None, "n_params": 6369, "n_units": 7,
         "element_size": 4, "micro_batches": 1, "collectives_per_step": [collectives] * 4,
         "block_bytes": [4224] * 6, "root_bytes": 132, "shard_numel_total": 3185, "expected_shard_numel": 3185,
         "max_abs_grad_diff_vs_mean": 0.0, "max_grad_diff_over_bound": 0.0, "max_abs_grad": 1.0,
         "max_abs_diff_vs_adamw": 0.0, "steps_not_bit_equal": [], "max_abs_weight": 1.0,
         "max_abs_loss_diff_vs_adamw": 0.0, "max_loss_diff_over_bound": 0.0, "loss_rtol": 5e-7,
         "full_grads_kept_after_step": 0,
         "gathered_peak_per_rank": [{"forward": forward_peak, "backward": backward_peak}] * 2,
         "held_per_rank": [{"params": params_at_rest, "grads": 12_740, "optimizer": 25_508}] * 2}
    return {**r, **changes}


def test_zero3_checks_pass_one_block_at_a_time_and_reject_never_freeing_and_summing():
    zero3_probes.check(_zero3_result(4360))
    with pytest.raises(AssertionError, match="gathered parameter bytes"):     # every block still gathered
        zero3_probes.check(_zero3_result(25_480))
    with pytest.raises(AssertionError, match="at rest"):                     # never freed after the backward
        zero3_probes.check(_zero3_result(4360, params_at_rest=25_476 + 12_740))
    with pytest.raises(AssertionError, match="mean of the ranks' gradients"):     # a sum: 2 x the mean
        zero3_probes.check(_zero3_result(4360, max_abs_grad_diff_vs_mean=0.25, max_grad_diff_over_bound=4e6))
    with pytest.raises(AssertionError, match="bit-for-bit"):                # a shard stepped off by one element
        zero3_probes.check(_zero3_result(4360, steps_not_bit_equal=[0, 1, 2, 3]))
    with pytest.raises(AssertionError, match="gather the block again in before_backward"):
        zero3_probes.check(_zero3_result(4360, error="RuntimeError: setStorage: ... out of bounds for "
                                                          "storage of size 0"))
    with pytest.raises(AssertionError, match="FSDP2"):
        zero3_probes.check(_zero3_result(4360, losses=[1.0], fsdp2_losses=[1.1],
                                              max_abs_loss_diff_vs_fsdp2=0.1, first_loss_diff_vs_fsdp2=0.1))


def test_zero3_cases_are_known_to_the_graded_run_only_for_exercise_3(tmp_path):
    impl = tmp_path / "zero3_impl.py"
    impl.write_text("class ZeRO3: pass\n")
    cfg.from_options(zero_scratch.Config, {"impl": str(impl), "exercise": "zero3", "runs": ("2:mlp", "3:gpt")})
    with pytest.raises(ValueError, match="known cases"):
        cfg.from_options(zero_scratch.Config, {"impl": str(impl), "exercise": "zero1", "runs": ("3:gpt",)})


def test_zero3_checks_reject_freeing_only_in_step_and_other_collectives():
    with pytest.raises(AssertionError, match="in the backward"):     # every block kept until step()
        zero3_probes.check(_zero3_result(4360, backward_peak=25_480))
    all_reduce = {"all_gather": 2 * 4 * 2 * 3185, "all_reduce": 4 * 6369}    # all-reduce, then keep a slice
    with pytest.raises(AssertionError, match="collectives your class called"):
        zero3_probes.check(_zero3_result(4360, collectives_per_step=[all_reduce] * 4))
    broadcasts = {"broadcast": 2 * 4 * 2 * 3185, "reduce_scatter": 4 * 2 * 3185}   # N broadcasts per gather
    with pytest.raises(AssertionError, match="collectives your class called"):
        zero3_probes.check(_zero3_result(4360, collectives_per_step=[broadcasts] * 4))


def test_recording_on_thread_ranks_names_and_sizes_what_the_class_calls_and_nothing_of_the_probes():
    import torch.distributed as dist

    from lablib.measure.collective_log import CollectiveLog
    from lablib.labs.zero_from_scratch import comm as zero_comm

    def step(rank):
        log = CollectiveLog()
        dist.all_reduce(torch.ones(5))                       # the probe's own: not recorded
        with zero_comm.recording(log):
            shard = torch.empty(3)
            dist.reduce_scatter_tensor(shard, torch.ones(6))
            dist.all_gather_into_tensor(torch.empty(6), shard)
            dist.broadcast(torch.ones(7, dtype=torch.float64), src=0)
        return zero_comm.bytes_by_kind(log)

    assert zero_comm.run_in_thread_ranks(2, step) == [{"reduce_scatter": 24, "all_gather": 24, "broadcast": 56}] * 2
    assert zero_comm.bus_ratio_to_ddp({"reduce_scatter": 24, "all_gather": 24}, 24, 2) == 1.0


def _mixed_result(**changes):
    """A correct mixed-precision ZeRO3 result (bf16 gathers, fp32 reduction) on the 'mlp' case at N = 2."""
    r = _zero3_result(4360 // 2, backward_peak=4224 // 2, case="mlp@bf16/fp32", mixed=True,
                      param_dtype="torch.bfloat16", reduce_dtype="torch.float32", param_element_size=2,
                      reduce_element_size=4, unit_shard_numels=[528] * 6 + [17], unit_trainable=[True] * 7,
                      collectives_per_step=[{"all_gather": 2 * 2 * 2 * 3185, "reduce_scatter": 4 * 2 * 3185}] * 4,
                      wrong_compute=[], loss_dtypes=["torch.bfloat16"], shard_dtypes=["torch.float32"],
                      shard_grad_dtypes=["torch.float32"])
    return {**r, **changes}


def test_mixed_precision_checks_reject_fp32_on_the_wire_a_16_bit_master_and_uncast_weights():
    zero3_probes.check(_mixed_result())
    fp32_gathers = {"all_gather": 2 * 4 * 2 * 3185, "reduce_scatter": 4 * 2 * 3185}     # cast after the gather
    with pytest.raises(AssertionError, match="collectives your class called"):
        zero3_probes.check(_mixed_result(collectives_per_step=[fp32_gathers] * 4))
    bf16_reduce = {"all_gather": 2 * 2 * 2 * 3185, "reduce_scatter": 2 * 2 * 3185}     # reduced in bf16
    with pytest.raises(AssertionError, match="collectives your class called"):
        zero3_probes.check(_mixed_result(collectives_per_step=[bf16_reduce] * 4))
    with pytest.raises(AssertionError, match="the fp32 master"):
        zero3_probes.check(_mixed_result(shard_dtypes=["torch.bfloat16"]))
    with pytest.raises(AssertionError, match="cast to param_dtype"):
        zero3_probes.check(_mixed_result(wrong_compute=["forward: ... is torch.float32"]))
    frozen = _mixed_result(unit_trainable=[False] + [True] * 6,       # a frozen first unit: gathered once, no state
                           collectives_per_step=[{"all_gather": 2 * 2 * (3185 + 3185 - 528),
                                                  "reduce_scatter": 4 * 2 * (3185 - 528)}] * 4,
                           held_per_rank=[{"params": 12_740, "grads": 4 * (3185 - 528),
                                           "optimizer": 8 * (3185 - 528) + 4 * 6}] * 2)
    zero3_probes.check(frozen)
    # a frozen second unit after a trained first one: its backward runs, so it is gathered twice, never reduced
    middle = dict(unit_trainable=[True, False] + [True] * 5, unit_backward=[True] * 7,
                  held_per_rank=[{"params": 12_740, "grads": 4 * (3185 - 528),
                                  "optimizer": 8 * (3185 - 528) + 4 * 6}] * 2)
    zero3_probes.check(_mixed_result(**middle, collectives_per_step=[{"all_gather": 2 * 2 * 2 * 3185,
                                                                      "reduce_scatter": 4 * 2 * (3185 - 528)}] * 4))
    with pytest.raises(AssertionError, match="collectives your class called"):   # counted as gathered once
        zero3_probes.check(_mixed_result(**middle, collectives_per_step=[{"all_gather": 2 * 2 * (3185 + 3185 - 528),
                                                                          "reduce_scatter": 4 * 2 * (3185 - 528)}] * 4))


def test_mixed_bound_covers_a_16_bit_sum_and_parse_case_names_the_cases():
    from lablib.labs.zero_from_scratch.step_checks import GradientTap, mixed_mean_gradient_and_bound
    from lablib.labs.zero_from_scratch.zero3_cases import parse_case

    assert parse_case("gpt@fp16/fp32") == ("gpt", torch.float16, torch.float32)
    assert parse_case("mlp") == ("mlp", None, None)
    with pytest.raises(ValueError, match="bf16"):
        parse_case("mlp@half")
    # One rank, two micro-batches of fp16 gradients, some subnormal: summed and halved in fp16 they stay within the
    # bound, which is reduce_dtype's relative rounding plus gradual underflow's absolute one.
    p = torch.nn.Parameter(torch.zeros(1000, dtype=torch.float16))
    tap = GradientTap([p])
    g = torch.Generator().manual_seed(0)
    terms = [(torch.randn(1000, generator=g) * 10.0 ** torch.randint(-7, 0, (1000,), generator=g)).half()
             for _ in range(2)]
    tap.grads = [terms]
    mean, bound = mixed_mean_gradient_and_bound(tap, 1, 2, torch.float16, torch.float32)
    student = ((terms[0] + terms[1]) / 1).float()
    assert ((student.double() - mean).abs() <= bound).all()
    assert (bound > 0).all()
