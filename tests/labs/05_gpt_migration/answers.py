"""Wrong answers for lab 05 (tests/labkit.py: the lab's answer files)."""

_DDP_HEADER = '''%%writefile ddp_impl.py
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
'''

_WRAP = '''

def wrap_model(model, env):
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    return DDP(model, device_ids=device_ids)
'''
_LOADER = '''

def make_loader(dataset, batch_size, env, seed):
    sampler = DistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=seed,
                                 drop_last=True)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
'''
_EPOCH = '''

def start_epoch(loader, epoch):
    loader.sampler.set_epoch(epoch)
'''
_MEAN = '''

def mean_across_ranks(value, env):
    total = value.detach().clone().float()
    dist.all_reduce(total)
    return total.item() / env.world_size
'''

_FSDP_HEADER = '''%%writefile fsdp_impl.py
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_fsdp(model, mesh=None):
'''

_ACC = '''%%writefile accelerate_impl.py
import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader


def train_loop(model, optimizer, train_set, val_set, config, on_step):
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed))
    loader = DataLoader(train_set, batch_size=config.batch_size // accelerator.num_processes, shuffle=True,
                        drop_last=True)
    val_loader = DataLoader(val_set, batch_size=config.val_batch_size // accelerator.num_processes)
    PREPARE
    curve, step = [], 0
    while step < config.steps:
        for x, y in loader:
            x, y = x.to(accelerator.device), y.to(accelerator.device)
            _, loss = model(x, y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            on_step(step, loss)
            if step % config.eval_every == 0 or step == config.steps:
                curve.append((step, evaluate(model, val_loader, accelerator)))
                accelerator.print(f"step {step}: val loss {curve[-1][1]:.4f}")
            if step == config.steps:
                break
    return curve


@torch.no_grad()
def evaluate(model, val_loader, accelerator):
    model.eval()
    losses = []
    for x, y in val_loader:
        x, y = x.to(accelerator.device), y.to(accelerator.device)
        logits, _ = model(x)
        per_sequence = F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(dim=1)
        losses.append(accelerator.gather_for_metrics(per_sequence))
    model.train()
    return torch.cat(losses).mean().item()
'''

_PREPARE_ALL = "model, optimizer, loader, val_loader = accelerator.prepare(model, optimizer, loader, val_loader)"

# A correct variant must keep full marks (tests/test_labs.py does not run these; they are documented here and
# checked by hand: a correct apply_fsdp keeps its points when exercise 1's answer is wrong, since exercise 2 is
# graded against lablib's single-process baseline, not against the student's DDP run).

WRONG_ANSWERS = {
    "ddp_parts": [
        ("a plain shuffled DataLoader instead of a DistributedSampler: every rank trains on the same data",
         _DDP_HEADER + _WRAP + '''

def make_loader(dataset, batch_size, env, seed):
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True,
                      generator=torch.Generator().manual_seed(seed))
''' + '''

def start_epoch(loader, epoch):
    pass
''' + _MEAN),
        ("forgets set_epoch: every epoch replays epoch 0's order", _DDP_HEADER + _WRAP + _LOADER + '''

def start_epoch(loader, epoch):
    pass
''' + _MEAN),
        ("all_reduce without dividing by the world size (sum, not mean)", _DDP_HEADER + _WRAP + _LOADER + _EPOCH + '''

def mean_across_ranks(value, env):
    total = value.detach().clone().float()
    dist.all_reduce(total)
    return total.item()
'''),
        ("reports rank 0's own value without any all_reduce", _DDP_HEADER + _WRAP + _LOADER + _EPOCH + '''

def mean_across_ranks(value, env):
    return value.item()
'''),
        ("forgets to wrap the model in DDP: gradients are never averaged, the ranks drift apart",
         _DDP_HEADER + '''

def wrap_model(model, env):
    return model
''' + _LOADER + _EPOCH + _MEAN),
        ("ignores the seed argument: every run shuffles with seed 0", _DDP_HEADER + _WRAP + '''

def make_loader(dataset, batch_size, env, seed):
    sampler = DistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank, shuffle=True, drop_last=True)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
''' + _EPOCH + _MEAN),
        ("returns the mean on rank 0 only (other ranks get their own value)", _DDP_HEADER + _WRAP + _LOADER + _EPOCH + '''

def mean_across_ranks(value, env):
    total = value.detach().clone().float()
    dist.reduce(total, dst=0)
    return total.item() / env.world_size if env.rank == 0 else value.item()
'''),
        ("all-reduces the caller's tensor in place (value.detach() shares its memory): the caller's value becomes the sum",
         _DDP_HEADER + _WRAP + _LOADER + _EPOCH + '''

def mean_across_ranks(value, env):
    total = value.detach()
    dist.all_reduce(total)
    return total.item() / env.world_size
'''),
        ("gives the sampler the rank within the node: ranks of the second node get the first node's shards",
         _DDP_HEADER + _WRAP + '''

def make_loader(dataset, batch_size, env, seed):
    sampler = DistributedSampler(dataset, num_replicas=env.world_size, rank=env.local_rank, shuffle=True, seed=seed,
                                 drop_last=True)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
''' + _EPOCH + _MEAN),
    ],
    "apply_fsdp": [
        ("only fully_shard at the root: the whole model is one unit, all-gathered at once", _FSDP_HEADER + '''
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model
'''),
        ("shards the blocks but forgets the root: embeddings and final LayerNorm stay replicated", _FSDP_HEADER + '''
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    return model
'''),
        ("ignores the mesh argument: fully_shard's default mesh over all ranks (wrong for HSDP or any sub-mesh)",
         _FSDP_HEADER + '''
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.h:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model
'''),
        ("passes the mesh to the root only: the blocks are sharded over the default mesh", _FSDP_HEADER + '''
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.h:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model
'''),
        ("no mixed-precision policy: computes in fp32", _FSDP_HEADER + '''
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
'''),
        ("reduces gradients in bf16 too", _FSDP_HEADER + '''
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for block in model.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model
'''),
        ("blocks reduce in bf16, only the root in fp32 (a root-only check would pass it)", _FSDP_HEADER + '''
    for block in model.h:
        fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16))
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    return model
'''),
    ],
    "accelerate_loop": [
        ("shuffles with an unseeded DataLoader: another data order than the baseline's (the loss moves by percents)",
         _ACC.replace("PREPARE", _PREPARE_ALL).replace(
             "Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed))",
             "Accelerator()")),
        ("seeds the DataLoader's generator instead of Accelerate's sampler: the loader draws its worker seed from it "
         "first, so the order is not the baseline's",
         _ACC.replace("PREPARE", _PREPARE_ALL).replace(
             "Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed))",
             "Accelerator()").replace("shuffle=True,", "shuffle=True, generator=torch.Generator().manual_seed(config.seed),")),
        ("prepares the model and optimizer but not the data loaders: every process trains on the same batches",
         _ACC.replace("PREPARE", "model, optimizer = accelerator.prepare(model, optimizer)")),
        ("prepares the data loaders but not the model: no DDP, the processes drift apart",
         _ACC.replace("PREPARE", "optimizer, loader, val_loader = accelerator.prepare(optimizer, loader, val_loader)")),
        ("validation loss on the process's own shard, without gather_for_metrics",
         _ACC.replace("PREPARE", _PREPARE_ALL).replace("accelerator.gather_for_metrics(per_sequence)", "per_sequence")),
        ("skips the evaluation of the last step (only every eval_every steps)",
         _ACC.replace("PREPARE", _PREPARE_ALL).replace("if step % config.eval_every == 0 or step == config.steps:",
                                                        "if step % config.eval_every == 0:")),
        ("per-process batch equal to the global batch: twice the samples per step",
         _ACC.replace("PREPARE", _PREPARE_ALL).replace("batch_size=config.batch_size // accelerator.num_processes",
                                                        "batch_size=config.batch_size")),
        # Issue 42's kinds (instructor/hidden_kinds.py): both kept full marks before the hidden three-step and
        # extreme-logits checks, since every visible check still holds (ranks equal, batches right, the last loss
        # equal to lablib's evaluation of the same weights at ordinary logits).
        ("never clears the gradients: from the second step on each step adds all earlier steps' gradients",
         _ACC.replace("PREPARE", _PREPARE_ALL).replace("            optimizer.zero_grad()\n", "")),
        ("validation loss as the log of a softmax: -inf where the softmax underflows, at logits far from zero",
         _ACC.replace("PREPARE", _PREPARE_ALL).replace(
             'F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(dim=1)',
             '-torch.log(torch.softmax(logits, dim=-1)).gather(-1, y.unsqueeze(-1)).squeeze(-1).mean(dim=1)')),
    ],
    "pick_strategy": [
        ("believes FSDP is always the better choice", 'pick = {"S1": "fsdp", "S2": "fsdp", "S3": "accelerate"}'),
        ("believes Accelerate shards a model that does not fit by itself", 'pick = {"S1": "ddp", "S2": "accelerate", "S3": "accelerate"}'),
    ],
}

CORRECT_VARIANTS = {
    "ddp_parts": [
        # The thread rehearsal before the real run replaces torch.distributed's module attributes; a name bound
        # before it is the real function, and the rehearsal must step aside rather than fail the answer.
        ("the all-reduce imported by name (from torch.distributed import all_reduce)",
         _DDP_HEADER + "from torch.distributed import all_reduce\n" + _WRAP + _LOADER + _EPOCH
         + _MEAN.replace("    dist.all_reduce(total)", "    all_reduce(total)")),
    ],
    "accelerate_loop": [
        ("gradients cleared before each forward with set_to_none=False, the loss as log_softmax + nll_loss",
         _ACC.replace("PREPARE", _PREPARE_ALL).replace("            optimizer.zero_grad()\n", "").replace(
             "            _, loss = model(x, y)\n", "            optimizer.zero_grad(set_to_none=False)\n            _, loss = model(x, y)\n").replace(
             'F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(dim=1)',
             'F.nll_loss(F.log_softmax(logits, dim=-1).transpose(1, 2), y, reduction="none").mean(dim=1)')),
    ],
}
