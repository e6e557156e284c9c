"""What a rank really holds in memory, counted from the tensors' storages (lab 04, ZeRO).

Three kinds of memory, each measured, never estimated:

- **model states**: parameters, gradients and optimizer state (``model_state_bytes``). A tensor is only a
  view of a *storage*; views share it (``q, k, v = qkv.split(...)``, DDP's gradients as views of its
  buckets, FSDP2's sharded parameters as views of a padded shard), so each storage is counted once, with
  its full size (padding included). A ``DTensor`` is counted by its local shard (``to_local()``): the
  bytes this rank holds, not the global tensor it describes;
- **activations**: the tensors autograd saves for the backward pass (``SavedActivations``), seen
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

class SavedActivations:
    """Count the storages autograd saves for backward while the block is open: the course's one counter of
    activation memory (lab 04's measurements, and every training step ``lablib.measure.benchmark`` measures).

        with SavedActivations(exclude=model.parameters()) as saved:
            loss = model(x, y)[1]
        saved.bytes, saved.tensors, saved.n_saved

    Every tensor an op saves passes through a ``saved_tensors_hooks`` pack hook. Many are views of one
    storage (q, k, v of one qkv projection; a Linear's input reshaped to 2-D; its weight transposed), so
    storages, not tensors, are what is held: each is counted once, by its full size (DTensors by their local
    shard). Not activations, so never counted: the storages of ``exclude`` (e.g. the parameters and
    buffers), and with ``parameters_of=model`` the storages of the model's parameters and buffers *at the
    moment they are saved* (FSDP2 all-gathers a unit's parameters into new storages for each forward, so a
    list taken before the step would miss them).

    bytes     unique storages saved for backward, in bytes
    tensors   (shape, dtype, storage bytes) of each counted storage, in save order
    n_saved   how many tensors autograd saved (views and excluded ones included)
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = (), parameters_of: torch.nn.Module | None = None):
        self._excluded = {_storage_key(local_tensor(t)) for t in exclude}
        self._module = parameters_of
        self._seen: dict[tuple, tuple] = {}
        self.n_saved = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _model_state_keys(self) -> set:
        if self._module is None:
            return set()
        held = list(self._module.parameters()) + list(self._module.buffers())
        return {_storage_key(local_tensor(t)) for t in held}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.n_saved += 1
        local = local_tensor(t)
        key = _storage_key(local)
        if key not in self._excluded and key not in self._seen and key not in self._model_state_keys():
            self._seen[key] = (tuple(local.shape), str(local.dtype).replace("torch.", ""), key[2])
        return t

    def __enter__(self) -> "SavedActivations":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        self._hooks.__exit__(*exc)
        return False

    @property
    def bytes(self) -> int:
        return sum(v[2] for v in self._seen.values())

    @property
    def tensors(self) -> list[tuple]:
        return list(self._seen.values())


def saved_activation_bytes(forward: Callable[[], torch.Tensor],
                           exclude: Iterable[torch.Tensor] = ()) -> tuple[SavedActivations, torch.Tensor]:
    """Run forward() inside ``SavedActivations(exclude)``: the count and forward()'s output (whose backward
    still works)."""
    with SavedActivations(exclude=exclude) as saved:
        out = forward()
    return saved, out


# --- memory over one training step -------------------------------------------------------------------

import weakref  # noqa: E402  (this section's own import, kept with it)

class _LiveSavedActivations(SavedActivations):
    """``SavedActivations`` that also knows which of its storages autograd still holds: a weak reference to
    every saved tensor it counts, so the counter itself keeps nothing alive.

    With ``track_peak``, ``peak_held`` is the most bytes of saved storages held at once: counted after every save
    (saved activations only grow while a forward saves them, and only shrink while a backward frees them, so their
    peak follows a save). Unlike ``bytes`` (every storage seen during the block, once per address), a storage freed
    before another is saved at its address is not counted twice, nor one freed long before the other is saved
    (the micro-batches of gradient accumulation: one micro-batch's activations are held at a time).
    """

    def __init__(self, parameters_of: torch.nn.Module, track_peak: bool = False):
        super().__init__(parameters_of=parameters_of)
        self._refs: dict[tuple, list] = {}
        self._track_peak = track_peak
        self.peak_held = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        out = super()._pack(t)
        local = local_tensor(t)
        key = _storage_key(local)
        # an activation (not a parameter or buffer) now: an address once an activation's may hold a parameter later
        if key in self._seen and key not in self._excluded and key not in self._model_state_keys():
            self._refs.setdefault(key, []).append(weakref.ref(local))
            if self._track_peak:
                self.peak_held = max(self.peak_held, self.held_bytes())
        return out

    def held_bytes(self) -> int:
        """Bytes of the saved storages held right now, each storage once (a moment, not a peak)."""
        return StorageCounter().add(self.alive())

    def alive(self) -> list[torch.Tensor]:
        """The saved tensors still held (by autograd's graph, or by anything else)."""
        return [t for refs in self._refs.values() for t in (ref() for ref in refs) if t is not None]


class MemoryTimeline:
    """What this rank holds, sampled at every module's forward and backward boundary of one training step.

        with MemoryTimeline(model, optimizer, persistent={"ddp_buckets": n}) as timeline:
            model(x, y)[1].backward(); optimizer.step(); optimizer.zero_grad()
        timeline.samples   # [{"event": "forward h.0", "phase": "forward", "params": ..., "total": ...}, ...]

    Each sample counts, like the rest of this module (``StorageCounter``: each storage once, a DTensor by its
    local shard): the parameters (under FSDP2 the local shards *and* every unit all-gathered at that
    moment, which its modules expose while unsharded), their gradients, the optimizer's state and the saved
    activations autograd has not yet freed; ``persistent`` adds bytes held outside the tensors seen here
    (DDP's gradient buckets) to every sample. Samples are taken before and after every module's forward
    (module hooks), when the gradient of a module's output arrives (the start of its backward: a hook on
    the output tensor), before and after ``optimizer.step``, and at both ends.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 persistent: dict[str, int] | None = None):
        self.model = getattr(model, "module", model)             # DDP's wrapper has no modules of its own
        self.optimizer = optimizer
        self.persistent = dict(persistent or {})
        self.params = list(model.parameters())                    # FSDP2 between steps: the local shards
        self.saved = _LiveSavedActivations(parameters_of=self.model)
        self.samples: list[dict] = []
        self._handles: list = []

    def sample(self, event: str, phase: str) -> None:
        counter = StorageCounter()
        held = self.params + [p for m in self.model.modules() for p in m._parameters.values() if p is not None]
        row = {"event": event, "phase": phase, "params": counter.add(held),
               "grads": counter.add(p.grad for p in held),
               "optimizer": counter.add(optimizer_state_tensors(self.optimizer)) if self.optimizer else 0,
               "activations": counter.add(self.saved.alive()), **self.persistent}
        row["total"] = sum(v for k, v in row.items() if k not in ("event", "phase"))
        self.samples.append(row)

    def _forward_done(self, label: str, output) -> None:
        self.sample(f"forward {label} done", "forward")
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, torch.Tensor) and t.requires_grad:   # its gradient arrives when the backward
                t.register_hook(lambda grad: self.sample(f"backward {label}", "backward"))   # reaches the module
                return

    def __enter__(self) -> "MemoryTimeline":
        self.sample("start", "start")
        for name, module in self.model.named_modules():
            label = name or "(model)"
            self._handles.append(module.register_forward_pre_hook(
                lambda m, args, label=label: self.sample(f"forward {label}", "forward")))
            self._handles.append(module.register_forward_hook(
                lambda m, args, out, label=label: self._forward_done(label, out)))
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_pre_hook(
                lambda *_: self.sample("optimizer.step", "optimizer")))
            self._handles.append(self.optimizer.register_step_post_hook(
                lambda *_: self.sample("optimizer.step done", "optimizer")))
        self.saved.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        self.saved.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self.sample("end", "end")
        return False
