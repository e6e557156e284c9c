"""Lab 07's probe of the students' ``ZeRO3`` (exercise 3): parameters sharded at rest, gathered per block while it
runs; ``lablib.runs.zero_scratch --exercise zero3`` runs it on 2-4 ranks, ``zero_probes.rehearse`` on threads first.

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

What a rank holds is counted from storages (``zero_probes.held_bytes``, the shards counted as parameters): at rest
(between steps) about 1/N of the parameters, gradients and state. During the forward the probe samples, before and
after every module's forward (its hooks run after the student's), the bytes of the model's gathered parameters:
at most one block beside the root's (the root's module is the model itself, so it is gathered for the whole forward).
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lablib import checks
from lablib.probes.ddp import default_group
from lablib.measure.memory import unique_storage_bytes
from lablib.course.models import GPT, GPTConfig
from lablib.measure.rankcheck import (FP32_UNIT_ROUNDOFF, bound_ratio, formula_rtol, gather_objects,
                                      mean_gradient_and_abs_sum, mean_rounding_bound)
from lablib.probes.zero import (CASES as STACK_CASES, LR, WEIGHT_DECAY, batch, build, check_gradient_then_update,
                                error_in_impl, gather_shards, held_bytes)

GPT_CASE = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)   # 28,576 parameters; padding at N = 3
CASES = ("mlp", "uneven", "gpt")
_SEEDED = threading.Lock()           # the rehearsal's ranks are threads sharing torch's global generator


def build_case(case: str, seed: int):
    """(model, blocks): the same initial weights on every rank. A block is a unit of ZeRO-3; the model's other
    parameters (GPT: embeddings, final norm, tied head; the stack: its head) are the root's."""
    if case == "gpt":
        with _SEEDED:
            torch.manual_seed(seed)
            model = GPT(GPT_CASE)
        return model, list(model.h)
    model = build(STACK_CASES[case], seed)
    return model, list(model.layers)


def my_batch(case: str, step: int, rank: int, world_size: int, per_rank: int, seed: int):
    """This rank's rows of the step's global batch (world_size * per_rank samples)."""
    if case == "gpt":   # random tokens: the losses are compared, not learned (and no text to load on every rank)
        g = torch.Generator().manual_seed(seed * 1000 + step)
        tokens = torch.randint(GPT_CASE.vocab_size, (world_size * per_rank, GPT_CASE.block_size + 1), generator=g)
        mine = tokens[rank * per_rank:(rank + 1) * per_rank]
        return mine[:, :-1], mine[:, 1:]                      # (per_rank, block_size): inputs, next tokens
    x, y = batch(STACK_CASES[case], step, world_size * per_rank, seed)   # the course's regression task
    return x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]


def loss_of(model, case: str, x, y) -> torch.Tensor:
    return model(x, y)[1] if case == "gpt" else F.mse_loss(model(x), y)


def mean_over_ranks(value: float, world_size: int, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)   # on the rank's device: NCCL needs it there
    if world_size > 1:
        dist.all_reduce(t)
    return t.item() / world_size


class ForwardMeter:
    """The largest bytes of gathered parameters (the model's parameter storages: freed ones count 0) seen before
    and after any module's forward. Registered after the student's hooks, so it sees what they leave."""

    def __init__(self, model):
        self.model, self.peak, self.handles = model, 0, []

    def sample(self, *_):
        self.peak = max(self.peak, unique_storage_bytes(self.model.parameters()))

    def __enter__(self):
        for m in self.model.modules():
            self.handles += [m.register_forward_pre_hook(self.sample), m.register_forward_hook(self.sample)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False


def fsdp2_losses(case: str, env, group, steps: int, per_rank: int, seed: int) -> list[float]:
    """FSDP2 (``fully_shard`` on every block, then the root) on the same batches from the same weights."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    device = env.device.type
    mesh = DeviceMesh.from_group(group, device) if group is not None else init_device_mesh(device, (world_size,))
    model, blocks = build_case(case, seed)
    model.to(env.device)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(steps):
        x, y = my_batch(case, step, rank, world_size, per_rank, seed)
        opt.zero_grad()
        loss = loss_of(model, case, x.to(env.device), y.to(env.device))
        loss.backward()
        opt.step()
        t = loss.detach().double().reshape(1)
        dist.all_reduce(t, group=group)
        losses.append(t.item() / world_size)
    return losses


def probe(impl, case: str, env, group=None, steps: int = 4, per_rank: int = 2, seed: int = 0,
          fsdp2: bool = False) -> dict:
    """Train the student's ZeRO3 and plain AdamW side by side on group's ranks (world size 1 in a notebook)."""
    world_size = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    model, blocks = build_case(case, seed)
    reference, _ = build_case(case, seed)
    model.to(env.device), reference.to(env.device)
    ref_params = dict(reference.named_parameters())
    name_of = {id(p): n for n, p in model.named_parameters()}
    n_params = sum(p.numel() for p in model.parameters())
    block_bytes = [4 * sum(p.numel() for p in b.parameters()) for b in blocks]
    root_bytes = 4 * n_params - sum(block_bytes)
    # S = ceil(numel / N) per unit (the blocks, then the root's parameters): what a rank holds at rest
    unit_numels = [b // 4 for b in block_bytes] + ([root_bytes // 4] if root_bytes > 0 else [])
    out = {"case": case, "world_size": world_size, "steps": steps, "error": None, "n_params": n_params,
           "n_units": len(unit_numels), "block_bytes": block_bytes, "root_bytes": root_bytes,
           "expected_shard_numel": sum(-(-u // world_size) for u in unit_numels)}
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses, ref_losses, grad_diffs, grad_ratios, diffs, grads_kept, rest, fwd_peaks = [], [], [], [], [], [], [], []
    mismatch, loss_terms = [], 0
    try:
        with default_group(group), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)            # torch 2.13's new names for the collectives
            # register_full_backward_pre_hook on a block whose inputs need no gradient (the stack's first layer)
            # warns that it fires on the outputs' gradients: exactly when a pre-hook should.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            student = impl.ZeRO3(model, blocks, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
            units = student.all_units()
            for step in range(steps):
                x, y = (t.to(env.device) for t in my_batch(case, step, rank, world_size, per_rank, seed))
                student.zero_grad()
                with ForwardMeter(model) as meter:
                    loss = loss_of(model, case, x, y)
                fwd_peaks.append(meter.peak)
                loss.backward()
                loss_terms = y.numel()           # the float32 mean the loss takes over this rank's targets
                losses.append(mean_over_ranks(loss.item(), world_size, env.device))
                ref_opt.zero_grad()
                ref_loss = loss_of(reference, case, x, y)
                ref_loss.backward()
                ref_losses.append(mean_over_ranks(ref_loss.item(), world_size, env.device))
                with torch.no_grad():            # the mean gradient, and the sum of |terms| it rounds: one flat each
                    flat, abs_sum = mean_gradient_and_abs_sum(list(reference.parameters()), world_size)
                    sizes = [q.numel() for q in reference.parameters()]
                    mean = dict(zip(ref_params, flat.split(sizes)))
                    bound = dict(zip(ref_params, mean_rounding_bound(abs_sum, world_size).split(sizes)))
                    # Each unit's gradient as the student's ranks hold it (the shards, gathered, padding included)
                    # against the mean's same elements (padding: exactly 0); then the reference steps on the
                    # student's own gradient.
                    worst, worst_ratio = 0.0, 0.0
                    for u in units:
                        numel = sum(p.numel() for p in u.params)
                        got = gather_shards(u.shard.grad, world_size, world_size * u.shard.numel()).to(flat.device)
                        want, allowed = torch.zeros_like(got), torch.zeros_like(got)
                        want[:numel] = torch.cat([mean[name_of[id(p)]] for p in u.params])
                        allowed[:numel] = torch.cat([bound[name_of[id(p)]] for p in u.params])
                        worst = max(worst, (got - want).abs().max().item())
                        worst_ratio = max(worst_ratio, bound_ratio(got - want, allowed))
                        for p, g in zip(u.params, got[:numel].split([p.numel() for p in u.params])):
                            ref_params[name_of[id(p)]].grad.copy_(g.view_as(p))
                    grad_diffs.append(worst)
                    grad_ratios.append(worst_ratio)
                student.step()
                ref_opt.step()
                grads_kept.append(sum(p.grad is not None for p in model.parameters()))
                held = held_bytes(model, student, shards=[u.shard for u in units])
                rest.append(held)
                with torch.no_grad():            # the updated parameters, gathered from the shards by the probe
                    worst, equal = 0.0, True
                    for u in units:
                        want = torch.cat([ref_params[name_of[id(p)]].detach().flatten() for p in u.params])
                        full = gather_shards(u.shard, world_size, want.numel()).to(want.device)
                        worst = max(worst, (full - want).abs().max().item())
                        equal = equal and torch.equal(full, want)
                    diffs.append(worst)
                    if not equal:
                        mismatch.append(step)
            out["held_per_rank"] = gather_objects(rest[-1], env, group) if world_size > 1 else [rest[-1]]
            out["forward_peak_per_rank"] = (gather_objects(max(fwd_peaks), env, group) if world_size > 1
                                            else [max(fwd_peaks)])
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
        out["max_abs_grad"] = max(q.grad.abs().max().item() for q in reference.parameters())
        out["full_grads_kept_after_step"] = max(grads_kept)
    except Exception as exc:  # noqa: BLE001 - a wrong answer is a result to report, not a crash of the run
        out["error"] = error_in_impl(exc)
        return out
    if fsdp2:       # real ranks only: FSDP2 cannot run on threads
        out["fsdp2_losses"] = fsdp2_losses(case, env, group, steps, per_rank, seed)
        out["max_abs_loss_diff_vs_fsdp2"] = max(abs(a - b) for a, b in zip(losses, out["fsdp2_losses"]))
        out["first_loss_diff_vs_fsdp2"] = abs(losses[0] - out["fsdp2_losses"][0])
    return out


def check(r: dict) -> None:
    """The graded checks of one probe result (at any world size); each failure says what and why."""
    where = f"ZeRO3 on {r['world_size']} rank(s), case '{r['case']}'"
    error = r["error"] or ""
    freed = "storage of size 0" in error
    checks.check_true(not error, f"{where}: raised {error}" + (
        "\n  that is: the backward used a block's parameters while its full buffer was freed" if freed else ""),
        hint="gather the block again in before_backward: its backward needs its full parameters" if freed else
             "NotImplementedError: the exercise cell is still the stub (write it and run it); any other error "
             "names the line of your file it came from")
    n = r["world_size"]
    check_gradient_then_update(r, where, "reduce-scatter the block's zero-padded flat gradient, then divide by N (the "
                               "mean, not the sum); shard r is elements [r*S, (r+1)*S)",
                               "step only the shards; padding must never shift a real element")
    checks.check_true(r["max_loss_diff_over_bound"] <= 1.0,
                      f"{where}: with the same weights, your losses against AdamW's in one process: the largest "
                      f"difference ({r['max_abs_loss_diff_vs_adamw']:.3g}) is {r['max_loss_diff_over_bound']:.3g} times "
                      f"the float32 rounding of the loss's mean (relative {r['loss_rtol']:.1e})",
                      hint="the forward must run on the gathered parameters of every block")
    if "first_loss_diff_vs_fsdp2" in r:
        checks.check_close(r["losses"][0], r["fsdp2_losses"][0], rtol=r["loss_rtol"], atol=0,
                           what=f"{where}: the first loss (the same initial weights) against FSDP2's (losses "
                                f"{r['losses']}, FSDP2 {r['fsdp2_losses']})")
    checks.check_equal(r["full_grads_kept_after_step"], 0, f"{where}: model parameters that still hold a full .grad "
                       f"after step()", hint="once a block's gradients are reduce-scattered, set each p.grad to None")
    shard = r["expected_shard_numel"]        # sum over units of S = ceil(numel / N): 1/N of the model + padding
    # Storages are counted in whole bytes, so these are equalities: the shards (fp32), their gradients, and AdamW's
    # two moments of them with a 4-byte step per unit.
    for rank, h in enumerate(r["held_per_rank"]):
        checks.check_equal(h["params"], 4 * shard, f"{where}, rank {rank}: parameter bytes held at rest (between "
                           f"steps): the shards, sum of ceil(numel/{n}) over the {r['n_units']} units = {shard}",
                           hint="free every block's full buffer after its forward and after its backward (resize "
                                "its storage to 0)")
        checks.check_equal(h["grads"], 4 * shard, f"{where}, rank {rank}: gradient bytes held after step (the shards' "
                           f"gradients)", hint="keep only the shard's gradient; no full gradient after the reduce-scatter")
        checks.check_equal(h["optimizer"], 8 * shard + 4 * r["n_units"],
                           f"{where}, rank {rank}: optimizer-state bytes (AdamW on the shards: two moments and a step "
                           f"per unit)")
    # During the forward: the root's parameters (its module is the whole model) and one block at a time.
    bound = r["root_bytes"] + max(r["block_bytes"]) + 2 * 4 * n         # + each one's padding
    for rank, peak in enumerate(r["forward_peak_per_rank"]):
        checks.check_true(peak <= bound,
                          f"{where}, rank {rank}: gathered parameter bytes seen at a module boundary in the forward: "
                          f"{peak:,}; at most {bound:,.0f} (the root's {r['root_bytes']:,} + the largest block's "
                          f"{max(r['block_bytes']):,} + padding; blocks {r['block_bytes']})",
                          hint="free each block's gathered parameters in its forward hook, after its forward")
