"""lablib.measure.benchmark (StepMeter), lablib.parallel.activation_checkpointing, lablib.measure.rankcheck, and
lab 05's package lablib.labs.gpt_migration (training, probes and run, the run script gpt_migration)."""

from __future__ import annotations

import os

import textwrap

import pytest
import torch

from pathlib import Path
from types import SimpleNamespace

from lablib.course import data
from lablib.labs.gpt_migration import training
from lablib.jobs import launch
from lablib.measure import timing
from lablib.measure.benchmark import StepMeter
from lablib.measure.memory import saved_activation_bytes
from lablib.parallel.activation_checkpointing import CheckpointedBlock, apply_activation_checkpointing
from lablib.jobs.distenv import from_env
from lablib.measure.rankcheck import RecordingDataset, shard_report, weight_spread
from lablib.jobs.distenv import gather_objects
from lablib.course.models import GPT, GPTConfig
from lablib.labs.gpt_migration import run as gpt_migration

TINY = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _loss_and_grads(model, x):
    _, loss = model(x, x)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def test_activation_checkpointing_changes_nothing_but_memory():
    torch.manual_seed(0)
    plain = GPT(TINY)
    torch.manual_seed(0)
    wrapped = apply_activation_checkpointing(GPT(TINY))
    apply_activation_checkpointing(wrapped)                       # idempotent: no double wrapping
    assert all(isinstance(b, CheckpointedBlock) and not isinstance(b.block, CheckpointedBlock) for b in wrapped.h)
    x = torch.randint(0, 65, (4, 16))
    loss_a, grads_a = _loss_and_grads(plain, x)
    loss_b, grads_b = _loss_and_grads(wrapped, x)
    assert loss_a == pytest.approx(loss_b, abs=1e-6)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_rankcheck_in_one_process():
    data = RecordingDataset(list(range(10)))
    assert [data[i] for i in (3, 1, 3)] == [3, 1, 3] and data.seen == [3, 1, 3] and len(data) == 10
    assert shard_report([[0, 2, 4], [1, 3, 5]]) == {"samples_per_rank": [3, 3], "distinct_per_rank": [3, 3],
                                                    "overlapping_samples": 0}
    assert shard_report([[0, 1, 2], [2, 1, 7]])["overlapping_samples"] == 2
    env = from_env()
    assert gather_objects({"a": 1}, env) == [{"a": 1}]
    assert weight_spread(GPT(TINY), env) == 0.0


def test_step_meter_in_one_process(capsys):
    torch.manual_seed(0)
    model = GPT(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meter = StepMeter(from_env(), model, optimizer, tokens_per_step=64, total_steps=8, eval_every=100)
    x = torch.randint(0, 65, (4, 16))
    for step in range(1, 9):
        _, loss = model(x, x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        meter(step, loss)
    out = meter.summary()
    P = model.num_params()
    memory = out["memory"]
    assert memory["params"] == 4 * P                               # tied weights counted once
    assert memory["optimizer"] >= 8 * P                            # two AdamW moments (+ step counters)
    assert memory["during_step"] >= 4 * P                          # at least the gradients are allocated in a step
    assert memory["upper_bound"] == memory["at_rest"] + memory["during_step"]
    assert memory["end_of_forward"] == memory["at_rest"] + memory["activations"]
    # CPU time / wall time of a step: positive, and at most every core busy (a process may run several threads;
    # short intervals and the clocks' granularity give some slack).
    assert 0 < out["cpu_share_per_rank"][0] <= 1.5 * (os.cpu_count() or 1)
    assert len(out["median_step_s_per_rank"]) == 1 and out["median_step_s"] == timing.median(out["step_s"])
    # One counter of saved activations: the meter's equals lab 04's count of the same forward, which leaves the
    # parameters out by their storages (a Linear saves its weight as a transposed view, not the leaf).
    saved, _ = saved_activation_bytes(lambda: model(x, x)[1], exclude=list(model.parameters()) + list(model.buffers()))
    assert memory["activations"] == saved.bytes > 0
    assert out["collectives_per_step"] == {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
    assert out["tokens_per_s"] > 0 and len(out["train_losses"]) == 8
    assert out["timed_steps"] >= 3


def test_config_is_validated_before_launch():
    with pytest.raises(ValueError, match="unknown"):
        launch.run("gpt_migration", {"variants": "zero3"}, nproc=1, timeout_s=30)
    with pytest.raises(ValueError, match="nproc=1"):
        launch.run("gpt_migration", {"variants": "single"}, nproc=2, timeout_s=30)
    with pytest.raises(ValueError, match="divisible"):
        launch.run("gpt_migration", {"variants": "fsdp", "batch_size": 16, "fsdp_impl": __file__}, nproc=3,
                   timeout_s=30)


DDP_IMPL = '''
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

def wrap_model(model, env):
    return DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None)

def make_loader(dataset, batch_size, env, seed):
    sampler = DistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank, seed=seed, drop_last=True)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)

def start_epoch(loader, epoch):
    loader.sampler.set_epoch(epoch)

def mean_across_ranks(value, env):
    total = value.detach().clone().float()
    dist.all_reduce(total)
    return total.item() / env.world_size
'''

FSDP_IMPL = '''
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

def apply_fsdp(model, mesh=None):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model
'''


def test_gpt_migration_counts_and_shards_on_two_ranks(tmp_path):
    (tmp_path / "ddp_impl.py").write_text(textwrap.dedent(DDP_IMPL))
    (tmp_path / "fsdp_impl.py").write_text(textwrap.dedent(FSDP_IMPL))
    result = launch.run("gpt_migration",
                        {"variants": "ddp,fsdp", "ddp_impl": str(tmp_path / "ddp_impl.py"), "fsdp_impl": str(tmp_path / "fsdp_impl.py"), "steps": 6, "eval_every": 3, "n_embd": 32, "ckpt_dir": str(tmp_path / "ckpt"),
                         "exchange_rounds": 2},
                        nproc=2, timeout_s=240, quiet=True, show_progress=False)
    ddp, fsdp = result["metrics"]["ddp"], result["metrics"]["fsdp"]
    assert ddp["collectives_per_step"] == {"all_reduce": 1, "all_gather": 0, "reduce_scatter": 0}
    assert fsdp["collectives_per_step"] == {"all_reduce": 0, "all_gather": 5, "reduce_scatter": 3}   # 2L+1, L+1
    assert ddp["weight_spread_across_ranks"] == 0.0
    assert ddp["samples_seen"]["overlapping_samples"] == 0
    assert fsdp["fsdp_plan"]["units"] == {name: {"param_dtype": "torch.bfloat16", "reduce_dtype": "torch.float32"}
                                          for name in ("", "h.0", "h.1")}
    assert ddp["probe"]["loader"]["sampler"] == ["DistributedSampler"] * 2
    assert ddp["val_curve"][-1][0] == 6 and ddp["evaluation_steps"] == [3, 6]
    assert all(abs(b - fsdp["full_param_bytes"] / 2) <= 0.02 * fsdp["full_param_bytes"] for b in fsdp["param_bytes_per_rank"])
    assert fsdp["memory"]["at_rest"] < ddp["memory"]["at_rest"] / 2   # 12P/2 against 16P
    assert (tmp_path / "ckpt" / "ddp_rank0.pt").is_file() and (tmp_path / "ckpt" / "fsdp_dcp").is_dir()
    assert list(gpt_migration.SETUPS)[0] == "single"
    # no exchange is the same DDP model inside no_sync(): no all-reduce; the rounds keep each arm's steps in order
    exchange = ddp["exchange"]
    assert {arm: exchange[arm]["allreduce_calls_per_step"] for arm in ("ddp", "no_exchange", "ddp_again")} == \
        {"ddp": 1, "no_exchange": 0, "ddp_again": 1}
    assert exchange["ratio_per_round"] == [a / b for a, b in zip(exchange["ddp"]["step_s"], exchange["no_exchange"]["step_s"])]
    assert len(exchange["floor_per_round"]) == 2 and len(exchange["ddp"]["cpu_s"]) == 2


def test_evaluation_steps_and_reference_loop_in_one_process():
    assert training.evaluation_steps(24, 10) == [10, 20, 24] and training.evaluation_steps(20, 10) == [10, 20]
    ds = data.BlockDataset(torch.randint(0, 65, (4001,)), block_size=16)
    env = from_env()
    model = GPT(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = SimpleNamespace(steps=5, batch_size=8, val_batch_size=4, eval_every=2, seed=0)
    calls = []
    curve, trained = training.train_loop(model, optimizer, ds, ds, config, env, training.reference_parts(),
                                         lambda step, loss: calls.append(step))
    assert calls == [1, 2, 3, 4, 5] and [s for s, _ in curve] == [2, 4, 5] and trained is model
    full = training.evaluate(model, ds, 50, env)
    assert curve[-1][1] == pytest.approx(full, rel=1e-5)   # batch size does not change the mean


def test_exercises_are_graded_against_lablib_references_not_each_other():
    """No cascade: the FSDP2 and Accelerate test cells use lablib's baseline, never the student's DDP run."""
    import sys
    sys.path.insert(0, str(Path(__file__).parent))
    import labkit
    nb = labkit.read("05_gpt_migration")
    for exercise in ("apply_fsdp", "accelerate_loop"):
        for grade_id, (index, _) in labkit.test_cells(nb, exercise).items():
            source = nb.cells[index].source
            for name in ("ddp[", "ddp_accum", "ddp_run", "loader_probe", "mean_probe"):
                assert name not in source, f"{grade_id} depends on exercise 1's results ({name})"
