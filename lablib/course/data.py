"""Tiny Shakespeare, character level: find (or download, verify and cache) the text, tokenize, batch.

Where the text comes from, in order:
1. ``LABLIB_SHAKESPEARE=/path/to/tinyshakespeare.txt`` (course machines, CI, offline laptops);
2. the cache, ``$LABLIB_CACHE`` or ``~/.cache/lablib/tinyshakespeare.txt``;
3. a download of the char-rnn repository's raw file into the cache.
Every copy is checked against the known SHA-256 before use; a wrong or truncated file is an error that
says which file and what to do, never silently different training data.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SHAKESPEARE_BYTES = 1_115_394
ENV_VAR = "LABLIB_SHAKESPEARE"


class DataUnavailableError(RuntimeError):
    """The data set is neither available locally nor downloadable; the message says how to fix it."""


def sha256_of(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def cache_dir() -> Path:
    return Path(os.environ.get("LABLIB_CACHE", Path.home() / ".cache" / "lablib"))


def _check(path: Path, origin: str) -> Path:
    digest = sha256_of(path)
    if digest != SHAKESPEARE_SHA256:
        raise DataUnavailableError(
            f"{origin} {path} is not Tiny Shakespeare: {path.stat().st_size} bytes with sha256 {digest}, "
            f"expected {SHAKESPEARE_BYTES} bytes with sha256 {SHAKESPEARE_SHA256}. "
            f"Delete it (or fix {ENV_VAR}) and run again.")
    return path


def shakespeare_path(url: str = SHAKESPEARE_URL, timeout_s: float = 30.0) -> Path:
    """A verified local copy of Tiny Shakespeare (see the module docstring for the search order)."""
    local = os.environ.get(ENV_VAR)
    if local:
        path = Path(local).expanduser()
        if not path.is_file():
            raise DataUnavailableError(f"{ENV_VAR}={local} but there is no file there. Point {ENV_VAR} "
                                       f"at a copy of tinyshakespeare.txt, or unset it to download one.")
        return _check(path, f"the file named by {ENV_VAR},")
    cached = cache_dir() / "tinyshakespeare.txt"
    if cached.is_file():
        return _check(cached, "the cached file")
    cached.parent.mkdir(parents=True, exist_ok=True)
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            payload = response.read()
    except (urllib.error.URLError, OSError) as exc:
        raise DataUnavailableError(
            f"Tiny Shakespeare is not cached at {cached} and downloading it from {url} failed ({exc}). "
            f"Either connect to the internet and run again, or download input.txt from the char-rnn "
            f"repository (data/tinyshakespeare/) on another machine and set {ENV_VAR}=/path/to/that/file."
        ) from exc
    with tempfile.NamedTemporaryFile(dir=cached.parent, delete=False) as tmp:
        tmp.write(payload)
    try:
        _check(Path(tmp.name), "the downloaded file")
    except DataUnavailableError:
        os.unlink(tmp.name)
        raise
    os.replace(tmp.name, cached)  # atomic, so two ranks downloading at once cannot corrupt the cache
    return cached


def load_shakespeare() -> str:
    return shakespeare_path().read_text(encoding="utf-8")


@dataclass(frozen=True)
class CharTokenizer:
    """Characters to integer ids and back; the vocabulary is the sorted set of characters in the text."""

    chars: str

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Token ids of text, (len(text),) long. One vectorised lookup: a Python dict per character costs every
        rank of every run almost half a second for Tiny Shakespeare's 1.1 M characters."""
        if not text:
            return torch.empty(0, dtype=torch.long)
        codes = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32).long()
        vocab = torch.tensor([ord(c) for c in self.chars], dtype=torch.long)
        order = torch.argsort(vocab)
        where = torch.searchsorted(vocab[order], codes).clamp_(max=len(vocab) - 1)
        unknown = vocab[order][where] != codes
        if unknown.any():
            raise KeyError(chr(int(codes[unknown][0])))
        return order[where]

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def train_val_split(tokens: torch.Tensor, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """First (1 - val_fraction) of the text for training, the rest for validation (as in nanoGPT)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    n_train = int(len(tokens) * (1.0 - val_fraction))
    return tokens[:n_train], tokens[n_train:]


class BlockDataset(Dataset):
    """Non-overlapping windows of block_size + 1 tokens: item i is (x, y) with y = x shifted by one.

    A map-style dataset, so ``DistributedSampler`` can hand each rank a disjoint set of windows.
    x, y: (block_size,) long tensors.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int):
        if len(tokens) < block_size + 1:
            raise ValueError(f"{len(tokens)} tokens are too few for block_size={block_size}")
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * self.block_size: (i + 1) * self.block_size + 1]
        return chunk[:-1], chunk[1:]


class GlobalBatchSampler(Sampler):
    """Batches of this rank's slice of each *global* batch, reshuffled every time it is iterated.

    One permutation of the dataset per epoch, seeded with ``seed + epoch`` (the same on every rank); global
    batch i is positions [i B, (i + 1) B) of it, and rank r takes the contiguous slice
    [i B + r b, i B + (r + 1) b) with b = B / world_size. So every optimizer step sees the same B samples
    whatever the number of ranks, and the ranks' samples are disjoint. The epoch advances by itself at every
    ``iter()`` (like Accelerate's loaders), so a loop needs no call per epoch.
    Lab 05's reference runs (one process, FSDP2) use it; ``DistributedSampler``, which interleaves instead of
    slicing, gives each step the same set of B samples from the same permutation (the lab derives why).
    """

    def __init__(self, n_items: int, global_batch: int, env, seed: int = 0):
        if global_batch < 1 or global_batch % env.world_size:
            raise ValueError(f"global_batch={global_batch} must be a positive multiple of world_size={env.world_size}")
        if n_items < global_batch:
            raise ValueError(f"{n_items} items are too few for one global batch of {global_batch}")
        self.n_items, self.global_batch, self.seed = n_items, global_batch, seed
        self.rank_batch = global_batch // env.world_size
        self.first = env.rank * self.rank_batch            # this rank's offset inside a global batch
        self.epoch = 0

    def __len__(self) -> int:
        return self.n_items // self.global_batch           # incomplete last global batch dropped

    def __iter__(self):
        order = torch.randperm(self.n_items, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        self.epoch += 1
        for start in range(0, len(self) * self.global_batch, self.global_batch):
            yield order[start + self.first: start + self.first + self.rank_batch].tolist()


def global_batch_loader(dataset: Dataset, global_batch: int, env, seed: int = 0) -> DataLoader:
    """A DataLoader over this rank's share (global_batch / world_size items) of each global batch."""
    return DataLoader(dataset, batch_sampler=GlobalBatchSampler(len(dataset), global_batch, env, seed))


def shakespeare_datasets(block_size: int, val_blocks: int | None = None):
    """(tokenizer, train BlockDataset, validation BlockDataset) of Tiny Shakespeare, character level;
    val_blocks keeps only the first that many validation sequences (None: all)."""
    text = load_shakespeare()
    tokenizer = CharTokenizer.from_text(text)
    train_tokens, val_tokens = train_val_split(tokenizer.encode(text))
    if val_blocks is not None:
        val_tokens = val_tokens[: val_blocks * block_size + 1]
    return tokenizer, BlockDataset(train_tokens, block_size), BlockDataset(val_tokens, block_size)


def regression_task(n: int, d_in: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The course's synthetic regression task (labs 01 and 03): x ~ N(0, 1) of shape (n, d_in) and the smooth
    target y = sin(sum of x's first 8 features), shape (n, 1), which a small MLP learns in a few steps.
    The generator decides the samples, so every rank builds the same ones."""
    if d_in < 8:
        raise ValueError(f"d_in={d_in} must be at least 8 (the target reads the first 8 features)")
    x = torch.randn(n, d_in, generator=generator)
    return x, torch.sin(x[:, :8].sum(dim=1, keepdim=True))
