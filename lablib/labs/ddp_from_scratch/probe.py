"""Lab 06's probe of the students' ``DDPIndividualParameters`` and ``DDPBucketed``: what their classes do on
the ranks, and the graded checks of it (``run_ddp_scratch`` runs it on 2-4 ranks; the notebook runs
``probe_without_processes`` at world size 1 first, a quick pre-check before a torchrun start).

For every case (a small model; see ``CASES``) the student's wrapper trains a few SGD steps, each on a new
shuffled global batch split evenly over the ranks. Every rank starts from *different* weights (seeded with
its rank), so only a wrapper that broadcasts rank 0's parameters and buffers can end where the reference
does: a single process that trains rank 0's initial model on each whole global batch, compared after every
step. What is recorded per step comes from ``lablib.measure.counting`` (every collective the student's code called,
when it was launched and finished, whether it was asynchronous) and when ``loss.backward()`` returned; so
overlap is seen in the order of events, never assumed from a duration.

For ``DDPBucketed`` the module's ``assign_buckets`` is replaced, for the probe, by PyTorch's own bucket
assignment (``lablib.parallel.ddp_buckets.torch_bucket_assignment``, the one DDP uses), so the class is graded
whatever the student's ``assign_buckets`` returns; the sizes it was called with are recorded. No exercise's answer is here: the
references are PyTorch's bucket assignment and a single process.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from lablib import checks
from lablib.jobs.distenv import DistEnv
from lablib.jobs.exercise import load_fresh as load_impl  # noqa: F401 - the notebook's loader (ddp_probes.load_impl)
from lablib.labs.ddp_from_scratch import order as ddp_order
from lablib.labs.ddp_from_scratch.cases import CASES, global_batch, loss_of, reference_loss
from lablib.labs.ddp_from_scratch.cases import readiness_case  # noqa: F401 - the hidden checks' readiness orders
from lablib.measure import counting
from lablib.measure.rankcheck import (FP32_UNIT_ROUNDOFF, FP64_UNIT_ROUNDOFF, max_abs_diff, sgd_rounding_bound,
                                      weight_spread)
from lablib.parallel.ddp_buckets import load_bucketed_impl  # noqa: F401 - the notebook's loader of exercise 3
from lablib.parallel.ddp_buckets import torch_bucket_assignment, use_torch_assignment
from lablib.probes.harness import LR, default_group, sgd_step_, unique_trainable, zero_grad_

WRAPPERS = {"individual": "DDPIndividualParameters", "bucketed": "DDPBucketed"}


# --- recording what the student's code calls ---------------------------------------------------------------------

@contextlib.contextmanager
def watch_waits(recorder, waits: list):
    """Record the log's phase at every ``Work.wait`` and ``Future.wait`` called inside (opened inside
    ``count_collectives``, whose own ``Work.wait`` it wraps and restores)."""
    work_wait, future_wait = c10d.Work.wait, torch.Future.wait

    def on_work(self, *args, **kwargs):
        waits.append(recorder.phase)
        return work_wait(self, *args, **kwargs)

    def on_future(self, *args, **kwargs):
        waits.append(recorder.phase)
        return future_wait(self, *args, **kwargs)

    c10d.Work.wait, torch.Future.wait = on_work, on_future
    try:
        yield waits
    finally:
        c10d.Work.wait, torch.Future.wait = work_wait, future_wait


CLEARS = ("set_to_none", "set_to_none=False", "accumulated")   # how the loop leaves .grad before each step


class _Through:
    """The wrapper as the probe's loss sees it, every forward through ``call`` (e.g. a hidden check's, which compares
    the arguments before and after)."""

    def __init__(self, module, call, what):
        self.module, self.call, self.what = module, call, what

    def __call__(self, *args, **kwargs):
        return self.call(self.module, *args, what=self.what, **kwargs)

    def parameters(self):
        return self.module.parameters()


def _clear(params, clear: str) -> None:
    """What the training loop does to .grad before a step: ``set_to_none`` (zero_grad's default: None),
    ``set_to_none=False`` (zero tensors where there was a gradient), ``accumulated`` (nothing: the gradients of
    every step so far add up, as over the micro-batches of gradient accumulation with a sync each)."""
    if clear == "set_to_none":
        zero_grad_(params)
    elif clear == "set_to_none=False":                  # what Module.zero_grad(set_to_none=False) does to each
        for p in params:                                # (torch/nn/modules/module.py:2971-2975)
            if p.grad is not None:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()


def probe_case(impl, wrapper: str, case_name, env, group=None, steps: int | None = None,
               bucket_size_mb: float = 0.05, per_rank: int = 8, seed: int = 0, clear: str = "set_to_none",
               call=None) -> dict:
    """Train the student's wrapper on one case on group's ranks (world size 1 in a notebook) and record it.

    Returns what the checks compare: the broadcast bytes at construction against the model's parameter and
    buffer bytes, whether ``.module`` and ``parameters()`` are the model's, per step the order of events
    (``order``: gradients becoming final, all-reduces launched, waits, backward's return), which
    gradients are None after the synchronization and which parameters no rank used, the calls to assign_buckets,
    the buckets PyTorch would form, and the largest distance, over the steps, of the weights from the
    single-process reference and between the ranks. ``probe_steps`` is the same, one step at a time.
    """
    out = None
    for out in probe_steps(impl, wrapper, case_name, env, group, steps, bucket_size_mb, per_rank, seed, clear, call):
        pass
    return out


def probe_steps(impl, wrapper: str, case_name, env, group=None, steps: int | None = None,
                bucket_size_mb: float = 0.05, per_rank: int = 8, seed: int = 0, clear: str = "set_to_none",
                call=None):
    """``probe_case`` one step at a time, on the same wrapper: yields the record so far after each step (and once,
    with ``error`` set, where the wrapper raised). ``case_name``: a name in ``CASES`` or a ``Case``; ``clear``: how
    the loop leaves .grad before each step (``CLEARS``), the wrapper and the single-process reference alike;
    ``call(fn, *args, mutable=..., what=..., **kwargs)``, if given, makes the wrapper's construction and every
    forward (a hidden check's ``HiddenCheck.call``)."""
    case = CASES[case_name] if isinstance(case_name, str) else case_name
    clear = case.clear or clear                           # a case that fixes it (routed_accumulated) wins
    if clear not in CLEARS:
        raise ValueError(f"clear={clear!r} must be one of {CLEARS}")
    steps = case.steps or steps or 3
    cap = case.cap_mb or bucket_size_mb
    world_size = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    torch.manual_seed(seed * 100 + 1 + rank)              # every rank starts from different weights...
    model = case.build().to(env.device)
    torch.manual_seed(seed * 100 + 1)                     # ...and rank 0's are the reference's
    reference = case.build().to(env.device)
    name = case_name if isinstance(case_name, str) else type(model).__name__
    out = {"case": name, "world_size": world_size, "steps": steps, "cap_mb": cap, "error": None, "clear": clear}
    recorder, assign_calls, waits, ready = counting.CollectiveLog(phase="init"), [], [], []
    ready_order = list(reversed(unique_trainable(model)))  # the order the contract assumes (a tied weight once)
    out["param_bytes"] = [p.numel() * p.element_size() for p in ready_order]
    for i, p in enumerate(ready_order):                   # registered before the student's hooks: runs first
        p.register_post_accumulate_grad_hook(lambda _, i=i: ready.append((time.perf_counter(), i)))
    if wrapper == "bucketed":
        use_torch_assignment(impl, assign_calls)
        out["expected_buckets"] = torch_bucket_assignment([])(out["param_bytes"], cap)
        out["expected_bucket_bytes"] = [sum(out["param_bytes"][i] for i in b) for b in out["expected_buckets"]]
    out["n_trainable"] = len(ready_order)
    out["state_bytes"] = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    out["steps_recorded"] = steps_out = []
    out["assign_calls"] = assign_calls
    make = call or (lambda fn, *args, mutable=(), what="", **kwargs: fn(*args, **kwargs))
    try:
        with default_group(group), counting.count_collectives(recorder), watch_waits(recorder, waits):
            cls = getattr(impl, WRAPPERS[wrapper])
            ddp = make(cls, model, cap, mutable=(0,), what=cls.__name__) if wrapper == "bucketed" else \
                make(cls, model, mutable=(0,), what=cls.__name__)
            forward = ddp if call is None else _Through(ddp, call, f"{cls.__name__}.forward")
            out["broadcast_bytes"] = recorder.bytes("broadcast")
            out["module_is_model"] = getattr(ddp, "module", None) is model
            out["parameters_are_model_s"] = [id(p) for p in ddp.parameters()] == [id(p) for p in model.parameters()]
            params, ref_params = list(ddp.parameters()), list(reference.parameters())
            diffs, spreads = [], []
            max_grad, max_weight = 0.0, max(p.abs().max().item() for p in ref_params)
            # How far the wrapper may end from the reference: rounding only. The two sum the same terms in another
            # order (each rank its per_rank samples, then the ranks); the longest sum behind a gradient element is
            # the global batch's elements (samples x tokens) plus a dot product over the widest parameter dimension,
            # plus the two divisions of the mean, plus, where the loop accumulates, one term per step so far. The
            # models are smooth (tanh, GELU), as the bound requires.
            u = FP64_UNIT_ROUNDOFF if ref_params[0].dtype == torch.float64 else FP32_UNIT_ROUNDOFF
            for step in range(steps):
                x, y = global_batch(case, step, world_size, per_rank, seed)
                longest = (x.shape[0] * (x.shape[1] if case.tokens else 1) + max(max(p.shape) for p in ref_params) + 2
                           + (steps if clear == "accumulated" else 0))
                xr, yr = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
                _clear(params, clear)
                none_before = [p.grad is None for p in ready_order]
                first, ready[:], waits[:] = len(recorder.calls), [], []
                recorder.phase = "forward"
                t0 = time.perf_counter()
                loss = loss_of(forward, case, xr.to(env.device), yr.to(env.device))
                recorder.phase = "backward"
                loss.backward()
                backward_done = time.perf_counter()
                recorder.phase = "after_backward"
                ddp.finish_gradient_synchronization()
                recorder.phase = "step"
                grad_is_none = [p.grad is None for p in ready_order]
                sgd_step_(params)
                reduces = [c for c in recorder.calls[first:] if c.name == "all_reduce"]
                recorder.phase = "check"
                used = torch.zeros(len(ready_order), device=env.device)
                used[[i for _, i in ready]] = 1.0
                if dist.is_initialized():
                    dist.all_reduce(used)                 # the probe's own: how many ranks used each parameter
                steps_out.append({
                    "bytes": [c.bytes for c in reduces], "launched": [c.launched_s - t0 for c in reduces],
                    "async_in_backward": all(c.asynchronous for c in reduces if c.launched_s < backward_done),
                    "ready": [(t - t0, i) for t, i in ready], "backward_done": backward_done - t0,
                    "waits_in_backward": sum(phase in ("forward", "backward") for phase in waits),
                    "waits_after_backward": sum(phase == "after_backward" for phase in waits),
                    "async_reduces": sum(c.asynchronous for c in reduces),
                    "grad_is_none": grad_is_none, "grad_was_none": none_before,
                    "globally_unused": [i for i, n in enumerate(used.tolist()) if n == 0]})
                # The reference, in lockstep: rank 0's initial weights trained by one process on the whole batch.
                _clear(ref_params, clear)
                reference_loss(reference, case, x.to(env.device), y.to(env.device), world_size).backward()
                max_grad = max(max_grad, *(p.grad.abs().max().item() for p in ref_params if p.grad is not None))
                sgd_step_(ref_params)
                max_weight = max(max_weight, *(p.abs().max().item() for p in ref_params))
                diffs.append(max_abs_diff(model, reference))
                spreads.append(weight_spread(model, env))     # 0.0: bit-identical on every rank of the group
                out["max_abs_diff_per_step"] = diffs
                out["max_abs_diff_vs_single_process"] = max(diffs)
                out["weight_spread_across_ranks"] = max(spreads)
                out["max_abs_weight"], out["max_abs_grad"] = max_weight, max_grad
                out["longest_sum"] = longest
                out["rounding_bound"] = sgd_rounding_bound(step + 1, LR, longest, max_grad, max_weight, u)
                out["buffers_equal_reference"] = all(torch.equal(a, b) for a, b in zip(model.buffers(),
                                                                                        reference.buffers()))
                out["steps_done"] = step + 1
                yield out
    except checks.CheckFailed:
        raise                                             # a hidden check's verdict on an argument: not the run's
    except Exception as exc:  # noqa: BLE001 - a wrong answer is a result to report, not a crash of the run
        out["error"] = f"{type(exc).__name__}: {exc}"
        yield out


@contextlib.contextmanager
def stepping(*args, **kwargs):
    """``probe_steps(*args, **kwargs)`` as a function that runs the next step and returns the record so far; the
    probe's patches (counting, the default group) are undone when the block ends, whatever happened in it."""
    steps = probe_steps(*args, **kwargs)
    try:
        yield lambda: next(steps)
    finally:
        steps.close()


@contextlib.contextmanager
def one_rank():
    """A gloo group of one in this process (torn down after, unless one was there already): yields its DistEnv."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo")
    finally:
        if owned:
            dist.destroy_process_group()


def probe_without_processes(impl, wrapper: str, cases=("mlp", "tied", "unused"), check=None) -> list[dict]:
    """probe_case at world size 1 in this process (a gloo group of one, torn down after): a quick look
    before a real run, never a replacement for it. ``check(result)``, if given, runs after each case."""
    with one_rank() as env:
        out = []
        for case in cases:
            out.append(probe_case(impl, wrapper, case, env, steps=2))
            if check is not None:
                check(out[-1])     # the first wrong case ends it
        return out


def check_probe(r, wrapper: str) -> None:
    """The graded checks of one probe_case result (at any world size); each failure says what and why."""
    where = f"{WRAPPERS[wrapper]} on {r['world_size']} rank(s), case '{r['case']}'" + \
        (f", .grad left by the loop as after {r['clear']}" if r.get("clear", "set_to_none") != "set_to_none" else "")
    checks.check_true(r["error"] is None, f"{where}: raised {r['error']}",
                      hint="the traceback names the line; a parameter without a gradient must be handled, never a "
                           "hang (on several ranks a mismatch of the ranks' all-reduces shows up as gloo's 'Received "
                           "data size doesn't match' or a timeout)")
    checks.check_true(r["module_is_model"], f"{where}: .module must be the wrapped model itself")
    checks.check_true(r["parameters_are_model_s"], f"{where}: parameters() must be the module's parameters, in order",
                      hint="register the model as a submodule (self.module = module) and no parameters of your own")
    checks.check_true(not 0 < r["broadcast_bytes"] < r["state_bytes"],
                      f"{where}: broadcast {r['broadcast_bytes']} of the model's {r['state_bytes']} bytes of "
                      f"parameters and buffers", hint="broadcast every parameter (frozen ones too) and every buffer")
    n = r["n_trainable"]
    for i, step in enumerate(r["steps_recorded"]):
        at = f"{where}, step {i}"
        checks.check_true(step["bytes"], f"{at}: no all-reduce was called", hint="all-reduce with dist.all_reduce, even on one rank")
        checks.check_true(step["async_in_backward"], f"{at}: an all-reduce inside the backward was blocking",
                          hint="start it with async_op=True and wait for the handle in finish_gradient_synchronization")
        if wrapper == "individual":
            with_grad = len(step["ready"])
            checks.check_true(len(step["bytes"]) in (with_grad, n),
                              f"{at}: {ddp_order.plural(len(step['bytes']), 'all-reduce')} for "
                              f"{ddp_order.plural(with_grad, 'gradient')} ({ddp_order.plural(n, 'trainable parameter')})",
                              hint="one per distinct trainable parameter (a tied weight is one)")
            problems = ddp_order.individual_problems(step, r["param_bytes"])
        else:
            order = ddp_order.launch_order_problems(step, r["expected_bucket_bytes"], n)
            checks.check_true(not order, f"{at}: launch order: " + "; ".join(order),
                              hint="every rank must issue the same all-reduces in the same order: buckets strictly in "
                                   "index order, each every step (a parameter unused on this rank as zeros, marked "
                                   "ready at the end of the forward)")
            problems = ddp_order.bucket_problems(step, r["expected_buckets"], r["expected_bucket_bytes"], n)
            was_none = step.get("grad_was_none", [True] * n)
            kept = [i for i in step["globally_unused"] if was_none[i] and not step["grad_is_none"][i]]
            checks.check_true(not kept, f"{at}: parameters that no rank used this step (indices {kept} in reverse "
                              f"registration order; .grad was None before it) have a "
                              f".grad after the synchronization", hint="leave .grad None where no rank produced a "
                              "gradient, as DDP does (zeros would still be decayed by AdamW): all-reduce a usage map, "
                              "this step's (nothing kept from an earlier step)")
        problems += ddp_order.wait_problems(step)
        waited, started = step.get("waits_after_backward", 0), step.get("async_reduces", 0)
        if waited < started:
            problems.append(f"finish_gradient_synchronization waited {ddp_order.plural(waited, 'time')} for "
                            f"{ddp_order.plural(started, 'asynchronous all-reduce')}: every handle must be waited "
                            f"for (one finished says nothing of the others), or a .grad may be read before its "
                            f"all-reduce has written it")
        first = r["steps_recorded"][0]
        if i and step.get("waits_after_backward", 0) * max(len(first["bytes"]), 1) > \
                first.get("waits_after_backward", 0) * max(len(step["bytes"]), 1):
            problems.append(f"finish_gradient_synchronization waited {step['waits_after_backward']} times for "
                            f"{ddp_order.plural(len(step['bytes']), 'all-reduce')} in this step, and "
                            f"{first['waits_after_backward']} times for {len(first['bytes'])} in the first: handles "
                            f"(or buckets) of earlier steps are kept and waited for again")
        checks.check_true(not problems, f"{at}: overlap: " + "; ".join(problems),
                          hint="all-reduces start inside the backward, from the hooks, and are waited for after it")
    if wrapper == "bucketed":
        checks.check_equal([c["param_bytes"] for c in r["assign_calls"]], [r["param_bytes"]],
                           f"{where}: assign_buckets calls (sizes in bytes, in the order gradients become ready)",
                           hint="call it once, with the trainable parameters in reverse registration order")
    checks.check_close(r["max_abs_diff_vs_single_process"], 0.0,
                       f"{where}: max |w - w_single-process| over {r.get('steps_done', r['steps'])} steps (after each); rounding "
                       f"allows {r['rounding_bound']:.1e} (rankcheck.sgd_rounding_bound)",
                       rtol=0, atol=r["rounding_bound"],
                       hint="rank 0's initial state on every rank, then the mean (not the sum) of the gradients")
    checks.check_equal(r["weight_spread_across_ranks"], 0.0, f"{where}: weights must be identical on every rank "
                       f"after every step")
