"""Lab 12's graded Ulysses re-shard (exercise 4): what each rank runs and records, in thread ranks (a rehearsal)
and on torchrun ranks (``lablib.labs.context_parallel.run``), and the checks.

In threads, ``torch.distributed``'s functions are lablib.probes.rehearsal's fakes plus lablib.probes.group_rehearsal's
(shared with lab 13): ``all_to_all_single`` cuts every rank's input into N equal pieces, piece j to rank j, received
in rank order, and each rank's calls are logged with their message size as lablib.measure.counting logs them on
real ranks (S = the input's bytes).

Checked: ``seq_to_head`` moves every value to where the contract puts it, bit for bit (a re-shard only moves
values), and ``head_to_seq`` undoes it; ``ulysses_attention`` equals one process's attention on the whole sequence
within lablib.labs.context_parallel.cp_ring's rounding bound; all-to-alls only (q, k, v to heads, 3 messages of B H (T/N) D
values or 1 of them packed, then 1 back) and no other collective, a barrier included (the thread ranks log it as the
real run's counter does); a head count N does not divide is refused with a ValueError that names both numbers. A case with
"groups": 2 (threads only) cuts the world into two groups of consecutive ranks, each a Ulysses group of its own
(as under data parallelism x context parallelism), and "groups" as a list of rank lists gives groups in any order
(every other rank; one group in reversed order): every world size, rank and all-to-all must be the group's.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from lablib import checks
from lablib.measure import counting
from lablib.probes import group_rehearsal
from lablib.labs.context_parallel.cp_ring import DTYPES, UNDERFLOW, UNIT_ROUNDOFF, error_bounds, full_inputs, reference
from lablib.probes.group_rehearsal import ThreadGroup
from lablib.probes.rehearsal import run_in_thread_ranks

# The visible case; the graded ones are drawn by the instructor's hidden tests when they run and passed as dicts
# (``resolve_case``). "groups": 2 cuts the world into two Ulysses groups of consecutive ranks (thread ranks only).
CASES = {
    "basic": dict(B=1, H=4, T=16, D=8, causal=True, dtype="float32", logits=3.0),
}
CASE_KEYS = {"B", "H", "T", "D", "causal", "dtype", "logits"}


def resolve_case(case) -> dict:
    """A case by name (``CASES``) or as a dict with a ``name`` and the keys of ``CASE_KEYS``: the dict, named."""
    if isinstance(case, str):
        if case not in CASES:
            raise ValueError(f"unknown Ulysses case {case!r}; named cases: {sorted(CASES)} (others are passed as dicts)")
        return dict(CASES[case], name=case)
    missing = sorted((CASE_KEYS | {"name"}) - set(case))
    if missing or case["dtype"] not in DTYPES:
        raise ValueError(f"Ulysses case {case!r}: lacks {missing} or has a dtype not in {sorted(DTYPES)}")
    return dict(case)


def probe_ulysses(module, group, case, seed: int = 0, log=None) -> dict:
    """One rank: the re-shards and the attention of one case (a name of ``CASES`` or a dict), and the error for a
    head count N does not divide."""
    case = resolve_case(case)
    case_name = case["name"]
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    full = full_inputs(case, seed)
    ref = reference(full, case["causal"])
    t_r = case["T"] // n
    mine = slice(rank * t_r, (rank + 1) * t_r)
    q, k, v = (full[name][:, :, mine].contiguous() for name in "qkv")
    kept = [t.clone() for t in (q, k, v)]
    h_r = case["H"] // n
    record = {"case": case_name, "dtype": case["dtype"], "rank": rank, "world_size": n, "element_size": q.element_size(),
              "values": q.numel(), "groups": case.get("groups", 1),
              "group_ranks": group.ranks if isinstance(group, ThreadGroup) else None}
    with counting.count_collectives() as real_log:
        calls_before = len(log) if log is not None else 0
        heads = module.seq_to_head(q, group)
        record["seq_to_head_exact"] = (list(heads.shape) == [case["B"], h_r, case["T"], case["D"]]
                                       and torch.equal(heads, full["q"][:, rank * h_r:(rank + 1) * h_r]))
        record["head_to_seq_exact"] = torch.equal(module.head_to_seq(heads, group), q)
        reshard_calls = len(log) - calls_before if log is not None else len(real_log.calls)
        start = len(log) if log is not None else len(real_log.calls)
        out = module.ulysses_attention(q, k, v, group, case["causal"])
    calls = (log[start:] if log is not None else
             [(c.name, c.bytes) for c in real_log.calls[start:]])
    record.update(reshard_calls=reshard_calls, calls=[list(c) for c in calls],
                  inputs_unchanged=all(torch.equal(a, b) for a, b in zip((q, k, v), kept)),
                  shape=list(out.shape), expected_shape=list(q.shape), dtype_out=str(out.dtype))
    if list(out.shape) == list(q.shape) and torch.isfinite(out).all():
        bound = error_bounds(full, ref, case["causal"], UNIT_ROUNDOFF[case["dtype"]], 1,
                             UNDERFLOW[case["dtype"]])["out"][:, :, mine]
        diff = (out.double() - ref["out"][:, :, mine]).abs()
        record["bound_ratio"], record["max_abs_err"] = (diff / (bound + 1e-300)).max().item(), diff.max().item()
    else:
        record["bound_ratio"], record["max_abs_err"] = float("inf"), float("inf")
    record["indivisible"] = indivisible_message(module, group, n) if n > 1 else None   # every H divides by 1
    return record


def indivisible_message(module, group, n: int) -> str:
    """The error seq_to_head raises for n_head = N + 1 ("" if none: then the re-shard went ahead)."""
    x = torch.zeros(1, n + 1, 2 * n, 2)
    try:
        module.seq_to_head(x, group)
    except ValueError as error:
        return str(error) or "ValueError without a message"
    except Exception as error:  # noqa: BLE001 - reported: the contract asks for a ValueError of its own
        return f"not a ValueError: {type(error).__name__}: {error}"
    return ""


def rehearse_ulysses(module, world_size: int, cases, timeout_s: float = 20.0) -> list[list[dict]]:
    """Each case on world_size thread ranks: [case][rank] records. A module that bound torch.distributed's functions
    by name (``from torch.distributed import all_to_all_single``) is rehearsed the same way: those names call the
    rehearsal's fakes while it runs (``group_rehearsal.names_follow_fakes``)."""
    with group_rehearsal.names_follow_fakes(module):
        return _rehearse(module, world_size, cases, timeout_s)


def _rehearse(module, world_size: int, cases, timeout_s: float) -> list[list[dict]]:
    out = []
    for case in cases:
        case = resolve_case(case)
        group_of = _groups(case, world_size)
        logs = [[] for _ in range(world_size)]
        out.append(run_in_thread_ranks(
            world_size, lambda rank, case=case: probe_ulysses(module, group_of[rank], case, log=logs[rank]),
            timeout_s, more_fakes=functools.partial(group_rehearsal.fakes, log=logs)))
    return out


def _groups(case: dict, world_size: int) -> list:
    """Each world rank's group for a case: "groups" a count (that many groups of consecutive ranks; 1: the default
    group) or a list of groups, each a list of world ranks in group-rank order (equal sizes, every rank once)."""
    layout = case.get("groups", 1)
    if isinstance(layout, int):
        if world_size % layout:
            raise ValueError(f"case {case['name']!r} cuts the world into {layout} groups: world_size={world_size} "
                             f"must be a multiple of {layout}")
        size = world_size // layout
        layout = [list(range(g * size, (g + 1) * size)) for g in range(layout)] if layout > 1 else None
    if layout is None:
        return [None] * world_size
    if sorted(r for g in layout for r in g) != list(range(world_size)) or len({len(g) for g in layout}) != 1:
        raise ValueError(f"case {case['name']!r}: groups {layout} must hold every rank of {world_size} once, in "
                         f"groups of one size")
    return [next(ThreadGroup(g) for g in layout if rank in g) for rank in range(world_size)]


def check_ulysses(records: list[dict]) -> None:
    for r in records:
        where = f"Ulysses, case {r['case']!r}, rank {r['rank']} of {r['world_size']}"
        if r.get("group_ranks"):
            where += (f" in its group (world ranks {r['group_ranks']} in group-rank order, each group an attention of "
                      f"its own: everything seq_to_head, head_to_seq and ulysses_attention do is over the group they "
                      f"are given)")
        n = r["world_size"]
        msg = r["indivisible"]
        checks.check_true(n == 1 or bool(msg) and not msg.startswith("not a ValueError") and str(n + 1) in msg and str(n) in msg,
                          f"{where}: n_head = {n + 1} on {n} ranks must raise a ValueError naming {n + 1} and {n}; "
                          f"got {msg or 'no error'!r}", hint="check n_head % N yourself, before the all-to-all")
        checks.check_true(r["seq_to_head_exact"], f"{where}: seq_to_head did not give rank r all T positions of heads "
                          f"[r H/N, (r+1) H/N), in sequence order, bit for bit",
                          hint="cut the heads into N groups (group j for rank j) before the all-to-all; the pieces "
                               "received come in rank order = sequence order")
        checks.check_true(r["head_to_seq_exact"], f"{where}: head_to_seq(seq_to_head(x)) is not x")
        checks.check_equal(r["reshard_calls"], 2, f"{where}: collectives in seq_to_head + head_to_seq",
                           hint="one all_to_all_single each and nothing else (a barrier is a collective too, counted "
                                "on thread ranks as on processes; the all-to-all already orders the ranks)")
        names = [c[0] for c in r["calls"]]
        message = r["values"] * r["element_size"]
        sizes = [c[1] for c in r["calls"]]
        checks.check_true(set(names) <= {"all_to_all"} and 2 <= len(names) <= 4,
                          f"{where}: collectives in ulysses_attention were {names}",
                          hint="q, k, v to heads (3 all-to-alls, or 1 of q, k, v packed together), the output back (1); "
                               "nothing else (no barrier: the all-to-all already orders the ranks)")
        checks.check_true(sum(sizes) == 4 * message and sizes[-1] == message,
                          f"{where}: bytes of the all-to-alls {sizes}; expected q, k, v to heads (3 x {message} bytes, "
                          f"in 1 to 3 messages) and the output back ({message} bytes)",
                          hint="each tensor moved is this rank's B H (T/N) D values, once")
        checks.check_equal(r["shape"], r["expected_shape"], f"{where}: output shape")
        checks.check_equal(r["dtype_out"], str(DTYPES[r["dtype"]]), f"{where}: output dtype")
        checks.check_true(r["bound_ratio"] <= 1.0, f"{where}: output differs from one process's attention by "
                          f"{r['max_abs_err']:.3g} ({r['bound_ratio']:.3g} x the rounding bound)",
                          hint="the causal mask is over the whole sequence once the heads are split")
        checks.check_true(r["inputs_unchanged"], f"{where}: q, k or v changed in place")
