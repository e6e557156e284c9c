"""Lab 11's exercise 2 observed: the shards DTensor itself gives each coordinate of a device mesh, and the
placements FSDP2 x TP really uses, in one process on CPU (a ``fake`` process group: collectives do nothing, so
``distribute_tensor(..., src_data_rank=None)`` keeps each rank's own cut of the full tensor); and a guard that the
answer rebuilds the tensor by its own arithmetic, not by DTensor's layout code.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist


def fake_ranks(world_size: int):
    """Each rank of a ``world_size`` job in turn, in this process (``for rank in fake_ranks(4): ...``), with a
    fake process group initialised for that rank (refused where a real one is already up)."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process: fake ranks would replace it")
    for rank in range(world_size):
        dist.init_process_group("fake", rank=rank, world_size=world_size)
        try:
            yield rank
        finally:
            dist.destroy_process_group()


def dtensor_shards(full: torch.Tensor, mesh_shape: tuple[int, ...], placements) -> dict[tuple[int, ...], torch.Tensor]:
    """{mesh coordinate: the local shard DTensor keeps there} for ``full`` distributed with ``placements``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    if len(mesh_shape) != len(placements):
        raise ValueError(f"a mesh of shape {mesh_shape} needs {len(mesh_shape)} placements, got {placements}")
    out = {}
    for _ in fake_ranks(math.prod(mesh_shape)):
        mesh = init_device_mesh("cpu", tuple(mesh_shape))
        local = distribute_tensor(full, mesh, list(placements), src_data_rank=None).to_local()
        out[tuple(mesh.get_coordinate())] = local.clone()
    return out


def fsdp2_tp_layout(config, mesh_shape=(2, 2), name: str = "h.0.mlp.c_fc.weight") -> dict:
    """The course GPT under FSDP2 x TP (``tensor_parallel.apply_2d``) on a (dp, tp) mesh, in fake ranks: every
    parameter's placements, and for ``name`` (a matrix) the first row and the shape of the block each coordinate
    keeps: an index tensor distributed with that parameter's mesh and placements (a fake group moves no data, so
    the model's own values are not the ones to read)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from lablib.course.models import GPT
    from lablib.parallel.tensor_parallel import apply_2d

    placements, blocks = {}, {}
    for rank in fake_ranks(math.prod(mesh_shape)):
        mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        model = apply_2d(GPT(config), mesh)
        params = dict(model.named_parameters())
        if rank == 0:
            placements = {n: tuple(p.placements) for n, p in params.items()}
        p = params[name]
        rows, cols = p.shape
        index = torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols)
        local = distribute_tensor(index, mesh, p.placements, src_data_rank=None).to_local()   # the (dp, tp) mesh
        blocks[tuple(mesh.get_coordinate())] = {"first_row": int(local[0, 0].item()) // cols,
                                                "shape": tuple(local.shape)}
    return {"placements": placements, "blocks": blocks, "name": name, "shape": tuple(params[name].shape)}


_TORCH_TENSOR_DIR = str(Path(torch.__file__).parent / "distributed" / "tensor")
_THIS_FILE = str(Path(__file__).resolve())


@contextlib.contextmanager
def refuse_layout_helpers():
    """Record every Python function the block itself calls in DTensor's package (torch/distributed/tensor/: its
    layout rules, ``_compute_local_shape_and_global_offset``, ``distribute_tensor``...) or in this module, except
    a placement's attributes (``dim``, ``split_factor``: properties in Python), its ``is_*`` predicates and
    dunders; ``used`` lists them after the block. Exercise 2 asks for the layout's arithmetic, so an answer that
    asks DTensor for it does not count."""
    used: list[str] = []
    previous = sys.getprofile()

    def ours(code) -> bool:
        return code.co_filename.startswith(_TORCH_TENSOR_DIR) or code.co_filename == _THIS_FILE

    def profile(frame, event, arg):
        # only what the block calls itself: a helper's own calls inside DTensor's code are not the answer's
        if event == "call" and ours(frame.f_code) and not (frame.f_back and ours(frame.f_back.f_code)):
            name = frame.f_code.co_name
            if name not in ("refuse_layout_helpers", "dim", "split_factor") \
                    and not (name.startswith("is_") or (name.startswith("__") and name.endswith("__"))):
                used.append(f"{Path(frame.f_code.co_filename).name}:{name}")

    # sys.setprofile watches this thread only; threading.setprofile every thread started inside the block (an
    # answer that hands DTensor's helper to a worker thread is recorded too)
    previous_threads = threading.getprofile()
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        yield used
    finally:
        sys.setprofile(previous)
        threading.setprofile(previous_threads)


def describe(mesh_shape, placements, global_shape) -> str:
    """A case in words, for a check's message."""
    names = ", ".join(repr(p) for p in placements)
    return f"a {tuple(global_shape)} tensor on a mesh of shape {tuple(mesh_shape)} with ({names})"

