"""Checks that data-parallel ranks really did what data parallelism promises, from a real run:

- every rank trained on its own samples (``RecordingDataset`` remembers the indices a process loaded;
  ``shard_report`` compares the ranks' lists once gathered);
- every rank ends with the same weights (``weight_spread``: 0.0 when they are bit-identical);
- a parallel run ends where a single-process reference does (``max_abs_diff`` of two models' weights).

They read what happened; they do not know how the sampler or the wrapper was written.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from lablib.memory import local_tensor


class RecordingDataset(Dataset):
    """Wraps a map-style dataset and records, in this process, every index loaded from it."""

    def __init__(self, base: Dataset):
        self.base, self.seen = base, []

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i):
        self.seen.append(int(i))
        return self.base[i]


def gather_objects(obj, env, group=None) -> list:
    """[rank 0's obj, rank 1's obj, ...] of ``group`` (default: every rank) on each of its ranks; a
    one-element list without a process group. The course's one way to bring per-rank figures together."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * (env.world_size if group is None else dist.get_world_size(group))
    dist.all_gather_object(out, obj, group=group)
    return out


def shard_report(seen_per_rank: list[list[int]]) -> dict:
    """How many samples each rank loaded, how many distinct, and how many were loaded by two ranks."""
    sets = [set(s) for s in seen_per_rank]
    overlap = sum(len(a & b) for i, a in enumerate(sets) for b in sets[i + 1:])
    return {"samples_per_rank": [len(s) for s in seen_per_rank], "distinct_per_rank": [len(s) for s in sets],
            "overlapping_samples": overlap}


def weight_spread(model: torch.nn.Module, env) -> float:
    """max over parameters of (max over ranks - min over ranks); 0.0 when every rank holds the same weights."""
    flat = torch.cat([local_tensor(p).detach().float().flatten() for p in model.parameters()])
    hi, lo = flat.clone(), flat.clone()
    if dist.is_initialized():
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return (hi - lo).max().item()


def max_abs_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """Largest |weight of a - weight of b| over all parameters (two models of the same architecture)."""
    return max((p.detach() - q.detach()).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
