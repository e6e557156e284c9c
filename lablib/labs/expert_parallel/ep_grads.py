"""Lab 13's exercise 4 probed and graded: the gradient reduction of expert parallelism x data parallelism.

A mesh of ``dp`` x ``ep`` ranks, rank = d * ep + e: the ranks (d, 0..ep-1) are one expert-parallel group (they
share their tokens by all-to-all, and hold experts block 0..ep-1 between them); the ranks (0..dp-1, e) hold the
same experts block e and form its data-parallel group. Each rank has run ``backward`` on its own mean loss L_r.
The contract: afterwards every ``.grad`` is the gradient of the mean of all W = dp ep ranks' losses, so

    dense parameter (a copy on every rank):   g <- (1/W) sum over all W ranks of g_r
    expert parameter (a copy per dp group):   g <- (1/W) sum over its dp group of g_r

(the expert's local gradient already sums the contributions of the ep ranks whose tokens it ran; see the lab).
The probe gives each rank known gradients g_r (per rank and parameter, from one generator), calls
``reduce_moe_gradients(dense_params, expert_params, dp_group, world_group)`` and compares with the two sums above;
values, dtypes and storage: each ``.grad`` is updated where it is (the tensor an optimizer holds), parameters
unchanged, a parameter with no gradient (frozen, or unused) left alone. On real ranks the all-reduces are counted with
their groups' ranks (``lablib.measure.counting``): an expert's gradient must be reduced over its dp group only.

Visible cases (``CASES``): fp32; a frozen expert parameter (requires_grad False, grad None). A case is a dict: dtype,
``no_grad`` (None, or [kind, index, requires_grad] of the parameter whose .grad is None on every rank: frozen when
requires_grad is False, unused by the loss when it is True), an optional ``seed`` for the gradients, ``backwards``
(.grad the sum of that many draws, as after accumulation) and ``zero_on`` ([kind, index, mesh ranks]: on those ranks
that .grad is a zero tensor, as zero_grad(set_to_none=False) leaves it where no loss reached the parameter). The graded
cases beyond these (float64, an unused parameter, other seeds) are drawn by the instructor's hidden tests and handed
to the same functions as dicts (``resolve_case``); none of them is listed here. Tolerance: a sum of at most W
terms in any order, and a division: gamma_{W+1} (which holds u) times the sum of the terms' magnitudes.
"""

from __future__ import annotations

import torch

from lablib import checks
from lablib.measure import counting
from lablib.measure.rankcheck import gamma
from lablib.labs.expert_parallel.ep_dispatch import unrehearsed

UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}
CASES = {"fp32": dict(dtype="float32", no_grad=None), "frozen": dict(dtype="float32", no_grad=["expert", 1, False])}
DTYPES = {"float32": torch.float32, "float64": torch.float64}
SHAPES = {"dense": [(6, 4), (4,)], "expert": [(5, 3), (3,)]}


def resolve_case(case) -> dict:
    """A case by name (``CASES``) or a dict with ``name``, ``dtype``, ``no_grad`` and optionally ``seed``: checked."""
    if isinstance(case, str):
        if case not in CASES:
            raise ValueError(f"unknown ep_dp case {case!r}; named cases: {sorted(CASES)} (others are passed as dicts)")
        case = dict(CASES[case], name=case)
    if not isinstance(case, dict) or {"name", "dtype", "no_grad"} - set(case) or set(case) - {
            "name", "dtype", "no_grad", "seed", "zero_on", "backwards"}:
        raise ValueError(f"an ep_dp case is a name or a dict with keys name, dtype, no_grad (and seed, zero_on, "
                         f"backwards); got {case!r}")
    zero_on = case.get("zero_on")
    if zero_on is not None and not (len(zero_on) == 3 and zero_on[0] in SHAPES and
                                    zero_on[1] in range(len(SHAPES[zero_on[0]]))):
        raise ValueError(f"ep_dp case {case['name']!r}: zero_on must be None or [kind in {sorted(SHAPES)}, index, "
                         f"mesh ranks whose .grad of it is a zero tensor]")
    no_grad = case["no_grad"]
    if case["dtype"] not in DTYPES or not (no_grad is None or (
            len(no_grad) == 3 and no_grad[0] in SHAPES and no_grad[1] in range(len(SHAPES[no_grad[0]])))):
        raise ValueError(f"ep_dp case {case['name']!r}: dtype must be one of {sorted(DTYPES)}, no_grad None or "
                         f"[kind in {sorted(SHAPES)}, index, requires_grad]")
    return dict(case, seed=int(case.get("seed", 0)), no_grad=None if no_grad is None else
                [no_grad[0], int(no_grad[1]), bool(no_grad[2])], backwards=int(case.get("backwards", 1)),
                zero_on=None if zero_on is None else [zero_on[0], int(zero_on[1]), [int(r) for r in zero_on[2]]])


def parse_mesh(spec: str) -> tuple[int, int]:
    """'2x3' -> (dp 2, ep 3)."""
    dp, _, ep = spec.partition("x")
    return int(dp), int(ep)


def mesh_groups(dp: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(dp groups: ranks holding the same experts, one per e; ep groups: one per d)."""
    return ([[d * ep + e for d in range(dp)] for e in range(ep)], [[d * ep + e for e in range(ep)] for d in range(dp)])


def _grads(case: dict, rank: int, kind: str) -> list[torch.Tensor]:
    """What each parameter's .grad holds on this rank: ``backwards`` draws summed (gradients accumulated over several
    backwards), or a zero tensor where ``zero_on`` says (zero_grad(set_to_none=False), and no loss reached it here)."""
    gen = torch.Generator().manual_seed(31 * rank + (0 if kind == "dense" else 1) + 1000 * case["seed"])
    draws = [[torch.randn(shape, generator=gen) for shape in SHAPES[kind]] for _ in range(case.get("backwards", 1))]
    grads = [sum(d[i] for d in draws).to(DTYPES[case["dtype"]]) for i in range(len(SHAPES[kind]))]
    zero_on = case.get("zero_on")
    if zero_on and zero_on[0] == kind and rank in zero_on[2]:
        grads[zero_on[1]] = torch.zeros_like(grads[zero_on[1]])
    return grads


def probe(impl, case, rank: int, dp: int, ep: int, dp_group, world_group, device=None) -> dict:
    """``device``: where the parameters and gradients live (the rank's GPU under nccl)."""
    world = dp * ep
    device = device or torch.device("cpu")
    case = resolve_case(case)
    dtype, no_grad = DTYPES[case["dtype"]], case["no_grad"]
    record = {"case": case["name"], "rank": rank, "mesh": f"{dp}x{ep}", "error": None, "unrehearsed": False,
              "no_grad": no_grad}
    try:
        params = {kind: [torch.nn.Parameter(torch.full(s, float(i + 1), dtype=dtype, device=device))
                         for i, s in enumerate(SHAPES[kind])] for kind in SHAPES}
        for kind in SHAPES:
            for p, g in zip(params[kind], _grads(case, rank, kind)):
                p.grad = g.to(device)
        if no_grad:
            kind, i, trainable = no_grad
            params[kind][i].requires_grad_(trainable)
            params[kind][i].grad = None
        held = {kind: [p.grad for p in params[kind]] for kind in SHAPES}
        with counting.count_collectives() as log:
            impl.reduce_moe_gradients(params["dense"], params["expert"], dp_group, world_group)
        same_dp = [d * ep + rank % ep for d in range(dp)]
        diffs, bounds = {}, {}
        for kind, ranks in (("dense", range(world)), ("expert", same_dp)):
            terms = [_grads(case, r, kind) for r in ranks]
            for i, p in enumerate(params[kind]):
                name = f"{kind}[{i}]"
                if no_grad and (no_grad[0], no_grad[1]) == (kind, i):
                    diffs[name] = 0.0 if p.grad is None else float("inf")
                    bounds[name] = 0.0
                    continue
                stacked = torch.stack([t[i].double() for t in terms])
                want = stacked.sum(0) / world
                got = p.grad
                ok = got is not None and got.shape == want.shape and got.dtype == dtype
                diffs[name] = (got.cpu().double() - want).abs().max().item() if ok else float("inf")
                bounds[name] = gamma(world + 1, UNIT_ROUNDOFF[dtype]) * stacked.abs().sum(0).max().item() / world
                record.setdefault("in_place", []).append(got is not None and got.data_ptr() == held[kind][i].data_ptr())
        record.update(diffs=diffs, bounds=bounds,
                      params_changed=any(not torch.equal(p.detach(), torch.full_like(p, float(i + 1)))
                                         for kind in SHAPES for i, p in enumerate(params[kind])),
                      calls=[(c.name, sorted(c.ranks) if c.ranks is not None else None, c.bytes) for c in log.calls],
                      dp_ranks=same_dp, world=world)
    except Exception as exc:  # noqa: BLE001 - a wrong answer is a result to report
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["unrehearsed"] = unrehearsed(exc)
    return record


def check(record: dict, real_ranks: bool = True) -> None:
    where = f"case {record['case']!r}, mesh dp x ep = {record['mesh']}, rank {record['rank']}"
    if record["error"]:
        raise checks.CheckFailed(f"reduce_moe_gradients failed ({where}): {record['error']}")
    for name, diff in record["diffs"].items():
        hint = ("dense: summed over all W ranks, divided by W" if name.startswith("dense") else
                "expert: summed over its data-parallel group only (the ranks holding the same experts), divided by "
                "W = dp x ep (not by dp: each local gradient already sums ep ranks' tokens)")
        no_grad = record.get("no_grad")
        if no_grad and name == f"{no_grad[0]}[{no_grad[1]}]":
            hint = "a parameter whose .grad is None (frozen, or never reached by the loss) keeps grad None"
        checks.check_true(diff <= record["bounds"][name], f"{name}.grad ({where}): max difference "
                          f"{diff:.2e} from the mean loss's gradient, allowed {record['bounds'][name]:.1e}", hint)
    checks.check_true(all(record.get("in_place", [])), f"every .grad updated in place ({where})",
                      "the optimizer holds the .grad tensors: reduce into them (all_reduce works in place)")
    checks.check_true(not record["params_changed"], f"the parameters themselves unchanged ({where})")
    if real_ranks:
        for name, ranks, _ in record["calls"]:
            checks.check_true(name == "all_reduce" and ranks is not None and
                              sorted(ranks) in (record["dp_ranks"], list(range(record["world"]))),
                              f"collectives ({where}): {name} over ranks {ranks}",
                              "all_reduce over the dp group (experts) or over every rank (dense parameters)")
