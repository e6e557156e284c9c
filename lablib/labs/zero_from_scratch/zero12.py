"""Lab 07's probe of the students' ``ShardedOptimizer`` (ZeRO-1) and ``ZeRO2``: what their classes do on the
ranks, what each rank holds, the collectives they call, and the graded checks of it (``lablib.labs.zero_from_scratch.run_zero_scratch``
runs it on 2-4 ranks; the notebook runs ``rehearse`` first: the same probe on ranks that are threads of its own
process, seconds before a torchrun start). Exercise 3 has its own probe, ``lablib.labs.zero_from_scratch.zero3``.

The references are PyTorch's, never another exercise: each rank also trains a copy of the same model with plain
``torch.optim.AdamW`` on the same gradients, in lockstep.

- ``ShardedOptimizer`` gets, on every rank, the *same* gradient (rank 0's, broadcast by the probe), so after
  each of 10 steps every parameter must equal plain AdamW's **bit for bit** (``torch.equal``) on every rank. Before
  each step the probe changes every group's lr (``cases.lr_factor``), as a schedule would.
- ``ZeRO2`` gets each rank's own share of the batch (data parallelism). Its shards' gradients, gathered here, must
  be the mean of the ranks' gradients (as its model computed them, ``step_checks.GradientTap``; all-reduced here) to within float32 rounding of a mean summed in another
  order (``rankcheck.mean_rounding_bound``, element by element); AdamW, stepped on that same gathered gradient, must
  then give every parameter bit for bit (the same numbers through the same element-wise arithmetic). Stepping the
  reference on its own all-reduced mean instead would let AdamW's division by sqrt(v) magnify the last-bit
  differences of the two sums, by up to the learning rate where a gradient is near 0: no bound from the arithmetic.
  Its collectives are recorded where it calls them (``comm``): one reduce-scatter of the padded flat gradient
  and one all-gather of the padded flat parameters per step, nothing else.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lablib import checks
from lablib.measure.collective_log import CollectiveLog
from lablib.measure.rankcheck import bound_ratio, max_abs_diff, weight_spread
from lablib.jobs.distenv import gather_objects
from lablib.probes.harness import default_group
from lablib.labs.zero_from_scratch.cases import (CASES, CLASSES, LATE_GROUP, LR, WEIGHT_DECAY, batch, build, dtype_of,
                                      error_in_impl, lr_factor, micro_batches, param_groups)
from lablib.labs.zero_from_scratch.step_checks import GradientTap, check_gradient_then_update, check_ran, mean_gradient_and_bound
from lablib.labs.zero_from_scratch.comm import bytes_by_kind, check_bus_ratio, check_collectives, recording, rehearse_with
from lablib.labs.zero_from_scratch.held import adamw_state_bytes, gather_shards, held_bytes


def probe_case(impl, exercise: str, case_name: str, env, group=None, steps: int = 10, per_rank: int = 4,
               seed: int = 0) -> dict:
    """Train the student's class and plain AdamW side by side on group's ranks (world size 1 in a notebook)."""
    case = CASES[case_name]
    steps = min(steps, case.steps)
    world_size = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    model, reference = build(case, seed), build(case, seed)      # the same initial weights on every rank
    model.to(env.device), reference.to(env.device)
    trained = [p for p in model.parameters() if p.requires_grad]
    ref_trained = [q for q in reference.parameters() if q.requires_grad]
    n_params = sum(p.numel() for p in trained)
    elem = trained[0].element_size()
    out = {"case": case_name, "world_size": world_size, "steps": steps, "error": None, "n_params": n_params,
           "element_size": elem, "frozen_bytes": sum(p.numel() * p.element_size() for p in model.parameters()
                                                     if not p.requires_grad),
           "param_state_bytes": [2 * p.numel() * elem + 4 for p in trained],
           "full_state_bytes": adamw_state_bytes(trained), "collectives_per_step": []}
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
            base_lrs, tap = None, GradientTap(trained)
            for step in range(steps):
                if step == case.late_head and exercise == "zero1":
                    student.add_param_group({"params": list(model.head.parameters()), **LATE_GROUP})
                    ref_opt.add_param_group({"params": list(reference.head.parameters()), **LATE_GROUP})
                    base_lrs = None
                if exercise == "zero1":          # a schedule: every outer group's lr changes before each step
                    base_lrs = base_lrs or [g["lr"] for g in ref_opt.param_groups]
                    for opt in (student, ref_opt):
                        for g, lr in zip(opt.param_groups, base_lrs):
                            g["lr"] = lr * lr_factor(step)
                x, y = batch(case, step, world_size * per_rank, seed)
                if exercise == "zero2":          # data parallel: my share of the batch
                    x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
                x, y = x.to(env.device), y.to(env.device)
                log = CollectiveLog()
                with recording(log):
                    student.zero_grad()
                ref_opt.zero_grad()
                tap.reset()
                for mx, my in micro_batches(x, y, case):     # one backward per micro-batch, then one step
                    F.mse_loss(model(mx), my).backward()
                with torch.no_grad():                # one flat collective for all the gradients: (numel,)
                    if exercise == "zero1":          # every rank the same gradient: rank 0's
                        flat = torch.cat([p.grad.flatten() for p in trained])
                        if world_size > 1:
                            dist.broadcast(flat, src=0)
                        for p, q, g in zip(trained, ref_trained, flat.split([t.numel() for t in trained])):
                            p.grad.copy_(g.view_as(p.grad))
                            q.grad = g.view_as(q).clone()
                    else:                            # zero2: the mean over ranks and what its rounding may be
                        flat, bound = mean_gradient_and_bound(tap, world_size, case.micro_batches, dtype_of(case))
                with recording(log):
                    student.step()
                out["collectives_per_step"].append(bytes_by_kind(log))
                if exercise == "zero2":
                    with torch.no_grad():            # the student's mean gradient, gathered from the shards: (numel,)
                        mine = gather_shards(getattr(getattr(student, "shard", None), "grad", None), world_size,
                                             n_params).to(flat.device, flat.dtype)
                        grad_ratios.append(bound_ratio(mine - flat, bound))
                        grad_diffs.append((mine - flat).abs().max().item())
                        for q, g in zip(ref_trained, mine.split([t.numel() for t in trained])):
                            q.grad = g.view_as(q).clone()
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
            tap.remove()
            held = held_bytes(model, student)
            out["held_per_rank"] = gather_objects(held, env, group) if world_size > 1 else [held]
            if exercise == "zero1":          # the state this rank's optimizer reports: self.state, its entries
                entries = sum(1 for v in student.state.values() if v)
                out["state_entries_per_rank"] = gather_objects(entries, env, group) if world_size > 1 else [entries]
                out["greedy_state_bytes"] = greedy_state_bytes(param_groups(model, case), case, model, world_size)
            student.zero_grad()              # "no gradient left": counted after it
            out["grads_after_zero_grad"] = held_bytes(model, student)["grads"]
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


def greedy_state_bytes(groups, case, model, world_size: int) -> list[int]:
    """AdamW state bytes per rank (sorted) when every parameter goes, largest first within each add_param_group
    call, to the rank that owns the fewest parameter bytes so far, counted over all groups (the late head's group
    last): the exercise's rule. Ties between equal loads or equal sizes only permute the ranks' totals."""
    loads, state = [0] * world_size, [0] * world_size
    late = [list(model.head.parameters())] if case.late_head >= 0 else []
    for params in [g["params"] for g in groups] + late:
        for p in sorted(params, key=lambda p: p.numel() * p.element_size(), reverse=True):
            r = min(range(world_size), key=lambda i: loads[i])
            loads[r] += p.numel() * p.element_size()
            state[r] += (2 * p.numel() * p.element_size() + 4) if p.requires_grad else 0
    return sorted(state)


def rehearse(impl, exercise: str, runs, check=None) -> list[dict]:
    """probe_case for each "world size:case" of runs on ranks that are threads of this process
    (``lablib.probes.rehearsal``): seconds, before the real torchrun run of the same cases. Per run, rank 0's
    result, or the first rank's whose error is not only the wait for a rank that failed. Nothing (and a line
    that says so) when the class calls a collective the rehearsal does not emulate. ``check(result)``, if given,
    runs after each case (the first failure ends the rehearsal)."""
    return rehearse_with(lambda case, env: probe_case(impl, exercise, case, env), runs, check)


# --- the graded checks ------------------------------------------------------------------------------------------

def check_probe(r: dict, exercise: str) -> None:
    """The graded checks of one probe_case result (exercises 1 and 2, any world size); each failure says what."""
    r = r.to_dict() if hasattr(r, "to_dict") else r      # a launch.RunResult: plain lists and dicts to compare
    where = f"{CLASSES[exercise]} on {r['world_size']} rank(s), case '{r['case']}'"
    check_ran(r, where)
    n, elem = r["world_size"], r["element_size"]
    held = r["held_per_rank"]
    if exercise == "zero1":
        checks.check_true(r["is_optimizer"], f"{where}: must be a torch.optim.Optimizer (subclass it)")
        checks.check_equal(r["param_groups"], r["reference_groups"],
                           f"{where}: param_groups after the last step (parameters per group, lr as the probe's "
                           f"schedule set it, weight decay) vs torch.optim.AdamW's",
                           hint="call super().__init__(params, defaults) and let add_param_group record every group")
        checks.check_equal(r["steps_not_bit_equal"], [], f"{where}: steps after which some parameter is not "
                           f"bit-for-bit equal to plain AdamW's on this rank (of {r['steps']}; the probe changes "
                           f"every group's lr before each step, as a schedule does)",
                           hint="step() copies the outer groups' hyperparameters (lr...) to the inner groups, steps "
                                "the inner optimizer, then every parameter reaches every rank from its owner")
        state = [h["optimizer"] for h in held]
        # Each parameter's state (2 moments and a 4-byte step) on exactly one rank: whole bytes, no rounding.
        checks.check_equal(sum(state), r["full_state_bytes"],
                           f"{where}: optimizer-state bytes summed over the ranks (each parameter's state on its owner "
                           f"only), per rank {state}", hint="each rank's inner optimizer gets only the parameters it owns")
        checks.check_equal(sum(r["state_entries_per_rank"]), len(r["param_state_bytes"]),
                           f"{where}: parameters with a state in self.state, summed over the ranks (per rank "
                           f"{r['state_entries_per_rank']})", hint="self.state is the inner optimizer's state "
                                                                   "(self.state = self.inner.state)")
        bound = r["full_state_bytes"] / n + max(r["param_state_bytes"]) + 4 * len(r["param_state_bytes"])
        checks.check_true(max(state) <= bound,
                          f"{where}: the fullest rank holds {max(state):,} bytes of state; balanced by size it "
                          f"holds at most {bound:,.0f} (the average {r['full_state_bytes'] / n:,.0f} + the "
                          f"largest parameter's); per rank {state}",
                          hint="give each parameter, largest first, to the rank that owns the fewest bytes so far")
        checks.check_equal(sorted(state), r["greedy_state_bytes"],
                           f"{where}: optimizer-state bytes per rank (sorted) against the rule's (largest first, each "
                           f"to the rank that owns the fewest bytes so far, over every group added)",
                           hint="keep the ranks' loads across add_param_group calls: a group added later continues "
                                "from the loads so far")
        return
    check_gradient_then_update(r, where, "reduce-scatter the zero-padded flat gradient, divide by N (the mean, not "
                               "the sum), make it the shard's .grad; shard r is elements [r*S, (r+1)*S)",
                               "step your shard only, then all-gather every rank's updated shard; padding must "
                               "never shift a real element")
    checks.check_equal(r["weight_spread_across_ranks"], 0.0, f"{where}: parameters identical on every rank")
    checks.check_equal(r["full_grads_kept_after_step"], 0, f"{where}: model parameters that still hold a full "
                       f".grad after step()", hint="keep only your shard's gradient: set every p.grad to None")
    checks.check_equal(r["grads_after_zero_grad"], 0, f"{where}: gradient bytes held after zero_grad()",
                       hint="zero_grad() leaves no gradient: the shard's .grad too")
    shard = -(-r["n_params"] // n)             # S = ceil(numel / N)
    padded = elem * n * shard                  # the flat buffer's bytes
    expected = {"reduce_scatter": padded, "all_gather": padded}
    check_collectives(where, r["collectives_per_step"], expected,
                      f"expected one reduce-scatter of the padded flat gradient and one all-gather of the padded "
                      f"flat parameters, N S = {n * shard} elements of {elem} bytes each, and nothing else",
                      hint="dist.reduce_scatter_tensor(shard_grad, flat_grad): an all-reduce of the whole gradient "
                           "sends twice the bytes and keeps what this rank does not own; N broadcasts are no all-gather")
    check_bus_ratio(where, r["collectives_per_step"], elem * r["n_params"], n, shard * n / r["n_params"],
                    f"reduce-scatter + all-gather = one all-reduce's bytes: 1 x padded / numel = {n * shard} / "
                    f"{r['n_params']}")
    # Storages are counted in whole bytes: no tolerance but the padding's place (in the parameters' flat buffer
    # or not: N S - numel < N elements).
    frozen = r["frozen_bytes"]
    for rank, h in enumerate(held):
        checks.check_true(frozen + elem * r["n_params"] <= h["params"] <= frozen + padded,
                          f"{where}, rank {rank}: parameter bytes {h['params']:,} (replicated: between "
                          f"{frozen + elem * r['n_params']:,} and the padded flat buffer's {padded:,}"
                          + (f" + the frozen parameters' {frozen:,}" if frozen else "") + ")",
                          hint="the trainable parameters are views of the flat buffer: no second copy")
        checks.check_equal(h["grads"], elem * shard, f"{where}, rank {rank}: gradient bytes held after step (one "
                           f"shard of S = ceil({r['n_params']}/{n}) = {shard} elements of {elem} bytes)",
                           hint="only this rank's shard gradient; the full flat gradient is freed after the "
                                "reduce-scatter")
        checks.check_equal(h["optimizer"], 2 * elem * shard + 4, f"{where}, rank {rank}: optimizer-state bytes "
                           f"(AdamW on one shard of {shard}: two moments and a 4-byte step)",
                           hint="the inner optimizer gets the shard (a view of the flat buffer), not the model")
