"""Lab 06's per-rank timeline of one training step: when each block's backward ran, when each all-reduce ran,
and how much of the communication the backward hid (DDP's own definition).

Two clocks, one per backend:

- gloo on the CPU: ``time.perf_counter`` in the rank's threads. A gloo all-reduce runs on gloo's threads and
  its work's future completes when the data has arrived, so launch and completion are when it really ran.
- NCCL on GPUs: CPU times say when work was *issued*, not when it ran: kernels queue on streams, and NCCL marks
  a work's future complete once the collective is enqueued, so "done" would equal "launched" and every variant
  would look fully hidden. There the timeline comes from a profiler trace (``torch.profiler``, CUDA activity):
  each NCCL kernel's start and end on the GPU, and the end of the last compute kernel launched by the time the
  last gradient became final (its launch found through the trace's correlation ids; not by the time
  ``backward()`` returned, which for PyTorch's DDP comes after its communication: ``read_cuda_trace``). Block
  spans are not drawn there (their hooks run on the CPU).
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import torch

from lablib.labs.ddp_from_scratch.order import buckets_and_usage_map
from lablib.measure import counting

MARK = "lab06_step", "lab06_backward"   # the trace's user annotations around the step and around loss.backward()
GRAD_READY = "lab06_grad_ready"         # ... and at each gradient becoming final (grad_ready_hook)


def overlap_fraction(comm: list[tuple[float, float]], compute_end: float) -> float:
    """DDP's definition (its reducer's timer): communication spans the first launch .. the last completion;
    the part of it before the backward's compute ended (the last gradient became final) is hidden.
    0 when nothing ran during the backward's compute, 1 when all of it did."""
    start, end = min(c[0] for c in comm), max(c[1] for c in comm)
    if end <= start:
        return 1.0
    return max(0.0, min(end, compute_end) - start) / (end - start)


class BlockTimes:
    """Backward start and end of the GPT's head and blocks (full backward hooks), perf_counter seconds."""

    def __init__(self, gpt):
        self.spans: dict[str, list[float]] = {}
        named = [("head", gpt.lm_head)] + [(f"block {i}", b) for i, b in enumerate(gpt.h)]
        for name, module in named:
            module.register_full_backward_pre_hook(lambda m, g, name=name: self.spans.__setitem__(name, [time.perf_counter()]))
            module.register_full_backward_hook(lambda m, gi, go, name=name: self.spans[name].append(time.perf_counter()))


def grad_ready_hook(ready: list[float], profiled: bool):
    """A post-accumulate-grad hook that notes when a gradient became final: perf_counter seconds in ``ready``, and
    when ``profiled`` (CUDA) a ``GRAD_READY`` annotation on the trace's clock too (``read_cuda_trace`` ends the
    compute at the last one: kernels launched until then are the backward's own). On the CPU no annotation: it
    would add its cost to every gradient of the timed backward."""
    from torch.profiler import record_function

    def hook(_):
        if profiled:
            with record_function(GRAD_READY):
                ready.append(time.perf_counter())
        else:
            ready.append(time.perf_counter())
    return hook


def read_cuda_trace(events: list[dict]) -> dict:
    """From a chrome trace's complete events (``ph == "X"``): seconds from the step's start, ``comm`` (NCCL kernels:
    start, end), ``compute_end`` (the end of the last non-NCCL kernel launched no later than the last gradient
    became final, the last ``GRAD_READY`` annotation, found through the trace's correlation ids).

    Not "launched before backward() returned": PyTorch's DDP finishes inside backward() (its reducer's
    ``finalize_backward`` runs as the autograd engine's final callback; with ``gradient_as_bucket_view=False`` it
    copies every bucket back into ``.grad``, kernels queued after the last NCCL kernel), so that bound would end
    DDP's compute after its communication and read it as 100 % hidden."""
    marks = {e["name"]: e for e in events if e.get("cat") == "user_annotation" and e["name"] in MARK}
    ready = [e["ts"] + e.get("dur", 0) for e in events if e.get("cat") == "user_annotation" and e["name"] == GRAD_READY]
    t0 = marks[MARK[0]]["ts"]
    cutoff = max(ready) if ready else marks[MARK[1]]["ts"] + marks[MARK[1]]["dur"]
    launched = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    kernels = [e for e in events if e.get("cat") == "kernel"]
    comm = [((e["ts"] - t0) / 1e6, (e["ts"] + e["dur"] - t0) / 1e6) for e in kernels if "nccl" in e["name"].lower()]
    compute = [e for e in kernels if "nccl" not in e["name"].lower()
               and launched.get(e.get("args", {}).get("correlation"), float("inf")) <= cutoff]
    compute_end = max(((e["ts"] + e["dur"] - t0) / 1e6 for e in compute), default=0.0)
    return {"comm": comm, "compute_end": compute_end}


def profile_cuda_step(step) -> dict:
    """Run ``step(mark_backward)`` under the profiler (CUDA) and read the GPU's timeline from its trace
    (``read_cuda_trace``). ``step`` wraps its loss.backward() in ``mark_backward()``; the model's gradients carry
    ``grad_ready_hook``s."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(MARK[0]):
            step(lambda: record_function(MARK[1]))
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    return read_cuda_trace(events)


def record_step(env, model, batch, finish, optimizer, recorder, grad_ready: list, blocks: BlockTimes,
                bucket_timer=None) -> dict:
    """One timed training step of a wrapped GPT: seconds from its start, the forward, each block's backward,
    where the backward's compute ended (the last gradient final) and backward() returned, each all-reduce's
    (start, end, bytes), and the hidden fraction. CPU: perf_counter, the all-reduces from ``recorder`` (a
    ``counting.CollectiveLog``) or, for DDP, ``bucket_timer`` (``scaling.BucketTimer``); CUDA: the profiler's
    trace (``profile_cuda_step``; bytes 0, blocks not drawn)."""
    if env.device.type == "cuda":
        def cuda_step(mark_backward):
            loss = model(*batch)[1]
            with mark_backward():
                loss.backward()
            finish()
        gpu = profile_cuda_step(cuda_step)
        optimizer.step()
        end = max([gpu["compute_end"], *(b for _, b in gpu["comm"])])
        return {"forward": [0.0, 0.0], "backward_end": gpu["compute_end"], "compute_end": gpu["compute_end"],
                "finish_end": end, "end": end, "blocks": {}, "comm": [(a, b, 0) for a, b in gpu["comm"]],
                "overlap_fraction": overlap_fraction(gpu["comm"], gpu["compute_end"]) if gpu["comm"] else 0.0}
    with counting.count_collectives(recorder):
        t0 = time.perf_counter()
        loss = model(*batch)[1]
        t_forward = time.perf_counter()
        loss.backward()
        t_backward = time.perf_counter()
        finish()
        t_finish = time.perf_counter()
    optimizer.step()
    t_end = time.perf_counter()
    if bucket_timer is not None:
        comm = [(a, b, n) for a, b, n, _ in bucket_timer.spans]
    else:
        comm = [(c.launched_s, c.done_s or t_finish, c.bytes) for c in recorder.calls if c.name == "all_reduce"]
    compute_end = max(grad_ready)
    return {"forward": [0.0, t_forward - t0], "backward_end": t_backward - t0, "compute_end": compute_end - t0,
            "finish_end": t_finish - t0, "end": t_end - t0,
            "blocks": {k: [v[0] - t0, v[-1] - t0] for k, v in blocks.spans.items()},
            "comm": [(a - t0, b - t0, n) for a, b, n in comm], "overlap_fraction": overlap_fraction(comm, compute_end)}


def grad_bytes_and_count(model) -> tuple[int, int]:
    """Bytes of the trainable gradients (a tied weight once) and the number of trainable tensors."""
    params = [p for p in model.parameters() if p.requires_grad]
    return sum(p.numel() * p.element_size() for p in params), len(params)


def without_usage_map(step: dict, grad_bytes: int, n_params: int) -> dict:
    """A timeline step of the bucketed class with its usage-map all-reduce taken out of ``comm`` (into
    ``usage_map``) and the hidden fraction recomputed over the buckets, as DDP's own timer counts them."""
    buckets, j = buckets_and_usage_map([n for _, _, n in step["comm"]], grad_bytes, n_params)
    step["usage_map"] = None if j is None else step["comm"][j]
    step["comm"] = [step["comm"][i] for i in buckets]
    if j is not None and step["comm"]:
        step["overlap_fraction"] = overlap_fraction(step["comm"], step["compute_end"])
    return step



def ddp_style_fraction(steps: list[dict]) -> float | None:
    """The hidden fraction as DDP's logger computes it: its mean overlap time over its mean communication time
    (communication: first launch to last completion; overlap: the part of it before the compute's end), a ratio
    of means over the steps given, not a median of per-step fractions."""
    comm = [(min(a for a, _, _ in s["comm"]), max(b for _, b, _ in s["comm"]), s["compute_end"])
            for s in steps if s["comm"]]
    total = sum(end - start for start, end, _ in comm)
    return sum(max(0.0, min(end, c) - start) for start, end, c in comm) / total if total > 0 else None
