"""Lab 00's timings (lablib.labs.collectives.bench) in one process, without a process group (its barriers and the
slowest-rank all-reduce are no-ops there): the order the arms take turns in, the window's number of calls, and the
figures per call."""

from __future__ import annotations

import time

import pytest

from lablib.labs.collectives import bench


def test_every_arm_takes_every_place_and_odd_rounds_run_backwards():
    log = []
    arms = {name: (lambda name=name: log.append(name)) for name in bench.ARMS}
    n = len(bench.ARMS)
    out = bench.rounds(arms, calls=1, repeats=2 * n, group=None)
    assert set(out) == set(bench.ARMS) and all(len(v) == 2 * n for v in out.values())
    per_round = [log[k * n:(k + 1) * n] for k in range(2 * n)]
    for k, order in enumerate(per_round):
        forwards = order if k % 2 == 0 else order[::-1]
        assert forwards == list(bench.ARMS[k % n:] + bench.ARMS[:k % n]), (k, order)
    # the floor (and every arm) stands at every place of a round, not only at its ends
    assert {order.index(bench.FLOOR) for order in per_round} == set(range(n))
    # ... and as far from the all-reduce, in the cycle, as the reduce-scatter is
    place = {name: i for i, name in enumerate(bench.ARMS)}
    def apart(a, b):
        return min((place[a] - place[b]) % n, (place[b] - place[a]) % n)
    assert apart(bench.FLOOR, "all_reduce") == apart("reduce_scatter", "all_reduce")


def test_a_window_holds_enough_calls_for_every_arm_and_figures_are_per_call(monkeypatch):
    # A clock that only the calls move: one arm takes 1 s a call, the other 0.5 s.
    clock = {"now": 0.0}
    monkeypatch.setattr(bench.timing.time, "perf_counter", lambda: clock["now"])

    def takes(seconds):
        def call():
            clock["now"] += seconds
        return call

    slow, fast = takes(1.0), takes(0.5)
    assert bench.calls_for(6.0, {"slow": slow}, group=None) == 8             # 1, 2, 4 calls last under 6 s
    assert bench.calls_for(4.0, {"slow": slow}, group=None) == 4             # exactly the target is enough
    assert bench.calls_for(6.0, {"slow": slow, "fast": fast}, group=None) == 16   # the fast arm needs 16 x 0.5 s
    assert bench.calls_for(6.0, {"no time": takes(0.0)}, group=None) == bench.MAX_CALLS   # capped, never endless
    out = bench.rounds({"slow": slow, "fast": fast}, calls=8, repeats=3, group=None)
    assert out == {"slow": [1.0] * 3, "fast": [0.5] * 3}                    # per call, not per 8-call window


def test_an_unknown_collective_is_refused():
    with pytest.raises(ValueError, match="unknown collective 'all_reduce_twice'"):
        bench.timed_call("all_reduce_twice", None, {}, 2, None)
