import os
import signal
import subprocess
import sys

import pytest
import torch

from lablib.jobs import distenv, launch


def test_plain_process_is_world_size_one(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    env = distenv.from_env()
    assert (env.rank, env.world_size, env.is_main) == (0, 1, True)
    with distenv.distributed() as env2:
        assert env2.world_size == 1 and not torch.distributed.is_initialized()


def test_bad_rank_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK=3 is outside WORLD_SIZE=2"):
        distenv.from_env()
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(ValueError, match="not an integer"):
        distenv.from_env()


def test_backend_selection(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert distenv.select_backend_and_device(1, 2) == ("nccl", torch.device("cuda", 1))
    assert distenv.select_backend_and_device(3, 4) == ("gloo", torch.device("cuda", 0))  # 4 ranks share GPU 0
    monkeypatch.setenv("LABLIB_DEVICE", "cpu")
    assert distenv.select_backend_and_device(0, 2) == ("gloo", torch.device("cpu"))
    monkeypatch.delenv("LABLIB_DEVICE")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert distenv.select_backend_and_device(0, 2) == ("gloo", torch.device("cpu"))


@pytest.mark.parametrize("nproc", [1, 3])
def test_ranks_see_a_consistent_environment(nproc):
    result = launch.run("hello", nproc=nproc, timeout_s=120, quiet=True)
    m = result["metrics"]
    assert m["all_reduce_sum"] == m["expected_sum"] == nproc * (nproc + 1) / 2
    assert sorted(r["rank"] for r in m["ranks"]) == list(range(nproc))
    assert all(r["world_size"] == nproc and r["backend"] == "gloo" for r in m["ranks"])
    assert len({r["pid"] for r in m["ranks"]}) == nproc


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL variant needs at least two visible GPUs")
def test_nccl_on_two_gpus():
    result = launch.run("hello", nproc=2, timeout_s=120, quiet=True)
    assert result["env"]["backend"] == "nccl"
    assert result["metrics"]["all_reduce_sum"] == 3


def test_a_collective_gloo_cannot_serve_is_found_and_named(monkeypatch):
    """The probe behind the one-GPU fallback, on a one-rank gloo group: a collective that raises is a gap."""
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert distenv.gloo_gaps(torch.device("cpu"), 1) == []

        def unsupported(*args, **kwargs):
            raise RuntimeError("ProcessGroupGloo::reduce_scatter: unsupported device type cuda\nmore")

        monkeypatch.setattr(dist, "reduce_scatter_single", unsupported)
        assert distenv.gloo_gaps(torch.device("cpu"), 1) == [
            "reduce_scatter_single (ProcessGroupGloo::reduce_scatter: unsupported device type cuda)"]
    finally:
        dist.destroy_process_group()


RESTARTED_WORKER = '''
import os, sys, torch, torch.distributed as dist
from lablib.jobs import distenv
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
with distenv.distributed(timeout_s=60) as env:
    x = torch.ones(1)
    dist.all_reduce(x)                       # the group is up: gloo's addresses are in the store
    if attempt == 0 and env.rank == 1:
        os._exit(3)                          # a worker dies; torchrun restarts the whole group
    dist.all_reduce(x)
    if env.is_main:
        open(sys.argv[1], "w").write(f"{attempt} {x.item():g} {env.world_size}")
'''


def test_a_group_restarted_by_torchrun_initialises_again(tmp_path):
    """torchrun --max-restarts: the second attempt's ranks must not find the first attempt's gloo addresses
    in the rendezvous store (without distenv.attempt_store they try to connect to the dead ranks and hang)."""
    script, out = tmp_path / "worker.py", tmp_path / "out.txt"
    script.write_text(RESTARTED_WORKER)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "--max-restarts", "1", str(script), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail("the restarted group hung:\n" + output[-3000:])
    assert proc.returncode == 0, output[-3000:]
    assert out.read_text() == "1 4 2"          # attempt 1 finished: 1 + 1, twice all-reduced over 2 ranks
