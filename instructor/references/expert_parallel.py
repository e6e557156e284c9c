"""Lab 13's answer-equal references: exercise 1's capacity rule and exercise 2's load-balancing loss.

Instructor-only: the hidden test cells import it (``from instructor.references import expert_parallel as ep_ref``);
students install ``lablib``, whose MoE layer takes these as functions and never computes them.

Written as a literal reading of the contract, by loops where the answer would vectorise, so it checks the
answer instead of repeating it.
"""

from __future__ import annotations

import math

import torch


def expert_capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float) -> int:
    """ceil(capacity_factor * k * num_tokens / num_experts), exact on the factor as written (1.1 * 100 / 10 is
    11.000000000000002 in floats); the hidden cases use factors exact in binary, so a float ceiling passes too."""
    from fractions import Fraction
    return math.ceil(Fraction(str(capacity_factor)) * k * num_tokens / num_experts)


def keep_within_capacity(expert_index: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Priority: every token's first choice in token order, then every token's second choice, and so on; each
    expert keeps its first ``capacity`` assignments in that order."""
    num_tokens, k = expert_index.shape
    keep = torch.zeros(num_tokens, k, dtype=torch.bool)
    taken = [0] * num_experts
    for j in range(k):
        for t in range(num_tokens):
            e = int(expert_index[t, j])
            if taken[e] < capacity:
                keep[t, j] = True
                taken[e] += 1
    return keep


def load_balancing_loss(router_probs: torch.Tensor, expert_index: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha * E * sum_i f_i P_i, f_i = assignments to i / (T k) (no gradient), P_i = mean router probability."""
    num_tokens, num_experts = router_probs.shape
    k = expert_index.shape[1]
    counts = [0] * num_experts
    for e in expert_index.flatten().tolist():
        counts[e] += 1
    f = torch.tensor(counts, dtype=router_probs.dtype) / (num_tokens * k)
    P = router_probs.sum(0) / num_tokens
    return alpha * num_experts * (f * P).sum()
