"""Lab 08's 2-D step: the course GPT on a (data, tensor) = (2, 2) mesh of 4 ranks, FSDP2 across the data dimension
and tensor parallelism across the tensor dimension (``lablib.parallel.tensor_parallel.apply_2d``), against one process.

    torchrun --standalone --nproc-per-node 4 -m lablib.labs.tensor_parallel.run_tp_2d --steps 3 --out out.json

Each step's global batch is split over the data-parallel ranks (the two tensor-parallel ranks of a data rank get
the same rows); the loss of a step is the mean over the ranks of their local mean losses, the single process's
is the whole batch's. Collectives are counted twice: FSDP2's all-gathers and reduce-scatters where it calls
``torch.distributed`` (``lablib.measure.counting``), tensor parallelism's in ``CommDebugMode``.
"""

from __future__ import annotations

import copy
import itertools
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from lablib.measure import counting
from lablib.course import data
from lablib.jobs import script
from lablib.parallel import tensor_parallel
from lablib.probes.harness import sgd_step_, zero_grad_
from lablib.course.models import GPT, gpt_config
from lablib.jobs.distenv import gather_objects


@dataclass(frozen=True)
class Config:
    data_parallel: int = 2
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 32
    batch_size: int = 8          # the global batch, split over the data-parallel ranks
    steps: int = 3
    lr: float = 0.1
    seed: int = 0

    def validate(self) -> None:
        if self.data_parallel < 1 or self.batch_size % self.data_parallel:
            raise ValueError(f"batch_size={self.batch_size} must split evenly over data_parallel={self.data_parallel}")
        gpt_config(self)

    def validate_world(self, world_size: int) -> None:
        if world_size % self.data_parallel:
            raise ValueError(f"data_parallel={self.data_parallel} must divide the {world_size} ranks "
                             f"(mesh = data_parallel x world_size / data_parallel)")


def run(env, config: Config) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    tokenizer, train, _ = data.shakespeare_datasets(config.block_size)
    # Whole global batches on every rank (a loader for a world of one): the single process trains on them too.
    whole = data.global_batch_loader(train, config.batch_size, SimpleNamespace(rank=0, world_size=1), config.seed)
    batches = list(itertools.islice(whole, config.steps))
    torch.manual_seed(config.seed)
    single = GPT(gpt_config(config, tokenizer.vocab_size))
    dp, tp = config.data_parallel, env.world_size // config.data_parallel
    mesh = init_device_mesh(env.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    model = tensor_parallel.apply_2d(copy.deepcopy(single), mesh)
    dp_rank, share = mesh["dp"].get_local_rank(), config.batch_size // dp
    out = {"mesh": [dp, tp], "losses": {"single": [], "2d": []}, "comm": [],
           "bytes_per_rank": {"single": tensor_parallel.local_param_bytes(single),
                              "2d": tensor_parallel.local_param_bytes(model)}}
    for x, y in batches:
        zero_grad_(single.parameters())
        _, loss = single(x, y)
        loss.backward()
        sgd_step_(single.parameters(), config.lr)
        out["losses"]["single"].append(loss.item())
        zero_grad_(model.parameters())
        log, mode = counting.CollectiveLog(), CommDebugMode()
        with counting.count_collectives(log), mode:
            _, local = model(x[dp_rank * share:(dp_rank + 1) * share], y[dp_rank * share:(dp_rank + 1) * share])
            local.backward()
        sgd_step_(model.parameters(), config.lr)
        losses = gather_objects(local.item(), env)
        out["losses"]["2d"].append(sum(losses) / len(losses))
        out["comm"].append({"fsdp": dict(Counter(c.name for c in log.calls if not c.functional)),   # not DTensor's
                            "comm_debug_mode": {str(op).rsplit(".", 1)[-1]: n for op, n in mode.get_comm_counts().items()}})
    return out


def main() -> None:
    script.main(Config, run)


if __name__ == "__main__":
    main()
