"""Lab 13's library pieces without a process start: the MoE layer and its formulas, the thread rehearsal's
all_to_all_single and sub-groups, and the probes' verdicts on answers written here (right and wrong)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from lablib import checks
from lablib.course.models import GPTConfig
from lablib.labs.expert_parallel import ep_dispatch, ep_grads, moe
from lablib.labs.expert_parallel import run as ep_run
from lablib.probes import group_rehearsal
from lablib.probes.rehearsal import RehearsalDeadlock, run_in_thread_ranks


def test_combine_in_one_process_is_the_gated_sum():
    torch.manual_seed(0)
    experts = nn.ModuleList(nn.Linear(3, 3) for _ in range(3))
    x, gates = torch.randn(4, 3), torch.rand(4, 2)
    index = torch.tensor([[0, 1], [2, moe.DROPPED], [1, 0], [moe.DROPPED, moe.DROPPED]])
    y = moe.combine_in_one_process(x, index, gates, experts)
    for t in range(4):
        want = sum((gates[t, j] * experts[int(index[t, j])](x[t]) for j in range(2) if index[t, j] >= 0),
                   torch.zeros(3))
        assert torch.allclose(y[t], want, atol=1e-6)


def test_router_gates_renormalised_for_top2_not_for_top1():
    x = torch.randn(10, 8)
    for k in (1, 2):
        router = moe.Router(8, 4, k)
        probs, index, gates = router(x)
        assert torch.allclose(probs.sum(-1), torch.ones(10))
        if k == 1:
            assert torch.equal(gates, probs.gather(1, index))
        else:
            assert torch.allclose(gates.sum(-1), torch.ones(10))
    with pytest.raises(ValueError, match="between 1 and num_experts"):
        moe.Router(8, 4, 5)


def test_moe_layer_without_rules_drops_nothing_and_counts_every_assignment():
    layer = moe.MoEMLP(GPTConfig(n_embd=8, n_head=1), num_experts=4, k=2)
    y = layer(torch.randn(2, 5, 8))
    assert y.shape == (2, 5, 8) and layer.dropped == 0 and int(layer.tokens_per_expert.sum()) == 20
    with pytest.raises(ValueError, match="keep_fn"):
        moe.MoEMLP(GPTConfig(n_embd=8, n_head=1), num_experts=4, capacity_factor=1.0)


def test_dropped_fraction_formula_against_sampling():
    """The binomial formula vs 2000 sampled uniform routings (E = 4, T = 64, c = 1): a Monte Carlo mean of a
    fraction in [0, 1] has standard error below 0.5 / sqrt(2000) = 0.011; 4 standard errors allowed."""
    gen = torch.Generator().manual_seed(0)
    E, T, C = 4, 64, 16
    loads = torch.stack([torch.bincount(torch.randint(E, (T,), generator=gen), minlength=E) for _ in range(2000)])
    sampled = (loads - C).clamp(min=0).sum(1).float().mean().item() / T
    assert abs(sampled - moe.dropped_fraction_uniform(T, E, 1, 1.0)) < 4 * 0.5 / math.sqrt(2000)
    assert moe.dropped_fraction_uniform(T, 1, 1, 1.0) == 0.0


def test_dropped_fraction_top2_is_binomial_T_k_over_E():
    """k = 2 picks 2 distinct experts: an expert's load is Binomial(T, k/E). Against 2000 sampled top-2 routings
    (E = 4, T = 64, c = 1: 0.050, where Binomial(kT, 1/E) gave 0.061; same standard-error bound as above); at
    E = k every expert gets exactly T assignments: nothing drops at c = 1, exactly T - C below it."""
    gen = torch.Generator().manual_seed(1)
    E, T, k, C = 4, 64, 2, 32
    index = torch.rand(2000, T, E, generator=gen).topk(k, dim=-1).indices
    loads = torch.nn.functional.one_hot(index, E).sum((1, 2))
    sampled = (loads - C).clamp(min=0).sum(1).float().mean().item() / (k * T)
    formula = moe.dropped_fraction_uniform(T, E, k, 1.0)
    assert abs(sampled - formula) < 4 * 0.5 / math.sqrt(2000) and abs(formula - 0.0497) < 1e-4
    assert moe.dropped_fraction_uniform(T, 2, 2, 1.0) == 0.0
    assert moe.dropped_fraction_uniform(T, 2, 2, 0.9) == pytest.approx((T - math.ceil(0.9 * T)) / T)
    with pytest.raises(ValueError, match="between 1 and num_experts"):
        moe.dropped_fraction_uniform(T, 2, 3, 1.0)


def test_bytes_formula():
    b = moe.all_to_all_bytes_per_rank(tokens=4096, k=2, n_embd=4096, world_size=8, value_bytes=2, num_experts=64)
    assert b["dispatch"] == 2 * 4096 * 4096 * 2 and b["forward_leaving_rank"] == pytest.approx(2 * b["dispatch"] * 7 / 8)
    assert b["forward_total"] == 2 * b["dispatch"] + 8 * 64 and b["backward_total"] == 2 * b["dispatch"]


def _a2a_body(rank):
    group = group_rehearsal.ThreadGroup([0, 1, 2])
    sizes = [[1, 2, 0], [0, 1, 3], [2, 0, 1]][rank]                       # rows rank sends to each rank
    x = torch.arange(sum(sizes), dtype=torch.float32).unsqueeze(1) + 100 * rank
    recv = [[1, 0, 2], [2, 1, 0], [0, 3, 1]][rank]
    out = torch.empty(sum(recv), 1)
    torch.distributed.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=sizes, group=group)
    return out.squeeze(1).tolist()


def test_rehearsal_all_to_all_single_uneven():
    got = run_in_thread_ranks(3, _a2a_body, more_fakes=group_rehearsal.fakes)
    assert got == [[0.0, 200.0, 201.0], [1.0, 2.0, 100.0], [101.0, 102.0, 103.0, 202.0]]


def test_rehearsal_all_to_all_single_refuses_wrong_output_splits():
    def body(rank):
        out = torch.empty(2, 1)
        torch.distributed.all_to_all_single(out, torch.zeros(2 + rank, 1), output_split_sizes=[1, 1],
                                            input_split_sizes=[1, 1 + rank])
    with pytest.raises(RuntimeError, match="Received data size doesn't match"):
        run_in_thread_ranks(2, body, more_fakes=group_rehearsal.fakes)


def test_rehearsal_all_reduce_over_sub_groups():
    def body(rank):
        t = torch.tensor([float(rank)])
        torch.distributed.all_reduce(t, group=group_rehearsal.ThreadGroup([rank % 2, rank % 2 + 2]))
        return (t.item(), torch.distributed.get_rank(group_rehearsal.ThreadGroup([rank % 2, rank % 2 + 2])))
    assert run_in_thread_ranks(4, body, more_fakes=group_rehearsal.fakes) == [(2.0, 0), (4.0, 0), (2.0, 1), (4.0, 1)]


def test_rehearsal_deadlock_is_reported():
    def body(rank):
        if rank == 0:
            torch.distributed.all_reduce(torch.zeros(1))
    with pytest.raises(RehearsalDeadlock):
        run_in_thread_ranks(2, body, timeout_s=1.0, more_fakes=group_rehearsal.fakes)


class _Zeros:
    """A dispatch that sends nothing and returns zeros: it must fail."""

    @staticmethod
    def expert_parallel_moe(x, expert_index, gates, local_experts, num_experts, group):
        return torch.zeros_like(x)


def test_dispatch_probe_rejects_a_wrong_answer_and_names_the_output():
    group = group_rehearsal.ThreadGroup([0, 1])
    records = run_in_thread_ranks(2, lambda r: ep_dispatch.probe(_Zeros, "uneven", r, 2, group),
                                  more_fakes=group_rehearsal.fakes)
    with pytest.raises(checks.CheckFailed, match="does not require grad|rows each local expert ran|output equals"):
        ep_dispatch.check(records[0], real_ranks=False)


class _Mean:
    @staticmethod
    def reduce_moe_gradients(dense_params, expert_params, dp_group, world_group):
        for params, group in ((dense_params, world_group), (expert_params, dp_group)):
            for p in params:
                if p.grad is not None:
                    torch.distributed.all_reduce(p.grad, group=group)
                    p.grad /= torch.distributed.get_world_size(world_group)


class _DividedByDp(_Mean):
    @staticmethod
    def reduce_moe_gradients(dense_params, expert_params, dp_group, world_group):
        _Mean.reduce_moe_gradients(dense_params, expert_params, dp_group, world_group)
        for p in expert_params:
            if p.grad is not None:
                p.grad *= torch.distributed.get_world_size(world_group) / torch.distributed.get_world_size(dp_group)


class _SkipsFrozenOnly(_Mean):
    """Skips by requires_grad: all_reduce(None) on a trainable parameter the loss never reached."""

    @staticmethod
    def reduce_moe_gradients(dense_params, expert_params, dp_group, world_group):
        for params, group in ((dense_params, world_group), (expert_params, dp_group)):
            for p in params:
                if p.requires_grad:
                    torch.distributed.all_reduce(p.grad, group=group)
                    p.grad /= torch.distributed.get_world_size(world_group)


class _NoWait(_Mean):
    """Divides before the asynchronous all-reduce is waited on (a race on gloo and NCCL alike)."""

    @staticmethod
    def reduce_moe_gradients(dense_params, expert_params, dp_group, world_group):
        for params, group in ((dense_params, world_group), (expert_params, dp_group)):
            for p in params:
                if p.grad is not None:
                    torch.distributed.all_reduce(p.grad, group=group, async_op=True)
                    p.grad /= torch.distributed.get_world_size(world_group)


_UNUSED = dict(name="unused", dtype="float32", no_grad=["dense", 1, True])       # a case given as a dict


@pytest.mark.parametrize("impl, case, passes", [(_Mean, "frozen", True), (_Mean, _UNUSED, True),
                                                (_DividedByDp, "frozen", False), (_SkipsFrozenOnly, _UNUSED, False),
                                                (_NoWait, "fp32", "never waited")])
def test_grads_probe_on_a_2x2_mesh(impl, case, passes):
    dp_groups, _ = ep_grads.mesh_groups(2, 2)
    world = group_rehearsal.ThreadGroup(range(4))

    def rehearse():
        return run_in_thread_ranks(4, lambda r: ep_grads.probe(impl, case, r, 2, 2,
                                                               group_rehearsal.ThreadGroup(dp_groups[r % 2]), world),
                                   more_fakes=group_rehearsal.fakes)
    if passes == "never waited":     # the rehearsal names the async all-reduces no one waited on
        from lablib.probes.rehearsal import NeverWaited
        with pytest.raises(NeverWaited, match=r"never waited \(all_reduce\)"):
            rehearse()
        return
    records = rehearse()
    if passes:
        for record in records:
            ep_grads.check(record, real_ranks=False)
    else:
        with pytest.raises(checks.CheckFailed, match="expert|dense|failed"):
            ep_grads.check(records[0], real_ranks=False)


def test_rehearsal_async_result_lands_on_wait():
    def body(rank):
        t = torch.tensor([float(rank + 1)])
        work = torch.distributed.all_reduce(t, async_op=True)
        before = t.item()
        work.wait()
        return before, t.item()
    assert run_in_thread_ranks(2, body, more_fakes=group_rehearsal.fakes) == [(1.0, 3.0), (2.0, 3.0)]


def test_visible_cases_only_in_lablib_and_dict_cases_checked():
    assert set(ep_dispatch.CASES) == {"uneven", "empty", "one"} and set(ep_grads.CASES) == {"fp32", "frozen"}
    drawn = ep_dispatch.resolve_case(dict(name="top3", k=3, dtype="float64", routing="random", seed=9, tokens=[2, 5]))
    assert [ep_dispatch.tokens_on(r, drawn) for r in range(3)] == [2, 5, 2]
    data = ep_dispatch.routing(drawn, 2, 4, 0)
    assert data[0][1].shape == (2, 3) and data[0][0].dtype == torch.float64
    for bad in (dict(name="x", k=0, dtype="float32", routing="random"), dict(name="x", k=1, dtype="half",
                routing="random"), dict(name="x", k=1, dtype="float32", routing="random", tokens=[0]),
                dict(name="x", k=1, dtype="float32"), dict(name="x", k=1, dtype="float32", routing="one", extra=1)):
        with pytest.raises(ValueError, match="dispatch case"):
            ep_dispatch.resolve_case(bad)
    with pytest.raises(ValueError, match="ep_dp case"):
        ep_grads.resolve_case(dict(name="x", dtype="float32", no_grad=["nope", 0, True]))


def test_run_config_validation():
    with pytest.raises(ValueError, match="unknown"):
        ep_run.Config(exercise="dispatch", cases=("nope",)).validate()
    with pytest.raises(ValueError, match="dispatch case"):
        ep_run.Config(exercise="dispatch", cases_json='[{"name": "x", "k": 1}]').validate()
    with pytest.raises(ValueError, match="cases_json"):
        ep_run.Config(exercise="dispatch", cases_json='{"name": "x"}').validate()
    with pytest.raises(ValueError, match="needs 4 ranks"):
        ep_run.Config(exercise="ep_dp", mesh="2x2").validate_world(2)
    ep_run.Config(exercise="ep_dp", mesh="2x2", cases=("frozen",)).validate()


_SOLUTION_LIKE = """
import torch
import torch.distributed as dist
{import_line}


def expert_parallel_moe(x, expert_index, gates, local_experts, num_experts, group):
    n = dist.get_world_size(group)
    counts = torch.zeros(num_experts, dtype=torch.int64)
    out = torch.empty_like(counts)
    {call}(out, counts, group=group)
    return x * 0
"""


@pytest.mark.parametrize("import_line, call, stepped_aside", [
    ("", "dist.all_to_all_single", False),
    ("from torch.distributed import all_to_all_single", "all_to_all_single", True),
    ("from torch.distributed._functional_collectives import all_to_all_single_autograd as a2a",
     "(lambda o, i, group: a2a(i, None, None, group))", True)])
def test_rehearsal_steps_aside_for_names_bound_before_it(tmp_path, import_line, call, stepped_aside):
    """A name bound before the rehearsal is torch's real collective: it meets the rehearsal's group and raises
    (distributed_c10d.py / _functional_collectives.py frames); the rehearsal then returns [] (the real run
    decides) instead of failing the answer. A rehearsed call runs (and this wrong answer fails its check)."""
    from lablib.labs.expert_parallel import probes as ep_probes

    impl = tmp_path / "impl.py"
    impl.write_text(_SOLUTION_LIKE.format(import_line=import_line, call=call))
    records = ep_probes.rehearse_dispatch(str(impl), 2, ("uneven",))
    assert (records == []) == stepped_aside
    if not stepped_aside:
        with pytest.raises(checks.CheckFailed):
            ep_probes.check_records(records, "dispatch", real_ranks=False)


class _WholeBatch:
    """Right values and rows, but every rank's whole batch goes to every rank and dense (T, k, h) results come
    back: the exact byte formula must reject it on threads (the old bound 2 k T h b + 4096 let it pass)."""

    @staticmethod
    def expert_parallel_moe(x, expert_index, gates, local_experts, num_experts, group):
        dist = torch.distributed
        n, me, per_rank = dist.get_world_size(group), dist.get_rank(group), len(local_experts)
        T, k = expert_index.shape
        sizes = torch.full((n,), T, dtype=torch.int64)
        theirs = torch.empty_like(sizes)
        dist.all_to_all_single(theirs, sizes, group=group)
        recv = theirs.tolist()
        xs = x.new_empty((sum(recv), x.shape[1]))
        dist.all_to_all_single(xs, x.detach().repeat(n, 1), recv, [T] * n, group=group)
        idx = expert_index.new_empty((sum(recv), k))
        dist.all_to_all_single(idx, expert_index.repeat(n, 1), recv, [T] * n, group=group)
        dense = xs.new_zeros((sum(recv), k, x.shape[1]))
        with torch.no_grad():
            for i, expert in enumerate(local_experts):
                t, j = (idx == me * per_rank + i).nonzero(as_tuple=True)
                dense[t, j] = expert(xs[t])
        back = dense.new_empty((n * T, k * x.shape[1]))
        dist.all_to_all_single(back, dense.reshape(sum(recv), -1), [T] * n, recv, group=group)
        return (back.view(n, T, k, -1).sum(0) * gates.unsqueeze(-1)).sum(1)


def test_dispatch_bytes_are_the_formula_exactly():
    calls = [[], []]
    group = group_rehearsal.ThreadGroup([0, 1])
    records = run_in_thread_ranks(2, lambda r: ep_dispatch.probe(_WholeBatch, "uneven", r, 2, group, steps=1,
                                                                 thread_calls=calls[r]),
                                  more_fakes=lambda world, local: group_rehearsal.fakes(world, local, calls))
    step = records[0]["steps"][0]
    assert step["output"] <= step["output_bound"] and step["rows"] == step["wanted_rows"]      # values are right
    with pytest.raises(checks.CheckFailed, match="bytes the forward sends"):
        ep_dispatch.check({**records[0], "steps": [{**step, "x_grad": 0.0, "gates_grad": 0.0,
                                                     "expert_grads": {"-": 0.0}, "expert_grads_none": []}]}, real_ranks=False)


def test_grouped_mm_experts_equal_the_loop_with_an_empty_expert():
    """torch._grouped_mm on the CPU (torch 2.13): the dropless grouped product equals the loop over experts, an
    expert with no row included. Both compute the same sums in float32, maybe in other orders: each differs from
    the exact value by at most gamma_{h+1} (first product and bias) times its magnitudes, carried through GELU
    (slope at most 1.13) and |W2|, plus gamma_{4h+1} times the second product's magnitudes; twice that between
    the two (Higham, Lemma 3.1 and the dot-product bound 3.5)."""
    from lablib.course.models import MLPBlock
    from lablib.measure.rankcheck import gamma

    torch.manual_seed(0)
    experts = nn.ModuleList(MLPBlock(GPTConfig(n_embd=16, n_head=1)) for _ in range(4))
    counts = torch.tensor([5, 0, 11, 3])
    x = torch.randn(int(counts.sum()), 16)
    loop = moe.experts_in_a_loop(x, counts, experts)
    grouped = moe.experts_grouped_mm(x, counts, moe.stack_experts(experts))
    assert grouped.shape == loop.shape
    bound = []
    with torch.no_grad():
        for expert, rows in zip(experts, x.double().split(counts.tolist())):
            w1, b1 = expert.c_fc.weight.double(), expert.c_fc.bias.double()
            w2, b2 = expert.c_proj.weight.double(), expert.c_proj.bias.double()
            first = rows.abs() @ w1.abs().t() + b1.abs()                       # magnitudes of the first sums
            second = torch.nn.functional.gelu(rows @ w1.t() + b1).abs() @ w2.abs().t() + b2.abs()
            bound.append(2 * (gamma(16 + 1) * 1.13 * (first @ w2.abs().t()) + gamma(4 * 16 + 1) * second))
    assert torch.all((grouped - loop).abs().double() <= torch.cat(bound))
    times = moe.time_grouped_vs_loop(x, counts, experts, rounds=2, calls=1)
    assert set(times) == {"loop", "grouped", "loop again"} and all(len(v) == 2 for v in times.values())
