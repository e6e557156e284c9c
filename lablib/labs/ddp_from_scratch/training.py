"""Lab 06's training pieces shared by its measurements (``run_ddp_overlap``): the batches every variant trains on,
the course GPT each starts from, the students' classes or PyTorch's DDP around it, and one timed SGD step."""

from __future__ import annotations

import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from lablib.course import data
from lablib.course.models import GPT, gpt_config


class Batches:
    """Global batch ``step`` of Tiny Shakespeare (the same on every rank for a given step); rank r's slice."""

    def __init__(self, config, env):
        _, train, _ = data.shakespeare_datasets(config.block_size)
        self.train, self.config, self.env = train, config, env

    def rank_batch(self, step: int):
        b, n = self.config.batch_per_rank, self.env.world_size
        g = torch.Generator().manual_seed(self.config.seed * 10000 + step)
        idx = torch.randint(0, len(self.train), (b * n,), generator=g)[self.env.rank * b:(self.env.rank + 1) * b]
        x, y = zip(*(self.train[int(i)] for i in idx))
        return torch.stack(x).to(self.env.device), torch.stack(y).to(self.env.device)


def new_gpt(config, env) -> GPT:
    torch.manual_seed(config.seed)      # identical initial weights for every variant and rank
    return GPT(gpt_config(config)).to(env.device)


def wrap(variant: str, impl, model, cap_mb: float):
    if variant == "individual":
        return impl.DDPIndividualParameters(model)
    if variant == "bucketed":
        return impl.DDPBucketed(model, cap_mb)
    return DDP(model, bucket_cap_mb=cap_mb)


def finish(model) -> None:
    if not isinstance(model, DDP):
        model.finish_gradient_synchronization()


def train_step(model, optimizer, batch, phases: dict | None = None) -> float:
    """One SGD step; ``phases`` (if given) gets each phase's seconds appended: forward, backward (until
    ``backward()`` returned), both together (``compute_s``), finish (``finish_gradient_synchronization``), optimizer."""
    t0 = time.perf_counter()
    optimizer.zero_grad()            # set_to_none is the default
    loss = model(*batch)[1]
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    finish(model)
    t3 = time.perf_counter()
    optimizer.step()
    value = loss.item()
    if phases is not None:
        for name, seconds in zip(PHASES, (t1 - t0, t2 - t1, t2 - t0, t3 - t2, time.perf_counter() - t3)):
            phases[name].append(seconds)
    return value


PHASES = ("forward_s", "backward_s", "compute_s", "finish_s", "opt_s")
