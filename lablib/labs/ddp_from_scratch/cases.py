"""Lab 06's test cases: the small models ``probe`` trains under the students' DDP classes, each with
the feature it checks, their batches, and the loss the single-process reference minimises.

Every model is smooth (tanh, GELU), as ``rankcheck.sgd_rounding_bound`` requires. Three models exist to check
one rule each:

- ``ToyNet(unused_layer=True)``: a layer the forward never uses, registered last, so it sits in the *first*
  bucket (buckets follow the reverse registration order): marking it ready only at the end of the backward would
  hold back every bucket;
- ``Reordered``: the head is registered before the body, so its gradients become ready *before* the body's
  although its buckets come after them: readiness order differs from bucket order, and buckets must still be
  launched in index order (PyTorch's reducer: ``next_bucket_``, reducer.hpp:232);
- ``Routed``: even ranks use one branch, odd ranks the other: the unused parameters differ by rank, so only
  buckets launched in index order, with unused parameters marked ready at the end of the forward, keep the
  ranks' sequences of all-reduces equal. In the ``alternating`` case every rank takes branch a on even steps and
  branch b on odd ones: the unused parameters change from step to step (bookkeeping kept from an earlier step shows);
- ``ReadyInOrder(order)``: equal parameters whose gradients become final in a given order (``readiness_case``):
  inside one bucket, an order other than the bucket's (reverse registration);
- ``SeveralOutputs(kind)``: a forward that returns several tensors, a dict (``"dict"``) or a tuple whose second
  element is a list (``"tuple"``), each output from its own head: the search for unused parameters must follow
  every output, not only a tensor or the first element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lablib.course import data
from lablib.course.models import GPT, GPTConfig


class ToyNet(nn.Module):
    """d_in -> widths... -> 1 with tanh, a buffer that scales the input (it must be broadcast too), and
    optionally a frozen first layer and a layer that forward never uses."""

    def __init__(self, d_in=16, widths=(32, 24), frozen_first=False, unused_layer=False):
        super().__init__()
        self.register_buffer("input_scale", 1.0 + 0.5 * torch.randn(d_in))   # (d_in,)
        dims = (d_in, *widths)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(dims[-1], 1)
        self.unused = nn.Linear(dims[-1], 3) if unused_layer else None
        if frozen_first:
            self.layers[0].requires_grad_(False)

    def forward(self, x):                        # x: (batch, d_in) -> (batch, 1)
        x = x * self.input_scale
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


class Reordered(nn.Module):
    """The head registered first, used last: its gradients (8 and 192 bytes) are ready before the body's
    (96 and 1536 bytes), whose buckets come first in reverse registration order."""

    def __init__(self, d_in=16, width=24):
        super().__init__()
        self.register_buffer("input_scale", 1.0 + 0.5 * torch.randn(d_in))
        self.head = nn.Linear(width, 2)
        self.body = nn.Linear(d_in, width)

    def forward(self, x):                        # (batch, d_in) -> (batch, 1)
        return self.head(torch.tanh(self.body(x * self.input_scale))).sum(dim=1, keepdim=True)


class Routed(nn.Module):
    """A shared elementwise body, then branch a or branch b, chosen by the sign of the input's last feature (the
    batches set it by rank: even ranks use a, odd ranks b). Every parameter has 16 elements: buckets of equal
    size, so ranks that issue them in different orders get wrong sums (which the weights show), not a gloo
    abort on mismatched sizes."""

    def __init__(self, d_in=16):
        super().__init__()
        self.register_buffer("input_scale", 1.0 + 0.5 * torch.randn(d_in))
        self.body_scale = nn.Parameter(1.0 + 0.1 * torch.randn(d_in))
        self.body_shift = nn.Parameter(0.1 * torch.randn(d_in))
        self.branch_a = nn.Parameter(0.25 * torch.randn(d_in))
        self.branch_b = nn.Parameter(0.25 * torch.randn(d_in))

    def forward(self, x):                        # (batch, d_in) -> (batch, 1)
        h = torch.tanh(x * self.input_scale * self.body_scale + self.body_shift)
        branch = self.branch_a if x[0, -1] > 0 else self.branch_b
        return (h * branch).sum(dim=1, keepdim=True)


class ReadyInOrder(nn.Module):
    """n parameters of d_in elements each, registered w0..w(n-1), used in a chain in the reverse of ``order``: the
    last one used is the first whose gradient is final (backward walks the chain from its end), so their gradients
    become final in ``order`` (indices in registration order)."""

    def __init__(self, order, d_in=16):
        super().__init__()
        if sorted(order) != list(range(len(order))):
            raise ValueError(f"order={order} must list the parameters 0..n-1 once each")
        self.order = list(order)
        self.w = nn.ParameterList(nn.Parameter(1.0 + 0.1 * torch.randn(d_in)) for _ in order)

    def forward(self, x):                        # (batch, d_in) -> (batch, 1)
        for i in reversed(self.order):
            x = torch.tanh(x * self.w[i])
        return x.sum(dim=1, keepdim=True)


class SeveralOutputs(nn.Module):
    """A shared body, then three heads of their own parameters; the forward returns their outputs as a dict
    (``kind="dict"``: {"a": ..., "b": ..., "c": ...}) or as a tuple (``kind="tuple"``: (a, [b, c])). The loss
    sums the outputs' losses (``loss_of``)."""

    KINDS = ("dict", "tuple")

    def __init__(self, kind, d_in=16, width=24):
        super().__init__()
        if kind not in self.KINDS:
            raise ValueError(f"kind={kind!r} must be one of {self.KINDS}")
        self.kind = kind
        self.body = nn.Linear(d_in, width)
        self.head_a = nn.Linear(width, 1)
        self.head_b = nn.Linear(width, 1)
        self.head_c = nn.Linear(width, 1)

    def forward(self, x):                        # (batch, d_in) -> 3 x (batch, 1)
        h = torch.tanh(self.body(x))
        a, b, c = self.head_a(h), self.head_b(h), self.head_c(h)
        return {"a": a, "b": b, "c": c} if self.kind == "dict" else (a, [b, c])


def _tensors(output) -> list:
    """The tensors in a model's output: a tensor, or tuples, lists, dicts of them (nested)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors(o)]
    raise TypeError(f"a model output of type {type(output).__name__}: expected tensors, tuples, lists, dicts")


@dataclass(frozen=True)
class Case:
    build: object          # () -> nn.Module (called after seeding)
    tokens: bool = False   # the model takes token ids (a GPT), else (batch, 16) floats
    cap_mb: float = 0.0    # DDPBucketed's bucket_size_mb (0: the run's bucket_size_mb)
    steps: int = 0         # steps (0: the run's steps)
    routed: bool = False   # each rank's shard picks its own branch (the reference sums per-shard losses)
    alternating: bool = False   # every rank takes the same branch, a on even steps, b on odd ones
    clear: str = ""        # how the loop leaves .grad before each step (probe.CLEARS; "": the run's)


def _tiny_gpt():
    return GPT(GPTConfig(vocab_size=17, block_size=8, n_layer=1, n_head=2, n_embd=16))


CASES = {
    "mlp": Case(lambda: ToyNet()),
    "tied": Case(_tiny_gpt, tokens=True),                                 # lm_head.weight is wte.weight
    "frozen": Case(lambda: ToyNet(frozen_first=True)),
    "uneven": Case(lambda: ToyNet(d_in=16, widths=(200, 3, 60)), cap_mb=2.5e-3),  # 13.6 kB, 12 B, ... in 2.6 kB buckets
    "tiny_cap": Case(lambda: ToyNet(), cap_mb=1e-6),                      # 1 byte: every parameter alone
    "one_bucket": Case(lambda: ToyNet(), cap_mb=100.0),                   # everything in one bucket
    "unused": Case(lambda: ToyNet(unused_layer=True)),                    # a layer that gets no gradient
    "reshuffled": Case(lambda: ToyNet(widths=(40, 40)), steps=6),         # more steps, a new batch order each
    "reordered": Case(Reordered, cap_mb=1e-6),                            # ready before its bucket's turn
    "routed": Case(Routed, cap_mb=1e-6, routed=True),                     # unused parameters differ by rank
    "routed_accumulated": Case(Routed, cap_mb=1e-6, routed=True, clear="accumulated"),   # ... and .grad kept
    "routed_zeroed": Case(Routed, cap_mb=1e-6, routed=True, clear="set_to_none=False"),  # ... and .grad zeroed
    "float64": Case(lambda: ToyNet().double()),                           # another dtype (8-byte gradients)
    "alternating": Case(Routed, cap_mb=1e-6, alternating=True),           # the unused parameters change by step
    "dict_out": Case(lambda: SeveralOutputs("dict"), cap_mb=1e-6),       # outputs in a dict
    "tuple_out": Case(lambda: SeveralOutputs("tuple"), cap_mb=1e-6),     # (a, [b, c]): not all in output[0]
}


def readiness_case(order) -> Case:
    """``ReadyInOrder(order)`` in one bucket: its gradients become final in ``order`` (registration indices), not
    in the bucket's order (reverse registration)."""
    return Case(lambda: ReadyInOrder(order), cap_mb=100.0)


def global_batch(case: Case, step: int, world_size: int, per_rank: int, seed: int):
    """Step's whole batch, identical on every rank, in a new shuffled order every step."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    n = world_size * per_rank
    order = torch.randperm(n, generator=g)
    if case.tokens:
        x = torch.randint(0, 17, (n, 8), generator=g)
        return x[order], torch.roll(x, -1, dims=1)[order]
    x, y = data.regression_task(n, 16, g)      # the course's synthetic task (labs 01 and 03)
    x, y = x[order], y[order]
    if case.routed:                            # shard r's last feature: +1 on even ranks, -1 on odd ones
        x[:, -1] = torch.tensor([1.0 if (i // per_rank) % 2 == 0 else -1.0 for i in range(n)])
    if case.alternating:                       # every shard's last feature: +1 on even steps, -1 on odd ones
        x[:, -1] = 1.0 if step % 2 == 0 else -1.0
    return x, y


def loss_of(model, case: Case, x, y):
    if case.tokens:
        return model(x, y)[1]
    out = model(x.to(_dtype(model)).contiguous())
    if isinstance(out, torch.Tensor):
        return F.mse_loss(out, y.to(_dtype(model)))
    return sum(F.mse_loss(o, y.to(_dtype(model))) for o in _tensors(out))   # several outputs: their losses summed


def reference_loss(model, case: Case, x, y, world_size: int):
    """The loss whose gradient the ranks' mean gradient equals: the whole batch's mean loss, or, where each
    shard takes its own branch, the mean over the shards of their mean losses (equal shares: the same value)."""
    if not case.routed:
        return loss_of(model, case, x, y)
    b = x.shape[0] // world_size
    return sum(loss_of(model, case, x[r * b:(r + 1) * b], y[r * b:(r + 1) * b]) for r in range(world_size)) / world_size


def _dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype
