"""Lab 09's probe of the students' pipeline engine: what it does on the ranks, and the graded checks of it.

``probe_engine`` runs one training step of the student's ``pipeline_step`` on this rank's stage of the
course GPT (``lablib.pipeline.gpt_stages``), with the course's reference schedule (``pipeline.schedule``, by
simulation: never the student's exercise 1), and records

- the order in which the stage really ran forwards and backwards (module hooks and an identity autograd
  function on the stage's output, so the check sees what ran, not what the engine says);
- per operation when it started and ended (the Gantt chart), and the saved-activation bytes of each
  micro-batch's forward (``lablib.memory.SavedActivations``);
- every send/recv the engine called, with its peer and launch/done times (``lablib.counting``);
- the stage's gradients and the micro-batches' losses.

The engine runs on a process group of its own with a short timeout (``p2p_timeout_s``): a schedule that
deadlocks ends there on every waiting rank, and each rank's still-pending send/recv (peer, bytes, since when)
goes to rank 0 through the job's TCP store, which the broken group does not need. ``deadlock_message`` says
which ranks waited on which. The single-process reference (the whole GPT on the whole batch) is computed on
rank 0; ``check_engine`` compares.
"""

from __future__ import annotations

import datetime
import pickle
import time
import traceback

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from lablib import checks, counting, pipeline
from lablib.ddp_probes import default_group
from lablib.distenv import DistEnv
from lablib.exercise import load_module
from lablib.memory import SavedActivations
from lablib.models import GPT, GPTConfig

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


def probe_engine(impl, case: str, env, group=None, p2p_timeout_s: float = 15.0, seed: int = 0,
                 micro_batch: int = 2, config: GPTConfig = SMALL, tag: str = "") -> dict | None:
    """One step of the student's engine on this rank's stage (a rank outside the case's p returns None after
    the case). Every rank of the job calls it, in the same order; rank 0 gets the whole result."""
    kind, p, m = parse_case(case)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    inputs, targets = batch(config, m, micro_batch, seed)
    mine = None
    if dist.is_initialized():   # a fresh group per case, with a short timeout: a deadlock breaks only it
        mine = dist.new_group(list(range(p)), timeout=datetime.timedelta(seconds=p2p_timeout_s))
    record = None
    if rank < p:
        torch.manual_seed(seed)
        stage = pipeline.gpt_stages(GPT(config), p)[rank].to(env.device)
        ops = pipeline.schedule(kind, p, m)[rank]
        recorder, log = StageRecorder(stage), counting.CollectiveLog(phase="step")
        record = {"rank": rank, "ops": ops, "error": None, "losses": None}
        t0 = time.perf_counter()
        try:
            with default_group(mine if world > 1 else None), counting.count_collectives(log):
                record["losses"] = [float(x) for x in impl.pipeline_step(
                    stage, list(ops), inputs, targets, (micro_batch, config.block_size, config.n_embd))]
        except NotImplementedError:   # an unwritten exercise: the course's own message, not a failed check
            raise
        except Exception as exc:   # noqa: BLE001 - recorded for the check, which fails with it
            record["error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()[-600:]
            record["traceback"] = traceback.format_exc()[-2000:]
        record["events"] = [[k, j, a - t0, (b or a) - t0] for k, j, a, b in recorder.close()]
        record["saved_bytes"] = recorder.saved_bytes
        record["p2p"] = [{"function": c.function, "peer": c.peer, "bytes": c.bytes, "launched_s": c.launched_s - t0,
                          "done_s": None if c.done_s is None else c.done_s - t0} for c in log.calls]
        record["grads"] = pipeline.stage_gradients(stage)
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


def probe_without_processes(impl, cases=("gpipe:1:3", "1f1b:1:2")) -> list[dict]:
    """probe_engine on one stage in this process (a gloo group of one, torn down after): a quick look
    before a real run (the loss scaling, the gradients), never a replacement for it."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        env = DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo")
        return [probe_engine(impl, case, env) for case in cases]
    finally:
        if owned:
            dist.destroy_process_group()


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
    """Which rank waited on which: every send/recv still pending when the case's group timed out."""
    lines = []
    for r in records:
        pending = [c for c in r["p2p"] if c["done_s"] is None]
        for c in pending:
            verb = "send to" if c["function"] in ("send", "isend") else "recv from"
            lines.append(f"rank {r['rank']} waited in {c['function']} ({verb} rank {c['peer']}, {c['bytes']} bytes, "
                         f"posted {c['launched_s'] * 1e3:.0f} ms into the step)")
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
        checks.check_equal(_ops_text(ran), _ops_text(expected), f"{what}: the order rank {rank} ran its forwards "
                           f"and backwards in", hint="run the operations in the order of ops, one by one")
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


def _ops_text(ops) -> str:
    return " ".join(f"{k}{j}" for k, j in ops)


# --- what the measurement reads from a result ------------------------------------------------------------------------

def busy_and_step(result) -> tuple[list[float], float]:
    """Per rank the seconds its stage computed (forwards and backwards), and the step: first start to last end."""
    events = result["events"]
    start = min(e[2] for rank_events in events for e in rank_events)
    end = max(e[3] for rank_events in events for e in rank_events)
    return [sum(e[3] - e[2] for e in rank_events) for rank_events in events], end - start


def measured_idle_fraction(result) -> float:
    """1 - computing / (ranks x step): the measured bubble (waiting for a peer counts as idle)."""
    busy, step = busy_and_step(result)
    return 1.0 - sum(busy) / (len(busy) * step)


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
