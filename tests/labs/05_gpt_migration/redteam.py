"""Lab 05 answers written by a red team that had read only the released notebook (no tests, no solution): those of
its wrong answers that kept full marks then (tests/labkit.py appends them to answers.py's lists)."""

# The training loop every evaluation answer below shares (the red team's text, verbatim).
_TRAIN_LOOP = '''def train_loop(model, optimizer, train_set, val_set, config, on_step):
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed))
    n = accelerator.num_processes
    train_loader = DataLoader(train_set, batch_size=config.batch_size // n, shuffle=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=config.val_batch_size // n, shuffle=False)
    model, optimizer, train_loader, val_loader = accelerator.prepare(model, optimizer, train_loader, val_loader)
    curve, step, epoch = [], 0, 0
    while step < config.steps:
        if hasattr(train_loader, "set_epoch"):
            train_loader.set_epoch(epoch)
        for x, y in train_loader:
            _, loss = model(x, y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            on_step(step, loss)
            if step % config.eval_every == 0 or step == config.steps:
                curve.append((step, _evaluate(model, val_loader, accelerator)))
                accelerator.print(f"step {step}: val loss {curve[-1][1]:.4f}")
            if step == config.steps:
                break
        epoch += 1
    return curve
'''

WRONG_ANSWERS = {
    "ddp_parts": [
        ("w7: drop_last=True on the DistributedSampler only: the DataLoader keeps an incomplete last batch",
         '''%%writefile ddp_impl.py
"""Exercise 1 of lab 05."""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def wrap_model(model, env):
    if env.device.type == "cuda":
        return DDP(model, device_ids=[env.device.index])
    return DDP(model)


def make_loader(dataset, batch_size, env, seed):
    # drop_last on the sampler only: the DataLoader keeps an incomplete last batch
    sampler = DistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank, seed=seed, drop_last=True)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def start_epoch(loader, epoch):
    loader.sampler.set_epoch(epoch)


def mean_across_ranks(value, env):
    t = value.detach().clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return (t / env.world_size).item()
'''),
    ],
    "apply_fsdp": [
        ("w6: shards only the modules that are isinstance(m, Block): another module in model.h[i] is left unsharded",
         '''%%writefile fsdp_impl.py
"""Exercise 2 of lab 05."""
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from lablib.course.models import Block


def apply_fsdp(model, mesh=None):
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for module in list(model.modules()):
        if isinstance(module, Block):
            fully_shard(module, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model
'''),
        ("w7: mesh=None replaced by init_device_mesh('cuda', ...): apply_fsdp(model) fails on a CPU process group",
         '''%%writefile fsdp_impl.py
"""Exercise 2 of lab 05."""
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


def apply_fsdp(model, mesh=None):
    if mesh is None:
        mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.h:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model
'''),
    ],
    "accelerate_loop": [
        ("w2: gathers one per-batch mean loss per forward with gather_for_metrics and averages the batch means (an uneven last batch weighs as much as a full one)",
         '''%%writefile accelerate_impl.py
"""Exercise 3 of lab 05."""
import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader


def _evaluate(model, val_loader, accelerator):
    model.eval()
    losses = []
    with torch.no_grad():
        for x, y in val_loader:
            _, loss = model(x, y)
            losses.append(accelerator.gather_for_metrics(loss.reshape(1)))
    model.train()
    return torch.cat(losses).double().mean().item()


''' + _TRAIN_LOOP),
        ("w4: each process averages its own share (gather_for_metrics called, its result thrown away) and the processes' means are averaged with accelerator.gather (Accelerate's padding counted)",
         '''%%writefile accelerate_impl.py
"""Exercise 3 of lab 05."""
import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader


def _evaluate(model, val_loader, accelerator):
    model.eval()
    losses = []
    with torch.no_grad():
        for x, y in val_loader:
            logits, _ = model(x)
            per_seq = F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(dim=1)
            accelerator.gather_for_metrics(per_seq)
            losses.append(per_seq)
    model.train()
    per_proc = torch.cat(losses).double().mean()
    return accelerator.gather(per_proc.reshape(1)).mean().item()


''' + _TRAIN_LOOP),
        ("w6: gathers the per-sequence losses with accelerator.gather, not gather_for_metrics (the sequences Accelerate repeats to pad an uneven last batch are counted)",
         '''%%writefile accelerate_impl.py
"""Exercise 3 of lab 05."""
import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader


def _evaluate(model, val_loader, accelerator):
    model.eval()
    losses = []
    with torch.no_grad():
        for x, y in val_loader:
            logits, _ = model(x)
            per_seq = F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(dim=1)
            losses.append(accelerator.gather(per_seq))
    model.train()
    return torch.cat(losses).double().mean().item()


''' + _TRAIN_LOOP),
        ("w7: collects the curve in a mutable default argument (train_loop(..., curve=[])): a second call in one process returns the first call's points too",
         '''%%writefile accelerate_impl.py
"""Exercise 3 of lab 05."""
import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader


def _evaluate(model, val_loader, accelerator):
    model.eval()
    losses = []
    with torch.no_grad():
        for x, y in val_loader:
            logits, _ = model(x)
            per_seq = F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(dim=1)
            losses.append(accelerator.gather_for_metrics(per_seq))
    model.train()
    return torch.cat(losses).double().mean().item()


def train_loop(model, optimizer, train_set, val_set, config, on_step, curve=[]):
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed))
    n = accelerator.num_processes
    train_loader = DataLoader(train_set, batch_size=config.batch_size // n, shuffle=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=config.val_batch_size // n, shuffle=False)
    model, optimizer, train_loader, val_loader = accelerator.prepare(model, optimizer, train_loader, val_loader)
    step, epoch = 0, 0
    while step < config.steps:
        if hasattr(train_loader, "set_epoch"):
            train_loader.set_epoch(epoch)
        for x, y in train_loader:
            _, loss = model(x, y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            on_step(step, loss)
            if step % config.eval_every == 0 or step == config.steps:
                curve.append((step, _evaluate(model, val_loader, accelerator)))
                accelerator.print(f"step {step}: val loss {curve[-1][1]:.4f}")
            if step == config.steps:
                break
        epoch += 1
    return curve
'''),
    ],
}
