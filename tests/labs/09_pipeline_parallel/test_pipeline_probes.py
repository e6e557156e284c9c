"""Lab 09's library pieces: the GPT cut into stages, a given order played in time (against the closed forms, with
the instructor's reference orders), exercise 1's property checks (they leave one 1F1B order for small p, m),
the probe of an engine at one stage in this process, and one real torchrun run: a correct engine passes, a
blocking-send engine ends in a deadlock message that names who waited on whom.

The engines below are the test's own (posted receives and sends everywhere; a blocking-send variant), not
the lab's solution.
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch

from instructor.references import pipeline as pipeline_ref
from lablib import checks
from lablib.jobs import launch
from lablib.parallel import pipeline
from lablib.labs.pipeline_parallel import probe as pipeline_probes
from lablib.labs.pipeline_parallel import rehearsal as pipeline_rehearsal
from lablib.jobs import config as cfg
from lablib.course.models import GPT, GPTConfig
from lablib.labs.pipeline_parallel import run_pipeline as pipeline_run

EXAMPLE = {"gpipe:2:2": ["F0 F1 B0 B1", "F0 F1 B0 B1"], "1f1b:2:3": ["F0 F1 B0 F2 B1 B2", "F0 B0 F1 B1 F2 B2"]}

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


def test_lablib_makes_no_schedule():
    """Students install lablib: it plays an order it is given, and makes no GPipe or 1F1B order nor formula."""
    for name in ("schedule", "simulate", "in_flight_limit", "bubble_fraction", "peak_in_flight", "REFERENCES"):
        assert not hasattr(pipeline, name), name
    with pytest.raises(ValueError, match="at least 2 chunks"):
        pipeline.interleaved_order(4, 8, 1, 0)


@pytest.mark.parametrize("p,m", [(1, 1), (2, 1), (3, 2), (4, 8), (5, 3), (8, 40)])
def test_reference_orders_played_give_the_closed_forms(p, m):
    for kind in pipeline_ref.KINDS:
        played = pipeline.play(pipeline_ref.schedule(kind, p, m))
        assert pipeline.idle_fraction(played) == pytest.approx(pipeline_ref.bubble_fraction(p, m))
        assert [pipeline.peak_held(r) for r in played] == [pipeline_ref.peak_in_flight(kind, p, m, s) for s in range(p)]
        assert max(op.end for r in played for op in r) == 3 * (m + p - 1)
        pipeline_probes.check_schedule(kind, pipeline_ref.schedule(kind, p, m), p, m)
    first = pipeline_ref.schedule("1f1b", p, m)[0]
    forwards = min(p, m)                       # stage 0: p - 1 warm-up forwards, then the steady state's first
    assert first[:forwards] == [("F", j) for j in range(forwards)] and first[forwards] == ("B", 0)


def test_reference_is_quick_at_the_largest_drawn_size():
    import time
    t0 = time.perf_counter()
    orders = pipeline_ref.schedule("1f1b", 64, 512)
    assert time.perf_counter() - t0 < 10
    assert [pipeline.peak_held(r) for r in orders][:3] == [64, 63, 62]


def _rank_orders(m, cap):
    """Every order of one stage with forwards and backwards in micro-batch order, F j before B j, <= cap held."""
    out = []

    def extend(f, b, seq):
        if f == m and b == m:
            out.append(seq)
        if f < m and f - b < cap:
            extend(f + 1, b, seq + [("F", f)])
        if b < f:
            extend(f, b + 1, seq + [("B", b)])
    extend(0, 0, [])
    return out


@pytest.mark.parametrize("p,m", [(2, 3), (2, 4), (3, 5), (4, 2), (4, 3), (4, 5)])
def test_exercise_1s_checks_leave_one_1f1b_order(p, m):
    """Exercise 3 compares with the student's own exercise 1 where it passes exercise 1's checks: at the (p, m)
    the notebook uses, those checks leave exactly one 1F1B order, the reference's (so no cascade)."""
    passing = []
    for combo in itertools.product(*[_rank_orders(m, min(p - s, m)) for s in range(p)]):
        try:                               # the step's length first: most orders fail there, and it is quick
            if max(op.end for r in pipeline.play(combo) for op in r) > 3 * (m + p - 1):
                continue
            pipeline_probes.check_schedule("1f1b", list(combo), p, m)
        except (pipeline.Deadlock, checks.CheckFailed):
            continue
        passing.append(list(combo))
    assert passing == [pipeline_ref.schedule("1f1b", p, m)]


def test_check_schedule_names_what_is_wrong():
    good = pipeline_ref.schedule("1f1b", 4, 3)
    with pytest.raises(checks.CheckFailed, match="one list of operations per stage"):
        pipeline_probes.check_schedule("1f1b", good[:3], 4, 3)
    with pytest.raises(checks.CheckFailed, match="missing B2"):
        pipeline_probes.check_schedule("1f1b", [good[0][:-1]] + good[1:], 4, 3)
    with pytest.raises(checks.CheckFailed, match=r"stage 2: runs more forwards before its first backward than the step needs"):
        pipeline_probes.check_schedule("1f1b", good[:2] + [pipeline_ref.schedule("gpipe", 4, 3)[2]] + good[3:], 4, 3)
    with pytest.raises(checks.CheckFailed, match="every forward before"):
        pipeline_probes.check_schedule("gpipe", good, 4, 3)
    with pytest.raises(checks.CheckFailed, match="wait for each other"):
        pipeline_probes.check_schedule("1f1b", [good[0], [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]]
                                       + good[2:], 4, 3)
    with pytest.raises(checks.CheckFailed, match="two forwards in a row after the first backward"):
        pipeline_probes.check_schedule("1f1b", [good[0], [("F", 0), ("B", 0), ("F", 1), ("F", 2), ("B", 1), ("B", 2)]]
                                       + good[2:], 4, 3)
    slow = [[op for j in range(3) for op in (("F", j), ("B", j))] for _ in range(2)]
    with pytest.raises(checks.CheckFailed, match=r"takes 18, not \(m \+ p - 1\)\(t_f \+ t_b\) = 12"):
        pipeline_probes.check_schedule("1f1b", slow, 2, 3)
    with pytest.raises(checks.CheckFailed, match="pairs"):
        pipeline_probes.check_schedule("gpipe", [["F0", "B0"]], 1, 1)
    with pytest.raises(checks.CheckFailed, match="stage 0: differs at operation 1 of 6"):
        pipeline_probes.check_same_schedule(slow, pipeline_ref.schedule("1f1b", 2, 3), "1F1B")


def test_answer_without_module_refuses_the_reference_and_a_copy_of_its_code():
    copy = types.FunctionType(pipeline_ref.schedule.__code__, pipeline_ref.schedule.__globals__)
    for answer in (lambda: pipeline_ref.schedule("1f1b", 2, 3), lambda: copy("1f1b", 2, 3)):
        with pytest.raises(checks.CheckFailed, match="not yours"):
            with pipeline_probes.answer_without_module(pipeline_ref, reason="not yours"):
                answer()
    with pipeline_probes.answer_without_module(pipeline_ref, reason="not yours"):
        assert pipeline.play([[("F", 0), ("B", 0)]])[0][1].end == 3.0     # lablib itself is allowed
    assert pipeline_ref.schedule("gpipe", 1, 1) == [[("F", 0), ("B", 0)]]


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (3, 6, 2)])
def test_interleaved_bubble_is_megatrons(p, m, v):
    ops = pipeline.play([pipeline.interleaved_order(p, m, v, r) for r in range(p)], chunks=v)
    assert pipeline.idle_fraction(ops) == pytest.approx((p - 1) / (v * m + p - 1))
    with pytest.raises(ValueError, match="multiple"):
        pipeline.interleaved_order(p, m + 1, v, 0)


def test_play_validates_and_names_a_deadlock():
    with pytest.raises(ValueError, match="twice"):
        pipeline.play([[("F", 0), ("F", 0), ("B", 0)]])
    with pytest.raises(ValueError, match="chunk"):
        pipeline.play([[("F", 0, 1), ("B", 0, 1)]])
    with pytest.raises(pipeline.Deadlock) as raised:
        pipeline.play([[("F", 0), ("F", 1), ("B", 0), ("B", 1)], [("F", 0), ("B", 0), ("B", 1)]])
    assert raised.value.waits == ["rank 0 waits to run B1 for rank 1's B1",
                                  "rank 1 waits to run B1 for its own F1 (no rank's list has it)"]
    assert pipeline.parse_orders(pipeline.orders_text(pipeline_ref.schedule("1f1b", 3, 4))) == \
        pipeline_ref.schedule("1f1b", 3, 4)
    with pytest.raises(ValueError, match="F<j> or B<j>"):
        pipeline.parse_orders("F0 X1")


def test_probe_at_one_stage(tmp_path):
    engine = pipeline_probes.load_engine(write_engine(tmp_path / "engine_impl.py"))
    results = pipeline_probes.probe_without_processes(engine, {"gpipe:1:3": ["F0 F1 F2 B0 B1 B2"],
                                                               "1f1b:1:2": ["F0 B0 F1 B1"]})
    for r in results:
        pipeline_probes.check_engine(r)
    assert results[1]["ran"] == [[["F", 0], ["B", 0], ["F", 1], ["B", 1]]]


def test_probe_catches_a_missing_loss_scale(tmp_path):
    source = ENGINE.replace("SEND", "dist.isend").replace("y = y * (1.0 / len(micro_inputs))", "pass")
    (tmp_path / "engine_impl.py").write_text(source)
    engine = pipeline_probes.load_engine(str(tmp_path / "engine_impl.py"))
    with pytest.raises(checks.CheckFailed, match="gradients"):
        for r in pipeline_probes.probe_without_processes(engine, {"gpipe:1:3": ["F0 F1 F2 B0 B1 B2"]}):
            pipeline_probes.check_engine(r)


def test_rehearsal_on_threads_passes_a_correct_engine_and_names_a_deadlock(tmp_path):
    cases = {**EXAMPLE, "1f1b:3:2": pipeline_ref.schedule("1f1b", 3, 2), "1f1b:2:1": pipeline_ref.schedule("1f1b", 2, 1)}
    good = pipeline_probes.load_engine(write_engine(tmp_path / "good.py"))
    results = pipeline_rehearsal.rehearse(good, cases)
    pipeline_rehearsal.check_rehearsal(results)
    assert [r["case"] for r in results] == list(cases)
    assert results[1]["ran"] == [[["F", 0], ["F", 1], ["B", 0], ["F", 2], ["B", 1], ["B", 2]],
                                 [["F", 0], ["B", 0], ["F", 1], ["B", 1], ["F", 2], ["B", 2]]]
    bad = pipeline_probes.load_engine(write_engine(tmp_path / "bad.py", blocking=True))
    results = pipeline_rehearsal.rehearse(bad, cases)
    pipeline_rehearsal.check_rehearsal(results[:1])          # GPipe's sends go one way at a time: no cycle
    with pytest.raises(checks.CheckFailed, match="rank 0 waits for its send to rank 1; rank 1 waits for its send"):
        pipeline_rehearsal.check_rehearsal(results[1:2])
    assert not torch.distributed.is_initialized() and torch.distributed.send is not None


def test_rehearsal_catches_a_wrong_gradient_and_steps_aside_for_names_bound_before(tmp_path):
    source = ENGINE.replace("SEND", "dist.isend").replace("                g = torch.zeros(activation_shape)\n"
                                                          "                dist.irecv(g, me + 1).wait()\n",
                                                          "                g = torch.zeros(activation_shape)\n"
                                                          "                dist.irecv(g, me + 1).wait()\n"
                                                          "                g = 2 * g\n")
    (tmp_path / "twice.py").write_text(source)
    with pytest.raises(checks.CheckFailed, match="gradients"):
        pipeline_rehearsal.check_rehearsal(pipeline_rehearsal.rehearse(
            pipeline_probes.load_engine(str(tmp_path / "twice.py")), EXAMPLE))
    bound = ENGINE.replace("import torch, torch.distributed as dist", "import torch, torch.distributed as dist\n"
                           "from torch.distributed import irecv").replace("dist.irecv(", "irecv(").replace("SEND", "dist.isend")
    (tmp_path / "bound.py").write_text(bound)
    assert pipeline_rehearsal.rehearse(pipeline_probes.load_engine(str(tmp_path / "bound.py")), EXAMPLE) is None


def test_config_is_strict():
    with pytest.raises(cfg.ConfigError):
        cfg.from_argv(pipeline_run.Config, ["--cases", "gpipe:2:4", "--bogus", "1"])
    with pytest.raises(ValueError, match="schedule"):
        pipeline_probes.parse_case("zb:2:2")
    with pytest.raises(ValueError, match="2 cases but 1 orders"):
        cfg.from_options(pipeline_run.Config, {"cases": ("gpipe:2:2", "1f1b:2:3"), "orders": ("F0 B0/F0 B0",),
                                               "impl": __file__})
    with pytest.raises(ValueError, match="micro-batch 0..1"):
        cfg.from_options(pipeline_run.Config, {"cases": ("gpipe:2:2",), "orders": ("F0 F2 B0 B1/F0 F1 B0 B1",),
                                               "impl": __file__})
    assert pipeline_probes.case_options(EXAMPLE)["orders"][1] == "F0 F1 B0 F2 B1 B2/F0 B0 F1 B1 F2 B2"
    for floor, repeat in (("gpipe:2:8", 3), (list(EXAMPLE)[0], 1)):   # not a case; no timed round to compare in
        with pytest.raises(ValueError, match="floor"):
            cfg.from_options(pipeline_run.Config, {**pipeline_probes.case_options(EXAMPLE), "floor": floor,
                                                   "repeat": repeat, "impl": __file__})


def test_real_ranks_pass_and_a_blocking_send_deadlocks_with_a_message(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    floor = list(EXAMPLE)[-1]
    good = launch.run("pipeline", {"impl": write_engine(tmp_path / "good.py"), **pipeline_probes.case_options(EXAMPLE),
                                   "repeat": 4, "floor": floor}, nproc=2, timeout_s=120, quiet=True)
    for case, r in good.metrics.runs.items():      # the measurement's rounds: round 0 warms up, three timed
        pipeline_probes.check_engine(r)
        assert len(r.idle_fractions) == len(r.step_s) == len(r.stage_costs) == len(r.model_idle_fractions) == 3
        # the drawn step is the timed round of median idle share (3 rounds: the middle one), and says which
        assert r.idle_fractions[r.drawn_round - 1] == pipeline.idle_fraction(r.events)
        assert sorted(r.idle_fractions)[1] == pipeline.idle_fraction(r.events)
        # the floor case ran a second time in every timed round (its own steps, not a copy of the first run's)
        assert ("floor_step_s" in r) == (case == floor)
        assert all(0 <= x < 1 for x in r.model_idle_fractions) and all(b > 0 for b in r.peak_activation_bytes)
    again = good.metrics.runs[floor]
    assert len(again.floor_step_s) == len(again.floor_idle_fractions) == 3
    assert all(0 < x < 1 for x in again.floor_idle_fractions) and again.floor_step_s != again.step_s
    cases = {"1f1b:2:4": pipeline_ref.schedule("1f1b", 2, 4), **EXAMPLE}
    bad = launch.run("pipeline", {"impl": write_engine(tmp_path / "bad.py", blocking=True),
                                  **pipeline_probes.case_options(cases), "p2p_timeout_s": 3.0},
                     nproc=2, timeout_s=120, quiet=True)
    assert list(bad.metrics.runs) == ["1f1b:2:4"]            # stopped at the first failing case
    r = bad.metrics.runs["1f1b:2:4"]
    assert "rank 0 waited in send (send to rank 1" in r.deadlock
    assert "rank 1 waited in send (send to rank 0" in r.deadlock
    with pytest.raises(checks.CheckFailed, match="deadlock"):
        pipeline_probes.check_engine(r)


def test_torch_pipelining_runs_the_same_stages(tmp_path, monkeypatch):
    """The comparison run: torch's schedules on gpt_stages give one process's losses; GPipe holds more."""
    from lablib.labs.pipeline_parallel import run_pipeline_torch as pipeline_torch

    with pytest.raises(ValueError, match="unknown"):
        pipeline_torch.Config(schedules=("zb",)).validate()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="floor"):
        pipeline_torch.Config(schedules=("gpipe",)).validate()
    run = launch.run("pipeline_torch", {"schedules": ("gpipe", "1f1b", "interleaved_1f1b"), "rounds": 2,
                                        "n_microbatches": 4, "n_embd": 16, "block_size": 8}, nproc=2, timeout_s=180,
                     quiet=True)
    m = run.metrics
    for s in m.schedules.values():
        assert s.losses == pytest.approx(m.reference_losses, rel=1e-4)
    assert m.schedules["gpipe"].peak_activation_bytes[0] > m.schedules["1f1b"].peak_activation_bytes[0]
    assert len(m.floor_ratios) == 2 and m.schedules["1f1b"].vs_floor is None      # 1F1B against itself: the floor
    for s in (m.schedules["gpipe"], m.schedules["interleaved_1f1b"]):
        assert [a / b for a, b in zip(s.step_s, m.schedules["1f1b"].step_s)] == pytest.approx(s.ratios)
        assert s.vs_floor.needed is None and s.vs_floor.verdict == "within noise"   # 2 rounds cannot tell apart
