"""Lab 12's library parts against references: the activation and byte formulas, the counted idle fraction, the
rounding bound (a correct fp32 attention lies inside it, a wrong one far outside), the overlap recorder, the thread
all-to-all (inside a sub-group too), and the run script's refusals. All in one process, in seconds."""

from __future__ import annotations

import functools
import json
import math
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lablib import checks
from lablib.jobs import config as cfg
from lablib.labs.context_parallel import cp_model, cp_ring, cp_ulysses
from lablib.labs.context_parallel import run as context_parallel
from lablib.labs.context_parallel.cp_events import OverlapComm
from lablib.measure.memory import SavedActivations
from lablib.probes import group_rehearsal, rehearsal
from lablib.probes.ring_rehearsal import run_in_threads


@pytest.mark.parametrize("q_len,k_len,causal", [(32, 32, True), (8, 32, True), (16, 16, False)])
def test_saved_bytes_formula_equals_measured(q_len, k_len, causal):
    q = torch.randn(2, 3, q_len, 8, requires_grad=True)
    k, v = (torch.randn(2, 3, k_len, 8, requires_grad=True) for _ in range(2))
    with SavedActivations() as saved:
        cp_model.unfused_attention(q, k, v, causal, q_positions=torch.arange(k_len - q_len, k_len))
    assert saved.bytes == cp_model.saved_bytes_formula(2, 3, q_len, k_len, 8, 4, causal)


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_contiguous_idle_fraction_counted_near_formula(world_size):
    counted = cp_model.idle_fraction(cp_model.causal_pairs_per_step(cp_model.contiguous_positions(4096, world_size)))
    assert abs(counted - (world_size - 1) / (2 * world_size - 1)) <= 2 * world_size / 4096


def test_idle_fraction_zero_when_balanced_and_pairs_add_up():
    work = cp_model.causal_pairs_per_step(cp_model.contiguous_positions(100, 4))
    assert sum(map(sum, work)) == 100 * 101 // 2                  # every causal pair exactly once
    assert cp_model.idle_fraction([[3, 3], [5, 5]]) == 0.0


def test_ring_and_ulysses_bytes():
    for n in (2, 4, 8):
        ring = cp_model.ring_bytes_per_rank(1, 32, 4096, 128, n, 2)
        ulysses = cp_model.ulysses_bytes_per_rank(1, 32, 4096, 128, n, 2)
        assert ring / ulysses == pytest.approx(n / 2, rel=1e-12)
    assert cp_model.ring_bytes_per_rank(1, 32, 4096, 128, 1, 2) == 0
    with pytest.raises(ValueError, match="divisible by 3"):
        cp_model.ulysses_bytes_per_rank(1, 32, 4096, 128, 3, 2)


def test_shuffled_split_is_an_uneven_partition():
    for n in (2, 3, 4):
        positions = cp_ring.split_positions(cp_ring.CASES["shuffled"], n, seed=0)
        assert torch.equal(torch.cat(positions).sort().values, torch.arange(cp_ring.CASES["shuffled"]["T"]))
        assert len({len(p) for p in positions}) > 1


# cases like the hidden tests' draws (the graded ones are drawn when the solution's hidden tests run)
_CASES = {"float64": dict(cp_ring.CASES["shuffled"], dtype="float64", T=21),
          "noncausal": dict(cp_ring.CASES["shuffled"], causal=False, T=18)}


@pytest.mark.parametrize("case", ["causal", "large_logits", "float64", "noncausal"])
def test_bound_holds_for_fp32_attention_and_catches_a_small_error(case):
    spec = _CASES.get(case) or cp_ring.CASES[case]
    full = cp_ring.full_inputs(spec, seed=3)
    ref = cp_ring.reference(full, spec["causal"])
    bounds = cp_ring.error_bounds(full, ref, spec["causal"], cp_ring.UNIT_ROUNDOFF[spec["dtype"]], 4,
                                  cp_ring.UNDERFLOW[spec["dtype"]])
    got = cp_model.unfused_attention(full["q"], full["k"], full["v"], spec["causal"])   # in the case's own dtype
    ratio = ((got.double() - ref["out"]).abs() / bounds["out"]).max().item()
    assert ratio < 1
    wrong = got.double() + 1e-3 * ref["out"].abs().max()
    assert ((wrong - ref["out"]).abs() / bounds["out"]).max().item() > 1


def test_overlap_comm_counts_products_between_post_and_wait():
    def ring(comm, overlap):
        comm = OverlapComm(comm)
        x, buf = torch.ones(4, 4), torch.empty(4, 4)
        with comm.watching():
            if overlap:
                works = [comm.isend(x, (comm.rank + 1) % 2), comm.irecv(buf, (comm.rank - 1) % 2)]
                x @ x
            else:
                x @ x
                works = [comm.isend(x, (comm.rank + 1) % 2), comm.irecv(buf, (comm.rank - 1) % 2)]
            for w in works:
                w.wait()
        return comm.overlapped_receives()

    assert run_in_threads(2, lambda c: ring(c, True)) == [1, 1]
    assert run_in_threads(2, lambda c: ring(c, False)) == [0, 0]


def test_blocking_sends_facing_each_other_fail_fast():
    def blocking(comm):
        x = torch.ones(3)
        comm.send(x, (comm.rank + 1) % 2)
        comm.recv(x, (comm.rank - 1) % 2)

    start = time.perf_counter()
    with pytest.raises(rehearsal.RehearsalDeadlock):
        run_in_threads(2, blocking, timeout_s=30)
    assert time.perf_counter() - start < 5


def _all_to_all_in_threads(world_size: int, fn):
    """fn(rank) on world_size thread ranks with the sub-group fakes cp_ulysses rehearses with: (returns, logs)."""
    logs = [[] for _ in range(world_size)]
    results = rehearsal.run_in_thread_ranks(world_size, fn, timeout_s=5,
                                            more_fakes=functools.partial(group_rehearsal.fakes, log=logs))
    return results, logs


def test_thread_all_to_all_is_a_transpose_of_pieces():
    class Swap:   # the all-to-all by hand: rank r's piece j goes to rank j, pieces received in rank order
        @staticmethod
        def seq_to_head(x, group):
            import torch.distributed as dist
            out = torch.empty_like(x)
            dist.all_to_all_single(out, x.contiguous(), group=group)
            return out

    results, logs = _all_to_all_in_threads(3, lambda rank: Swap.seq_to_head(torch.arange(3.0) + 10 * rank, None))
    for r in range(3):
        assert results[r].tolist() == [r, 10 + r, 20 + r]
        assert logs[r] == [("all_to_all", 12)]


def test_thread_all_to_all_stays_inside_a_sub_group():
    """4 thread ranks cut into the groups {0, 1} and {2, 3}: rank, world size and all-to-all are the group's; a
    call without the group is the whole world's (what an answer that ignores its group gets)."""
    import torch.distributed as dist
    groups = [group_rehearsal.ThreadGroup(range(0, 2)), group_rehearsal.ThreadGroup(range(2, 4))]

    def on_rank(rank):
        group = groups[rank // 2]
        inside, whole = torch.empty(2), torch.empty(4)
        dist.all_to_all_single(inside, torch.arange(2.0) + 10 * rank, group=group)
        dist.all_to_all_single(whole, torch.arange(4.0) + 10 * rank)
        return (dist.get_rank(group), dist.get_world_size(group), dist.get_world_size(), inside.tolist(),
                whole.tolist())

    results, logs = _all_to_all_in_threads(4, on_rank)
    for r in range(4):
        first = 2 * (r // 2)
        assert results[r] == (r % 2, 2, 4, [10 * first + r % 2, 10 * (first + 1) + r % 2],
                              [10 * j + r for j in range(4)])
        assert logs[r] == [("all_to_all", 8), ("all_to_all", 16)]


def _ulysses_module(*replacements):
    """The red team's Ulysses answer (redteam.py beside this file), each (old, new) replaced, as a module."""
    import types

    import labkit
    redteam = labkit.lab_file("12_context_parallel", "redteam")
    source = redteam._ULY.split("\n", 1)[1]                          # without the %%writefile line
    for old, new in replacements:
        assert old in source, old
        source = source.replace(old, new)
    module = types.ModuleType("cp_ulysses_impl")
    exec(compile(source, "cp_ulysses_impl.py", "exec"), module.__dict__)
    return module


_A2A = "dist.all_to_all_single(recv, send, group=group)"
_SUBGROUPS = dict(B=2, H=8, T=12, D=4, causal=True, dtype="float32", logits=3.0, groups=2, name="subgroups")


@pytest.mark.parametrize("replacements, passes", [
    ((), True),
    (((_A2A, "dist.all_to_all_single(recv, send, [len(recv) // n] * n, [len(send) // n] * n, group=group)"),), True),
    (((_A2A, "dist.all_to_all_single(recv, send, group=group, async_op=True).wait()"),), True),
    (((_A2A, "dist.all_to_all_single(recv, send)"),), False),                                # the world, not the group
    (((_A2A, "dist.all_to_all_single(recv, send, group=group); dist.all_reduce(torch.zeros(1), group=group)"),),
     False),                                                                                  # a fifth collective
])
def test_ulysses_rehearsal_on_two_sub_groups(replacements, passes):
    """4 thread ranks in two Ulysses groups of 2 (case "subgroups"): a correct answer however it waits or splits
    passes; one that ignores its group, never waits or calls another collective fails the check."""
    records = cp_ulysses.rehearse_ulysses(_ulysses_module(*replacements), 4, (_SUBGROUPS,))[0]
    assert [(r["rank"], r["world_size"], r["groups"]) for r in records] == [(0, 2, 2), (1, 2, 2), (0, 2, 2), (1, 2, 2)]
    if passes:
        cp_ulysses.check_ulysses(records)
    else:
        with pytest.raises(checks.CheckFailed):
            cp_ulysses.check_ulysses(records)


def test_ulysses_rehearsal_names_a_work_never_waited():
    """An async all-to-all never waited: the rehearsal (lablib.probes.rehearsal's _Pending, shared with the group
    rehearsal) writes its output only on wait() and, when the rank's function returns, names the work never waited."""
    from lablib.probes.rehearsal import NeverWaited
    module = _ulysses_module((_A2A, "dist.all_to_all_single(recv, send, group=group, async_op=True)"))
    with pytest.raises(NeverWaited, match=r"never waited \(all_to_all_single\)"):
        cp_ulysses.rehearse_ulysses(module, 4, (_SUBGROUPS,))


@pytest.mark.parametrize("options,message", [({"exercise": "ring"}, "exercise"), ({"cases": ("nope",)}, "unknown"),
                                             ({"exercise": "idle", "repeats": 0}, "at least 1"),
                                             ({"exercise": "ulysses", "cases_json": json.dumps([_SUBGROUPS])},
                                              "thread ranks"),
                                             ({"cases_json": '[{"name": "x"}]'}, "lacks"),
                                             ({"flex_seq_len": 512}, "exercise 'idle'"),
                                             ({"exercise": "idle", "gather_rounds": -1}, "gather_rounds")])
def test_run_config_refuses_bad_options(options, message):
    with pytest.raises((ValueError, cfg.ConfigError), match=message):
        cfg.from_options(context_parallel.Config, options).validate()


def test_ring_and_gathered_kv_send_the_same_bytes_and_what_each_holds():
    """cp_idle.timed_gather against timed_ring on 2 thread ranks: N - 1 blocks sent each; the ring holds its block
    and the one arriving (2 T/N positions), the gather all T positions plus its own padded input during the
    collective (N + 1 blocks)."""
    from lablib.labs.context_parallel.cp_model import contiguous_positions
    from lablib.labs.context_parallel import cp_idle
    from lablib.probes.rehearsal import run_in_thread_ranks
    from lablib.probes.ring_rehearsal import run_in_threads

    positions = contiguous_positions(32, 2)
    block = 2 * 1 * 2 * 16 * 8 * 4                              # K and V of one rank: 2 B H (T/N) D e, float32
    gathered = run_in_thread_ranks(2, lambda r: cp_idle.timed_gather(None, positions, 1, 2, 8))
    assert [(g["bytes_sent"], g["largest_kv_bytes"]) for g in gathered] == [(block, 3 * block)] * 2
    rings = run_in_threads(2, lambda comm: (cp_idle.timed_ring(comm, positions, 1, 2, 8), comm.counts()["bytes_sent"]))
    assert [(sent, rows["largest_kv_bytes"]) for rows, sent in rings] == [(block, 2 * block)] * 2
    assert sum(g["pairs"] for g in gathered) == sum(sum(rows["pairs"]) for rows, _ in rings) == 32 * 33 // 2


# --- issue 38 / 46: what the checks now see ------------------------------------------------------------------------

def _ring_module(source: str):
    import types
    module = types.ModuleType("cp_ring_impl")
    exec(compile(source, "cp_ring_impl.py", "exec"), module.__dict__)
    return module


_KEEPS_SCORES = """
import math
import torch
import torch.distributed as dist


def ring_attention_forward(q, k, v, comm, positions, causal=True):
    n, rank = comm.world_size, comm.rank
    kept_s, kept_v, kv = [], [], torch.stack([k, v])
    for step in range(n):
        src = (rank - step) % n
        if step < n - 1:
            nxt = torch.empty((2, *q.shape[:2], len(positions[(src - 1) % n]), q.shape[-1]), dtype=kv.dtype)
            works = [comm.isend(kv, (rank + 1) % n), comm.irecv(nxt, (rank - 1) % n)]
        s = q @ kv[0].transpose(-2, -1) / math.sqrt(q.shape[-1])
        if causal:
            s = s.masked_fill(positions[src][None, :] > positions[rank][:, None], -math.inf)
        kept_s.append(s)
        kept_v.append(kv[1])
        if step < n - 1:
            [w.wait() for w in works]
            kv = nxt
    s = torch.cat(kept_s, -1)
    return torch.softmax(s, -1) @ torch.cat(kept_v, -2), torch.logsumexp(s, -1)
"""


def test_score_sizes_catch_one_softmax_at_the_end(tmp_path, monkeypatch):
    """The ring that keeps every block's scores passes values, bytes and overlap but not the memory check."""
    path = tmp_path / "cp_ring_impl.py"
    path.write_text(_KEEPS_SCORES)
    records = cp_ring.rehearse_ring(str(path), "ring_forward", 2, ("causal",))[0]
    assert all(r["outputs"]["out"]["bound_ratio"] <= 1 for r in records)
    assert records[0]["largest_score"] == 1 * 2 * 12 * 24 > records[0]["score_bound"] == 2 * 12 * 12
    with pytest.raises(checks.CheckFailed, match="one block of scores at a time"):
        cp_ring.check_ring(records, "ring_forward")


def test_wrong_direction_is_named_at_three_ranks(tmp_path):
    path = tmp_path / "cp_ring_impl.py"
    path.write_text(_KEEPS_SCORES.replace("comm.isend(kv, (rank + 1) % n), comm.irecv(nxt, (rank - 1) % n)",
                                          "comm.isend(kv, (rank - 1) % n), comm.irecv(nxt, (rank + 1) % n)"))
    cp_ring.rehearse_ring(str(path), "ring_forward", 2, ("causal",))          # N = 2: left is right
    with pytest.raises(Exception, match="wrong direction"):
        cp_ring.rehearse_ring(str(path), "ring_forward", 3, ("causal",))


def test_ulysses_rehearsal_at_one_rank_and_from_imports():
    cp_ulysses.check_ulysses(cp_ulysses.rehearse_ulysses(_ulysses_module(), 1, ("basic",))[0])
    bound = _ulysses_module(("import torch.distributed as dist\n",
                             "import torch.distributed as dist\nfrom torch.distributed import all_to_all_single\n"),
                            (_A2A, "all_to_all_single(recv, send, group=group)"))
    for records in cp_ulysses.rehearse_ulysses(bound, 2, ("basic",)):           # rehearsed like any other style
        cp_ulysses.check_ulysses(records)
    assert bound.all_to_all_single is dist.all_to_all_single                    # the real function again afterwards
    # The red team's answer: names bound by import, the group ignored. Two groups of 2 on 4 thread ranks catch it.
    ignores_group = _ulysses_module(
        ("import torch.distributed as dist\n",
         "import torch.distributed as dist\nfrom torch.distributed import all_to_all_single, get_world_size\n"),
        (_A2A, "all_to_all_single(recv, send)"), ("dist.get_world_size(group)", "get_world_size()"))
    with pytest.raises(Exception):
        for records in cp_ulysses.rehearse_ulysses(ignores_group, 4, [dict(B=1, H=8, T=16, D=8, causal=True,
                                                                           dtype="float32", logits=3.0, groups=2,
                                                                           name="subgroups")]):
            cp_ulysses.check_ulysses(records)


def test_ulysses_barrier_is_counted_in_threads():
    module = _ulysses_module((_A2A, _A2A + "; dist.barrier(group=group)"))
    with pytest.raises(checks.CheckFailed, match="barrier"):
        for records in cp_ulysses.rehearse_ulysses(module, 2, ("basic",)):
            cp_ulysses.check_ulysses(records)
