"""Lab 09's library pieces: the GPT cut into stages, the schedules by simulation (against the closed forms),
the probe of an engine at one stage in this process, and one real torchrun run: a correct engine passes, a
blocking-send engine ends in a deadlock message that names who waited on whom.

The engines below are the test's own (posted receives and sends everywhere; a blocking-send variant), not
the lab's solution.
"""

from __future__ import annotations

import pytest
import torch

from lablib import checks, launch, pipeline, pipeline_probes
from lablib import config as cfg
from lablib.models import GPT, GPTConfig
from lablib.runs import pipeline as pipeline_run

ENGINE = '''
import torch, torch.distributed as dist


def pipeline_step(stage, ops, micro_inputs, micro_targets, activation_shape):
    me, n = dist.get_rank(), dist.get_world_size()
    saved, pending, losses = {}, [], [None] * len(micro_inputs)
    for kind, j in ops:
        if kind == "F":
            if me == 0:
                x = micro_inputs[j]
            else:
                x = torch.zeros(activation_shape)
                dist.irecv(x, me - 1).wait()
                x.requires_grad = True
            y = stage(x, micro_targets[j]) if me == n - 1 else stage(x)
            if me == n - 1:
                losses[j] = float(y.detach())
                y = y * (1.0 / len(micro_inputs))
            else:
                pending.append(SEND(y.detach(), me + 1))
            saved[j] = (x, y)
        else:
            x, y = saved.pop(j)
            if me == n - 1:
                torch.autograd.backward(y)
            else:
                g = torch.zeros(activation_shape)
                dist.irecv(g, me + 1).wait()
                torch.autograd.backward(y, g)
            if me > 0:
                pending.append(SEND(x.grad, me - 1))
    for p in pending:
        if p is not None:
            p.wait()
    return losses if me == n - 1 else []
'''


def write_engine(path, blocking=False):
    send = "dist.send" if blocking else "dist.isend"
    path.write_text(ENGINE.replace("SEND", send))
    return str(path)


def test_layer_split_is_even_and_validated():
    assert [list(r) for r in pipeline.layer_split(5, 3)] == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="n_layer"):
        pipeline.layer_split(2, 3)


@pytest.mark.parametrize("p", [1, 2, 3])
def test_stages_compose_to_the_model(p):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=11, block_size=6, n_layer=3, n_head=2, n_embd=8)
    model = GPT(config)
    ids = torch.randint(0, 11, (3, 6))
    targets = torch.roll(ids, -1, 1)
    loss = model(ids, targets)[1]
    loss.backward()
    torch.manual_seed(0)
    stages = pipeline.gpt_stages(GPT(config), p)
    x = ids
    for stage in stages[:-1]:
        x = stage(x)
    staged = stages[-1](x, targets)
    staged.backward()
    assert torch.allclose(staged, loss)
    grads = pipeline.combine_stage_gradients([pipeline.stage_gradients(s) for s in stages])
    reference = pipeline.model_gradients(model)
    assert sorted(grads) == sorted(reference)
    for name, g in reference.items():
        assert torch.allclose(grads[name], g, atol=1e-6), name


@pytest.mark.parametrize("p,m", [(1, 1), (2, 1), (3, 2), (4, 8), (5, 3)])
def test_simulation_matches_the_closed_forms(p, m):
    for kind in pipeline.KINDS:
        ops = pipeline.simulate(kind, p, m)
        assert pipeline.idle_fraction(ops) == pytest.approx((p - 1) / (m + p - 1))
        expected = [m] * p if kind == "gpipe" else [min(m, p - s) for s in range(p)]
        assert [pipeline.peak_held(r) for r in ops] == expected
    first = pipeline.schedule("1f1b", p, m)[0]
    warmup = min(p - 1, m)
    assert first[:warmup] == [("F", j) for j in range(warmup)]


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (3, 6, 2)])
def test_interleaved_bubble_is_megatrons(p, m, v):
    ops = pipeline.simulate("1f1b", p, m, chunks=v)
    assert pipeline.idle_fraction(ops) == pytest.approx((p - 1) / (v * m + p - 1))
    with pytest.raises(ValueError, match="multiple"):
        pipeline.simulate("1f1b", p, m + 1, chunks=v)


def test_simulate_validates():
    with pytest.raises(ValueError, match="at least 1"):
        pipeline.simulate("gpipe", 2, 0)
    with pytest.raises(ValueError, match="kind"):
        pipeline.simulate("zb", 2, 2)


def test_probe_at_one_stage(tmp_path):
    engine = pipeline_probes.load_engine(write_engine(tmp_path / "engine_impl.py"))
    results = pipeline_probes.probe_without_processes(engine)
    for r in results:
        pipeline_probes.check_engine(r)
    assert results[1]["ran"] == [[["F", 0], ["B", 0], ["F", 1], ["B", 1]]]


def test_probe_catches_a_missing_loss_scale(tmp_path):
    source = ENGINE.replace("SEND", "dist.isend").replace("y = y * (1.0 / len(micro_inputs))", "pass")
    (tmp_path / "engine_impl.py").write_text(source)
    engine = pipeline_probes.load_engine(str(tmp_path / "engine_impl.py"))
    with pytest.raises(checks.CheckFailed, match="gradients"):
        for r in pipeline_probes.probe_without_processes(engine, ("gpipe:1:3",)):
            pipeline_probes.check_engine(r)


def test_config_is_strict():
    with pytest.raises(cfg.ConfigError):
        cfg.from_argv(pipeline_run.Config, ["--cases", "gpipe:2:4", "--bogus", "1"])
    with pytest.raises(ValueError, match="schedule"):
        pipeline_probes.parse_case("zb:2:2")


def test_real_ranks_pass_and_a_blocking_send_deadlocks_with_a_message(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    good = launch.run("pipeline", {"impl": write_engine(tmp_path / "good.py"), "cases": ("1f1b:2:3", "gpipe:2:2")},
                      nproc=2, timeout_s=120, quiet=True)
    for r in good.metrics.runs.values():
        pipeline_probes.check_engine(r)
    bad = launch.run("pipeline", {"impl": write_engine(tmp_path / "bad.py", blocking=True),
                                  "cases": ("1f1b:2:4", "gpipe:2:2"), "p2p_timeout_s": 3.0},
                     nproc=2, timeout_s=120, quiet=True)
    assert list(bad.metrics.runs) == ["1f1b:2:4"]            # stopped at the first failing case
    r = bad.metrics.runs["1f1b:2:4"]
    assert "rank 0 waited in send (send to rank 1" in r.deadlock
    assert "rank 1 waited in send (send to rank 0" in r.deadlock
    with pytest.raises(checks.CheckFailed, match="deadlock"):
        pipeline_probes.check_engine(r)


def test_torch_pipelining_runs_the_same_stages(tmp_path, monkeypatch):
    """The comparison run: torch's schedules on gpt_stages give one process's losses; GPipe holds more."""
    from lablib.runs import pipeline_torch

    with pytest.raises(ValueError, match="unknown"):
        pipeline_torch.Config(schedules=("zb",)).validate()
    monkeypatch.chdir(tmp_path)
    run = launch.run("pipeline_torch", {"schedules": ("gpipe", "1f1b", "interleaved_1f1b"), "steps": 1,
                                        "n_microbatches": 4, "n_embd": 16, "block_size": 8}, nproc=2, timeout_s=180,
                     quiet=True)
    m = run.metrics
    for s in m.schedules.values():
        assert s.losses == pytest.approx(m.reference_losses, rel=1e-4)
    assert m.schedules["gpipe"].peak_activation_bytes[0] > m.schedules["1f1b"].peak_activation_bytes[0]
