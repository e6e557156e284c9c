"""What ``dcp.async_save`` saves the training loop (lab 10): the time the caller waits against the checkpoint's total.

``dcp.save`` blocks until every byte is on storage. ``dcp.async_save`` returns once the state is *staged*
(copied to CPU memory; on a GPU, the device-to-host copy) and writes it from a background thread; the returned
future completes when the files and ``.metadata`` are written. The job waits only for the staging, so the
Young/Daly ``C`` (the time the job stops for a checkpoint) shrinks, while the total stays as long (or longer: the
write now shares the machine with training). Measured here in one process (DCP without a process group), on a
state of plain CPU tensors, in rounds: each round saves with ``dcp.save``, with ``dcp.async_save`` and with
``dcp.save`` again (the same code timed against itself: the noise floor of the ratios), the order reversed every
other round, after one warm-up round left out (a process's first DCP save also imports and plans).
"""

from __future__ import annotations

import tempfile
import time
import warnings

import torch

from lablib.measure import timing


def measure_save(state_mb: float = 64.0, rounds: int = 6) -> dict:
    """Per round, seconds of ``dcp.save`` (``blocking``), of ``dcp.async_save`` until it returns (``async_blocking``)
    and until its future completes (``async_total``), and of a second ``dcp.save`` (``blocking_again``), for a state
    of ``state_mb`` MB of float32 tensors of 4 MB; each a list over the rounds and its median (``median_<name>``).
    ``ratios``: per round async_blocking / blocking and async_total / blocking, each with ``timing.noise_verdict``
    against ``floor`` (blocking_again / blocking)."""
    import torch.distributed.checkpoint as dcp

    if state_mb <= 0 or rounds < 1:
        raise ValueError(f"state_mb={state_mb} must be > 0 and rounds={rounds} >= 1")
    state = {f"w{i}": torch.randn(1024, 1024) for i in range(max(1, round(state_mb / 4)))}

    def blocking() -> dict:
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            dcp.save(state, checkpoint_id=d)
            return {"seconds": time.perf_counter() - t0}

    def asynchronous() -> dict:
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            future = dcp.async_save(state, checkpoint_id=d)
            t1 = time.perf_counter()
            future.result()
            return {"returned": t1 - t0, "completed": time.perf_counter() - t0}

    arms = [("blocking", blocking), ("async", asynchronous), ("blocking_again", blocking)]
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")    # "torch.distributed is ... uninitialized ... a single process": meant
        for r in range(rounds + 1):        # round 0 warms up
            row = {}
            for name, arm in (arms if r % 2 == 0 else arms[::-1]):
                row[name] = arm()
            if r > 0:
                rows.append({"blocking": row["blocking"]["seconds"], "async_blocking": row["async"]["returned"],
                             "async_total": row["async"]["completed"], "blocking_again": row["blocking_again"]["seconds"]})
    out = {"state_mb": 4.0 * len(state), "rounds": rounds}
    for key in ("blocking", "async_blocking", "async_total", "blocking_again"):
        out[key] = [row[key] for row in rows]
        out[f"median_{key}"] = timing.median(out[key])
    floor = [row["blocking_again"] / row["blocking"] for row in rows]
    out["floor"] = floor
    out["ratios"] = {}
    for key in ("async_blocking", "async_total"):
        ratios = [row[key] / row["blocking"] for row in rows]
        out["ratios"][key] = {"per_round": ratios, "median": timing.median(ratios),
                              "verdict": timing.noise_verdict(ratios, floor, comparisons=2)}
    return out
