"""Lab 07's probe of the students' ``ShardedOptimizer`` (ZeRO-1) and ``ZeRO2``: what their classes do on the
ranks, what each rank holds, and the graded checks of it (``lablib.runs.zero_scratch`` runs it on 2-4 ranks; the
notebook runs ``rehearse`` first: the same probe on ranks that are threads of its own process, seconds before a
torchrun start).

The references are PyTorch's, never another exercise: each rank also trains a copy of the same model with plain
``torch.optim.AdamW`` on the same gradients, in lockstep.

- ``ShardedOptimizer`` gets, on every rank, the *same* gradient (rank 0's, broadcast by the probe), so after
  each of 10 steps every parameter must equal plain AdamW's **bit for bit** (``torch.equal``) on every rank.
- ``ZeRO2`` gets each rank's own share of the batch (data parallelism). Its shards' gradients, gathered here, must
  be the mean of the ranks' gradients (all-reduced here) to within float32 rounding of a mean summed in another
  order (``rankcheck.mean_rounding_bound``, element by element); AdamW, stepped on that same gathered gradient, must
  then give every parameter bit for bit (the same numbers through the same element-wise arithmetic). Stepping the
  reference on its own all-reduced mean instead would let AdamW's division by sqrt(v) magnify the last-bit
  differences of the two sums, by up to the learning rate where a gradient is near 0: no bound from the arithmetic.

What a rank holds is counted from storages (``lablib.measure.memory.StorageCounter``: each storage once, views included
in their base): ``held_bytes`` walks everything reachable from the student's object (attributes, lists, dicts,
inner optimizers and their state, ``.grad`` of every tensor found), so a copy of the state kept anywhere counts,
whatever it is named.
"""

from __future__ import annotations

import threading
import traceback
import types
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lablib import checks
from lablib.course import data
from lablib.probes.ddp import default_group
from lablib.jobs.distenv import DistEnv
from lablib.measure.memory import StorageCounter
from lablib.measure.rankcheck import (bound_ratio, gather_objects, max_abs_diff, mean_gradient_and_abs_sum,
                                      mean_rounding_bound, weight_spread)

CLASSES = {"zero1": "ShardedOptimizer", "zero2": "ZeRO2", "zero3": "ZeRO3"}


# --- the cases --------------------------------------------------------------------------------------------------

class Stack(nn.Module):
    """d_in -> widths... -> 1, tanh between: a weight (big) and a bias (small) per layer, so assigning
    parameters round-robin by count puts the weights on some ranks and the biases on the others."""

    def __init__(self, d_in: int, widths: tuple[int, ...]):
        super().__init__()
        dims = (d_in, *widths)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(dims[-1], 1)

    def forward(self, x):                      # x: (batch, d_in) -> (batch, 1)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


@dataclass(frozen=True)
class Case:
    d_in: int
    widths: tuple[int, ...]
    groups: bool = False      # weights / biases in two groups with their own lr and weight decay
    late_head: int = -1       # >= 0: the head joins through add_param_group before this step


CASES = {
    "mlp": Case(32, (32,) * 6),                                  # 6,369 parameters: odd, padding at N = 2 and 4
    "uneven": Case(16, (200, 3, 61, 7)),                         # sizes from 1 to 3,200; 4,689: padding at N = 2 and 4
    "groups": Case(16, (48, 48, 48, 48), groups=True, late_head=3),
}
LR, WEIGHT_DECAY = 1e-2, 0.1


_SEEDED = threading.Lock()   # the rehearsal's ranks are threads sharing torch's global generator


def build(case: Case, seed: int) -> Stack:
    with _SEEDED:
        torch.manual_seed(seed)
        return Stack(case.d_in, case.widths)


def param_groups(model: Stack, case: Case) -> list[dict]:
    """The groups the optimizer is built with (the late head is left out; it is added later)."""
    body = [p for n, p in model.named_parameters() if not (case.late_head >= 0 and n.startswith("head"))]
    if not case.groups:
        return [{"params": body}]
    return [{"params": [p for p in body if p.dim() > 1]},                                   # weights: decayed
            {"params": [p for p in body if p.dim() == 1], "lr": 2 * LR, "weight_decay": 0.0}]  # biases: not


LATE_GROUP = {"lr": LR / 2, "weight_decay": 0.05}


def batch(case: Case, step: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return data.regression_task(n, case.d_in, g)    # the course's synthetic task (labs 01, 03, 06)


# --- what a rank holds ------------------------------------------------------------------------------------------

def reachable_tensors(obj, depth: int = 8):
    """Every tensor reachable from obj, as (tensor, is_a_grad): through attributes, dicts (keys and values),
    lists, tuples, sets, optimizers' state and param_groups, and the ``.grad`` of every tensor found."""
    seen: set[int] = set()
    stack = [(obj, depth, False)]
    while stack:
        x, d, is_grad = stack.pop()
        if x is None or id(x) in seen or d < 0:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            yield x, is_grad
            if x.grad is not None:
                stack.append((x.grad, d, True))
        elif isinstance(x, dict):
            stack.extend((v, d - 1, False) for kv in x.items() for v in kv)
        elif isinstance(x, (list, tuple, set, frozenset)):
            stack.extend((v, d - 1, False) for v in x)
        elif isinstance(x, (types.ModuleType, types.FunctionType, types.MethodType, type, str, bytes, int, float)):
            continue
        elif hasattr(x, "__dict__"):
            stack.extend((v, d - 1, False) for v in vars(x).values())


def held_bytes(model: nn.Module, obj, shards=()) -> dict:
    """Bytes this rank holds: the model's parameters (their storages: a flat buffer they are views of counts
    whole, padding included; a freed one, resized to 0, counts nothing) and ``shards`` (ZeRO-3's parameters at
    rest), the gradients (any ``.grad`` reachable from the model or from obj) and everything else reachable from
    obj (the optimizer state, wherever kept). Each storage once."""
    counter = StorageCounter()
    params = list(model.parameters())
    out = {"params": counter.add([*params, *shards])}
    found = list(reachable_tensors(obj))
    out["grads"] = counter.add([p.grad for p in params] + [t for t, is_grad in found if is_grad])
    out["optimizer"] = counter.add(t for t, is_grad in found if not is_grad)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def gather_shards(shard: torch.Tensor | None, world_size: int, numel: int) -> torch.Tensor:
    """Every rank's shard (S,), gathered by the probe (not by the student's code) into (N * S,) and cut to the first
    numel elements; NaN when this rank has no shard tensor (e.g. a gradient that was never set)."""
    if shard is None:
        return torch.full((numel,), float("nan"))
    shard = shard.detach().contiguous()
    out = torch.empty(world_size * shard.numel(), dtype=shard.dtype, device=shard.device)
    if world_size > 1:
        dist.all_gather_into_tensor(out, shard)
    else:
        out.copy_(shard)
    return out[:numel]


def adamw_state_bytes(params) -> int:
    """AdamW's state for these parameters: exp_avg and exp_avg_sq (fp32, their size) and a 4-byte step each."""
    return sum(8 * p.numel() + 4 for p in params)


# --- the probe --------------------------------------------------------------------------------------------------

def probe_case(impl, exercise: str, case_name: str, env, group=None, steps: int = 10, per_rank: int = 4,
               seed: int = 0, fsdp2: bool = False) -> dict:
    """Train the student's class and plain AdamW side by side on group's ranks (world size 1 in a notebook).
    Exercise 3 (``zero3``) is ``lablib.probes.zero3.probe`` (4 steps; fsdp2: FSDP2's losses too, real ranks)."""
    if exercise == "zero3":
        from lablib.probes import zero3 as zero3_probes
        return zero3_probes.probe(impl, case_name, env, group, steps=min(steps, 4), per_rank=min(per_rank, 2),
                                  seed=seed, fsdp2=fsdp2)
    case = CASES[case_name]
    world_size = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    model, reference = build(case, seed), build(case, seed)      # the same initial weights on every rank
    model.to(env.device), reference.to(env.device)
    n_params = sum(p.numel() for p in model.parameters())
    out = {"case": case_name, "world_size": world_size, "steps": steps, "error": None, "n_params": n_params,
           "param_state_bytes": [8 * p.numel() + 4 for p in model.parameters()],
           "full_state_bytes": adamw_state_bytes(model.parameters())}
    # ZeRO2 takes the whole model in one group; ShardedOptimizer gets the case's groups.
    ref_groups = param_groups(reference, case) if exercise == "zero1" else reference.parameters()
    ref_opt = torch.optim.AdamW(ref_groups, lr=LR, weight_decay=WEIGHT_DECAY)
    mismatch, diffs, spreads, grads_kept, grad_ratios, grad_diffs = [], [], [], [], [], []
    try:
        # torch 2.13 warns that reduce_scatter_tensor / all_gather_into_tensor have new names: on stderr, which
        # nbgrader counts as a failed cell; the names are right, so the warning is kept out of the grade.
        with default_group(group), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            if exercise == "zero1":
                student = getattr(impl, CLASSES[exercise])(param_groups(model, case), torch.optim.AdamW,
                                                           lr=LR, weight_decay=WEIGHT_DECAY)
                out["is_optimizer"] = isinstance(student, torch.optim.Optimizer)
            else:
                student = getattr(impl, CLASSES[exercise])(model, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
            for step in range(steps):
                if step == case.late_head and exercise == "zero1":
                    student.add_param_group({"params": list(model.head.parameters()), **LATE_GROUP})
                    ref_opt.add_param_group({"params": list(reference.head.parameters()), **LATE_GROUP})
                x, y = batch(case, step, world_size * per_rank, seed)
                if exercise == "zero2":          # data parallel: my share of the batch
                    x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
                x, y = x.to(env.device), y.to(env.device)
                student.zero_grad()
                F.mse_loss(model(x), y).backward()
                ref_opt.zero_grad()
                F.mse_loss(reference(x), y).backward()
                with torch.no_grad():                # one flat collective for all the gradients: (numel,)
                    if exercise == "zero1":          # every rank the same gradient: rank 0's
                        flat = torch.cat([p.grad.flatten() for p in model.parameters()])
                        if world_size > 1:
                            dist.broadcast(flat, src=0)
                        targets = [*model.parameters(), *reference.parameters()]
                    else:                            # zero2: the mean over ranks, and the sum of |terms| it rounds
                        flat, abs_sum = mean_gradient_and_abs_sum(list(reference.parameters()), world_size)
                        targets = []                 # the reference steps on the student's own mean (below)
                    for p, g in zip(targets, [*flat.split([t.numel() for t in model.parameters()])] * 2):
                        p.grad.copy_(g.view_as(p.grad))
                student.step()
                if exercise == "zero2":
                    with torch.no_grad():            # the student's mean gradient, gathered from the shards: (numel,)
                        mine = gather_shards(getattr(getattr(student, "shard", None), "grad", None), world_size,
                                             n_params).to(flat.device)
                        grad_ratios.append(bound_ratio(mine - flat, mean_rounding_bound(abs_sum, world_size)))
                        grad_diffs.append((mine - flat).abs().max().item())
                        for q, g in zip(reference.parameters(), mine.split([t.numel() for t in model.parameters()])):
                            q.grad.copy_(g.view_as(q.grad))
                ref_opt.step()
                grads_kept.append(sum(p.grad is not None for p in model.parameters()))
                if any(not torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters())):
                    mismatch.append(step)
                diffs.append(max_abs_diff(model, reference))
                spreads.append(weight_spread(model, env))    # on the default group: group's ranks here
            out["param_groups"] = [{"n_params": len(g["params"]), "lr": g.get("lr"),
                                    "weight_decay": g.get("weight_decay")} for g in student.param_groups] \
                if exercise == "zero1" else None
            out["reference_groups"] = [{"n_params": len(g["params"]), "lr": g["lr"], "weight_decay": g["weight_decay"]}
                                       for g in ref_opt.param_groups]
            held = held_bytes(model, student)
            out["held_per_rank"] = gather_objects(held, env, group) if world_size > 1 else [held]
        out["steps_not_bit_equal"] = mismatch
        out["max_abs_diff_vs_adamw"] = max(diffs)
        if exercise == "zero2":
            out["max_grad_diff_over_bound"] = max(grad_ratios)
            out["max_abs_grad_diff_vs_mean"] = max(grad_diffs)
        out["max_abs_weight"] = max(q.abs().max().item() for q in reference.parameters())
        out["weight_spread_across_ranks"] = max(spreads)
        out["full_grads_kept_after_step"] = max(grads_kept)
    except Exception as exc:  # noqa: BLE001 - a wrong answer is a result to report, not a crash of the run
        out["error"] = error_in_impl(exc)
    return out


def error_in_impl(exc: BaseException) -> str:
    """The exception in one line, with the line of the student's ``*_impl.py`` it came from (if any)."""
    mine = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.endswith("_impl.py")]
    where = f" (at {mine[-1].filename.rsplit('/', 1)[-1]} line {mine[-1].lineno}: {mine[-1].line})" if mine else ""
    return f"{type(exc).__name__}: {exc}{where}"


def rehearse(impl, exercise: str, runs) -> list[dict]:
    """probe_case for each "world size:case" of runs on ranks that are threads of this process
    (``lablib.probes.rehearsal``): seconds, before the real torchrun run of the same cases. Per run, rank 0's
    result, or the first rank's whose error is not only the wait for a rank that failed. Nothing (and a line
    that says so) when the class calls a collective the rehearsal does not emulate."""
    from lablib.probes.rehearsal import RehearsalUnsupported, run_in_thread_ranks

    out = []
    for n, case in (r.split(":") for r in runs):
        n = int(n)
        try:
            per_rank = run_in_thread_ranks(n, lambda rank: probe_case(
                impl, exercise, case, DistEnv(rank, rank, n, n, torch.device("cpu"), "gloo")))
        except RehearsalUnsupported as exc:
            print(f"(rehearsal skipped: {exc}; the real run checks everything)")
            return out
        if any("RehearsalUnsupported" in (r["error"] or "") for r in per_rank):
            print("(rehearsal skipped: a collective it does not emulate; the real run checks everything)")
            return out
        first = [r for r in per_rank if r["error"] and "RehearsalDeadlock" not in r["error"]]
        out.append(first[0] if first else per_rank[0])
    return out


# --- the graded checks ------------------------------------------------------------------------------------------

def check_gradient_then_update(r: dict, where: str, gradient_hint: str, update_hint: str) -> None:
    """ZeRO2's and ZeRO3's two checks of a step: the shards' gradients, gathered, against the ranks' mean gradient to
    the float32 rounding of a mean added in another order (``rankcheck.mean_rounding_bound``, element by element;
    padding exactly 0), then AdamW, stepped on that same gathered gradient, bit for bit."""
    checks.check_true(r["max_grad_diff_over_bound"] <= 1.0,
                      f"{where}: your shards' gradients (gathered) against the mean of the ranks' gradients over "
                      f"{r['steps']} steps: the largest difference ({r['max_abs_grad_diff_vs_mean']:.3g}) is "
                      f"{r['max_grad_diff_over_bound']:.3g} times what float32 rounding of a mean allows "
                      f"(2 gamma_N sum|g_r| / N per element, rankcheck.mean_rounding_bound)", hint=gradient_hint)
    checks.check_equal(r["steps_not_bit_equal"], [], f"{where}: steps after which some parameter is not bit-for-bit "
                       f"equal to AdamW's stepped on your own mean gradient (of {r['steps']}; max |diff| "
                       f"{r['max_abs_diff_vs_adamw']:.3g})", hint=update_hint)


def check_probe(r: dict, exercise: str) -> None:
    """The graded checks of one probe_case result (at any world size); each failure says what and why."""
    r = r.to_dict() if hasattr(r, "to_dict") else r      # a launch.RunResult: plain lists and dicts to compare
    if exercise == "zero3":
        from lablib.probes import zero3 as zero3_probes
        return zero3_probes.check(r)
    where = f"{CLASSES[exercise]} on {r['world_size']} rank(s), case '{r['case']}'"
    checks.check_true(r["error"] is None, f"{where}: raised {r['error']}",
                      hint="NotImplementedError: the exercise cell is still the stub (write it and run it); any other "
                           "error names the line of your file it came from")
    n = r["world_size"]
    held = r["held_per_rank"]
    if exercise == "zero1":
        checks.check_true(r["is_optimizer"], f"{where}: must be a torch.optim.Optimizer (subclass it)")
        checks.check_equal(r["param_groups"], r["reference_groups"],
                           f"{where}: param_groups (parameters per group, lr, weight decay) vs torch.optim.AdamW's",
                           hint="call super().__init__(params, defaults) and let add_param_group record every group")
        checks.check_equal(r["steps_not_bit_equal"], [], f"{where}: steps after which some parameter is not "
                           f"bit-for-bit equal to plain AdamW's on this rank (of {r['steps']})",
                           hint="after the owner's step, every parameter must reach every rank from its owner")
        state = [h["optimizer"] for h in held]
        # Each parameter's state (8 bytes per element and a 4-byte step) on exactly one rank: whole bytes, no rounding.
        checks.check_equal(sum(state), r["full_state_bytes"],
                           f"{where}: optimizer-state bytes summed over the ranks (each parameter's state on its owner "
                           f"only), per rank {state}", hint="each rank's inner optimizer gets only the parameters it owns")
        bound = r["full_state_bytes"] / n + max(r["param_state_bytes"]) + 4 * len(r["param_state_bytes"])
        checks.check_true(max(state) <= bound,
                          f"{where}: the fullest rank holds {max(state):,} bytes of state; balanced by size it "
                          f"holds at most {bound:,.0f} (the average {r['full_state_bytes'] / n:,.0f} + the "
                          f"largest parameter's); per rank {state}",
                          hint="give each parameter, largest first, to the rank that owns the fewest bytes so far")
    else:
        check_gradient_then_update(r, where, "reduce-scatter the zero-padded flat gradient, divide by N (the mean, not "
                                   "the sum), make it the shard's .grad; shard r is elements [r*S, (r+1)*S)",
                                   "step your shard only, then all-gather every rank's updated shard; padding must "
                                   "never shift a real element")
        checks.check_equal(r["weight_spread_across_ranks"], 0.0, f"{where}: parameters identical on every rank")
        checks.check_equal(r["full_grads_kept_after_step"], 0, f"{where}: model parameters that still hold a full "
                           f".grad after step()", hint="keep only your shard's gradient: set every p.grad to None")
        shard = -(-r["n_params"] // n)             # S = ceil(numel / N)
        # Storages are counted in whole bytes: no tolerance but the padding's place (in the parameters' flat buffer
        # or not: N S - numel < N elements).
        for rank, h in enumerate(held):
            checks.check_true(4 * r["n_params"] <= h["params"] <= 4 * n * shard,
                              f"{where}, rank {rank}: parameter bytes {h['params']:,} (fp32, replicated: between "
                              f"{4 * r['n_params']:,} and the padded flat buffer's {4 * n * shard:,})",
                              hint="the parameters are views of the flat buffer: no second copy")
            checks.check_equal(h["grads"], 4 * shard, f"{where}, rank {rank}: gradient bytes held after step (one "
                               f"shard of S = ceil({r['n_params']}/{n}) = {shard} fp32)",
                               hint="only this rank's shard gradient; the full flat gradient is freed after the "
                                    "reduce-scatter")
            checks.check_equal(h["optimizer"], 8 * shard + 4, f"{where}, rank {rank}: optimizer-state bytes (AdamW on "
                               f"one shard of {shard}: two moments and a 4-byte step)",
                               hint="the inner optimizer gets the shard (a view of the flat buffer), not the model")


# --- lab 04's formula, from where it lives ----------------------------------------------------------------------

LAB04 = "04_zero_memory"


def lab04_bytes_per_rank(folder=None):
    """Lab 04's ``bytes_per_rank(n_params, world_size, stage, recipe)``, the reader's own: the exercise cell
    (grade_id ``zero_bytes_per_rank``) of the lab 04 notebook beside this lab (``../04_zero_memory``), else of
    the course repository's copies (solutions/, then labs/). Returns (function, path), or (None, why) when no
    copy has it written (a stub raises NotImplementedError)."""
    import json
    from pathlib import Path

    from lablib.measure import memory

    here = Path(folder or Path.cwd()).resolve()
    repo = Path(__file__).resolve().parents[2]
    candidates = [here.parent / LAB04, repo / "solutions" / LAB04, repo / "labs" / LAB04]
    why = []
    for candidate in candidates:
        path = candidate / f"{LAB04}.ipynb"
        if not path.is_file():
            continue
        # json, not nbformat: importing nbformat (jsonschema's format checkers) costs seconds on a 2-core machine
        cells = [c for c in json.loads(path.read_text(encoding="utf-8"))["cells"]
                 if c.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "zero_bytes_per_rank"]
        namespace = {**vars(memory)}
        try:
            source = "".join(cells[0]["source"]) if isinstance(cells[0]["source"], list) else cells[0]["source"]
            exec(compile(source, str(path), "exec"), namespace)   # noqa: S102 - the reader's own cell
            namespace["bytes_per_rank"](1000, 2, 1, memory.FP32_ADAM)
        except Exception as exc:  # noqa: BLE001 - a stub or a broken cell: try the next copy
            why.append(f"{path}: {type(exc).__name__}")
            continue
        return namespace["bytes_per_rank"], str(path)
    return None, "no lab 04 notebook with bytes_per_rank written: " + ("; ".join(why) or "none found")
