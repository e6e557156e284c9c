"""The hidden cases every exercise gets, from one place (instructor-only: lablib never imports this).

A graded exercise's hidden test cell opens one ``HiddenCheck`` for its exercise and drives the student's answer
through it. The kinds of mistake that kept full marks across the course are applied here, the same way in every
lab, instead of each lab remembering (or forgetting) them:

=============  ===========================================================================================
kind           what the check does
=============  ===========================================================================================
inputs         every argument is deep-copied before the call and compared after it (a list consumed in
               place, a tensor normalised in place, an all-reduce run on the caller's tensor)
aliasing       a returned container holds one object per entry (not one object for every rank), and what
               comes back shares no storage with an argument it was not meant to return
steps          the student's object is driven for three steps with a check after each (a counter, buffer,
               work handle or mutable default that is never reset is wrong from the second step on)
gradients      a step that starts from ``zero_grad(set_to_none=False)``'s zero tensors and one that starts
               from gradients accumulated over several backwards (an answer that relies on ``.grad is None``)
readiness      parameters become ready in an order that differs from their registration order
extremes       inputs scaled to extremes (logits far from zero: a log of a softmax instead of a log-softmax)
topology       a non-default mesh or group, and a simulated second node whose local ranks differ from the ranks
device_state   state that exists only on a GPU (CUDA generators) is checked to be present by its keys
=============  ===========================================================================================

``inputs``, ``aliasing`` and ``steps`` apply to every exercise that is code; the others apply where the exercise
has the trait behind them (it touches gradients, launches communication, computes numerics, takes a mesh, group
or rank, saves device state). An exercise leaves a kind out only with a stated reason, in ``EXERCISES`` below;
``HiddenCheck.done()`` fails the hidden cell (so the solution loses its points in CI) when a kind the table
requires was not applied. ``python -m instructor.hidden_kinds`` prints the instructor's report: per exercise,
the kinds applied and each opt-out with its reason.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from lablib import checks

KINDS: dict[str, str] = {
    "inputs": "arguments deep-copied before the call and compared after it",
    "aliasing": "returned containers checked for aliasing (one object per entry, no storage shared with an argument)",
    "steps": "the answer driven for three steps, a check after each",
    "gradients": "a step from zero_grad(set_to_none=False) and one from gradients accumulated over several backwards",
    "readiness": "a readiness order that differs from the registration order",
    "extremes": "inputs scaled to extremes",
    "topology": "a non-default mesh or group and a simulated second node (local rank != rank)",
    "device_state": "GPU-only state checked to be present (by its keys; a CPU run cannot see the values)",
}
ALWAYS = ("inputs", "aliasing", "steps")
TRAIT_KINDS = {"gradients": "gradients", "communication": "readiness", "numerics": "extremes",
               "topology": "topology", "device_state": "device_state"}
STEPS = 3
# Scales for "extremes": tiny values near float32's resolution of 1, and values far from zero (a softmax of logits
# a few hundred apart underflows to exactly 0 in float32 below exp(-103.9), so its logarithm is -inf).
EXTREME_SCALES = (1e-3, 1e2, 1e3)


@dataclass(frozen=True)
class Exercise:
    """One graded exercise: the traits that decide which kinds apply, and the kinds it leaves out, each with why.
    value_answer: the exercise is a value (a multiple-choice letter, a dict of picks), not code: nothing is called,
    so no kind applies (``why_value`` says so in the report)."""

    lab: str
    name: str
    traits: frozenset = frozenset()
    opt_out: dict = field(default_factory=dict)
    value_answer: bool = False

    def __post_init__(self):
        unknown = set(self.traits) - set(TRAIT_KINDS)
        if unknown:
            raise ValueError(f"{self.lab}/{self.name}: unknown traits {sorted(unknown)}; known: {sorted(TRAIT_KINDS)}")
        for kind, reason in self.opt_out.items():
            if kind not in KINDS:
                raise ValueError(f"{self.lab}/{self.name}: opts out of unknown kind {kind!r}; kinds: {sorted(KINDS)}")
            if not isinstance(reason, str) or len(reason.split()) < 4:
                raise ValueError(f"{self.lab}/{self.name}: opting out of {kind!r} needs a stated reason (a sentence), "
                                 f"got {reason!r}")
        extra = set(self.opt_out) - set(self.applicable)
        if extra:
            raise ValueError(f"{self.lab}/{self.name}: opts out of {sorted(extra)}, which do not apply to it anyway")

    @property
    def applicable(self) -> tuple[str, ...]:
        if self.value_answer:
            return ()
        return tuple(k for k in KINDS if k in ALWAYS or k in {TRAIT_KINDS[t] for t in self.traits})

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(k for k in self.applicable if k not in self.opt_out)


def _ex(lab, name, traits=(), value_answer=False, **opt_out) -> Exercise:
    return Exercise(lab, name, frozenset(traits), dict(opt_out), value_answer)


# Every routed exercise, with its traits and opt-outs (the reasons are printed in the instructor's report).
_TABLE = [
    # --- lab 00 ---
    _ex("00_collectives", "predict",
        steps="four pure functions of the tensors they are given: nothing is kept between calls, so each of the "
              "hidden cases (three world sizes, nine cases each) is already a fresh step"),
    _ex("00_collectives", "job_setup", ("communication", "topology"),
        steps="the graded torchrun job already calls run_job one scenario after another in each rank's process (ok "
              "and error on 2 ranks, then on 3: four times on ranks 0 and 1, twice on rank 2), set-up to tear-down "
              "each time, then setup_distributed on five simulated machines, and checks every one",
        readiness="its only collectives are init_process_group's rendezvous and one barrier between the save and the "
                  "loads: no set of tensors whose readiness order it could depend on; the order that matters (save, "
                  "barrier, load) is forced by a slow file system in every torchrun scenario"),
    _ex("00_collectives", "fix_script", ("gradients", "communication"),
        inputs="a whole script run as __main__ under torchrun: no caller passes it anything; its data, model and "
               "steps are fixed, and its weights are checked against the same training in one process",
        aliasing="the script returns nothing: what it leaves is each rank's printed step count and weight checksum, "
                 "checked on every rank",
        steps="the graded torchrun run drives it through all its steps (9, to rank 0's stop) and checks every rank's "
              "collectives, in order, against rank 0's, and the weights after the last step",
        gradients="the script owns its training loop, zero_grad included (copied from the given script): no caller "
                  "leaves gradients for it",
        readiness="it issues its all-reduces itself, one per parameter in registration order, not from a reducer "
                  "that reacts to autograd; the check compares every rank's sequence of collectives with rank 0's"),
    _ex("00_collectives", "tool_answer", value_answer=True),
    _ex("01_gradient_accumulation", "accumulation_step", ("gradients", "communication"),
        readiness="the answer only chooses when DDP's reducer syncs (no_sync); it launches no collective itself, "
                  "and the hidden 3-rank torchrun run counts the reducer's all-reduces"),
    _ex("01_gradient_accumulation", "microbatch_loss", ("numerics",)),
    _ex("01_gradient_accumulation", "bn_answer", value_answer=True),
    _ex("01_gradient_accumulation", "lr_scaling",
        steps="two pure functions of numbers: nothing is kept between calls, so every hidden case is already a "
              "fresh step"),
    # --- lab 02 ---
    _ex("02_ring_allreduce", "ring_cost",
        steps="two pure functions of numbers: nothing is kept between calls, so every hidden case is already a "
              "fresh step"),
    _ex("02_ring_allreduce", "ring_allreduce", ("communication",),
        readiness="the ring's sends and receives follow the fixed schedule of 2(N-1) steps the algorithm defines; "
                  "nothing becomes ready in an order of its own (no gradients, no buckets), and every rank's "
                  "peers and bytes are checked on 2 to 5 threads and processes"),
    _ex("02_ring_allreduce", "gradient_cost",
        steps="a pure function of numbers: nothing is kept between calls, so every hidden case is already a "
              "fresh step"),
    _ex("02_ring_allreduce", "latency_answer", value_answer=True),
    _ex("03_amdahl_scaling", "amdahl_laws",
        steps="two pure functions of numbers: nothing is kept between calls, so every hidden case is already a "
              "fresh step"),
    _ex("03_amdahl_scaling", "lr_answer", value_answer=True),
    _ex("03_amdahl_scaling", "fit_amdahl_p",
        steps="a pure function of the measured points: nothing is kept between calls, so every hidden case is "
              "already a fresh step"),
    _ex("03_amdahl_scaling", "predict_speedup",
        steps="two pure functions of numbers: nothing is kept between calls, so every hidden case is already a "
              "fresh step"),
    _ex("03_amdahl_scaling", "serial_answer", value_answer=True),
    _ex("04_zero_memory", "zero_bytes_per_rank", ("numerics",),
        steps="a pure function of numbers: nothing is kept between calls, so every hidden case is a fresh step"),
    _ex("04_zero_memory", "activation_estimate",
        steps="two pure functions of integer sizes: nothing is kept between calls, so every hidden case is a fresh "
              "step"),
    _ex("05_gpt_migration", "ddp_parts", ("communication", "topology"),
        readiness="mean_across_ranks issues one all-reduce of one tensor and DDP's own reducer launches the gradient "
                  "all-reduces: no bucket whose readiness order the answer could depend on"),
    _ex("05_gpt_migration", "apply_fsdp", ("topology",),
        steps="applying FSDP2 is one call; the torchrun runs train the result for several steps and count its "
              "collectives per step"),
    _ex("05_gpt_migration", "pick_strategy", value_answer=True),
    # --- lab 05 ---
    _ex("05_gpt_migration", "accelerate_loop", ("gradients", "communication", "numerics"),
        gradients="the exercise is the training loop itself: it gets a model fresh from construction (no .grad) and "
                  "decides when gradients are cleared; Accelerate's own examples clear them after optimizer.step(), "
                  "correct here and wrong from a stale start, while a loop that never clears them fails the "
                  "three-step check against lablib's loop",
        readiness="the loop's only collective of its own is gather_for_metrics of one tensor per evaluation; the "
                  "gradient all-reduces are those of the DDP that accelerator.prepare builds, whose buckets the "
                  "answer never sees"),
    # --- lab 07 ---
    _ex("07_zero_from_scratch", "sharded_optimizer", ("gradients", "communication"),
        readiness="step() starts its broadcasts after the backward is over, when every gradient is complete: the "
                  "order autograd finished them in cannot reach the answer"),
    _ex("07_zero_from_scratch", "zero2", ("gradients", "communication"),
        readiness="step() reduce-scatters one flat gradient, laid out in registration order, after the backward is "
                  "over: the order autograd finished the gradients in cannot reach the answer"),
    _ex("07_zero_from_scratch", "zero3", ("gradients", "communication"),
        inputs="ZeRO3 is given the model and its blocks to re-point their parameters at its own buffers and free "
               "them between uses: changing them is the exercise; the probe checks what they then compute (losses, "
               "gradients, the update)",
        aliasing="the constructor returns the object itself and its methods return nothing: no container comes "
                 "back whose entries could alias",
        steps="the probe drives every case three or four steps on the same object and checks "
              "each step's gradient, update, collectives and bytes held",
        gradients="the class creates and clears the shards' gradients itself (zero_grad and the reduce-scatter "
                  "are its own code); what an accumulating loop leaves, a second backward before step(), is the "
                  "hidden 'accum' case, checked against the mean of every backward"),
    # --- lab 08 ---
    _ex("08_tensor_parallel", "tp_f_g", ("communication", "topology"),
        readiness="f and g each all-reduce one tensor when autograd reaches them: there is no bucket of several "
                  "gradients whose completion order the answer could depend on"),
    _ex("08_tensor_parallel", "tp_mlp", ("communication", "topology"),
        steps="the probe trains every class three SGD steps on the same object (one in bf16) and compares each "
              "step's output, gradients and weights with the single process's",
        readiness="the layers call f and g once each per pass, on one activation: no bucket of several gradients "
                  "whose completion order the answer could depend on"),
    _ex("08_tensor_parallel", "tp_attention", ("communication", "topology", "numerics"),
        steps="the probe trains the layer three SGD steps on the same object (one in bf16) and compares each "
              "step's output, gradients and weights with the single process's",
        readiness="the layer calls f and g once each per pass, on one activation: no bucket of several gradients "
                  "whose completion order the answer could depend on"),
    _ex("08_tensor_parallel", "forward_bytes_answer", value_answer=True),
    # --- lab 06 ---
    _ex("06_ddp_from_scratch", "ddp_individual", ("gradients", "communication")),
    _ex("06_ddp_from_scratch", "assign_buckets"),   # steps: called again after the caller changed its last answer
    _ex("06_ddp_from_scratch", "ddp_bucketed", ("gradients", "communication")),
    _ex("06_ddp_from_scratch", "one_bucket_answer", value_answer=True),
    _ex("09_pipeline_parallel", "schedules"),
    _ex("09_pipeline_parallel", "pipeline_engine", ("communication",),
        readiness="the order of the sends is the schedule the test passes (GPipe, 1F1B and other cases, a different "
                  "order per rank): the engine must follow it, it chooses no order of its own"),
    _ex("09_pipeline_parallel", "bubble_formulas",
        steps="two pure functions of integers: nothing is kept between calls, so every drawn hidden case is a fresh "
              "step"),
    _ex("09_pipeline_parallel", "microbatch_answer", value_answer=True),
    _ex("10_fault_tolerance", "app_state", ("device_state",),
        inputs="start() owns what it is given: it shards the model in place and the AppState keeps the sampler the "
               "run steps; the graded runs compare every step with an uninterrupted run instead",
        aliasing="a state_dict hands DCP the live parameters and optimizer state by design (get_state_dict returns "
                 "them, not copies) and DCP loads into them in place",
        steps="the precheck and the graded torchrun run train six and more steps, stop or are killed, resume and "
              "compare every step with the uninterrupted run bit for bit"),
    _ex("10_fault_tolerance", "young_daly", ("numerics",),
        steps="three pure functions of numbers: nothing is kept between calls, so every hidden case is a fresh step"),
    _ex("10_fault_tolerance", "per_rank_answer", value_answer=True),
    # --- lab 11 ---
    _ex("11_strategy_benchmark", "strategy_class", ("gradients", "communication", "topology"),
        readiness="the answer launches no collective: sync_gradients asks the wrapper to finish, and the wrapper's "
                  "own hooks (lab 06's classes, PyTorch's DDP) launch and order the all-reduces; the torchrun run "
                  "trains with them and compares every row's weights with one process's"),
    _ex("11_strategy_benchmark", "full_from_shards", ("topology",),
        topology="the mesh is given as numbers (mesh_shape, placements), so every hidden case is already a mesh of its "
                 "own: 1-D and 2-D, uneven, nested, strided (FSDP2 x TP), replicated",
        steps="a function of its arguments alone: nothing is kept between calls, so every hidden case is a fresh step"),
    _ex("11_strategy_benchmark", "planner", ("numerics",),
        steps="two functions of their arguments alone (dicts and degrees): nothing is kept between calls, so every "
              "hidden case is a fresh step"),
    # --- lab 12 ---
    _ex("12_context_parallel", "cp_ring_forward", ("communication", "numerics", "topology"),
        topology="comm is the whole topology: the answer sees comm.rank and comm.world_size, never a group, "
                 "mesh or local rank; the hidden cases run the ring on 1, 3 and 4 thread ranks (at 3 and 4 the "
                 "left and right neighbours differ) with positions dealt out in a shuffled, uneven split"),
    _ex("12_context_parallel", "cp_ring_backward", ("communication", "numerics", "topology"),
        topology="as in the forward, comm (its rank and world size) is all the topology there is, and the hidden "
                 "cases run the backward's ring on 1, 3 and 4 thread ranks"),
    _ex("12_context_parallel", "cp_zigzag"),
    _ex("12_context_parallel", "cp_ulysses", ("communication", "numerics", "topology"),
        readiness="each re-shard is one all_to_all_single whose pieces arrive in group-rank order by contract, and the "
                  "rehearsal already lands an async one only at its wait (group_rehearsal._land): no order of "
                  "readiness is left for the answer to depend on"),
    _ex("12_context_parallel", "ulysses_bytes_answer", value_answer=True),
    # --- lab 13 ---
    _ex("13_expert_parallel", "moe_routing"),
    _ex("13_expert_parallel", "moe_aux_loss", ("numerics",),
        steps="a function of its arguments alone (a count and a mean): nothing is kept between calls, so every hidden "
              "case is a fresh step"),
    _ex("13_expert_parallel", "ep_dispatch", ("communication", "topology"),
        readiness="each all_to_all_single of the dispatch (counts, tokens, results, and the backward's two) delivers "
                  "in group-rank order by contract, and the rehearsal lands an async one only at its wait "
                  "(group_rehearsal._land): no order of readiness is left for the answer to depend on"),
    _ex("13_expert_parallel", "ep_dp", ("gradients", "communication", "topology"),
        readiness="it runs after the backward has finished and reduces the parameters in the order of the lists it "
                  "is handed, the same on every rank: no gradient becomes ready while it runs"),
    _ex("13_expert_parallel", "dispatch_bytes_answer", value_answer=True),
]
EXERCISES: dict[tuple[str, str], Exercise] = {(e.lab, e.name): e for e in _TABLE}


class HiddenCheck:
    """The hidden cases of one exercise. Use every applicable kind, then call ``done()`` (or use it as a context
    manager): a kind the table requires and the cell never applied is an error in the hidden test, not the
    student's (the solution then loses its points, which CI reports)."""

    def __init__(self, exercise: Exercise):
        self.exercise = exercise
        self.applied: set[str] = set()
        self._lock = threading.Lock()

    # --- bookkeeping ---------------------------------------------------------------------------------------
    def _mark(self, kind: str) -> None:
        if kind not in self.exercise.applicable:
            raise RuntimeError(f"hidden test of {self.exercise.name}: kind {kind!r} does not apply to it "
                               f"(traits {sorted(self.exercise.traits)}); add the trait in instructor/hidden_kinds.py")
        with self._lock:
            self.applied.add(kind)

    def stepped_aside(self, kinds: tuple[str, ...], why: str) -> None:
        """The harness that applies ``kinds`` did not run this answer (e.g. a thread rehearsal that cannot stand in
        for a collective the answer bound by name): they count as applied, and done() prints why they were not."""
        for kind in kinds:
            self._mark(kind)
        self.aside = getattr(self, "aside", []) + [f"{', '.join(kinds)} stepped aside ({why})"]

    def done(self) -> None:
        missing = [k for k in self.exercise.required if k not in self.applied]
        if missing:
            raise RuntimeError(f"hidden test of {self.exercise.lab}/{self.exercise.name} never applied "
                               f"{missing} (instructor/hidden_kinds.py requires them; opt out with a reason there)")
        print(f"[hidden kinds] {self.exercise.name}: applied {', '.join(sorted(self.applied)) or 'none'}"
              + "".join(f"; {k} left out ({r})" for k, r in self.exercise.opt_out.items())
              + "".join(f"; {a}" for a in getattr(self, "aside", [])))

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.done()
        return False

    # --- inputs and aliasing -------------------------------------------------------------------------------
    def call(self, fn: Callable, *args, mutable: tuple = (), what: str = "", in_place: tuple = (), **kwargs):
        """fn(*args, **kwargs) with every argument deep-copied before and compared after the call, except those
        named in ``mutable`` (positions or keyword names: what the exercise is meant to change, e.g. the model
        an optimizer step updates) or ``in_place`` (tensors the exercise writes its result into by design: their
        elements may change, nothing else: see ``_in_place_difference``). What comes back is then checked for
        aliasing (``check_no_aliasing``; it may be an ``in_place`` tensor, the exercise's output)."""
        self._mark("inputs")
        self._mark("aliasing")
        what = what or getattr(fn, "__name__", "the answer")
        named = [(i, a) for i, a in enumerate(args)] + list(kwargs.items())
        for key, a in named:
            if key in in_place and not isinstance(a, torch.Tensor):
                raise TypeError(f"in_place names argument {key}, a {type(a).__name__}: only a tensor is written in place")
        mutable = tuple(mutable) + tuple(in_place)
        around = {key: _in_place_snapshot(a) for key, a in named if key in in_place}
        before = {key: _snapshot(a) for key, a in named if key not in mutable}
        result = fn(*args, **kwargs)
        for key, a in named:
            if key in in_place:
                diff = _in_place_difference(around[key], a)
                checks.check_true(diff is None, f"{what} wrote into argument {key} beyond its own elements ({diff})",
                                  hint="write the result into the tensor's own elements (through tensor.view(-1)), "
                                       "keep its shape, dtype and memory, and touch nothing around it")
        for key, a in named:
            if key in mutable:
                continue
            diff = _difference(before[key], a)
            label = f"argument {key}" if isinstance(key, int) else f"argument {key}="
            checks.check_true(diff is None, f"{what} changed the caller's {label} ({diff})",
                              hint="work on a copy (or a new tensor): the caller still uses what it passed")
        self.check_no_aliasing(result, args=[a for key, a in named if key not in mutable], what=what)
        return result

    def check_no_aliasing(self, result, args=(), what: str = "the answer", per_entry: bool = True) -> None:
        """``result``'s entries (a list, tuple or dict: one per rank, step or bucket) are distinct objects that share
        no tensor storage with each other, and nothing in it shares storage with ``args``."""
        self._mark("aliasing")
        entries = list(result.values()) if isinstance(result, dict) else list(result) \
            if isinstance(result, (list, tuple)) else []
        if per_entry:
            mutable_entries = [(i, e) for i, e in enumerate(entries) if not isinstance(e, (int, float, str, bool, bytes,
                                                                                           type(None), tuple))]
            seen: dict[int, int] = {}
            for i, e in mutable_entries:
                j = seen.setdefault(id(e), i)
                checks.check_true(j == i, f"{what} returned one object for entries {j} and {i} (each needs its own)",
                                  hint="build a new object per entry, e.g. [make() for _ in range(n)], not [obj] * n")
            spans = [(i, span) for i, e in enumerate(entries) for span in _spans(e)]
            for a, (i, x) in enumerate(spans):
                for j, y in spans[a + 1:]:
                    checks.check_true(i == j or not _overlap(x, y),
                                      f"{what} returned entries {i} and {j} sharing one tensor's memory",
                                      hint="each entry needs its own tensor (clone it)")
        given = [span for a in args for span in _spans(a)]
        shared = any(_overlap(x, y) for x in _spans(result) for y in given)
        checks.check_true(not shared, f"{what} returned a tensor that shares memory with one of its arguments",
                          hint="return a new tensor (clone), not a view of what the caller passed")

    # --- steps ---------------------------------------------------------------------------------------------
    def steps(self, step: Callable[[int], object], check: Callable[[int, object], None], n: int = STEPS) -> list:
        """step(i) then check(i, its result) for i = 0..n-1 on the same student object; a failure names the step."""
        if n < STEPS:
            raise ValueError(f"steps needs at least {STEPS} steps (a state reset only at the first shows from the "
                             f"second; one that grows shows by the third), got {n}")
        self._mark("steps")
        out = []
        for i in range(n):
            result = step(i)
            try:
                check(i, result)
            except checks.CheckFailed as exc:
                raise checks.CheckFailed(f"step {i + 1} of {n} on the same object: {exc}") from None
            out.append(result)
        return out

    # --- gradients -----------------------------------------------------------------------------------------
    GRADIENT_STARTS = ("set_to_none=False", "accumulated")

    def gradient_starts(self) -> Iterator[str]:
        """The two states a training loop may leave .grad in besides None: yields each name; prepare the model with
        ``leave_gradients`` inside the loop. The kind counts as applied once both were visited."""
        for start in self.GRADIENT_STARTS:
            yield start
        self._mark("gradients")

    @staticmethod
    def leave_gradients(model: torch.nn.Module, start: str, loss: Callable[[], torch.Tensor]) -> None:
        """Leave .grad as a loop would: "set_to_none=False": a backward, then zero_grad(set_to_none=False) (zero
        tensors, not None); "accumulated": two backwards of ``loss()`` and no clearing (stale sums)."""
        if start not in HiddenCheck.GRADIENT_STARTS:
            raise ValueError(f"start must be one of {HiddenCheck.GRADIENT_STARTS}, got {start!r}")
        loss().backward()
        if start == "set_to_none=False":
            model.zero_grad(set_to_none=False)
        else:
            loss().backward()

    # --- readiness -----------------------------------------------------------------------------------------
    def readiness_orders(self, n: int, seed: int = 0) -> list[list[int]]:
        """Orders of n items in which they become ready, none equal to registration order 0..n-1: the reverse
        (what autograd usually does) and a seeded shuffle that is neither forward nor reverse (n >= 3)."""
        if n < 2:
            raise ValueError(f"a readiness order needs at least 2 items, got {n}")
        self._mark("readiness")
        orders = [list(range(n))[::-1]]
        if n >= 3:
            rng, order = random.Random(seed), list(range(n))
            while order in (list(range(n)), orders[0]):
                rng.shuffle(order)
            orders.append(order)
        return orders

    # --- extremes ------------------------------------------------------------------------------------------
    def extremes(self, x: torch.Tensor, scales=EXTREME_SCALES) -> Iterator[tuple[str, torch.Tensor]]:
        """(label, x * scale) for each scale; the kind counts as applied once every scale was visited."""
        for s in scales:
            yield f"inputs scaled by {s:g}", (x.detach() * s).requires_grad_(x.requires_grad)
        self._mark("extremes")

    # --- topology ------------------------------------------------------------------------------------------
    def second_node(self, world_size: int = 4, nodes: int = 2, device: str = "cpu", backend: str = "gloo") -> list:
        """DistEnvs of every rank of ``nodes`` nodes with world_size // nodes ranks each: on every node but the
        first, local_rank != rank (an answer that uses one for the other is wrong only there)."""
        from lablib.jobs.distenv import DistEnv

        if world_size % nodes or world_size // nodes < 1:
            raise ValueError(f"world_size {world_size} does not split into {nodes} equal nodes")
        self._mark("topology")
        per_node = world_size // nodes
        return [DistEnv(r, r % per_node, world_size, per_node, torch.device(device), backend) for r in range(world_size)]

    def named_mesh(self, name: str = "hidden_dp"):
        """A 1-D DeviceMesh over this process's world whose dimension has a name no default mesh has: an answer
        that ignores the mesh it is given builds its own (unnamed) one. Needs a process group."""
        from torch.distributed.device_mesh import init_device_mesh
        import torch.distributed as dist

        self._mark("topology")
        return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=(name,))

    # --- device state --------------------------------------------------------------------------------------
    CUDA_MARKER = torch.frombuffer(bytearray(b"hidden:cuda-rng!"), dtype=torch.uint8)   # 16 bytes, as Philox's state

    @contextlib.contextmanager
    def fake_cuda_generators(self, module) -> Iterator[list]:
        """Inside the block, the student's ``module`` sees a machine with one GPU whose generator state is
        ``CUDA_MARKER``: its ``torch.cuda`` (and ``torch.cuda.random``) answer is_available() True, device_count() 1,
        get_rng_state(_all) the marker; set_rng_state(_all) calls are recorded in the list yielded. Only the student's
        module is changed (its global ``torch`` is a stand-in), so torch's own code still runs on the CPU."""
        restored: list = []
        fake = _FakeCuda(self.CUDA_MARKER, restored)
        saved = dict(vars(module))
        module.torch = _TorchWithCuda(torch, fake)
        for name, value in saved.items():
            if value is torch.cuda or value is torch.cuda.random:
                setattr(module, name, fake)
            elif callable(value) and getattr(value, "__module__", "") in ("torch.cuda.random", "torch.cuda") and \
                    hasattr(_FakeCuda, getattr(value, "__name__", "")):
                setattr(module, name, getattr(fake, value.__name__))
        try:
            yield restored
        finally:
            for name, value in saved.items():
                setattr(module, name, value)

    def check_device_state_present(self, state, what: str, restored: list | None = None) -> None:
        """``state`` (what the answer saves) holds the GPU generator state that ``fake_cuda_generators`` showed it;
        with ``restored`` (that block's list), the answer also put it back. A CPU run can check no more: the values
        exist only on a GPU."""
        self._mark("device_state")
        checks.check_true(_holds(state, self.CUDA_MARKER), f"{what}: the GPU's random generator state is not in it "
                          f"(on a machine with a GPU)", hint="save torch.cuda's generator states whenever a GPU is "
                          "there (torch.cuda.get_rng_state_all()); a CPU run cannot see their values, a GPU run needs them")
        if restored is not None:
            checks.check_true(any(_holds(r, self.CUDA_MARKER) for r in restored),
                              f"{what}: loading it did not restore the GPU's random generator state",
                              hint="torch.cuda.set_rng_state_all(...) with what was saved, when a GPU is there")

    # --- readiness of point-to-point receives, groups of thread ranks (labs 12 and 13) -------------------------------
    def late_receives(self, comm):
        """``comm`` (a point-to-point comm whose isend/irecv return works with wait()) with receives that become ready
        only when their work is waited, the latest a backend may deliver them, not when the peer happens to post first
        (as a thread rehearsal otherwise delivers): an answer that reads a receive buffer before waiting on it (every
        wait left to the end of the loop) then reads the wrong bytes on every run, not on some. All else is comm's."""
        self._mark("readiness")
        return _LateReceives(comm)

    def other_groups(self, world_size: int = 4) -> dict[str, list[list[int]]]:
        """Ways to cut ``world_size`` ranks into groups other than the default one (every rank in rank order), each a
        list of groups of world ranks in group-rank order: "halves" (consecutive ranks, as context-parallel groups
        beside data parallelism), "strided" (every other rank: a 2-D mesh's other dimension, where a group rank is not
        the world rank minus an offset) and "reversed" (one group whose rank i is world rank N-1-i). An answer that uses
        the world's rank, size or default group where the given group's belong is wrong in at least one of them."""
        if world_size < 4 or world_size % 2:
            raise ValueError(f"other_groups needs an even world_size of at least 4 (two groups of 2 or more), "
                             f"got {world_size}")
        self._mark("topology")
        half = world_size // 2
        return {"halves": [list(range(half)), list(range(half, world_size))],
                "strided": [list(range(0, world_size, 2)), list(range(1, world_size, 2))],
                "reversed": [list(range(world_size))[::-1]]}

    # --- topology: groups formed beside each other --------------------------------------------------------------
    def subgroups(self, world_size: int, size: int) -> list[list[int]]:
        """The ranks of world_size // size groups of ``size`` consecutive ranks, to be formed at once: none is the
        default group, and in every group but the first a rank's place in its group differs from its global rank (an
        answer that uses the default group instead of the one it is given, or dist.get_rank() for its place in it, is
        wrong there)."""
        if size < 2 or world_size % size or world_size == size:
            raise ValueError(f"{world_size} ranks do not split into several groups of {size} (>= 2) ranks")
        self._mark("topology")
        return [list(range(first, first + size)) for first in range(0, world_size, size)]


class _LateReceives:
    """A comm whose irecv lands in a buffer of its own, copied into the caller's tensor at the first wait()."""

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def irecv(self, tensor, src):
        landing = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        return _LandsWhenWaited(self._comm.irecv(landing, src), lambda: tensor.copy_(landing))


class _LandsWhenWaited:
    def __init__(self, work, land):
        self._work, self._land = work, land

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        if self._land is not None:
            with torch.no_grad():
                self._land()
            self._land = None
        return result

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        if done:
            self.wait()
        return done


class _FakeCuda:
    """torch.cuda as the student's module sees it inside fake_cuda_generators (also standing in for torch.cuda.random)."""

    def __init__(self, marker: torch.Tensor, restored: list):
        self._marker, self._restored = marker, restored
        self.random = self

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def get_rng_state(self, device="cuda"):
        return self._marker.clone()

    def get_rng_state_all(self):
        return [self._marker.clone()]

    def set_rng_state(self, new_state, device="cuda"):
        self._restored.append(new_state)

    def set_rng_state_all(self, new_states):
        self._restored.append(list(new_states))

    def manual_seed(self, seed):
        pass

    manual_seed_all = manual_seed

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _TorchWithCuda:
    """The torch module with another torch.cuda: what the student's module calls ``torch`` inside the block."""

    def __init__(self, real, cuda):
        self._real, self.cuda = real, cuda

    def __getattr__(self, name):
        return getattr(self._real, name)


def _holds(value, marker: torch.Tensor, depth: int = 0) -> bool:
    """Whether a tensor equal to marker is somewhere in value (containers, and objects through their attributes)."""
    if depth > 8:
        return False
    if isinstance(value, torch.Tensor):
        return value.shape == marker.shape and value.dtype == marker.dtype and torch.equal(value.cpu(), marker)
    if isinstance(value, dict):
        return any(_holds(v, marker, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds(v, marker, depth + 1) for v in value)
    if isinstance(value, (bytes, bytearray)):   # a pickled blob (lablib's per_rank): the tensor's bytes are in it
        return bytes(marker.numpy()) in value
    if hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, type)):
        return any(_holds(v, marker, depth + 1) for v in vars(value).values())
    return False


def hidden(lab: str, name: str) -> HiddenCheck:
    """The one entry point of a hidden test cell: ``with hidden("01_...", "accumulation_step") as hk: ...``."""
    try:
        return HiddenCheck(EXERCISES[(lab, name)])
    except KeyError:
        raise KeyError(f"{lab}/{name} is not in instructor/hidden_kinds.py's table: add it with its traits") from None


# --- comparison helpers ------------------------------------------------------------------------------------
def _snapshot(value):
    """A copy to compare with later: tensors detached and cloned (a non-leaf tensor refuses deepcopy), containers
    rebuilt, anything else deep-copied."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_snapshot(v) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: _snapshot(v) for k, v in value.items()}
    try:
        return copy.deepcopy(value)
    except Exception as exc:  # noqa: BLE001 - an argument that cannot be copied is compared by identity only
        return _Uncopyable(value, exc)


@dataclass
class _Uncopyable:
    value: object
    error: Exception


def _difference(before, after, path: str = "") -> str | None:
    """A short description of the first difference between a snapshot and the object now, or None."""
    where = path or "it"
    if isinstance(before, _Uncopyable):
        return None if before.value is after else f"{where} was replaced"
    if isinstance(before, torch.Tensor):
        if not isinstance(after, torch.Tensor):
            return f"{where} is no longer a tensor"
        if before.shape != after.shape or before.dtype != after.dtype:
            return f"{where} changed from {tuple(before.shape)} {before.dtype} to {tuple(after.shape)} {after.dtype}"
        if not torch.equal(torch.nan_to_num(before.detach()), torch.nan_to_num(after.detach())) or \
                not torch.equal(before.detach().isnan(), after.detach().isnan()):
            return f"{where}'s values changed in place"
        return None
    if isinstance(before, torch.nn.Module):
        b, a = before.state_dict(), after.state_dict()
        return _difference(dict(b), dict(a), path + ".state_dict()")
    if isinstance(before, (list, tuple)):
        if type(before) is not type(after) or len(before) != len(after):
            return f"{where} had {len(before)} entries, now {len(after) if hasattr(after, '__len__') else '?'}"
        for i, (x, y) in enumerate(zip(before, after)):
            d = _difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    if isinstance(before, dict):
        if set(before) != set(after):
            return f"{where}'s keys changed: {sorted(map(str, before))} -> {sorted(map(str, after))}"
        for k in before:
            d = _difference(before[k], after[k], f"{path}[{k!r}]")
            if d:
                return d
        return None
    if isinstance(before, float) and isinstance(after, float) and math.isnan(before) and math.isnan(after):
        return None
    if isinstance(before, (int, float, str, bytes, bool, type(None))):
        return None if before == after else f"{where} changed from {before!r} to {after!r}"
    if hasattr(before, "__array__") and hasattr(after, "__array__"):       # NumPy arrays and scalars
        import numpy as np
        return None if np.array_equal(before, after, equal_nan=True) else f"{where}'s values changed in place"
    if type(before).__eq__ is not object.__eq__:
        # A type that says what equal means (a dataclass, a DeviceMesh): its own comparison, not its attributes, which
        # may include caches filled on first use (DeviceMesh's hash).
        same = before == after
        if isinstance(same, bool):
            return None if same else f"{where} changed from {before!r} to {after!r}"
    return None     # an object with no equality of its own (a DataLoader): only its replacement is seen, by the caller


def _in_place_snapshot(t: torch.Tensor) -> tuple:
    """What an in-place argument must keep: its layout, its memory, and every byte of its storage outside its own
    elements (a view into a larger buffer shows writes around it)."""
    storage = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    return (tuple(t.shape), t.stride(), t.dtype, t.storage_offset(), t.untyped_storage().data_ptr(),
            storage.clone(), _spans(t))


def _in_place_difference(before: tuple, t: torch.Tensor) -> str | None:
    shape, stride, dtype, offset, storage_ptr, storage_bytes, spans = before
    now = (tuple(t.shape), t.stride(), t.dtype, t.storage_offset())
    if now != (shape, stride, dtype, offset):
        return f"its shape, strides, dtype or offset changed from {(shape, stride, dtype, offset)} to {now}"
    if t.untyped_storage().data_ptr() != storage_ptr:
        return "it was given new memory (resize_ or set_): the caller's buffer no longer holds it"
    after = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    keep = torch.ones(len(storage_bytes), dtype=torch.bool)
    for _, _, first, end in spans:                  # its own elements' bytes may change
        keep[first - storage_ptr:end - storage_ptr] = False
    changed = (after.cpu() != storage_bytes.cpu()) & keep
    if changed.any():
        return f"{int(changed.sum())} bytes of its storage outside its elements changed, the first at byte " \
               f"{int(changed.nonzero()[0])}"
    return None


def _spans(value, depth: int = 0) -> list:
    """(device, storage, first byte, end byte) of the memory each non-empty tensor in value can reach (lists, tuples,
    dicts, modules): two tensors alias when their spans overlap (chunks of one new tensor do not)."""
    if depth > 6:
        return []
    if isinstance(value, torch.Tensor):
        if hasattr(value, "to_local"):          # a DTensor: the memory is its local shard's
            value = value.to_local()
        if value.numel() == 0 or value.device.type == "meta":
            return []
        try:
            storage = value.untyped_storage().data_ptr()
        except RuntimeError:                    # a tensor subclass without storage of its own
            return []
        first = value.data_ptr()
        reach = sum((n - 1) * abs(st) for n, st in zip(value.shape, value.stride())) + 1
        return [(str(value.device), storage, first, first + reach * value.element_size())]
    if isinstance(value, torch.nn.Module):
        return [s for t in value.state_dict(keep_vars=True).values() for s in _spans(t, depth + 1)]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _spans(v, depth + 1)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _spans(v, depth + 1)]
    return []


def _overlap(x: tuple, y: tuple) -> bool:
    return x[:2] == y[:2] and x[2] < y[3] and y[2] < x[3]


def report(lab: str | None = None) -> str:
    """The instructor's table: per exercise, the kinds its hidden test applies and each opt-out with its reason."""
    lines = ["lab | exercise | kinds applied | opt-outs (reason)", "---|---|---|---"]
    for e in sorted(_TABLE, key=lambda e: e.lab):     # stable: each lab's exercises keep the table's order
        if lab and e.lab != lab:
            continue
        if e.value_answer:
            lines.append(f"{e.lab} | {e.name} | - | a value answer (no code is called): no kind applies")
            continue
        outs = "; ".join(f"{k}: {r}" for k, r in e.opt_out.items()) or "-"
        lines.append(f"{e.lab} | {e.name} | {', '.join(e.required)} | {outs}")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(report(sys.argv[1] if len(sys.argv) > 1 else None))
