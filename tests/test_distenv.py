import pytest
import torch

from lablib import distenv, launch


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

        monkeypatch.setattr(dist, "reduce_scatter_tensor", unsupported)
        assert distenv.gloo_gaps(torch.device("cpu"), 1) == [
            "reduce_scatter_tensor (ProcessGroupGloo::reduce_scatter: unsupported device type cuda)"]
    finally:
        dist.destroy_process_group()
