"""Lab 00's job_setup check (lablib.labs.collectives.job_setup.Recorder): when rank 0's slow torch.save may write.
Two recorders share an in-process store; no process group is made (the barriers are stand-ins that return at once),
so each test sets up the exact interleaving it names."""

from __future__ import annotations

import torch.distributed as dist

from lablib.labs.collectives.job_setup import Recorder


def _pair():
    store = dist.HashStore()
    ranks = [Recorder(r, 2, save_delay_s=0.0) for r in range(2)]
    for rec in ranks:
        rec.store = store
        rec.reset("t")
    return ranks


def _barrier(rec):
    rec._barrier(lambda: None)


def test_rank_waiting_in_a_barrier_rank0_has_not_entered_lets_rank0_write():
    # the right order: rank 0 saves, then the barrier; rank 1 is in that barrier already
    rank0, rank1 = _pair()
    _barrier(rank1)
    assert rank0._waits_for_rank0(1)


def test_a_barrier_both_ranks_passed_before_the_save_does_not_count():
    # the wrong order (a barrier before the save): rank 1 has left the barrier both entered; however long its
    # "entered" record reads the same, rank 0 must wait for its load (the flag it replaced read "in the barrier"
    # until rank 1 got round to overwriting it, and a busy machine gave rank 0 that moment: full marks kept)
    rank0, rank1 = _pair()
    _barrier(rank1)
    _barrier(rank0)
    assert not rank0._waits_for_rank0(1)
    rank1._mark("loading")
    assert rank0._waits_for_rank0(1)


def test_a_second_barrier_after_a_first_one_counts():
    rank0, rank1 = _pair()
    for rec in (rank0, rank1):
        _barrier(rec)
    _barrier(rank1)                                      # rank 1 in barrier 2, rank 0 about to save before it
    assert rank0._waits_for_rank0(1)


def test_a_new_scenario_starts_its_count_again():
    rank0, rank1 = _pair()
    _barrier(rank1)
    for rec in (rank0, rank1):
        rec.reset("u")
    assert not rank0._waits_for_rank0(1)
