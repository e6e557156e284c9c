"""Lab 11's exercise 2, the expected shards (instructor only: students never import it).

Each mesh coordinate's block of the full tensor by plain arithmetic, without DTensor: ``Shard(d)`` on mesh
dimension k cuts tensor dimension d the way ``torch.chunk`` does (chunks of ceil(D / n), the last ones shorter or
empty), mesh dimensions applied left to right, each cutting the block the ones before it left; a
``_StridedShard(d, split_factor=sf)`` on mesh dimension k is applied *after* the mesh dimensions to its right
that shard the same tensor dimension (``sf`` = the product of their sizes): FSDP2 x TP's right-to-left layout
(torch/distributed/tensor/placement_types.py:799-830; placed by torch/distributed/fsdp/_fully_shard/
_fsdp_param.py:409-421 and 506-519). ``tests/test_lablib_strategies.py`` holds these against DTensor's own shards
(a fake process group, one process).
"""

from __future__ import annotations

import itertools

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def chunk_bounds(size: int, n: int, i: int) -> tuple[int, int]:
    """[lo, hi) of torch.chunk's i-th of n chunks of size elements (empty past the last chunk torch.chunk makes)."""
    chunk = -(-size // n)
    lo = min(i * chunk, size)
    return lo, min(lo + chunk, size)


def application_order(placements) -> list[int]:
    """The mesh dimensions in the order they cut the tensor."""
    order = list(range(len(placements)))
    for k, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            later = [j for j in range(k + 1, len(placements))
                     if isinstance(placements[j], (Shard, _StridedShard)) and placements[j].dim == p.dim]
            if not later:
                raise NotImplementedError(f"{p} on mesh dimension {k} with no later shard of dim {p.dim}")
            order.remove(k)
            order.insert(order.index(later[-1]) + 1, k)
    return order


def block(global_shape, mesh_shape, placements, coord) -> tuple[slice, ...]:
    """The slices of the full tensor that the rank at ``coord`` keeps."""
    ndim = len(global_shape)
    start, size = [0] * ndim, list(global_shape)
    for k in application_order(placements):
        p = placements[k]
        if isinstance(p, Replicate):
            continue
        if not isinstance(p, (Shard, _StridedShard)):
            raise NotImplementedError(f"placement {p}")
        if isinstance(p, _StridedShard):
            sf = 1
            for j in range(k + 1, len(placements)):
                if isinstance(placements[j], (Shard, _StridedShard)) and placements[j].dim == p.dim:
                    sf *= mesh_shape[j]
            if sf != p.split_factor:
                raise NotImplementedError(f"{p}: split_factor {p.split_factor} is not the later shards' {sf}")
        d = p.dim % ndim
        lo, hi = chunk_bounds(size[d], mesh_shape[k], coord[k])
        start[d], size[d] = start[d] + lo, hi - lo
    return tuple(slice(a, a + s) for a, s in zip(start, size))


def expected_shards(full: torch.Tensor, mesh_shape, placements) -> dict[tuple[int, ...], torch.Tensor]:
    """{mesh coordinate: the local shard} of ``full``."""
    if len(mesh_shape) != len(placements):
        raise ValueError(f"a mesh of shape {mesh_shape} needs {len(mesh_shape)} placements, got {placements}")
    return {coord: full[block(tuple(full.shape), mesh_shape, placements, coord)].clone()
            for coord in itertools.product(*(range(n) for n in mesh_shape))}
