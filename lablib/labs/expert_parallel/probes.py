"""Lab 13's probes, as the notebook reaches them: exercises 1 and 2 (the capacity rule and the load-balancing loss)
checked in this process by their properties; exercises 3 and 4 rehearsed on threads as ranks, then run for real
(``lablib.labs.expert_parallel.run``). One module per exercise's probe:

- ``lablib.labs.expert_parallel.ep_dispatch``: exercise 3, dispatch and combine with all_to_all_single vs one process;
- ``lablib.labs.expert_parallel.ep_grads``: exercise 4, the gradient reduction of expert x data parallelism on a dp x ep mesh;
- ``lablib.probes.group_rehearsal``: all_to_all_single and sub-groups on threads (shared with lab 12).

The properties checked here never hold an answer: the hidden tests compare with the instructor's references.
"""

from __future__ import annotations

import math

import torch

from lablib import checks
from lablib.jobs.exercise import load_module
from lablib.probes import group_rehearsal
from lablib.labs.expert_parallel import ep_dispatch, ep_grads

REQUIRED = {"routing": ("expert_capacity", "keep_within_capacity"), "aux_loss": ("load_balancing_loss",),
            "dispatch": ("expert_parallel_moe",), "ep_dp": ("reduce_moe_gradients",)}


def load_impl(path: str, exercise: str):
    return load_module(path, required=REQUIRED[exercise])


# --- exercise 1: capacity ---------------------------------------------------------------------------------------

def routing_cases() -> list[tuple[str, torch.Tensor, int]]:
    """The visible cases, (name, expert_index (T, k), num_experts): random k = 1 and 2 with T that E does not
    divide, an expert no token picks, every token on one expert, a single token, no token. The hidden tests draw
    their own routings when they run; no graded routing is listed here."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for name, t, e, k in (("k1", 37, 4, 1), ("k2", 29, 6, 2), ("many", 101, 8, 2)):
        cases.append((name, torch.rand(t, e, generator=gen).topk(k, dim=-1).indices, e))
    scores = torch.rand(23, 5, generator=gen)
    scores[:, 3] = -1
    cases.append(("empty expert", scores.topk(2, dim=-1).indices, 5))
    cases.append(("one expert", torch.zeros(17, 1, dtype=torch.long), 4))
    cases.append(("one token", torch.tensor([[2, 0]]), 3))
    cases.append(("no token", torch.zeros(0, 2, dtype=torch.long), 3))
    return cases


def check_keep_properties(keep, expert_index: torch.Tensor, num_experts: int, capacity: int, name: str,
                          given: torch.Tensor | None = None) -> None:
    """What any capacity rule must do: a bool (T, k) mask; no expert keeps more than capacity; an expert drops an
    assignment only when it is full (keeps min(routed, capacity)); the caller's expert_index unchanged (``given``:
    the tensor that was passed to the rule, compared with ``expert_index``, an untouched copy)."""
    if given is not None:
        checks.check_true(given.shape == expert_index.shape and torch.equal(given, expert_index),
                          f"keep_within_capacity leaves the caller's expert_index unchanged ({name})",
                          "the caller still routes with that tensor: compute the mask in new tensors, never write "
                          "into expert_index (no in-place transpose, no -1 written at the dropped assignments)")
    checks.check_true(isinstance(keep, torch.Tensor) and keep.dtype == torch.bool and keep.shape == expert_index.shape,
                      f"keep_within_capacity returns a bool tensor shaped like expert_index ({name})",
                      f"got {type(keep).__name__} {getattr(keep, 'dtype', '')} {tuple(getattr(keep, 'shape', ()))}")
    routed = torch.bincount(expert_index.flatten(), minlength=num_experts)
    kept = torch.bincount(expert_index[keep], minlength=num_experts)
    checks.check_equal(kept.tolist(), routed.clamp(max=capacity).tolist(),
                       f"assignments kept per expert ({name}, capacity {capacity})",
                       "each expert keeps min(assignments routed to it, capacity): it drops only when full")


def check_capacity_properties(capacity_fn) -> None:
    for t, e, k, c in ((64, 4, 1, 1.0), (64, 4, 2, 1.0), (10, 4, 1, 1.0), (10, 3, 2, 1.25), (1, 8, 1, 1.0)):
        got = capacity_fn(t, e, k, c)
        checks.check_true(isinstance(got, int) and not isinstance(got, bool), f"expert_capacity({t}, {e}, {k}, {c}) "
                          f"is an int", f"got {got!r} ({type(got).__name__}): a number of tokens")
        checks.check_true(got >= c * k * t / e - 1e-9 and got < c * k * t / e + 1,
                          f"expert_capacity({t}, {e}, {k}, {c}) = {got}: at least the average share times the factor "
                          f"({c * k * t / e:g}), less than one more", "k T c / E, rounded up")


# --- exercise 2: the load-balancing loss ------------------------------------------------------------------------

def check_aux_properties(loss_fn) -> None:
    """Uniform routing and probabilities give alpha (E f_i P_i = 1/E each); the loss is differentiable in the
    probabilities with d loss / d p_ti = alpha E f_i / T (f counts tokens: no gradient); the inputs unchanged."""
    e, t, alpha = 4, 8, 0.01
    probs = torch.full((t, e), 1.0 / e, requires_grad=True)
    index = torch.arange(t).remainder(e).unsqueeze(1)
    loss = loss_fn(probs, index, alpha)
    checks.check_true(isinstance(loss, torch.Tensor) and loss.dim() == 0, "the loss is a scalar tensor",
                      f"got {type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}")
    checks.check_close(float(loss.detach()), alpha, "the loss of perfectly balanced routing (f_i = P_i = 1/E)", rtol=1e-6,
                       hint="alpha * E * sum_i f_i P_i = alpha * E * E / E^2 = alpha")
    # k = 2, balanced: each token's two experts (t, t + 1) mod E, every expert 2T/E of the 2T assignments
    index2 = torch.stack([torch.arange(t), torch.arange(1, t + 1)], 1).remainder(e)
    loss2 = loss_fn(torch.full((t, e), 1.0 / e), index2, alpha)
    checks.check_close(float(loss2.detach()), alpha, "the loss of balanced top-2 routing (f_i = P_i = 1/E)", rtol=1e-6,
                       hint="for k > 1, f_i = (assignments to expert i) / (k T): sum_i f_i = 1 for every k")
    gen = torch.Generator().manual_seed(3)
    for index in (torch.tensor([0, 0, 0, 1, 0, 2, 0, 1]).unsqueeze(1),                        # k = 1
                  torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0], [0, 3], [2, 0], [0, 1], [1, 2]])):  # k = 2, distinct
        k = index.shape[1]
        logits = torch.randn(t, e, generator=gen, requires_grad=True)
        probs = logits.softmax(-1)
        probs.retain_grad()
        before, index_before = probs.detach().clone(), index.clone()
        loss = loss_fn(probs, index, alpha)
        checks.check_true(loss.requires_grad, "the loss has a gradient with respect to the router's probabilities",
                          "P_i is the mean of the probabilities: keep it in the graph")
        loss.backward()
        f = torch.bincount(index.flatten(), minlength=e).double() / (k * t)
        want = (alpha * e * f / t).expand(t, e)
        checks.check_true(torch.allclose(probs.grad.double(), want, rtol=1e-5, atol=1e-9),
                          f"d loss / d p_ti = alpha E f_i / T (k = {k})", f"got row 0 {probs.grad[0].tolist()}, want "
                          f"{want[0].tolist()}: f_i (a count of all k T assignments, divided by k T) carries no "
                          f"gradient; P_i averages every token's p_i")
        checks.check_true(torch.equal(probs.detach(), before) and torch.equal(index, index_before),
                          f"the router's probabilities and expert_index come back unchanged (k = {k})")


# --- exercises 3 and 4 on threads ------------------------------------------------------------------------------

def _layout(groups, size: int, what: str) -> list[list[int]]:
    """Groups of thread ranks, each a list in group-rank order: ``groups`` a count (blocks of ``size`` consecutive
    ranks) or the lists themselves (every thread rank once, ``size`` in each)."""
    if isinstance(groups, int):
        return [list(range(g * size, (g + 1) * size)) for g in range(groups)]
    layout = [list(g) for g in groups]
    if any(len(g) != size for g in layout) or sorted(r for g in layout for r in g) != list(range(len(layout) * size)):
        raise ValueError(f"{what}: groups {layout} must each hold {size} thread ranks, every rank "
                         f"0..{len(layout) * size - 1} once")
    return layout


def rehearse_dispatch(path, world_size: int, cases, groups=1) -> list[dict]:
    """Exercise 3 on ``world_size`` threads standing in for ranks: every rank's record (values, rows, gradients,
    and the rehearsal's all_to_all_single calls with their bytes). [] when the rehearsal cannot emulate what the
    code calls (a collective it lacks, or a torch.distributed name bound before it: ``from torch.distributed import
    all_to_all_single``); the real run then decides, as in labs 05 and 07. ``path``: the exercise file, or the module
    already loaded (the same module for several calls in a row).
    ``groups`` > 1: ``groups x world_size`` threads, each block of ``world_size`` consecutive ranks its own
    expert-parallel group of ``world_size`` ranks (as on a dp x ep mesh), every group running the same case; or the
    groups as lists of thread ranks in group-rank order (every other rank; one group in reversed order)."""
    from lablib.probes.rehearsal import RehearsalUnsupported, run_in_thread_ranks

    impl = load_impl(path, "dispatch") if isinstance(path, str) else path
    layout = _layout(groups, world_size, "rehearse_dispatch")
    where = {t: (group_rehearsal.ThreadGroup(g), i) for g in layout for i, t in enumerate(g)}
    threads = len(layout) * world_size
    records = []
    try:
        for case in cases:
            calls: list[list] = [[] for _ in range(threads)]      # per thread rank: (name, bytes)
            records += run_in_thread_ranks(
                threads, lambda r: ep_dispatch.probe(impl, case, where[r][1], world_size, where[r][0],
                                                     thread_calls=calls[r]),
                more_fakes=lambda world, local: group_rehearsal.fakes(world, local, calls))
    except RehearsalUnsupported:
        return []
    return _stepped_aside(records)


def _stepped_aside(records: list[dict]) -> list[dict]:
    """[] when any rank met something the rehearsal cannot emulate (see ``ep_dispatch.unrehearsed``), else the
    records: a correct answer the threads cannot run is never failed by them."""
    if any(r.get("unrehearsed") for r in records):
        print("(rehearsal skipped: the code calls a torch.distributed function the threads do not emulate, e.g. one "
              "bound by 'from torch.distributed import ...'; the real run checks everything)")
        return []
    return records


def rehearse_grads(path, mesh: str, cases, worlds=1) -> list[dict]:
    """Exercise 4 on dp x ep threads (``mesh`` 'DPxEP'), each with its own dp group and the world group. ``path``: the
    exercise file or the module already loaded. ``worlds``: how many meshes side by side (blocks of dp x ep
    consecutive threads, each its own world group, as two pipeline stages are), or their thread ranks as lists in
    world-rank order (every other rank); a mesh position is the rank within its world."""
    from lablib.probes.rehearsal import RehearsalUnsupported, run_in_thread_ranks

    impl = load_impl(path, "ep_dp") if isinstance(path, str) else path
    dp, ep = ep_grads.parse_mesh(mesh)
    dp_groups, _ = ep_grads.mesh_groups(dp, ep)
    layout = _layout(worlds, dp * ep, "rehearse_grads")
    where = {t: (w, i) for w in layout for i, t in enumerate(w)}

    def one_rank(t, case):
        w, i = where[t]
        return ep_grads.probe(impl, case, i, dp, ep, group_rehearsal.ThreadGroup([w[j] for j in dp_groups[i % ep]]),
                              group_rehearsal.ThreadGroup(w))
    records = []
    try:
        for case in cases:
            records += run_in_thread_ranks(len(layout) * dp * ep, lambda t: one_rank(t, case),
                                           more_fakes=group_rehearsal.fakes)
    except RehearsalUnsupported:
        return []
    return _stepped_aside(records)


def check_records(records, exercise: str, real_ranks: bool) -> None:
    check = ep_dispatch.check if exercise == "dispatch" else ep_grads.check
    # a rank that raised first: the ranks left waiting for it only report a deadlock
    for r in sorted(records, key=lambda r: "RehearsalDeadlock" in (r.get("error") or "")):
        check(r, real_ranks=real_ranks)


def capacity_factor_sweep(num_tokens: int, num_experts: int, k: int, factors, expert_index_fn, capacity_fn,
                          keep_fn) -> list[float]:
    """The dropped fraction at each capacity factor, for routing drawn by ``expert_index_fn()`` (T, k)."""
    out = []
    for c in factors:
        index = expert_index_fn()
        keep = keep_fn(index, num_experts, capacity_fn(num_tokens, num_experts, k, c))
        out.append(1.0 - keep.float().mean().item())
    return out


def balance(tokens_per_expert) -> float:
    """max over experts / mean: 1 is perfect balance; the busiest expert (its rank) sets the step time."""
    t = torch.as_tensor(tokens_per_expert, dtype=torch.float64)
    return float(t.max() / t.mean()) if t.sum() else math.nan
