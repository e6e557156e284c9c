"""A rank whose gloo worker thread still needs the GIL when the rank ends (tests/test_teardown.py).

    torchrun --standalone --nproc-per-node 2 tests/steps/late_callback.py --ending plain|lablib --marker DIR

Rank 1 joins an all-reduce late, so rank 0's worker thread completes it - and runs its Python callback,
which needs the GIL - after rank 0's main thread has finished. ``plain`` ends like an ordinary script
(the interpreter finalizes); ``lablib`` ends through ``lablib.jobs.script.main`` (barrier, destroy, gc,
``processes.end_rank``). Each rank's atexit handler leaves a file in DIR: it runs only if the
interpreter finalized.
"""

from __future__ import annotations

import atexit
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist


def post_late_allreduce(rank: int, marker_dir: str) -> None:
    atexit.register(lambda: (Path(marker_dir) / f"finalized{rank}").touch())
    if rank == 1:
        time.sleep(1.0)
    t = torch.ones(16)
    dist.all_reduce(t, async_op=True).get_future().then(lambda fut: fut.value()[0] * 2)


@dataclass(frozen=True)
class Config:
    marker: str = "."


def train(env, config: Config) -> dict:
    post_late_allreduce(env.rank, config.marker)
    return {}


if __name__ == "__main__":
    ending, marker = sys.argv[sys.argv.index("--ending") + 1], sys.argv[sys.argv.index("--marker") + 1]
    if ending == "plain":
        dist.init_process_group("gloo")
        post_late_allreduce(dist.get_rank(), marker)
    else:
        from lablib.jobs import script
        script.main(Config, train, ["--marker", marker])
