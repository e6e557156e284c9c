"""Lab 07's probe of the students' ``ZeRO3`` (exercise 3): parameters sharded at rest, gathered per block while it
runs; ``lablib.labs.zero_from_scratch.run_zero_scratch --exercise zero3`` runs it on 2-4 ranks, ``zero12.rehearse`` on threads first.

Each rank trains the same model on its own share of the batch. The references are PyTorch's, never another
exercise:

- the mean of the ranks' gradients (all-reduced here): the student's shard gradients, gathered here, must equal it
  to within float32 rounding of a mean summed in another order (``rankcheck.mean_rounding_bound``, per element);
- plain ``torch.optim.AdamW`` in this process, stepped in lockstep on that same gathered gradient: the updated
  parameters, gathered here from the shards with the probe's own all-gather, must equal AdamW's bit for bit (the
  same numbers through the same element-wise arithmetic), and so the losses to the rounding of their own mean.
  (Stepped on its own all-reduced mean, AdamW's division by sqrt(v) would magnify the two sums' last-bit
  differences, up to 1.4e-5 in the GPT case after 4 steps: no bound from the arithmetic.);
- on real ranks and the course GPT (``lablib.course.models``), FSDP2 (``fully_shard`` on every block, then the root)
  trained on the same batches from the same weights: the first loss (the same weights) must be the same to the
  rounding of its mean; after that FSDP2's own reduce-scatter order and AdamW allow no bound, so the later losses
  are reported, not checked.

What a rank holds is counted from storages (``held.held_bytes``, the shards counted as parameters): at rest
(between steps) about 1/N of the parameters, gradients and state. During the forward the probe samples, before and
after every module's forward (its hooks run after the student's), the bytes of the model's gathered parameters:
at most one block beside the root's (the root's module is the model itself, so it is gathered for the whole forward).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from lablib import checks
from lablib.measure.collective_log import CollectiveLog
from lablib.measure.memory import unique_storage_bytes
from lablib.measure.rankcheck import FP32_UNIT_ROUNDOFF, bound_ratio, formula_rtol
from lablib.jobs.distenv import gather_objects
from lablib.probes.harness import default_group
from lablib.labs.zero_from_scratch.cases import LR, WEIGHT_DECAY, error_in_impl, micro_batches
from lablib.labs.zero_from_scratch.step_checks import (GradientTap, check_gradient_then_update, check_ran, mean_gradient_and_bound,
                                       mixed_mean_gradient_and_bound)
from lablib.labs.zero_from_scratch.comm import bytes_by_kind, check_bus_ratio, check_collectives, recording, rehearse_with
from lablib.labs.zero_from_scratch.held import gather_shards, held_bytes

from lablib.labs.zero_from_scratch.zero3_cases import (CASES, DTYPES, build_case, fsdp2_losses, loss_of, mean_over_ranks,  # noqa: F401
                                       my_batch, parse_case, stack_case)


class GatheredMeter:
    """The largest bytes of gathered parameters (the model's parameter storages: freed ones count 0) seen before
    and after any module's forward, and in the backward each time a parameter's gradient is complete. Registered
    after the student's hooks, so it sees what they leave: a block still gathered while a later one runs (in
    either pass) shows here."""

    def __init__(self, model, expected=None):
        self.model, self.peak, self.handles = model, {"forward": 0, "backward": 0}, []
        self.phase = "forward"
        # Mixed precision: {id(parameter): the master's values cast to param_dtype}. Every gathered parameter seen
        # must be exactly that (the dtype and the bits): what the forward and the backward compute with.
        self.expected, self.wrong = expected, []

    def sample(self, *_):
        self.peak[self.phase] = max(self.peak[self.phase], unique_storage_bytes(self.model.parameters()))
        if self.expected is None or len(self.wrong) >= 3:
            return
        for p in self.model.parameters():
            if p.untyped_storage().nbytes() >= (p.storage_offset() + p.numel()) * p.element_size():   # gathered
                want = self.expected[id(p)]
                if p.dtype != want.dtype:
                    self.wrong.append(f"{self.phase}: a gathered parameter of shape {tuple(p.shape)} is {p.dtype}, "
                                      f"not param_dtype {want.dtype}")
                elif not torch.equal(p.detach(), want):
                    self.wrong.append(f"{self.phase}: a gathered parameter of shape {tuple(p.shape)} differs from "
                                      f"the master cast to {want.dtype} by up to "
                                      f"{(p.detach().double() - want.double()).abs().max().item():.3g}")

    def __enter__(self):
        for m in self.model.modules():
            self.handles += [m.register_forward_pre_hook(self.sample), m.register_forward_hook(self.sample)]
        for p in self.model.parameters():
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(self.sample))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False


def probe(impl, case: str, env, group=None, steps: int = 4, per_rank: int = 2, seed: int = 0,
          fsdp2: bool = False) -> dict:
    """Train the student's ZeRO3 and plain AdamW side by side on group's ranks (world size 1 in a notebook)."""
    world_size = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    name, case = case, parse_case(case)[0]         # "mlp@bf16/fp32": the model of "mlp", ZeRO3 in mixed precision
    _, param_dtype, reduce_dtype = parse_case(name)
    model, blocks = build_case(case, seed)
    reference, _ = build_case(case, seed)
    model.to(env.device), reference.to(env.device)
    stack = stack_case(case)
    steps = min(steps, stack.steps) if stack else steps
    n_micro = stack.micro_batches if stack else 1
    dtype = next(model.parameters()).dtype
    elem = next(model.parameters()).element_size()
    mixed = param_dtype is not None
    compute_dtype = param_dtype or dtype                     # FSDP2's defaults: reduce in param_dtype
    summed_dtype = reduce_dtype or compute_dtype
    ref_params = dict(reference.named_parameters())
    name_of = {id(p): n for n, p in model.named_parameters()}
    n_params = sum(p.numel() for p in model.parameters())
    block_bytes = [elem * sum(p.numel() for p in b.parameters()) for b in blocks]
    root_bytes = elem * n_params - sum(block_bytes)
    # S = ceil(numel / N) per unit (the blocks, then the root's parameters): what a rank holds at rest
    unit_numels = [b // elem for b in block_bytes] + ([root_bytes // elem] if root_bytes > 0 else [])
    trainable = [any(p.requires_grad for p in b.parameters()) for b in blocks] + ([True] if root_bytes > 0 else [])
    # A unit's backward runs (and needs it gathered again) when it is trained or a trained block runs before it
    # (autograd passes the gradient through it to that block's input): a frozen block after a trained one too.
    backward = [any(trainable[:i + 1]) for i in range(len(blocks))] + ([True] if root_bytes > 0 else [])
    out = {"case": name, "world_size": world_size, "steps": steps, "error": None, "n_params": n_params,
           "element_size": elem, "micro_batches": n_micro, "mixed": mixed,
           "param_dtype": str(compute_dtype), "reduce_dtype": str(summed_dtype),
           "param_element_size": torch.finfo(compute_dtype).bits // 8,
           "reduce_element_size": torch.finfo(summed_dtype).bits // 8,
           "unit_shard_numels": [-(-u // world_size) for u in unit_numels], "unit_trainable": trainable,
           "unit_backward": backward,
           "n_units": len(unit_numels), "block_bytes": block_bytes, "root_bytes": root_bytes,
           "expected_shard_numel": sum(-(-u // world_size) for u in unit_numels), "collectives_per_step": []}
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    ref_list = list(reference.parameters())
    losses, ref_losses, grad_diffs, grad_ratios, diffs, grads_kept, rest = [], [], [], [], [], [], []
    fwd_peaks, bwd_peaks, mismatch, loss_terms = [], [], [], 0
    wrong_compute, loss_dtypes, shard_dtypes, grad_dtypes = [], set(), set(), set()
    try:
        with default_group(group), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)            # torch 2.13's new names for the collectives
            # register_full_backward_pre_hook on a block whose inputs need no gradient (the stack's first layer)
            # warns that it fires on the outputs' gradients: exactly when a pre-hook should.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            if mixed:
                student = impl.ZeRO3(model, blocks, torch.optim.AdamW, param_dtype=param_dtype,
                                     reduce_dtype=reduce_dtype, lr=LR, weight_decay=WEIGHT_DECAY)
            else:               # exercise 3's call, as its text gives it
                student = impl.ZeRO3(model, blocks, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
            units = student.all_units()
            for i, u in enumerate(units):    # at rest the full buffers are freed: a shard that is a view of one is gone
                if u.shard.untyped_storage().nbytes() < u.shard.numel() * u.shard.element_size():
                    raise ValueError(f"unit {i}'s shard has {u.shard.untyped_storage().nbytes()} bytes of storage for "
                                     f"{u.shard.numel()} elements: it is a view of the full buffer that free() "
                                     f"released; make it a .clone() (it must outlive free())")
            tap = GradientTap([p for n, p in model.named_parameters()])   # in ref_params' order
            for step in range(steps):
                x, y = (t.to(env.device) for t in my_batch(case, step, rank, world_size, per_rank, seed))
                log = CollectiveLog()
                with recording(log):
                    student.zero_grad()
                ref_opt.zero_grad()
                tap.reset()
                expected = ({id(p): ref_params[name_of[id(p)]].detach().to(compute_dtype)
                             for p in model.parameters()} if mixed else None)
                for mx, my in micro_batches(x, y, stack) if stack else [(x, y)]:
                    with GatheredMeter(model, expected) as meter, recording(log):
                        loss = loss_of(model, case, mx, my)
                        meter.phase = "backward"
                        loss.backward()
                    fwd_peaks.append(meter.peak["forward"])
                    bwd_peaks.append(meter.peak["backward"])
                    wrong_compute += meter.wrong
                    loss_dtypes.add(str(loss.dtype))
                    loss_terms = my.numel()          # the float32 mean the loss takes over this rank's targets
                    losses.append(mean_over_ranks(loss.item(), world_size, env.device))
                    with torch.no_grad():
                        ref_losses.append(mean_over_ranks(loss_of(reference, case, mx, my).item(), world_size,
                                                          env.device))
                with torch.no_grad():            # the mean gradient, and how far a correct one may be: one flat each
                    if mixed:
                        flat, bound_flat = mixed_mean_gradient_and_bound(tap, world_size, n_micro, summed_dtype, dtype)
                    else:
                        flat, bound_flat = mean_gradient_and_bound(tap, world_size, n_micro, dtype)
                    sizes = [q.numel() for q in ref_list]
                    mean = dict(zip(ref_params, flat.split(sizes)))
                    bound = dict(zip(ref_params, bound_flat.split(sizes)))
                    # Each unit's gradient as the student's ranks hold it (the shards, gathered, padding included)
                    # against the mean's same elements (padding: exactly 0); then the reference steps on the
                    # student's own gradient.
                    worst, worst_ratio = 0.0, 0.0
                    for u in units:
                        numel = sum(p.numel() for p in u.params)
                        shard_dtypes.add(str(u.shard.dtype))
                        if u.shard.grad is None:           # a frozen unit: no gradient, and none expected
                            if any(q.requires_grad for q in u.params):
                                raise ValueError("a unit with trainable parameters has no shard gradient after the "
                                                 "backward")
                            continue
                        grad_dtypes.add(str(u.shard.grad.dtype))
                        got = gather_shards(u.shard.grad, world_size, world_size * u.shard.numel()).to(flat.device,
                                                                                                        flat.dtype)
                        want, allowed = torch.zeros_like(got), torch.zeros_like(got)
                        want[:numel] = torch.cat([mean[name_of[id(p)]] for p in u.params])
                        allowed[:numel] = torch.cat([bound[name_of[id(p)]] for p in u.params])
                        worst = max(worst, (got - want).abs().max().item())
                        worst_ratio = max(worst_ratio, bound_ratio(got - want, allowed))
                        for p, g in zip(u.params, got[:numel].split([p.numel() for p in u.params])):
                            ref_params[name_of[id(p)]].grad = g.view_as(p).to(dtype).clone()
                    grad_diffs.append(worst)
                    grad_ratios.append(worst_ratio)
                with recording(log):
                    student.step()
                out["collectives_per_step"].append(bytes_by_kind(log))
                ref_opt.step()
                grads_kept.append(sum(p.grad is not None for p in model.parameters()))
                held = held_bytes(model, student, shards=[u.shard for u in units])
                rest.append(held)
                with torch.no_grad():            # the updated parameters, gathered from the shards by the probe
                    worst, equal = 0.0, True
                    for u in units:
                        want = torch.cat([ref_params[name_of[id(p)]].detach().flatten() for p in u.params])
                        full = gather_shards(u.shard, world_size, want.numel()).to(want.device, want.dtype)
                        worst = max(worst, (full - want).abs().max().item())
                        equal = equal and torch.equal(full, want)
                    diffs.append(worst)
                    if not equal:
                        mismatch.append(step)
            tap.remove()
            student.zero_grad()              # "no gradient left": counted after it
            out["grads_after_zero_grad"] = held_bytes(model, student, shards=[u.shard for u in units])["grads"]
            out["held_per_rank"] = gather_objects(rest[-1], env, group) if world_size > 1 else [rest[-1]]
            peaks = {"forward": max(fwd_peaks), "backward": max(bwd_peaks)}
            out["gathered_peak_per_rank"] = gather_objects(peaks, env, group) if world_size > 1 else [peaks]
            out["wrong_compute"] = wrong_compute[:3]
            out["loss_dtypes"], out["shard_dtypes"] = sorted(loss_dtypes), sorted(shard_dtypes)
            out["shard_grad_dtypes"] = sorted(grad_dtypes)
        out["shard_numel_total"] = sum(u.shard.numel() for u in units)
        out["losses"], out["reference_losses"] = losses, ref_losses
        out["max_abs_grad_diff_vs_mean"] = max(grad_diffs)
        out["max_grad_diff_over_bound"] = max(grad_ratios)
        out["max_abs_diff_vs_adamw"] = max(diffs)
        out["steps_not_bit_equal"] = mismatch
        out["max_abs_loss_diff_vs_adamw"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
        # Equal weights leave the losses apart by at most the rounding of their float32 means (each rank's targets,
        # then the ranks): loss_terms + N roundings of non-negative terms.
        out["loss_rtol"] = formula_rtol(loss_terms + world_size, unit_roundoff=FP32_UNIT_ROUNDOFF)
        out["max_loss_diff_over_bound"] = max(abs(a - b) / (out["loss_rtol"] * abs(b)) if a != b else 0.0
                                              for a, b in zip(losses, ref_losses))
        out["max_abs_weight"] = max(q.abs().max().item() for q in reference.parameters())
        out["max_abs_grad"] = max(q.grad.abs().max().item() for q in reference.parameters() if q.grad is not None)
        out["full_grads_kept_after_step"] = max(grads_kept)
    except Exception as exc:  # noqa: BLE001 - a wrong answer is a result to report, not a crash of the run
        out["error"] = error_in_impl(exc)
        return out
    if fsdp2:       # real ranks only: FSDP2 cannot run on threads
        out["fsdp2_losses"] = fsdp2_losses(case, env, group, steps, per_rank, seed)
        out["max_abs_loss_diff_vs_fsdp2"] = max(abs(a - b) for a, b in zip(losses, out["fsdp2_losses"]))
        out["first_loss_diff_vs_fsdp2"] = abs(losses[0] - out["fsdp2_losses"][0])
    return out


def rehearse(impl, runs, check=None) -> list[dict]:
    """``probe`` for each "world size:case" of runs on ranks that are threads of this process (seconds, before the
    torchrun run of the same cases; ``check(result)`` after each; see ``comm.rehearse_with``)."""
    return rehearse_with(lambda case, env: probe(impl, case, env), runs, check)


def check(r: dict) -> None:
    """The graded checks of one probe result (at any world size); each failure says what and why."""
    r = r.to_dict() if hasattr(r, "to_dict") else r      # a launch.RunResult: plain lists and dicts to compare
    where = f"ZeRO3 on {r['world_size']} rank(s), case '{r['case']}'"
    error = r["error"] or ""
    freed = "storage of size 0" in error
    check_ran(r, where, "\n  that is: the backward used a block's parameters while its full buffer was freed" if freed
              else "", hint="gather the block again in before_backward: its backward needs its full parameters"
              if freed else None)
    n, elem, m = r["world_size"], r["element_size"], r["micro_batches"]
    check_gradient_then_update(r, where, "reduce-scatter the block's zero-padded flat gradient, then divide by N (the "
                               "mean, not the sum); shard r is elements [r*S, (r+1)*S); a second backward before "
                               "step() adds to the shard's .grad", "step only the shards; padding must never shift "
                               "a real element")
    mixed = r.get("mixed", False)
    if mixed:      # ZeRO3(param_dtype=..., reduce_dtype=...): what the passes compute with, and in which dtypes
        pd, rd = r["param_dtype"], r["reduce_dtype"]
        checks.check_equal(r["wrong_compute"], [], f"{where}: parameters seen during the forward and the backward "
                           f"that are not the master shards cast to param_dtype ({pd}), bit for bit",
                           hint="cast each unit's fp32 shard to param_dtype before the all-gather, into a full buffer "
                                "of param_dtype that the parameters are views of")
        checks.check_equal(r["loss_dtypes"], [pd], f"{where}: the dtype of the loss (computed in param_dtype)",
                           hint="the parameters must be views of a param_dtype buffer")
        checks.check_equal(r["shard_dtypes"], [str(torch.float32)], f"{where}: the dtype of the shards the optimizer "
                           f"steps (the fp32 master)", hint="keep the shard in the parameters' own dtype; only the "
                           "gathered copy is param_dtype")
        checks.check_equal(r["shard_grad_dtypes"], [str(torch.float32)], f"{where}: the dtype of the shards' gradients "
                           f"handed to the optimizer", hint="cast the reduce-scattered mean to the shard's dtype")
    else:
        checks.check_true(r["max_loss_diff_over_bound"] <= 1.0,
                          f"{where}: with the same weights, your losses against AdamW's in one process: the largest "
                          f"difference ({r['max_abs_loss_diff_vs_adamw']:.3g}) is {r['max_loss_diff_over_bound']:.3g} "
                          f"times the float32 rounding of the loss's mean (relative {r['loss_rtol']:.1e})",
                          hint="the forward must run on the gathered parameters of every block")
    if "first_loss_diff_vs_fsdp2" in r:
        checks.check_close(r["losses"][0], r["fsdp2_losses"][0], rtol=r["loss_rtol"], atol=0,
                           what=f"{where}: the first loss (the same initial weights) against FSDP2's (losses "
                                f"{r['losses']}, FSDP2 {r['fsdp2_losses']})")
    checks.check_equal(r["full_grads_kept_after_step"], 0, f"{where}: model parameters that still hold a full .grad "
                       f"after step()", hint="once a block's gradients are reduce-scattered, set each p.grad to None")
    shard = r["expected_shard_numel"]        # sum over units of S = ceil(numel / N): 1/N of the model + padding
    trainable = r.get("unit_trainable", [True] * r["n_units"])         # a frozen unit: False
    trained = (sum(s for s, t in zip(r["unit_shard_numels"], trainable) if t) if "unit_shard_numels" in r
               else shard)                                             # the shards that get a gradient
    backward = r.get("unit_backward", trainable)
    twice = (sum(s for s, b in zip(r["unit_shard_numels"], backward) if b) if "unit_shard_numels" in r
             else trained)                                             # the shards gathered again for a backward
    pe, re_ = r.get("param_element_size", elem), r.get("reduce_element_size", elem)
    # The collectives, per step: every unit padded to N S_u elements, all-gathered (param_dtype) before its forward
    # and again before its backward, its gradient reduce-scattered (reduce_dtype) once; m times with m
    # micro-batches. A frozen unit before every trained one has no backward: one all-gather, no reduce-scatter; a
    # frozen unit after a trained one is gathered for its backward too (its input's gradient), not reduce-scattered.
    expected = {"all_gather": m * n * pe * (shard + twice), "reduce_scatter": m * n * re_ * trained}
    check_collectives(where, r["collectives_per_step"], expected,
                      f"expected per forward-backward ({m} per step) two all-gathers ({pe}-byte elements) and one "
                      f"reduce-scatter ({re_}-byte elements) of every trained unit's padded flat buffer, one "
                      f"all-gather of a frozen one before every trained one, two of a frozen one after a trained "
                      f"one ({r['n_units']} units, {n * shard} elements in all), and "
                      f"nothing else", hint="gather: dist.all_gather_into_tensor into the unit's full buffer (N "
                      "broadcasts are no all-gather), of the shard cast to param_dtype; the gradients: "
                      "dist.reduce_scatter_tensor in reduce_dtype (an all-reduce sends twice the bytes)")
    if m == 1 and not mixed and trained == shard:
        check_bus_ratio(where, r["collectives_per_step"], elem * r["n_params"], n, 1.5 * n * shard / r["n_params"],
                        f"the paper's 1.5 x DDP, for padded units: 1.5 x {n * shard} / {r['n_params']}")
    # Storages are counted in whole bytes, so these are equalities: the shards, their gradients, and AdamW's
    # two moments of them with a 4-byte step per trained unit.
    for rank, h in enumerate(r["held_per_rank"]):
        checks.check_equal(h["params"], elem * shard, f"{where}, rank {rank}: parameter bytes held at rest (between "
                           f"steps): the shards, sum of ceil(numel/{n}) over the {r['n_units']} units = {shard}",
                           hint="free every block's full buffer after its forward and after its backward (resize "
                                "its storage to 0)")
        checks.check_equal(h["grads"], elem * trained, f"{where}, rank {rank}: gradient bytes held after step (the "
                           f"trained shards' gradients)", hint="keep only the shard's gradient; no full gradient "
                                                               "after the reduce-scatter")
        checks.check_equal(h["optimizer"], 2 * elem * trained + 4 * sum(trainable),
                           f"{where}, rank {rank}: optimizer-state bytes (AdamW on the trained shards: two moments "
                           f"and a step per unit)")
    # While a pass runs: the root's parameters (its module is the whole model) and one block at a time, in
    # param_dtype.
    scale = pe / elem
    bound = scale * (r["root_bytes"] + max(r["block_bytes"])) + 2 * pe * n         # + each one's padding
    for rank, peaks in enumerate(r["gathered_peak_per_rank"]):
        for phase, hint in (("forward", "free each block's gathered parameters in its forward hook, after its "
                                        "forward"),
                            ("backward", "free each block once its gradients are reduce-scattered, during the "
                                         "backward, not in step()")):
            checks.check_true(peaks[phase] <= bound,
                              f"{where}, rank {rank}: gathered parameter bytes seen in the {phase}: {peaks[phase]:,}; "
                              f"at most {bound:,.0f} (the root's + the largest block's parameters in {pe}-byte "
                              f"elements + padding; blocks {r['block_bytes']} bytes in fp32)", hint=hint)
