"""Lab 09's probe of the students' engine (exercise 1's checks: ``schedules``).

``probe_engine`` runs one training step of the student's ``pipeline_step`` on this rank's stage of the
course GPT (``lablib.parallel.pipeline.gpt_stages``), with the op lists it is given (the notebook writes them out for
the visible cases; never the student's exercise 1), and records

- the order in which the stage really ran forwards and backwards (module hooks and an identity autograd
  function on the stage's output, so the check sees what ran, not what the engine says);
- per operation when it started and ended (the Gantt chart), and the saved-activation bytes of each
  micro-batch's forward (``lablib.measure.memory.SavedActivations``);
- every send/recv the engine called, with its peer and launch/done times (``lablib.measure.counting``);
- the stage's gradients and the micro-batches' losses;
- the step on a stopwatch, from the common start (a barrier) to this rank's return, as
  ``run_pipeline_torch`` times torch's schedules (per step the slowest rank);
- with ``memory=True``, the saved activations autograd really held at its peak
  (``lablib.measure.memory.MemoryTimeline``, as for torch's schedules): an engine that keeps what it should
  have freed shows here, not in the event order.

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
import pickle
import time
import traceback

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from lablib import checks
from lablib.measure import counting
from lablib.parallel import pipeline
from lablib.probes.harness import default_group
from lablib.jobs.distenv import DistEnv
from lablib.jobs.exercise import load_module
from lablib.measure.memory import MemoryTimeline
from lablib.course.models import GPT, GPTConfig
from lablib.labs.pipeline_parallel.recorder import StageRecorder, peak_saved_bytes  # noqa: F401 - the notebook reads them here
from lablib.labs.pipeline_parallel.schedules import (FUNCTIONS, answer_without_module,  # noqa: F401
                                                     check_same_schedule, check_schedule)

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


def reference(config: GPTConfig, inputs, targets, seed: int,
              dtype: torch.dtype = torch.float32) -> tuple[dict, list[float]]:
    """The single process: the whole GPT (its parameters in ``dtype``) on the whole batch (mean loss); its
    gradients and micro-batch losses."""
    torch.manual_seed(seed)
    model = GPT(config).to(dtype)
    loss = model(torch.cat(inputs), torch.cat(targets))[1]
    loss.backward()
    with torch.no_grad():
        losses = [model(x, y)[1].item() for x, y in zip(inputs, targets)]
    return pipeline.model_gradients(model), losses


def probe_engine(impl, case: str, orders, env, p2p_timeout_s: float = 15.0, seed: int = 0, micro_batch: int = 2,
                 config: GPTConfig = SMALL, tag: str = "", memory: bool = False,
                 dtype: torch.dtype = torch.float32) -> dict:
    """One step of the student's engine on this rank's stage, running ``orders[rank]`` (one op list per stage of
    the case). Every rank of the job calls it, in the same order; rank 0 gets the whole result, the others
    {"ok": ...} (a rank outside the case's p waits for it). ``dtype``: the stages' parameters, so the activations
    and their gradients that cross between ranks (an engine's receive buffers must follow the stage)."""
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
        stage = pipeline.gpt_stages(GPT(config).to(dtype), p)[rank].to(env.device)
        warm_up(stage, inputs[0], targets[0], shape, env.device)
        ops = [tuple(op) for op in orders[rank]]
        recorder, log = StageRecorder(stage, count_saved=not memory), counting.CollectiveLog(phase="step")
        record = {"rank": rank, "ops": ops, "error": None, "losses": None}
    if everyone is not None:    # the step starts on every rank at once: a wait in it is the step's own
        dist.barrier(group=everyone)
    if record is not None:
        timeline = MemoryTimeline(stage) if memory else contextlib.nullcontext()
        t0 = time.perf_counter()
        try:
            with default_group(mine if world > 1 else None), counting.count_collectives(log), timeline:
                record["losses"] = [float(x) for x in impl.pipeline_step(stage, list(ops), inputs, targets, shape)]
            record["t_end"] = time.perf_counter()
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
        record["peak_activation_bytes"] = max(x["activations"] for x in timeline.samples) if memory else None
    if world == 1:
        records = [record]
    else:                       # through the store: the case's group may be broken by a deadlock
        store = c10d._get_default_store()
        if record is not None:
            store.set(f"pp{tag}/{case}/{rank}", pickle.dumps(record))
        records = [pickle.loads(store.get(f"pp{tag}/{case}/{r}")) for r in range(p)]
    return summarize(case, records, config, inputs, targets, seed, dtype) if rank == 0 else \
        {"ok": all(r["error"] is None for r in records)}


def warm_up(stage, ids, targets, shape, device) -> None:
    """One forward and backward of the stage, before the step, its gradients dropped: a process's first ones
    cost up to a second under load (measured 0.75 s each at a load of 10 on 2 cores, against 0.03 s after),
    which would otherwise fall inside the step and its send/recv timeout."""
    dtype = next(stage.parameters()).dtype
    x = ids.to(device) if stage.first else torch.zeros(shape, device=device, dtype=dtype, requires_grad=True)
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


def summarize(case: str, records: list[dict], config: GPTConfig, inputs, targets, seed: int,
              dtype: torch.dtype = torch.float32) -> dict:
    """Rank 0: the records of every stage against the single process (its parameters in ``dtype``, as the stages')."""
    kind, p, m = parse_case(case)
    zero = min(r["t0"] for r in records)     # perf_counter is one clock for the processes of one machine
    for r in records:
        shift = r["t0"] - zero
        r["events"] = [[k, j, a + shift, b + shift] for k, j, a, b in r["events"]]
        for c in r["p2p"]:
            c["launched_s"] += shift
            c["done_s"] = None if c["done_s"] is None else c["done_s"] + shift
    out = {"case": case, "kind": kind, "n_stages": p, "n_microbatches": m, "dtype": str(dtype).removeprefix("torch."),
           "errors": {r["rank"]: r["error"] for r in records if r["error"]},
           "tracebacks": {r["rank"]: r["traceback"] for r in records if r["error"]},
           "deadlock": deadlock_message(records) if any(r["error"] for r in records) else None,
           "ran": [[[k, j] for k, j, _, _ in r["events"]] for r in records],
           "schedule": [[list(op) for op in r["ops"]] for r in records],
           "events": [r["events"] for r in records], "p2p": [r["p2p"] for r in records],
           "saved_bytes": [r["saved_bytes"] for r in records]}
    out["ok"] = not out["errors"]
    if out["ok"]:   # the stopwatch: the ranks started together, the step ends when the slowest returns
        out["step_s"] = max(r["t_end"] for r in records) - zero
        out["peak_activation_bytes"] = [r["peak_activation_bytes"] for r in records]
    if out["ok"]:
        ref_grads, ref_losses = _reference_once(config, inputs, targets, seed, dtype)
        grads = pipeline.combine_stage_gradients([r["grads"] for r in records])
        missing = sorted(set(ref_grads) - set(grads))
        out["max_grad_diff"] = max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items() if n in grads)
        out["grad_scale"] = max(float(g.abs().max()) for g in ref_grads.values())
        out["missing_grads"] = missing
        out["losses"] = records[-1]["losses"]
        out["reference_losses"] = ref_losses
    return out


_REFERENCES: dict = {}


def _reference_once(config: GPTConfig, inputs, targets, seed: int, dtype: torch.dtype) -> tuple[dict, list[float]]:
    """``reference``, computed once per batch: the measurement's rounds check the same case again every round, and
    recomputing the whole GPT's step on rank 0 each time cost more CPU than the pipeline step it checks. The key holds
    the batch's token ids themselves, so another batch never reads a stored result."""
    key = (repr(config), seed, dtype, tuple(tuple(x.flatten().tolist()) for x in inputs),
           tuple(tuple(y.flatten().tolist()) for y in targets))
    if key not in _REFERENCES:
        if len(_REFERENCES) >= 16:          # a run checks at most a few cases: keep memory bounded all the same
            _REFERENCES.clear()
        _REFERENCES[key] = reference(config, inputs, targets, seed, dtype)
    return _REFERENCES[key]


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
    what = f"{result['kind']} on {result['n_stages']} stages, {result['n_microbatches']} micro-batches" + \
        ("" if result.get("dtype", "float32") == "float32" else f", the GPT in {result['dtype']}")
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
