"""lablib.tp_probes and lablib.tensor_parallel without a torchrun start: the reference f and g, the layouts,
the probe's verdicts on stand-in modules at world size 1, and DTensor's plan on a mesh of one rank."""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lablib import tensor_parallel, tp_probes
from lablib.checks import CheckFailed
from lablib.models import GPT, GPTConfig
from lablib.runs import tensor_parallel as tp_run


@pytest.fixture()
def one_rank():
    with tp_probes.one_process() as env:
        yield env


def copy_of(function):
    """The same code as a new function object: what a student who copied lablib's reference would run."""
    return types.FunctionType(function.__code__, function.__globals__, function.__name__)


def test_reference_f_and_g_communicate_in_one_direction_each(one_rank):
    pair = types.SimpleNamespace(f=copy_of(tp_probes.reference_f), g=copy_of(tp_probes.reference_g))
    record = tp_probes.probe_f_g(pair, 1, dist.group.WORLD, 0)
    tp_probes.check_f_g(record)
    assert record["f"]["forward"] == {} and record["f"]["backward"] == {"all_reduce": 1}
    assert record["g"]["forward"] == {"all_reduce": 1} and record["g"]["backward"] == {}


def test_the_reference_pair_itself_is_refused_as_an_answer(one_rank):
    with pytest.raises(CheckFailed, match="not an answer"):
        tp_probes.check_f_g(tp_probes.probe_f_g(tp_probes.REFERENCE_F_G, 1, dist.group.WORLD, 0))
    x = torch.ones(2, requires_grad=True)
    assert torch.equal(tp_probes.reference_f(x, dist.group.WORLD), x)     # and works again after the probe


def test_swapped_f_and_g_fail_the_check(one_rank):
    swapped = types.SimpleNamespace(f=copy_of(tp_probes.reference_g), g=copy_of(tp_probes.reference_f))
    with pytest.raises(CheckFailed, match="all-reduces"):
        tp_probes.check_f_g(tp_probes.probe_f_g(swapped, 1, dist.group.WORLD, 0))


class WholeMLP(nn.Module):
    """A stand-in for a student's class at world size 1: the full layers, f and g around them."""

    def __init__(self, mlp, group, bias_twice=False):
        super().__init__()
        self.c_fc, self.c_proj, self.group, self.bias_twice = mlp.c_fc, mlp.c_proj, group, bias_twice

    def forward(self, x):
        h = F.gelu(self.c_fc(tp_probes.reference_f(x, self.group)))
        out = tp_probes.reference_g(h @ self.c_proj.weight.T, self.group)
        if self.c_proj.bias is not None:
            out = out + self.c_proj.bias * (2 if self.bias_twice else 1)
        return out


def test_probe_passes_a_correct_module_and_fails_a_doubled_bias(one_rank):
    good = types.SimpleNamespace(TensorParallelMLP=WholeMLP)
    for record in tp_probes.probe_without_processes(good, "mlp"):
        tp_probes.check_layer(record)
    bad = types.SimpleNamespace(TensorParallelMLP=lambda mlp, group: WholeMLP(mlp, group, bias_twice=True))
    record = tp_probes.probe_layer(bad, "mlp", 1, dist.group.WORLD, one_rank, bias=True)
    with pytest.raises(CheckFailed, match="loss"):
        tp_probes.check_layer(record)


def test_probe_reports_wrong_shapes_without_running():
    assert tp_probes.shard_shape((12, 4), "col", 2) == (6, 4)
    assert tp_probes.shard_shape((4, 12), "row", 3) == (4, 4)
    assert tp_probes.shard_shape((7,), "replicated", 2) == (7,)
    record = {"kind": "mlp", "tp": 2, "bias": True, "error": None, "missing": [], "extra": [],
              "wrong_shapes": {"c_fc.weight": [[64, 8], [32, 16]]}}
    with pytest.raises(CheckFailed, match="shape of this rank's c_fc.weight"):
        tp_probes.check_layer(record)


def test_groups_and_their_process_counts():
    assert tp_probes.parse_groups("3") == (1, 3) and tp_probes.parse_groups("2x2") == (2, 2)
    assert tp_probes.nproc_for(("2x2", "3", "4")) == 4 and tp_probes.nproc_for(("2",)) == 2
    with pytest.raises(ValueError, match="not 'N' or 'KxN'"):
        tp_run.Config(groups=("two",)).validate()
    with pytest.raises(ValueError, match="need exactly 4 processes"):
        tp_run.Config(groups=("2x2",)).validate_world(2)


def test_qkv_rows_by_rank_puts_each_ranks_heads_together():
    order = tensor_parallel.qkv_rows_by_rank(4, 2)
    assert order.tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
    assert sorted(order.tolist()) == list(range(12))


def test_dtensor_plan_on_one_rank_gives_the_single_process_loss_and_gradients(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    torch.manual_seed(0)
    single = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16))
    parallel = tensor_parallel.apply_dtensor(copy.deepcopy(single), init_device_mesh("cpu", (1,)), vocab_parallel=True)
    assert parallel.lm_head.weight is parallel.wte.weight, "the tied weight must stay tied"
    idx, targets = torch.randint(0, 16, (2, 8)), torch.randint(0, 16, (2, 8))
    _, loss = single(idx, targets)
    loss.backward()
    with loss_parallel():
        _, parallel_loss = parallel(idx, targets)
        parallel_loss.backward()
    assert abs(parallel_loss.full_tensor().item() - loss.item()) < 1e-6
    grads = tensor_parallel.full_gradients(parallel, dist.group.WORLD, 1)
    for name, p in single.named_parameters():
        assert torch.allclose(grads[name], p.grad, atol=1e-6), name
    assert tensor_parallel.local_param_bytes(parallel) == tensor_parallel.local_param_bytes(single)


def test_a_degree_that_does_not_divide_is_refused_up_front():
    with pytest.raises(ValueError, match="must divide n_head=4"):
        tensor_parallel.check_divides(GPT(GPTConfig(n_layer=1, n_head=4, n_embd=32)), 3)


def test_2d_run_validates_its_mesh_up_front():
    from lablib.runs import tp_2d

    with pytest.raises(ValueError, match="must split evenly over data_parallel=3"):
        tp_2d.Config(data_parallel=3).validate()
    with pytest.raises(ValueError, match="must divide the 3 ranks"):
        tp_2d.Config().validate_world(3)
