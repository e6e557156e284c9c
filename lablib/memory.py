"""What a rank really holds in memory, counted from the tensors' storages (lab 04, ZeRO).

Three kinds of memory, each measured, never estimated:

- **model states**: parameters, gradients and optimizer state (``model_state_bytes``). A tensor is only a
  view of a *storage*; views share it (``q, k, v = qkv.split(...)``, DDP's gradients as views of its
  buckets, FSDP2's sharded parameters as views of a padded shard), so each storage is counted once, with
  its full size (padding included). A ``DTensor`` is counted by its local shard (``to_local()``): the
  bytes this rank holds, not the global tensor it describes;
- **activations**: the tensors autograd saves for the backward pass (``saved_activation_bytes``), seen
  through ``torch.autograd.graph.saved_tensors_hooks`` (https://pytorch.org/docs/stable/autograd.html#hooks-for-saved-tensors);
- the **recipes** of bytes per parameter the ZeRO paper (Rajbhandari et al., 2020, arXiv:1910.02054)
  reasons with, and the GPU cards the notebook fits them on.

The formula for bytes per rank is the lab's exercise and is not here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.utils.checkpoint

GB = 1e9  # the ZeRO paper and GPU data sheets count in 10^9 bytes ("a 40 GB card"); 1 GiB = 1.074 GB

# Memory of common data-centre cards, in bytes (the whole card; CUDA context and fragmentation take some).
GPU_CARDS = {"40 GB (A100-40GB)": 40 * GB, "80 GB (A100/H100-80GB)": 80 * GB}


@dataclass(frozen=True)
class PrecisionRecipe:
    """Bytes each parameter costs in each of the four model states.

    param_bytes:  the weights the forward and backward use (2 in bf16/fp16, 4 in fp32)
    grad_bytes:   their gradients (usually the same dtype as the weights)
    master_bytes: an fp32 copy of the weights that the optimizer updates (4 under mixed precision,
                  0 when the weights are fp32 already: they *are* the master copy)
    optim_bytes:  the optimizer's own state (Adam: two fp32 moments = 8; SGD+momentum: 4; plain SGD: 0)
    """

    name: str
    param_bytes: float
    grad_bytes: float
    master_bytes: float
    optim_bytes: float

    @property
    def total(self) -> float:
        """Bytes per parameter without any sharding (what DDP keeps on every rank)."""
        return self.param_bytes + self.grad_bytes + self.master_bytes + self.optim_bytes


MIXED_ADAM = PrecisionRecipe("bf16/fp16 mixed precision + Adam", 2, 2, 4, 8)   # 16 bytes (ZeRO paper, K = 12)
FP32_ADAM = PrecisionRecipe("fp32 + Adam", 4, 4, 0, 8)                        # 16 bytes, the course's CPU runs
RECIPES = {"mixed": MIXED_ADAM, "fp32": FP32_ADAM}


# --- counting storages ------------------------------------------------------------------------------

def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of t this rank holds: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _storage_key(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr(), s.nbytes())


class StorageCounter:
    """Adds up storage bytes, each storage once, across every call (so across categories too)."""

    def __init__(self):
        self.seen: set[tuple] = set()

    def add(self, tensors: Iterable[torch.Tensor | None]) -> int:
        """Bytes of the storages among tensors not counted before (None entries are skipped)."""
        new = 0
        for t in tensors:
            if t is None:
                continue
            t = local_tensor(t)
            key = _storage_key(t)
            if key not in self.seen and key[2] > 0:
                self.seen.add(key)
                new += key[2]
        return new


def unique_storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes held by the storages behind tensors, each storage counted once."""
    return StorageCounter().add(tensors)


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in an optimizer's state: exp_avg, exp_avg_sq, step, ...

    ``ZeroRedundancyOptimizer`` keeps only this rank's partition, in a local optimizer (``.optim``);
    its own ``.state`` is filled only by ``consolidate_state_dict``, so the local one is what is held.
    """
    inner = getattr(optimizer, "optim", optimizer)
    return [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def model_state_bytes(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> dict:
    """Bytes this rank holds in parameters, their gradients and the optimizer's state, right now.

    params: every parameter tensor the rank holds (for FSDP2: the sharded DTensors *and*, while a module
    is unsharded, the unsharded ones its modules expose). A storage already counted under an earlier
    category is not counted again.
    """
    params = list(params)
    counter = StorageCounter()
    out = {"params": counter.add(params),
           "grads": counter.add(p.grad for p in params),
           "optimizer": counter.add(optimizer_state_tensors(optimizer)) if optimizer is not None else 0}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


# --- activations ------------------------------------------------------------------------------------

@dataclass
class SavedActivations:
    bytes: int                       # unique storages saved for backward, parameters excluded
    tensors: list[tuple]             # (shape, dtype, storage bytes) of each storage, in save order
    n_saved: int                     # how many tensors autograd saved (views included)


def saved_activation_bytes(forward: Callable[[], torch.Tensor],
                           exclude: Iterable[torch.Tensor] = ()) -> tuple[SavedActivations, torch.Tensor]:
    """Run forward() and count the storages autograd saves for backward (each once; `exclude`, e.g. the
    parameters, not at all). Returns the count and forward()'s output (whose backward still works).

    Every tensor an op saves passes through the pack hook. Many are views of one storage (q, k, v of
    one qkv projection; a Linear's input reshaped to 2-D), so storages, not tensors, are what is held.
    """
    excluded = {_storage_key(local_tensor(t)) for t in exclude}
    seen: dict[tuple, tuple] = {}
    n_saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal n_saved
        n_saved += 1
        key = _storage_key(t)
        if key not in excluded and key not in seen:
            seen[key] = (tuple(t.shape), str(t.dtype).replace("torch.", ""), key[2])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    return SavedActivations(sum(v[2] for v in seen.values()), list(seen.values()), n_saved), out
