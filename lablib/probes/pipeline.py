"""Lab 09's graded checks: the properties of a schedule (exercise 1), and the probe of the students' engine.

``check_schedule`` grades a schedule by what any GPipe or 1F1B order must do, with no reference order: every
forward and backward once per stage, in micro-batch order, F j before B j, GPipe's forwards first, 1F1B's stage
s holding at most min(p - s, m) micro-batches, and, played by ``lablib.parallel.pipeline.play``, no deadlock and the step
over in (m + p - 1)(t_f + t_b). (For p <= 4 and m <= 5 these leave exactly one 1F1B order; the tests count them.)

``probe_engine`` runs one training step of the student's ``pipeline_step`` on this rank's stage of the
course GPT (``lablib.parallel.pipeline.gpt_stages``), with the op lists it is given (the notebook writes them out for
the visible cases; never the student's exercise 1), and records

- the order in which the stage really ran forwards and backwards (module hooks and an identity autograd
  function on the stage's output, so the check sees what ran, not what the engine says);
- per operation when it started and ended (the Gantt chart), and the saved-activation bytes of each
  micro-batch's forward (``lablib.measure.memory.SavedActivations``);
- every send/recv the engine called, with its peer and launch/done times (``lablib.measure.counting``);
- the stage's gradients and the micro-batches' losses.

The ranks start the step together (a barrier once everything before it is built), and the engine runs on a
process group of its own with a short timeout (``p2p_timeout_s``): a schedule that deadlocks ends there on
every waiting rank, and each rank's still-pending send/recv (peer, bytes, since when) goes to rank 0 through
the job's TCP store, which the broken group does not need. ``deadlock_message`` says which ranks waited on
which. The single-process reference (the whole GPT on the whole batch) is computed on rank 0;
``check_engine`` compares.
"""

from __future__ import annotations

import contextlib
import datetime
import numbers
import os
import pickle
import sys
import time
import traceback
from collections import Counter

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from lablib import checks
from lablib.measure import counting
from lablib.parallel import pipeline
from lablib.probes.ddp import default_group
from lablib.jobs.distenv import DistEnv
from lablib.jobs.exercise import load_module
from lablib.measure.memory import SavedActivations
from lablib.course.models import GPT, GPTConfig

SMALL = GPTConfig(vocab_size=17, block_size=8, n_layer=4, n_head=2, n_embd=16)


def load_engine(path: str):
    """Exercise 2's module (``pipeline_step``), as the notebook cell last wrote it."""
    return load_module(path, required=("pipeline_step",))


def parse_case(case: str) -> tuple[str, int, int]:
    """"1f1b:3:5" -> ("1f1b", 3, 5): schedule, stages, micro-batches."""
    kind, p, m = case.split(":")
    if kind not in pipeline.KINDS:
        raise ValueError(f"case {case!r}: the schedule must be one of {pipeline.KINDS}")
    return kind, int(p), int(m)


# --- exercise 1: what a schedule must do -------------------------------------------------------------------------

FUNCTIONS = {"gpipe": "gpipe_schedule", "1f1b": "one_f_one_b_schedule"}


def check_schedule(kind: str, orders, n_stages: int, n_microbatches: int, what: str = "") -> None:
    """The graded properties of a student's GPipe or 1F1B schedule for (p, m) (the module docstring); raises
    ``checks.CheckFailed`` at the first that fails, saying which stage and what came back."""
    p, m = n_stages, n_microbatches
    what = what or f"{FUNCTIONS[kind]}({p}, {m})"
    checks.check_true(isinstance(orders, (list, tuple)) and len(orders) == p,
                      f"{what}: one list of operations per stage, {p} in all; got {_short(orders)}")
    all_ops = sorted([("F", j) for j in range(m)] + [("B", j) for j in range(m)])
    for s, rank_ops in enumerate(orders):
        ops = _as_ops(rank_ops, f"{what}, stage {s}")
        extra = sorted(set(ops) - set(all_ops)) + [op for op, n in Counter(ops).items() if n > 1]
        missing = sorted(set(all_ops) - set(ops))
        checks.check_true(not extra and not missing, f"{what}, stage {s}: every ('F', j) and ('B', j) for j in "
                          f"0..{m - 1} exactly once; missing {pipeline.ops_text(missing) or 'none'}, not wanted or "
                          f"twice {pipeline.ops_text(sorted(set(extra))) or 'none'}  ({pipeline.ops_text(ops)})")
        for k, name in (("F", "forwards"), ("B", "backwards")):
            checks.check_equal([j for kind_, j in ops if kind_ == k], list(range(m)),
                               f"{what}, stage {s}: the {name}' micro-batches, in the order the stage runs them",
                               hint="micro-batches go through the pipeline in order, 0 first")
        at = {op: i for i, op in enumerate(ops)}
        early = [j for j in range(m) if at[("B", j)] < at[("F", j)]]
        checks.check_true(not early, f"{what}, stage {s}: the backward of micro-batch {early[0] if early else ''} before its "
                          f"forward ({pipeline.ops_text(ops)})", hint="the backward of j needs the activations "
                          "forward j saved")
        first_backward = min(at[("B", j)] for j in range(m))
        if kind == "gpipe":
            checks.check_true(first_backward == m, f"{what}, stage {s}: GPipe runs every forward before the first "
                              f"backward ({pipeline.ops_text(ops)})")
        else:
            held = pipeline.peak_held(ops)
            checks.check_true(held <= min(p - s, m), f"{what}, stage {s}: holds {held} micro-batches at once "
                              f"(forward run, backward not yet); 1F1B's stage s holds at most min(p - s, m) = "
                              f"{min(p - s, m)}  ({pipeline.ops_text(ops)})",
                              hint="fewer warm-up forwards: a backward as soon as one is possible")
    try:
        played = pipeline.play([_as_ops(o, what) for o in orders])
    except pipeline.Deadlock as exc:
        raise checks.CheckFailed(f"{what}: played in order (lablib.parallel.pipeline.play), the ranks wait for each other: "
                                 f"{'; '.join(exc.waits)}") from None
    end, best = max(op.end for rank_ops in played for op in rank_ops), (m + p - 1) * 3
    checks.check_true(end <= best + 1e-9, f"{what}: played in order with t_f = 1, t_b = 2 the step takes {end:g}, "
                      f"not (m + p - 1)(t_f + t_b) = {best}: a stage waits where it could compute",
                      hint="start each backward as early as its gradient can arrive")


def check_same_schedule(got, expected, what: str, hint: str = "") -> None:
    """got equals expected stage by stage (both lists of ("F"/"B", j) per stage); a failure names the first stage
    and position that differ and shows a few operations around it, not the whole lists."""
    checks.check_true(isinstance(got, (list, tuple)) and len(got) == len(expected),
                      f"{what}: one list of operations per stage, {len(expected)} in all; got {_short(got)}")
    for s, (mine, theirs) in enumerate(zip(got, expected)):
        mine, theirs = _as_ops(mine, f"{what}, stage {s}"), [tuple(op) for op in theirs]
        if mine != theirs:
            i = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            lo = max(0, i - 4)
            checks.check_true(False, f"{what}, stage {s}: differs at operation {i} of {len(theirs)}\n"
                              f"  expected: ... {pipeline.ops_text(theirs[lo:i + 5])} ...\n"
                              f"  got:      ... {pipeline.ops_text(mine[lo:i + 5])} ...", hint)


def _as_ops(rank_ops, what: str) -> list[tuple[str, int]]:
    """A stage's operations as ("F"/"B", j) tuples, or a check failure that says what came back."""
    try:
        ops = [(op[0], op[1]) for op in rank_ops if len(op) == 2]
        if len(ops) == len(rank_ops) and all(k in ("F", "B") and isinstance(j, numbers.Integral)
                                             and not isinstance(j, bool) for k, j in ops):
            return [(str(k), int(j)) for k, j in ops]             # numpy's ints and strings are fine too
    except (TypeError, KeyError, IndexError):
        pass
    raise checks.CheckFailed(f"{what}: a list of ('F', j) / ('B', j) pairs, j an int; got {_short(rank_ops)}")


def _short(value, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + " ..."


@contextlib.contextmanager
def answer_without_module(module, reason: str):
    """Inside the block, any Python code compiled from ``module``'s file raises ``checks.CheckFailed(reason)``
    instead of running: a call of its functions, and a copy of one's code object made before the block, which
    ``checks.answer_without`` (it swaps the functions' code) does not see. The hidden checks call the students'
    functions in it, with the reference they are compared with as the module, and the reference outside."""
    paths = {module.__file__, os.path.realpath(module.__file__)}     # what a code object's co_filename holds
    previous = sys.gettrace()

    def refuse(frame, event, arg):   # called at every Python call inside the block: kept to a set lookup
        if frame.f_code.co_filename in paths:
            raise checks.CheckFailed(reason)
        return None

    sys.settrace(refuse)
    try:
        yield
    finally:
        sys.settrace(previous)


# --- exercise 2: the engine on the ranks ------------------------------------------------------------------------

def case_options(orders_by_case: dict) -> dict:
    """The run's ``cases`` and ``orders`` options from {"1f1b:2:3": per-rank op lists (or "F0 F1 B0 ..." per rank)}."""
    for case, orders in orders_by_case.items():
        check_orders(case, _op_lists(orders))
    return {"cases": tuple(orders_by_case),
            "orders": tuple(pipeline.orders_text(_op_lists(orders)) for orders in orders_by_case.values())}


def check_orders(case: str, orders) -> None:
    """A case's op lists fit it: one list per stage, each op an F or a B of a micro-batch 0..m-1 (ValueError)."""
    _, p, m = parse_case(case)
    if len(orders) != p:
        raise ValueError(f"case {case!r} has {p} stages but its orders have {len(orders)} ranks' lists")
    for r, ops in enumerate(orders):
        bad = [op for op in ops if op[0] not in ("F", "B") or not 0 <= op[1] < m]
        if bad:
            raise ValueError(f"case {case!r}, rank {r}: {bad[0]} is not an F or B of a micro-batch 0..{m - 1}")


def batch(config: GPTConfig, n_microbatches: int, micro_batch: int, seed: int):
    """The step's m micro-batches of token ids and next-token targets, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (n_microbatches * micro_batch, config.block_size), generator=g)
    targets = torch.roll(ids, -1, dims=1)
    return list(ids.split(micro_batch)), list(targets.split(micro_batch))


class _Mark(torch.autograd.Function):
    """Identity; its backward calls ``callback()``: the moment the gradient reaches this tensor."""

    @staticmethod
    def forward(ctx, x, callback):
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.callback()
        return grad, None


class StageRecorder:
    """Hooks on one stage: which forward/backward ran when, and each forward's saved-activation bytes."""

    def __init__(self, stage: torch.nn.Module, mark: bool = True):
        self.stage, self.events, self.grad_times, self.saved_bytes = stage, [], [], []
        self._mark = mark      # False: forwards and saved bytes only (torch's zero-bubble detaches outputs in place)
        self._n_forward, self._saved = 0, None
        self._state = [*stage.parameters(), *stage.buffers()]
        self._handles = [stage.register_forward_pre_hook(self._pre), stage.register_forward_hook(self._post)]
        self._handles += [p.register_post_accumulate_grad_hook(lambda _: self.grad_times.append(time.perf_counter()))
                          for p in stage.parameters()]

    def _pre(self, module, args):
        self._t0 = time.perf_counter()
        self._saved = SavedActivations(exclude=self._state).__enter__()   # parameters are not activations

    def _post(self, module, args, output):
        self._saved.__exit__(None, None, None)
        j = self._n_forward
        self._n_forward += 1
        self.saved_bytes.append(self._saved.bytes)
        self.events.append(["F", j, self._t0, time.perf_counter()])
        if not self._mark:
            return output
        return _Mark.apply(output, lambda: self.events.append(["B", j, time.perf_counter(), None]))

    def close(self) -> list[list]:
        """The events in time order, each backward's end set to the last gradient it produced."""
        for h in self._handles:
            h.remove()
        events = sorted(self.events, key=lambda e: e[2])
        for i, e in enumerate(events):
            if e[0] == "B":
                until = events[i + 1][2] if i + 1 < len(events) else float("inf")
                e[3] = max([t for t in self.grad_times if e[2] <= t < until], default=e[2])
        return events


def reference(config: GPTConfig, inputs, targets, seed: int) -> tuple[dict, list[float]]:
    """The single process: the whole GPT on the whole batch (mean loss); its gradients and micro-batch losses."""
    torch.manual_seed(seed)
    model = GPT(config)
    loss = model(torch.cat(inputs), torch.cat(targets))[1]
    loss.backward()
    with torch.no_grad():
        losses = [model(x, y)[1].item() for x, y in zip(inputs, targets)]
    return pipeline.model_gradients(model), losses


def probe_engine(impl, case: str, orders, env, p2p_timeout_s: float = 15.0, seed: int = 0, micro_batch: int = 2,
                 config: GPTConfig = SMALL, tag: str = "") -> dict:
    """One step of the student's engine on this rank's stage, running ``orders[rank]`` (one op list per stage of
    the case). Every rank of the job calls it, in the same order; rank 0 gets the whole result, the others
    {"ok": ...} (a rank outside the case's p waits for it)."""
    kind, p, m = parse_case(case)
    check_orders(case, orders)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    everyone = c10d._get_default_group() if world > 1 else None
    inputs, targets = batch(config, m, micro_batch, seed)
    shape = (micro_batch, config.block_size, config.n_embd)
    mine = None
    if dist.is_initialized():   # a fresh group per case, with a short timeout: a deadlock breaks only it
        mine = dist.new_group(list(range(p)), timeout=datetime.timedelta(seconds=p2p_timeout_s))
    record = None
    if rank < p:
        torch.manual_seed(seed)
        stage = pipeline.gpt_stages(GPT(config), p)[rank].to(env.device)
        warm_up(stage, inputs[0], targets[0], shape, env.device)
        ops = [tuple(op) for op in orders[rank]]
        recorder, log = StageRecorder(stage), counting.CollectiveLog(phase="step")
        record = {"rank": rank, "ops": ops, "error": None, "losses": None}
    if everyone is not None:    # the step starts on every rank at once: a wait in it is the step's own
        dist.barrier(group=everyone)
    if record is not None:
        t0 = time.perf_counter()
        try:
            with default_group(mine if world > 1 else None), counting.count_collectives(log):
                record["losses"] = [float(x) for x in impl.pipeline_step(stage, list(ops), inputs, targets, shape)]
        except NotImplementedError:   # an unwritten exercise: the course's own message, not a failed check
            raise
        except Exception as exc:   # noqa: BLE001 - recorded for the check, which fails with it
            record["error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()[-600:]
            record["traceback"] = traceback.format_exc()[-2000:]
        record["events"] = [[k, j, a - t0, (b or a) - t0] for k, j, a, b in recorder.close()]
        record["saved_bytes"] = recorder.saved_bytes
        record["p2p"] = [{"function": c.function, "peer": c.peer, "bytes": c.bytes, "launched_s": c.launched_s - t0,
                          "done_s": None if c.done_s is None else c.done_s - t0, "asynchronous": c.asynchronous}
                         for c in log.calls]
        record["grads"] = {name: g.cpu() for name, g in pipeline.stage_gradients(stage).items()}   # nccl: off GPU
        record["t0"] = t0
    if world == 1:
        records = [record]
    else:                       # through the store: the case's group may be broken by a deadlock
        store = c10d._get_default_store()
        if record is not None:
            store.set(f"pp{tag}/{case}/{rank}", pickle.dumps(record))
        records = [pickle.loads(store.get(f"pp{tag}/{case}/{r}")) for r in range(p)]
    return summarize(case, records, config, inputs, targets, seed) if rank == 0 else \
        {"ok": all(r["error"] is None for r in records)}


def warm_up(stage, ids, targets, shape, device) -> None:
    """One forward and backward of the stage, before the step, its gradients dropped: a process's first ones
    cost up to a second under load (measured 0.75 s each at a load of 10 on 2 cores, against 0.03 s after),
    which would otherwise fall inside the step and its send/recv timeout."""
    x = ids.to(device) if stage.first else torch.zeros(shape, device=device, requires_grad=True)
    with torch.random.fork_rng(devices=[]):
        out = stage(x, targets.to(device)) if stage.last and stage.loss else stage(x)
        out.float().sum().backward()
    stage.zero_grad(set_to_none=True)


def probe_without_processes(impl, cases: dict) -> list[dict]:
    """probe_engine on one stage in this process (a gloo group of one, torn down after), for each case of
    {case: op lists}: a quick look before a real run (the loss scaling, the gradients), never a replacement."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        env = DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo")
        return [probe_engine(impl, case, _op_lists(orders), env) for case, orders in cases.items()]
    finally:
        if owned:
            dist.destroy_process_group()


def _op_lists(orders) -> list[list[tuple[str, int]]]:
    """Per-rank op lists from op lists or "F0 F1 B0 ..." strings."""
    return [pipeline.parse_orders(o)[0] if isinstance(o, str) else [tuple(op) for op in o] for o in orders]


def summarize(case: str, records: list[dict], config: GPTConfig, inputs, targets, seed: int) -> dict:
    """Rank 0: the records of every stage against the single process."""
    kind, p, m = parse_case(case)
    zero = min(r["t0"] for r in records)     # perf_counter is one clock for the processes of one machine
    for r in records:
        shift = r["t0"] - zero
        r["events"] = [[k, j, a + shift, b + shift] for k, j, a, b in r["events"]]
        for c in r["p2p"]:
            c["launched_s"] += shift
            c["done_s"] = None if c["done_s"] is None else c["done_s"] + shift
    out = {"case": case, "kind": kind, "n_stages": p, "n_microbatches": m,
           "errors": {r["rank"]: r["error"] for r in records if r["error"]},
           "tracebacks": {r["rank"]: r["traceback"] for r in records if r["error"]},
           "deadlock": deadlock_message(records) if any(r["error"] for r in records) else None,
           "ran": [[[k, j] for k, j, _, _ in r["events"]] for r in records],
           "schedule": [[list(op) for op in r["ops"]] for r in records],
           "events": [r["events"] for r in records], "p2p": [r["p2p"] for r in records],
           "saved_bytes": [r["saved_bytes"] for r in records]}
    out["ok"] = not out["errors"]
    if out["ok"]:
        ref_grads, ref_losses = reference(config, inputs, targets, seed)
        grads = pipeline.combine_stage_gradients([r["grads"] for r in records])
        missing = sorted(set(ref_grads) - set(grads))
        out["max_grad_diff"] = max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items() if n in grads)
        out["grad_scale"] = max(float(g.abs().max()) for g in ref_grads.values())
        out["missing_grads"] = missing
        out["losses"] = records[-1]["losses"]
        out["reference_losses"] = ref_losses
    return out


def deadlock_message(records: list[dict]) -> str:
    """Which rank waited on which, when the case's group timed out: the blocking send/recv a rank was in, or
    (none pending) the first isend/irecv it had not seen complete; then any other error, rank by rank."""
    lines = []
    for r in records:
        pending = [c for c in r["p2p"] if c["done_s"] is None]
        blocking = [c for c in pending if not c.get("asynchronous")]
        for c in blocking or pending[:1]:
            verb = "send to" if c["function"] in ("send", "isend") else "recv from"
            lines.append(f"rank {r['rank']} waited in {c['function']} ({verb} rank {c['peer']}, {c['bytes']} bytes, "
                         f"posted {c['launched_s'] * 1e3:.0f} ms into the step)")
        if len(pending) > len(blocking or pending[:1]):
            lines[-1] += f", with {len(pending) - len(blocking or pending[:1])} more isend/irecv not seen complete"
        if r["error"] and not pending:
            lines.append(f"rank {r['rank']}: {r['error'].splitlines()[-1][:300]}")
    return "; ".join(lines)


def check_engine(result: dict) -> None:
    """The graded checks of one case: no error or deadlock, the schedule followed, losses and gradients equal
    to the single process."""
    what = f"{result['kind']} on {result['n_stages']} stages, {result['n_microbatches']} micro-batches"
    if not result["ok"]:
        timed_out = any("Timed out" in e or "timed out" in e for e in result["errors"].values())
        checks.check_true(False, f"{what}: the step failed" + (" (deadlock: the ranks waited on each other until the "
                                                                "timeout)" if timed_out else ""),
                          hint=f"{result['deadlock']}. A blocking send returns only once the peer posted its recv: "
                               "post sends with dist.isend and wait for them at the end" if timed_out else
                               f"{result['deadlock']}\n{_first_traceback(result)}")
    for rank, (ran, expected) in enumerate(zip(result["ran"], result["schedule"])):
        checks.check_equal(pipeline.ops_text(ran), pipeline.ops_text(expected), f"{what}: the order rank {rank} ran "
                           f"its forwards and backwards in", hint="run the operations in the order of ops, one by one")
    checks.check_equal(result["missing_grads"], [], f"{what}: parameters without a gradient")
    checks.check_close(result["losses"], result["reference_losses"], f"{what}: the micro-batches' losses (last rank)",
                       rtol=1e-4, atol=1e-5, hint="the last rank returns each micro-batch's mean loss, in order")
    checks.check_true(result["max_grad_diff"] <= 1e-5 + 1e-4 * result["grad_scale"],
                      f"{what}: gradients equal to one process on the whole batch (largest difference "
                      f"{result['max_grad_diff']:.2e}, largest gradient {result['grad_scale']:.2e})",
                      hint="the step's loss is the mean over the m micro-batches: each backward starts from loss / m")


def _first_traceback(result) -> str:
    """The traceback of the lowest failing rank, from the student's code on (the probe's frames left out)."""
    rank = min(result["tracebacks"], key=int)
    lines = result["tracebacks"][rank].splitlines()
    start = next((i for i, line in enumerate(lines) if "_impl.py" in line), 0)
    return f"rank {rank}'s traceback:\n" + "\n".join(lines[start:])


# --- what the measurement reads from a result (its timeline: lablib.parallel.pipeline.idle_fraction(result.events)) ---------

def peak_saved_bytes(result) -> list[int]:
    """Per rank, the most saved-activation bytes held at once: a forward adds its micro-batch's bytes, the
    micro-batch's backward releases them (events in time order)."""
    peaks = []
    for rank_events, sizes in zip(result["events"], result["saved_bytes"]):
        held = peak = 0
        forward_bytes = dict(enumerate(sizes))
        for kind, j, _, _ in rank_events:
            held += forward_bytes.get(j, 0) if kind == "F" else -forward_bytes.get(j, 0)
            peak = max(peak, held)
        peaks.append(peak)
    return peaks
