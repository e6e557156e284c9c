"""Measure a training step the same way for every parallelism: time, memory, CPU share, collectives.

A ``StepMeter`` is called by a training loop after every optimizer step (``on_step(step, loss)``), so the
loop itself carries no measuring code and a DDP loop, an FSDP2 loop and an Accelerate loop are measured
identically. Between two calls lies exactly one training step (forward, backward, optimizer step,
``zero_grad``), and the meter opens its measuring windows on those boundaries:

- **step time** (``lablib.measure.timing``'s definition): the interval between calls on each rank, leaving out
  warm-up, evaluation and measured steps; per step the slowest rank's; their median is ``median_step_s``;
  tokens/s = tokens of the global batch / that median;
- **memory per rank** (one step, ``profile_step``), counted the same way on every device, never
  estimated: the model states from their storages (parameters and AdamW state between steps, the gradients
  when ``optimizer.step`` is called, DDP's persistent gradient buckets from its communication hook; FSDP2's
  DTensors by their local shards) and the activations autograd saves for the backward: the most bytes of saved
  storages it holds at once during the step (``memory._LiveSavedActivations``' ``peak_held``, parameters excluded:
  with gradient accumulation one micro-batch's, as each backward frees what its forward saved). Two sums are
  reported, named for what they are: ``end_of_forward`` = at rest + saved activations (``zero_grad`` sets
  the gradients to None, so none exist yet), and ``upper_bound`` = at rest + gradients + activations (the
  backward frees activations as it creates gradients, so the true peak lies between the larger of the two
  ends and this bound). Both leave out short-lived temporaries and FSDP2's transiently all-gathered unit.
  Not the process's RSS (Python, libraries and cached pages are megabytes of noise); on a GPU
  ``torch.cuda.max_memory_allocated`` (the allocator's real peak) is recorded next to them;
- **CPU share**: the process's CPU time per step over its wall time (1.0: one core busy all the time;
  below 1 on one thread: the rank waited, for a collective or for a core another process held);
- **collectives per step** (one step, ``count_step``), by ``lablib.measure.counting``: FSDP2's all-gathers and
  reduce-scatters through ``count_collectives``, DDP's bucket all-reduces through the hook that
  ``counting.count_ddp_models()`` puts on every DDP model built inside it (also the one Accelerate builds in
  ``prepare``): pass that log as ``ddp_log``.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from lablib.jobs import script
from lablib.measure import timing
from lablib.measure.counting import CollectiveLog, count_collectives
from lablib.measure.memory import _LiveSavedActivations, model_state_bytes, unique_storage_bytes

# The step after which memory is measured, and the one after which collectives are counted (both after
# DDP's first-step bucket rebuild and FSDP2's lazy initialisation).
PROFILE_STEP, COUNT_STEP = 3, 4


class StepMeter:
    """``on_step(step, loss)`` after each optimizer step; ``summary(env)`` at the end (all ranks call it)."""

    def __init__(self, env, model, optimizer, tokens_per_step: int, total_steps: int, eval_every: int,
                 ddp_log: CollectiveLog | None = None):
        self.env, self.model, self.optimizer = env, model, optimizer
        self.tokens_per_step, self.total_steps, self.eval_every = tokens_per_step, total_steps, eval_every
        self.profile_step, self.count_step = PROFILE_STEP, COUNT_STEP
        self.ddp_log = ddp_log if ddp_log is not None else CollectiveLog()
        self.intervals: dict[int, float] = {}
        self.cpu_intervals: dict[int, float] = {}
        self.losses: list[float] = []
        self.memory: dict = {}
        self.collectives: dict = {}
        self._t = self._cpu = None
        self._window = None
        self._ddp_calls = self._ddp_bytes = 0      # cumulative totals of the DDP log at the last call
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
            activations = _LiveSavedActivations(parameters_of=getattr(self.model, "module", self.model),
                                                track_peak=True)
            activations.__enter__()
            self._window = ("memory", (activations, handle, grads_seen))
        elif step == self.count_step:
            block = count_collectives()
            self._window = ("comm", (block, block.__enter__()))

    def _close(self) -> None:
        kind, obj = self._window
        self._window = None
        if kind == "memory":
            activations, handle, grads_seen = obj
            activations.__exit__(None, None, None)
            handle.remove()
            m = self.memory
            m["grads"] = max(grads_seen, default=0)
            m["activations"] = activations.peak_held
            m["at_rest"] = m["params"] + m["optimizer"] + m["ddp_buckets"]
            m["during_step"] = m["grads"] + m["activations"]
            m["end_of_forward"] = m["at_rest"] + m["activations"]
            m["upper_bound"] = m["at_rest"] + m["during_step"]
            if self.env.device.type == "cuda":
                torch.cuda.synchronize(self.env.device)
                m["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(self.env.device)
        else:
            block, log = obj
            block.__exit__(None, None, None)
            counts = log.counts()
            # DDP's bucket all-reduces are in the DDP log (its hook's own dist.all_reduce is not recorded twice).
            counts["all_reduce"] = counts.get("all_reduce", 0) + self.ddp_log.count() - self._ddp_calls
            self.collectives = {k: counts.get(k, 0) for k in ("all_reduce", "all_gather", "reduce_scatter")}

    def __call__(self, step: int, loss: torch.Tensor) -> None:
        if self._window is not None:
            self._close()
        calls, nbytes = self.ddp_log.count(), self.ddp_log.bytes()
        self._ddp_step_bytes = nbytes - self._ddp_bytes
        self._ddp_calls, self._ddp_bytes = calls, nbytes
        if self.env.device.type == "cuda":      # the step is over when the GPU is done (lablib.measure.timing's stopwatch)
            torch.cuda.synchronize(self.env.device)
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
        """Every rank must call this (a collective: the slowest rank sets the pace, ``lablib.measure.timing``)."""
        if self._window is not None:
            self._close()
        steps = sorted(self.intervals)
        if not steps:
            raise ValueError(f"no step was timed in {self.total_steps} steps: train more steps than the warm-up, "
                             f"the measured steps ({self.profile_step}, {self.count_step}) and the evaluations")
        times = timing.step_times([self.intervals[k] for k in steps], self.env.device)
        own_median = statistics.median(self.intervals[k] for k in steps)
        cpu_share = statistics.median(self.cpu_intervals[k] / self.intervals[k] for k in steps)
        per_rank = torch.tensor([own_median, cpu_share], dtype=torch.float64)
        if dist.is_initialized():
            gathered = [torch.zeros_like(per_rank) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, per_rank)
        else:
            gathered = [per_rank]
        return {**times, "tokens_per_s": self.tokens_per_step / times["median_step_s"],
                "median_step_s_per_rank": [float(g[0]) for g in gathered],
                "cpu_share_per_rank": [float(g[1]) for g in gathered],
                "train_losses": self.losses, "memory": self.memory, "collectives_per_step": self.collectives,
                "timed_steps": len(steps)}
