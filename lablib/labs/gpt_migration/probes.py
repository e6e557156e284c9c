"""Read what lab 05's exercise code does, on the ranks, without training: the graded cells check these.

- ``probe_loader``: the items a ``make_loader`` / ``start_epoch`` pair gives each rank, per epoch and per
  seed, and the sampler class behind it;
- ``probe_mean``: what ``mean_across_ranks`` returns for known per-rank values;
- ``fsdp_plan``: which modules are FSDP2 units and the mixed-precision policy *each* unit holds;
- ``*_without_processes``: the same two looks taken in the notebook's own process before a real run, so a
  wrong loader or plan fails in a second instead of after a torchrun start.

They observe; they do not know how the answer was written (the checks compare with what the docstrings
promise: disjoint shards, a new order per epoch and per seed, the mean).
"""

from __future__ import annotations

import torch
from torch.utils.data import DistributedSampler

from lablib.jobs.distenv import gather_objects


def probe_loader(make_loader, start_epoch, env, seed: int, items_per_rank: int = 40, batch_size: int = 4) -> dict:
    """Orders of a toy dataset of items_per_rank * world_size integers, on every rank (gathered):
    orders[rank] = [epoch 0 with seed, epoch 1 with seed, epoch 0 with seed + 1]."""
    probe = list(range(items_per_rank * env.world_size))
    orders, batch_sizes, sampler = [], set(), None
    for s, epoch in ((seed, 0), (seed, 1), (seed + 1, 0)):
        loader = make_loader(probe, batch_size, env, s)
        sampler = getattr(loader, "sampler", None)
        sampler = "DistributedSampler" if isinstance(sampler, DistributedSampler) else type(sampler).__name__
        start_epoch(loader, epoch)
        batches = [[int(i) for i in batch] for batch in loader]
        batch_sizes.update(len(b) for b in batches)
        orders.append([i for b in batches for i in b])
    return {"orders": gather_objects(orders, env), "probe_size": len(probe), "seed": seed,
            "batch_sizes": sorted(batch_sizes), "requested_batch_size": batch_size,
            "sampler": gather_objects(sampler, env)}


def probe_mean(mean_across_ranks, env) -> dict:
    """mean_across_ranks of (rank + 1.5) and of (rank ** 2), as returned on every rank."""
    out = {}
    for name, value, expected in (("rank_plus_1_5", lambda r: r + 1.5, (env.world_size - 1) / 2 + 1.5),
                                  ("rank_squared", lambda r: float(r * r),
                                   sum(r * r for r in range(env.world_size)) / env.world_size)):
        got = mean_across_ranks(torch.tensor(value(env.rank), device=env.device), env)
        out[name] = {"per_rank": gather_objects(float(got), env), "expected": expected}
    return out


def fsdp_plan(model) -> dict:
    """Which modules are FSDP2 units, and each unit's mixed-precision policy as FSDP2 holds it.

    units: {module name ('' = root): {"param_dtype": ..., "reduce_dtype": ...} or None}.
    """
    from torch.distributed.fsdp import FSDPModule

    def policy(module):
        group = module._get_fsdp_state()._fsdp_param_group     # private, read only: the unit's own policy
        if group is None:
            return None
        return {"param_dtype": str(group.mp_policy.param_dtype), "reduce_dtype": str(group.mp_policy.reduce_dtype)}

    units = {name: policy(m) for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    blocks = [isinstance(b, FSDPModule) or isinstance(getattr(b, "block", None), FSDPModule) for b in model.h]
    return {"root_is_fsdp": isinstance(model, FSDPModule), "blocks_are_fsdp": blocks, "units": units}


def loader_probe_without_processes(make_loader, start_epoch, world_size: int, seed: int, **sizes) -> dict:
    """probe_loader for every rank of a world of world_size, called in this one process: make_loader gets each
    rank's DistEnv in turn (a DistributedSampler takes rank and world size as arguments, no process group is
    involved). A quick look before a real run, never a replacement for it."""
    from lablib.jobs.distenv import DistEnv

    per_rank = [probe_loader(make_loader, start_epoch, DistEnv(r, r, world_size, world_size, torch.device("cpu"), "gloo"),
                             seed, **sizes) for r in range(world_size)]
    return {**per_rank[0], "orders": [p["orders"][0] for p in per_rank], "sampler": [p["sampler"][0] for p in per_rank],
            "batch_sizes": sorted({b for p in per_rank for b in p["batch_sizes"]})}


def mean_probe_without_processes(mean_across_ranks, world_size: int) -> dict | None:
    """probe_mean on a world of world_size ranks that are threads of this process (``lablib.probes.rehearsal``): a quick
    look before the real run, never a replacement for it. None when the answer calls a collective the rehearsal
    does not stand in for (the real run then decides)."""
    from lablib.jobs.distenv import DistEnv
    from lablib.probes.rehearsal import RehearsalUnsupported, run_in_thread_ranks

    def rank(r):
        return probe_mean(mean_across_ranks, DistEnv(r, r, world_size, world_size, torch.device("cpu"), "gloo"))

    try:
        return run_in_thread_ranks(world_size, rank)[0]
    except RehearsalUnsupported:
        return None


def fsdp_plan_without_processes(apply_fsdp, model) -> dict:
    """fsdp_plan of apply_fsdp(model, mesh) on a world of one process (a gloo group of one, torn down after):
    which modules become units and each unit's policy, without starting ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return fsdp_plan(apply_fsdp(model, init_device_mesh("cpu", (1,))))
    finally:
        if owned:
            dist.destroy_process_group()
