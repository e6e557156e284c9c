"""Lab 08's hidden kinds (instructor-only; the solution notebook's hidden cells call it).

- ``f_g_three_steps``: exercise 1's f and g on two ranks that are threads of the notebook's process
  (``lablib.probes.rehearsal``), three calls in a row of each through ``HiddenCheck.call`` and ``HiddenCheck.steps``:
  after every call, every output returned so far must still hold what it held (a buffer kept from call to call and
  returned again overwrites the caller's earlier result), x must be unchanged, and the backward must have given x
  its gradient (f: the sum of the ranks' upstream gradients; g: the rank's own). The rehearsal adds in rank order,
  and so does the reference here: the sums are compared bit for bit.
- ``attention_at_extremes``: exercise 3's attention at world size 1 in this process, its input scaled to extremes
  (``HiddenCheck.extremes``): the output and the input's gradient must be finite wherever the single-process
  module's are (a softmax taken as exp(s) / sum exp(s) overflows to inf / inf once the scores pass 88.7, the log of
  float32's largest number; torch's softmax subtracts the row's maximum first). Only finiteness is compared there:
  near 1e6 float32's numbers are 0.0625 apart, so one rounding moves a score by up to 0.03, which can reorder two
  near-equal scores and move the almost one-hot softmax's output by O(1): no value bound follows from the arithmetic.
"""

from __future__ import annotations

import torch

from lablib import checks
from lablib.labs.tensor_parallel import probe as tp_probes
from lablib.labs.tensor_parallel.layers import case_config, full_module
from lablib.probes import rehearsal

WORLD_SIZE = 2


def _x_and_w(rank: int, step: int):
    g = torch.Generator().manual_seed(7000 + 100 * step + rank)
    return torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)


def f_g_three_steps(hk, comm) -> bool:
    """See the module's docstring. False when f or g binds a collective by name before the rehearsal (threads cannot
    stand in for it): the kinds are then stepped aside, and the torchrun runs decide."""
    def rank_fn(rank):
        for name in ("f", "g"):
            kept = []                                  # (output, what it must still hold), every call so far

            def step(i, name=name):
                x, w = _x_and_w(rank, i)
                x.requires_grad_(True)
                # f returns a view of x by design (the identity forward): x is compared below instead
                y = hk.call(getattr(comm, name), x, None, mutable=(0,) if name == "f" else (),
                            what=f"{name}(x, group)")
                xs, ws = zip(*(_x_and_w(r, i) for r in range(WORLD_SIZE)))
                total_x, total_w = xs[0].clone(), ws[0].clone()
                for r in range(1, WORLD_SIZE):          # rank order, as the rehearsal adds
                    total_x += xs[r]
                    total_w += ws[r]
                want_y, want_grad = (xs[rank], total_w) if name == "f" else (total_x, ws[rank])
                y.backward(w)
                kept.append((y, want_y))
                return x, want_grad

            def check(i, result, name=name):
                x, want_grad = result
                checks.check_true(torch.equal(x.detach(), _x_and_w(rank, i)[0]),
                                  f"{name}(x, group), call {i + 1}: changed the caller's x in place",
                                  hint="work on a copy (x.clone()) before an in-place all-reduce")
                checks.check_true(x.grad is not None and torch.equal(x.grad, want_grad),
                                  f"{name}(x, group), call {i + 1}, rank {rank}: x's gradient is not the expected "
                                  f"{'sum over the ranks' if name == 'f' else 'upstream gradient'}")
                changed = [j + 1 for j, (y, want) in enumerate(kept) if not torch.equal(y.detach(), want)]
                checks.check_equal(changed, [], f"{name}(x, group) on {WORLD_SIZE} ranks, rank {rank}, after call "
                                   f"{i + 1}: the calls whose output no longer holds what that call returned",
                                   hint="return a new tensor on every call: a buffer kept between calls and "
                                        "returned again overwrites what the caller got from an earlier call")
            hk.steps(step, check)

    try:
        rehearsal.run_in_thread_ranks(WORLD_SIZE, rank_fn)
    except rehearsal.RehearsalUnsupported:
        hk.stepped_aside(("inputs", "aliasing", "steps"), "a torch.distributed function bound by name cannot be "
                                                          "rehearsed on thread ranks; the torchrun runs decide")
        return False
    return True


def attention_at_extremes(hk, attention_impl) -> None:
    """See the module's docstring."""
    import torch.distributed as dist

    config = case_config(1, bias=True)
    full = full_module("attention", config, seed=3)
    x = torch.randn(2, config.block_size, config.n_embd, generator=torch.Generator().manual_seed(11))
    with tp_probes.one_process():
        mine = hk.call(attention_impl.TensorParallelAttention, full, dist.group.WORLD,
                       what="TensorParallelAttention(attn, group)")
        for label, scaled in hk.extremes(x.requires_grad_(True)):
            outputs = []
            for module in (mine, full):
                xi = scaled.detach().clone().requires_grad_(True)
                y = module(xi)
                y.backward(torch.ones_like(y))
                outputs.append((y.detach(), xi.grad))
            (y, gx), (want_y, want_gx) = outputs
            for what, got, want in (("output", y, want_y), ("input's gradient", gx, want_gx)):
                bad = int((torch.isfinite(want) & ~torch.isfinite(got)).sum())
                checks.check_equal(bad, 0, f"TensorParallelAttention with its {label}: elements of the {what} that "
                                   f"are not finite where the single-process attention's are",
                                   hint="a softmax as exp(s) / sum(exp(s)) overflows for scores past 88.7: use "
                                        "torch.softmax or F.scaled_dot_product_attention (they subtract the "
                                        "row's maximum first)")


def constructors_leave_the_full_module(hk, impl, kinds=("column", "row", "mlp")) -> None:
    """Each class of exercise 2 built at world size 1 in this process through ``HiddenCheck.call``: the full module
    it copies from is unchanged afterwards, and the new module's parameters share no memory with it (a view of the
    full weight keeps all of it alive, and training the shard would write into the caller's layer)."""
    import torch.distributed as dist

    from lablib.labs.tensor_parallel.layers import CLASSES

    with tp_probes.one_process():
        for kind in kinds:
            for bias in (True, False):
                full = full_module(kind, case_config(1, bias=bias), seed=5)
                hk.call(getattr(impl, CLASSES[kind]), full, dist.group.WORLD,
                        what=f"{CLASSES[kind]}(module, group), bias={bias}")
