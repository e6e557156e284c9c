"""What one pipeline stage really did in a step, recorded from outside the students' engine.

``StageRecorder`` hooks a stage: when each forward and backward ran (module hooks, and an identity autograd
function on the stage's output whose backward marks the moment the gradient arrives, so the record is what
ran, not what the engine says) and each forward's saved-activation bytes
(``lablib.measure.memory.SavedActivations``). ``peak_saved_bytes`` is what those bytes and the event order
imply a stage held; the measurement also samples what autograd really still holds
(``lablib.measure.memory.MemoryTimeline``, as for torch's schedules), which an engine that keeps tensors too
long shows and the event order does not.
"""

from __future__ import annotations

import time

import torch

from lablib.measure.memory import SavedActivations


class _Mark(torch.autograd.Function):
    """Identity; its backward calls ``callback()``: the moment the gradient reaches this tensor."""

    @staticmethod
    def forward(ctx, x, callback):
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.callback()
        return grad, None


class StageRecorder:
    """Hooks on one stage: which forward/backward ran when, and each forward's saved-activation bytes."""

    def __init__(self, stage: torch.nn.Module, mark: bool = True, count_saved: bool = True):
        self.stage, self.events, self.grad_times, self.saved_bytes = stage, [], [], []
        self._mark = mark      # False: forwards and saved bytes only (torch's zero-bubble detaches outputs in place)
        self._count_saved = count_saved   # False under a MemoryTimeline: saved-tensor hooks nest, the inner one wins
        self._n_forward, self._saved = 0, None
        self._state = [*stage.parameters(), *stage.buffers()]
        self._handles = [stage.register_forward_pre_hook(self._pre), stage.register_forward_hook(self._post)]
        self._handles += [p.register_post_accumulate_grad_hook(lambda _: self.grad_times.append(time.perf_counter()))
                          for p in stage.parameters()]

    def _pre(self, module, args):
        self._t0 = time.perf_counter()
        if self._count_saved:
            self._saved = SavedActivations(exclude=self._state).__enter__()   # parameters are not activations

    def _post(self, module, args, output):
        j = self._n_forward
        self._n_forward += 1
        if self._count_saved:
            self._saved.__exit__(None, None, None)
            self.saved_bytes.append(self._saved.bytes)
        self.events.append(["F", j, self._t0, time.perf_counter()])
        if not self._mark:
            return output
        return _Mark.apply(output, lambda: self.events.append(["B", j, time.perf_counter(), None]))

    def close(self) -> list[list]:
        """The events in time order, each backward's end set to the last gradient it produced."""
        for h in self._handles:
            h.remove()
        events = sorted(self.events, key=lambda e: e[2])
        for i, e in enumerate(events):
            if e[0] == "B":
                until = events[i + 1][2] if i + 1 < len(events) else float("inf")
                e[3] = max([t for t in self.grad_times if e[2] <= t < until], default=e[2])
        return events


def peak_saved_bytes(result) -> list[int]:
    """Per rank, the most saved-activation bytes held at once: a forward adds its micro-batch's bytes, the
    micro-batch's backward releases them (events in time order)."""
    peaks = []
    for rank_events, sizes in zip(result["events"], result["saved_bytes"]):
        held = peak = 0
        forward_bytes = dict(enumerate(sizes))
        for kind, j, _, _ in rank_events:
            held += forward_bytes.get(j, 0) if kind == "F" else -forward_bytes.get(j, 0)
            peak = max(peak, held)
        peaks.append(peak)
    return peaks
