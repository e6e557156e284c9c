"""Lab 07's probe of the students' ``ZeRO3`` (exercise 3): parameters sharded at rest, gathered per block while it
runs; ``lablib.runs.zero_scratch --exercise zero3`` runs it on 2-4 ranks, ``zero_probes.rehearse`` on threads first.

Each rank trains the same model on its own share of the batch. The references are PyTorch's, never another
exercise:

- plain ``torch.optim.AdamW`` in this process on the mean of the ranks' gradients (all-reduced here), stepped in
  lockstep: after every step the student's shard gradients must equal that mean (fp32 rounding) and the updated
  parameters, gathered here from the shards with the probe's own all-gather, must equal AdamW's;
- on real ranks and the course GPT (``lablib.models``), FSDP2 (``fully_shard`` on every block, then the root)
  trained on the same batches from the same weights: the losses must be the same.

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
from lablib.ddp_probes import default_group
from lablib.memory import unique_storage_bytes
from lablib.models import GPT, GPTConfig
from lablib.rankcheck import gather_objects
from lablib.zero_probes import CASES as STACK_CASES, LR, WEIGHT_DECAY, batch, build, error_in_impl, held_bytes

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


def _gathered(unit, world_size: int) -> torch.Tensor:
    """The unit's full flat buffer (N * S,), gathered by the probe from the shards (not by the student's code)."""
    out = torch.empty(world_size * unit.shard.numel(), dtype=unit.shard.dtype, device=unit.shard.device)
    if world_size > 1:
        dist.all_gather_into_tensor(out, unit.shard.detach().contiguous())
    else:
        out.copy_(unit.shard.detach())
    return out


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
    out = {"case": case, "world_size": world_size, "steps": steps, "error": None, "n_params": n_params,
           "n_units": len(blocks) + (root_bytes > 0), "block_bytes": block_bytes, "root_bytes": root_bytes}
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses, ref_losses, grad_diffs, diffs, grads_kept, rest, fwd_peaks = [], [], [], [], [], [], []
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
                losses.append(mean_over_ranks(loss.item(), world_size, env.device))
                ref_opt.zero_grad()
                ref_loss = loss_of(reference, case, x, y)
                ref_loss.backward()
                ref_losses.append(mean_over_ranks(ref_loss.item(), world_size, env.device))
                with torch.no_grad():            # the reference: the mean gradient, one flat collective
                    flat = torch.cat([q.grad.flatten() for q in reference.parameters()])
                    if world_size > 1:
                        dist.all_reduce(flat)
                    flat.div_(world_size)
                    for q, g in zip(reference.parameters(), flat.split([q.numel() for q in reference.parameters()])):
                        q.grad.copy_(g.view_as(q.grad))
                    # the student's shard gradients against the mean gradient's same elements (padding: 0)
                    worst = 0.0
                    for u in units:
                        want = torch.zeros(world_size * u.shard.numel(), device=u.shard.device)
                        want[:sum(p.numel() for p in u.params)] = torch.cat(
                            [ref_params[name_of[id(p)]].grad.flatten() for p in u.params])
                        mine = want.chunk(world_size)[rank]
                        got = u.shard.grad if u.shard.grad is not None else torch.full_like(mine, float("nan"))
                        worst = max(worst, (got - mine).abs().max().item())
                    grad_diffs.append(worst)
                student.step()
                ref_opt.step()
                grads_kept.append(sum(p.grad is not None for p in model.parameters()))
                held = held_bytes(model, student, shards=[u.shard for u in units])
                rest.append(held)
                with torch.no_grad():            # the updated parameters, gathered from the shards by the probe
                    worst = 0.0
                    for u in units:
                        full = _gathered(u, world_size)
                        want = torch.cat([ref_params[name_of[id(p)]].detach().flatten() for p in u.params])
                        worst = max(worst, (full[:want.numel()] - want).abs().max().item())
                    diffs.append(worst)
            out["held_per_rank"] = gather_objects(rest[-1], env, group) if world_size > 1 else [rest[-1]]
            out["forward_peak_per_rank"] = (gather_objects(max(fwd_peaks), env, group) if world_size > 1
                                            else [max(fwd_peaks)])
        out["shard_numel_total"] = sum(u.shard.numel() for u in units)
        out["losses"], out["reference_losses"] = losses, ref_losses
        out["max_abs_grad_diff_vs_mean"] = max(grad_diffs)
        out["max_abs_diff_vs_adamw"] = max(diffs)
        out["max_abs_loss_diff_vs_adamw"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
        out["max_abs_weight"] = max(q.abs().max().item() for q in reference.parameters())
        out["max_abs_grad"] = max(q.grad.abs().max().item() for q in reference.parameters())
        out["full_grads_kept_after_step"] = max(grads_kept)
    except Exception as exc:  # noqa: BLE001 - a wrong answer is a result to report, not a crash of the run
        out["error"] = error_in_impl(exc)
        return out
    if fsdp2:       # real ranks only: FSDP2 cannot run on threads
        out["fsdp2_losses"] = fsdp2_losses(case, env, group, steps, per_rank, seed)
        out["max_abs_loss_diff_vs_fsdp2"] = max(abs(a - b) for a, b in zip(losses, out["fsdp2_losses"]))
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
    checks.check_close(r["max_abs_grad_diff_vs_mean"], 0.0, atol=1e-6 * max(1.0, r["max_abs_grad"]),
                       what=f"{where}: max |shard .grad - the mean gradient's same elements| over {r['steps']} steps",
                       hint="reduce-scatter the block's zero-padded flat gradient, then divide by N (the mean, "
                            "not the sum); shard r is elements [r*S, (r+1)*S)")
    # fp32 rounding of the mean (another order of the sum than the reference's all-reduce), which Adam's division by
    # sqrt(v) magnifies where a gradient is near 0: up to about 1e-5 after 4 steps at lr 1e-2; a shifted element
    # or a sum instead of the mean is off by far more (and the gradient check above catches both first).
    checks.check_close(r["max_abs_diff_vs_adamw"], 0.0, atol=1e-4 * max(1.0, r["max_abs_weight"]),
                       what=f"{where}: max |w - w_AdamW on the mean gradient| (gathered from the shards) over "
                            f"{r['steps']} steps", hint="step only the shards; padding must never shift a real element")
    checks.check_close(r["max_abs_loss_diff_vs_adamw"], 0.0, atol=1e-5,
                       what=f"{where}: max |loss - loss of AdamW in one process| over the steps")
    if "max_abs_loss_diff_vs_fsdp2" in r:
        checks.check_close(r["max_abs_loss_diff_vs_fsdp2"], 0.0, atol=1e-5,
                           what=f"{where}: max |loss - FSDP2's loss| over the steps (losses {r['losses']}, FSDP2 "
                                f"{r['fsdp2_losses']})")
    checks.check_equal(r["full_grads_kept_after_step"], 0, f"{where}: model parameters that still hold a full .grad "
                       f"after step()", hint="once a block's gradients are reduce-scattered, set each p.grad to None")
    shard = r["shard_numel_total"]           # sum over units of S = ceil(numel / N): 1/N of the model + padding
    for rank, h in enumerate(r["held_per_rank"]):
        checks.check_close(h["params"], 4 * r["n_params"] / n, rtol=0.01, atol=4 * n * r["n_units"],
                           what=f"{where}, rank {rank}: parameter bytes held at rest (between steps): the shards",
                           hint="free every block's full buffer after its forward and after its backward (resize "
                                "its storage to 0)")
        checks.check_close(h["grads"], 4 * shard, rtol=0.01, atol=16,
                           what=f"{where}, rank {rank}: gradient bytes held after step (the shards' gradients)",
                           hint="keep only the shard's gradient; no full gradient after the reduce-scatter")
        checks.check_close(h["optimizer"], 8 * shard + 4 * r["n_units"], rtol=0.01, atol=16 * r["n_units"],
                           what=f"{where}, rank {rank}: optimizer-state bytes (AdamW on the shards)")
    # During the forward: the root's parameters (its module is the whole model) and one block at a time.
    bound = r["root_bytes"] + max(r["block_bytes"]) + 2 * 4 * n         # + each one's padding
    for rank, peak in enumerate(r["forward_peak_per_rank"]):
        checks.check_true(peak <= bound,
                          f"{where}, rank {rank}: gathered parameter bytes seen at a module boundary in the forward: "
                          f"{peak:,}; at most {bound:,.0f} (the root's {r['root_bytes']:,} + the largest block's "
                          f"{max(r['block_bytes']):,} + padding; blocks {r['block_bytes']})",
                          hint="free each block's gathered parameters in its forward hook, after its forward")
