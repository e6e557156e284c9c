"""The Tiny Shakespeare loader (local copy, cache, real HTTP download, offline error) and batching."""

import functools
import hashlib
import http.server
import threading
from pathlib import Path

import pytest
import torch

from lablib import data
from lablib.distenv import DistEnv

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


def test_distributed_sampler_gives_disjoint_shards_and_reshuffles():
    ds = data.BlockDataset(torch.arange(1001), block_size=10)  # 100 windows
    seen = []
    for rank in range(2):
        env = DistEnv(rank, rank, 2, 2, torch.device("cpu"), "gloo")
        loader = data.make_loader(ds, batch_size=5, env=env, seed=3)
        loader.sampler.set_epoch(0)
        epoch0 = [int(x[0, 0]) for x, _ in loader]
        loader.sampler.set_epoch(1)
        epoch1 = [int(x[0, 0]) for x, _ in loader]
        assert epoch0 != epoch1, "set_epoch must change the order"
        seen.append({int(x[i, 0]) for x, _ in loader for i in range(len(x))})
    assert not seen[0] & seen[1], "ranks must see disjoint windows"
    assert len(seen[0] | seen[1]) == 100
