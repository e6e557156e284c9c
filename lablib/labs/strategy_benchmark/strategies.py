"""One training loop, every parallelism behind one interface (lab 11).

A strategy is what a training loop has to ask of a parallelism, and no more (torchtitan's ``apply_*`` functions
applied to a plain model, seen from the loop):

    strategy = TorchDDP(env)
    model = strategy.wrap_model(GPT(config))                      # DDP, FSDP2, tensor or pipeline parallel
    opt = strategy.wrap_optimizer(model, torch.optim.SGD, lr=0.05, momentum=0.9)
    for x, y in batches:                                          # the same global batch on every rank
        opt.zero_grad()
        strategy.forward_backward(model, x, y)                    # this rank's share of it
        strategy.sync_gradients(model)                            # what must finish between backward and step
        opt.step()
    weights = strategy.full_weights(model)                        # the whole model, as one process names it

``full_weights`` is what makes a sharded strategy checkable: every rank gets every parameter whole (a DTensor's
``full_tensor()``, pipeline stages gathered), so its weights can be compared with one process's, element by element.
``held_tensors`` says what this rank holds, for the storage count (``lablib.measure.memory``).

PyTorch's own strategies are here; the students' (lab 06's DDP classes, lab 07's ShardedOptimizer behind this
interface) are lab 11's exercise, and ``lablib.labs.strategy_benchmark.rows`` puts them, lab 08's tensor-parallel
modules and the stand-ins for missing files in the table.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from lablib.measure.memory import local_tensor, optimizer_state_tensors


class Strategy:
    """The interface, and what most strategies share: data parallel over every rank, nothing to do after the
    backward, the model's own parameters whole. A subclass overrides where it differs."""

    name = "single"

    def __init__(self, env):
        self.env = env

    # --- data: the same global batch everywhere, each data-parallel rank its own rows ---------------------------
    def data_parallel(self) -> tuple[int, int]:
        """(this rank's data-parallel index, the data-parallel size)."""
        return self.env.rank, self.env.world_size

    def local_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows r*b .. (r+1)*b of the global batch (B, T), b = B / data-parallel size."""
        r, n = self.data_parallel()
        if x.shape[0] % n:
            raise ValueError(f"a global batch of {x.shape[0]} sequences does not split over {n} data-parallel ranks")
        b = x.shape[0] // n
        return x[r * b:(r + 1) * b].to(self.env.device), y[r * b:(r + 1) * b].to(self.env.device)

    # --- the interface ------------------------------------------------------------------------------------------
    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model.to(self.env.device)

    def wrap_optimizer(self, model: nn.Module, optimizer_cls, **hyper) -> torch.optim.Optimizer:
        return optimizer_cls(model.parameters(), **hyper)

    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _, loss = model(*self.local_batch(x, y))
        loss.backward()
        return loss.detach()

    def sync_gradients(self, model: nn.Module) -> None:
        pass

    def full_weights(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in unwrap(model).named_parameters()}

    # --- what the rank holds ------------------------------------------------------------------------------------
    def held_tensors(self, model: nn.Module, optimizer) -> dict[str, list]:
        """This rank's tensors by kind (a DTensor by its local shard): parameters, gradients, optimizer state."""
        params = [local_tensor(p) for p in model.parameters()]
        return {"params": params, "grads": [local_tensor(p.grad) for p in model.parameters() if p.grad is not None],
                "optimizer": optimizer_state_tensors(optimizer), "buffers": list(model.buffers())}


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside a data-parallel wrapper (``.module``: DDP's, lab 06's classes)."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


class TorchDDP(Strategy):
    """PyTorch's DDP: gradients all-reduced in buckets during the backward; ``gradient_as_bucket_view`` makes the
    gradients the buckets, so the gradient storages counted are all DDP holds for them."""

    name = "torch_ddp"
    bucket_cap_mb = 25.0

    def wrap_model(self, model):
        return DDP(model.to(self.env.device), bucket_cap_mb=self.bucket_cap_mb, gradient_as_bucket_view=True)


class TorchDDPZeRO1(TorchDDP):
    """DDP + ``ZeroRedundancyOptimizer`` (ZeRO-1: each rank keeps the optimizer state of its share of the
    parameters, updates them, and broadcasts them: torch/distributed/optim/zero_redundancy_optimizer.py)."""

    name = "torch_ddp_zero1"

    def wrap_optimizer(self, model, optimizer_cls, **hyper):
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_cls, **hyper)


class SumNotMean(TorchDDP):
    """A negative control: DDP whose communication hook sums the gradients instead of averaging them (the
    mistake a hand-written all-reduce makes when it forgets the division by N). The check must fail it."""

    name = "control_sum_not_mean"

    def wrap_model(self, model):
        ddp = super().wrap_model(model)

        def summed(group, bucket):
            return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])
        ddp.register_comm_hook(None, summed)
        return ddp


class FSDP2(Strategy):
    """``fully_shard`` on every block, then on the root (embeddings, tied head, ln_f): ZeRO-3, each parameter a
    DTensor holding its Shard(0) rows; gathered for the forward and the backward, gradients reduce-scattered."""

    name = "fsdp2"

    def wrap_model(self, model):
        from torch.distributed.fsdp import fully_shard

        model = model.to(self.env.device)
        for block in model.h:
            fully_shard(block)
        return fully_shard(model)

    def full_weights(self, model):
        return {name: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                for name, p in model.named_parameters()}


def merge_qkv(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``SeparateQKV``'s q, k and v (``...c_attn.q.weight``) put back into one fused c_attn, in q, k, v order."""
    out: dict[str, torch.Tensor | list] = {}
    for name, w in weights.items():
        head, sep, tail = name.rpartition(".c_attn.")
        if sep and tail[:2] in ("q.", "k.", "v."):
            out.setdefault(f"{head}.c_attn.{tail[2:]}", []).append(w)   # named_parameters: q, then k, then v
        else:
            out[name] = w
    return {name: torch.cat(w) if isinstance(w, list) else w for name, w in out.items()}


class FSDP2TP(FSDP2):
    """A 2-D (dp, tp) mesh: DTensor tensor parallelism inside each group of ``tp`` ranks, FSDP2 across the dp
    groups (``lablib.parallel.tensor_parallel.apply_2d``, torchtitan's order). The ranks of one tp group see the
    same rows of the batch: the data-parallel index is the dp coordinate."""

    name = "fsdp2_x_tp"
    tp = 2

    def __init__(self, env):
        super().__init__(env)
        if env.world_size % self.tp:
            raise ValueError(f"fsdp2_x_tp needs a world size divisible by tp={self.tp}, got {env.world_size}")
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(env.device.type, (env.world_size // self.tp, self.tp),
                                     mesh_dim_names=("dp", "tp"))

    def data_parallel(self):
        return self.mesh["dp"].get_local_rank(), self.mesh["dp"].size()

    def wrap_model(self, model):
        from lablib.parallel.tensor_parallel import apply_2d

        return apply_2d(model.to(self.env.device), self.mesh)

    def full_weights(self, model):
        return merge_qkv(super().full_weights(model))


class TorchPipeline(Strategy):
    """``torch.distributed.pipelining``: the GPT cut into one stage per rank (``lablib.parallel.pipeline``), GPipe
    over ``micro_batches`` micro-batches of the whole batch (every rank sees all of it: no data parallelism). The
    tied embedding and head sit on the first and last stage: their two gradients are added after the backward
    (Megatron-LM's all-reduce between the two), so both copies take the same step."""

    name = "pipeline_gpipe"
    micro_batches = 2

    def data_parallel(self):
        return 0, 1

    def wrap_model(self, model):
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        from lablib.parallel.pipeline import gpt_stages, token_loss

        env = self.env
        self.tied_shape = model.wte.weight.shape          # (vocab_size, n_embd): wte on stage 0, its copy last
        self.stage_module = gpt_stages(model, env.world_size, loss=False)[env.rank].to(env.device)
        stage = PipelineStage(self.stage_module, env.rank, env.world_size, env.device)
        self.schedule = ScheduleGPipe(stage, self.micro_batches, loss_fn=token_loss)   # scale_grads: mean loss
        return self.stage_module

    def forward_backward(self, model, x, y):
        x, y = self.local_batch(x, y)
        losses = []
        if self.env.rank == 0:
            self.schedule.step(x)
        elif self.env.rank == self.env.world_size - 1:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        return torch.stack(losses).mean() if losses else torch.zeros(())

    def _tied(self, model):
        return model.wte.weight if model.first else model.lm_head.weight if model.last else None

    def sync_gradients(self, model):
        if self.env.world_size == 1:
            return
        tied = self._tied(model)
        grad = tied.grad if tied is not None else torch.zeros(self.tied_shape, device=self.env.device)
        dist.all_reduce(grad)        # first + last stage (zeros from the middle ones)

    def full_weights(self, model):
        mine = {name: p.detach().cpu() for name, p in self._renamed(model).items()}
        gathered = [None] * self.env.world_size
        dist.all_gather_object(gathered, mine)
        out = {}
        for stage in gathered:
            out.update(stage)
        # the last stage's copy of the tied weight is kept apart: the check compares it with wte too
        return {name: w.to(self.env.device) for name, w in out.items()}

    @staticmethod
    def _renamed(stage):
        """The stage's parameters under the whole model's names; the head's copy as ``lm_head_copy.weight``."""
        out = {}
        for name, p in stage.named_parameters():
            if name.startswith("h."):
                _, i, rest = name.split(".", 2)
                name = f"h.{stage.layers[int(i)]}.{rest}"
            out["lm_head_copy.weight" if name == "lm_head.weight" and not stage.first else name] = p
        return out
