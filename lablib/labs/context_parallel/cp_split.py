"""Lab 12's exercise 3 checked by its properties: a zigzag split is a partition of the positions into 2N chunks in
sequence order (sizes as ``torch.tensor_split`` makes them: non-increasing, differing by at most one), rank r
holding chunk r then chunk 2N - 1 - r; and the idle-fraction formula against the work counted on a long sequence."""

from __future__ import annotations

import torch

from lablib import checks
from lablib.labs.context_parallel.cp_model import causal_pairs_per_step, contiguous_positions, idle_fraction, position_runs


def check_zigzag(split, seq_len: int, world_size: int) -> None:
    where = f"zigzag_positions({seq_len}, {world_size})"
    checks.check_true(isinstance(split, (list, tuple)) and len(split) == world_size,
                      f"{where} must return a list of {world_size} tensors, got {type(split).__name__}")
    for r, p in enumerate(split):
        checks.check_true(isinstance(p, torch.Tensor) and p.dtype == torch.int64 and p.dim() == 1,
                          f"{where}[{r}] must be a 1-D int64 tensor of positions")
    every = torch.cat(list(split)).sort().values
    checks.check_true(torch.equal(every, torch.arange(seq_len)), f"{where}: every position must be held by exactly one "
                      f"rank", hint="the chunks together must cover 0..T-1 once")
    # the contract's properties, read off the split itself (no expected positions are built here): each rank holds
    # two runs of consecutive positions (rank N - 1's chunks N - 1 and N touch: one run, cut in two, the longer
    # first, as neighbouring chunks of a tensor_split are), the 2N runs in sequence order have the sizes
    # torch.tensor_split gives (non-increasing, differing by at most one), and rank r holds run r then run 2N - 1 - r
    n_chunks = 2 * world_size
    held = [position_runs(p) for p in split]
    for r, runs in enumerate(held):
        if len(runs) == 1 and r == world_size - 1 and runs[0][1] >= 2:
            held[r] = [(runs[0][0], (runs[0][1] + 1) // 2), (runs[0][0] + (runs[0][1] + 1) // 2, runs[0][1] // 2)]
        checks.check_true(len(held[r]) == 2, f"{where}: rank {r} holds {len(runs)} run(s) of consecutive positions "
                          f"(start, length) {runs}; the contract gives each rank two chunks",
                          hint="torch.tensor_split(torch.arange(T), 2N) makes 2N chunks; rank r takes chunk r and "
                               "chunk 2N - 1 - r")
    chunks = sorted(run for runs in held for run in runs)
    sizes = [length for _, length in chunks]
    checks.check_true(len(sizes) == n_chunks and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True),
                      f"{where}: the chunks in sequence order have sizes {sizes}; the contract cuts {seq_len} positions "
                      f"into {n_chunks} chunks of sizes differing by at most one, the longer ones first",
                      hint="torch.tensor_split(x, 2N) always gives 2N chunks, the first T mod 2N one longer; "
                           "torch.chunk(x, 2N) can give fewer, and a remainder put in the last chunk is not it")
    for r, runs in enumerate(held):
        order = [chunks.index(run) for run in runs]
        checks.check_equal(order, [r, n_chunks - 1 - r], f"{where}: rank {r} holds chunks {order} (in sequence order, "
                           f"counted from 0), in that order", hint="rank r takes chunk r from the front, then chunk "
                                                                   "2N - 1 - r from the back")


def check_short(zigzag_positions, world_size: int) -> None:
    """Fewer than 2N positions: a ValueError naming the length; exactly 2N: a split like any other (one position a
    chunk), not an error."""
    try:
        shortest = zigzag_positions(2 * world_size, world_size)
    except ValueError as error:
        checks.check_true(False, f"zigzag_positions({2 * world_size}, {world_size}) raised {error!r}; {2 * world_size} "
                          f"positions are enough (one per chunk): only fewer than 2N is refused")
    check_zigzag(shortest, 2 * world_size, world_size)
    try:
        zigzag_positions(2 * world_size - 1, world_size)
    except ValueError as error:
        checks.check_true(str(2 * world_size - 1) in str(error), f"the error for seq_len={2 * world_size - 1} on "
                          f"{world_size} ranks must name the length; got {error}")
        return
    checks.check_true(False, f"zigzag_positions({2 * world_size - 1}, {world_size}) must raise a ValueError: some rank "
                      f"would hold an empty chunk")


def check_idle_formula(contiguous_idle_fraction, world_size: int, seq_len: int = 4096) -> None:
    """The formula against the idle fraction counted from the causal pairs of a long sequence (the diagonal blocks'
    b(b+1)/2 pairs make the count differ from the formula's half block by O(N/T))."""
    counted = idle_fraction(causal_pairs_per_step(contiguous_positions(seq_len, world_size)))
    got = contiguous_idle_fraction(world_size)
    checks.check_close(got, counted, f"contiguous_idle_fraction({world_size}) against the counted work at T = {seq_len}",
                       rtol=0, atol=2 * world_size / seq_len,
                       hint="step 0: every rank computes its diagonal block (half a block of work); steps 1..N-1: the "
                            "busiest rank computes a full block; rank r does r + 1/2 blocks in all")
