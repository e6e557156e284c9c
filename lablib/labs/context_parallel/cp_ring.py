"""Lab 12's graded ring attention (exercises 1 and 2): what each rank runs and records, the single-process reference,
the rounding bound it is compared with, and the checks. The same ``probe_ring`` runs on thread ranks (a rehearsal,
``lablib.probes.ring_rehearsal.ThreadWorld``) and on torchrun ranks (``lablib.labs.context_parallel.run``).

Reference: attention on the whole sequence in one process, in float64, by autograd (``unfused_attention``); each
rank compares its block, picked by its global positions. The bound (``error_bounds``) is derived in the notebook's
section 3: float rounding of the dot products (gamma_D), of the exponentials and their arguments (ranks + 1
applications on a ring of N ranks, each at most 2 ulps plus the rounding of |s - m|), of the sums over T keys and N
merges (gamma_{T+2N}); twice that, because the float64 reference rounds too.

Splits checked (``SPLITS``): ``contiguous`` (the naive split, lablib.labs.context_parallel.cp_model) and ``shuffled`` (a random
permutation dealt out in uneven blocks: every block mixes early and late positions, so a mask built from local
indices, or from the wrong block's positions, fails; the zigzag split is one such list).
"""

from __future__ import annotations

import math

import torch

from lablib import checks
from lablib.labs.context_parallel.cp_model import contiguous_positions, unfused_attention
from lablib.measure.p2p import direct_calls
from lablib.measure.rankcheck import gamma
from lablib.labs.context_parallel.cp_events import OverlapComm

# The visible cases, by name (batch, heads, sequence length, head size, split, causal, dtype, logit scale: the
# scores reach about this size). The graded ones beyond these are drawn by the instructor's hidden tests when they
# run and handed to the same functions as dicts (``resolve_case``); none of them is listed here.
CASES = {
    "causal": dict(B=1, H=2, T=24, D=8, split="contiguous", causal=True, dtype="float32", logits=3.0),
    "shuffled": dict(B=1, H=2, T=26, D=8, split="shuffled", causal=True, dtype="float32", logits=3.0),
    "large_logits": dict(B=1, H=2, T=24, D=8, split="shuffled", causal=True, dtype="float32", logits=100.0),
}
CASE_KEYS = {"B", "H", "T", "D", "split", "causal", "dtype", "logits"}
DTYPES = {"float32": torch.float32, "float64": torch.float64}
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "float64": 2.0 ** -53}
# the gap between subnormals (torch.finfo(dtype).tiny * eps): below the normal range rounding is absolute, so a
# probability exp(s - lse) near e^-100 is off by up to this much, not by a relative u
UNDERFLOW = {"float32": 2.0 ** -149, "float64": 2.0 ** -1074}
EXERCISES = {"ring_forward": ("cp_ring_impl.py", "ring_attention_forward"),
             "ring_backward": ("cp_ring_backward_impl.py", "ring_attention_backward")}


def resolve_case(case) -> dict:
    """A case by name (``CASES``) or as a dict with a ``name`` and the keys of ``CASE_KEYS`` (``layout``: "BTHD"
    for non-contiguous inputs, optional): the dict, named, checked."""
    if isinstance(case, str):
        if case not in CASES:
            raise ValueError(f"unknown ring case {case!r}; named cases: {sorted(CASES)} (others are passed as dicts)")
        return dict(CASES[case], name=case)
    missing = sorted((CASE_KEYS | {"name"}) - set(case))
    if missing:
        raise ValueError(f"ring case {case!r} lacks {missing}")
    if case["dtype"] not in DTYPES or case["split"] not in ("contiguous", "shuffled"):
        raise ValueError(f"ring case {case['name']!r}: dtype must be one of {sorted(DTYPES)} and split 'contiguous' "
                         f"or 'shuffled'")
    return dict(case)


def split_positions(case: dict, world_size: int, seed: int) -> list[torch.Tensor]:
    if case["split"] == "contiguous":
        return contiguous_positions(case["T"], world_size)
    order = torch.randperm(case["T"], generator=torch.Generator().manual_seed(seed + 17))
    sizes = [case["T"] // world_size + (1 if r == world_size - 1 else 0) - (1 if r == 0 and world_size > 1 else 0)
             for r in range(world_size)]
    sizes[-1] += case["T"] - sum(sizes)                        # uneven on purpose: first short, last long
    return list(torch.split(order, sizes))


def full_inputs(case: dict, seed: int) -> dict[str, torch.Tensor]:
    """q, k, v and the output's gradient on the whole sequence, (B, H, T, D), exact in the case's dtype. q and k are
    scaled so that the scores q k^T / sqrt(D) reach about +-logits."""
    g = torch.Generator().manual_seed(seed)
    shape = (case["B"], case["H"], case["T"], case["D"])
    dtype = DTYPES[case["dtype"]]
    size = math.sqrt(case["logits"])
    return {"q": (torch.rand(shape, generator=g) * 2 - 1).mul(size).to(dtype),
            "k": (torch.rand(shape, generator=g) * 2 - 1).mul(size).to(dtype),
            "v": torch.randn(shape, generator=g).to(dtype), "grad": torch.randn(shape, generator=g).to(dtype)}


def reference(full: dict, causal: bool) -> dict[str, torch.Tensor]:
    """One process, whole sequence, float64, autograd: out, lse and the gradients of q, k, v."""
    q, k, v = (full[n].double().requires_grad_() for n in "qkv")
    out = unfused_attention(q, k, v, causal)
    out.backward(full["grad"].double())
    scores = torch.matmul(q, k.transpose(-2, -1)).detach() / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return {"out": out.detach(), "lse": torch.logsumexp(scores, -1), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def error_bounds(full: dict, ref: dict, causal: bool, u: float, world_size: int, eta: float = 0.0) -> dict[str, torch.Tensor]:
    """Elementwise bounds on |computed - exact| for each output (section 3 of the notebook derives each term).
    ``eta`` (``UNDERFLOW``): the absolute rounding of a result in the subnormal range. Each probability, each
    product P dO or dS q and each dS may underflow there, so every sum over T keys or queries gains at most
    (T + 2N) eta times the largest factor it multiplies: without that term a correct fp32 backward at scores near 100
    (probabilities near e^-100 = 4e-44, subnormal) measured up to 6e3 x the bound."""
    q, k, v, g = (full[n].double() for n in ("q", "k", "v", "grad"))
    B, H, T, D = q.shape
    scale = 1 / math.sqrt(D)
    visible = torch.ones(T, T, dtype=torch.bool).tril() if causal else torch.ones(T, T, dtype=torch.bool)
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    a = torch.matmul(q.abs(), k.abs().transpose(-2, -1)) * scale               # sum |q_d k_d| / sqrt(D)
    amax = a.masked_fill(~visible, 0).amax(-1, keepdim=True)
    smax = s.abs().masked_fill(~visible, 0).amax(-1, keepdim=True)
    n_sum = T + 2 * world_size
    eps = (world_size + 1) * (2 * gamma(D, u) * amax + u * (2 * smax + math.log(T) + 2)) + gamma(n_sum, u)
    p = torch.softmax(s.masked_fill(~visible, -math.inf), -1)
    out, lse = ref["out"], ref["lse"][..., None]
    bounds = {"out": 2 * eps * v.abs().amax(-2, keepdim=True) + u * out.abs(),
              "lse": (eps + u * lse.abs()).squeeze(-1)}
    d_p = torch.matmul(g, v.transpose(-2, -1))
    delta = (g * out).sum(-1, keepdim=True)
    d_s = p * (d_p - delta)
    err_ds = (eps * p * (d_p - delta).abs() + p * (gamma(D, u) * torch.matmul(g.abs(), v.abs().transpose(-2, -1))
              + gamma(D + 1, u) * (g.abs() * out.abs()).sum(-1, keepdim=True)) + 2 * u * d_s.abs())
    gs = gamma(n_sum + 1, u)
    bounds["dq"] = scale * (torch.matmul(err_ds, k.abs()) + gs * torch.matmul(d_s.abs(), k.abs())) + u * ref["dq"].abs()
    bounds["dk"] = scale * (torch.matmul(err_ds.transpose(-2, -1), q.abs())
                            + gs * torch.matmul(d_s.abs().transpose(-2, -1), q.abs())) + u * ref["dk"].abs()
    bounds["dv"] = (torch.matmul((eps * p).transpose(-2, -1), g.abs()) + gs * torch.matmul(p.transpose(-2, -1), g.abs())
                    + u * ref["dv"].abs())
    if eta:
        under = n_sum * eta
        dsmax = (d_p - delta).abs().amax() + 1
        bounds["out"] = bounds["out"] + under * (v.abs().amax() + 1)
        bounds["dv"] = bounds["dv"] + under * (g.abs().amax() + 1)
        bounds["dq"] = bounds["dq"] + under * scale * dsmax * (k.abs().amax() + 1)
        bounds["dk"] = bounds["dk"] + under * scale * dsmax * (q.abs().amax() + 1)
    return {name: 2 * b for name, b in bounds.items()}                         # x2: the reference rounds too


def _local(t: torch.Tensor, pos: torch.Tensor, layout: str) -> torch.Tensor:
    block = t[:, :, pos]
    if layout == "BTHD":          # the caller's (B, T, H, D) activations, transposed: a non-contiguous view
        return block.transpose(1, 2).contiguous().transpose(1, 2)
    return block.contiguous()


def _kv_received(receives: list[dict], full: dict, positions: list[torch.Tensor], layout: str, dtype) -> list[bool]:
    """For each receive, whether what arrived is a K or V block, or both stacked (compared as sorted values, so any
    layout of the block counts): those are the receives the ring must overlap with compute."""
    blocks = []
    for pos in positions:
        k, v = (_local(full[name], pos, layout).to(dtype) for name in "kv")
        blocks += [k.flatten().sort().values, v.flatten().sort().values,
                   torch.cat([k.flatten(), v.flatten()]).sort().values]
    out = []
    for r in receives:
        data = r.get("data")
        flat = None if data is None else data.flatten().sort().values
        out.append(flat is not None and any(b.shape == flat.shape and b.dtype == flat.dtype and torch.equal(b, flat)
                                            for b in blocks))
    return out


def score_bound(case: dict, positions: list[torch.Tensor], rank: int) -> int:
    """The most elements a score-shaped tensor of a ring may have: B H max(T_r, D) max(max_j T_j, D) (one block of
    scores, (T_r, T_j), or its transpose; q, k, v and the outputs, (T, D), fit too). Keeping every block's scores for
    one softmax at the end needs B H T_r T."""
    longest = max(len(p) for p in positions)
    return case["B"] * case["H"] * max(len(positions[rank]), case["D"]) * max(longest, case["D"])


def probe_ring(module, exercise: str, inner_comm, case, seed: int = 0) -> dict:
    """What one rank's call of the student's function did, compared with the reference (also on this rank).
    ``case``: a name of ``CASES`` or a case dict (``resolve_case``)."""
    case = resolve_case(case)
    case_name = case["name"]
    n, rank = inner_comm.world_size, inner_comm.rank
    positions = split_positions(case, n, seed)
    full = full_inputs(case, seed)
    ref = reference(full, case["causal"])
    mine = positions[rank]
    layout = case.get("layout", "BHTD")
    args = {name: _local(full[name], mine, layout) for name in ("q", "k", "v", "grad")}
    dtype = DTYPES[case["dtype"]]
    given_out = _local(ref["out"], mine, layout).to(dtype)
    given_lse = ref["lse"][:, :, mine].to(dtype).contiguous()
    kept = {name: t.clone() for name, t in args.items()}
    comm = OverlapComm(inner_comm)
    fn = getattr(module, EXERCISES[exercise][1])
    with direct_calls() as called, comm.watching():
        if exercise == "ring_forward":
            got = dict(zip(("out", "lse"), fn(args["q"], args["k"], args["v"], comm, positions, case["causal"])))
        else:
            got = dict(zip(("dq", "dk", "dv"), fn(args["grad"], args["q"], args["k"], args["v"], given_out, given_lse,
                                                   comm, positions, case["causal"])))
    bounds = error_bounds(full, ref, case["causal"], UNIT_ROUNDOFF[case["dtype"]], n, UNDERFLOW[case["dtype"]])
    kv = _kv_received(comm.receives, full, positions, layout, dtype)
    record = {"case": case_name, "dtype": case["dtype"], "rank": rank, "world_size": n, "outputs": {},
              "counts": comm.counts(), "receives": len(comm.receives), "overlapped_receives": comm.overlapped_receives(),
              "kv_receives": sum(kv), "kv_overlapped": sum(1 for is_kv, r in zip(kv, comm.receives)
                                                          if is_kv and (r["products_between"] or 0) > 0),
              "largest_score": comm.largest_score, "largest_score_op": comm.largest_score_function,
              "score_bound": score_bound(case, positions, rank),
              "direct_calls": sorted({c.function for c in called.calls}),
              "inputs_unchanged": all(torch.equal(args[k_], kept[k_]) for k_ in args),
              "block_lengths": [len(p) for p in positions], "element_size": dtype.itemsize,
              "per_position": case["B"] * case["H"] * case["D"] * dtype.itemsize}
    for name, value in got.items():
        expected = ref[name][:, :, mine]
        entry = {"shape": list(value.shape) if isinstance(value, torch.Tensor) else repr(type(value)),
                 "expected_shape": list(expected.shape), "dtype": str(getattr(value, "dtype", None)),
                 "finite": bool(isinstance(value, torch.Tensor) and torch.isfinite(value).all())}
        if isinstance(value, torch.Tensor) and list(value.shape) == list(expected.shape) and entry["finite"]:
            diff = (value.detach().double() - expected).abs()
            entry["max_abs_err"] = diff.max().item()
            entry["bound_ratio"] = (diff / (bounds[name][:, :, mine] + 1e-300)).max().item()
        if name in ("dk", "dv") and entry.get("bound_ratio", 0) > 1:     # another block's gradients returned?
            entry["matches_rank"] = next(
                (j for j, pos in enumerate(positions) if j != rank and len(pos) == len(mine) and
                 ((value.detach().double() - ref[name][:, :, pos]).abs() <= bounds[name][:, :, pos]).all()), None)
        record["outputs"][name] = entry
    return record


def expected_bytes(record: dict, exercise: str) -> int:
    """Bytes rank r sends: the K/V blocks of ranks r, r-1, ..., r-N+2 (N - 1 hops) and, in the backward, the dK/dV
    of every block (N hops: the last brings them home)."""
    n, rank, lengths = record["world_size"], record["rank"], record["block_lengths"]
    kv = sum(lengths[(rank - s) % n] for s in range(n - 1))
    grads = sum(lengths) if exercise == "ring_backward" and n > 1 else 0
    return 2 * (kv + grads) * record["per_position"]


_BOUND_HINTS = {
    "ring_forward": "check the causal mask (global positions), the online-softmax merge and which rank's block you "
                    "hold at each step",
    "ring_backward": "P = exp(s - lse) with the mask by global positions (the forward's probabilities); delta = "
                     "rowsum(dO * O) with the forward's O (rowsum(dO) alone, or a block's own rowsum(P * dP), is "
                     "not it); dK/dV of a block accumulate as it travels and make N hops, the last one home to its "
                     "owner",
}


def check_ring(records: list[dict], exercise: str) -> None:
    """Every rank of one case: values within the bound, shapes, dtypes, the ring's direction, bytes, overlap of
    every K/V receive, and the memory of one block of scores at a time."""
    for r in records:
        dtype = str(DTYPES[r["dtype"]])
        where = f"{exercise}, case {r['case']!r}, rank {r['rank']} of {r['world_size']}"
        for name, e in r["outputs"].items():
            checks.check_equal(e["shape"], e["expected_shape"], f"{where}: shape of {name}")
            checks.check_true(e["finite"], f"{where}: {name} has NaN or inf",
                              hint="a block whose every key is masked has max -inf: exp(-inf - (-inf)) is NaN; and "
                                   "exp of large scores overflows unless the running max is subtracted first")
            if e.get("matches_rank") is not None:
                checks.check_true(False, f"{where}: the {name} returned is rank {e['matches_rank']}'s block's "
                                  f"gradient, not this rank's", hint="the dK/dV accumulators make N hops: after the "
                                  "last step one more hop to (rank + 1) % N brings each block's gradients home")
            checks.check_true(e["bound_ratio"] <= 1.0, f"{where}: {name} differs from one process's attention on "
                              f"the whole sequence by {e['max_abs_err']:.3g}, {e['bound_ratio']:.3g} x the rounding "
                              f"bound", hint=_BOUND_HINTS[exercise])
            if name != "lse":
                checks.check_equal(e["dtype"], dtype, f"{where}: dtype of {name}")
        checks.check_true(r["inputs_unchanged"], f"{where}: q, k, v (or grad_out) were changed in place",
                          hint="the caller keeps using its tensors: work on new ones")
        checks.check_equal(r["direct_calls"], [], f"{where}: torch.distributed called directly",
                           hint="send and receive only through comm")
        checks.check_true(r["largest_score"] <= r["score_bound"], f"{where}: a tensor of {r['largest_score']} "
                          f"elements went through {r['largest_score_op']}; one block of scores at a time is at most "
                          f"B H max(T_r, D) max(T_j, D) = {r['score_bound']}: the ring's memory promise is one "
                          f"(T_r, T_j) block, not (T_r, T)",
                          hint="merge each block into the running (out, lse) with the online softmax when it "
                               "arrives; keeping every block's scores for one softmax at the end is the T/N x T "
                               "memory ring attention exists to avoid")
        c, n = r["counts"], r["world_size"]
        right, left = (r["rank"] + 1) % n, (r["rank"] - 1) % n
        if n > 1:
            checks.check_equal(sorted(int(p) for p in c["sent_to"]), [right], f"{where}: ranks sent to",
                               hint="K/V (and dK/dV) move to the right neighbour (rank + 1) % N only")
            checks.check_equal(sorted(int(p) for p in c["received_from"]), [left], f"{where}: ranks received from")
        checks.check_equal(c["bytes_sent"], expected_bytes(r, exercise), f"{where}: bytes sent",
                           hint="each K/V block once per hop, N - 1 hops; in the backward also dK/dV, N hops")
        if n > 1:
            checks.check_true(r["kv_receives"] >= n - 1 and r["kv_overlapped"] == r["kv_receives"],
                              f"{where}: {r['kv_overlapped']} of the {r['kv_receives']} receive(s) of a K/V block "
                              f"were in flight while a block was computed; every one (N - 1 = {n - 1} steps receive "
                              f"a block, K and V together or apart) must be",
                              hint="post comm.isend / comm.irecv for the next block, compute this block, then wait")


def rehearse_ring(path: str, exercise: str, world_size: int, cases, timeout_s: float = 20.0) -> list[list[dict]]:
    """The cases (names of ``CASES`` or case dicts) on world_size thread ranks (lablib.probes.ring_rehearsal.ThreadWorld: a blocking send facing a
    blocking send is reported as a deadlock at once); [case][rank] records. One rank needs no threads."""
    from lablib.jobs.exercise import load_module
    from lablib.measure.p2p import CountingComm
    from lablib.probes.ring_rehearsal import run_in_threads

    module = load_module(path, (EXERCISES[exercise][1],))
    cases = [resolve_case(case) for case in cases]
    if world_size == 1:
        return [[probe_ring(module, exercise, CountingComm(0, 1), case)] for case in cases]
    return [run_in_threads(world_size, lambda comm, case=case: probe_ring(module, exercise, comm, case), timeout_s)
            for case in cases]
