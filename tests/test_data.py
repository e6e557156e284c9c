"""The Tiny Shakespeare loader (local copy, cache, real HTTP download, offline error) and batching."""

import functools
import hashlib
import http.server
import threading
from pathlib import Path

import pytest
import torch

from lablib.course import data
from lablib.jobs.distenv import DistEnv

SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "tinyshakespeare.txt"
needs_copy = pytest.mark.skipif(not SHARED.is_file(), reason="needs ../shared/data/tinyshakespeare.txt")


@pytest.fixture
def isolated(monkeypatch, tmp_path):
    """No env var, an empty cache of our own."""
    monkeypatch.delenv(data.ENV_VAR, raising=False)
    monkeypatch.setenv("LABLIB_CACHE", str(tmp_path / "cache"))
    return tmp_path


def serve(folder: Path):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@needs_copy
def test_env_var_copy_is_verified_and_used(monkeypatch):
    monkeypatch.setenv(data.ENV_VAR, str(SHARED))
    text = data.load_shakespeare()
    assert len(text.encode()) == data.SHAKESPEARE_BYTES
    assert hashlib.sha256(text.encode()).hexdigest() == data.SHAKESPEARE_SHA256
    assert data.CharTokenizer.from_text(text).vocab_size == 65


def test_env_var_to_missing_or_wrong_file(isolated, monkeypatch):
    monkeypatch.setenv(data.ENV_VAR, str(isolated / "nope.txt"))
    with pytest.raises(data.DataUnavailableError, match="no file there"):
        data.shakespeare_path()
    wrong = isolated / "wrong.txt"
    wrong.write_text("To be or not to be")
    monkeypatch.setenv(data.ENV_VAR, str(wrong))
    with pytest.raises(data.DataUnavailableError, match="is not Tiny Shakespeare: 18 bytes"):
        data.shakespeare_path()


@needs_copy
def test_download_verifies_and_caches(isolated):
    site = isolated / "site"
    site.mkdir()
    (site / "input.txt").write_bytes(SHARED.read_bytes())
    server, base = serve(site)
    try:
        path = data.shakespeare_path(url=f"{base}/input.txt")
    finally:
        server.shutdown()
    assert path == isolated / "cache" / "tinyshakespeare.txt"
    assert data.sha256_of(path) == data.SHAKESPEARE_SHA256
    # The server is gone: the second call must use the cache.
    assert data.shakespeare_path(url=f"{base}/input.txt") == path


def test_corrupt_download_is_rejected_and_not_cached(isolated):
    site = isolated / "site"
    site.mkdir()
    (site / "input.txt").write_text("First Citizen:\nnot the real file\n")
    server, base = serve(site)
    try:
        with pytest.raises(data.DataUnavailableError, match="the downloaded file .* is not Tiny Shakespeare"):
            data.shakespeare_path(url=f"{base}/input.txt")
    finally:
        server.shutdown()
    assert not (isolated / "cache" / "tinyshakespeare.txt").exists()


def test_offline_without_copy_says_how_to_fix(isolated):
    server, base = serve(isolated)
    server.shutdown()
    server.server_close()  # nothing listens on that port any more
    with pytest.raises(data.DataUnavailableError, match=r"set LABLIB_SHAKESPEARE=/path/to/that/file"):
        data.shakespeare_path(url=f"{base}/input.txt", timeout_s=5)


def test_tokenizer_split_and_blocks():
    text = "hello world, hello labs"
    tok = data.CharTokenizer.from_text(text)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    train, val = data.train_val_split(ids, 0.25)
    assert len(train) + len(val) == len(ids) and torch.equal(torch.cat([train, val]), ids)
    with pytest.raises(ValueError, match="val_fraction"):
        data.train_val_split(ids, 1.5)
    ds = data.BlockDataset(ids, block_size=4)
    x, y = ds[1]
    assert torch.equal(x[1:], y[:-1]) and torch.equal(x, ids[4:8])


def test_global_batch_sampler_slices_the_same_global_batches_on_any_world_size():
    ds = data.BlockDataset(torch.arange(1001), block_size=10)  # 100 windows
    one = data.global_batch_loader(ds, 8, DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo"), seed=3)
    loaders = [data.global_batch_loader(ds, 8, DistEnv(r, r, 2, 2, torch.device("cpu"), "gloo"), seed=3) for r in range(2)]
    for epoch in range(2):                            # every iter() is the next epoch: a new permutation
        single = [sorted(int(v) for v in x[:, 0] // 10) for x, _ in one]
        per_rank = [[[int(v) for v in x[:, 0] // 10] for x, _ in loader] for loader in loaders]
        assert len(single) == 12 and all(len(b) == 4 for rank in per_rank for b in rank)
        for i, batch in enumerate(single):            # step i: the same 8 windows, split 4 + 4, disjoint
            assert sorted(per_rank[0][i] + per_rank[1][i]) == batch
            assert not set(per_rank[0][i]) & set(per_rank[1][i])
        if epoch == 0:
            first = single
    assert first != single, "the second pass must be another permutation"
    other_seed = data.global_batch_loader(ds, 8, DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo"), seed=4)
    assert [sorted(int(v) for v in x[:, 0] // 10) for x, _ in other_seed] != first
    with pytest.raises(ValueError, match="multiple of world_size=2"):
        data.GlobalBatchSampler(100, 7, DistEnv(0, 0, 2, 2, torch.device("cpu"), "gloo"))


def test_shakespeare_datasets_keep_the_asked_validation_blocks(monkeypatch):
    if not SHARED.is_file():
        pytest.skip("needs ../shared/data/tinyshakespeare.txt")
    monkeypatch.setenv(data.ENV_VAR, str(SHARED))
    tok, train, val = data.shakespeare_datasets(block_size=64, val_blocks=8)
    assert tok.vocab_size == 65 and len(val) == 8 and len(train) > 10_000
