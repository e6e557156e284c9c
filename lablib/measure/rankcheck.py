"""Checks that data-parallel ranks really did what data parallelism promises, from a real run:

- every rank trained on its own samples (``RecordingDataset`` remembers the indices a process loaded;
  ``shard_report`` compares the ranks' lists once gathered);
- every rank ends with the same weights (``weight_spread``: 0.0 when they are bit-identical);
- a parallel run ends where a single-process reference does (``max_abs_diff`` of two models' weights).

They read what happened; they do not know how the sampler or the wrapper was written. How close "ends where" must
be is derived, never picked: ``gamma`` (n roundings), ``formula_rtol`` (two evaluations of one formula),
``mean_rounding_bound`` (one mean, summed in two orders) and ``sgd_rounding_bound`` (two SGD runs whose sums differ
in order) give the course's tolerances from the arithmetic.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from lablib.measure.memory import local_tensor


class RecordingDataset(Dataset):
    """Wraps a map-style dataset and records, in this process, every index loaded from it."""

    def __init__(self, base: Dataset):
        self.base, self.seen = base, []

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i):
        self.seen.append(int(i))
        return self.base[i]


def shard_report(seen_per_rank: list[list[int]]) -> dict:
    """How many samples each rank loaded, how many distinct, and how many were loaded by two ranks."""
    sets = [set(s) for s in seen_per_rank]
    overlap = sum(len(a & b) for i, a in enumerate(sets) for b in sets[i + 1:])
    return {"samples_per_rank": [len(s) for s in seen_per_rank], "distinct_per_rank": [len(s) for s in sets],
            "overlapping_samples": overlap}


def samples_per_step(seen_per_rank: list[list[int]], steps: int, per_rank: int) -> list[list[int]]:
    """The samples of each optimizer step, all ranks together (sorted): rank r's indices in the order it loaded
    them, ``per_rank`` of them per step. Only the first steps * per_rank count (a loader may read ahead)."""
    return [sorted(i for seen in seen_per_rank for i in seen[step * per_rank:(step + 1) * per_rank])
            for step in range(steps)]


def weight_spread(model: torch.nn.Module, env) -> float:
    """max over parameters of (max over ranks - min over ranks); 0.0 when every rank holds the same weights."""
    flat = torch.cat([local_tensor(p).detach().float().flatten() for p in model.parameters()])
    hi, lo = flat.clone(), flat.clone()
    if dist.is_initialized():
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return (hi - lo).max().item()


def max_abs_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """Largest |weight of a - weight of b| over all parameters (two models of the same architecture)."""
    return max((p.detach() - q.detach()).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


FP32_UNIT_ROUNDOFF = 2.0 ** -24   # u: a float32 addition or product rounds with relative error at most u
FP64_UNIT_ROUNDOFF = 2.0 ** -53   # the same for float64 (Python's float, NumPy's default)


def gamma(n: int, unit_roundoff: float = FP32_UNIT_ROUNDOFF) -> float:
    """gamma_n = n u / (1 - n u): n roundings, each a factor (1 + d) with |d| <= u, multiply a result by at most
    1 + gamma_n and at least 1 - gamma_n (Higham, Accuracy and Stability of Numerical Algorithms, Lemma 3.1)."""
    n_u = n * unit_roundoff
    if n_u >= 1:
        raise ValueError(f"n={n} roundings are too many for unit roundoff {unit_roundoff}: n u >= 1")
    return n_u / (1 - n_u)


def formula_rtol(roundings: int, condition: float = 1.0, unit_roundoff: float = FP64_UNIT_ROUNDOFF) -> float:
    """Relative tolerance between two floating-point evaluations of one real formula from the same inputs (a graded
    answer and the check's value), which may order and group the operations differently.

    ``roundings``: how many roundings can reach the result in either evaluation (each operation adds one, the
    factors of a product or quotient add their counts, a sum of positive terms keeps its largest; a decimal
    literal such as 0.045 counts one, its conversion to binary), Higham's theta_n counting (Lemma 3.3).
    ``condition``: how much the formula can magnify one relative rounding error of an intermediate: 1 when no
    subtraction cancels (sums of positive terms, products, quotients), ``|a| / |a - b|`` for a difference of
    computed numbers. Each evaluation is then within c gamma_n of the exact value, so the two are within
    2 c gamma_n / (1 - c gamma_n) of each other.
    """
    cg = condition * gamma(roundings, unit_roundoff)
    if cg >= 1:
        raise ValueError(f"condition {condition} x gamma_{roundings} = {cg} >= 1: no relative bound")
    return 2 * cg / (1 - cg)


def mean_rounding_bound(abs_sum, n: int, unit_roundoff: float = FP32_UNIT_ROUNDOFF):
    """How far apart two float computations of the mean of the same n terms can end when they add them in another
    order (a reduce-scatter's against an all-reduce's, or dividing each term before the sum instead of after):
    each takes n roundings on the way (n - 1 additions and a division by n), so each is within
    gamma_n * sum|terms| / n of the exact mean (Higham, section 3.1), and the two within twice that.
    ``abs_sum``: the sum of the terms' absolute values, a number or a tensor (then element by element).
    """
    return 2 * gamma(n, unit_roundoff) * abs_sum / n


def mean_gradient_and_abs_sum(params, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ranks' mean of ``params``' gradients, flat (numel,), and the sum over ranks of their absolute values
    (what ``mean_rounding_bound`` needs): one all-reduce each, the way a data-parallel reference takes its mean."""
    flat = torch.cat([p.grad.flatten() for p in params])
    abs_sum = flat.abs()
    if world_size > 1:
        dist.all_reduce(flat)
        dist.all_reduce(abs_sum)
    return flat.div_(world_size), abs_sum


def bound_ratio(diff: torch.Tensor, bound: torch.Tensor) -> float:
    """max over elements of |diff| / bound: at most 1.0 when every element is within its own bound (an element whose
    bound is 0 must differ by exactly 0, else the ratio is inf)."""
    diff, bound = diff.abs().double(), bound.double()
    ratio = torch.where(diff == 0, torch.zeros_like(diff), diff / bound)
    return ratio.max().item() if ratio.numel() else 0.0


def sgd_rounding_bound(steps: int, lr: float, longest_sum: int, max_grad: float, max_weight: float,
                       unit_roundoff: float = FP32_UNIT_ROUNDOFF) -> float:
    """How far two SGD runs of the same model, data and initial weights end apart, as an estimate, when they differ
    only in the order of their floating-point sums (DDP's per-rank partial sums against one process's single sum).

    Per step, two sources, added over the steps:
    - the gradient: each element is a sum of at most ``longest_sum`` rounded terms t_i; each order of the sum lands
      within gamma_n * sum|t_i| of the exact value, gamma_n = n u / (1 - n u) (Higham, Accuracy and Stability of
      Numerical Algorithms, section 3.1; section 4.2 gives gamma_(n-1) for recursive summation), so two orders
      differ by up to 2 gamma_n sum|t_i|. This function uses gamma_n * ``max_grad`` in place of that: an estimate,
      not a bound (the largest gradient element stands for sum|t_i|, which is larger wherever terms of both signs
      cancel; lab 01 says so next to its figure). The update multiplies it by ``lr``;
    - the update w - lr g is rounded to float32 in each run: at most u |w| each, so 2 u max|w| between them.
    The bound adds the steps' contributions without amplifying them. That holds when the gradient is a smooth
    (Lipschitz) function of the weights and lr times the curvature is small: an early difference is then
    carried, not multiplied. It does not hold across a kink such as ReLU's at 0, where a rounding-sized
    difference can switch one sample's pre-activation to the other side and change the gradient by that
    sample's whole contribution.
    """
    return steps * (lr * gamma(longest_sum, unit_roundoff) * max_grad + 2 * unit_roundoff * max_weight)
