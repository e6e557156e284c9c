"""Measure a training step the same way for every parallelism: time, memory, CPU share, collectives.

A ``StepMeter`` is called by a training loop after every optimizer step (``on_step(step, loss)``), so the
loop itself carries no measuring code and a DDP loop, an FSDP2 loop and an Accelerate loop are measured
identically. Between two calls lies exactly one training step (forward, backward, optimizer step,
``zero_grad``), and the meter opens its measuring windows on those boundaries:

- **step time**: the median interval between calls, leaving out warm-up, evaluation and measured steps;
  tokens/s = tokens of the global batch / the slowest rank's median step time;
- **memory per rank** (one step, ``profile_step``), counted the same way on every device, never
  estimated: the model states from their storages (parameters and AdamW state between steps, the gradients
  when ``optimizer.step`` is called, DDP's persistent gradient buckets from its communication hook; FSDP2's
  DTensors by their local shards) and the activations autograd saves for the backward (every storage that
  passes through a ``saved_tensors_hooks`` pack hook during the step, parameters excluded). Two sums are
  reported, named for what they are: ``end_of_forward`` = at rest + saved activations (``zero_grad`` sets
  the gradients to None, so none exist yet), and ``upper_bound`` = at rest + gradients + activations (the
  backward frees activations as it creates gradients, so the true peak lies between the larger of the two
  ends and this bound). Both leave out short-lived temporaries and FSDP2's transiently all-gathered unit.
  Not the process's RSS (Python, libraries and cached pages are megabytes of noise); on a GPU
  ``torch.cuda.max_memory_allocated`` (the allocator's real peak) is recorded next to them;
- **CPU share**: the process's CPU time per step over its wall time (1.0: one core busy all the time;
  below 1 on one thread: the rank waited, for a collective or for a core another process held);
- **collectives per step** (one step, ``count_step``): FSDP2's all-gathers and reduce-scatters pass through
  ``torch.distributed`` and are counted by wrapping its functions for one step; DDP's gradient
  all-reduces are issued by its C++ reducer and are counted by a communication hook on every DDP model
  built inside ``count_ddp_models()`` (also the one Accelerate builds in ``prepare``).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lablib import script
from lablib.counting import CommCounter, count_ddp_allreduces
from lablib.memory import local_tensor, model_state_bytes, unique_storage_bytes

# torch.distributed's collectives -> the names the course uses (FSDP2 calls the *_single ones in torch 2.13).
COLLECTIVES = {"all_reduce": "all_reduce", "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
               "all_gather": "all_gather", "reduce_scatter_single": "reduce_scatter",
               "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter": "reduce_scatter"}


@contextlib.contextmanager
def count_ddp_models():
    """Attach lablib.counting's all-reduce counter to every DDP model constructed inside the block.

    Yields the list the counters are appended to (one per model, in construction order).
    """
    counters: list[CommCounter] = []
    original = DistributedDataParallel.__init__

    def counting_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        counters.append(count_ddp_allreduces(self))

    DistributedDataParallel.__init__ = counting_init
    try:
        yield counters
    finally:
        DistributedDataParallel.__init__ = original


class _CollectiveCounter:
    """Counts calls of torch.distributed's collectives while open, by wrapping the module's functions (FSDP2
    and DDP's Python communication hooks call them through ``torch.distributed``). Only the outermost call
    counts, so a collective implemented with another is counted once."""

    def __init__(self):
        self.counts = Counter()
        self.originals = {}
        self.depth = 0

    def _wrap(self, name, fn):
        def counting(*args, **kwargs):
            if self.depth == 0:
                self.counts[COLLECTIVES[name]] += 1
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
        return counting

    def __enter__(self):
        for name in COLLECTIVES:
            if hasattr(dist, name):
                self.originals[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self.originals[name]))
        return self

    def __exit__(self, *exc):
        for name, fn in self.originals.items():
            setattr(dist, name, fn)
        return False


class _SavedActivations:
    """Storages autograd saves for backward while open (each once; parameters, sharded or gathered, excluded)."""

    def __init__(self):
        self.seen: dict[tuple, int] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not (t.is_leaf and t.requires_grad):  # a parameter is not an activation
            local = local_tensor(t)
            s = local.untyped_storage()
            self.seen.setdefault((str(local.device), s.data_ptr(), s.nbytes()), s.nbytes())
        return t

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)
        return False

    @property
    def bytes(self) -> int:
        return sum(self.seen.values())


class StepMeter:
    """``on_step(step, loss)`` after each optimizer step; ``summary(env)`` at the end (all ranks call it)."""

    def __init__(self, env, model, optimizer, tokens_per_step: int, total_steps: int, eval_every: int,
                 profile_step: int = 3, count_step: int = 4, ddp_counters: list[CommCounter] | None = None):
        self.env, self.model, self.optimizer = env, model, optimizer
        self.tokens_per_step, self.total_steps, self.eval_every = tokens_per_step, total_steps, eval_every
        self.profile_step, self.count_step = profile_step, count_step
        self.ddp_counters = ddp_counters if ddp_counters is not None else []
        self.intervals: dict[int, float] = {}
        self.cpu_intervals: dict[int, float] = {}
        self.losses: list[float] = []
        self.memory: dict = {}
        self.collectives: dict = {}
        self._t = self._cpu = None
        self._window = None
        self._ddp_calls = self._ddp_bytes = 0      # cumulative totals of the DDP counters at the last call
        self._ddp_step_bytes = 0                   # bytes all-reduced in the last step = DDP's bucket bytes

    # -- measuring windows, opened after step k and closed after step k + 1 -----------------------------
    def _open(self, step: int) -> None:
        if step == self.profile_step:
            states = model_state_bytes(self.model.parameters(), self.optimizer)
            self.memory = {"params": states["params"], "optimizer": states["optimizer"],
                           "ddp_buckets": self._ddp_step_bytes}   # DDP keeps its buckets between steps
            grads_seen = []

            def count_grads(optimizer, args, kwargs):  # every gradient exists when the optimizer steps
                grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
                grads_seen.append(unique_storage_bytes(grads))

            handle = self.optimizer.register_step_pre_hook(count_grads)
            if self.env.device.type == "cuda":
                torch.cuda.synchronize(self.env.device)
                torch.cuda.reset_peak_memory_stats(self.env.device)
            self._window = ("memory", (_SavedActivations().__enter__(), handle, grads_seen))
        elif step == self.count_step:
            mode = _CollectiveCounter()
            mode.__enter__()
            self._window = ("comm", mode)

    def _close(self) -> None:
        kind, obj = self._window
        self._window = None
        if kind == "memory":
            activations, handle, grads_seen = obj
            activations.__exit__(None, None, None)
            handle.remove()
            m = self.memory
            m["grads"] = max(grads_seen, default=0)
            m["activations"] = activations.bytes
            m["at_rest"] = m["params"] + m["optimizer"] + m["ddp_buckets"]
            m["during_step"] = m["grads"] + m["activations"]
            m["end_of_forward"] = m["at_rest"] + m["activations"]
            m["upper_bound"] = m["at_rest"] + m["during_step"]
            if self.env.device.type == "cuda":
                torch.cuda.synchronize(self.env.device)
                m["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(self.env.device)
        else:
            obj.__exit__(None, None, None)
            counts = obj.counts
            if self.ddp_counters:  # the hook sees exactly DDP's gradient all-reduces (its Python call of
                # dist.all_reduce is seen by the wrapper too: count it once)
                counts["all_reduce"] = sum(c.calls for c in self.ddp_counters) - self._ddp_calls
            self.collectives = {k: counts.get(k, 0) for k in ("all_reduce", "all_gather", "reduce_scatter")}

    def __call__(self, step: int, loss: torch.Tensor) -> None:
        if self._window is not None:
            self._close()
        calls, nbytes = sum(c.calls for c in self.ddp_counters), sum(c.bytes for c in self.ddp_counters)
        self._ddp_step_bytes = nbytes - self._ddp_bytes
        self._ddp_calls, self._ddp_bytes = calls, nbytes
        now, cpu = time.perf_counter(), time.process_time()
        measured = step - 1 in (self.profile_step, self.count_step)
        after_eval = (step - 1) % self.eval_every == 0
        if self._t is not None and step > 2 and not measured and not after_eval:
            self.intervals[step] = now - self._t
            self.cpu_intervals[step] = cpu - self._cpu
        self.losses.append(float(loss.detach()))
        script.progress(self.env, step, self.total_steps, loss=self.losses[-1])
        self._open(step)
        self._t, self._cpu = time.perf_counter(), time.process_time()

    def summary(self) -> dict:
        """Every rank must call this (it all-reduces the step time: the slowest rank sets the pace)."""
        if self._window is not None:
            self._close()
        median = statistics.median(self.intervals.values()) if self.intervals else float("nan")
        cpu_share = (statistics.median(self.cpu_intervals[k] / self.intervals[k] for k in self.intervals)
                     if self.intervals else float("nan"))
        per_rank = torch.tensor([median, cpu_share], dtype=torch.float64)
        if dist.is_initialized():
            gathered = [torch.zeros_like(per_rank) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, per_rank)
        else:
            gathered = [per_rank]
        slowest = max(float(g[0]) for g in gathered)              # the slowest rank sets the pace
        return {"median_step_time_s": slowest, "tokens_per_s": self.tokens_per_step / slowest,
                "median_step_time_s_per_rank": [float(g[0]) for g in gathered],
                "cpu_share_per_rank": [float(g[1]) for g in gathered],
                "train_losses": self.losses, "memory": self.memory, "collectives_per_step": self.collectives,
                "timed_steps": len(self.intervals)}
