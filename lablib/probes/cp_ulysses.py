"""Lab 12's graded Ulysses re-shard (exercise 4): what each rank runs and records, in thread ranks (a rehearsal)
and on torchrun ranks (``lablib.runs.context_parallel``), and the checks.

In threads, ``torch.distributed``'s functions are lablib.probes.rehearsal's fakes plus an ``all_to_all_single`` of
equal splits (every rank's input cut into N equal pieces along dim 0, piece j to rank j, received in rank order),
which logs each call's message size as lablib.measure.counting does on real ranks (S = the input's bytes).

Checked: ``seq_to_head`` moves every value to where the contract puts it, bit for bit (a re-shard only moves
values), and ``head_to_seq`` undoes it; ``ulysses_attention`` equals one process's attention on the whole sequence
within lablib.probes.cp_ring's rounding bound; exactly 4 all-to-alls of B H (T/N) D values each and no other
collective; a head count N does not divide is refused with a ValueError that names both numbers. The case
"subgroups" (threads only) cuts the world into two groups of consecutive ranks, each a Ulysses group of its own
(as under data parallelism x context parallelism): every world size, rank and all-to-all must be the group's.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from lablib import checks
from lablib.measure import counting
from lablib.probes import rehearsal
from lablib.probes.cp_ring import DTYPES, UNIT_ROUNDOFF, error_bounds, full_inputs, reference

CASES = {
    "basic": dict(B=1, H=4, T=16, D=8, causal=True, dtype="float32", logits=3.0),
    "batch": dict(B=2, H=12, T=24, D=4, causal=True, dtype="float32", logits=3.0),
    "float64": dict(B=1, H=12, T=12, D=8, causal=True, dtype="float64", logits=3.0),
    "noncausal": dict(B=1, H=12, T=12, D=8, causal=False, dtype="float32", logits=3.0),
    "subgroups": dict(B=2, H=8, T=12, D=4, causal=True, dtype="float32", logits=3.0, groups=2),
}


class ThreadGroup:
    """A sub-group of the thread ranks (consecutive global ranks): its own rendezvous, ranks numbered inside it."""

    def __init__(self, ranks, timeout_s: float):
        self.ranks = list(ranks)
        self.world = rehearsal._World(len(self.ranks), timeout_s)
        self.n = len(self.ranks)

    def rank(self) -> int:
        return self.ranks.index(rehearsal._local.rank)

    def exchange(self, what: str, value) -> list:
        """Every member's value in group-rank order (the rendezvous numbers its slots by group rank)."""
        global_rank, rehearsal._local.rank = rehearsal._local.rank, self.rank()
        try:
            return self.world.exchange(what, value)
        finally:
            rehearsal._local.rank = global_rank


def probe_ulysses(module, group, case_name: str, seed: int = 0, log=None) -> dict:
    """One rank: the re-shards and the attention of one case, and the error for a head count N does not divide."""
    case = CASES[case_name]
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    full = full_inputs(case, seed)
    ref = reference(full, case["causal"])
    t_r = case["T"] // n
    mine = slice(rank * t_r, (rank + 1) * t_r)
    q, k, v = (full[name][:, :, mine].contiguous() for name in "qkv")
    kept = [t.clone() for t in (q, k, v)]
    h_r = case["H"] // n
    record = {"case": case_name, "rank": rank, "world_size": n, "element_size": q.element_size(),
              "values": q.numel(), "groups": case.get("groups", 1)}
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
                  shape=list(out.shape), expected_shape=list(q.shape), dtype=str(out.dtype))
    if list(out.shape) == list(q.shape) and torch.isfinite(out).all():
        bound = error_bounds(full, ref, case["causal"], UNIT_ROUNDOFF[case["dtype"]], 1)["out"][:, :, mine]
        diff = (out.double() - ref["out"][:, :, mine]).abs()
        record["bound_ratio"], record["max_abs_err"] = (diff / (bound + 1e-300)).max().item(), diff.max().item()
    else:
        record["bound_ratio"], record["max_abs_err"] = float("inf"), float("inf")
    record["indivisible"] = indivisible_message(module, group, n)
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


def _all_to_all_fakes(world, log_per_rank):
    def members(group):
        """The rendezvous a collective over ``group`` meets at, and this rank's place in it."""
        if isinstance(group, ThreadGroup):
            return group, group.rank()
        return world, rehearsal._local.rank

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        if output_split_sizes or input_split_sizes:
            raise rehearsal.RehearsalUnsupported("all_to_all_single with split sizes is not rehearsed here")
        meeting, me = members(group)
        if input.numel() % meeting.n or output.numel() != input.numel():
            raise ValueError(f"all_to_all_single: input of {input.numel()} and output of {output.numel()} elements; "
                             f"both must be equal and divisible by the group's {meeting.n} ranks")
        log_per_rank[rehearsal._local.rank].append(("all_to_all", input.numel() * input.element_size()))
        values = meeting.exchange("all_to_all_single", input.detach().reshape(meeting.n, -1).clone())
        with torch.no_grad():
            output.copy_(torch.cat([v[me] for v in values]).view_as(output))
        return rehearsal._Done() if async_op else None
    return {"all_to_all_single": all_to_all_single, "get_rank": lambda group=None: members(group)[1],
            "get_world_size": lambda group=None: members(group)[0].n}


def rehearse_ulysses(module, world_size: int, cases, timeout_s: float = 20.0) -> list[list[dict]]:
    """Each case on world_size thread ranks: [case][rank] records."""
    out = []
    for case in cases:
        world = rehearsal._World(world_size, timeout_s)
        n_groups = CASES[case].get("groups", 1)
        if world_size % n_groups:
            raise ValueError(f"case {case!r} cuts the world into {n_groups} groups: world_size={world_size} must be a "
                             f"multiple of {n_groups}")
        size = world_size // n_groups
        groups = [ThreadGroup(range(g * size, (g + 1) * size), timeout_s) for g in range(n_groups)]
        logs = [[] for _ in range(world_size)]
        fakes = rehearsal._fake_functions(world)
        fakes.update(_all_to_all_fakes(world, logs))
        results, errors = [None] * world_size, [None] * world_size

        def body(rank):
            rehearsal._local.rank = rank
            try:
                group = groups[rank // size] if n_groups > 1 else None
                results[rank] = probe_ulysses(module, group, case, log=logs[rank])
            except BaseException as error:  # noqa: BLE001 - raised below
                errors[rank] = error
                for barrier in [world.barrier] + [g.world.barrier for g in groups]:
                    barrier.abort()
        with rehearsal._patched(fakes):
            threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout_s * 2)
        failed = [e for e in errors if e is not None and not isinstance(e, rehearsal.RehearsalDeadlock)] or \
            [e for e in errors if e is not None]
        if failed:
            raise failed[0]
        out.append(results)
    return out


def check_ulysses(records: list[dict]) -> None:
    for r in records:
        where = f"Ulysses, case {r['case']!r}, rank {r['rank']} of {r['world_size']}"
        if r.get("groups", 1) > 1:
            where += (f" in its group (the world cut into {r['groups']} groups of {r['world_size']} ranks, each group "
                      f"an attention of its own: everything seq_to_head, head_to_seq and ulysses_attention do is "
                      f"over the group they are given)")
        n = r["world_size"]
        msg = r["indivisible"]
        checks.check_true(bool(msg) and not msg.startswith("not a ValueError") and str(n + 1) in msg and str(n) in msg,
                          f"{where}: n_head = {n + 1} on {n} ranks must raise a ValueError naming {n + 1} and {n}; "
                          f"got {msg or 'no error'!r}", hint="check n_head % N yourself, before the all-to-all")
        checks.check_true(r["seq_to_head_exact"], f"{where}: seq_to_head did not give rank r all T positions of heads "
                          f"[r H/N, (r+1) H/N), in sequence order, bit for bit",
                          hint="cut the heads into N groups (group j for rank j) before the all-to-all; the pieces "
                               "received come in rank order = sequence order")
        checks.check_true(r["head_to_seq_exact"], f"{where}: head_to_seq(seq_to_head(x)) is not x")
        checks.check_equal(r["reshard_calls"], 2, f"{where}: collectives in seq_to_head + head_to_seq",
                           hint="one all_to_all_single each")
        names = [c[0] for c in r["calls"]]
        message = r["values"] * r["element_size"]
        checks.check_equal(names, ["all_to_all"] * 4, f"{where}: collectives in ulysses_attention",
                           hint="q, k, v to heads (3), the output back (1); nothing else")
        checks.check_equal([c[1] for c in r["calls"]], [message] * 4, f"{where}: bytes of each all-to-all",
                           hint="each message is this rank's B H (T/N) D values")
        checks.check_equal(r["shape"], r["expected_shape"], f"{where}: output shape")
        checks.check_equal(r["dtype"], str(DTYPES[CASES[r["case"]]["dtype"]]), f"{where}: output dtype")
        checks.check_true(r["bound_ratio"] <= 1.0, f"{where}: output differs from one process's attention by "
                          f"{r['max_abs_err']:.3g} ({r['bound_ratio']:.3g} x the rounding bound)",
                          hint="the causal mask is over the whole sequence once the heads are split")
        checks.check_true(r["inputs_unchanged"], f"{where}: q, k or v changed in place")
