"""Lab 12's exercise 3 checked by its properties: a zigzag split is a partition of the positions into 2N chunks in
sequence order (sizes as ``torch.tensor_split`` makes them: non-increasing, differing by at most one), rank r
holding chunk r then chunk 2N - 1 - r; and the idle-fraction formula against the work counted on a long sequence."""

from __future__ import annotations

import torch

from lablib import checks
from lablib.course.cp_model import causal_pairs_per_step, contiguous_positions, idle_fraction, position_runs


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
    # tensor_split's chunk sizes: the first T mod 2N chunks one position longer; chunk i starts where i-1 ends
    n_chunks = 2 * world_size
    sizes = [seq_len // n_chunks + (1 if i < seq_len % n_chunks else 0) for i in range(n_chunks)]
    starts = [sum(sizes[:i]) for i in range(n_chunks)]
    for r, p in enumerate(split):
        front, back = r, n_chunks - 1 - r
        want = [(starts[front], sizes[front]), (starts[back], sizes[back])]
        held = [tuple(run) for run in position_runs(p)]
        expected = torch.cat([torch.arange(a, a + n) for a, n in want])
        checks.check_true(torch.equal(p, expected), f"{where}: rank {r} holds the runs (start, length) {held}; the "
                          f"contract gives it chunk "
                          f"{front} = {want[0]} and chunk {back} = {want[1]}, in that order",
                          hint="torch.tensor_split(torch.arange(T), 2N) makes the chunks (the larger first); rank r "
                               "takes chunk r from the front and chunk r from the back (2N - 1 - r)")


def check_short(zigzag_positions, world_size: int) -> None:
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
