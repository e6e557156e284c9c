"""Pipeline parallelism, applied to the course GPT from outside: the stages, and schedules by simulation.

``gpt_stages(model, n_stages)`` cuts a ``lablib.models.GPT`` into consecutive stages (stage 0: the
embeddings and the first blocks; the last stage: the last blocks, ``ln_f``, ``lm_head`` and the loss). GPT-2
ties ``lm_head.weight`` to ``wte.weight``; once the two sit on different ranks each stage keeps its own copy
and the two gradients must be added (Megatron-LM all-reduces them between the first and last stage; the
checks here add them up when they compare with one process).

``simulate(kind, n_stages, n_microbatches, ...)`` plays a schedule tick by tick: every rank runs at most one
operation at a time, an operation starts once its inputs exist (the forward of micro-batch j on stage s
needs stage s-1's forward of j; the backward needs stage s+1's backward of j), and a rank picks among the
ready ones by a *rule*, not from a list:

- ``gpipe`` (Huang et al., 2019): forwards first, backwards only once this rank has run every forward;
- ``1f1b`` (PipeDream-Flush, Narayanan et al., 2021; Megatron-LM's non-interleaved schedule): a backward
  whenever one is ready; a forward only while this rank holds fewer than p - rank micro-batches.

The order each rank ends up with is the course's reference schedule (exercise 1 is graded against it), and
the simulated idle time is the reference bubble (exercise 3). With ``chunks`` (interleaving v) rank r holds
virtual stages r, r + p, ..., each 1/v of its layers (Narayanan et al., 2021, section 2.2), and runs them in
Megatron-LM's interleaved order (``interleaved_order``), each operation as soon as its inputs exist; the
simulated bubble is then (p - 1) / (v m + p - 1), as the paper derives (the tests check it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lablib.models import GPT

KINDS = ("gpipe", "1f1b")


# --- the stages -------------------------------------------------------------------------------------------------

def layer_split(n_layer: int, n_stages: int) -> list[range]:
    """Which blocks each stage holds: consecutive, as even as possible, earlier stages one more."""
    if not 1 <= n_stages <= n_layer:
        raise ValueError(f"n_stages={n_stages} must be between 1 and n_layer={n_layer} (every stage needs a block)")
    base, extra = divmod(n_layer, n_stages)
    sizes = [base + (s < extra) for s in range(n_stages)]
    starts = [sum(sizes[:s]) for s in range(n_stages)]
    return [range(a, a + n) for a, n in zip(starts, sizes)]


class GPTStage(nn.Module):
    """Blocks ``layers`` of a GPT, with the embeddings on the first stage and the head on the last.

    first stage:  token ids (mb, T) -> hidden (mb, T, n_embd)
    middle stage: hidden -> hidden
    last stage:   ``stage(hidden, targets)`` -> the micro-batch's mean cross-entropy (a scalar)
    With one stage, ``stage(ids, targets)`` is the whole model's loss.
    """

    def __init__(self, model: GPT, layers: range, first: bool, last: bool, loss: bool = True):
        super().__init__()
        self.first, self.last, self.loss = first, last, loss
        self.layers = layers                    # the blocks' indices in the whole model
        if first:
            self.wte, self.wpe = model.wte, model.wpe
        self.h = nn.ModuleList(model.h[i] for i in layers)
        if last:
            self.ln_f = model.ln_f
            self.lm_head = model.lm_head
            if not first:   # the tied weight lives on stage 0 too: a copy of its own here
                self.lm_head = nn.Linear(model.config.n_embd, model.config.vocab_size, bias=False)
                self.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))   # (mb, T, n_embd)
        for block in self.h:
            x = block(x)
        if not self.last:
            return x
        logits = self.lm_head(self.ln_f(x))                                           # (mb, T, vocab)
        if not self.loss:            # torch.distributed.pipelining computes the loss itself (loss_fn)
            return logits
        if targets is None:
            raise ValueError("the last stage computes the loss: call it as stage(hidden, targets)")
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def gpt_stages(model: GPT, n_stages: int, loss: bool = True) -> list[GPTStage]:
    """The GPT cut into n_stages consecutive stages (they share the model's parameters, except the tied head).
    loss=False: the last stage returns the logits (for a schedule that takes a loss_fn)."""
    split = layer_split(model.config.n_layer, n_stages)
    return [GPTStage(model, layers, s == 0, s == n_stages - 1, loss) for s, layers in enumerate(split)]


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's loss from logits (mb, T, vocab) and targets (mb, T): the loss_fn of a torch schedule."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def stage_gradients(stage: GPTStage) -> dict[str, torch.Tensor]:
    """The stage's gradients under the whole model's names (``h.3.mlp...``); the untied head's copy is added to
    ``wte.weight`` when the stages are combined (``combine_stage_gradients``)."""
    out = {}
    for name, p in stage.named_parameters():
        if name.startswith("h."):
            _, i, rest = name.split(".", 2)
            name = f"h.{stage.layers[int(i)]}.{rest}"
        out[name] = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
    return out


def model_gradients(model: GPT) -> dict[str, torch.Tensor]:
    """The single-process model's gradients by name (the tied weight once, as ``wte.weight``)."""
    return {name: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            for name, p in model.named_parameters()}


def combine_stage_gradients(per_stage: list[dict]) -> dict[str, torch.Tensor]:
    """All stages' gradients as one model's: the tied head's gradient added to the embedding's."""
    out: dict[str, torch.Tensor] = {}
    for grads in per_stage:
        for name, g in grads.items():
            name = "wte.weight" if name == "lm_head.weight" else name
            out[name] = out[name] + g if name in out else g
    return out


# --- schedules by simulation --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Op:
    rank: int
    kind: str        # "F" or "B"
    microbatch: int
    chunk: int       # which of the rank's v model chunks (0 without interleaving)
    start: float
    end: float


def in_flight_limit(kind: str, n_stages: int, rank: int) -> int:
    """How many micro-batches a rank may hold (forward run, backward not yet) before it must run a backward."""
    return 10**9 if kind == "gpipe" else n_stages - rank


def interleaved_order(n_stages: int, n_microbatches: int, chunks: int, rank: int) -> list[tuple[str, int, int]]:
    """Megatron-LM's interleaved 1F1B order for one rank: ("F"/"B", micro-batch, chunk). Forwards go through the
    chunks in groups of p micro-batches; warm-up 2(p - rank - 1) + (v - 1)p forwards, then one forward one
    backward (Narayanan et al., 2021; megatron/core/pipeline_parallel/schedules.py). Needs m a multiple of p."""
    p, m, v = n_stages, n_microbatches, chunks
    if m % p:
        raise ValueError(f"interleaving needs n_microbatches={m} to be a multiple of n_stages={p} (Megatron's rule)")
    total = m * v
    forward = [("F", (k // (p * v)) * p + k % p, (k // p) % v) for k in range(total)]
    backward = [("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v) for k in range(total)]
    warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    order = forward[:warmup]
    for k in range(total - warmup):
        order += [forward[warmup + k], backward[k]]
    return order + backward[total - warmup:]


def simulate(kind: str, n_stages: int, n_microbatches: int, chunks: int = 1, t_forward: float = 1.0,
             t_backward: float = 2.0) -> list[list[Op]]:
    """Every rank's operations, in the order and at the times the rule gives (see the module docstring); with
    chunks > 1 (1F1B only) each rank follows ``interleaved_order`` instead of the rule, as soon as it can.

    t_forward, t_backward: one micro-batch's forward and backward through a rank's whole share of the model
    (with v chunks, each chunk takes 1/v of them). Returns one list of ``Op`` per rank, in time order.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} must be one of {KINDS}")
    p, m, v = n_stages, n_microbatches, chunks
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"n_stages={p}, n_microbatches={m} and chunks={v} must be at least 1")
    if v > 1 and kind != "1f1b":
        raise ValueError(f"interleaving (chunks={v}) is a 1F1B schedule; use kind='1f1b' or chunks=1")
    orders = [interleaved_order(p, m, v, r) for r in range(p)] if v > 1 else None
    last = p * v - 1                          # the last virtual stage
    done: dict[tuple, float] = {}             # ("F"/"B", virtual stage, micro-batch) -> end time
    busy_until, held, forwards_left = [0.0] * p, [0] * p, [m * v] * p
    ops: list[list[Op]] = [[] for _ in range(p)]
    time, tick = 0.0, min(t_forward, t_backward) / v / 4
    give_up = 4 * m * v * p * (t_forward + t_backward)

    def ready(what: str, s: int, j: int) -> bool:
        if (what, s, j) in done:
            return False
        if what == "F":
            return s == 0 or done.get(("F", s - 1, j), float("inf")) <= time + 1e-9
        after = s == last or done.get(("B", s + 1, j), float("inf")) <= time + 1e-9
        return after and done.get(("F", s, j), float("inf")) <= time + 1e-9

    while any(len(o) < 2 * m * v for o in ops):
        if time > give_up:
            raise RuntimeError(f"the {kind} schedule for p={p}, m={m}, v={v} deadlocks: no rank can go on")
        for r in range(p):
            if busy_until[r] > time + 1e-9:
                continue
            if orders is not None:     # interleaved: the rank's next operation in Megatron's order, once ready
                what, j, c = orders[r][len(ops[r])] if len(ops[r]) < len(orders[r]) else (None, 0, 0)
                choice = (what, c * p + r, j) if what and ready(what, c * p + r, j) else None
            else:
                f = [("F", r, j) for j in range(m) if ready("F", r, j)]
                b = [("B", r, j) for j in range(m) if ready("B", r, j)]
                if kind == "gpipe":     # forwards first; backwards once this rank has run every forward
                    choice = f[0] if f else (b[0] if b and forwards_left[r] == 0 else None)
                else:                   # a backward when one is ready; a forward while under the limit
                    choice = b[0] if b else (f[0] if f and held[r] < in_flight_limit(kind, p, r) else None)
            if choice is None:
                continue
            what, s, j = choice
            duration = (t_forward if what == "F" else t_backward) / v
            held[r] += 1 if what == "F" else -1
            forwards_left[r] -= what == "F"
            done[choice] = busy_until[r] = time + duration
            ops[r].append(Op(r, what, j, s // p, time, time + duration))
        time += tick
    return ops


def schedule(kind: str, n_stages: int, n_microbatches: int) -> list[list[tuple[str, int]]]:
    """The reference schedule: each rank's ordered ("F", j) / ("B", j) operations (one chunk per rank)."""
    return [[(op.kind, op.microbatch) for op in rank_ops] for rank_ops in simulate(kind, n_stages, n_microbatches)]


def idle_fraction(ops: list[list[Op]]) -> float:
    """The share of the step the ranks sit idle: 1 - busy / (ranks x step), the step from first start to last end."""
    start = min(o.start for rank_ops in ops for o in rank_ops)
    end = max(o.end for rank_ops in ops for o in rank_ops)
    busy = sum(o.end - o.start for rank_ops in ops for o in rank_ops)
    return 1.0 - busy / (len(ops) * (end - start))


def peak_held(rank_ops) -> int:
    """The most micro-batches (forward begun, backward not finished) one rank held at once, from its order.
    Anything with ``.kind`` and ``.microbatch`` in time order, or ("F"/"B", j) pairs."""
    held = peak = 0
    for op in rank_ops:
        kind = op[0] if isinstance(op, tuple) else op.kind
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


# The simulation is the reference exercises 1 and 3 are graded against, not an answer: the checks call the
# students' functions with these refusing (lablib.checks.answer_without).
REFERENCES = (simulate, schedule, idle_fraction, peak_held, in_flight_limit, interleaved_order)
REFERENCE_ONLY = ("lablib.pipeline's simulation is what this exercise is checked against, not an answer: "
                  "build the schedule (or the formula) yourself")


def draw(ax, per_rank, unit: float = 1.0, label_ops: bool = True) -> None:
    """A Gantt chart: one row per rank (rank 0 on top), forwards blue, backwards orange, each labelled with its
    micro-batch. per_rank: one list per rank of ``Op`` or [kind, micro-batch, start, end]; times x unit."""
    colors = {"F": "tab:blue", "B": "tab:orange"}
    n = len(per_rank)
    for r, rank_ops in enumerate(per_rank):
        y = n - 1 - r
        for op in rank_ops:
            kind, j, a, b = (op.kind, op.microbatch, op.start, op.end) if isinstance(op, Op) else op[:4]
            ax.broken_barh([(a * unit, (b - a) * unit)], (y + 0.1, 0.8), facecolor=colors[kind], edgecolor="white",
                           alpha=0.55 + 0.45 * (getattr(op, "chunk", 0) % 2 == 0))
            if label_ops:
                ax.text((a + b) / 2 * unit, y + 0.5, str(j), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks([n - 1 - r + 0.5 for r in range(n)], [f"rank {r}" for r in range(n)])
