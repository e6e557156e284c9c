"""Wrong answers and correct variants for lab 11 (tests/labkit.py: the lab's answer files).

Exercise 1's hidden checks run first in the kernel (wrappers that record what the strategy gives them), so its wrong
answers fail before any torchrun start; each correct variant costs one start of the graded run (5 rows, 2 ranks).
Exercises 2 and 3 run in the kernel. Entries marked "red team" are mistakes and variants written from the released
notebook only; the ones the first tests missed are marked "(missed before)".
"""

from __future__ import annotations

from labkit import SolutionCells

LAB = "11_strategy_benchmark"
_changed = SolutionCells(LAB).changed


# The red team's exercise 1 variants share the released cell's head (the constructor is given).
_EX1_HEAD = '''
%%writefile strategies_impl.py
"""Exercise 1 of lab 11: lab 06's DDP classes and lab 07's ShardedOptimizer behind the strategy interface."""
import torch

from lablib.labs.strategy_benchmark.strategies import Strategy, unwrap


class YourDDP(Strategy):
    def __init__(self, env, ddp_cls, ddp_kwargs=None, sharded_optimizer_cls=None):
        super().__init__(env)
        self.ddp_cls = ddp_cls
        self.ddp_kwargs = dict(ddp_kwargs or {})
        self.sharded_optimizer_cls = sharded_optimizer_cls
'''

# Two of the red team's exercise 2 answers: an index tensor cut by torch.tensor_split or torch.chunk.
_CUT_INDEX = '''
def full_from_shards(shards, mesh_shape, placements, global_shape):
    """The full tensor of shape global_shape from every mesh coordinate's local shard."""
    sample = next(iter(shards.values()))
    numel = 1
    for n in global_shape:
        numel *= n
    index = torch.arange(numel).reshape(tuple(global_shape))
    flat = torch.empty(numel, dtype=sample.dtype, device=sample.device)
    for coord, local in shards.items():
        block = index
        for k, placement in enumerate(placements):
            if isinstance(placement, Shard):
                block = torch.@@SPLIT@@(block, mesh_shape[k], dim=placement.dim)[coord[k]]
        flat[block.reshape(-1)] = local.reshape(-1)
    return flat.reshape(tuple(global_shape))
'''

WRONG_ANSWERS = {
    "strategy_class": [
        ("never synchronizes (sync_gradients does nothing: caught by the in-kernel contract check)", _changed(
            "strategy_class", ("        model.finish_gradient_synchronization()   # waits for the all-reduces (lab 06's contract)\n",
                               "        pass\n"))),
        ("ignores the sharded optimizer (a plain optimizer every time)", _changed(
            "strategy_class", ("        if self.sharded_optimizer_cls is None:\n", "        if True:\n"))),
        ("builds the sharded optimizer without the hyper-parameters (default lr, no momentum)", _changed(
            "strategy_class", ("return self.sharded_optimizer_cls(params, optimizer_cls, **hyper)",
                               "return self.sharded_optimizer_cls(params, optimizer_cls)"))),
        ("returns the wrapper's parameter names ('module.wte.weight')", _changed(
            "strategy_class", ("return {n: w.detach() for n, w in model.module.named_parameters()}",
                               "return {n: w.detach() for n, w in model.named_parameters()}"))),
        ("red team (missed before): all-reduces p.grad itself and halves it instead of finishing the wrapper's "
         "synchronization (right only at 2 ranks with a wrapper that has no hooks)", _changed(
            "strategy_class", ("        model.finish_gradient_synchronization()   # waits for the all-reduces (lab 06's contract)\n",
                               "        import torch.distributed as dist\n"
                               "        for p in model.parameters():\n"
                               "            if p.grad is not None:\n"
                               "                dist.all_reduce(p.grad)\n"
                               "                p.grad.mul_(0.5)\n"))),
        ("red team (missed before): ddp_kwargs dropped (lab 06's DDPBucketed needs its bucket size)", _changed(
            "strategy_class", ("return self.ddp_cls(model.to(self.env.device), **self.ddp_kwargs)",
                               "return self.ddp_cls(model.to(self.env.device))"))),
        ("red team (missed before): the model is not moved to env.device (the same on a CPU, wrong on a GPU)", _changed(
            "strategy_class", ("return self.ddp_cls(model.to(self.env.device), **self.ddp_kwargs)",
                               "return self.ddp_cls(model, **self.ddp_kwargs)"))),
        ("red team: ZeroRedundancyOptimizer's keyword optimizer_class= instead of lab 07's optimizer_cls", _changed(
            "strategy_class", ("return self.sharded_optimizer_cls(params, optimizer_cls, **hyper)",
                               "return self.sharded_optimizer_cls(params, optimizer_class=optimizer_cls, **hyper)"))),
    ],
    "full_from_shards": [
        ("the caller's dict of shards consumed (shards.pop as each is placed, to free it): kept full marks before the "
         "arguments were compared after the call (issue 42)", _changed("full_from_shards", (
            "    for coord, shard in shards.items():\n",
            "    for coord in list(shards):\n        shard = shards.pop(coord)                 # each shard freed as soon as "
            "it is placed\n"))),
        ("every placement Replicate: one coordinate's shard returned as the full tensor, the caller's own tensor (kept "
         "full marks before the aliasing check of issue 42)", _changed("full_from_shards", (
            "    first = next(iter(shards.values()))\n",
            "    first = next(iter(shards.values()))\n    if all(isinstance(p, Replicate) for p in placements):\n"
            "        return first                              # every coordinate holds the whole tensor\n"))),
        ("splits evenly, D // n rows per rank (the remainder lost)", _changed(
            "full_from_shards", ("chunk = -(-size[d] // mesh_shape[k])", "chunk = size[d] // mesh_shape[k]"))),
        ("forgets that a second mesh dimension splits each chunk again (offsets from the whole size)", _changed(
            "full_from_shards", ("start[d], size[d] = start[d] + lo, hi - lo", "start[d] = start[d] + lo"))),
        ("treats Replicate() as a split of dimension 0", _changed(
            "full_from_shards", ("if isinstance(placement, (Shard, _StridedShard)):\n                d = placement.dim % ndim",
                                 "if True:\n                d = placement.dim % ndim if isinstance(placement, (Shard, _StridedShard)) else 0"))),
        ("builds the result in float32 whatever the shards' dtype", _changed(
            "full_from_shards", ("full = torch.empty(tuple(global_shape), dtype=first.dtype, device=first.device)",
                                 "full = torch.empty(tuple(global_shape), device=first.device)"))),
        ("concatenates the shards in coordinate order along the first placement's dimension", '''
def full_from_shards(shards, mesh_shape, placements, global_shape):
    dim = placements[0].dim if isinstance(placements[0], Shard) else 0
    return torch.cat([shards[c] for c in sorted(shards)], dim=dim)
'''),
        ("red team (missed before): two mesh dimensions on one tensor dimension cut as one torch.chunk into n0 n1 "
         "pieces (the same when sizes divide; 5 rows over 2 x 2: 2, 2, 1, 0 instead of 2, 1, 1, 1)", '''
def full_from_shards(shards, mesh_shape, placements, global_shape):
    """The full tensor of shape global_shape from every mesh coordinate's local shard."""
    sample = next(iter(shards.values()))
    full = torch.empty(tuple(global_shape), dtype=sample.dtype, device=sample.device)
    for coord, local in shards.items():
        # per tensor dim: how many pieces it is cut into and this coordinate's flat index among them
        pieces, which = {}, {}
        for k, placement in enumerate(placements):
            if isinstance(placement, Shard):
                d = placement.dim % len(global_shape)
                which[d] = which.get(d, 0) * mesh_shape[k] + coord[k]
                pieces[d] = pieces.get(d, 1) * mesh_shape[k]
        idx = []
        for d, size in enumerate(global_shape):
            if d in pieces:
                chunk = -(-size // pieces[d])
                start = min(which[d] * chunk, size)
                idx.append(slice(start, min(start + chunk, size)))
            else:
                idx.append(slice(0, size))
        full[tuple(idx)] = local
    return full
'''),
        ("red team: torch.tensor_split's rule (5 over 4: 2, 1, 1, 1) instead of torch.chunk's (2, 2, 1, 0)",
         _CUT_INDEX.replace("@@SPLIT@@", "tensor_split")),
        ("red team: torch.chunk(...)[c] (torch.chunk returns fewer than n chunks when the last are empty)",
         _CUT_INDEX.replace("@@SPLIT@@", "chunk")),
        ("red team: the mesh dimensions applied last first", _changed(
            "full_from_shards", ("        for k in order:\n", "        for k in reversed(order):\n"))),
        ("FSDP2 x TP's _StridedShard cut left to right like Shard (the notebook's old rule: blocks swapped)", _changed(
            "full_from_shards", ("if isinstance(placement, _StridedShard):", "if False:"))),
        ("_StridedShard ignored (not a Shard subclass: taken for Replicate)", _changed(
            "full_from_shards", ("if isinstance(placement, (Shard, _StridedShard)):\n                d",
                                 "if isinstance(placement, Shard):\n                d"))),
        ("asks DTensor's private layout function for each coordinate's offset (refused)", '''
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset


def full_from_shards(shards, mesh_shape, placements, global_shape):
    first = next(iter(shards.values()))
    full = torch.empty(tuple(global_shape), dtype=first.dtype, device=first.device)
    for coord, shard in shards.items():
        shape, offset = _compute_local_shape_and_global_offset(tuple(global_shape), tuple(mesh_shape), list(coord),
                                                               list(placements))
        full[tuple(slice(o, o + n) for o, n in zip(offset, shape))] = shard
    return full
'''),
        ("red team: DTensor's own layout function called from a worker thread (the guard once watched this thread "
         "only)", '''
import concurrent.futures as _cf
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

_POOL = _cf.ThreadPoolExecutor(1)


def full_from_shards(shards, mesh_shape, placements, global_shape):
    first = next(iter(shards.values()))
    full = torch.empty(tuple(global_shape), dtype=first.dtype, device=first.device)
    for coord, shard in shards.items():
        shape, offset = _POOL.submit(_compute_local_shape_and_global_offset, tuple(global_shape), tuple(mesh_shape),
                                     list(coord), list(placements)).result()
        full[tuple(slice(o, o + n) for o, n in zip(offset, shape))] = shard
    return full
'''),
        ("cuts an index tensor with the notebook's own dtensor_shards and scatters (DTensor's layout, refused)", '''
def full_from_shards(shards, mesh_shape, placements, global_shape):
    first = next(iter(shards.values()))
    numel = 1
    for n in global_shape:
        numel *= n
    index = torch.arange(numel, dtype=torch.float64).reshape(tuple(global_shape))
    flat = torch.empty(numel, dtype=first.dtype, device=first.device)
    for coord, block in dtensor_shards(index, tuple(mesh_shape), list(placements)).items():
        flat[block.reshape(-1).long()] = shards[coord].reshape(-1)
    return flat.reshape(tuple(global_shape))
'''),
    ],
    "planner": [
        ("ZeRO-2 shards only the optimizer state (gradients kept whole)", _changed(
            "planner", ("gr / (dp if zero >= 2 else 1)", "gr / (dp if zero >= 3 else 1)"))),
        ("activations not divided by the tensor-parallel degree", _changed(
            "planner", ("layer = s * b * h * (10 + 24 / tp)", "layer = s * b * h * (10 + 24)"))),
        ("the gradient reduction always at the bandwidth within a node", _changed(
            "planner", ('bw = cluster["bw_intra"] if tp * dp <= g else cluster["bw_inter"]', 'bw = cluster["bw_intra"]'))),
        ("the gradient reduction across nodes whenever the cluster spans nodes (tp * dp <= g ignored)", _changed(
            "planner", ('bw = cluster["bw_intra"] if tp * dp <= g else cluster["bw_inter"]',
                        'bw = cluster["bw_intra"] if N <= g else cluster["bw_inter"]'))),
        ("forgets the pipeline's bubble (m slots, not m + p - 1)", _changed(
            "planner", ("pipeline = (m + pp - 1) * (", "pipeline = m * ("))),
        ("plans the smallest memory instead of the fastest step that fits", _changed(
            "planner", ('(best is None or p["step_s"] < best["step_s"])',
                        '(best is None or p["memory_bytes"] < best["memory_bytes"])'))),
        ("never checks that the plan fits in memory", _changed(
            "planner", ('if p["memory_bytes"] <= limit and (best is None', 'if (best is None'))),
        ("ignores the memory reserve (fits in M, not M - R)", _changed(
            "planner", ('limit = cluster["memory_bytes"] - cluster["reserve_bytes"]', 'limit = cluster["memory_bytes"]'))),
        ("allows ZeRO-2/3 with a pipeline", _changed(
            "planner", ('        ("ZeRO-2/3 with pp > 1 (DeepSpeed\'s pipeline engine refuses it)", zero >= 2 and pp > 1)) if wrong]',
                        '        ) if wrong]'))),
        ("no recomputation option: every layer keeps its scores (recompute='none' only)", _changed(
            "planner", ("                    for recompute in RECOMPUTE:\n", "                    for recompute in ('none',):\n"))),
        ("the data-parallel reduction never overlapped with the backward", _changed(
            "planner", ("exposed = max(factor * share * bucket, reduce_s - hidden)", "exposed = reduce_s"))),
        ("the data-parallel reduction always hidden (no last bucket)", _changed(
            "planner", ("exposed = max(factor * share * bucket, reduce_s - hidden)",
                        "exposed = max(0.0, reduce_s - backward)"))),
        ("one reduce-scatter per step for ZeRO-2/3 with m > 1 (sharded gradients reduced once, as if accumulated whole)",
         _changed("planner", ("            if zero == 2:      #", "            if False:      #"),
                  ("m * (2 * share * w * shard + reduce_s)", "(m * 2 * share * w * shard + reduce_s)"))),
        ("ZeRO-3's gathers and reduce-scatter each hidden behind the compute on its own (one link counted as two)",
         _changed("planner", ("exposed = max(factor * share * bucket, m * (2 * share * w * shard + reduce_s) - m * compute_mb)",
                              "exposed = max(factor * share * bucket, m * reduce_s - m * compute_mb) "
                              "+ max(0.0, m * 2 * share * w * shard - m * compute_mb)"))),
        ("ZeRO-3 gathers the parameters once per micro-batch (the backward's re-gather left out)", _changed(
            "planner", ("m * (2 * share * w * shard + reduce_s)", "m * (share * w * shard + reduce_s)"))),
        ("pipeline sends cost nothing", _changed(
            "planner", ('pp_mb = 2 * (2 * b * s * h) / (cluster["bw_intra"] if N <= g else cluster["bw_inter"]) if pp > 1 else 0',
                        "pp_mb = 0"))),
        ("the fp32 logits left out", _changed(
            "planner", ("last_stage = (L // pp) * kept + working + 4 * s * b * v / tp", "last_stage = (L // pp) * kept + working"))),
        ("gradient bytes always 2 (the gradients' dtype ignored)", _changed(
            "planner", ("grads = gr * shard", "grads = 2 * shard"))),
        ("full recomputation without its second forward", _changed(
            "planner", ("passes = 8 if recompute == \"full\" else 6", "passes = 6"))),
        ("ZeRO-1/2's all-gather of the updated parameters left out", _changed(
            "planner", ("                exposed += share * w * shard                      # updated parameters all-gathered after the step\n",
                        "                pass\n"))),
        ("no micro-batches without a pipeline (mbs = B / dp when pp = 1)", _changed(
            "planner", ("            for mbs in range(1, B // dp + 1):",
                        "            for mbs in (range(1, B // dp + 1) if pp > 1 else [B // dp]):"))),
        ("1F1B keeps p micro-batches in flight, not min(p, m)", _changed(
            "planner", ("first_stage = (L // pp) * kept * min(pp, m) + working", "first_stage = (L // pp) * kept * pp + working"))),
        ("d | B, p | L and the ZeRO stage never validated", _changed(
            "planner", ('("pp does not divide layers", L % pp),', ""),
                       ('("dp*mbs does not divide the batch", B % (dp * mbs)), ("zero not in 0..3", zero not in range(4)),', ""))),
        ("plan tries ZeRO stages 0-2 only (zero_stages ignored)", _changed(
            "planner", ("                for zero in zero_stages:", "                for zero in range(3):"))),
        ("ZeRO-2 also shards the parameters", _changed(
            "planner", ("w / (dp if zero == 3 else 1)", "w / (dp if zero >= 2 else 1)"))),
        ("the attention scores' 5as^2b not divided by the tensor-parallel degree", _changed(
            "planner", ("kept, working = layer + 5 * a * s * s * b / tp, 0", "kept, working = layer + 5 * a * s * s * b, 0"))),
        ("activations of all L layers on every stage", _changed(
            "planner", ("first_stage = (L // pp) * kept * min(pp, m) + working", "first_stage = L * kept * min(pp, m) + working"))),
        ("assert instead of ValueError for dp tp pp != N and tp > g", _changed(
            "planner", ("    if bad:\n", '    assert dp * tp * pp == N and tp <= g, "invalid degrees"\n    if bad:\n'))),
        ("plan returns None when nothing fits", _changed(
            "planner", ("    if best is None:\n        raise", "    if False:\n        raise"))),
        ("the gradient reduction of the whole model's P parameters, not this GPU's P/(tp pp)", _changed(
            "planner", ("grads = gr * shard", "grads = gr * P"))),
        ("micro-batches counted over the global batch (B / mbs), not one rank's (B / (dp mbs))", _changed(
            "planner", ("m, b = B // (dp * mbs), mbs", "m, b = B // mbs, mbs"))),
        ("red team: plan folds the reserve into the caller's cluster dict (no answer changes; the caller's dict does)",
         _changed("planner", ('    limit = cluster["memory_bytes"] - cluster["reserve_bytes"]\n',
                              '    limit = cluster["memory_bytes"] - cluster["reserve_bytes"]\n'
                              '    cluster["memory_bytes"] -= cluster["reserve_bytes"]\n'
                              '    cluster["reserve_bytes"] = 0\n'))),
    ],
}


CORRECT_VARIANTS = {
    "strategy_class": [
        ("unwraps with a loop, keyword optimizer_cls, the wrapper's parameter list", '''
%%writefile strategies_impl.py
import torch.nn as nn

from lablib.labs.strategy_benchmark.strategies import Strategy


class YourDDP(Strategy):
    def __init__(self, env, ddp_cls, ddp_kwargs=None, sharded_optimizer_cls=None):
        super().__init__(env)
        self.ddp_cls, self.ddp_kwargs = ddp_cls, dict(ddp_kwargs or {})
        self.sharded_optimizer_cls = sharded_optimizer_cls

    def wrap_model(self, model):
        model.to(self.env.device)
        return self.ddp_cls(model, **self.ddp_kwargs)

    def wrap_optimizer(self, model, optimizer_cls, **hyper):
        params = list(model.parameters())
        if self.sharded_optimizer_cls:
            return self.sharded_optimizer_cls(params, optimizer_cls=optimizer_cls, **hyper)
        return optimizer_cls(params, **hyper)

    def sync_gradients(self, model):
        model.finish_gradient_synchronization()

    def full_weights(self, model):
        inner = model
        while isinstance(getattr(inner, "module", None), nn.Module):
            inner = inner.module
        return {name: p.detach().clone() for name, p in inner.named_parameters()}
'''),
        ("red team: the wrapper's parameters (each once: the module is its only child)", _changed(
            "strategy_class", ("params = model.module.parameters()        # the wrapped model's: the same tensors, each once",
                               "params = model.parameters()"))),
        ("red team: super().wrap_model for the device move, lablib's unwrap, a lambda factory, cloned weights",
         _EX1_HEAD + '''
    def wrap_model(self, model):
        model = super().wrap_model(model)            # Strategy's: model.to(self.env.device)
        return self.ddp_cls(model, **self.ddp_kwargs)

    def wrap_optimizer(self, model, optimizer_cls, **hyper):
        params = list(unwrap(model).parameters())
        if self.sharded_optimizer_cls is None:
            make = optimizer_cls
        else:
            make = lambda ps, **kw: self.sharded_optimizer_cls(ps, optimizer_cls, **kw)   # lab 07: positional
        return make(params, **hyper)

    def sync_gradients(self, model):
        finish = getattr(model, "finish_gradient_synchronization")
        finish()

    def full_weights(self, model):
        return {name: p.detach().clone() for name, p in unwrap(model).named_parameters()}
'''),
        ("red team: in-place model.to(device=...), a list of parameters, no_grad around finish, a dict loop",
         _EX1_HEAD + '''
    def wrap_model(self, model):
        device = self.env.device
        model.to(device=device)
        wrapped = self.ddp_cls(model, **self.ddp_kwargs)
        return wrapped

    def wrap_optimizer(self, model, optimizer_cls, **hyper):
        params = [p for p in model.parameters()]
        if self.sharded_optimizer_cls is not None:
            return self.sharded_optimizer_cls(params, optimizer_cls, **hyper)
        return optimizer_cls(params, **hyper)

    def sync_gradients(self, model):
        with torch.no_grad():
            model.finish_gradient_synchronization()

    def full_weights(self, model):
        plain = model.module
        prefix_free = {}
        for name, p in plain.named_parameters():
            prefix_free[name] = p.detach()
        return prefix_free
'''),
    ],
    "full_from_shards": [
        ("torch.chunk on index ranges, coordinate by coordinate", '''
def full_from_shards(shards, mesh_shape, placements, global_shape):
    any_shard = next(iter(shards.values()))
    out = torch.zeros(global_shape, dtype=any_shard.dtype, device=any_shard.device)
    # a strided shard (FSDP2 x TP) cuts after every later mesh dim that shards the same tensor dim
    def rank_of(k):
        pl = placements[k]
        if type(pl).__name__ != "_StridedShard":
            return (k, 0)
        last = max(j for j in range(k + 1, len(placements))
                   if not isinstance(placements[j], Replicate) and placements[j].dim == pl.dim)
        return (last, 1)
    order = sorted(range(len(placements)), key=rank_of)
    for coord, local in shards.items():
        ranges = [torch.arange(n) for n in global_shape]
        for k in order:
            pl = placements[k]
            if isinstance(pl, Replicate):
                continue
            d = pl.dim if pl.dim >= 0 else pl.dim + len(global_shape)
            parts = ranges[d].chunk(mesh_shape[k])
            ranges[d] = parts[coord[k]] if coord[k] < len(parts) else ranges[d][:0]
        if all(len(r) for r in ranges):
            out[tuple(slice(int(r[0]), int(r[-1]) + 1) for r in ranges)] = local
    return out
'''),
        ("red team: per-coordinate start and length from ceil chunks, mesh dimensions in order",
         '''
def full_from_shards(shards, mesh_shape, placements, global_shape):
    """The full tensor of shape global_shape from every mesh coordinate's local shard."""
    from torch.distributed.tensor.placement_types import _StridedShard as Strided

    any_shard = next(iter(shards.values()))
    full = torch.empty(tuple(global_shape), dtype=any_shard.dtype, device=any_shard.device)
    steps = [(k, p) for k, p in enumerate(placements) if not isinstance(p, Strided)]
    for k, placement in enumerate(placements):
        if isinstance(placement, Strided):             # cut right after the last later shard of its dim
            j = max(i for i in range(k + 1, len(placements))
                    if isinstance(placements[i], (Shard, Strided)) and placements[i].dim == placement.dim)
            where = next(n for n, (i, _) in enumerate(steps) if i == j)
            steps.insert(where + 1, (k, placement))
    for coord, local in shards.items():
        starts = [0] * len(global_shape)
        sizes = list(global_shape)
        for k, placement in steps:
            if isinstance(placement, (Shard, Strided)):
                d = placement.dim % len(global_shape)
                n = mesh_shape[k]
                chunk = -(-sizes[d] // n)                      # ceil: torch.chunk's chunk length
                start = min(coord[k] * chunk, sizes[d])
                stop = min(start + chunk, sizes[d])
                starts[d] += start
                sizes[d] = stop - start
        full[tuple(slice(a, a + n) for a, n in zip(starts, sizes))] = local
    return full
'''),
        ("red team: an index tensor cut with torch.chunk as DTensor cuts it (missing chunks empty), scattered",
         '''
import itertools

import torch


def _chunk_or_empty(t, n, i, dim):
    """torch.chunk's i-th of n chunks, empty where torch.chunk returns fewer than n."""
    pieces = torch.chunk(t, n, dim=dim)
    if i < len(pieces):
        return pieces[i]
    return t.narrow(dim, t.shape[dim], 0)


def full_from_shards(shards, mesh_shape, placements, global_shape):
    """Scatter each shard through an index tensor cut exactly the way DTensor cuts the full tensor."""
    sample = shards[next(iter(shards))]
    numel = 1
    for n in global_shape:
        numel *= n
    index = torch.arange(numel).reshape(tuple(global_shape))
    flat = torch.zeros(numel, dtype=sample.dtype, device=sample.device)
    order = list(range(len(placements)))
    for k in range(len(placements) - 1, -1, -1):       # right-to-left (strided) shards move after their partners
        if hasattr(placements[k], "split_factor"):
            partner = max(j for j in range(k + 1, len(placements)) if placements[j].is_shard()
                          and placements[j].dim == placements[k].dim)
            order.remove(k)
            order.insert(order.index(partner) + 1, k)
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        block = index
        for k in order:
            placement = placements[k]
            if placement.is_shard() or hasattr(placement, "split_factor"):
                block = _chunk_or_empty(block, mesh_shape[k], coord[k], placement.dim)
        flat[block.reshape(-1).to(flat.device)] = shards[coord].reshape(-1)
    return flat.reshape(tuple(global_shape))
'''),
    ],
    "planner": [
        ("itertools.product over the degrees, helpers per term, min by (step, memory)", '''
from itertools import product

RECOMPUTE = ("none", "selective", "full")
BUCKET_BYTES = 25 * 2**20


def _ring(nbytes, n, bw):
    return 2 * (n - 1) / n * nbytes / bw


def predict(model, cluster, dp, zero, tp, pp, mbs, recompute, state_bytes=(2, 2, 12)):
    P, L, h, a = model["params"], model["layers"], model["hidden"], model["heads"]
    s, B, v = model["seq"], model["batch"], model["vocab"]
    N, g, F = cluster["gpus"], cluster["gpus_per_node"], cluster["flops"]
    if min(dp, tp, pp, mbs) < 1 or dp * tp * pp != N or tp > g or a % tp or L % pp or B % (dp * mbs):
        raise ValueError("invalid degrees")
    if zero not in (0, 1, 2, 3) or recompute not in RECOMPUTE or (zero >= 2 and pp > 1):
        raise ValueError("invalid ZeRO stage or recomputation")
    psi = P / tp / pp
    bw_, bg, bo = state_bytes
    states = psi * bw_ / (dp if zero >= 3 else 1) + psi * bg / (dp if zero >= 2 else 1) + psi * bo / (dp if zero >= 1 else 1)
    m = B // dp // mbs
    base = s * mbs * h * (10 + 24 / tp)
    per_layer = {"none": base + 5 * a * s * s * mbs / tp, "selective": base, "full": 2 * s * mbs * h}[recompute]
    extra = base if recompute == "full" else 0.0
    acts = max(L // pp * per_layer * min(pp, m) + extra, L // pp * per_layer + extra + 4 * s * mbs * v / tp)
    k = 8 if recompute == "full" else 6
    slot = k * psi * mbs * s / F + L // pp * (k - 2) * _ring(2 * mbs * s * h, tp, cluster["bw_intra"])
    if pp > 1:
        slot += 4 * mbs * s * h / (cluster["bw_intra"] if N <= g else cluster["bw_inter"])
    step = (m + pp - 1) * slot
    if dp > 1:
        bw = cluster["bw_intra"] if tp * dp <= g else cluster["bw_inter"]
        G = bg * psi
        c = min(BUCKET_BYTES, G)
        T = (lambda x: _ring(x, dp, bw)) if zero == 0 else (lambda x: _ring(x, dp, bw) / 2)
        t_b = (k - 2) * psi * mbs * s / F
        t_mb = k * psi * mbs * s / F
        if zero == 3:                                    # m x (gather, gather, reduce-scatter) behind m x compute
            step += max(T(c), m * (_ring(bw_ * psi, dp, bw) + T(G) - t_mb))
        else:                                            # the link busy from the first or the last reduction on
            reductions = m if zero == 2 else 1
            step += max(T(c), *(n * T(G) - (n - 1) * t_mb - t_b * (1 - c / G) for n in (1, reductions)))
            if zero:
                step += _ring(bw_ * psi, dp, bw) / 2
    return {"memory_bytes": states + acts, "step_s": step}


def plan(model, cluster, zero_stages=(0, 1, 2, 3)):
    N, B = cluster["gpus"], model["batch"]
    options = []
    for tp, pp, mbs, zero, rc in product(range(1, N + 1), range(1, N + 1), range(1, B + 1), zero_stages, RECOMPUTE):
        if N % (tp * pp) or B % (N // (tp * pp) * mbs):
            continue
        dp = N // (tp * pp)
        try:
            p = predict(model, cluster, dp, zero, tp, pp, mbs, rc)
        except ValueError:
            continue
        if p["memory_bytes"] <= cluster["memory_bytes"] - cluster["reserve_bytes"]:
            options.append(dict(p, dp=dp, zero=zero, tp=tp, pp=pp, mbs=mbs, recompute=rc))
    if not options:
        raise ValueError("nothing fits")
    return min(options, key=lambda o: (o["step_s"], o["memory_bytes"]))
'''),
        ("red team style: every stage's memory computed, and a practitioner's pick among plans within 1% of the "
         "fastest (least model parallelism, then the lowest ZeRO stage, then the least memory)", '''
import math

RECOMPUTE = ("none", "selective", "full")
BUCKET_BYTES = 25 * 2**20


def predict(model, cluster, dp, zero, tp, pp, mbs, recompute, state_bytes=(2, 2, 12)):
    P, L, h, a, s, B, v = (model[k] for k in ("params", "layers", "hidden", "heads", "seq", "batch", "vocab"))
    N, g = cluster["gpus"], cluster["gpus_per_node"]
    problems = []
    if min(dp, tp, pp, mbs) < 1:
        problems.append("a degree below 1")
    elif math.prod((dp, tp, pp)) != N:
        problems.append("dp*tp*pp != N")
    elif B % (dp * mbs):
        problems.append("batch")
    if tp > g or a % tp or L % pp:
        problems.append("tp or pp")
    if zero not in range(4) or (zero > 1 and pp > 1):
        problems.append("zero")
    if recompute not in RECOMPUTE:
        problems.append("recompute")
    if problems:
        raise ValueError("; ".join(problems))
    shard = P / (tp * pp)
    divide = (dp if zero == 3 else 1, dp if zero >= 2 else 1, dp if zero >= 1 else 1)
    states = sum(shard * nbytes / k for nbytes, k in zip(state_bytes, divide))
    micro = B // (dp * mbs)
    no_scores = s * mbs * h * (10 + 24 / tp)
    if recompute == "full":
        kept, working = 2 * s * mbs * h, no_scores
    else:
        kept, working = no_scores + (5 * a * s * s * mbs / tp if recompute == "none" else 0), 0
    stages = []
    for i in range(pp):
        held = (L // pp) * kept * min(pp - i, micro) + working
        if i == pp - 1:
            held = (L // pp) * kept + working + 4 * s * mbs * v / tp
        stages.append(held)
    flops_mb = (4 if recompute == "full" else 3) * 2 * shard * mbs * s
    ring = lambda nbytes, n, bw: 2 * (n - 1) / n * nbytes / bw
    t_mb = flops_mb / cluster["flops"]
    t_mb += (L // pp) * (6 if recompute == "full" else 4) * ring(2 * mbs * s * h, tp, cluster["bw_intra"])
    if pp > 1:
        t_mb += 2 * 2 * mbs * s * h / (cluster["bw_intra"] if N <= g else cluster["bw_inter"])
    step = (micro + pp - 1) * t_mb
    if dp > 1:
        bw = cluster["bw_intra"] if tp * dp <= g else cluster["bw_inter"]
        scale = 1.0 if zero == 0 else 0.5
        grads = state_bytes[1] * shard
        first = min(BUCKET_BYTES, grads)
        backward = (flops_mb - 2 * shard * mbs * s) / cluster["flops"]
        gather = 0.5 * ring(state_bytes[0] * shard, dp, bw)
        reduce = scale * ring(grads, dp, bw)
        if zero == 3:
            traffic, budget = micro * (2 * gather + reduce), micro * flops_mb / cluster["flops"]
            step += max(scale * ring(first, dp, bw), traffic - budget)
        else:
            # simulate the link micro-batch by micro-batch: reductions (one, or one per micro-batch under ZeRO-2)
            # queue behind each other; each starts at the earliest when its micro-batch's first bucket is full
            compute, link_free = flops_mb / cluster["flops"], 0.0
            for i in range(micro if zero == 2 else 1):
                first_ready = (micro - (micro if zero == 2 else 1) + i + 1) * compute - backward * (1 - first / grads)
                link_free = max(link_free, first_ready) + reduce
            step += max(scale * ring(first, dp, bw), link_free - micro * compute)
            if zero in (1, 2):
                step += gather
    return {"memory_bytes": states + max(stages), "step_s": step}


def plan(model, cluster, zero_stages=(0, 1, 2, 3)):
    N = cluster["gpus"]
    found = []
    for tp in [d for d in range(1, N + 1) if N % d == 0]:
        for pp in [d for d in range(1, N // tp + 1) if (N // tp) % d == 0]:
            dp = N // (tp * pp)
            for mbs in range(1, model["batch"] + 1):
                for zero in sorted(zero_stages, reverse=True):
                    for recompute in reversed(RECOMPUTE):
                        try:
                            p = predict(model, cluster, dp, zero, tp, pp, mbs, recompute)
                        except ValueError:
                            continue
                        if p["memory_bytes"] <= cluster["memory_bytes"] - cluster["reserve_bytes"]:
                            found.append({"dp": dp, "zero": zero, "tp": tp, "pp": pp, "mbs": mbs,
                                          "recompute": recompute, **p})
    if not found:
        raise ValueError(f"no plan fits in {cluster['memory_bytes'] - cluster['reserve_bytes']:.3g} bytes")
    fastest = min(f["step_s"] for f in found)
    near = [f for f in found if f["step_s"] <= fastest * 1.005]
    return min(near, key=lambda f: (f["tp"] * f["pp"], f["zero"], f["memory_bytes"]))
'''),
    ],
}
