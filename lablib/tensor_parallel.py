"""Tensor parallelism applied to the course GPT from outside (``lablib.models`` knows nothing of it).

Two ways, one model:

- ``apply_by_hand(model, group, mlp_cls, attention_cls)``: every block's ``mlp`` and ``attn`` replaced by
  tensor-parallel modules built from them (lab 08's exercises: the students' classes);
- ``apply_dtensor(model, mesh, vocab_parallel)``: PyTorch's DTensor API, ``parallelize_module`` with
  ``ColwiseParallel`` / ``RowwiseParallel`` (https://pytorch.org/docs/stable/distributed.tensor.parallel.html),
  the plan torchtitan applies to Llama; with ``vocab_parallel`` the token embedding is split by vocabulary rows
  and ``lm_head`` (tied to it) by vocabulary columns, so the logits stay sharded for ``loss_parallel``; with
  ``sequence_parallel`` the norms and the residual stream are split along the sequence (``SequenceParallel``).

The fused ``c_attn`` (q, k and v rows one after the other) cannot be split in contiguous blocks as it is: rank
r's block would hold q rows only. ``apply_dtensor`` first permutes its rows (``qkv_rows_by_rank``) so that block r
holds rank r's heads' q, k and v rows, and sets each attention's ``n_head`` to its heads per rank, as torchtitan
does. ``full_gradients`` undoes both to compare with the single process.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from lablib.memory import local_tensor
from lablib.tp_probes import gathered

# parameter name suffix -> layout of its shards in apply_by_hand's modules (see tp_probes.LAYOUTS)
BY_HAND_LAYOUT = {"mlp.c_fc.weight": "col", "mlp.c_fc.bias": "col", "mlp.c_proj.weight": "row",
                  "attn.c_attn.weight": "qkv", "attn.c_attn.bias": "qkv", "attn.c_proj.weight": "row"}


def check_divides(model: nn.Module, tp: int) -> None:
    """Validate the degrees up front: heads and MLP width must split evenly over tp ranks."""
    c = model.config
    if c.n_head % tp or (4 * c.n_embd) % tp:
        raise ValueError(f"tensor-parallel size {tp} must divide n_head={c.n_head} and the MLP width "
                         f"4 * n_embd={4 * c.n_embd}; choose tp among the divisors of {c.n_head}")


def apply_by_hand(model: nn.Module, group, mlp_cls, attention_cls, tp: int) -> nn.Module:
    """Replace each block's MLP and attention with ``mlp_cls(block.mlp, group)`` and
    ``attention_cls(block.attn, group)``; embeddings, norms and lm_head stay whole on every rank."""
    check_divides(model, tp)
    for block in model.h:
        block.mlp = mlp_cls(block.mlp, group)
        block.attn = attention_cls(block.attn, group)
    return model


def qkv_rows_by_rank(n_embd: int, tp: int) -> torch.Tensor:
    """Row order of c_attn that puts rank r's heads' q, k and v rows in the r-th contiguous block:
    [q_0, k_0, v_0, q_1, k_1, v_1, ...], each of n_embd / tp rows."""
    width = n_embd // tp
    return torch.cat([torch.arange(width) + part * n_embd + r * width for r in range(tp) for part in range(3)])


def apply_dtensor(model: nn.Module, mesh, vocab_parallel: bool = False, sequence_parallel: bool = False) -> nn.Module:
    """parallelize_module over a 1-D mesh: c_attn and c_fc column-wise, the two c_proj row-wise.

    vocab_parallel: also the vocabulary (embedding rows; lm_head's columns, its logits left sharded for
    ``loss_parallel``). sequence_parallel (Korthikanti et al., 2022, arXiv:2205.05198): between the blocks' matrix
    products the residual stream and the norms hold T/N positions per rank; each c_proj reduce-scatters along the
    sequence instead of all-reducing, and an all-gather brings the whole sequence back before c_attn and c_fc.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    if vocab_parallel and sequence_parallel:
        raise ValueError("apply_dtensor: choose vocab_parallel or sequence_parallel (the lab shows them apart)")
    tp = mesh.size()
    check_divides(model, tp)
    order = qkv_rows_by_rank(model.config.n_embd, tp)
    gather_sequence = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                         use_local_output=True)
    for i, block in enumerate(model.h):
        attn = block.attn
        with torch.no_grad():
            attn.c_attn.weight.copy_(attn.c_attn.weight[order])
            if attn.c_attn.bias is not None:
                attn.c_attn.bias.copy_(attn.c_attn.bias[order])
        attn.n_head //= tp                     # heads on this rank (the forward reads sizes from c_attn)
        between = Shard(1) if sequence_parallel else Replicate()   # the residual stream's layout
        plan = {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(output_layouts=between),
                "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel(output_layouts=between)}
        if sequence_parallel:
            plan.update({"ln_1": SequenceParallel(), "ln_2": SequenceParallel(),
                         "attn": gather_sequence, "mlp": gather_sequence})
            if i == 0:                         # the embeddings' whole sequence -> this rank's T/N positions
                plan[""] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                              use_local_output=True)
        parallelize_module(block, mesh, plan)
    if sequence_parallel:                      # lm_head (tied to wte) stays whole: it gets the whole sequence
        parallelize_module(model, mesh, {"ln_f": SequenceParallel(), "lm_head": gather_sequence})
    if vocab_parallel:
        tied = model.lm_head.weight is model.wte.weight
        parallelize_module(model, mesh, {
            "wte": RowwiseParallel(input_layouts=Replicate()),          # rows = tokens; output all-reduced
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})  # logits by vocab
        if tied:                               # both are split by vocabulary rows (Shard(0)): one tensor again
            model.lm_head.weight = model.wte.weight
    return model


def local_param_bytes(model: nn.Module) -> int:
    """Parameter bytes this rank holds (a DTensor by its shard; a tied weight once)."""
    return sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in model.parameters())


def full_gradients(model: nn.Module, group=None, tp: int = 1) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient, as the single-process model names and orders it: DTensor gradients
    gathered (``full_tensor``), apply_by_hand's shards gathered by BY_HAND_LAYOUT, c_attn's rows put back."""
    out = {}
    for name, p in model.named_parameters():
        grad = torch.zeros_like(local_tensor(p)) if p.grad is None else p.grad
        if hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
            if ".attn.c_attn." in name:
                restored = torch.empty_like(grad)
                restored[qkv_rows_by_rank(model.config.n_embd, tp)] = grad
                grad = restored
        else:
            how = next((h for suffix, h in BY_HAND_LAYOUT.items() if name.endswith(suffix)), "replicated")
            grad = gathered(grad, how, group, tp)
        out[name] = grad
    return out


def apply_2d(model: nn.Module, mesh) -> nn.Module:
    """A (dp, tp) mesh: tensor parallelism inside each group of mesh["tp"] ranks (``apply_dtensor``), then FSDP2's
    ``fully_shard`` across mesh["dp"], each block a unit and the rest in the root's, in torchtitan's order (tensor
    parallel first, so FSDP2 shards the DTensors tensor parallelism made)."""
    from torch.distributed.fsdp import fully_shard

    apply_dtensor(model, mesh["tp"])
    for unit in model.h:
        fully_shard(unit, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])
