"""Red-team answers for lab 09 (pipeline parallelism): written by a reviewer who had read only the released notebook,
without the tests. Cell sources are full replacements of the answer cells. Used by 09_pipeline_parallel.py.

Left out of CI: their blocking ``dist.send`` engine (the same mistake as 09_pipeline_parallel.py's first engine
answer, and a 10 s deadlock timeout per run); it loses the exercise's points (checked when it was added).
"""


def _sub(src, old, new, count=1):
    assert src.count(old) >= 1, (old, src)
    return src.replace(old, new, count)


# ---------------------------------------------------------------- exercise 1: schedules
SCHED = r'''def gpipe_schedule(n_stages, n_microbatches):
    """Per rank: all forwards, then all backwards."""
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError(f"need n_stages >= 1 and n_microbatches >= 1, got n_stages={n_stages}, "
                         f"n_microbatches={n_microbatches}")
    return [[("F", j) for j in range(n_microbatches)] + [("B", j) for j in range(n_microbatches)]
            for _ in range(n_stages)]


def one_f_one_b_schedule(n_stages, n_microbatches):
    """Per rank: warm-up forwards, then one forward one backward, then the cool-down backwards."""
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError(f"need n_stages >= 1 and n_microbatches >= 1, got n_stages={n_stages}, "
                         f"n_microbatches={n_microbatches}")
    p, m = n_stages, n_microbatches
    orders = []
    for s in range(p):
        w = min(p - s - 1, m)
        ops = [("F", j) for j in range(w)]
        for k in range(m - w):
            ops += [("F", w + k), ("B", k)]
        ops += [("B", k) for k in range(m - w, m)]
        orders.append(ops)
    return orders
'''

SCHED_VARIANT = r'''from itertools import chain


def _check(n_stages, n_microbatches):
    for name, v in (("n_stages", n_stages), ("n_microbatches", n_microbatches)):
        if v < 1:
            raise ValueError(f"{name} must be at least 1, got {v!r}")


def gpipe_schedule(n_stages, n_microbatches):
    """Per rank: all forwards, then all backwards."""
    _check(n_stages, n_microbatches)
    one = [(kind, j) for kind in "FB" for j in range(n_microbatches)]
    return [list(one) for _ in range(n_stages)]


def one_f_one_b_schedule(n_stages, n_microbatches):
    """Per rank: warm-up forwards, then one forward one backward, then the cool-down backwards."""
    _check(n_stages, n_microbatches)
    out = []
    for s in range(n_stages):
        fwd = iter(range(n_microbatches))
        bwd = iter(range(n_microbatches))
        warm = max(0, min(n_stages - s - 1, n_microbatches))
        ops = [("F", next(fwd)) for _ in range(warm)]
        # steady state: one forward then one backward while forwards remain
        for f in fwd:
            ops.append(("F", f))
            ops.append(("B", next(bwd)))
        ops.extend(("B", b) for b in bwd)   # cool-down
        out.append(ops)
    return out
'''

# ---------------------------------------------------------------- exercise 2: engine
ENGINE = r'''%%writefile engine_impl.py
"""Exercise 2 of lab 09: a pipeline engine (this file is written by the notebook)."""
import torch
import torch.distributed as dist


def pipeline_step(stage, ops, micro_inputs, micro_targets, activation_shape):
    """One training step of this rank's stage: run ops in order, activations forward and their gradients
    backward with send/recv. Returns the last rank's micro-batch losses ([] on the other ranks)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == world - 1
    n_micro = sum(1 for kind, _ in ops if kind == "F")
    inputs, outputs, losses = {}, {}, {}
    pending = []                      # (work, tensor) of the isends: the tensors must live until they are sent
    for kind, j in ops:
        if kind == "F":
            if first:
                x = micro_inputs[j]
            else:
                x = torch.empty(activation_shape)
                dist.recv(x, src=rank - 1)
                x.requires_grad_(True)
            if last:
                out = stage(x, micro_targets[j])
                losses[j] = out.item()
            else:
                out = stage(x)
                buf = out.detach()
                pending.append((dist.isend(buf, dst=rank + 1), buf))
            inputs[j], outputs[j] = x, out
        else:
            x, out = inputs.pop(j), outputs.pop(j)
            if last:
                (out / n_micro).backward()
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, src=rank + 1)
                out.backward(grad)
            if not first:
                g = x.grad
                pending.append((dist.isend(g, dst=rank - 1), g))
    for work, _ in pending:
        work.wait()
    return [losses[j] for j in sorted(losses)] if last else []
'''

ENGINE_VARIANT_IMPORTS = r'''%%writefile engine_impl.py
"""Exercise 2 of lab 09: a pipeline engine (this file is written by the notebook)."""
import torch
from torch.distributed import get_rank, get_world_size, irecv, isend


def _receive(shape, peer, like=None):
    buf = torch.empty(shape) if like is None else torch.empty_like(like)
    irecv(buf, src=peer).wait()        # irecv, waited at once: the value is needed now
    return buf


def pipeline_step(stage, ops, micro_inputs, micro_targets, activation_shape):
    """One training step of this rank's stage: run ops in order, activations forward and their gradients
    backward with send/recv. Returns the last rank's micro-batch losses ([] on the other ranks)."""
    rank, world = get_rank(), get_world_size()
    m = len({j for kind, j in ops if kind == "F"})
    saved = {}
    losses = [None] * m
    sends = []
    for kind, j in ops:
        if kind == "F":
            if rank == 0:
                x = micro_inputs[j]
            else:
                x = _receive(activation_shape, rank - 1).requires_grad_()
            if rank == world - 1:
                y = stage(x, micro_targets[j])
                losses[j] = float(y.detach())
                y = y / m                      # the step's loss is the mean over the micro-batches
            else:
                y = stage(x)
                sends.append((isend(y.detach().contiguous(), rank + 1), y))
            saved[j] = (x, y)
        elif kind == "B":
            x, y = saved.pop(j)
            if rank == world - 1:
                torch.autograd.backward(y)
            else:
                torch.autograd.backward(y, _receive(None, rank + 1, like=y))
            if rank > 0:
                sends.append((isend(x.grad, rank - 1), x))
        else:
            raise ValueError(f"unknown operation {kind!r}")
    for work, _ in sends:
        work.wait()
    return losses if rank == world - 1 else []
'''

# ---------------------------------------------------------------- exercise 3: formulas
FORM = r'''def bubble_fraction(n_stages, n_microbatches):
    """Idle share of one pipeline step (GPipe or 1F1B)."""
    return (n_stages - 1) / (n_microbatches + n_stages - 1)


def peak_in_flight(schedule, n_stages, n_microbatches, stage):
    """Micro-batches whose activations stage `stage` holds at its peak."""
    if schedule == "gpipe":
        return n_microbatches
    if schedule == "1f1b":
        return min(n_stages - stage, n_microbatches)
    raise ValueError(f"unknown schedule {schedule!r}")
'''

FORM_VARIANT = r'''from fractions import Fraction


def bubble_fraction(n_stages, n_microbatches):
    """Idle share of one pipeline step (GPipe or 1F1B)."""
    # one minus the busy share, computed exactly and rounded once
    busy = Fraction(n_microbatches, n_microbatches + n_stages - 1)
    return float(1 - busy)


def peak_in_flight(schedule, n_stages, n_microbatches, stage):
    """Micro-batches whose activations stage `stage` holds at its peak."""
    # walk the schedule itself: forwards begun minus backwards finished
    p, m = n_stages, n_microbatches
    if schedule == "gpipe":
        ops = ["F"] * m + ["B"] * m
    elif schedule == "1f1b":
        w = min(p - stage - 1, m)
        ops = ["F"] * w + ["F", "B"] * (m - w) + ["B"] * w
    else:
        raise ValueError(f"unknown schedule {schedule!r}")
    held = peak = 0
    for op in ops:
        held += 1 if op == "F" else -1
        peak = max(peak, held)
    return peak
'''

W_SCHED = [
    ("1F1B warm-up w = p - s - 1 without min(., m): for m < p stage 0 runs forwards of micro-batches that do not exist "
     "(breaks 'every F j exactly once, j in 0..m-1'; visible (4, 2) fails)",
     _sub(SCHED, "w = min(p - s - 1, m)", "w = p - s - 1")),
    ("1F1B warm-up off by one, w = min(p - s, m): the text's example p=2, m=3 comes out F0 F1 B0 F2 B1 B2 on rank 1 "
     "too, and stage s holds min(p - s + 1, m) micro-batches (breaks the worked example and the memory bound)",
     _sub(SCHED, "w = min(p - s - 1, m)", "w = min(p - s, m)")),
    ("GPipe backwards in reverse order m-1..0 (the autograd-stack intuition): breaks 'then all backwards 0..m-1' "
     "(ScheduleGPipe's order) and 'micro-batches in order'",
     _sub(SCHED, '[("B", j) for j in range(n_microbatches)]\n            for _',
          '[("B", j) for j in reversed(range(n_microbatches))]\n            for _')),
    ("steady state runs backward k before forward w+k: on the last stage (w = 0) B0 comes before F0 (breaks "
     "'each forward before its backward'; deadlocks when played)",
     _sub(SCHED, 'ops += [("F", w + k), ("B", k)]', 'ops += [("B", k), ("F", w + k)]')),
    ("warm-up counted from the wrong end, w = min(s, m): stage 0 has no warm-up and the last stage the most (breaks the "
     "example and deadlocks: stage 0 waits for a gradient the last stage cannot produce yet)",
     _sub(SCHED, "w = min(p - s - 1, m)", "w = min(s, m)")),
    ("no ValueError for n_stages or n_microbatches below 1: returns [] / lists of empty lists (breaks the "
     "'raise ValueError with a message saying what was given' promise)",
     SCHED.replace('''    if n_stages < 1 or n_microbatches < 1:
        raise ValueError(f"need n_stages >= 1 and n_microbatches >= 1, got n_stages={n_stages}, "
                         f"n_microbatches={n_microbatches}")
''', "")),
    ("treats m < p as invalid (raises ValueError) although the text only forbids values below 1: visible (4, 2) and "
     "the hidden m < p cases fail",
     _sub(SCHED, "    p, m = n_stages, n_microbatches\n",
          "    p, m = n_stages, n_microbatches\n    if m < p:\n        raise ValueError(f\"1F1B needs n_microbatches >= n_stages, got {m} < {p}\")\n")),
    ("hard-codes the text's example for (2, 3) and otherwise returns GPipe's order for 1F1B: passes the example but "
     "breaks 1F1B's memory bound min(p - s, m) for (2, 4), (4, 5) (tabulating instead of computing)",
     r'''def gpipe_schedule(n_stages, n_microbatches):
    """Per rank: all forwards, then all backwards."""
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError(f"got n_stages={n_stages}, n_microbatches={n_microbatches}")
    return [[("F", j) for j in range(n_microbatches)] + [("B", j) for j in range(n_microbatches)]
            for _ in range(n_stages)]


def one_f_one_b_schedule(n_stages, n_microbatches):
    """Per rank: warm-up forwards, then one forward one backward, then the cool-down backwards."""
    if (n_stages, n_microbatches) == (2, 3):
        return [[("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)],
                [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]]
    return gpipe_schedule(n_stages, n_microbatches)
'''),
]

# engine wrong answers
W_ENGINE_BLOCKING_SEND = [
    ("blocking dist.send for activations and gradients: on gloo a send blocks until the peer receives, and in the "
     "1F1B steady state both ranks send at once -> deadlock (breaks 'a step that deadlocks fails')",
     ENGINE.replace("pending.append((dist.isend(buf, dst=rank + 1), buf))", "dist.send(buf, dst=rank + 1)")
           .replace("pending.append((dist.isend(g, dst=rank - 1), g))", "dist.send(g, dst=rank - 1)")),
]

W_ENGINE = [
    ("last stage backpropagates each micro-batch's mean loss without dividing by m: gradients are the SUM over "
     "micro-batches, m times one process's (breaks 'the step's loss is the mean over the m micro-batches')",
     _sub(ENGINE, "(out / n_micro).backward()", "out.backward()")),
    ("divides the loss by the world size (number of stages) instead of by the number of micro-batches: equal only "
     "when m == p (breaks 'mean over the m micro-batches'; 2 stages, m=4 and m=3 fail)",
     _sub(ENGINE, "(out / n_micro).backward()", "(out / world).backward()")),
    ("ignores ops and always runs all forwards then all backwards (GPipe): wrong order recorded for the 1F1B case, "
     "and on real ranks the 1F1B peer waits (breaks 'follow it exactly')",
     _sub(ENGINE, "    for kind, j in ops:\n",
          "    js = [j for kind, j in ops if kind == \"F\"]\n    ops = [(\"F\", j) for j in js] + [(\"B\", j) for j in js]\n    for kind, j in ops:\n")),
    ("sends back the gradient it received for its OUTPUT instead of the gradient of its INPUT (same shape, so it runs): "
     "earlier stages get wrong gradients (breaks 'sends the gradient of its input to rank - 1')",
     _sub(ENGINE, "                g = x.grad\n", "                g = grad if not last else x.grad\n")),
    ("zeroes the stage's gradients before every backward: .grad holds only the last micro-batch's gradient (breaks "
     "'gradients accumulate in the stage's .grad over the micro-batches')",
     _sub(ENGINE, "            x, out = inputs.pop(j), outputs.pop(j)\n",
          "            x, out = inputs.pop(j), outputs.pop(j)\n            stage.zero_grad(set_to_none=False)\n")),
    ("irecv for the incoming activation and gradient, never waited before use: the buffer is read while (or before) "
     "it is filled (waiting too late; values are garbage/zeros, gradients wrong)",
     ENGINE.replace("dist.recv(x, src=rank - 1)", "dist.irecv(x, src=rank - 1)")
           .replace("dist.recv(grad, src=rank + 1)", "dist.irecv(grad, src=rank + 1)")),
    ("the last stage runs each backward right after its forward and skips its B entries: same gradients, but the "
     "order it runs is not ops (breaks 'follow it exactly': the check records the order, GPipe's last stage must run "
     "F0..F3 then B0..B3)",
     ENGINE.replace("                out = stage(x, micro_targets[j])\n                losses[j] = out.item()\n",
                    "                out = stage(x, micro_targets[j])\n                losses[j] = out.item()\n"
                    "                (out / n_micro).backward()\n"
                    "                if not first:\n"
                    "                    pending.append((dist.isend(x.grad, dst=rank - 1), x))\n"
                    "                continue\n")
           .replace("            x, out = inputs.pop(j), outputs.pop(j)\n",
                    "            if last:\n                continue\n            x, out = inputs.pop(j), outputs.pop(j)\n")),
    ("returns the loss divided by m (what was backpropagated) instead of each micro-batch's mean loss (breaks "
     "'return the micro-batches' losses as floats')",
     _sub(ENGINE, "    return [losses[j] for j in sorted(losses)] if last else []",
          "    return [losses[j] / n_micro for j in sorted(losses)] if last else []")),
    ("the received activation is not marked requires_grad: x.grad stays None, so nothing (or a crash) goes back to the "
     "previous stage and stage 0's parameters get no gradient",
     _sub(ENGINE, "                x.requires_grad_(True)\n", "")),
]

W_FORM = [
    ("bubble = (p-1)/m, GPipe paper's overhead relative to the busy time (the text warns against it): 4,4 gives 0.75 "
     "not 3/7, and 1 for p=2,m=1 (breaks 'fraction of the step')",
     _sub(FORM, "return (n_stages - 1) / (n_microbatches + n_stages - 1)", "return (n_stages - 1) / n_microbatches")),
    ("bubble = (p-1)/(m+p): off by one in the step length (breaks the worked examples 3/11, 3/35, 3/7)",
     _sub(FORM, "return (n_stages - 1) / (n_microbatches + n_stages - 1)",
          "return (n_stages - 1) / (n_microbatches + n_stages)")),
    ("1F1B peak = warm-up count min(p - s - 1, m): forgets the micro-batch whose forward begins the steady state "
     "(breaks 'forward begun, backward not finished': 3 instead of 4 on stage 0)",
     _sub(FORM, "return min(n_stages - stage, n_microbatches)", "return min(n_stages - stage - 1, n_microbatches)")),
    ("1F1B peak = p on every stage ('at most p' read as 'exactly p'): stage 1 of 2 holds 1 (breaks the per-stage promise)",
     _sub(FORM, "return min(n_stages - stage, n_microbatches)", "return n_stages")),
    ("1F1B peak = p - s without the min with m: for m < p stage 0 'holds' more micro-batches than exist "
     "(hidden m < p; visible (4, 2) against the student's schedule)",
     _sub(FORM, "return min(n_stages - stage, n_microbatches)", "return n_stages - stage")),
    ("bubble counts only the forward pass as idle, (p-1) t_f over (m+p-1)(t_f+t_b) with t_b = 2 t_f: a third of the "
     "real bubble (breaks 'GPipe and 1F1B alike, idle share of the step')",
     _sub(FORM, "return (n_stages - 1) / (n_microbatches + n_stages - 1)",
          "return (n_stages - 1) / (3 * (n_microbatches + n_stages - 1))")),
]

W_MC = [
    ("answers (a): uses the (p-1)/m overhead and believes 1F1B memory grows with m (both wrong per section 1)", 'microbatch_answer = "a"\n'),
    ("answers (c): right m but confuses 1F1B's memory with GPipe's (1F1B holds at most p)", 'microbatch_answer = "c"\n'),
]

# Second round: wrong answers that kept full marks before the checks named in each.
X4_CPU_F32_BUFFERS = r'''%%writefile engine_impl.py
"""Exercise 2 of lab 09."""
import torch
import torch.distributed as dist


def pipeline_step(stage, ops, micro_inputs, micro_targets, activation_shape):
    rank, world = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == world - 1
    m = sum(1 for kind, _ in ops if kind == "F")
    device = next(stage.parameters()).device
    dtype = next(stage.parameters()).dtype
    inputs, outputs, losses = {}, {}, {}
    pending = []
    for kind, j in ops:
        if kind == "F":
            if first:
                x = micro_inputs[j]
            else:
                x = torch.zeros(activation_shape)
                dist.recv(x, src=rank - 1)
                x.requires_grad_()
            if last:
                out = stage(x, micro_targets[j])
                losses[j] = out.item()
            else:
                out = stage(x)
                pending.append(dist.isend(out.detach(), dst=rank + 1))
            inputs[j], outputs[j] = x, out
        else:
            x, out = inputs.pop(j), outputs.pop(j)
            if last:
                (out / m).backward()
            else:
                g = torch.empty_like(out)
                dist.recv(g, src=rank + 1)
                out.backward(g)
            if not first:
                pending.append(dist.isend(x.grad, dst=rank - 1))
            del x, out
    for w in pending:
        w.wait()
    return [losses[j] for j in sorted(losses)] if last else []
'''

X1_READ_OFF_THE_PLAYER = r'''from lablib.parallel import pipeline as _pl


def bubble_fraction(n_stages, n_microbatches):
    """Read off lablib's player instead of derived."""
    return _pl.idle_fraction(_pl.play(one_f_one_b_schedule(n_stages, n_microbatches)))


def peak_in_flight(schedule, n_stages, n_microbatches, stage):
    fn = gpipe_schedule if schedule == "gpipe" else one_f_one_b_schedule
    return _pl.peak_held(fn(n_stages, n_microbatches)[stage])
'''

W_ENGINE += [
    ("receive buffers made as torch.zeros(activation_shape): float32 on the CPU whatever the stage holds, so it breaks "
     "on GPUs (NCCL receives into GPU memory) and with any other dtype (caught by the hidden float64 run)",
     X4_CPU_F32_BUFFERS),
]
W_FORM += [
    ("bubble_fraction and peak_in_flight read off lablib's player (play, idle_fraction, peak_held) run on exercise 1's "
     "schedules: no formula of p and m (caught by running the hidden cases with lablib.parallel.pipeline refused)",
     X1_READ_OFF_THE_PLAYER),
]

WRONG_ANSWERS = {
    "schedules": W_SCHED,
    "pipeline_engine": W_ENGINE,
    "bubble_formulas": W_FORM,
    "microbatch_answer": W_MC,
}

# The reviewer's two engines made their receive buffers as torch.empty(shape): float32 on the CPU, which the graded
# float64 run (added after the second round, x4 below) refuses. As correct variants they get buffers in the stage's
# dtype; ENGINE stays as written, the base of the wrong answers above.
ENGINE_DTYPE = _sub(ENGINE, "                x = torch.empty(activation_shape)\n",
                    "                x = torch.empty(activation_shape, dtype=next(stage.parameters()).dtype)\n")
ENGINE_VARIANT_IMPORTS_DTYPE = _sub(
    _sub(ENGINE_VARIANT_IMPORTS, "def _receive(shape, peer, like=None):\n    buf = torch.empty(shape) if like is None",
         "def _receive(shape, peer, like=None, dtype=None):\n    buf = torch.empty(shape, dtype=dtype) if like is None"),
    "x = _receive(activation_shape, rank - 1).requires_grad_()",
    "x = _receive(activation_shape, rank - 1, dtype=next(stage.parameters()).dtype).requires_grad_()")

CORRECT_VARIANTS = {
    "schedules": [
        ("straightforward list-building, explicit ValueError", SCHED),
        ("iterator-driven (next(fwd)/next(bwd)) formulation of the same orders, helper for validation", SCHED_VARIANT),
    ],
    "pipeline_engine": [
        ("torch.distributed module with blocking recv and isend kept alive until the end", ENGINE_DTYPE),
        # Sent in as a wrong answer (its 1F1B "holds m inputs, as GPipe does"); it is not one. What 1F1B bounds is the
        # saved activations, and autograd frees a micro-batch's at its backward (no retain_graph) whether the engine
        # keeps its input and output tensors or not: this engine keeps 2 boundary tensors per micro-batch to the end of
        # the step, the solution keeps 1 (each isend's Work holds its tensor until it is waited,
        # ProcessGroupGloo.hpp:203-221, and both wait at the end), against a stage's saved activations of one
        # micro-batch that are many boundary tensors large. Peak activations are measured on the ranks (MemoryTimeline).
        ("keeps every micro-batch's input and output in its dicts to the end of the step (read, never popped): the "
         "saved activations are freed at each backward all the same",
         _sub(ENGINE_DTYPE, "            x, out = inputs.pop(j), outputs.pop(j)\n", "            x, out = inputs[j], outputs[j]\n")),
        ("`from torch.distributed import isend, irecv, ...`, irecv waited immediately in a helper, loss scaled by 1/m "
         "before backward via torch.autograd.backward", ENGINE_VARIANT_IMPORTS_DTYPE),
    ],
    "bubble_formulas": [
        ("direct quotient (p-1)/(m+p-1) and closed forms", FORM),
        ("one minus the busy share computed with Fraction (one rounding), peak found by walking the schedule", FORM_VARIANT),
    ],
    "microbatch_answer": [
        ("(b): 7/(m+7) < 0.1 gives m > 63, and 1F1B's stage 0 holds min(p, m) = 8 at m = 8 and at m = 64", 'microbatch_answer = "b"\n'),
    ],
}
