"""What ``dcp.async_save`` saves the training loop (lab 10): the time the caller waits against the checkpoint's total.

``dcp.save`` blocks until every byte is on storage. ``dcp.async_save`` returns once the state is *staged*
(copied to CPU memory; on a GPU, the device-to-host copy) and writes it from a background thread; the returned
future completes when the files and ``.metadata`` are written. The job waits only for the staging, so the
Young/Daly ``C`` (the time the job stops for a checkpoint) shrinks, while the total stays as long (or longer: the
write now shares the machine with training). Measured here in one process (DCP without a process group), on a
state of plain CPU tensors.
"""

from __future__ import annotations

import statistics
import tempfile
import time
import warnings

import torch


def measure_save(state_mb: float = 64.0, repeats: int = 3) -> dict:
    """Median seconds of ``dcp.save`` (blocking) and of ``dcp.async_save`` (until it returns: ``async_blocking``;
    until its future completes: ``async_total``), for a state of ``state_mb`` MB of float32 tensors of 4 MB."""
    import torch.distributed.checkpoint as dcp

    if state_mb <= 0 or repeats < 1:
        raise ValueError(f"state_mb={state_mb} must be > 0 and repeats={repeats} >= 1")
    state = {f"w{i}": torch.randn(1024, 1024) for i in range(max(1, round(state_mb / 4)))}
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")    # "torch.distributed is ... uninitialized ... a single process": meant
        for _ in range(repeats):
            with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
                t0 = time.perf_counter()
                dcp.save(state, checkpoint_id=a)
                t1 = time.perf_counter()
                future = dcp.async_save(state, checkpoint_id=b)
                t2 = time.perf_counter()
                future.result()
                t3 = time.perf_counter()
            rows.append((t1 - t0, t2 - t1, t3 - t1))
    blocking, async_blocking, async_total = (statistics.median(col) for col in zip(*rows))
    return {"state_mb": 4.0 * len(state), "blocking": blocking, "async_blocking": async_blocking,
            "async_total": async_total}
