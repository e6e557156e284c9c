"""The rows of lab 11's table that are built from the students' earlier labs, and the stand-ins for missing ones.

The students' files (``%%writefile`` cells of labs 06, 07 and 08) are looked up beside this lab's folder
(``labs_dir``, the folder holding ``06_ddp_from_scratch/`` ...). A file that is missing, or still holds the released
stubs, is replaced by a stand-in built on PyTorch, never on the earlier lab's answer (students install lablib):

- lab 06's ``DDPIndividualParameters`` / ``DDPBucketed``: PyTorch's own DDP given lab 06's constructor and
  ``finish_gradient_synchronization`` (lab 06's contract, PyTorch's algorithm; DDP's gradients are already averaged
  when its backward returns, so the method has nothing left to do), configured as the class it stands for:
  ``TorchDDPIndividualStandIn`` one bucket per parameter (one all-reduce per parameter, as
  ``DDPIndividualParameters`` issues), ``TorchDDPStandIn`` the bucket size lab 11 gives ``DDPBucketed``;
- lab 07's ``ShardedOptimizer(params, optimizer_cls, **hyper)``: PyTorch's ``ZeroRedundancyOptimizer``;
- lab 08's ``TensorParallelMLP`` / ``TensorParallelAttention``: the row runs ``DTensorTP`` (``parallelize_module``).

Each row says where its pieces came from (``source``), so the table shows what is yours and what stands in.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from lablib.jobs.exercise import unwritten
from lablib.parallel import tensor_parallel as tp_lib
from lablib.labs.strategy_benchmark.strategies import Strategy, merge_qkv

LAB06, LAB07, LAB08 = "06_ddp_from_scratch", "07_zero_from_scratch", "08_tensor_parallel"


class TorchDDPStandIn(DDP):
    """Stand-in for lab 06's classes: PyTorch's DDP behind their constructor, ``cls(module, bucket_size_mb=None)``.

    DDP broadcasts rank 0's parameters and buffers when it is built and all-reduces its buckets (averaged) inside
    the backward; its reducer's ``finalize_backward`` (torch/csrc/distributed/c10d/reducer.hpp) has waited for them
    when ``backward()`` returns, so lab 06's ``finish_gradient_synchronization`` has nothing left to do.
    ``gradient_as_bucket_view``: the gradients are the buckets (no second copy), as in the ``torch_ddp`` row."""

    def __init__(self, module: nn.Module, bucket_size_mb: float | None = None):
        if bucket_size_mb is not None and not bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb={bucket_size_mb} must be positive")
        super().__init__(module, bucket_cap_mb=bucket_size_mb, gradient_as_bucket_view=True)

    def finish_gradient_synchronization(self):
        """Lab 06's contract; DDP's backward has already finished the all-reduces."""


class TorchDDPIndividualStandIn(TorchDDPStandIn):
    """Stand-in for lab 06's ``DDPIndividualParameters(module)``: DDP with a bucket cap of one byte, so every
    bucket closes after its first parameter: one all-reduce per parameter per step, launched as its gradient is
    ready, like lab 06's class. DDP puts every parameter in one bucket for the first step unless it looks for
    unused parameters (torch/nn/parallel/distributed.py:152-155) and rebuilds the buckets with the cap after it,
    so the per-parameter all-reduces start at the second step (the harness counts the last)."""

    ONE_BYTE_MB = 2.0 ** -20

    def __init__(self, module: nn.Module):
        super().__init__(module, bucket_size_mb=self.ONE_BYTE_MB)


def sharded_optimizer_standin(params, optimizer_cls, **hyper):
    """Stand-in for lab 07's ``ShardedOptimizer``: PyTorch's ZeRO-1."""
    return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_cls, **hyper)


def _usable(path: Path) -> bool:
    return path.is_file() and not unwritten(path)


def lab_modules(labs_dir: str, standins: bool = False, bucket_size_mb: float = 0.05
                ) -> tuple[SimpleNamespace, dict[str, str]]:
    """The classes the rows need, each the student's where its file is written (unless ``standins``), else a
    stand-in; and for each piece a line saying which it is (and which lab writes the missing file)."""
    from lablib.jobs.exercise import load_fresh as load_impl
    from lablib.parallel.ddp_buckets import load_bucketed_impl

    root = Path(labs_dir).expanduser().resolve()
    found, source = {}, {}

    def take(key, lab, file, names, load, standin, standin_text):
        path = root / lab / file
        if not standins and _usable(path):
            module = load(str(path)) if load is load_bucketed_impl else load(str(path), names)
            found[key] = getattr(module, names[0])
            source[key] = f"yours ({lab}/{file})"
        else:
            found[key] = standin
            why = ("not used: the grading run" if standins else "missing" if not path.is_file()
                   else "still the released stubs")
            source[key] = f"stand-in: {standin_text} ({lab}/{file} {why}: lab {lab[:2]} writes it)"

    take("individual", LAB06, "ddp_individual_impl.py", ("DDPIndividualParameters",), load_impl,
         TorchDDPIndividualStandIn, "PyTorch's DDP, one bucket per parameter (bucket_cap_mb = 1 B)")
    take("bucketed", LAB06, "ddp_bucketed_impl.py", ("DDPBucketed",), load_bucketed_impl,
         TorchDDPStandIn, f"PyTorch's DDP, bucket_cap_mb={bucket_size_mb:g} (the size DDPBucketed gets here)")
    take("sharded_optimizer", LAB07, "zero1_impl.py", ("ShardedOptimizer",), load_impl, sharded_optimizer_standin,
         "ZeroRedundancyOptimizer")
    mlp, attn = root / LAB08 / "tp_mlp_impl.py", root / LAB08 / "tp_attention_impl.py"
    if not standins and _usable(mlp) and _usable(attn) and _usable(root / LAB08 / "tp_comm_impl.py"):
        found["tp"] = (load_impl(str(mlp), ("TensorParallelMLP",)).TensorParallelMLP,
                       load_impl(str(attn), ("TensorParallelAttention",)).TensorParallelAttention)
        source["tp"] = f"yours ({LAB08}/tp_mlp_impl.py, tp_attention_impl.py)"
    else:
        found["tp"] = None
        source["tp"] = f"stand-in: DTensor parallelize_module ({LAB08}/tp_*_impl.py missing or stubs: lab 08 writes them)"
    return SimpleNamespace(**found), source


class ByHandTP(Strategy):
    """Lab 08's tensor-parallel GPT: every block's MLP and attention replaced by the student's modules over all
    ranks (``tensor_parallel.apply_by_hand``); embeddings, norms and the head whole on every rank. Where each shard
    sits in the full weight is found once, from the initial weights (lab 08's layout: the MLP's contiguous blocks,
    the attention's rows found by value), and ``full_weights`` puts the trained shards back there."""

    name = "yours_tp"

    def __init__(self, env, mlp_cls, attention_cls):
        super().__init__(env)
        self.mlp_cls, self.attention_cls = mlp_cls, attention_cls

    def data_parallel(self):
        return 0, 1

    def wrap_model(self, model):
        model = model.to(self.env.device)
        initial = {name: p.detach().clone() for name, p in model.named_parameters()}
        tp = self.env.world_size
        tp_lib.apply_by_hand(model, dist.group.WORLD, self.mlp_cls, self.attention_cls, tp)
        self.places = {name: tp_lib._by_hand_index(name, p, model, initial, dist.group.WORLD, tp)
                       for name, p in model.named_parameters()}
        self.sizes = {name: initial[name].shape for name in initial}
        return model

    def full_weights(self, model):
        out = {}
        for name, p in model.named_parameters():
            place = self.places.get(name)
            if place is None:
                out[name] = p.detach()
            else:
                dim, index = place
                out[name] = tp_lib.assembled(p.detach(), index, dim, self.sizes[name][dim], dist.group.WORLD,
                                             self.env.world_size)
        return out


class DTensorTP(Strategy):
    """Tensor parallelism over all ranks with PyTorch's DTensor plan (``tensor_parallel.apply_dtensor``): the
    stand-in for lab 08's modules."""

    name = "dtensor_tp"

    def data_parallel(self):
        return 0, 1

    def wrap_model(self, model):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(self.env.device.type, (self.env.world_size,))
        return tp_lib.apply_dtensor(model.to(self.env.device), mesh)

    def full_weights(self, model):
        return merge_qkv({name: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                          for name, p in model.named_parameters()})


class DeepSpeedZeRO(Strategy):
    """DeepSpeed's ZeRO stage 1, 2 or 3 (Rajbhandari et al., 2020; the source chapter's ``ds_config`` route), fp32,
    around the loop's own optimizer (``zero_allow_untested_optimizer``: SGD is not one of DeepSpeed's). Optional:
    ``launchers/deepspeed`` installs it (requirements-deepspeed.txt); on a machine without CUDA the row sets
    ``DS_ACCELERATOR=cpu`` unless it is set (its shared-memory op is built with ninja and a C++ compiler the first time). ``engine.step()`` steps and clears the gradients;
    the loop's optimizer is a thin handle on it.

    ``gradient_clipping: 0.0``: DeepSpeed clips the gradients' global norm to 1.0 when the config says nothing
    (deepspeed 0.19.8, runtime/constants.py:203 ``GRADIENT_CLIPPING_DEFAULT = 1.0``, applied in
    runtime/zero/stage_1_and_2.py:3199-3208 and stage3.py:2982-2986; the default is version-specific), which the
    other rows do not do. The course GPT's first gradient has norm ~3.5, so a config without the key steps by 0.29
    of the unclipped step lr g and misses the weight check by ~3 orders of magnitude; with it, the three stages end
    where PyTorch's DDP does (1.5e-8 from one process after the harness's 3 steps, the ranks bit-identical)."""

    def __init__(self, env, stage: int):
        super().__init__(env)
        self.stage, self.name = stage, f"deepspeed_zero{stage}"

    def ds_config(self) -> dict:
        """The ``ds_config``: ZeRO at this stage, fp32 (no fp16/bf16 section), no clipping (see the docstring)."""
        return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": self.stage}, "zero_allow_untested_optimizer": True,
                "gradient_clipping": 0.0}

    def wrap_optimizer(self, model, optimizer_cls, **hyper):
        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")   # read when deepspeed is first imported
        import deepspeed

        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer_cls(model.parameters(), **hyper),
                                                    config=self.ds_config())
        return _EngineStep(self.engine)

    def forward_backward(self, model, x, y):
        _, loss = self.engine(*self.local_batch(x, y))
        self.engine.backward(loss)
        return loss.detach()

    def full_weights(self, model):
        import deepspeed

        params = list(model.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=self.stage == 3):
            return {name: p.detach().clone() for name, p in model.named_parameters()}


class _EngineStep:
    """The loop's ``opt.zero_grad()`` / ``opt.step()`` on a DeepSpeed engine (whose step also clears the gradients)."""

    def __init__(self, engine):
        self.engine = engine

    @property
    def state(self):
        """DeepSpeed's ZeRO optimizer's state (its inner optimizer's, per flat fp32 partition): the storage count's."""
        return self.engine.optimizer.state

    def zero_grad(self):
        pass

    def step(self):
        self.engine.step()
