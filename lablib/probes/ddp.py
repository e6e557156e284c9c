"""Lab 06's probe of the students' ``DDPIndividualParameters`` and ``DDPBucketed``: what their classes do on
the ranks, and the graded checks of it (``lablib.runs.ddp_scratch`` runs it on 2-4 ranks; the notebook runs
``probe_without_processes`` at world size 1 first, a quick pre-check before a torchrun start).

For every case (a small model; see ``CASES``) the student's wrapper trains a few SGD steps, each on a new
shuffled global batch split evenly over the ranks. Every rank starts from *different* weights (seeded with
its rank), so only a wrapper that broadcasts rank 0's parameters and buffers can end where the reference
does: a single process that trains rank 0's initial model on each whole global batch, compared after every
step. What is recorded per step comes from ``lablib.measure.counting`` (every collective the student's code called,
when it was launched and finished, whether it was asynchronous) and when ``loss.backward()`` returned; so
overlap is seen in the order of events, never assumed from a duration.

For ``DDPBucketed`` the module's ``assign_buckets`` is replaced, for the probe, by PyTorch's own bucket
assignment (``torch_bucket_assignment``, the one DDP uses), so the class is graded whatever the student's
``assign_buckets`` returns; the sizes it was called with are recorded. No exercise's answer is here: the
references are PyTorch's bucket assignment and a single process.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn as nn
import torch.nn.functional as F

from lablib import checks
from lablib.measure import counting
from lablib.course import data
from lablib.jobs.distenv import DistEnv
from lablib.jobs.exercise import load_module, require_file
from lablib.course.models import GPT, GPTConfig
from lablib.measure.rankcheck import max_abs_diff, sgd_rounding_bound, weight_spread

WRAPPERS = {"individual": "DDPIndividualParameters", "bucketed": "DDPBucketed"}
MIB = 2**20


# --- the cases: small models, each with the feature it checks -------------------------------------------------

class ToyNet(nn.Module):
    """d_in -> widths... -> 1 with tanh, a buffer that scales the input (it must be broadcast too), and
    optionally a frozen first layer and a layer that forward never uses."""

    def __init__(self, d_in=16, widths=(32, 24), frozen_first=False, unused_layer=False):
        super().__init__()
        self.register_buffer("input_scale", 1.0 + 0.5 * torch.randn(d_in))   # (d_in,)
        dims = (d_in, *widths)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(dims[-1], 1)
        self.unused = nn.Linear(dims[-1], 3) if unused_layer else None
        if frozen_first:
            self.layers[0].requires_grad_(False)

    def forward(self, x):                        # x: (batch, d_in) -> (batch, 1)
        x = x * self.input_scale
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


@dataclass(frozen=True)
class Case:
    build: object          # () -> nn.Module (called after seeding)
    tokens: bool = False   # the model takes token ids (a GPT), else (batch, 16) floats
    cap_mb: float = 0.0    # DDPBucketed's bucket_size_mb (0: the run's bucket_size_mb)
    steps: int = 0         # steps (0: the run's steps)


def _tiny_gpt():
    return GPT(GPTConfig(vocab_size=17, block_size=8, n_layer=1, n_head=2, n_embd=16))


CASES = {
    "mlp": Case(lambda: ToyNet()),
    "tied": Case(_tiny_gpt, tokens=True),                                 # lm_head.weight is wte.weight
    "frozen": Case(lambda: ToyNet(frozen_first=True)),
    "uneven": Case(lambda: ToyNet(d_in=16, widths=(200, 3, 60)), cap_mb=2.5e-3),  # 13.6 kB, 12 B, ... in 2.6 kB buckets
    "tiny_cap": Case(lambda: ToyNet(), cap_mb=1e-6),                      # 1 byte: every parameter alone
    "one_bucket": Case(lambda: ToyNet(), cap_mb=100.0),                   # everything in one bucket
    "unused": Case(lambda: ToyNet(unused_layer=True)),                    # a layer that gets no gradient
    "reshuffled": Case(lambda: ToyNet(widths=(40, 40)), steps=6),         # more steps, a new batch order each
}


def global_batch(case: Case, step: int, world_size: int, per_rank: int, seed: int):
    """Step's whole batch, identical on every rank, in a new shuffled order every step."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    n = world_size * per_rank
    order = torch.randperm(n, generator=g)
    if case.tokens:
        x = torch.randint(0, 17, (n, 8), generator=g)
        return x[order], torch.roll(x, -1, dims=1)[order]
    x, y = data.regression_task(n, 16, g)      # the course's synthetic task (labs 01 and 03)
    return x[order], y[order]


def loss_of(model, case: Case, x, y):
    if case.tokens:
        return model(x, y)[1]
    return F.mse_loss(model(x), y)


# --- recording what the student's code calls ---------------------------------------------------------------------

@contextlib.contextmanager
def default_group(group):
    """Let ``group`` stand in as the default process group (None: leave it). Code that calls collectives
    without a group argument then runs on group's ranks; its ranks are 0..n-1, so ranks agree."""
    if group is None:
        yield
        return
    world = c10d._world
    saved = world.default_pg
    world.default_pg = group
    try:
        yield
    finally:
        world.default_pg = saved


def torch_bucket_assignment(calls: list):
    """An ``assign_buckets(param_bytes, bucket_size_mb)`` that answers with PyTorch's own assignment (DDP's:
    parameters in the given order, a bucket closed once it holds at least the cap) and records its calls."""
    def assign_buckets(param_bytes, bucket_size_mb):
        sizes = [int(b) for b in param_bytes]
        calls.append({"param_bytes": sizes, "bucket_size_mb": float(bucket_size_mb)})
        tensors = [torch.empty(max(1, b // 4)) for b in sizes]
        buckets, _ = dist._compute_bucket_assignment_by_size(tensors, [max(1, int(bucket_size_mb * MIB))])
        return sorted((list(b) for b in buckets), key=min)
    return assign_buckets


def load_impl(path: str, required: tuple[str, ...] = ()):
    """The exercise module at path, loaded fresh, with its folder importable: exercise 3's module imports
    exercise 2's ``assign_buckets`` from ``buckets_impl.py`` beside it. Modules from that folder loaded
    earlier (an older ``buckets_impl``) are dropped first, so the file as last written is what runs."""
    folder = str(require_file(path).parent)
    for name, module in list(sys.modules.items()):
        if os.path.dirname(str(getattr(module, "__file__", "") or "")) == folder:
            del sys.modules[name]
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return load_module(path, required=required)


def load_bucketed_impl(path: str):
    """Exercise 3's module with a stand-in for exercise 2's ``buckets_impl`` (it imports ``assign_buckets`` from
    there): a missing or broken exercise 2 cannot cost exercise 3 its points; ``probe_case`` replaces the
    module's ``assign_buckets`` with PyTorch's assignment anyway."""
    stand_in = types.ModuleType("buckets_impl")
    stand_in.assign_buckets = torch_bucket_assignment([])
    saved = sys.modules.get("buckets_impl")
    sys.modules["buckets_impl"] = stand_in
    try:
        return load_impl(path, required=("DDPBucketed",))
    finally:
        if saved is None:
            sys.modules.pop("buckets_impl", None)
        else:
            sys.modules["buckets_impl"] = saved


def zero_grad_(params) -> None:
    for p in params:
        p.grad = None


LR = 0.1   # the probe's SGD learning rate (the wrapper and the reference alike)


def sgd_step_(params, lr: float = LR) -> None:
    """Plain SGD, p <- p - lr * grad, the same arithmetic as torch.optim.SGD without momentum. Not torch.optim
    itself: its first use imports torch._dynamo, seconds of CPU in every rank of every graded run."""
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)


def unique_trainable(model: nn.Module) -> list[torch.nn.Parameter]:
    """Trainable parameters, each once (a tied weight is one parameter), in registration order."""
    return [p for p in model.parameters() if p.requires_grad]


def probe_case(impl, wrapper: str, case_name: str, env, group=None, steps: int | None = None,
               bucket_size_mb: float = 0.05, per_rank: int = 8, seed: int = 0) -> dict:
    """Train the student's wrapper on one case on group's ranks (world size 1 in a notebook) and record it.

    Returns what the checks compare: the broadcast bytes at construction against the model's parameter and
    buffer bytes, whether ``.module`` and ``parameters()`` are the model's, per step the all-reduces (bytes,
    async, launched before ``backward()`` returned), the calls to assign_buckets, the buckets PyTorch would
    form, and the largest distance, over the steps, of the weights from the single-process reference and
    between the ranks.
    """
    case = CASES[case_name]
    steps = case.steps or steps or 3
    cap = case.cap_mb or bucket_size_mb
    world_size = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    torch.manual_seed(seed * 100 + 1 + rank)              # every rank starts from different weights...
    model = case.build().to(env.device)
    torch.manual_seed(seed * 100 + 1)                     # ...and rank 0's are the reference's
    reference = case.build().to(env.device)
    out = {"case": case_name, "world_size": world_size, "steps": steps, "cap_mb": cap, "error": None}
    recorder, assign_calls = counting.CollectiveLog(phase="init"), []
    if wrapper == "bucketed":
        impl.assign_buckets = torch_bucket_assignment(assign_calls)
        ready = [p.numel() * p.element_size() for p in reversed(unique_trainable(model))]
        out["expected_param_bytes"] = ready
        expected = torch_bucket_assignment([])(ready, cap)
        out["expected_bucket_bytes"] = sorted(sum(ready[i] for i in b) for b in expected)
    out["n_trainable"] = len(unique_trainable(model))
    out["state_bytes"] = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    steps_out = []
    try:
        with default_group(group), counting.count_collectives(recorder):
            ddp = getattr(impl, WRAPPERS[wrapper])(model, cap) if wrapper == "bucketed" else \
                getattr(impl, WRAPPERS[wrapper])(model)
            out["broadcast_bytes"] = recorder.bytes("broadcast")
            out["module_is_model"] = getattr(ddp, "module", None) is model
            out["parameters_are_model_s"] = [id(p) for p in ddp.parameters()] == [id(p) for p in model.parameters()]
            params, ref_params = list(ddp.parameters()), list(reference.parameters())
            diffs, spreads = [], []
            max_grad, max_weight = 0.0, max(p.abs().max().item() for p in ref_params)
            for step in range(steps):
                x, y = global_batch(case, step, world_size, per_rank, seed)
                xr, yr = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
                zero_grad_(params)
                first = len(recorder.calls)
                recorder.phase = "backward"
                loss_of(ddp, case, xr.to(env.device), yr.to(env.device)).backward()
                backward_done = time.perf_counter()
                with_grad = sum(p.grad is not None for p in unique_trainable(model))
                recorder.phase = "after_backward"
                ddp.finish_gradient_synchronization()
                recorder.phase = "step"
                sgd_step_(params)
                reduces = [c for c in recorder.calls[first:] if c.name == "all_reduce"]
                steps_out.append({"all_reduce_bytes": [c.bytes for c in reduces],
                                  "all_async": all(c.asynchronous for c in reduces),
                                  "launched_before_backward_returned": sum(c.launched_s < backward_done for c in reduces),
                                  "n_all_reduce": len(reduces), "params_with_grad": with_grad})
                # The reference, in lockstep: rank 0's initial weights trained by one process on the whole batch.
                zero_grad_(ref_params)
                loss_of(reference, case, x.to(env.device), y.to(env.device)).backward()
                max_grad = max(max_grad, *(p.grad.abs().max().item() for p in ref_params if p.grad is not None))
                sgd_step_(ref_params)
                max_weight = max(max_weight, *(p.abs().max().item() for p in ref_params))
                recorder.phase = "check"
                diffs.append(max_abs_diff(model, reference))
                spreads.append(weight_spread(model, env))     # 0.0: bit-identical on every rank of the group
        out["max_abs_diff_per_step"] = diffs
        out["max_abs_diff_vs_single_process"] = max(diffs)
        out["weight_spread_across_ranks"] = max(spreads)
        out["max_abs_weight"], out["max_abs_grad"] = max_weight, max_grad
        # How far the wrapper may end from the reference: float32 rounding only. The two sum the same terms in another
        # order (each rank its per_rank samples, then the ranks); the longest float32 sum behind a gradient element is
        # the global batch's elements (samples x tokens) plus a dot product over the widest parameter dimension, plus
        # the two divisions of the mean. The models are smooth (tanh, GELU), as the bound requires.
        out["longest_sum"] = (x.shape[0] * (x.shape[1] if case.tokens else 1)
                              + max(max(p.shape) for p in ref_params) + 2)
        out["rounding_bound"] = sgd_rounding_bound(steps, LR, out["longest_sum"], max_grad, max_weight)
        out["buffers_equal_reference"] = all(torch.equal(a, b) for a, b in zip(model.buffers(), reference.buffers()))
    except Exception as exc:  # noqa: BLE001 - a wrong answer is a result to report, not a crash of the run
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["steps_recorded"] = steps_out
    out["assign_calls"] = assign_calls
    return out


def probe_without_processes(impl, wrapper: str, cases=("mlp", "tied", "unused")) -> list[dict]:
    """probe_case at world size 1 in this process (a gloo group of one, torn down after): a quick look
    before a real run, never a replacement for it."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        env = DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo")
        return [probe_case(impl, wrapper, case, env, steps=2) for case in cases]
    finally:
        if owned:
            dist.destroy_process_group()


def check_probe(r, wrapper: str) -> None:
    """The graded checks of one probe_case result (at any world size); each failure says what and why."""
    where = f"{WRAPPERS[wrapper]} on {r['world_size']} rank(s), case '{r['case']}'"
    if r["error"] is not None:
        refused = (wrapper == "bucketed" and r["case"] == "unused" and not r["error"].startswith("NotImplementedError")
                   and any(w in r["error"].lower() for w in ("unused", "no grad", "did not receive")))
        checks.check_true(refused, f"{where}: raised {r['error']}",
                          hint="the traceback names the line; a parameter without a gradient must be handled or "
                               "refused with an error that says so, never a hang")
        return
    checks.check_true(r["module_is_model"], f"{where}: .module must be the wrapped model itself")
    checks.check_true(r["parameters_are_model_s"], f"{where}: parameters() must be the module's parameters, in order",
                      hint="register the model as a submodule (self.module = module) and no parameters of your own")
    checks.check_true(not 0 < r["broadcast_bytes"] < r["state_bytes"],
                      f"{where}: broadcast {r['broadcast_bytes']} of the model's {r['state_bytes']} bytes of "
                      f"parameters and buffers", hint="broadcast every parameter (frozen ones too) and every buffer")
    for i, step in enumerate(r["steps_recorded"]):
        at = f"{where}, step {i}"
        checks.check_true(step["n_all_reduce"] > 0, f"{at}: no all-reduce was called",
                          hint="all-reduce with dist.all_reduce, even on one rank")
        checks.check_true(step["all_async"], f"{at}: an all-reduce was blocking",
                          hint="start it with async_op=True and wait for the handle in finish_gradient_synchronization")
        if r["case"] != "unused":
            checks.check_equal(step["launched_before_backward_returned"], step["n_all_reduce"],
                               f"{at}: all-reduces launched before loss.backward() returned (no overlap otherwise)",
                               hint="launch from a hook that runs inside backward (register_post_accumulate_grad_hook)")
        if wrapper == "individual":
            checks.check_equal(step["n_all_reduce"], step["params_with_grad"],
                               f"{at}: all-reduces per step (one per parameter with a gradient; a tied weight is one)",
                               hint="register one hook per distinct trainable parameter")
        else:
            checks.check_equal(sorted(step["all_reduce_bytes"]), r["expected_bucket_bytes"],
                               f"{at}: bytes of each bucket's all-reduce (one flat buffer per bucket)",
                               hint="for this check assign_buckets is PyTorch's own assignment; use what it returns")
    if wrapper == "bucketed":
        checks.check_equal([c["param_bytes"] for c in r["assign_calls"]], [r["expected_param_bytes"]],
                           f"{where}: assign_buckets calls (sizes in bytes, in the order gradients become ready)",
                           hint="call it once, with the trainable parameters in reverse registration order")
    checks.check_close(r["max_abs_diff_vs_single_process"], 0.0,
                       f"{where}: max |w - w_single-process| over {r['steps']} steps (after each); float32 rounding "
                       f"allows {r['rounding_bound']:.1e} (rankcheck.sgd_rounding_bound)",
                       rtol=0, atol=r["rounding_bound"],
                       hint="rank 0's initial state on every rank, then the mean (not the sum) of the gradients")
    checks.check_equal(r["weight_spread_across_ranks"], 0.0, f"{where}: weights must be identical on every rank "
                       f"after every step")
