"""Pipeline parallelism, applied to the course GPT from outside: the stages, and a given schedule played in time.

``gpt_stages(model, n_stages)`` cuts a ``lablib.course.models.GPT`` into consecutive stages (stage 0: the
embeddings and the first blocks; the last stage: the last blocks, ``ln_f``, ``lm_head`` and the loss). GPT-2
ties ``lm_head.weight`` to ``wte.weight``; once the two sit on different ranks each stage keeps its own copy
and the two gradients must be added (Megatron-LM all-reduces them between the first and last stage; the
checks here add them up when they compare with one process).

``play(orders)`` takes a schedule someone wrote, each rank's operations ("F"/"B", micro-batch) in order, and
plays it with a timing model: every rank runs its list in order, one operation at a time, each as soon as the
rank is free and its input exists (the forward of micro-batch j on stage s needs stage s-1's forward of j;
the backward needs stage s+1's backward of j and this stage's own forward of j); a forward takes t_forward,
a backward t_backward. An order in which some rank waits for an operation that never comes is a
``Deadlock``, named rank by rank. ``idle_fraction`` and ``peak_held`` read a played (or measured) timeline.
lablib makes no GPipe or 1F1B order itself: writing them is lab 09's exercise.

With ``chunks`` (interleaving, v >= 2) rank r holds virtual stages r, r + p, ..., each 1/v of its layers
(Narayanan et al., 2021, section 2.2); ``interleaved_order`` is Megatron-LM's order for them, and played it
idles (p - 1) / (v m + p - 1) of the step, as the paper derives (the tests check it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lablib.course.models import GPT

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


# --- a given schedule, played ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Op:
    rank: int
    kind: str        # "F" or "B"
    microbatch: int
    chunk: int       # which of the rank's v model chunks (0 without interleaving)
    start: float
    end: float


class Deadlock(RuntimeError):
    """A played order in which ranks wait for operations that never come; ``waits`` says who waits for what."""

    def __init__(self, waits: list[str]):
        self.waits = waits
        super().__init__("the order deadlocks: " + "; ".join(waits))


def ops_text(rank_ops) -> str:
    """One rank's operations as text: [("F", 0), ("B", 0)] -> "F0 B0" (a chunk, if any, after a dot: "F0.1")."""
    return " ".join(f"{op[0]}{op[1]}" + (f".{op[2]}" if len(op) > 2 and op[2] else "") for op in rank_ops)


def orders_text(orders) -> str:
    """Every rank's operations as one string, ranks separated by "/": "F0 F1 B0 B1/F0 B0 F1 B1"."""
    return "/".join(ops_text(rank_ops) for rank_ops in orders)


def parse_orders(text: str) -> list[list[tuple[str, int]]]:
    """The inverse of ``orders_text``: "F0 B0/F0 B0" -> [[("F", 0), ("B", 0)], [("F", 0), ("B", 0)]]."""
    orders = []
    for rank, part in enumerate(text.split("/")):
        ops = []
        for token in part.split():
            if token[:1] not in ("F", "B") or not token[1:].isdigit():
                raise ValueError(f"rank {rank}'s operation {token!r} in {text!r}: write F<j> or B<j>, e.g. F0 B0")
            ops.append((token[0], int(token[1:])))
        orders.append(ops)
    return orders


def _op(op) -> tuple[str, int, int]:
    kind, j, *chunk = tuple(op)
    return str(kind), int(j), int(chunk[0]) if chunk else 0


def play(orders, t_forward=1.0, t_backward=2.0, chunks: int = 1, latency: float = 0.0,
         gap: float = 0.0) -> list[list[Op]]:
    """Each rank's given operations, in the given order, at the times they can run (see the module docstring).

    orders: one list per rank of ("F"/"B", micro-batch) or, with chunks > 1, ("F"/"B", micro-batch, chunk).
    t_forward, t_backward: one micro-batch's forward and backward through a rank's whole share of the model
    (with v chunks, each chunk takes 1/v of them): one number for every rank, or one per rank (stages of unequal
    cost, as measured: ``lablib.labs.pipeline_parallel.costs``). latency: from the end of an operation to the moment
    its output can be used on another rank (the message); gap: between two operations of one rank (the
    engine's own work: Python, receives posted, hooks). Returns one list of ``Op`` per rank, in time order; raises
    ``Deadlock`` when ranks wait for each other (or for an operation no rank's list has) and ``ValueError``
    for an operation that is not an F or a B, a chunk out of range, or one a rank lists twice.
    """
    p, v = len(orders), chunks
    if p < 1 or v < 1:
        raise ValueError(f"got {p} ranks' orders and chunks={v}: need at least one rank and one chunk")
    t_f, t_b = (list(t) if isinstance(t, (list, tuple)) else [float(t)] * p for t in (t_forward, t_backward))
    if len(t_f) != p or len(t_b) != p or min(t_f + t_b) < 0 or latency < 0 or gap < 0:
        raise ValueError(f"t_forward={t_forward}, t_backward={t_backward}: one time per rank ({p}) or one for all; "
                         f"they, latency={latency} and gap={gap} must be >= 0")
    lists = [[_op(op) for op in rank_ops] for rank_ops in orders]
    for r, rank_ops in enumerate(lists):
        bad = [op for op in rank_ops if op[0] not in ("F", "B") or op[1] < 0 or not 0 <= op[2] < v]
        if bad:
            raise ValueError(f"rank {r}: {bad[0]} is not ('F' or 'B', micro-batch >= 0, chunk in 0..{v - 1})")
        if len(set(rank_ops)) < len(rank_ops):
            twice = next(op for op in rank_ops if rank_ops.count(op) > 1)
            raise ValueError(f"rank {r} runs {ops_text([twice])} twice")
    last = p * v - 1                                   # the last virtual stage
    ended: dict[tuple[str, int, int], float] = {}      # ("F"/"B", virtual stage, micro-batch) -> end time
    waiting: dict[tuple[str, int, int], list[int]] = {}
    position, free_at, blocked_on = [0] * p, [0.0] * p, [None] * p
    played: list[list[Op]] = [[] for _ in range(p)]
    queue = list(range(p))
    while queue:                                       # a rank runs on until its next operation lacks an input
        r = queue.pop()
        while position[r] < len(lists[r]):
            kind, j, c = lists[r][position[r]]
            s = c * p + r
            needs = [("F", s - 1, j)] if kind == "F" and s > 0 else []
            if kind == "B":
                needs = [("F", s, j)] + ([("B", s + 1, j)] if s < last else [])
            missing = None
            for n in needs:
                if n not in ended:
                    missing = n
                    break
            if missing is not None:                    # woken again once the missing operation has ended
                if blocked_on[r] != missing:
                    blocked_on[r] = missing
                    waiting.setdefault(missing, []).append(r)
                break
            own = free_at[r] + (gap if position[r] else 0.0)
            start = max([own] + [ended[n] + (latency if n[1] % p != r else 0.0) for n in needs])
            free_at[r] = ended[(kind, s, j)] = start + (t_f[r] if kind == "F" else t_b[r]) / v
            played[r].append(Op(r, kind, j, c, start, free_at[r]))
            position[r] += 1
            queue += waiting.pop((kind, s, j), [])
    stuck = [r for r in range(p) if position[r] < len(lists[r])]
    if stuck:
        listed = {(kind, c * p + r, j) for r, rank_ops in enumerate(lists) for kind, j, c in rank_ops}
        raise Deadlock([_wait_text(r, lists[r][position[r]], blocked_on[r], p, listed) for r in stuck])
    return played


def _wait_text(r: int, op: tuple[str, int, int], missing: tuple[str, int, int], p: int, listed: set) -> str:
    """"rank 1 waits to run B0 for rank 2's B0" (a chunk after a dot: B0.1 is micro-batch 0 on chunk 1)."""
    kind, s, j = missing
    whose = "its own" if s % p == r else f"rank {s % p}'s"
    never = "" if missing in listed else " (no rank's list has it)"
    return f"rank {r} waits to run {ops_text([op])} for {whose} {ops_text([(kind, j, s // p)])}{never}"


def _timing(op) -> tuple[str, int, float, float]:
    """(kind, micro-batch, start, end) of an ``Op`` or of a measured event [kind, micro-batch, start, end]."""
    return (op.kind, op.microbatch, op.start, op.end) if isinstance(op, Op) else tuple(op[:4])


def busy_and_span(timeline) -> tuple[list[float], float]:
    """Per rank the time it computed (forwards and backwards), and the step: first start to last end. timeline:
    one list per rank of ``Op`` (played) or [kind, micro-batch, start, end] (measured by lablib.labs.pipeline_parallel.probe)."""
    ops = [[_timing(op) for op in rank_ops] for rank_ops in timeline]
    start = min(op[2] for rank_ops in ops for op in rank_ops)
    end = max(op[3] for rank_ops in ops for op in rank_ops)
    return [sum(op[3] - op[2] for op in rank_ops) for rank_ops in ops], end - start


def idle_fraction(timeline) -> float:
    """The share of the step the ranks sit idle: 1 - busy / (ranks x step); waiting for a peer counts as idle."""
    busy, step = busy_and_span(timeline)
    return 1.0 - sum(busy) / (len(busy) * step)


def peak_held(rank_ops) -> int:
    """The most micro-batches (forward begun, backward not finished) one rank held at once, along its order:
    ``Op``s or measured events in time order, or ("F"/"B", j) pairs."""
    held = peak = 0
    for op in rank_ops:
        held += 1 if (op.kind if isinstance(op, Op) else op[0]) == "F" else -1
        peak = max(peak, held)
    return peak


def interleaved_order(n_stages: int, n_microbatches: int, chunks: int, rank: int) -> list[tuple[str, int, int]]:
    """Megatron-LM's interleaved 1F1B order for one rank, v >= 2 chunks: ("F"/"B", micro-batch, chunk). Forwards
    go through the chunks in groups of p micro-batches; warm-up 2(p - rank - 1) + (v - 1)p forwards, then one
    forward one backward (Narayanan et al., 2021; megatron/core/pipeline_parallel/schedules.py). Needs m a
    multiple of p."""
    p, m, v = n_stages, n_microbatches, chunks
    if v < 2:
        raise ValueError(f"chunks={v}: interleaving needs at least 2 chunks per rank (one chunk is plain 1F1B)")
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


def draw(ax, timeline, unit: float = 1.0, label_ops: bool = True) -> None:
    """A Gantt chart: one row per rank (rank 0 on top), forwards blue, backwards orange, each labelled with its
    micro-batch. timeline: one list per rank of ``Op`` or [kind, micro-batch, start, end]; times x unit."""
    colors = {"F": "tab:blue", "B": "tab:orange"}
    n = len(timeline)
    for r, rank_ops in enumerate(timeline):
        y = n - 1 - r
        for op in rank_ops:
            kind, j, a, b = _timing(op)
            ax.broken_barh([(a * unit, (b - a) * unit)], (y + 0.1, 0.8), facecolor=colors[kind], edgecolor="white",
                           alpha=0.55 + 0.45 * (getattr(op, "chunk", 0) % 2 == 0))
            if label_ops:
                ax.text((a + b) / 2 * unit, y + 0.5, str(j), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks([n - 1 - r + 0.5 for r in range(n)], [f"rank {r}" for r in range(n)])
