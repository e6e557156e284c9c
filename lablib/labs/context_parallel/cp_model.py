"""Lab 12's numbers: how a sequence is split over context-parallel ranks, what each rank computes and holds, and
what each scheme sends. Pure functions of numbers (and of position lists), printed next to what the runs measure.

- ``contiguous_positions(T, N)``: rank r holds positions [r T/N, (r+1) T/N) (``torch.tensor_split``: blocks differ by
  at most one position, the larger first). The load-balanced (zigzag) split is the lab's exercise, not here.
- ``causal_pairs_per_step(positions)``: the (query, key) pairs each rank's causal attention must compute at each
  step of a ring whose step s gives rank r the keys of rank (r - s) mod N: the work, counted exactly;
  ``idle_fraction(work)``: the share of the ranks' time spent waiting when every step lasts as long as its slowest
  rank (a ring step cannot finish before the slowest rank has passed its block on).
- ``ring_bytes_per_rank``, ``ulysses_bytes_per_rank``: the bytes each rank sends in one attention forward.
- ``unfused_attention`` and the activation formulas of section 1 (what autograd keeps for the backward).
"""

from __future__ import annotations

import math

import torch


def contiguous_positions(seq_len: int, world_size: int) -> list[torch.Tensor]:
    """The naive split: rank r holds one contiguous block of the sequence (sizes differ by at most 1)."""
    if world_size < 1 or seq_len < world_size:
        raise ValueError(f"seq_len={seq_len} positions cannot give each of {world_size} ranks at least one; "
                         f"use a longer sequence or fewer ranks")
    return list(torch.tensor_split(torch.arange(seq_len), world_size))


def position_runs(positions: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) of each run of consecutive positions, in the order held."""
    out = []
    for p in positions.tolist():
        if out and p == out[-1][0] + out[-1][1]:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((p, 1))
    return out


def causal_pairs_per_step(positions: list[torch.Tensor], causal: bool = True) -> list[list[int]]:
    """work[s][r]: the (query, key) pairs rank r computes at ring step s (keys of rank (r - s) mod N): with the
    causal mask, the pairs whose key position is <= the query position; without it, every pair."""
    n = len(positions)
    work = []
    for step in range(n):
        row = []
        for rank in range(n):
            q, k = positions[rank], positions[(rank - step) % n]
            row.append(int((k[None, :] <= q[:, None]).sum()) if causal else len(q) * len(k))
        work.append(row)
    return work


def idle_fraction(work: list[list[float]]) -> float:
    """Share of rank-time spent idle when each step lasts as long as its busiest rank: 1 - sum(work) / (N sum max)."""
    n = len(work[0])
    busiest = sum(max(step) for step in work)
    return 0.0 if busiest == 0 else 1.0 - sum(sum(step) for step in work) / (n * busiest)


def ring_bytes_per_rank(batch: int, n_head: int, seq_len: int, head_dim: int, world_size: int,
                        element_size: int) -> float:
    """Forward: each rank passes N - 1 K/V blocks of T/N positions on (K and V: 2 tensors)."""
    return 2 * (world_size - 1) * batch * n_head * seq_len / world_size * head_dim * element_size


def ulysses_bytes_per_rank(batch: int, n_head: int, seq_len: int, head_dim: int, world_size: int,
                           element_size: int) -> float:
    """Forward: 4 all-to-alls (q, k, v to heads; the output back) of B H (T/N) D values each; a rank keeps 1/N
    of each and sends (N - 1)/N of it. Ulysses gives each rank H/N whole heads, so N must divide H."""
    if world_size < 1 or n_head % world_size:
        raise ValueError(f"Ulysses over {world_size} ranks needs a head count divisible by {world_size}; got "
                         f"n_head={n_head} (each rank computes n_head / world_size whole heads)")
    return 4 * (world_size - 1) / world_size * batch * n_head * seq_len / world_size * head_dim * element_size


def unfused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                      q_positions: torch.Tensor | None = None, k_positions: torch.Tensor | None = None):
    """softmax(q k^T / sqrt(D), causal by global positions) @ v, written out as the textbook does (no fused kernel),
    so autograd keeps the (T_q, T_k) probabilities: what section 1 counts. q: (B, H, T_q, D), k, v: (B, H, T_k, D)."""
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        qp = torch.arange(q.shape[-2]) if q_positions is None else q_positions
        kp = torch.arange(k.shape[-2]) if k_positions is None else k_positions
        scores = scores.masked_fill(kp[None, :] > qp[:, None], -math.inf)
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def saved_bytes_formula(batch: int, n_head: int, q_len: int, k_len: int, head_dim: int, element_size: int,
                        causal: bool = True) -> int:
    """What autograd keeps for ``unfused_attention``'s backward: q, k and v (matmul's inputs), the probabilities
    (softmax's output, also the second matmul's input), and the (T_q, T_k) boolean mask (1 byte a pair)."""
    inputs = batch * n_head * (q_len + 2 * k_len) * head_dim * element_size
    probs = batch * n_head * q_len * k_len * element_size
    return inputs + probs + (q_len * k_len if causal else 0)
