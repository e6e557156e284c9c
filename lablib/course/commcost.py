"""The latency-bandwidth (alpha-beta) cost model of communication: fitting it, and the numbers it needs.

A message of x bytes costs ``t = alpha + beta * x``: alpha is the fixed latency per message (seconds),
beta the time per byte (seconds/byte, 1/beta the bandwidth). An algorithm that takes s sequential steps
and moves x bytes per rank in total costs ``s * alpha + beta * x`` (Hockney, 1994; Thakur, Rabenseifner
and Gropp, "Optimization of Collective Communication Operations in MPICH", 2005).

Pure functions of numbers, testable without a process group. The traffic of one all-reduce is the
subject of lab 02's exercises, so it is not here.
"""

from __future__ import annotations

import math
from typing import Sequence

# Per-rank bandwidths used for the lab's "seed table" (bytes per second), each one way: the ring's B is what a
# rank sends while it receives as much (nccl-tests' bus bandwidth is the same per-direction figure). Nominal
# figures, the best case:
# - NVLink: 300 GB/s, the A100's NVLink 3 per direction (12 links x 25 GB/s each way; NVIDIA's "600 GB/s" adds
#   both directions). H100's NVLink 4: 450 GB/s each way (quoted as 900). NCCL measures ~230 GB/s on 8x A100.
# - PCIe: ~50 GB/s each way, between PCIe 4.0 x16 (32 GB/s each way) and PCIe 5.0 x16 (64 GB/s each way).
# - InfiniBand: 25 GB/s each way, one HDR 200 Gb/s NIC per GPU (NDR 400 Gb/s would be 50 GB/s).
INTERCONNECTS = {
    "NVLink": 300e9,
    "PCIe": 50e9,
    "InfiniBand": 25e9,
}

# Parameter counts of the models in the seed table. GPT-2 small is 124 M with its tied embedding counted once
# (the GPT-2 paper's "117M" is an older count of the same model). LLaMA-7B is 6.7 B (Touvron et al. 2023, Table 2;
# the released checkpoint holds 6,738 M): "7B" is its nominal name.
MODELS = {
    "GPT-2 small": 124e6,
    "GPT-2 large": 774e6,
    "LLaMA-7B": 6.74e9,
}


def alpha_beta_time(alpha_s: float, beta_s_per_byte: float, n_bytes: float, steps: int = 1) -> float:
    """Time of ``steps`` sequential messages that move ``n_bytes`` in total: steps * alpha + beta * n_bytes."""
    return steps * alpha_s + beta_s_per_byte * n_bytes


def fit_alpha_beta(n_bytes: Sequence[float], times_s: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of ``t = alpha + beta * x`` to measured (x, t) points; returns (alpha_s, beta_s_per_byte).

    The residuals are weighted by 1/t (relative error), so that a 1 KB point at 50 us counts as much as a
    64 MB point at 50 ms: plain least squares would fit the large messages only and could return a negative
    alpha. Solves the 2x2 normal equations of  sum_i ((alpha + beta x_i - t_i) / t_i)^2  in closed form.
    """
    if len(n_bytes) != len(times_s) or len(n_bytes) < 2:
        raise ValueError(f"need at least two (bytes, time) points of equal count, got {len(n_bytes)} sizes "
                         f"and {len(times_s)} times")
    if any(not (t > 0 and math.isfinite(t)) for t in times_s):
        raise ValueError(f"times must be positive and finite, got {list(times_s)}")
    # Rows (1/t_i, x_i/t_i) . (alpha, beta) ~= 1
    a = [1.0 / t for t in times_s]
    b = [x / t for x, t in zip(n_bytes, times_s)]
    saa, sab, sbb = sum(u * u for u in a), sum(u * v for u, v in zip(a, b)), sum(v * v for v in b)
    sa1, sb1 = sum(a), sum(b)
    det = saa * sbb - sab * sab
    if det <= 0 or abs(det) < 1e-12 * saa * sbb:
        raise ValueError("the points do not determine alpha and beta: give at least two different message sizes")
    alpha = (sa1 * sbb - sb1 * sab) / det
    beta = (saa * sb1 - sab * sa1) / det
    return alpha, beta


def crossover_bytes(alpha_s: float, beta_s_per_byte: float) -> float:
    """The message size at which latency and transfer cost the same for one message: alpha / beta bytes."""
    if not beta_s_per_byte > 0:
        raise ValueError(f"beta = {beta_s_per_byte!r} s/byte: a crossover needs a positive beta (a fit over sizes whose "
                         f"times did not grow with the message, latency-bound, gives none)")
    return alpha_s / beta_s_per_byte
