"""Lab 08's probe of the students' tensor-parallel code, and the graded checks of what it recorded
(``lablib.runs.tensor_parallel`` runs it on 2-4 ranks; the notebook runs ``probe_without_processes`` at world
size 1 first, a quick pre-check before a torchrun start).

Three exercises, each graded on its own:

- ``f_g``: Megatron's conjugate operators (Shoeybi et al., 2019, arXiv:1909.08053, section 3): f is the
  identity forward and an all-reduce of the gradient backward, g the all-reduce forward and the identity
  backward. Checked directly: each rank feeds its own input and upstream gradient, so the sums are visible, and
  the all-reduces are counted where the student's code calls torch.distributed (``lablib.measure.counting``).
- ``mlp``: ``TensorParallelMLP`` (``ColumnParallelLinear`` then ``RowParallelLinear``) built from the course
  GPT's ``MLPBlock``;
- ``attention``: ``TensorParallelAttention`` built from the course GPT's ``CausalSelfAttention``, heads split
  over the ranks.

The reference is the single-process module itself (``lablib.course.models``): the loss, the gradient of the input
and every parameter's gradient, gathered from the ranks' shards, must equal it, after every one of a few SGD
steps. While ``mlp`` and ``attention`` are graded, the students' f and g are replaced by ``DTensorFG``: DTensor's
own autograd (PyTorch's implementation of the same two operators, not exercise 1's answer: see its docstring), so
a wrong exercise 1 cannot cost exercises 2 and 3 their points. Collectives are counted with ``lablib.measure.counting``.

Where each shard sits in the full tensor (``LAYOUTS``): the MLP's by the notebook's contract, a column-parallel
weight rows [r*out/N, (r+1)*out/N) of the full weight, a row-parallel one columns [r*in/N, (r+1)*in/N); the
attention's found by value (``lablib.parallel.tensor_parallel.index_by_value``: the weights are random, so a copied row
matches one row only), then checked to be whole heads (``head_split_problems``), in whatever order the student
keeps them; gradients and weights are compared through that map.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn

from lablib import checks
from lablib.measure import counting
from lablib.probes.ddp import sgd_step_, zero_grad_
from lablib.jobs.distenv import DistEnv
from lablib.jobs.exercise import load_module, require_file
from lablib.course.models import CausalSelfAttention, GPTConfig, MLPBlock
from lablib.measure.rankcheck import gather_objects
from lablib.parallel.tensor_parallel import assembled, contiguous_index, index_by_value

COMM_MODULE = "tp_comm_impl"     # exercise 1's file (tp_comm_impl.py); exercises 2 and 3 import f and g from it
CLASSES = {"mlp": "TensorParallelMLP", "attention": "TensorParallelAttention"}
# parameter name -> how it is split: "col" a block of the weight's rows (output features), "row" a block of its
# columns (input features); "qkv" the q, k and v rows of this rank's heads and "heads" the columns of the same
# heads, both found by value, in any order; "replicated" the whole tensor on every rank.
LAYOUTS = {
    "mlp": {"c_fc.weight": "col", "c_fc.bias": "col", "c_proj.weight": "row", "c_proj.bias": "replicated"},
    "attention": {"c_attn.weight": "qkv", "c_attn.bias": "qkv", "c_proj.weight": "heads", "c_proj.bias": "replicated"},
}
SPLIT_DIM = {"col": 0, "qkv": 0, "row": 1, "heads": 1}     # the dimension each layout splits


# --- exercises 2 and 3's f and g: DTensor's ---------------------------------------------------------------------

class DTensorFG:
    """f and g made of DTensor's own autograd, which exercises 2 and 3 import while they are graded (``load_impl``).

    f(x, group): x declared whole on every rank (``Replicate``) and returned as a plain tensor whose gradient is
    declared a partial sum (``to_local(grad_placements=[Partial()])``): the identity forward; in the backward
    DTensor makes the gradient whole: an all-reduce. g(x, group): x declared the rank's partial sum (``Partial``)
    and redistributed to ``Replicate``: an all-reduce forward; its backward (Replicate to Partial) sends nothing.

    Not exercise 1's answer (autograd functions calling torch.distributed's all_reduce): DTensor issues functional
    collectives, and none on a group of one rank (a sum over one rank is the tensor itself), which check_f_g
    refuses. One mesh per group (``DeviceMesh.from_group``), made at its first use.
    """

    def __init__(self):
        self._meshes: dict[tuple[int, str], tuple] = {}

    def _mesh(self, group, device_type: str):
        from torch.distributed.device_mesh import DeviceMesh

        key = (id(group), device_type)
        if key not in self._meshes:            # the group is kept with its mesh: its id is not reused meanwhile
            self._meshes[key] = (group, DeviceMesh.from_group(group, device_type))
        return self._meshes[key][1]

    def f(self, x: torch.Tensor, group) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial, Replicate

        mesh = self._mesh(group, x.device.type)
        return DTensor.from_local(x, mesh, [Replicate()]).to_local(grad_placements=[Partial()])

    def g(self, x: torch.Tensor, group) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial, Replicate

        mesh = self._mesh(group, x.device.type)
        return DTensor.from_local(x, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local()


def load_impl(path: str, required: tuple[str, ...], reference_comm: bool):
    """The exercise module at path, loaded fresh, its folder importable (exercises 2 and 3 import f and g
    from exercise 1's file beside them). With reference_comm, that import gets a stand-in module holding a new
    ``DTensorFG``'s f and g, whatever exercise 1's file holds."""
    folder = str(require_file(path).parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    sys.modules.pop(COMM_MODULE, None)          # an older tp_comm_impl: the file as last written is what runs
    if reference_comm:
        stand_in, pair = types.ModuleType(COMM_MODULE), DTensorFG()
        stand_in.f, stand_in.g = pair.f, pair.g
        sys.modules[COMM_MODULE] = stand_in
    try:
        return load_module(path, required=required)
    finally:
        sys.modules.pop(COMM_MODULE, None)


def parse_groups(spec: str) -> tuple[int, int]:
    """A run's tensor-parallel groups: '3' -> (1 group, of 3 ranks); '2x2' -> (2 groups of 2 ranks, at once)."""
    count, _, size = spec.rpartition("x")
    return int(count or 1), int(size)


def nproc_for(groups) -> int:
    """The ranks a run checking ``groups`` (e.g. ("2x2", "3", "4")) needs: the largest of them."""
    return max(count * size for count, size in map(parse_groups, groups))


# --- the cases ---------------------------------------------------------------------------------------------------

def case_config(tp: int, bias: bool, n_head: int | None = None) -> GPTConfig:
    """Two heads per rank of 4 channels each (every size divides), or the n_head asked for."""
    n_head = n_head or 2 * tp
    return GPTConfig(vocab_size=17, block_size=8, n_layer=1, n_head=n_head, n_embd=4 * n_head, bias=bias)


def full_module(kind: str, config: GPTConfig, seed: int) -> nn.Module:
    """The single-process reference, with weights large enough (and biases nonzero) that a mistake shows."""
    torch.manual_seed(seed)
    module = MLPBlock(config) if kind == "mlp" else CausalSelfAttention(config)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if name.endswith("weight") else 0.2))
    return module


def shard_shape(shape: tuple, how: str, tp: int) -> tuple:
    """The shape of one rank's shard of a tensor of ``shape`` split by layout ``how`` over tp ranks."""
    if how == "replicated":
        return shape
    dim = SPLIT_DIM[how]
    return tuple(n // tp if d == dim else n for d, n in enumerate(shape))


def head_split_problems(rows: list[list[int]], columns: list[list[int]], n_embd: int, n_head: int) -> list[str]:
    """What is wrong with an attention's split over ranks, given where each rank's c_attn rows (``rows[r]``, indices
    into the full c_attn's 3 * n_embd rows: q, then k, then v) and c_proj columns (``columns[r]``, into its n_embd
    input columns) sit in the full weights, -1 for one found nowhere. Right: each rank holds the q, k and v rows of
    whole heads (head h: rows h * head_size .. (h + 1) * head_size - 1 of each of q, k and v) and c_proj's columns
    of the same heads, in any order; every head on exactly one rank. [] when all is right."""
    size = n_embd // n_head
    problems, heads_per_rank = [], []
    for r, (mine, cols) in enumerate(zip(rows, columns)):
        if -1 in mine:
            problems.append(f"rank {r}: row {mine.index(-1)} of its c_attn (with its bias) is no row of the full "
                            f"c_attn: copy whole rows of the weight and the same rows of the bias")
            continue
        if -1 in cols:
            problems.append(f"rank {r}: column {cols.index(-1)} of its c_proj.weight is no column of the full one: "
                            f"copy whole columns")
            continue
        heads = sorted({j % n_embd // size for j in mine})
        whole = sorted(part * n_embd + h * size + c for part in range(3) for h in heads for c in range(size))
        if sorted(mine) != whole:
            problems.append(f"rank {r}: its c_attn rows are not the q, k and v rows of whole heads (they touch heads "
                            f"{heads}; head h is rows h*{size}..h*{size}+{size - 1} of each of q, k and v, "
                            f"head_size={size}, and all {3 * size} of them belong on one rank)")
            continue
        if sorted(cols) != sorted(h * size + c for h in heads for c in range(size)):
            problems.append(f"rank {r}: its c_proj columns are not the channels of the heads its c_attn holds, "
                            f"{heads}: the output projection takes the same heads' outputs")
            continue
        heads_per_rank.append(heads)
    if not problems and sorted(h for heads in heads_per_rank for h in heads) != list(range(n_head)):
        problems.append(f"heads per rank {heads_per_rank}: each of the {n_head} heads must be on exactly one rank "
                        f"(rank r = dist.get_rank(group) keeps its own n_head / N of them)")
    return problems


def _shard_indices(student: nn.Module, reference: nn.Module, layout: dict, rank: int, tp: int) -> dict:
    """parameter name -> where this rank's shard sits along its layout's dimension of the full tensor."""
    mine, full = dict(student.named_parameters()), dict(reference.named_parameters())
    out = {}
    for name, how in layout.items():
        if how in ("col", "row"):
            out[name] = contiguous_index(full[name].shape[SPLIT_DIM[how]], rank, tp)
        elif how == "heads":
            out[name] = index_by_value(mine[name].T, full[name].T)
        elif how == "qkv":                     # a row of c_attn is found with its bias: they move together
            prefix = name.rsplit(".", 1)[0]
            rows, whole = mine[f"{prefix}.weight"].detach(), full[f"{prefix}.weight"].detach()
            if f"{prefix}.bias" in full:
                rows = torch.cat([rows, mine[f"{prefix}.bias"].detach()[:, None]], 1)
                whole = torch.cat([whole, full[f"{prefix}.bias"].detach()[:, None]], 1)
            out[name] = index_by_value(rows, whole)
    return out


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().float() - b.detach().float()).abs().max().item() if a.shape == b.shape else float("inf")


def probe_layer(impl, kind: str, tp: int, group, env, bias: bool = True, steps: int = 2, seed: int = 0) -> dict:
    """Build the student's module from the full one on group's ranks, train both a few SGD steps on the same
    batches, and record the losses, the largest gradient and weight differences, collectives and bytes."""
    config = case_config(tp, bias)
    reference = full_module(kind, config, seed)
    out = {"kind": kind, "tp": tp, "bias": bias, "steps": steps, "error": None, "forward": [], "backward": []}
    log = counting.CollectiveLog()
    try:
        try:
            student = getattr(impl, CLASSES[kind])(full_module(kind, config, seed), group)
            built = None
        except Exception as exc:  # noqa: BLE001
            built = f"{type(exc).__name__}: {exc}"
        # Every rank learns whether any rank failed before the first collective of the forward: an error on one
        # rank only would leave the others waiting in an all-reduce until the timeout.
        failed = [e for e in gather_objects(built, env, group) if e] if tp > 1 else [built] * (built is not None)
        if failed:
            raise RuntimeError(f"building {CLASSES[kind]} failed on a rank: {failed[0]}")
        names = dict(student.named_parameters())
        layout = {n: h for n, h in LAYOUTS[kind].items() if n in dict(reference.named_parameters())}
        out["missing"] = sorted(set(layout) - set(names))
        out["extra"] = sorted(set(names) - set(layout))
        out["param_bytes"] = sum(p.numel() * p.element_size() for p in student.parameters())
        full = dict(reference.named_parameters())
        out["expected_param_bytes"] = sum(full[n].numel() * full[n].element_size() // (1 if h == "replicated" else tp)
                                          for n, h in layout.items())
        out["full_param_bytes"] = sum(p.numel() * p.element_size() for p in reference.parameters())
        shapes = {n: tuple(names[n].shape) for n in layout if n in names}
        expected = {n: shard_shape(tuple(full[n].shape), h, tp) for n, h in layout.items()}
        out["wrong_shapes"] = {n: [list(shapes[n]), list(expected[n])] for n in shapes if shapes[n] != expected[n]}
        if out["missing"] or out["wrong_shapes"]:      # the same verdict on every rank: no forward is run
            return out
        index = _shard_indices(student, reference, layout, dist.get_rank(group), tp)
        if kind == "attention":                # where every rank's heads are, known to every rank: one verdict
            placed = gather_objects((index["c_attn.weight"].tolist(), index["c_proj.weight"].tolist()), env, group)
            out["head_split"] = head_split_problems([p[0] for p in placed], [p[1] for p in placed],
                                                    config.n_embd, config.n_head)
            if out["head_split"]:
                return out

        def whole(t: torch.Tensor, name: str) -> torch.Tensor:
            if layout[name] == "replicated":
                return t
            dim = SPLIT_DIM[layout[name]]
            return assembled(t, index[name], dim, full[name].shape[dim], group, tp)

        diffs = {"loss": 0.0, "input_grad": 0.0, "grad": 0.0, "weights": 0.0}
        worst = ""
        for step in range(steps):
            g = torch.Generator().manual_seed(seed * 100 + step)      # the same batch on every rank
            x = torch.randn(2, config.block_size, config.n_embd, generator=g)
            target = torch.randn(2, config.block_size, config.n_embd, generator=g)
            xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
            zero_grad_(student.parameters())
            zero_grad_(reference.parameters())
            with counting.count_collectives(log):
                log.reset()
                y = student(xs)
                out["forward"].append([[c.name, c.bytes] for c in log.calls])
                loss = ((y - target) ** 2).mean()
                log.reset()
                loss.backward()
                out["backward"].append([[c.name, c.bytes] for c in log.calls])
            ref_loss = ((reference(xr) - target) ** 2).mean()
            ref_loss.backward()
            diffs["loss"] = max(diffs["loss"], abs(loss.item() - ref_loss.item()))
            diffs["input_grad"] = max(diffs["input_grad"], _max_diff(xs.grad, xr.grad))
            for name in layout:
                p = names[name]
                d = _max_diff(whole(torch.zeros_like(p) if p.grad is None else p.grad, name), full[name].grad)
                if d > diffs["grad"]:
                    diffs["grad"], worst = d, name
            sgd_step_(student.parameters())
            sgd_step_(reference.parameters())
            diffs["weights"] = max(diffs["weights"], *(_max_diff(whole(names[n].data, n), full[n].data) for n in layout))
        out.update(max_diff=diffs, worst_grad=worst, loss=ref_loss.item(), bytes_per_activation=x.numel() * 4)
    except Exception as exc:  # noqa: BLE001 - a wrong answer is a result to report, not a crash of the run
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def probe_indivisible(impl, tp: int, group) -> dict:
    """TensorParallelAttention with a head count that tp does not divide: it must refuse, with a message."""
    config = case_config(tp, True, n_head=tp + 1)
    out = {"kind": "attention", "tp": tp, "n_head": config.n_head, "raised": None, "message": ""}
    try:
        impl.TensorParallelAttention(CausalSelfAttention(config), group)
    except Exception as exc:  # noqa: BLE001 - which error is the result
        out["raised"], out["message"] = type(exc).__name__, str(exc)
    return out


def probe_f_g(impl, tp: int, group, rank: int) -> dict:
    """f and g on their own: rank r feeds x_r and receives the upstream gradient w_r (different on each rank).
    Collectives are counted by name where torch.distributed is called; functional collectives (DTensor's, as in
    ``DTensorFG``) are listed apart, by torch's op."""
    def inputs(r):
        g = torch.Generator().manual_seed(1000 + r)
        return torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    xs, ws = zip(*(inputs(r) for r in range(tp)))
    x_sum, w_sum = torch.stack(xs).sum(0), torch.stack(ws).sum(0)
    out = {"tp": tp, "error": None}
    log = counting.CollectiveLog()

    def called():
        return dict(Counter(c.name for c in log.calls if not c.functional)), [c.function for c in log.calls if c.functional]
    try:
        for name, fn, want_y, want_grad in (("f", impl.f, xs[rank], w_sum), ("g", impl.g, x_sum, ws[rank])):
            x = xs[rank].clone().requires_grad_()
            before = x.detach().clone()
            with counting.count_collectives(log):
                log.reset()
                y = fn(x, group)
                forward, functional = called()
                log.reset()
                y.backward(ws[rank])
                backward, functional_backward = called()
            out[name] = {"forward": forward, "backward": backward, "functional": functional + functional_backward,
                         "y_diff": _max_diff(y, want_y),
                         "grad_diff": _max_diff(x.grad, want_grad) if x.grad is not None else float("inf"),
                         "input_changed": not torch.equal(x.detach(), before), "bytes": x.numel() * 4}
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def merge_ranks(per_rank: list[dict]) -> dict:
    """Rank 0's record, with every difference the worst over the ranks and the first error any rank saw."""
    merged = dict(per_rank[0])
    merged["error"] = next((r["error"] for r in per_rank if r.get("error")), None)
    if "max_diff" in merged:
        merged["max_diff"] = {k: max(r.get("max_diff", {}).get(k, float("inf")) for r in per_rank) for k in merged["max_diff"]}
    for op in ("f", "g"):
        if op in merged:
            merged[op] = {**merged[op], **{k: max(r[op][k] for r in per_rank if op in r)
                                          for k in ("y_diff", "grad_diff", "input_changed")}}
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


def probe_without_processes(impl, exercise: str) -> list[dict]:
    """The exercise's probe at world size 1 in this process: a quick look before a real run, never a
    replacement for it (on one rank every sum is the input itself, so the counts are what it can show)."""
    with one_process() as env:
        group = dist.group.WORLD
        if exercise == "f_g":
            return [probe_f_g(impl, 1, group, 0)]
        return [probe_layer(impl, exercise, 1, group, env, bias=b, steps=2) for b in (True, False)]


# --- the graded checks ---------------------------------------------------------------------------------------------

def check_f_g(r: dict) -> None:
    where = f"f and g on {r['tp']} rank(s)"
    checks.check_true(r["error"] is None, f"{where}: raised {r['error']}", hint="the traceback names the line")
    for name, fwd, bwd, what in (("f", 0, 1, "identity forward, all-reduce of the gradient backward"),
                                 ("g", 1, 0, "all-reduce forward, identity backward")):
        rec = r[name]
        checks.check_equal(list(rec["functional"]), [], f"{where}: {name}'s functional collectives (DTensor's, or "
                           f"torch.distributed._functional_collectives)",
                           hint="write f and g as autograd functions whose forward or backward calls torch.distributed's "
                                "all_reduce; DTensor's own f and g are what exercises 2 and 3 run, not this answer")
        checks.check_equal((rec["forward"].get("all_reduce", 0), rec["backward"].get("all_reduce", 0)), (fwd, bwd),
                           f"{where}: {name}'s all-reduces (forward, backward); {name} is the {what}",
                           hint="f and g are conjugate: each communicates in one direction only")
        checks.check_equal(sum(rec["forward"].values()) + sum(rec["backward"].values()), fwd + bwd,
                           f"{where}: {name}'s collectives in all", hint="only all-reduces, one in all")
        checks.check_true(not rec["input_changed"], f"{where}: {name} changed its input tensor in place",
                          hint="all-reduce a copy; the input belongs to the caller (autograd saves it)")
        checks.check_close(rec["y_diff"], 0.0, f"{where}: max |{name}(x_r) - expected| (f: x_r, g: sum over ranks of x_r)",
                           atol=1e-5, hint="reduce over the group passed in (group=group), with the sum")
        checks.check_close(rec["grad_diff"], 0.0, f"{where}: max |x_r.grad - expected| (f: sum of the ranks' upstream "
                           f"gradients, g: this rank's own)", atol=1e-5,
                           hint="backward returns one gradient per input of forward: (grad, None) for (x, group)")


def check_layer(r: dict) -> None:
    kind = CLASSES[r["kind"]]
    where = f"{kind} on {r['tp']} rank(s), bias={r['bias']}"
    checks.check_true(r["error"] is None, f"{where}: raised {r['error']}", hint="the traceback names the line")
    checks.check_equal(list(r["missing"]), [], f"{where}: parameters missing (names and layout are in the notebook's contract)",
                       hint=f"expected parameters {sorted(LAYOUTS[r['kind']])} (biases only when the full layer has them)")
    checks.check_equal(list(r["extra"]), [], f"{where}: parameters other than the contract's",
                       hint="keep only this rank's shards; do not register the full layer as a submodule")
    for name, (got, want) in dict(r.get("wrong_shapes", {})).items():
        checks.check_equal(list(got), list(want), f"{where}: shape of this rank's {name}",
                           hint="a column-parallel weight keeps out/N rows (output features) and all input columns; a "
                                "row-parallel weight all rows and in/N columns (nn.Linear's weight is (out, in))")
    for problem in r.get("head_split", []):
        checks.check_true(False, f"{where}: {problem}", hint="rank r keeps n_head / N whole heads: for each, its "
                          "head_size rows of q, of k and of v in c_attn and its head_size columns of c_proj.weight")
    checks.check_equal(r["param_bytes"], r["expected_param_bytes"],
                       f"{where}: parameter bytes on this rank (the full layer has {r['full_param_bytes']})",
                       hint="the split weights and biases hold 1/N of the full ones; only the row-parallel bias is whole")
    one = [["all_reduce", r["bytes_per_activation"]]]
    for step, calls in enumerate(zip(r["forward"], r["backward"])):
        # On one rank DTensor's f and g (the course's, while this is graded) send nothing: a sum over one rank is
        # the tensor itself. An f and g of the student's own all-reduce there all the same: both are right.
        fwd, bwd = ([list(c) for c in phase] or (one if r["tp"] == 1 else []) for phase in calls)
        checks.check_equal(fwd, one, f"{where}, step {step}: collectives in the forward (name, bytes)",
                           hint="one all-reduce of the (B, T, n_embd) output, by g, in the row-parallel layer")
        checks.check_equal(bwd, one, f"{where}, step {step}: collectives in the backward (name, bytes)",
                           hint="one all-reduce of the input's gradient, by f, in front of the column-parallel layer")
    d, scale = r["max_diff"], 1e-5
    checks.check_close(d["loss"], 0.0, f"{where}: max |loss - loss_single-process| over {r['steps']} steps",
                       atol=scale * max(1.0, r["loss"]) * 4,
                       hint="a row-parallel bias is added once, after the all-reduce; check which dimension each weight is split along")
    checks.check_close(d["input_grad"], 0.0, f"{where}: max |x.grad - x.grad_single-process|", atol=scale,
                       hint="f in front of the column-parallel layer all-reduces the input's gradient")
    checks.check_close(d["grad"], 0.0, f"{where}: max |gathered grad - grad_single-process| (worst: {r['worst_grad']})",
                       atol=scale, hint="the shards must be the contract's rows/columns of the full weight, and the forward must "
                                       "use them in the order it keeps them")
    checks.check_close(d["weights"], 0.0, f"{where}: max |gathered weight - weight_single-process| after SGD steps",
                       atol=scale)


def check_indivisible(r: dict) -> None:
    where = f"TensorParallelAttention with n_head={r['n_head']} on {r['tp']} ranks"
    checks.check_equal(r["raised"], "ValueError", f"{where}: the error raised", hint="raise ValueError up front, in __init__")
    checks.check_true(str(r["n_head"]) in r["message"] and str(r["tp"]) in r["message"],
                      f"{where}: the message must give the head count and the tensor-parallel size; got {r['message']!r}")


def gather_record(record: dict, env, group) -> dict:
    """Every rank of group's records merged on the group's first rank (see merge_ranks)."""
    return merge_ranks(gather_objects(record, env, group))
