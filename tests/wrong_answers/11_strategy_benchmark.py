"""Wrong answers and correct variants for lab 11 (see tests/wrong_answers/__init__.py).

Exercise 1's answers each cost one torchrun start of the graded run (5 rows, 2 ranks): four wrong ones, one correct
variant. Exercises 2 and 3 run in the kernel: more of them.
"""

from __future__ import annotations

from wrong_answers import SolutionCells

LAB = "11_strategy_benchmark"
_changed = SolutionCells(LAB).changed

WRONG_ANSWERS = {
    "strategy_class": [
        ("never synchronizes (sync_gradients does nothing: the stand-in's all-reduce never runs)", _changed(
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
    ],
    "full_from_shards": [
        ("splits evenly, D // n rows per rank (the remainder lost)", _changed(
            "full_from_shards", ("chunk = -(-size[d] // mesh_shape[k])", "chunk = size[d] // mesh_shape[k]"))),
        ("forgets that a second mesh dimension splits each chunk again (offsets from the whole size)", _changed(
            "full_from_shards", ("start[d], size[d] = start[d] + lo, hi - lo", "start[d] = start[d] + lo"))),
        ("treats Replicate() as a split of dimension 0", _changed(
            "full_from_shards", ("if isinstance(placement, Shard):\n                d = placement.dim % ndim",
                                 "if True:\n                d = placement.dim % ndim if isinstance(placement, Shard) else 0"))),
        ("builds the result in float32 whatever the shards' dtype", _changed(
            "full_from_shards", ("full = torch.empty(tuple(global_shape), dtype=first.dtype, device=first.device)",
                                 "full = torch.empty(tuple(global_shape), device=first.device)"))),
        ("concatenates the shards in coordinate order along the first placement's dimension", '''
def full_from_shards(shards, mesh_shape, placements, global_shape):
    dim = placements[0].dim if isinstance(placements[0], Shard) else 0
    return torch.cat([shards[c] for c in sorted(shards)], dim=dim)
'''),
    ],
    "planner": [
        ("ZeRO-2 shards only the optimizer state (gradients kept whole)", _changed(
            "planner", ("gr / (dp if zero >= 2 else 1)", "gr / (dp if zero >= 3 else 1)"))),
        ("activations not divided by the tensor-parallel degree", _changed(
            "planner", ("(10 + 24 / tp + 5 * a * s / (h * tp))", "(10 + 24 + 5 * a * s / h)"))),
        ("the gradient all-reduce always at the bandwidth within a node", _changed(
            "planner", ('dp_bw = cluster["bw_intra"] if N <= g else cluster["bw_inter"]', 'dp_bw = cluster["bw_intra"]'))),
        ("forgets the pipeline's bubble", _changed(
            "planner", ("* (m + pp - 1) / m\n", "\n"))),
        ("plans the smallest memory instead of the fastest step that fits", _changed(
            "planner", ('(best is None or p["step_s"] < best["step_s"])',
                        '(best is None or p["memory_bytes"] < best["memory_bytes"])'))),
        ("never checks that the plan fits in memory", _changed(
            "planner", ('if p["memory_bytes"] <= cluster["memory_bytes"] and (best is None',
                        'if (best is None'))),
    ],
}

CORRECT_VARIANTS = {
    "strategy_class": [
        ("unwraps with a loop, keyword optimizer_cls, the wrapper's parameter list", '''
%%writefile strategies_impl.py
import torch.nn as nn

from lablib.parallel.strategies import Strategy


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
    ],
    "full_from_shards": [
        ("torch.chunk on index ranges, coordinate by coordinate", '''
def full_from_shards(shards, mesh_shape, placements, global_shape):
    any_shard = next(iter(shards.values()))
    out = torch.zeros(global_shape, dtype=any_shard.dtype, device=any_shard.device)
    for coord, local in shards.items():
        ranges = [torch.arange(n) for n in global_shape]
        for k, pl in enumerate(placements):
            if isinstance(pl, Replicate):
                continue
            d = pl.dim if pl.dim >= 0 else pl.dim + len(global_shape)
            parts = ranges[d].chunk(mesh_shape[k])
            ranges[d] = parts[coord[k]] if coord[k] < len(parts) else ranges[d][:0]
        if all(len(r) for r in ranges):
            out[tuple(slice(int(r[0]), int(r[-1]) + 1) for r in ranges)] = local
    return out
'''),
    ],
    "planner": [
        ("itertools.product over the degrees, min by step time", '''
import itertools


def predict(model, cluster, dp, zero, tp, pp, state_bytes=(2, 2, 12)):
    P, L, h, a, s, B = model["params"], model["layers"], model["hidden"], model["heads"], model["seq"], model["batch"]
    N = cluster["gpus"]
    if dp * tp * pp != N or tp > cluster["gpus_per_node"] or a % tp or L % pp or B % dp or zero not in (0, 1, 2, 3):
        raise ValueError("invalid degrees")
    psi = P / tp / pp
    pw, pg, po = state_bytes
    states = psi * (pw / (dp if zero >= 3 else 1)) + psi * (pg / (dp if zero >= 2 else 1)) + psi * (po / (dp if zero >= 1 else 1))
    if pp > 1:
        m, b = B // dp, 1
    else:
        m, b = 1, B // dp
    act = (L // pp) * min(pp, m) * s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    t = 6 * P * B * s / (N * cluster["flops"]) * (m + pp - 1) / m
    t += 4 * (L // pp) * m * 2 * (tp - 1) / tp * (2 * b * s * h) / cluster["bw_intra"]
    bw = cluster["bw_intra"] if N <= cluster["gpus_per_node"] else cluster["bw_inter"]
    t += (1.5 if zero == 3 else 1) * 2 * (dp - 1) / dp * 2 * psi / bw
    return {"memory_bytes": states + act, "step_s": t, "states_bytes": states}


def plan(model, cluster):
    N = cluster["gpus"]
    options = []
    for tp, pp, zero in itertools.product(range(1, N + 1), range(1, N + 1), range(4)):
        if N % (tp * pp):
            continue
        try:
            p = predict(model, cluster, N // (tp * pp), zero, tp, pp)
        except ValueError:
            continue
        if p["memory_bytes"] <= cluster["memory_bytes"]:
            options.append(dict(p, dp=N // (tp * pp), zero=zero, tp=tp, pp=pp))
    if not options:
        raise ValueError("nothing fits")
    return min(options, key=lambda o: o["step_s"])
'''),
    ],
}
