"""lablib.measure.p2p.CountingComm and the lab 02 run script: exact byte counts, clear errors, no hang on a deadlock.

The run script is driven here with the naive all-reduce (lablib's baseline) as the "student" module, so no
solution of the lab's exercise is needed: its byte counts are known in closed form.
"""

import time

import pytest
import torch
import torch.distributed as dist

from lablib.jobs import launch
from lablib.measure.p2p import CountingComm, direct_calls


def test_world_size_one_needs_no_process_group():
    comm = CountingComm(0, 1)
    assert comm.counts() == {"bytes_sent": 0, "bytes_received": 0, "sends": 0, "recvs": 0, "largest_send": 0,
                             "sent_to": {}, "received_from": {}}


@pytest.mark.parametrize("peer, match", [(3, "ranks are 0..2"), (1, "with itself"), (-1, "ranks are 0..2")])
def test_bad_peer_is_a_clear_error(peer, match):
    comm = CountingComm(1, 3)
    with pytest.raises(ValueError, match=match):
        comm.isend(torch.zeros(4), peer)


def test_non_contiguous_tensor_is_a_clear_error():
    comm = CountingComm(0, 2)
    with pytest.raises(ValueError, match="contiguous"):
        comm.irecv(torch.zeros(4, 4).t(), 1)


def test_bad_rank_rejected():
    with pytest.raises(ValueError, match="not in a world of size 2"):
        CountingComm(2, 2)


NAIVE_IMPL = "from lablib.labs.ring_allreduce.run import naive_all_reduce as ring_all_reduce\n"


def test_direct_calls_records_calls_around_the_comm():
    with direct_calls() as log:
        with pytest.raises(ValueError):             # no process group here: the call still runs, and fails
            dist.all_reduce(torch.zeros(2))
        with pytest.raises(ValueError):
            torch.distributed.distributed_c10d.broadcast(torch.zeros(2), src=0)
    assert [c.function for c in log.calls] == ["all_reduce", "broadcast"]
    assert [c.bytes for c in log.calls] == [8, 8]
    assert dist.all_reduce.__name__ == "all_reduce"   # put back after the block


def test_run_script_counts_bytes_exactly(tmp_path):
    impl = tmp_path / "naive_impl.py"
    impl.write_text(NAIVE_IMPL)
    # World sizes 2 and 3 in one launch of 3 processes (ranks 0..1 form a sub-group), a 1-D and a 2-D tensor.
    result = launch.run("ring_allreduce",
                        {"impl": str(impl), "world_sizes": (2, 3), "sizes": (5,), "shapes": ("4x250",), "dtypes": ("float32", "bfloat16")},
                        nproc=3, timeout_s=120, quiet=True)
    rows = result["metrics"]["check"]
    assert [(r["world_size"], r["shape"], r["dtype"]) for r in rows] == [
        (n, shape, dtype) for n in (2, 3) for dtype in ("float32", "bfloat16") for shape in ([5], [4, 250])]
    for r in rows:
        n, M = r["world_size"], r["n_bytes"]
        assert r["max_abs_err"] == 0.0 and r["returned_input"] and r["direct_calls"] == []
        # naive: rank 0 receives N-1 tensors and sends N-1; the others one each way; every message is whole.
        assert r["bytes_sent"] == [(n - 1) * M] + [M] * (n - 1)
        assert r["bytes_received"] == [(n - 1) * M] + [M] * (n - 1)
        assert r["largest_send"] == [M] * n
        assert r["sent_to_ranks"] == [list(range(1, n))] + [[0]] * (n - 1)
        assert r["received_from_ranks"] == r["sent_to_ranks"]
        assert r["naive_bytes_sent"] == r["bytes_sent"]
        assert r["element_size"] == (4 if r["dtype"] == "float32" else 2)


def test_world_sizes_need_enough_processes():
    with pytest.raises(ValueError, match="need more ranks"):
        launch.run("ring_allreduce", {"world_sizes": (2, 3)}, nproc=2, timeout_s=10)


def test_run_script_benchmark_reports_medians(tmp_path):
    impl = tmp_path / "naive_impl.py"
    impl.write_text(NAIVE_IMPL)
    result = launch.run("ring_allreduce",
                        {"impl": str(impl), "sizes": (), "bench_bytes": (1024, 65536), "repeats": 1}, nproc=2,
                        timeout_s=120, quiet=True)
    bench = result["metrics"]["bench"]
    assert bench["n_bytes"] == [1024, 65536]
    for name in ("ring", "naive", "gloo", "gloo_again", "ring_again"):
        assert len(bench[f"{name}_s"]) == 2 and all(t > 0 for t in bench[f"{name}_s"])
    assert len(bench["ring_all_s"][0]) == 5       # messages up to 1 MiB are repeated 4x, rounded up to whole turns of 5
    # the ratios per repetition are the times' ratios, and each comparison is read against its denominator timed
    # against itself: ring / gloo against gloo again / gloo, naive / ring against ring again / ring
    assert bench["floor_gloo_again_over_gloo"][1][0] == pytest.approx(bench["gloo_again_all_s"][1][0] / bench["gloo_all_s"][1][0])
    assert bench["floor_ring_again_over_ring"][1][3] == pytest.approx(bench["ring_again_all_s"][1][3] / bench["ring_all_s"][1][3])
    assert bench["ring_over_gloo"][0][2] == pytest.approx(bench["ring_all_s"][0][2] / bench["gloo_all_s"][0][2])
    assert [set(v) for v in bench["verdicts"]] == [{"ring_vs_gloo", "naive_vs_ring"}] * 2


def test_benchmark_repetitions_rotate_whole_turns():
    """Every arm goes first equally often: the repetitions are whole rotations of the five arms; 4x the repeats up
    to 1 MiB, 1.5x above, rounded up to whole turns (5 -> 20 and 10)."""
    from lablib.labs.ring_allreduce.run import BENCH_ARMS, repetitions
    assert len(BENCH_ARMS) == 5 and BENCH_ARMS.count("gloo_again") == 1 and BENCH_ARMS.count("ring_again") == 1
    assert [repetitions(n, 5) for n in (1024, 2**20, 2**20 + 4, 2**26)] == [20, 20, 10, 10]
    assert repetitions(2**26, 1) == 5 and all(repetitions(2**26, r) % 5 == 0 for r in range(1, 12))


def test_deadlock_fails_fast_with_a_message(tmp_path):
    impl = tmp_path / "deadlock_impl.py"
    impl.write_text("def ring_all_reduce(tensor, comm):\n"
                    "    comm.send(tensor, (comm.rank + 1) % comm.world_size)\n"
                    "    comm.recv(tensor, (comm.rank - 1) % comm.world_size)\n"
                    "    return tensor\n")
    with pytest.raises(launch.RunError, match="deadlock"):
        launch.run("ring_allreduce", {"impl": str(impl), "sizes": (16,), "deadlock_s": 3.0}, nproc=2,
                   timeout_s=60, quiet=True)


def test_unknown_dtype_rejected_before_start():
    with pytest.raises(ValueError, match="not supported"):
        launch.run("ring_allreduce", {"dtypes": ("float8",)}, nproc=2, timeout_s=10)


# --- the rehearsal in threads ----------------------------------------------------------------------------

from lablib.probes.ring_rehearsal import rehearse_ring  # noqa: E402
from lablib.probes.ring_rehearsal import RehearsalDeadlock as DeadlockError, RehearsalError, run_in_threads  # noqa: E402
from lablib.labs.ring_allreduce.run import naive_all_reduce  # noqa: E402


def test_threads_sum_like_processes_and_count_the_same_bytes():
    rows = rehearse_ring(naive_all_reduce, world_sizes=(2, 3), sizes=(5,), shapes=("4x250",), dtypes=("float32", "bfloat16"))
    assert [(r["world_size"], r["shape"], r["dtype"]) for r in rows] == [
        (n, shape, dtype) for n in (2, 3) for dtype in ("float32", "bfloat16") for shape in ([5], [4, 250])]
    for r in rows:   # the same closed form as the torchrun test above
        n, M = r["world_size"], r["n_bytes"]
        assert r["max_abs_err"] == 0.0 and r["returned_input"] and r["direct_calls"] == []
        assert r["bytes_sent"] == [(n - 1) * M] + [M] * (n - 1)
        assert r["bytes_received"] == r["bytes_sent"]
        assert r["sent_to_ranks"] == [list(range(1, n))] + [[0]] * (n - 1)


def test_blocking_sends_facing_each_other_deadlock_at_once_and_say_who_waits():
    def both_send_first(comm):
        x = torch.zeros(4)
        comm.send(x, 1 - comm.rank)
        comm.recv(x, 1 - comm.rank)

    t0 = time.perf_counter()
    with pytest.raises(DeadlockError, match="rank 0 waits for its send to rank 1; rank 1 waits for its send to rank 0"):
        run_in_threads(2, both_send_first, timeout_s=30)
    assert time.perf_counter() - t0 < 5          # seen when both wait, not at the timeout


def test_isend_irecv_then_wait_does_not_deadlock_and_moves_the_bytes():
    def swap(comm):
        mine, theirs = torch.full((3,), float(comm.rank)), torch.empty(3)
        works = [comm.isend(mine, 1 - comm.rank), comm.irecv(theirs, 1 - comm.rank)]
        for w in works:
            w.wait()
        return theirs.tolist()

    assert run_in_threads(2, swap) == [[1.0] * 3, [0.0] * 3]


def test_size_mismatch_is_a_clear_error():
    def mismatch(comm):
        if comm.rank == 0:
            comm.send(torch.zeros(4, dtype=torch.bfloat16), 1)
        else:
            comm.recv(torch.zeros(4), 0)

    with pytest.raises(RehearsalError, match="sent 8 bytes to rank 1, which received them into a buffer of 16 bytes"):
        run_in_threads(2, mismatch)


def test_a_direct_torch_distributed_call_is_reported_not_raised():
    def ring_all_reduce(tensor, comm):
        dist.all_reduce(tensor)
        return tensor

    rows = rehearse_ring(ring_all_reduce, world_sizes=(2,), sizes=(6,))
    assert rows[0]["direct_calls"] == ["all_reduce"] and rows[0]["max_abs_err"] == float("inf")


def test_a_rank_error_names_the_rank():
    def fails_on_one(tensor, comm):
        if comm.rank == 1:
            raise IndexError("chunk 7")
        return tensor

    with pytest.raises(RehearsalError, match="rank 1 of 2 .* IndexError: chunk 7"):
        rehearse_ring(fails_on_one, world_sizes=(2,), sizes=(6,))
