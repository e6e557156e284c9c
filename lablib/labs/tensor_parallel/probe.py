"""Lab 08's probe of the students' tensor-parallel code: what the graded runs share (``run``, the step
``tensor_parallel``, runs the probes on 2-4 ranks; the notebook runs ``probe_without_processes`` at world size 1 first, a quick
pre-check before a torchrun start). One module per exercise's probe and checks:

- ``f_g``: exercise 1, Megatron's f and g (Shoeybi et al., 2019, arXiv:1909.08053, section 3),
  autograd Functions calling torch.distributed's all_reduce;
- ``layers``: exercises 2 and 3, ``ColumnParallelLinear``, ``RowParallelLinear`` (each graded
  alone), ``TensorParallelMLP`` and ``TensorParallelAttention`` against the single-process module;
- ``heads``: whole heads, and the sizes a group does not divide, refused with a full message.

Here: ``DTensorFG`` (DTensor's own f and g, which exercises 2 and 3 import while they are graded, so a wrong
exercise 1 cannot cost them their points), ``load_impl``, the groups a run checks, the ranks' records merged, and
the world-size-1 pre-check. The notebook reaches every probe and check through this module's names.
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections import Counter

import torch
import torch.distributed as dist

from lablib.jobs.distenv import DistEnv
from lablib.jobs.exercise import load_fresh
from lablib.labs.tensor_parallel.f_g import check_f_g, merge_f_g, probe_f_g  # noqa: F401 - the notebook's names
from lablib.labs.tensor_parallel.heads import check_indivisible, head_split_problems, probe_indivisible  # noqa: F401
from lablib.labs.tensor_parallel.layers import CLASSES, KINDS, check_layer, probe_layer  # noqa: F401
from lablib.jobs.distenv import gather_objects

COMM_MODULE = "tp_comm_impl"     # exercise 1's file (tp_comm_impl.py); exercises 2 and 3 import f and g from it
# exercise -> the names its file must define
REQUIRED = {"f_g": ("f", "g"),              # the autograd Functions: checked by the probe (f_g)
            "mlp": ("ColumnParallelLinear", "RowParallelLinear", "TensorParallelMLP"),
            "attention": ("TensorParallelAttention",)}


# --- exercises 2 and 3's f and g: DTensor's ---------------------------------------------------------------------

class DTensorFG:
    """f and g made of DTensor's own autograd, which exercises 2 and 3 import while they are graded (``load_impl``).

    f(x, group): x declared whole on every rank (``Replicate``) and returned as a plain tensor whose gradient is
    declared a partial sum (``to_local(grad_placements=[Partial()])``): the identity forward; in the backward
    DTensor makes the gradient whole: an all-reduce. g(x, group): x declared the rank's partial sum (``Partial``)
    and redistributed to ``Replicate``: an all-reduce forward; its backward (Replicate to Partial) sends nothing.

    Not exercise 1's answer (autograd functions calling torch.distributed's all_reduce): DTensor issues functional
    collectives, and none on a group of one rank (a sum over one rank is the tensor itself), which check_f_g
    refuses. One mesh per group (``DeviceMesh.from_group``), made at its first use. ``calls`` counts the calls of
    each (the layer checks ask that a column-parallel layer call f, a row-parallel one g, once each, in any world).
    """

    def __init__(self):
        self._meshes: dict[tuple[int, str], tuple] = {}
        self.calls: Counter = Counter()

    def _mesh(self, group, device_type: str):
        from torch.distributed.device_mesh import DeviceMesh

        key = (id(group), device_type)
        if key not in self._meshes:            # the group is kept with its mesh: its id is not reused meanwhile
            self._meshes[key] = (group, DeviceMesh.from_group(group, device_type))
        return self._meshes[key][1]

    def f(self, x: torch.Tensor, group) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial, Replicate

        self.calls["f"] += 1
        mesh = self._mesh(group, x.device.type)
        return DTensor.from_local(x, mesh, [Replicate()]).to_local(grad_placements=[Partial()])

    def g(self, x: torch.Tensor, group) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial, Replicate

        self.calls["g"] += 1
        mesh = self._mesh(group, x.device.type)
        return DTensor.from_local(x, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local()


class ThreadFG:
    """f and g for the thread rehearsal (``rehearse``: ranks as threads, ``lablib.probes.rehearsal``), which
    exercises 2 and 3 import there instead of ``DTensorFG`` (DTensor's collectives do not run on threads).

    Made of what the rehearsal fakes, and unlike exercise 1's answer on purpose: f is the identity with a gradient
    hook, g a sum whose gradient passes through; both sum by ``dist.all_gather`` and adding the ranks' tensors.
    Exercise 1's check refuses it (no autograd Function, no all-reduce). ``calls`` counts per thread (each thread
    is a rank)."""

    def __init__(self):
        self._local = threading.local()

    @property
    def calls(self) -> Counter:
        if not hasattr(self._local, "calls"):
            self._local.calls = Counter()
        return self._local.calls

    @staticmethod
    def _sum(t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.detach().contiguous())
        total = parts[0].clone()
        for part in parts[1:]:                 # rank order, as the rehearsal sums
            total += part
        return total

    def f(self, x: torch.Tensor, group) -> torch.Tensor:
        self.calls["f"] += 1
        y = x.view_as(x)
        if y.requires_grad:
            y.register_hook(self._sum)
        return y

    def g(self, x: torch.Tensor, group) -> torch.Tensor:
        self.calls["g"] += 1
        return self._sum(x) + (x - x.detach())    # the sum's value; the gradient reaches x unchanged


def load_impl(path: str, required: tuple[str, ...], reference_comm: bool | str):
    """The exercise module at path, loaded fresh, its folder importable (exercises 2 and 3 import f and g
    from exercise 1's file beside them). With reference_comm, that import gets a stand-in module holding a new
    ``DTensorFG``'s f and g, whatever exercise 1's file holds, and the module gets the pair as ``course_f_g`` (its
    ``calls`` tell the checks where f and g were called). ``reference_comm="threads"``: ``ThreadFG`` instead,
    for the thread rehearsal."""
    if not reference_comm:
        return load_fresh(path, required=required)
    stand_in, pair = types.ModuleType(COMM_MODULE), (ThreadFG() if reference_comm == "threads" else DTensorFG())
    stand_in.f, stand_in.g = pair.f, pair.g
    module = load_fresh(path, required=required, stand_ins={COMM_MODULE: stand_in})
    module.course_f_g = pair
    return module


def parse_groups(spec: str) -> tuple[int, int]:
    """A run's tensor-parallel groups: '3' -> (1 group, of 3 ranks); '2x2' -> (2 groups of 2 ranks, at once)."""
    count, _, size = spec.rpartition("x")
    return int(count or 1), int(size)


def nproc_for(groups) -> int:
    """The ranks a run checking ``groups`` (e.g. ("2x2", "3", "4")) needs: the largest of them."""
    return max(count * size for count, size in map(parse_groups, groups))


def runs_of(exercise: str, cases) -> list[tuple[str, str]]:
    """(kind, case) pairs a graded run checks, in order: every case of every class the exercise grades (the MLP's
    refusal of a width is its linear layers': the MLP only passes sizes on); f and g: all input cases in one probe."""
    if exercise == "f_g":
        return [("f_g", "inputs")]
    return [(kind, case) for kind in KINDS[exercise] for case in cases if not (case == "indivisible" and kind == "mlp")]


def check_record(r: dict) -> None:
    """The check of one record of a graded run, by what it holds."""
    if "cases" in r:
        check_f_g(r)
    elif "tries" in r:
        check_indivisible(r)
    else:
        check_layer(r)


def merge_ranks(per_rank: list[dict]) -> dict:
    """Rank 0's record, with every difference the worst over the ranks and the first error any rank saw."""
    merged = dict(per_rank[0])
    merged["error"] = next((r["error"] for r in per_rank if r.get("error")), None)
    if "max_diff" in merged:
        merged["max_diff"] = {k: max(r.get("max_diff", {}).get(k, float("inf")) for r in per_rank) for k in merged["max_diff"]}
        if merged.get("bounds") is not None:
            merged["bounds"] = {k: min((r.get("bounds") or {}).get(k, 0.0) for r in per_rank) for k in merged["bounds"]}
    if "cases" in merged:
        merge_f_g(merged, per_rank)
    return merged


# --- world size 1, in the notebook's process -----------------------------------------------------------------------

@contextlib.contextmanager
def one_process():
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo")
    finally:
        if owned:
            dist.destroy_process_group()


def probe_without_processes(impl, exercise: str, cases: tuple[str, ...] | None = None) -> list[dict]:
    """The exercise's probe at world size 1 in this process: a quick look before a real run, never a
    replacement for it (on one rank every sum is the input itself, so the counts are what it can show; a size
    one rank does not divide does not exist). ``cases``: f and g's inputs, or the layers' cases (default: plain;
    with and without biases)."""
    with one_process() as env:
        group = dist.group.WORLD
        if exercise == "f_g":
            return [probe_f_g(impl, 1, group, 0, tuple(cases or ("plain",)))]
        return [probe_layer(impl, kind, 1, group, env, case=case, steps=2)
                for kind in KINDS[exercise] for case in (cases or ("bias", "nobias")) if case != "indivisible"]


def rehearse(path: str, exercise: str, world_size: int, cases) -> list[dict]:
    """The exercise's probes on ``world_size`` threads standing in for ranks (``lablib.probes.rehearsal``), in a
    second, before the torchrun start: one merged record per (kind, case), marked ``rehearsal`` (the collectives
    are not counted there: the fakes stand beside torch's communication ops; values, shapes, refusals and the calls
    of f and g are checked). Exercises 2 and 3 run with ``ThreadFG``. [] when the rehearsal cannot emulate what the
    code calls (``RehearsalUnsupported``): the real run decides."""
    from lablib.probes.rehearsal import RehearsalUnsupported, run_in_thread_ranks

    if dist.is_initialized():                  # the rehearsal replaces torch.distributed's functions for a moment
        return []
    impl = load_impl(path, REQUIRED[exercise], reference_comm=False if exercise == "f_g" else "threads")
    group = "rehearsal"                        # the fakes ignore the group: every thread is in it

    def body(rank: int) -> list[dict]:
        env = DistEnv(rank, rank, world_size, world_size, torch.device("cpu"), "gloo")
        if exercise == "f_g":
            return [probe_f_g(impl, world_size, group, rank, tuple(cases))]
        return [probe_indivisible(impl, kind, world_size, group) if case == "indivisible" else
                probe_layer(impl, kind, world_size, group, env, case=case, steps=2)
                for kind, case in runs_of(exercise, cases)]
    try:
        per_rank = run_in_thread_ranks(world_size, body)
    except RehearsalUnsupported:
        return []
    return [{**merge_ranks(list(records)), "rehearsal": True} for records in zip(*per_rank)]


def check_rehearsal(records: list[dict]) -> None:
    """The checks of a rehearsal's records, where the rehearsal can judge: a record whose probe raised (the
    student's code, or something threads cannot emulate) is left to the real run."""
    for r in records:
        if not r.get("error"):
            check_record(r)


def gather_record(record: dict, env, group) -> dict:
    """Every rank of group's records merged on the group's first rank (see merge_ranks)."""
    return merge_ranks(gather_objects(record, env, group))
