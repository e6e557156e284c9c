"""Lab 13's exercise 3 probed and graded: the students' expert-parallel dispatch and combine against one process.

``expert_parallel_moe(x, expert_index, gates, local_experts, num_experts, group)`` runs on every rank of
``group`` (N ranks; rank r holds experts [r E/N, (r+1) E/N)). Every rank builds the same E experts (one seed)
and the same routing for all ranks (one generator), keeps its own tokens and experts, calls the student's
function, and back-propagates its own upstream gradient w_r. The reference is ``lablib.labs.expert_parallel.moe``'s
``combine_in_one_process`` on the full experts, in float64: rank r's output and the gradients of x_r and of
gates_r, and for each local expert the gradient of sum_r <w_r, y_r> (all ranks' tokens) and the number of rows
it ran (a forward hook counts them; the reference counts kept assignments per expert). Two steps: after the
first, every copy of the experts takes the same SGD step, and the second step is checked the same way (nothing
may be cached from the first call). The caller's x, expert_index and gates must come back unchanged.

Visible cases (``CASES``): token counts per rank that differ and that N does not divide, some assignments dropped
(``DROPPED``); an expert no token picks; every token picking expert 0 (all tokens to rank 0). The graded cases beyond
these (k > 1, float64, other token counts and seeds) are drawn by the instructor's hidden tests when they run and
handed to the same functions as dicts (``resolve_case``); none of them is listed here.
Tolerance: results within gamma_K * max|reference| (Higham's gamma_K = K u / (1 - K u), u = 2^-24 in float32,
2^-53 in float64), K the roundings along the longest chain (the expert's two matrix products, n_embd and 4 n_embd
terms; the gradient's sum over every token of the batch; the k gated terms; 8 elementwise steps): the sums may
run in any order.

Communication: the forward and the backward may call all_to_all_single only, and the message bytes of each sum to
the notebook's formula exactly (``expected_bytes``): one row per kept assignment out and one result row back (plus
the E int64 counts in the forward). Counted where the code calls the collective on real ranks
(``lablib.measure.counting``) and by the rehearsal's own all_to_all_single on threads.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from lablib import checks
from lablib.course.models import GPTConfig, MLPBlock
from lablib.labs.expert_parallel.moe import DROPPED, combine_in_one_process
from lablib.measure import counting
from lablib.measure.rankcheck import gamma

N_EMBD, EXPERTS_PER_RANK, LR = 8, 2, 0.1
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}
# The visible cases, by name: k (choices per token), dtype, routing ("random" with about one assignment in five
# dropped; "empty": expert 1 never picked; "one": every token picks expert 0; "rank_dropped": as "random", but every
# assignment of the last rank dropped, so that rank sends nothing), seed (added to the routing's seed),
# tokens (per-rank token counts, cycled over the ranks)
CASES = {"uneven": dict(k=1, dtype="float32", routing="random"), "empty": dict(k=1, dtype="float32", routing="empty"),
         "one": dict(k=1, dtype="float32", routing="one")}
CASE_KEYS = {"k", "dtype", "routing"}
ROUTINGS = ("random", "empty", "one", "rank_dropped")
OPTIONAL_KEYS = {"seed", "tokens"}
DTYPES = {"float32": torch.float32, "float64": torch.float64}
TOKENS = (5, 7, 4, 9, 6, 3)                 # differ per rank; no world size divides their sum evenly


def resolve_case(case) -> dict:
    """A case by name (``CASES``) or as a dict with a ``name``, the keys of ``CASE_KEYS`` and optionally
    ``seed`` (int) and ``tokens`` (per-rank token counts, at least 1 each): the dict, named, checked."""
    if isinstance(case, str):
        if case not in CASES:
            raise ValueError(f"unknown dispatch case {case!r}; named cases: {sorted(CASES)} (others are passed as "
                             f"dicts)")
        case = dict(CASES[case], name=case)
    if not isinstance(case, dict):
        raise ValueError(f"a dispatch case is a name or a dict, got {type(case).__name__}")
    missing, unknown = sorted((CASE_KEYS | {"name"}) - set(case)), sorted(set(case) - CASE_KEYS - OPTIONAL_KEYS - {"name"})
    if missing or unknown:
        raise ValueError(f"dispatch case {case!r}: missing keys {missing}, unknown keys {unknown}")
    if case["dtype"] not in DTYPES or case["routing"] not in ROUTINGS:
        raise ValueError(f"dispatch case {case['name']!r}: dtype must be one of {sorted(DTYPES)} and routing "
                         f"one of {ROUTINGS}")
    if not isinstance(case["k"], int) or case["k"] < 1:
        raise ValueError(f"dispatch case {case['name']!r}: k={case['k']!r} must be a positive int")
    tokens = case.get("tokens", TOKENS)
    if not tokens or not all(isinstance(t, int) and t >= 1 for t in tokens):
        raise ValueError(f"dispatch case {case['name']!r}: tokens={tokens!r} must be positive ints")
    return dict(case, seed=int(case.get("seed", 0)), tokens=list(tokens))


def tokens_on(rank: int, case: dict | None = None) -> int:
    """Rank's token count: the case's ``tokens`` (default 5, 7, 4, 9, ...), cycled over the ranks."""
    tokens = (case or {}).get("tokens", TOKENS)
    return tokens[rank % len(tokens)]


def experts_for(num_experts: int, dtype) -> nn.ModuleList:
    gen = torch.Generator().manual_seed(7)
    experts = nn.ModuleList(MLPBlock(GPTConfig(n_embd=N_EMBD, n_head=1)) for _ in range(num_experts))
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return experts.to(dtype)


def routing(case, world_size: int, num_experts: int, step: int) -> list[tuple]:
    """Every rank's (x, expert_index, gates, upstream gradient), the same on every rank that builds them."""
    case = resolve_case(case)
    k, dtype, kind = case["k"], DTYPES[case["dtype"]], case["routing"]
    if k > num_experts:
        raise ValueError(f"dispatch case {case['name']!r}: k={k} choices among {num_experts} experts")
    gen = torch.Generator().manual_seed(100 * step + world_size + 1000 * case["seed"])
    out = []
    for r in range(world_size):
        t = tokens_on(r, case)
        x, w = torch.randn(t, N_EMBD, generator=gen), torch.randn(t, N_EMBD, generator=gen)
        scores = torch.rand(t, num_experts, generator=gen)
        if kind == "empty":
            scores[:, 1] = -1.0
        if kind == "one":
            scores[:, 0] = 2.0
        index = scores.topk(k, dim=-1).indices
        if kind in ("random", "rank_dropped"):               # about one assignment in five dropped
            index = torch.where(torch.rand(t, k, generator=gen) < 0.2, torch.full_like(index, DROPPED), index)
        if kind == "rank_dropped" and r == world_size - 1:   # this rank's every assignment dropped
            index = torch.full_like(index, DROPPED)
        gates = torch.rand(t, k, generator=gen) + 0.5
        out.append((x.to(dtype), index, gates.to(dtype), w.to(dtype)))
    return out


def _row_counter(expert: nn.Module, counts: list, i: int):
    def hook(module, args):
        counts[i] += args[0].shape[0] if args[0].dim() > 1 else 1
    return expert.register_forward_pre_hook(hook)


def _diff(a, b) -> float:
    """max |a - b|; a gradient that is None counts as zeros (an expert no token reached has none)."""
    if a is None or b is None:
        other = b if a is None else a
        return 0.0 if other is None or not other.detach().abs().max().item() else float("inf")
    if a.shape != b.shape:
        return float("inf")
    return (a.detach().cpu().double() - b.detach().cpu().double()).abs().max().item() if a.numel() else 0.0


def unrehearsed(exc: BaseException) -> bool:
    """Whether an exception says the thread rehearsal cannot emulate what the code called, so the real run must
    decide: its ``RehearsalUnsupported``, or a frame in torch's own collectives. The rehearsal replaces
    ``torch.distributed``'s module attributes only, so a name bound before it (``from torch.distributed import
    all_to_all_single``, ``torch.distributed._functional_collectives.all_to_all_single_autograd``) is the real
    function, which meets the rehearsal's group object and raises (torch 2.13: ``get_backend``,
    distributed_c10d.py:1488-1492, "not initialized in the world group map"; ``_resolve_group_name``,
    _functional_collectives.py:1311, "Unsupported group type"). On real ranks the flag is never read."""
    from lablib.probes.rehearsal import RehearsalUnsupported

    if isinstance(exc, RehearsalUnsupported):
        return True
    tb = exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename.replace("\\", "/")
        if name.endswith(("torch/distributed/distributed_c10d.py", "torch/distributed/_functional_collectives.py")):
            return True
        tb = tb.tb_next
    return False


def expected_bytes(record_step: dict, num_experts: int, n_embd: int = N_EMBD) -> tuple[int, int]:
    """(forward, backward) message bytes of the notebook's formula for one rank and step: the forward sends its
    kept assignments' rows out and the rows its experts ran back, plus the E int64 counts; the backward sends
    the same rows' gradients the other way, without counts. The formula, not an answer: both sums are what the
    exercise's contract says must travel."""
    rows = record_step["kept_assignments"] + sum(record_step["wanted_rows"])
    payload = rows * n_embd * record_step["value_bytes"]
    return payload + 8 * num_experts, payload


def probe(impl, case, rank: int, world_size: int, group, steps: int = 2, device=None,
          thread_calls: list | None = None) -> dict:
    """One case on this rank: {"error", "steps": [per step: diffs, bounds, rows per local expert, wanted rows,
    collectives], ...}. The student's exceptions are recorded, not raised (the other ranks then stop waiting).
    ``device``: where the rank's tensors and experts live (its GPU under nccl, which has no CPU tensors); the
    float64 reference stays on the CPU. ``thread_calls``: on thread ranks, this rank's list that the rehearsal's
    collectives append (name, bytes) to (``group_rehearsal.fakes(..., log)``); on real ranks None, and
    ``lablib.measure.counting`` counts them where the code calls them."""
    case = resolve_case(case)
    k, dtype = case["k"], DTYPES[case["dtype"]]
    num_experts = EXPERTS_PER_RANK * world_size
    if k > num_experts:                                  # the case's own error, raised before the student's code runs
        raise ValueError(f"dispatch case {case['name']!r}: k={k} choices among {num_experts} experts "
                         f"({EXPERTS_PER_RANK} per rank on {world_size} ranks)")
    mine = range(rank * EXPERTS_PER_RANK, (rank + 1) * EXPERTS_PER_RANK)
    reference = experts_for(num_experts, torch.float64)
    local = nn.ModuleList(copy.deepcopy(experts_for(num_experts, dtype)[e]) for e in mine).to(device or "cpu")
    u = UNIT_ROUNDOFF[dtype]
    total_tokens = sum(tokens_on(r, case) for r in range(world_size))
    rounding = gamma(N_EMBD + 4 * N_EMBD + total_tokens + k + 8, u)
    record = {"case": case["name"], "rank": rank, "world_size": world_size, "num_experts": num_experts, "error": None,
              "unrehearsed": False, "thread_counted": thread_calls is not None, "steps": []}
    log = counting.CollectiveLog()
    try:
        for step in range(steps):
            data = routing(case, world_size, num_experts, step)
            x, index, gates, w = (t.to(device or "cpu") for t in data[rank])
            x_in, gates_in = x.clone().requires_grad_(), gates.clone().requires_grad_()
            index_in, kept = index.clone(), (x.clone(), index.clone(), gates.clone())
            rows = [0] * len(local)
            hooks = [_row_counter(expert, rows, i) for i, expert in enumerate(local)]
            calls = thread_calls if thread_calls is not None else []
            with counting.count_collectives(log):
                log.reset()
                start = len(calls)
                y = impl.expert_parallel_moe(x_in, index_in, gates_in, local, num_experts, group)
                forward = [(c.name, c.bytes) for c in log.calls] + list(calls[start:])
                log.reset()
                start = len(calls)
                (y * w).sum().backward()
                backward = [(c.name, c.bytes) for c in log.calls] + list(calls[start:])
            for h in hooks:
                h.remove()
            # the reference: every rank's tokens through the float64 experts, this rank's output and gradients
            reference.zero_grad()
            ref_x = x.detach().cpu().double().requires_grad_()
            ref_gates = gates.detach().cpu().double().requires_grad_()
            ref_y = None
            for r, (xr, ir, gr, wr) in enumerate(data):
                if r == rank:
                    ref_y = combine_in_one_process(ref_x, ir, ref_gates, reference)
                    loss = (ref_y * wr.double()).sum()
                else:
                    loss = (combine_in_one_process(xr.double(), ir, gr.double(), reference) * wr.double()).sum()
                if loss.requires_grad:      # a rank whose every assignment was dropped reaches no expert: no graph
                    loss.backward()
            wanted_rows = [sum(int((d[1] == e).sum()) for d in data) for e in mine]      # data: on the CPU
            scale = max(ref_y.abs().max().item() if ref_y.numel() else 0.0, 1.0)
            grads = {f"expert {e} {name}": (p.grad, dict(reference[e].named_parameters())[name].grad)
                     for e, expert in zip(mine, local) for name, p in expert.named_parameters()}
            grad_scale = max([1.0] + [g.abs().max().item() for _, g in grads.values() if g is not None])

            def bound_of(reference_grad):     # each gradient against its own size (at least 1)
                return rounding * max([1.0] + ([reference_grad.abs().max().item()]
                                               if reference_grad is not None and reference_grad.numel() else []))
            record["steps"].append({
                "output": _diff(y, ref_y), "output_bound": rounding * scale,
                "dtype": str(y.dtype), "want_dtype": str(dtype), "shape": list(y.shape), "want_shape": list(x.shape),
                "x_grad": _diff(x_in.grad, ref_x.grad), "gates_grad": _diff(gates_in.grad, ref_gates.grad),
                "expert_grads": {name: _diff(got, want) for name, (got, want) in grads.items()},
                "expert_grads_none": sorted({name.rsplit(" ", 1)[0] for name, (got, _) in grads.items() if got is None}),
                "grad_bound": rounding * grad_scale,
                "x_grad_bound": bound_of(ref_x.grad), "gates_grad_bound": bound_of(ref_gates.grad),
                "rows": rows, "wanted_rows": wanted_rows,
                "inputs_changed": [name for name, a, b in (("x", x_in, kept[0]), ("expert_index", index_in, kept[1]),
                                                           ("gates", gates_in, kept[2]))
                                   if not torch.equal(a.detach(), b)],
                "forward": forward, "backward": backward,
                "token_bytes": k * x.shape[0] * N_EMBD * x.element_size(),
                "kept_assignments": int((index != DROPPED).sum()), "value_bytes": x.element_size()})
            with torch.no_grad():                              # the same SGD step on every copy of the experts
                for p in local.parameters():
                    p.grad = None
                for p in reference.parameters():
                    if p.grad is not None:
                        p -= LR * p.grad
                for e, expert in zip(mine, local):             # same values as the reference: no drift between steps
                    for p, q in zip(expert.parameters(), reference[e].parameters()):
                        p.copy_(q)
    except Exception as exc:  # noqa: BLE001 - a wrong answer is a result to report
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["unrehearsed"] = unrehearsed(exc)
    return record


def check(record: dict, real_ranks: bool = True) -> None:
    """The verdict on one rank's record. The collectives' names and bytes are checked where they were counted: on
    real ranks (``real_ranks``), and on thread ranks whose probe was given ``thread_calls``."""
    where = f"case {record['case']!r}, rank {record['rank']} of {record['world_size']}"
    if record["error"]:
        raise checks.CheckFailed(f"expert_parallel_moe failed ({where}): {record['error']}")
    for step, s in enumerate(record["steps"], 1):
        at = f"{where}, step {step}"
        checks.check_equal((s["dtype"], s["shape"]), (s["want_dtype"], s["want_shape"]),
                           f"output dtype and shape ({at})", "y has x's dtype and shape: one row per token, in x's order")
        checks.check_true(not s["inputs_changed"], f"the caller's inputs come back unchanged ({at})",
                          f"changed: {s['inputs_changed']}; sort or scatter into new tensors, never in place")
        checks.check_equal(s["rows"], s["wanted_rows"], f"rows each local expert ran ({at})",
                           "each expert runs exactly the kept assignments routed to it, from every rank (none dropped "
                           "twice, none sent to the wrong rank: expert e lives on rank e // experts_per_rank)")
        checks.check_true(s["output"] <= s["output_bound"],
                          f"output equals one process's MoE ({at}): max |y - y_single| = {s['output']:.2e}, "
                          f"allowed {s['output_bound']:.1e}",
                          "y[t] = sum_j gates[t, j] * expert(x[t]) for the kept assignments, in the ORIGINAL token "
                          "order (undo the sort by expert when the results come back)")
        for name in ("x_grad", "gates_grad"):
            bound = s.get(f"{name}_bound", s["grad_bound"])
            checks.check_true(s[name] <= bound, f"{name.replace('_', ' ')} equals one process's ({at}): max "
                              f"difference {s[name]:.2e}, allowed {bound:.1e}",
                              "the gradient flows back through both all_to_all_single calls: each needs a backward "
                              "that sends the gradient back with the splits swapped")
        checks.check_true(not s.get("expert_grads_none"), f"every local expert has a gradient after the backward "
                          f"({at}): {s.get('expert_grads_none')} have None",
                          "a rank runs each of its experts, on zero rows when no token reached it: its gradient is then "
                          "zeros, not None, and exercise 4's reduction sees the same tensors on every rank")
        worst = max(s["expert_grads"].items(), key=lambda kv: kv[1])
        checks.check_true(worst[1] <= s["grad_bound"], f"local experts' gradients equal one process's ({at}): "
                          f"{worst[0]} off by {worst[1]:.2e}, allowed {s['grad_bound']:.1e}",
                          "an expert's gradient sums the contributions of the tokens of every rank")
        if not (real_ranks or record.get("thread_counted")):
            continue
        forward_bytes, backward_bytes = expected_bytes(s, record["num_experts"])
        for phase, want in (("forward", forward_bytes), ("backward", backward_bytes)):
            names = sorted({name for name, _ in s[phase]})
            checks.check_true(names == ["all_to_all"], f"the {phase} communicates with all_to_all_single only ({at}): "
                              f"called {names}", "counts first, then the tokens, then the results back; the backward "
                              "is the same exchanges reversed (an autograd Function around all_to_all_single)")
            sent = sum(b for _, b in s[phase])
            checks.check_equal(sent, want, f"bytes the {phase} sends ({at}), message sizes summed over its "
                               f"all_to_all_single calls", "the formula of section 4: (kept assignments sent + rows "
                               "your experts ran) x h x b" + (" + 8 E for the int64 counts" if phase == "forward"
                                                              else ", no counts") +
                               ": one row per kept assignment out, one result row back, nothing else (not the whole "
                               "batch, not the dropped assignments, not dense (T, k, h) results)")
