"""Lab 11's exercise 2 observed: the shards DTensor gives each coordinate of a device mesh, made by PyTorch's own
rule (``torch.distributed.tensor._utils._compute_local_shape_and_global_offset``, the function DTensor uses to
lay out a local shard: torch/distributed/tensor/_utils.py:199), without any process group. The check hands these
shards to the student's reassembly and compares the result with the tensor they were cut from.
"""

from __future__ import annotations

import itertools

import torch
from torch.distributed.tensor import Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset


def dtensor_shards(full: torch.Tensor, mesh_shape: tuple[int, ...], placements) -> dict[tuple[int, ...], torch.Tensor]:
    """{mesh coordinate: the local shard DTensor keeps there} for ``full`` distributed with ``placements``."""
    if len(mesh_shape) != len(placements):
        raise ValueError(f"a mesh of shape {mesh_shape} needs {len(mesh_shape)} placements, got {placements}")
    out = {}
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        shape, offset = _compute_local_shape_and_global_offset(tuple(full.shape), mesh_shape, list(coord), placements)
        index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
        out[coord] = full[index].clone()
    return out


def describe(mesh_shape, placements, global_shape) -> str:
    """A case in words, for a check's message."""
    names = ", ".join(f"Shard({p.dim})" if isinstance(p, Shard) else type(p).__name__ + "()" for p in placements)
    return f"a {tuple(global_shape)} tensor on a mesh of shape {tuple(mesh_shape)} with ({names})"
