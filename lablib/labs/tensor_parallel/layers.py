"""Lab 08's exercises 2 and 3 probed and graded: the students' tensor-parallel layers against the single-process one.

Four kinds, each built from a full module and the group, each graded alone (``KINDS``: exercise 2 grades
``ColumnParallelLinear`` and ``RowParallelLinear`` on their own as well as the MLP made of them, so an f or a g
moved from a linear layer into the MLP loses points):

- ``column``: ``ColumnParallelLinear(nn.Linear(5, 3 N), group)``: whole x in, this rank's 3 output features out;
  f in front: no collective forward, one all-reduce of x's gradient backward;
- ``row``: ``RowParallelLinear(nn.Linear(3 N, 5), group)``: this rank's 3 input features in, the whole output on
  every rank (g: one all-reduce forward, none backward), the bias added once;
- ``mlp`` and ``attention``: the course GPT's ``MLPBlock`` and ``CausalSelfAttention`` (``lablib.course.models``),
  one all-reduce each way.

The reference is the single-process module itself: rank r feeds its input (x, or its block of x's features for
``row``) and its upstream gradient (w, or its block of w's features for ``column``), so the sum over ranks of
what the layers compute is the full layer's; its output, the input's gradient and every parameter's gradient,
gathered from the ranks' shards (``lablib.parallel.tensor_parallel.assembled``), and the weights after each of a
few SGD steps must equal the single process's. Collectives are counted with ``lablib.measure.counting``.

Cases (``CASES``): with and without biases; and hidden: an input that does not require grad (then nothing needs
f's backward all-reduce), a non-contiguous input, other shapes (4-D, or another batch and sequence length for
the attention), and bf16 (module and input). Tolerances: fp32 results within gamma_K u32 of the reference's
largest magnitude, K the roundings along the longest chain (the reductions' lengths, the N partial sums, the
elementwise steps); in bf16 the single linear layers are held to gamma_K u_bf16 of the abs-products
(|x||W|^T + |b| and its like), and the MLP and attention only to their dtypes, shapes and collectives: bf16's
rounding through GELU and softmax leaves no bound tight enough to tell a mistake, and the fp32 cases grade values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from lablib import checks
from lablib.course.models import CausalSelfAttention, GPTConfig, MLPBlock
from lablib.measure import counting
from lablib.measure.rankcheck import gamma
from lablib.jobs.distenv import gather_objects
from lablib.parallel.tensor_parallel import assembled, contiguous_index, index_by_value
from lablib.probes.harness import LR, sgd_step_, zero_grad_
from lablib.labs.tensor_parallel.heads import head_split_problems

CLASSES = {"column": "ColumnParallelLinear", "row": "RowParallelLinear", "mlp": "TensorParallelMLP",
           "attention": "TensorParallelAttention"}
KINDS = {"mlp": ("column", "row", "mlp"), "attention": ("attention",)}    # exercise -> the classes it grades
# parameter name -> how it is split: "col" a block of the weight's rows (output features), "row" a block of its
# columns (input features); "qkv" the q, k and v rows of this rank's heads and "heads" the columns of the same
# heads, both found by value, in any order; "replicated" the whole tensor on every rank.
LAYOUTS = {
    "column": {"weight": "col", "bias": "col"},
    "row": {"weight": "row", "bias": "replicated"},
    "mlp": {"c_fc.weight": "col", "c_fc.bias": "col", "c_proj.weight": "row", "c_proj.bias": "replicated"},
    "attention": {"c_attn.weight": "qkv", "c_attn.bias": "qkv", "c_proj.weight": "heads", "c_proj.bias": "replicated"},
}
SPLIT_DIM = {"col": 0, "qkv": 0, "row": 1, "heads": 1}     # the dimension each layout splits
# case -> (bias, dtype, input requires grad, input non-contiguous, other shape)
CASES = {"bias": (True, torch.float32, True, False, False), "nobias": (False, torch.float32, True, False, False),
         "nograd": (True, torch.float32, False, False, False), "noncontig": (True, torch.float32, True, True, False),
         "shape": (True, torch.float32, True, False, True), "bf16": (True, torch.bfloat16, True, False, False)}
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}


def case_config(tp: int, bias: bool, n_head: int | None = None) -> GPTConfig:
    """Two heads per rank of 4 channels each (every size divides), or the n_head asked for."""
    n_head = n_head or 2 * tp
    return GPTConfig(vocab_size=17, block_size=8, n_layer=1, n_head=n_head, n_embd=4 * n_head, bias=bias)


def full_module(kind: str, config: GPTConfig, seed: int, dtype=torch.float32) -> nn.Module:
    """The single-process reference, with weights large enough (and biases nonzero) that a mistake shows.
    ``column`` and ``row``: non-square nn.Linear (5 -> 3 N, 3 N -> 5; N = n_head / 2), so a split along the wrong
    dimension has the wrong shape."""
    gen = torch.Generator().manual_seed(seed)  # its own generator: thread ranks build theirs at the same time
    width = 3 * (config.n_head // 2)
    module = {"column": lambda: nn.Linear(5, width, bias=config.bias), "row": lambda: nn.Linear(width, 5, bias=config.bias),
              "mlp": lambda: MLPBlock(config), "attention": lambda: CausalSelfAttention(config)}[kind]()
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if name.endswith("weight") else 0.2))
    return module.to(dtype)


def shard_shape(shape: tuple, how: str, tp: int) -> tuple:
    """The shape of one rank's shard of a tensor of ``shape`` split by layout ``how`` over tp ranks."""
    if how == "replicated":
        return shape
    dim = SPLIT_DIM[how]
    return tuple(n // tp if d == dim else n for d, n in enumerate(shape))


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


def _diff(a, b: torch.Tensor) -> float:
    if a is None or tuple(a.shape) != tuple(b.shape):
        return float("inf")
    return (a.detach().double() - b.detach().double()).abs().max().item()


def _io(kind: str, case: str, reference: nn.Module, step: int, seed: int, rank: int, tp: int):
    """(x, w): the step's full input and upstream gradient (the same on every rank), and the student's
    (x_s, w_s): this rank's share (row: its block of x's features; column: its block of w's)."""
    _, dtype, needs_grad, noncontig, other = CASES[case]
    lead = ((3, 5) if kind == "attention" else (2, 3, 4)) if other else (2, 8)
    n_in = reference.in_features if kind in ("column", "row") else reference.c_proj.out_features
    n_out = reference.out_features if kind in ("column", "row") else n_in
    g = torch.Generator().manual_seed(seed * 100 + step)
    x = torch.randn(n_in, *lead[::-1], generator=g).permute(*reversed(range(len(lead) + 1))) if noncontig \
        else torch.randn(*lead, n_in, generator=g)
    # w as a mean loss's gradient would be, O(1 / tokens): the SGD steps stay small, the layers tame step after step
    x, w = x.to(dtype), (torch.randn(*lead, n_out, generator=g) / x[..., 0].numel()).to(dtype)
    x_s, w_s = x, w
    if kind == "row":                          # this rank's input features (a strided view unless made contiguous)
        x_s = x[..., rank * n_in // tp:(rank + 1) * n_in // tp]
    if kind == "column":
        w_s = w[..., contiguous_index(n_out, rank, tp)].contiguous()
    x_s = x_s.detach() if noncontig else x_s.detach().clone().contiguous()
    return x.detach().clone().requires_grad_(needs_grad), w, x_s.requires_grad_(needs_grad), w_s


def _bounds(kind: str, reference: nn.Module, x: torch.Tensor, w: torch.Tensor, dtype, tp: int) -> dict:
    """How far the student's output, input gradient and weight gradients may be from the reference's (see the
    module docstring); none where bf16 leaves no useful bound (the MLP and attention's values: {})."""
    u = UNIT_ROUNDOFF[dtype]
    if kind in ("column", "row"):
        W = reference.weight.detach().double().abs()
        b = reference.bias.detach().double().abs() if reference.bias is not None else 0
        xa, wa = x.detach().double().abs(), w.detach().double().abs()
        # Each side within gamma_k u of the exact value, k the roundings of its longest chain (the dot product, the
        # N partial sums, the bias), times the sum of |terms|: the two sides within twice that of each other.
        k = reference.in_features + tp + 2
        wt, xt = wa.flatten(0, -2), xa.flatten(0, -2)           # (tokens, out), (tokens, in)
        grad_terms = max((wt.T @ xt).max().item(), wt.sum(0).max().item())   # the weight's and the bias's
        return {"output": 2 * gamma(k, u) * (xa @ W.T + b).max().item(),
                "input_grad": 2 * gamma(k, u) * (wa @ W).max().item(),
                "grad": 2 * gamma(xt.shape[0] + tp + 2, u) * grad_terms}
    if dtype != torch.float32:
        return {}
    n_embd = reference.c_proj.out_features
    k = 4 * n_embd + n_embd + x[..., 0].numel() + tp + 8    # c_fc and c_proj's sums (or q.k, softmax, c_proj), tokens
    return {q: 2 * gamma(k, u) for q in ("output", "input_grad", "grad")}   # times each result's largest magnitude


def probe_layer(impl, kind: str, tp: int, group, env, case: str = "bias", steps: int = 2, seed: int = 0) -> dict:
    """Build the student's module from the full one on group's ranks, feed both the same inputs and upstream
    gradients for a few SGD steps, and record the largest differences, the collectives and the bytes."""
    bias, dtype, needs_grad, _, _ = CASES[case]
    steps = 1 if dtype != torch.float32 else steps            # bf16: one step (the bound is for one)
    config = case_config(tp, bias)
    reference = full_module(kind, config, seed, dtype)
    out = {"kind": kind, "tp": tp, "case": case, "bias": bias, "steps": steps, "error": None, "forward": [],
           "backward": [], "dtype": str(dtype)}
    log = counting.CollectiveLog()
    rank = dist.get_rank(group) if tp > 1 else 0
    try:
        try:
            source = full_module(kind, config, seed, dtype)     # what the student's class copies from
            student = getattr(impl, CLASSES[kind])(source, group)
            built = None
        except Exception as exc:  # noqa: BLE001
            built = f"{type(exc).__name__}: {exc}"
        # Every rank learns whether any rank failed before the first collective of the forward: an error on one
        # rank only would leave the others waiting in an all-reduce until the timeout.
        failed = [e for e in gather_objects(built, env, group) if e] if tp > 1 else [built] * (built is not None)
        if failed:
            raise RuntimeError(f"building {CLASSES[kind]} failed on a rank: {failed[0]}")
        names, full = dict(student.named_parameters()), dict(reference.named_parameters())
        layout = {n: h for n, h in LAYOUTS[kind].items() if n in full}
        out["missing"], out["extra"] = sorted(set(layout) - set(names)), sorted(set(names) - set(layout))
        # bytes of the storages behind the parameters (a view of the full weight holds all of it), each once
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in student.parameters()}
        out["param_bytes"] = sum(storages.values())
        theirs = {p.untyped_storage().data_ptr() for p in source.parameters()}
        out["shared_with_source"] = sorted(n for n, p in names.items() if p.untyped_storage().data_ptr() in theirs)
        out["expected_param_bytes"] = sum(full[n].numel() * full[n].element_size() // (1 if h == "replicated" else tp)
                                          for n, h in layout.items())
        out["full_param_bytes"] = sum(p.numel() * p.element_size() for p in reference.parameters())
        out["param_dtypes"] = sorted({str(p.dtype) for p in student.parameters()})
        shapes = {n: tuple(names[n].shape) for n in layout if n in names}
        expected = {n: shard_shape(tuple(full[n].shape), h, tp) for n, h in layout.items()}
        out["wrong_shapes"] = {n: [list(shapes[n]), list(expected[n])] for n in shapes if shapes[n] != expected[n]}
        if out["missing"] or out["wrong_shapes"]:      # the same verdict on every rank: no forward is run
            return out
        index = _shard_indices(student, reference, layout, rank, tp)
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

        diffs = {q: 0.0 for q in ("output", "input_grad", "grad", "weights")}
        bounds = {q: 0.0 for q in diffs}
        compared = True                        # False: bf16's MLP and attention, whose values are not graded
        worst = ""
        for step in range(steps):
            x, w, x_s, w_s = _io(kind, case, reference, step, seed, rank, tp)
            zero_grad_(student.parameters())
            zero_grad_(reference.parameters())
            bound = _bounds(kind, reference, x, w, dtype, tp)
            compared = bool(bound)
            bound = bound or {q: 0.0 for q in ("output", "input_grad", "grad")}
            spy = getattr(impl, "course_f_g", None)           # the course's f and g, when they stand in
            if spy is not None:
                spy.calls.clear()
            with counting.count_collectives(log):
                log.reset()
                y = student(x_s)
                out["forward"].append([[c.name, c.bytes] for c in log.calls])
                log.reset()
                y.backward(w_s)
                out["backward"].append([[c.name, c.bytes] for c in log.calls])
            out["f_g_calls"] = None if spy is None else dict(spy.calls)
            y_ref = reference(x)
            y_ref.backward(w)
            out["output_dtype"], out["output_shape"] = str(y.dtype), list(y.shape)
            want_y = y_ref[..., contiguous_index(y_ref.shape[-1], rank, tp)] if kind == "column" else y_ref
            scale = 1.0 if kind in ("column", "row") else max(1.0, want_y.detach().abs().max().item())
            diffs["output"], bounds["output"] = max(diffs["output"], _diff(y, want_y)), bound["output"] * scale
            if needs_grad:
                want_g = x.grad[..., contiguous_index(x.shape[-1], rank, tp)] if kind == "row" else x.grad
                scale = 1.0 if kind in ("column", "row") else max(1.0, want_g.abs().max().item())
                diffs["input_grad"] = max(diffs["input_grad"], _diff(x_s.grad, want_g))
                bounds["input_grad"] = bound["input_grad"] * scale
            for name in layout:
                p = names[name]
                scale = 1.0 if kind in ("column", "row") else max(1.0, full[name].grad.abs().max().item())
                d = _diff(whole(torch.zeros_like(p) if p.grad is None else p.grad, name), full[name].grad)
                bounds["grad"] = max(bounds["grad"], bound["grad"] * scale)
                if d > diffs["grad"]:
                    diffs["grad"], worst = d, name
            sgd_step_(student.parameters())
            sgd_step_(reference.parameters())
            # each step: lr times the gradients' difference, and the update's own rounding (u |W|, both sides)
            u = UNIT_ROUNDOFF[dtype]
            bounds["weights"] += LR * bounds["grad"] + 2 * u * max(p.detach().abs().max().item() for p in full.values())
            diffs["weights"] = max(diffs["weights"], *(_diff(whole(names[n].data, n), full[n].data) for n in layout))
        out.update(max_diff=diffs, bounds=bounds if compared else None, worst_grad=worst, needs_grad=needs_grad,
                   bytes_in=x_s.numel() * x_s.element_size(), bytes_out=y.numel() * y.element_size())
    except Exception as exc:  # noqa: BLE001 - a wrong answer is a result to report, not a crash of the run
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def expected_collectives(r: dict) -> tuple[list, list]:
    """(forward, backward): the (name, bytes) calls a correct layer issues (module docstring)."""
    g = [["all_reduce", r["bytes_out"]]]
    f = [["all_reduce", r["bytes_in"]]] if r["needs_grad"] else []
    return {"column": ([], f), "row": (g, []), "mlp": (g, f), "attention": (g, f)}[r["kind"]]


def check_layer(r: dict) -> None:
    kind = CLASSES[r["kind"]]
    where = f"{kind} on {r['tp']} rank(s), case {r['case']} ({r['dtype'].replace('torch.', '')}, bias={r['bias']})"
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
    checks.check_equal(list(r.get("shared_with_source", [])), [], f"{where}: parameters that share memory with the "
                       f"full layer passed in", hint="copy the shards: .detach()[...].clone() into a new nn.Parameter; a "
                       "view keeps the whole full tensor alive and the SGD steps write into the caller's layer")
    checks.check_equal(list(r["param_dtypes"]), [r["dtype"]], f"{where}: your parameters' dtypes",
                       hint="copy the full layer's tensors as they are (.detach()[...].clone()): they keep its dtype")
    checks.check_equal(r["param_bytes"], r["expected_param_bytes"],
                       f"{where}: parameter bytes on this rank (the full layer has {r['full_param_bytes']})",
                       hint="the split weights and biases hold 1/N of the full ones; only the row-parallel bias is whole")
    checks.check_equal(r["output_dtype"], r["dtype"], f"{where}: the output's dtype")
    if r.get("f_g_calls") is not None:
        want = {"column": {"f": 1}, "row": {"g": 1}}.get(r["kind"], {"f": 1, "g": 1})
        checks.check_equal(dict(r["f_g_calls"]), want, f"{where}: calls of f and g (from tp_comm_impl) in one forward",
                           hint="ColumnParallelLinear's forward applies f to its input, RowParallelLinear's applies g to "
                                "its partial output; the MLP and the attention use f and g through them (or directly, "
                                "attention), once each")
    want_fwd, want_bwd = expected_collectives(r)
    for step, calls in enumerate([] if r.get("rehearsal") else zip(r["forward"], r["backward"])):
        for phase, got, want in (("forward", calls[0], want_fwd), ("backward", calls[1], want_bwd)):
            got = [list(c) for c in got]
            # On one rank DTensor's f and g (the course's, while this is graded) send nothing: a sum over one rank
            # is the tensor itself. An f and g of the student's own all-reduce there all the same: both are right.
            if r["tp"] == 1 and not got:
                continue
            checks.check_equal(got, want, f"{where}, step {step}: collectives in the {phase} (name, bytes)",
                               hint="f (all-reduce of the input's gradient, backward) in front of a column-parallel "
                                    "layer; g (all-reduce of the output, forward) after a row-parallel one; each once")
    d, b = r["max_diff"], r["bounds"]
    if b is None:                              # bf16 MLP or attention: dtypes, shapes and collectives only
        checks.check_true(all(v == v and v != float("inf") for v in d.values()),
                          f"{where}: differences from the single process {dict(d)} are not finite")
        return
    for q, what, hint in (
            ("output", "output (column-parallel: this rank's block of output features)",
             "a row-parallel bias is added once, after the all-reduce; check which dimension each weight is split along"),
            ("input_grad", "input's gradient (row-parallel: this rank's block of features)",
             "f in front of the column-parallel layer all-reduces the input's gradient"),
            ("grad", f"gathered parameter gradient (worst: {r['worst_grad']})",
             "the shards must be the contract's rows/columns of the full weight, used in the order they are kept"),
            ("weights", f"gathered weight after {r['steps']} SGD step(s)", "the parameters must be the ones the forward uses")):
        checks.check_true(d[q] <= b[q], f"{where}: max |{what} - single process's| = {d[q]:.3g} > bound {b[q]:.3g}",
                          hint=hint)
