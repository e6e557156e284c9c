"""torch's own context parallelism for FlexAttention, run on CPU over gloo (lab 12, section 6).

torch 2.13's FlexAttention path gathers K/V instead of passing them round a ring (Llama 3's context parallelism):
``_ContextParallel(seq_dim, AttentionType.FLEX)`` registers a forward pre-hook on the module that calls
``flex_attention`` (torch/distributed/tensor/experimental/_context_parallel/_attention.py:1331-1336), which replaces
its key and value by ``flex_cp_allgather`` (``flex_input_fn``, :1347-1378, the call at :1369), a custom op of two
``all_gather_single`` calls (_cp_custom_ops.py:9-21; its backward reduce-scatters the K/V gradients, :37-50). The query stays sharded, so the
block mask must translate local query indices to global ones: ``_create_cp_block_mask`` (_attention.py:1174-1309)
rewrites the mask_mod (:1237-1285) and builds the BlockMask with ``torch.compile(create_block_mask)`` (:1230-1235), cached in the
module global ``_compiled_create_block_mask`` (:1061). The queries, keys and values are sharded by torch's default
load balancer, the head-tail (zigzag) split when 2N divides T (_load_balancer.py:470-478), by
``_context_parallel_buffers`` (_attention.py:1064).

``flex_cp_compare`` runs one causal forward that way on every rank of the mesh and compares each rank's output with
one process's flex_attention on the whole sequence, sharded the same way. Forward only: flex_attention refuses a
backward on CPU ("FlexAttention does not support backward on CPU", torch/nn/attention/flex_attention.py:2075-2084), and on a CPU
without torch.compile flex_attention itself is unfused: it materializes the scores (its warning, :2481-2484).
Measured while the lab was written (2 cores, load average about 18, T = 512): the compiled mask took 127 s per
rank, the uncompiled one 1.1 s, with the same outputs.
``compile_mask``: build the mask as torch does (compiled, gcc) or with the uncompiled ``create_block_mask`` put in
that global (``_compile`` is False by default, torch/nn/attention/flex_attention.py:1846): the same
``_create_cp_block_mask`` and the same mask rewrite either way, only the compilation differs.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@torch.no_grad()
def flex_cp_compare(env, group, seq_len: int = 512, n_head: int = 2, head_dim: int = 16, compile_mask: bool = False,
                    seed: int = 0) -> dict:
    """One causal FlexAttention forward under torch's context parallelism on ``env.world_size`` CPU
    ranks, against one process; rank 0's dict holds every rank's figures. ``group``: a gloo group of every rank (the
    tensors stay on the CPU even where the default group is NCCL)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _create_default_load_balancer
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE, create_block_mask, flex_attention

    n = env.world_size
    if seq_len % (n * _DEFAULT_SPARSE_BLOCK_SIZE):
        raise ValueError(f"seq_len={seq_len}: torch's _create_cp_block_mask needs T divisible by world size x "
                         f"{_DEFAULT_SPARSE_BLOCK_SIZE} = {n * _DEFAULT_SPARSE_BLOCK_SIZE} (_attention.py:1224-1228)")
    mesh = DeviceMesh.from_group(group, "cpu")
    g = torch.Generator().manual_seed(seed)
    shape = (1, n_head, seq_len, head_dim)
    q, k, v = (torch.randn(shape, generator=g) for _ in range(3))

    # one process: the whole sequence
    mask_one = create_block_mask(causal, 1, n_head, seq_len, seq_len, device="cpu")
    out_one = flex_attention(q, k, v, block_mask=mask_one)

    # N ranks: torch's load balancer, sharding, mask and hook
    balancer = _create_default_load_balancer(seq_len, n, "cpu")
    if not compile_mask:
        cp_attention._compiled_create_block_mask = create_block_mask        # the global read at :1231
    start = time.perf_counter()
    mask_cp = cp_attention._create_cp_block_mask(causal, 1, n_head, seq_len, seq_len, mesh)
    mask_seconds = time.perf_counter() - start
    local = cp_attention._context_parallel_buffers(mesh, [q, k, v], [2, 2, 2], balancer)

    class Attention(torch.nn.Module):
        def forward(self, query, key, value, block_mask=None):
            return flex_attention(query, key, value, block_mask=block_mask)

    module = parallelize_module(Attention(), mesh, cp_attention._ContextParallel(
        seq_dim=2, attention_type=cp_attention._ContextParallel.AttentionType.FLEX))
    out = module(*local, block_mask=mask_cp)
    want = cp_attention._context_parallel_buffers(mesh, [out_one], [2], balancer)[0]
    diffs = {"out": (out - want).abs().max().item()}
    positions = cp_attention._context_parallel_buffers(mesh, [torch.arange(seq_len).view(1, -1)], [1], balancer)[0]
    row = {"rank": env.rank, "max_abs_diff": diffs, "mask_seconds": mask_seconds,
           "positions": [int(positions[0, 0]), int(positions[0, -1])]}
    rows = [None] * n
    dist.all_gather_object(rows, row, group=group)
    return {"seq_len": seq_len, "n_head": n_head, "head_dim": head_dim, "compile_mask": compile_mask,
            "load_balancer": type(balancer).__name__ if balancer else None, "ranks": rows}
