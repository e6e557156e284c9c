"""The checks ZeRO-2's and ZeRO-3's probes share (``lablib.labs.zero_from_scratch.zero12``, ``lablib.labs.zero_from_scratch.zero3``): the class ran,
the reference gradient and how far a correct answer's may be from it, and the two checks of a step (the shards'
gradients, then the update).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lablib import checks
from lablib.measure.rankcheck import gamma


def check_ran(r: dict, where: str, extra: str = "", hint: str | None = None) -> None:
    checks.check_true(r["error"] is None, f"{where}: raised {r['error']}{extra}",
                      hint=hint or "NotImplementedError: the exercise cell is still the stub (write it and run it); "
                                   "any other error names the line of your file it came from")


class GradientTap:
    """Each trainable parameter's gradient as the student's own model computes it, one per backward (a tensor hook
    sees the gradient before it is accumulated into ``.grad``, and before any hook of the student's). The reference
    mean is taken of these, not of a second model's: the CPU's matrix kernels choose their path by the alignment
    of a parameter's storage, so a parameter laid out at another offset of a flat buffer gets other last bits."""

    def __init__(self, params):
        self.params = list(params)
        self.handles = [p.register_hook(lambda g, i=i: self.grads[i].append(g.detach().clone()))
                        for i, p in enumerate(self.params) if p.requires_grad]
        self.reset()

    def reset(self) -> None:
        """No gradient yet; a frozen parameter's (requires_grad=False) is zero, in its dtype now."""
        self.grads = [[] if p.requires_grad else [torch.zeros_like(p, memory_format=torch.contiguous_format)]
                      for p in self.params]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def mean_gradient_and_bound(tap: GradientTap, world_size: int, micro_batches: int, dtype: torch.dtype):
    """The ranks' mean of the tapped gradients, flat (numel,), the way a data-parallel reference takes it (each
    rank's micro-batches added as autograd accumulates them, one all-reduce, then / N), and how far another correct
    computation of the same mean may be from it, per element.

    The exact mean is the sum of N m terms (N ranks, m micro-batches each) over N. Any order of adding them, and
    dividing before or after, puts each term through at most N + m - 1 roundings: m - 1 accumulations, N - 1
    additions across ranks, one division. So each computation is within gamma_{N+m-1} sum|terms| / N of the exact
    mean (Higham, Accuracy and Stability of Numerical Algorithms, section 3.1), and two of them within twice that;
    u is the dtype's unit roundoff. For m = 1 this is ``rankcheck.mean_rounding_bound``."""
    flat, abs_sum = _summed_over_ranks(tap, world_size, lambda g: g)
    unit_roundoff = torch.finfo(dtype).eps / 2
    return flat.div_(world_size), 2 * gamma(world_size + micro_batches - 1, unit_roundoff) * abs_sum / world_size


def mixed_mean_gradient_and_bound(tap: GradientTap, world_size: int, micro_batches: int, reduce_dtype: torch.dtype,
                                  master_dtype: torch.dtype):
    """Mixed precision (ZeRO3 with param_dtype / reduce_dtype): the ranks' mean of the tapped gradients, which the
    student's own model computed in param_dtype, each cast to reduce_dtype as the reduce-scatter gets it, and how far
    a correct computation of the mean may be from it, per element; flat (numel,), in float64.

    The reference adds the N m cast terms in float64, so it is within gamma_{Nm}(2^-53) sum|terms| / N of their
    exact mean. A correct ZeRO3 adds the N ranks' terms in reduce_dtype (N - 1 roundings), divides by N (one: in
    reduce_dtype, or after the cast), casts to the master's dtype (one, of unit roundoff at most reduce_dtype's
    when the master is the finer) and adds the m micro-batches' shard gradients there (m - 1): at most N + m
    roundings of unit roundoff u = reduce_dtype's (bf16 2^-8, fp16 2^-11, fp32 2^-24; a master coarser than the
    reduction is not a case here), so within gamma_{N+m}(u) sum|terms| / N of the exact mean (Higham, section 3.1).
    The bound is the sum of the two, plus one term for gradual underflow: below the smallest normal number (fp16:
    2^-14 = 6.1e-5) a rounding is no longer relative, it errs by up to half the smallest subnormal (fp16: 2^-25)
    in absolute terms (Higham, section 2.1: an addition whose result is subnormal is exact, a division is not), so
    the N + m roundings add at most (N + m) 2^-25 per element in fp16 (about 1e-45 in bf16, whose exponent is
    fp32's)."""
    flat, abs_sum = _summed_over_ranks(tap, world_size, lambda g: g.to(reduce_dtype).double())
    unit_roundoff = max(torch.finfo(reduce_dtype).eps, torch.finfo(master_dtype).eps) / 2
    terms = world_size * micro_batches
    bound = (gamma(world_size + micro_batches, unit_roundoff) + gamma(terms, torch.finfo(torch.float64).eps / 2))
    underflow = (world_size + micro_batches) * torch.finfo(reduce_dtype).smallest_normal * torch.finfo(reduce_dtype).eps / 2
    return flat.div_(world_size), bound * abs_sum / world_size + underflow


def check_gradient_then_update(r: dict, where: str, gradient_hint: str, update_hint: str) -> None:
    """ZeRO2's and ZeRO3's two checks of a step: the shards' gradients, gathered, against the ranks' mean gradient to
    the rounding of a mean added in another order (``mean_gradient_and_bound``, element by element; padding exactly
    0), then AdamW, stepped on that same gathered gradient, bit for bit."""
    checks.check_true(r["max_grad_diff_over_bound"] <= 1.0,
                      f"{where}: your shards' gradients (gathered) against the mean of the ranks' gradients over "
                      f"{r['steps']} steps: the largest difference ({r['max_abs_grad_diff_vs_mean']:.3g}) is "
                      f"{r['max_grad_diff_over_bound']:.3g} times what rounding of a mean allows "
                      f"(2 gamma_(N+m-1) sum|g| / N per element, m micro-batches per step)", hint=gradient_hint)
    checks.check_equal(r["steps_not_bit_equal"], [], f"{where}: steps after which some parameter is not bit-for-bit "
                       f"equal to AdamW's stepped on your own mean gradient (of {r['steps']}; max |diff| "
                       f"{r['max_abs_diff_vs_adamw']:.3g})", hint=update_hint)


def _summed_over_ranks(tap: GradientTap, world_size: int, term):
    """(sum of term(g), sum of |term(g)|) over every rank's tapped micro-batch gradients, flat (numel,): the
    micro-batches added in order (AccumulateGrad's in-place sum), then all-reduced over the ranks."""
    totals, abs_sums = [], []
    for grads in tap.grads:
        terms = [term(g) for g in grads]
        total, abs_sum = terms[0].clone(), terms[0].abs()
        for t in terms[1:]:
            total += t
            abs_sum += t.abs()
        totals.append(total.flatten())
        abs_sums.append(abs_sum.flatten())
    flat, abs_sum = torch.cat(totals), torch.cat(abs_sums)
    if world_size > 1:
        dist.all_reduce(flat)
        dist.all_reduce(abs_sum)
    return flat, abs_sum
