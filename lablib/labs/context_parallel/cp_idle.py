"""Lab 12's idle time, measured: a ring whose ranks compute the causal attention scores they must (skipping the
sub-blocks the mask removes entirely), pass their K/V block on, and time each step's compute and each wait.

Each rank's positions are cut at their runs of consecutive positions (the zigzag split's two chunks), and a
contiguous block into two halves, for the same granularity; a (query piece, key piece) pair is computed only if
some key is visible to some query, as FlashAttention-style kernels skip fully masked tiles. The work is real
(products with the block's keys and values, ``repeats`` times to make a step long next to the messages); it is not
the lab's answer (no softmax merge: this measures time, not values).
"""

from __future__ import annotations

import math
import time

import torch

from lablib.labs.context_parallel.cp_model import position_runs


def pieces(positions: torch.Tensor) -> list[torch.Tensor]:
    found = position_runs(positions)
    if len(found) == 1:                         # one contiguous block: two halves, like the zigzag's two chunks
        return list(torch.tensor_split(positions, 2))
    out, start = [], 0
    for _, length in found:
        out.append(positions[start:start + length])
        start += length
    return out


def tiles_per_step(positions: list[torch.Tensor]) -> list[list[int]]:
    """work[s][r]: the (query, key) pairs ``timed_ring`` computes at step s on rank r: every (query piece, key piece)
    tile that is not fully masked, in full (a diagonal tile costs its whole area, not its causal half). Its
    ``cp_model.idle_fraction`` is the idle that run predicts for itself: 2/7 for the contiguous split at N = 2
    (tiles 3 + 0 and 3 + 4 under steps of 3 and 4), against the (N-1)/(2N-1) = 1/3 of exact causal work."""
    n = len(positions)
    work = []
    for step in range(n):
        row = []
        for rank in range(n):
            keys = pieces(positions[(rank - step) % n])
            row.append(sum(len(qp) * len(kp) for qp in pieces(positions[rank]) for kp in keys
                           if not kp.min() > qp.max()))
        work.append(row)
    return work


def _tiles(q: torch.Tensor, mine: torch.Tensor, kv: torch.Tensor, key_positions: torch.Tensor, head_dim: int,
           repeats: int) -> int:
    """The work of one K/V block ``kv`` (2, B, H, len(key_positions), D) for the queries ``q`` at ``mine``: every
    tile not fully masked, ``repeats`` times; returns the visible (query, key) pairs."""
    pairs = 0
    key_pieces = pieces(key_positions)
    offsets = [0]
    for p in key_pieces:
        offsets.append(offsets[-1] + len(p))
    q_start = 0
    for qp in pieces(mine):
        q_block = q[:, :, q_start:q_start + len(qp)]
        q_start += len(qp)
        for kp, k0, k1 in zip(key_pieces, offsets, offsets[1:]):
            if kp.min() > qp.max():
                continue                                    # every key after every query: skipped
            visible = kp[None, :] <= qp[:, None]
            pairs += int(visible.sum())
            for _ in range(repeats):
                s = torch.matmul(q_block, kv[0, :, :, k0:k1].transpose(-2, -1)) / math.sqrt(head_dim)
                torch.matmul(torch.exp(s.masked_fill(~visible, -math.inf)), kv[1, :, :, k0:k1])
    return pairs


def timed_ring(comm, positions: list[torch.Tensor], batch: int, n_head: int, head_dim: int,
               repeats: int = 1, seed: int = 0) -> dict:
    """One causal ring pass on this rank: per step, seconds computing, seconds waiting for the next block, and the
    (query, key) pairs computed; ``span_s`` from the start to this rank's end. The block a rank waits for was sent
    when its left neighbour *started* the step (overlap), so a slow rank delays the others a step later and a fast
    rank finishes early: the idle time is the ranks' span against the slowest one's, 1 - sum(busy) / (N max span).
    comm: a CountingComm (or a thread rank's)."""
    n, rank = comm.world_size, comm.rank   # ring size and place
    g = torch.Generator().manual_seed(seed + rank)
    mine = positions[rank]
    q = torch.randn(batch, n_head, len(mine), head_dim, generator=g)
    kv = torch.randn(2, batch, n_head, len(mine), head_dim, generator=g)
    rows = {"compute_s": [], "cpu_s": [], "wait_s": [], "pairs": [], "largest_kv_bytes": 0}
    start = time.perf_counter()
    for step in range(n):
        src = (rank - step) % n
        held = kv.numel()
        if step < n - 1:
            incoming = torch.empty(2, batch, n_head, len(positions[(src - 1) % n]), head_dim)
            works = [comm.isend(kv, (rank + 1) % n), comm.irecv(incoming, (rank - 1) % n)]
            held += incoming.numel()                      # the block computed with and the one arriving
        rows["largest_kv_bytes"] = max(rows["largest_kv_bytes"], held * kv.element_size())
        t0, c0 = time.perf_counter(), time.thread_time()
        pairs = _tiles(q, mine, kv, positions[src], head_dim, repeats)
        t1, c1 = time.perf_counter(), time.thread_time()
        if step < n - 1:
            for w in works:
                w.wait()
            kv = incoming
        rows["compute_s"].append(t1 - t0)
        rows["cpu_s"].append(c1 - c0)                     # of it, seconds this thread ran on a core
        rows["wait_s"].append(time.perf_counter() - t1)
        rows["pairs"].append(pairs)
    rows["span_s"] = time.perf_counter() - start      # from the barrier the caller passed to this rank's last block
    return rows


def timed_gather(group, positions: list[torch.Tensor], batch: int, n_head: int, head_dim: int, repeats: int = 1,
                 seed: int = 0) -> dict:
    """The same causal work with K/V gathered first (Llama 3's context parallelism, torch's default ALL_GATHER
    rotate method): one all_gather of every rank's K/V block, exposed (nothing to compute until it lands), then every
    block's tiles. Blocks of unequal length are padded to the longest for the collective. Returns the gather's and
    the compute's seconds, the span, the bytes this rank sent (its block to each of the N-1 others, as the ring's
    N-1 hops send: the formula, not a count) and the K/V bytes it references at once: the N gathered blocks and its
    own padded input during the collective (N + 1 blocks; an in-place all-gather would hold N, all T positions)."""
    import torch.distributed as dist

    n, rank = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(seed + rank)
    mine = positions[rank]
    q = torch.randn(batch, n_head, len(mine), head_dim, generator=g)
    longest = max(len(p) for p in positions)
    padded = torch.zeros(2, batch, n_head, longest, head_dim)
    padded[..., :len(mine), :] = torch.randn(2, batch, n_head, len(mine), head_dim, generator=g)
    start = time.perf_counter()
    gathered = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(gathered, padded, group=group)
    t1 = time.perf_counter()
    held = (len(gathered) + 1) * padded.numel() * padded.element_size()
    del padded                                             # its copy is gathered[rank]
    pairs = sum(_tiles(q, mine, gathered[j][..., :len(positions[j]), :], positions[j], head_dim, repeats)
                for j in range(n))
    end = time.perf_counter()
    return {"gather_s": t1 - start, "compute_s": end - t1, "span_s": end - start, "pairs": pairs,
            "bytes_sent": (n - 1) * gathered[0].numel() * gathered[0].element_size(), "largest_kv_bytes": held}
