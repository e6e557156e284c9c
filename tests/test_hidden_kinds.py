"""instructor/hidden_kinds.py, the one place every hidden check goes through: each kind catches a tiny deliberately
wrong callable of its kind and passes a right one; the table refuses an opt-out without a reason; a hidden cell that
forgets a required kind fails."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import labkit
from instructor import hidden_kinds
from instructor.hidden_kinds import Exercise, HiddenCheck
from lablib.checks import CheckFailed


def _check(traits=(), **opt_out) -> HiddenCheck:
    return HiddenCheck(Exercise("99_test", "exercise", frozenset(traits), dict(opt_out)))


# --- inputs -----------------------------------------------------------------------------------------------------
def _sum_popping(batches):
    total = 0
    while batches:
        total += batches.pop(0)
    return total


def _normalise_in_place(x):
    x -= x.max()
    return x.exp().sum()


@pytest.mark.parametrize("wrong, args", [(_sum_popping, ([1, 2, 3],)), (_normalise_in_place, (torch.randn(5),)),
                                         (lambda d: d.update(extra=1) or 0, ({"a": torch.ones(2)},))])
def test_inputs_catches_an_answer_that_changes_what_the_caller_passed(wrong, args):
    with pytest.raises(CheckFailed, match="changed the caller's argument 0"):
        _check().call(wrong, *args)


def test_inputs_passes_an_answer_that_leaves_them_and_allows_the_declared_mutable_ones():
    hk = _check()
    assert hk.call(lambda b: sum(b), [1, 2, 3]) == 6
    assert hk.call(lambda x: (x - x.max()).exp().sum(), torch.zeros(4)).item() == 4.0
    model = torch.nn.Linear(2, 2)
    hk.call(lambda m, x: m.weight.data.add_(x), model, 1.0, mutable=(0,))   # the model is meant to change
    with pytest.raises(CheckFailed, match="argument 0"):
        hk.call(lambda m, x: m.weight.data.add_(x), model, 1.0)
    assert "inputs" in hk.applied


def test_inputs_sees_a_view_of_the_callers_tensor_changed_and_a_non_leaf_argument():
    leaf = torch.randn(3, requires_grad=True)
    logits = leaf * 2.0                      # not a leaf: deepcopy refuses it, the snapshot clones it
    with pytest.raises(CheckFailed, match="values changed in place"):
        _check().call(lambda z: z.sub_(1.0).sum(), logits)
    _check().call(lambda z: (z - 1.0).sum(), logits)


# --- aliasing -----------------------------------------------------------------------------------------------------
def test_aliasing_catches_one_object_for_every_rank_and_a_returned_view_of_an_argument():
    with pytest.raises(CheckFailed, match="one object for entries 0 and 1"):
        _check().call(lambda n: [[]] * n, 3)
    with pytest.raises(CheckFailed, match="sharing one tensor's memory"):
        _check().call(lambda t: [t[0], t[0]], torch.randn(2, 4).clone() + 0)
    with pytest.raises(CheckFailed, match="shares memory with one of its arguments"):
        _check().call(lambda t: t.view(-1), torch.randn(2, 2))
    with pytest.raises(CheckFailed, match="one object for entries"):
        state = {"step": 0}
        _check().check_no_aliasing({0: state, 1: state}, what="per-rank state")


def test_aliasing_passes_one_object_per_entry_and_new_tensors():
    hk = _check()
    hk.call(lambda n: [[] for _ in range(n)], 3)
    hk.call(lambda t: [t[0].clone(), t[1].clone()], torch.randn(2, 4))
    hk.call(lambda t: t.reshape(-1) + 0, torch.randn(2, 2))
    hk.call(lambda n: [0] * n, 3)            # numbers are immutable: one 0 for every entry is fine
    hk.call(lambda t: list((t * 2).chunk(2)), torch.randn(4))   # chunks of one new tensor: separate memory
    assert "aliasing" in hk.applied


# --- steps --------------------------------------------------------------------------------------------------------
class _CounterNeverReset:
    def __init__(self):
        self.seen = []

    def step(self, x):
        self.seen.append(x)      # wrong: this step's mean must not include the earlier steps
        return sum(self.seen) / len(self.seen)


class _Right:
    def step(self, x):
        return x


@pytest.mark.parametrize("cls, fails", [(_CounterNeverReset, True), (_Right, False)])
def test_steps_catches_state_that_is_wrong_from_the_second_step_on(cls, fails):
    obj, hk = cls(), _check()

    def check(i, got):
        from lablib import checks
        checks.check_close(got, float(i + 1), "the step's mean")

    if fails:
        with pytest.raises(CheckFailed, match="step 2 of 3 on the same object"):
            hk.steps(lambda i: obj.step(float(i + 1)), check)
    else:
        assert hk.steps(lambda i: obj.step(float(i + 1)), check) == [1.0, 2.0, 3.0]


def test_steps_refuses_fewer_than_three():
    with pytest.raises(ValueError, match="at least 3"):
        _check().steps(lambda i: i, lambda i, r: None, n=2)


# --- gradients ----------------------------------------------------------------------------------------------------
def _step_relying_on_none(model, x, y):
    """Wrong: clears only gradients that are None, i.e. relies on zero_grad(set_to_none=True)."""
    for p in model.parameters():
        if p.grad is not None and p.grad.abs().sum() == 0:
            continue
        if p.grad is not None:
            p.grad = None
    F.mse_loss(model(x), y).backward()


def _step_accumulating_on_top(model, x, y):
    """Wrong: adds into whatever .grad holds (right only after set_to_none=True or set_to_none=False)."""
    F.mse_loss(model(x), y).backward()


def _right_step(model, x, y):
    model.zero_grad(set_to_none=True)
    F.mse_loss(model(x), y).backward()


@pytest.mark.parametrize("answer, wrong", [(_step_accumulating_on_top, True), (_right_step, False)])
def test_gradients_catches_an_answer_that_relies_on_how_the_loop_cleared_them(answer, wrong):
    hk = _check(("gradients",))
    failures = []
    for start in hk.gradient_starts():
        torch.manual_seed(0)
        model, x, y = torch.nn.Linear(3, 1), torch.randn(4, 3), torch.randn(4, 1)
        reference = [g.clone() for g in torch.autograd.grad(F.mse_loss(model(x), y), list(model.parameters()))]
        hk.leave_gradients(model, start, lambda: F.mse_loss(model(x) * 3, y))
        answer(model, x, y)
        if not all(torch.allclose(p.grad, r) for p, r in zip(model.parameters(), reference)):
            failures.append(start)
    assert "gradients" in hk.applied
    assert failures == (["accumulated"] if wrong else [])


def test_leave_gradients_leaves_zero_tensors_or_stale_sums():
    model = torch.nn.Linear(2, 1)
    x = torch.randn(3, 2)
    HiddenCheck.leave_gradients(model, "set_to_none=False", lambda: model(x).sum())
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    HiddenCheck.leave_gradients(model, "accumulated", lambda: model(x).sum())
    assert torch.allclose(model.bias.grad, torch.tensor([6.0]))    # two backwards of 3 rows each, after the zeros
    with pytest.raises(ValueError, match="must be one of"):
        HiddenCheck.leave_gradients(model, "none", lambda: model(x).sum())


# --- readiness ----------------------------------------------------------------------------------------------------
def _bucket_flattened_in_readiness_order(grads_in_ready_order, order):
    """Wrong: lays the bucket out in the order gradients arrived, not in registration order."""
    return torch.cat([g for g in grads_in_ready_order])


def _bucket_flattened_in_registration_order(grads_in_ready_order, order):
    by_index = dict(zip(order, grads_in_ready_order))
    return torch.cat([by_index[i] for i in sorted(by_index)])


@pytest.mark.parametrize("answer, wrong", [(_bucket_flattened_in_readiness_order, True),
                                           (_bucket_flattened_in_registration_order, False)])
def test_readiness_catches_an_answer_that_assumes_registration_order(answer, wrong):
    hk = _check(("communication",))
    grads = [torch.full((2,), float(i)) for i in range(4)]
    expected = torch.cat(grads)
    orders = hk.readiness_orders(4)
    assert all(o != list(range(4)) and sorted(o) == list(range(4)) for o in orders) and len(orders) == 2
    caught = [not torch.equal(answer([grads[i] for i in o], o), expected) for o in orders]
    assert all(caught) if wrong else not any(caught)
    assert hk.readiness_orders(2) == [[1, 0]]
    with pytest.raises(ValueError):
        hk.readiness_orders(1)


# --- extremes -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("answer, wrong", [(lambda z: torch.log(torch.softmax(z, -1)), True),
                                           (lambda z: torch.log_softmax(z, -1), False)])
def test_extremes_catches_a_log_of_a_softmax(answer, wrong):
    hk = _check(("numerics",))
    z = torch.randn(4, 7, generator=torch.Generator().manual_seed(0))
    finite = [bool(torch.isfinite(answer(scaled)).all()) for _, scaled in hk.extremes(z)]
    assert "extremes" in hk.applied
    assert finite[0] and (not all(finite) if wrong else all(finite))


# --- topology -----------------------------------------------------------------------------------------------------
def test_second_node_catches_an_answer_that_uses_the_local_rank_as_the_rank():
    hk = _check(("topology",))
    envs = hk.second_node(world_size=4, nodes=2)
    assert [(e.rank, e.local_rank) for e in envs] == [(0, 0), (1, 1), (2, 0), (3, 1)]
    wrong = [list(range(8))[e.local_rank::e.world_size] for e in envs]    # DistributedSampler(rank=env.local_rank)
    right = [list(range(8))[e.rank::e.world_size] for e in envs]
    assert len(set().union(*map(set, wrong))) < 8 and len(set().union(*map(set, right))) == 8
    with pytest.raises(ValueError, match="does not split"):
        hk.second_node(world_size=3, nodes=2)


# --- device state -----------------------------------------------------------------------------------------------
_RIGHT_STATE = '''
import torch


def save():
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def load(state):
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
'''
_FROM_IMPORT_STATE = '''
import torch
from torch.cuda import get_rng_state_all, set_rng_state_all, is_available


def save():
    return {"cuda": get_rng_state_all() if is_available() else []}


def load(state):
    if is_available():
        set_rng_state_all(state["cuda"])
'''
_NO_CUDA_STATE = '''
import torch


def save():
    return {"torch": torch.get_rng_state()}   # wrong: a GPU's generators (dropout on the GPU) are not saved


def load(state):
    torch.set_rng_state(state["torch"])
'''
_SAVED_NOT_RESTORED = _RIGHT_STATE.replace("        torch.cuda.set_rng_state_all(state[\"cuda\"])", "        pass")


def _module(source: str):
    import types
    module = types.ModuleType("answer")
    exec(compile(source, "answer.py", "exec"), module.__dict__)
    return module


@pytest.mark.parametrize("source, error", [(_RIGHT_STATE, None), (_FROM_IMPORT_STATE, None),
                                           (_NO_CUDA_STATE, "is not in it"), (_SAVED_NOT_RESTORED, "did not restore")])
def test_device_state_catches_gpu_generators_left_out_on_a_cpu_run(source, error):
    assert source != _SAVED_NOT_RESTORED or "pass" in source
    module, hk = _module(source), _check(("device_state",))
    cpu_state = torch.get_rng_state()
    with hk.fake_cuda_generators(module) as restored:
        state = module.save()
        module.load(state)
    assert module.torch is torch and torch.get_rng_state().equal(cpu_state)    # the module is put back afterwards
    if error is None:
        hk.check_device_state_present(state, "the saved state", restored)
    else:
        with pytest.raises(CheckFailed, match=error):
            hk.check_device_state_present(state, "the saved state", restored)
    assert "device_state" in hk.applied


# --- the table and the bookkeeping ----------------------------------------------------------------------------------
def test_an_opt_out_needs_a_stated_reason_and_a_kind_that_applies():
    with pytest.raises(ValueError, match="needs a stated reason"):
        Exercise("99_test", "x", opt_out={"steps": "n/a"})
    with pytest.raises(ValueError, match="unknown kind"):
        Exercise("99_test", "x", opt_out={"stepz": "a reason of several words"})
    with pytest.raises(ValueError, match="do not apply"):
        Exercise("99_test", "x", opt_out={"extremes": "it computes no numerics at all"})
    with pytest.raises(ValueError, match="unknown traits"):
        Exercise("99_test", "x", frozenset({"numeric"}))


def test_done_fails_a_hidden_cell_that_forgot_a_required_kind_and_reports_the_opt_outs(capsys):
    hk = _check(("numerics",), steps="a pure function: nothing kept between calls")
    hk.call(lambda x: x + 1, 1)
    with pytest.raises(RuntimeError, match=r"never applied \['extremes'\]"):
        hk.done()
    list(hk.extremes(torch.ones(2)))
    hk.done()
    out = capsys.readouterr().out
    assert "applied aliasing, extremes, inputs" in out and "steps left out (a pure function" in out
    with pytest.raises(RuntimeError, match="does not apply"):
        hk.readiness_orders(3)


def test_every_exercise_of_every_lab_goes_through_the_table_and_the_report_lists_them():
    assert {lab for lab, _ in hidden_kinds.EXERCISES} <= set(labkit.labs()), "the table names a lab that does not exist"
    for lab in labkit.labs():
        exercises = set(labkit.exercises(labkit.read(lab)))
        listed = {name for (l, name) in hidden_kinds.EXERCISES if l == lab}
        assert listed <= exercises, f"{lab}: the table names exercises the lab does not have: {listed - exercises}"
        assert exercises <= listed, f"{lab}: exercises whose hidden checks do not go through instructor/hidden_kinds.py: " \
                                    f"{sorted(exercises - listed)}"
        source = "\n".join(c.source for c in labkit.read(lab).cells if c.cell_type == "code")
        for name in listed:
            assert f'hidden("{lab}", "{name}")' in source, f"{lab}/{name}: no hidden cell goes through hidden_kinds"
    text = hidden_kinds.report()
    assert all(f"{lab} | {name} |" in text for lab, name in hidden_kinds.EXERCISES)
    with pytest.raises(KeyError, match="not in instructor/hidden_kinds.py's table"):
        hidden_kinds.hidden("99_test", "nothing")


def test_inputs_compares_objects_by_their_own_equality_not_their_caches():
    from dataclasses import dataclass

    import numpy as np

    @dataclass
    class Env:
        rank: int

    class Cached:
        """Equal by value; a hash filled on first use (as DeviceMesh's) is not a change."""

        def __init__(self):
            self.value, self._hash = 3, None

        def __eq__(self, other):
            return self.value == other.value

        def __hash__(self):
            self._hash = self._hash or hash(self.value)
            return self._hash

    hk = _check()
    hk.call(lambda c: hash(c), Cached())
    with pytest.raises(CheckFailed, match="changed"):
        hk.call(lambda c: setattr(c, "value", 4), Cached())
    with pytest.raises(CheckFailed, match="changed"):
        hk.call(lambda e: object.__setattr__(e, "rank", 1), Env(0))
    with pytest.raises(CheckFailed, match="values changed in place"):
        hk.call(lambda a: a.__imul__(2), np.arange(3))
    hk.call(lambda a: a * 2, np.arange(3))


def test_device_state_is_found_inside_a_pickled_blob():
    import pickle

    hk = _check(("device_state",))
    blob = {"rng": pickle.dumps([{"cuda": [HiddenCheck.CUDA_MARKER.clone()]}])}   # as lablib's per_rank stores it
    hk.check_device_state_present(blob, "a pickled per-rank state")
    with pytest.raises(CheckFailed, match="is not in it"):
        hk.check_device_state_present({"rng": pickle.dumps([{"cuda": []}])}, "a pickled per-rank state")


# --- late receives and other groups (labs 12 and 13) ----------------------------------------------------------------
def _exchange(comm, read_before_wait: bool) -> float:
    """Rank r sends r + 1 to its right neighbour and receives its left neighbour's: wrong when it reads before waiting."""
    n, got = comm.world_size, torch.zeros(1)
    works = [comm.isend(torch.tensor([comm.rank + 1.0]), (comm.rank + 1) % n), comm.irecv(got, (comm.rank - 1) % n)]
    seen = got.clone()
    for work in works:
        work.wait()
    return (seen if read_before_wait else got).item()


@pytest.mark.parametrize("read_before_wait", [True, False])
def test_late_receives_land_only_when_waited(read_before_wait):
    from lablib.probes.ring_rehearsal import run_in_threads

    hk = _check(("communication",))
    got = run_in_threads(3, lambda comm: _exchange(hk.late_receives(comm), read_before_wait))
    assert "readiness" in hk.applied
    assert got == ([0.0, 0.0, 0.0] if read_before_wait else [3.0, 1.0, 2.0])


def test_other_groups_are_not_the_default_and_catch_the_world_rank_used_as_the_group_rank():
    hk = _check(("topology",))
    groups = hk.other_groups(4)
    assert "topology" in hk.applied
    for name, layout in groups.items():
        assert sorted(r for g in layout for r in g) == [0, 1, 2, 3] and layout != [[0, 1, 2, 3]], name
    # wrong: a group rank taken as the world rank modulo the group's size (right for consecutive halves only)
    wrong = {name: any(g.index(r) != r % len(g) for g in layout for r in g) for name, layout in groups.items()}
    assert wrong == {"halves": False, "strided": True, "reversed": True}
    with pytest.raises(ValueError, match="even world_size"):
        hk.other_groups(3)
def test_subgroups_are_several_groups_none_the_default_and_mark_topology():
    hk = _check(("topology",))
    assert hk.subgroups(4, 2) == [[0, 1], [2, 3]] and "topology" in hk.applied
    assert hk.subgroups(6, 3) == [[0, 1, 2], [3, 4, 5]]
    # an answer that takes the global rank for its place in the group indexes past the group on ranks 2 and 3
    groups = hk.subgroups(4, 2)
    assert [rank for g in groups for rank in g if rank >= len(g)] == [2, 3]
    for bad in ((4, 4), (5, 2), (4, 1)):
        with pytest.raises(ValueError, match="do not split"):
            hk.subgroups(*bad)
# --- in-place arguments -----------------------------------------------------------------------------------------
def _sum_into(t, _):
    t.view(-1).add_(1.0)
    return t


def _write_one_past(t, _):
    flat = t.view(-1)
    torch.as_strided(flat, (flat.numel() + 1,), (1,)).add_(1.0)     # one element too many
    return t


def _resized(t, _):
    t.resize_(t.numel() + 3)                                          # padding the caller's tensor
    return t


@pytest.mark.parametrize("answer, error", [(_sum_into, None), (_write_one_past, "outside its elements changed"),
                                           (_resized, "shape")])
def test_in_place_lets_the_tensor_change_and_nothing_around_it(answer, error):
    buffer = torch.zeros(12)
    view = buffer[3:9]                                   # guards of 3 elements either side
    hk = _check()
    if error is None:
        assert hk.call(answer, view, 0, in_place=(0,)) is view and buffer[3:9].eq(1).all() and buffer.sum() == 6
    else:
        with pytest.raises(CheckFailed, match=error):
            hk.call(answer, view, 0, in_place=(0,))
    with pytest.raises(CheckFailed, match="argument 1"):          # the other arguments are compared as always
        _check().call(lambda t, d: d.update(x=1) or t, torch.zeros(2), {}, in_place=(0,))
    with pytest.raises(TypeError, match="only a tensor"):
        _check().call(lambda t: t, [1.0], in_place=(0,))
