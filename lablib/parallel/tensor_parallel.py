"""Tensor parallelism applied to the course GPT from outside (``lablib.course.models`` knows nothing of it).

Two ways, one model:

- ``apply_by_hand(model, group, mlp_cls, attention_cls)``: every block's ``mlp`` and ``attn`` replaced by
  tensor-parallel modules built from them (lab 08's exercises: the students' classes);
- ``apply_dtensor(model, mesh, vocab_parallel)``: PyTorch's DTensor API, ``parallelize_module`` with
  ``ColwiseParallel`` / ``RowwiseParallel`` (https://pytorch.org/docs/stable/distributed.tensor.parallel.html),
  the plan torchtitan applies to Llama; with ``vocab_parallel`` the token embedding is split by vocabulary rows
  and ``lm_head`` (tied to it) by vocabulary columns, so the logits stay sharded for ``loss_parallel``; with
  ``sequence_parallel`` the norms and the residual stream are split along the sequence (``SequenceParallel``).

The fused ``c_attn`` (q, k and v rows one after the other) cannot be split in contiguous blocks as it is: rank
r's block would hold q rows only. ``apply_dtensor`` first replaces it by ``SeparateQKV``, three ``nn.Linear`` q, k
and v (torchtitan's Llama has separate wq, wk and wv), whose contiguous row blocks are whole heads, and sets each
attention's ``n_head`` to its heads per rank, as torchtitan does. ``full_gradients`` puts q, k and v back together
to compare with the single process.

Shards and where they sit in the full tensor: ``contiguous_index`` (a column- or row-parallel layer's block),
``index_by_value`` (rows found in the full tensor by their values: any layout of copied rows), ``assembled`` (the
full tensor from every rank's shard and index).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from lablib.measure.memory import local_tensor

# parameter name suffix -> (dimension split, how the shard's place is found) in apply_by_hand's modules: lab 08's
# contract fixes the MLP's blocks (exercise 2); the attention's rows and columns are found by value (exercise 3
# leaves their order to the student), in the full weight of the single-process model.
BY_HAND_LAYOUT = {"mlp.c_fc.weight": (0, "contiguous"), "mlp.c_fc.bias": (0, "contiguous"),
                  "mlp.c_proj.weight": (1, "contiguous"), "attn.c_attn.weight": (0, "value"),
                  "attn.c_attn.bias": (0, "value"), "attn.c_proj.weight": (1, "value")}


def check_divides(model: nn.Module, tp: int) -> None:
    """Validate the degrees up front: heads and MLP width must split evenly over tp ranks."""
    c = model.config
    if c.n_head % tp or (4 * c.n_embd) % tp:
        raise ValueError(f"tensor-parallel size {tp} must divide n_head={c.n_head} and the MLP width "
                         f"4 * n_embd={4 * c.n_embd}; choose tp among the divisors of {c.n_head}")


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 1) -> int:
    """The vocabulary padded up to a multiple of ``multiple * tp`` rows (Megatron-LM pads to 128 x tp, its
    ``--make-vocab-size-divisible-by``), so that every rank holds as many embedding rows and logits columns; the
    padded tokens never occur in the data. Unpadded, DTensor's Shard(0) splits like torch.chunk: 65 rows over 2
    ranks are 33 and 32."""
    unit = multiple * tp
    return -(-vocab_size // unit) * unit


def apply_by_hand(model: nn.Module, group, mlp_cls, attention_cls, tp: int) -> nn.Module:
    """Replace each block's MLP and attention with ``mlp_cls(block.mlp, group)`` and
    ``attention_cls(block.attn, group)``; embeddings, norms and lm_head stay whole on every rank."""
    check_divides(model, tp)
    for block in model.h:
        block.mlp = mlp_cls(block.mlp, group)
        block.attn = attention_cls(block.attn, group)
    return model


# --- shards and their place in the full tensor --------------------------------------------------------------------

def contiguous_index(size: int, rank: int, tp: int) -> torch.Tensor:
    """Rank's block of ``size`` features split over tp ranks: [rank * size / tp, (rank + 1) * size / tp)."""
    width = size // tp
    return torch.arange(rank * width, (rank + 1) * width)


def index_by_value(shard: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """For each row of ``shard`` (k, ...), the index of the row of ``full`` (K, ...) equal to it bit for bit (a copy
    of random weights: one match), or -1 where there is none. Rows of shard a transpose away give columns."""
    shard, full = shard.detach().flatten(1), full.detach().flatten(1).to(shard.dtype)
    if shard.shape[1] != full.shape[1]:
        return torch.full((shard.shape[0],), -1, dtype=torch.long)
    equal = (shard[:, None, :] == full[None, :, :]).all(-1)        # (k, K)
    return torch.where(equal.any(1), equal.int().argmax(1), -1)


def assembled(shard: torch.Tensor, index: torch.Tensor, dim: int, size: int, group, tp: int) -> torch.Tensor:
    """The full tensor (``size`` along ``dim``) from every rank's shard, each placed at its own ``index`` along
    dim (shards and indices all-gathered over group). A place no rank fills, or an index of -1, is inf."""
    shard, index = shard.detach().contiguous(), index.to(device=shard.device)
    if tp > 1:
        shards, indices = [torch.empty_like(shard) for _ in range(tp)], [torch.empty_like(index) for _ in range(tp)]
        dist.all_gather(shards, shard, group=group)
        dist.all_gather(indices, index, group=group)
        shard, index = torch.cat(shards, dim), torch.cat(indices)
    shape = list(shard.shape)
    shape[dim] = size
    out = torch.full(shape, float("inf"), dtype=shard.dtype, device=shard.device)
    known = index >= 0
    out.index_copy_(dim, index[known], shard.index_select(dim, known.nonzero().flatten()))
    return out


# --- DTensor -------------------------------------------------------------------------------------------------------

def _linear_from(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.detach().clone())
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().clone())
    return linear


class SeparateQKV(nn.Module):
    """A fused c_attn (n_embd -> [q | k | v]) as three nn.Linear ``q``, ``k``, ``v`` of n_embd rows each, with the
    same output: the attention's forward is unchanged, and ColwiseParallel's contiguous row blocks of each part
    are whole heads (a head is head_size consecutive rows of q, of k and of v)."""

    def __init__(self, c_attn: nn.Linear):
        super().__init__()
        n_embd = c_attn.in_features
        biases = c_attn.bias.split(n_embd) if c_attn.bias is not None else (None,) * 3
        self.q, self.k, self.v = (_linear_from(w, b) for w, b in zip(c_attn.weight.split(n_embd), biases))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)    # (B, T, 3 * n_embd / tp)


def apply_dtensor(model: nn.Module, mesh, vocab_parallel: bool = False, sequence_parallel: bool = False,
                  local_input: bool = False) -> nn.Module:
    """parallelize_module over a 1-D mesh: q, k, v (``SeparateQKV``) and c_fc column-wise, the two c_proj row-wise.

    vocab_parallel: also the vocabulary (embedding rows; lm_head's columns, its logits left sharded for
    ``loss_parallel``). sequence_parallel (Korthikanti et al., 2022, arXiv:2205.05198): between the blocks' matrix
    products the residual stream and the norms hold T/N positions per rank; each c_proj reduce-scatters along the
    sequence instead of all-reducing, and an all-gather brings the whole sequence back before c_attn and c_fc.

    local_input (sequence_parallel only): the attention's and the MLP's gathered input handed on as a plain tensor
    (``PrepareModuleInput(..., use_local_output=True)``) instead of a DTensor (the default, torchtitan's plan).
    The plain tensor forgets that it came from Shard(1): the column-parallel layer re-declares it Replicate
    (``DTensor.from_local``), whose backward makes its Partial gradient Replicate, an all-reduce, and the
    all-gather's backward then keeps this rank's T/N positions of it. Kept as a DTensor, the gradient goes from
    Partial straight to Shard(1): a reduce-scatter, half the bytes. The lab runs both to show it. Sources (torch
    2.13): torch/distributed/tensor/parallel/style.py:90, 106-112 (ColwiseParallel's input declared Replicate) and
    522-544 (PrepareModuleInput); torch/distributed/tensor/_api.py:239-287 (_FromTorchTensor.backward: Partial to
    the declared Replicate); torch/distributed/tensor/_redistribute.py:1953-1967 (Redistribute.backward: back to
    the forward's input placement).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    if vocab_parallel and sequence_parallel:
        raise ValueError("apply_dtensor: choose vocab_parallel or sequence_parallel (the lab shows them apart)")
    if local_input and not sequence_parallel:
        raise ValueError("apply_dtensor: local_input=True changes the sequence-parallel plan only; "
                         "pass sequence_parallel=True with it")
    tp = mesh.size()
    check_divides(model, tp)
    if vocab_parallel and model.config.vocab_size % tp:
        raise ValueError(f"vocab_parallel: vocab_size={model.config.vocab_size} rows do not split evenly over {tp} ranks; "
                         f"build the model with padded_vocab_size(vocab_size, {tp}) = "
                         f"{padded_vocab_size(model.config.vocab_size, tp)} rows (the padded tokens never occur)")
    gather_sequence = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                         use_local_output=local_input)
    # q, k and v read one input DTensor (use_local_output=False): autograd adds their three partial input
    # gradients before it is made whole, one all-reduce (three ColwiseParallel on a plain tensor would make three).
    one_input = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                   use_local_output=False)
    for i, block in enumerate(model.h):
        block.attn.c_attn = SeparateQKV(block.attn.c_attn)
        block.attn.n_head //= tp               # heads on this rank (the forward reads sizes from c_attn)
        between = Shard(1) if sequence_parallel else Replicate()   # the residual stream's layout
        plan = {"attn.c_attn": one_input, "attn.c_attn.q": ColwiseParallel(), "attn.c_attn.k": ColwiseParallel(),
                "attn.c_attn.v": ColwiseParallel(), "attn.c_proj": RowwiseParallel(output_layouts=between),
                "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel(output_layouts=between)}
        if sequence_parallel:
            plan.update({"ln_1": SequenceParallel(), "ln_2": SequenceParallel(),
                         "attn": gather_sequence, "mlp": gather_sequence})
            if i == 0:                         # the embeddings' whole sequence -> this rank's T/N positions
                plan[""] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                              use_local_output=True)
        parallelize_module(block, mesh, plan)
    if sequence_parallel:                      # lm_head (tied to wte) stays whole: it gets the whole sequence
        # as a plain tensor (its weight is one: DTensor refuses mixed operands); its input gradient is then whole
        # on every rank, and the all-gather's backward keeps this rank's positions of it, sending nothing.
        whole_sequence = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                            use_local_output=True)
        parallelize_module(model, mesh, {"ln_f": SequenceParallel(), "lm_head": whole_sequence})
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


def _by_hand_index(name: str, p: torch.Tensor, model: nn.Module, full: dict, group, tp: int):
    """(dim, index) of apply_by_hand's shard ``name`` in the full tensor, or None for a whole one."""
    suffix = next((s for s in BY_HAND_LAYOUT if name.endswith(s)), None)
    if suffix is None:
        return None
    dim, how = BY_HAND_LAYOUT[suffix]
    if how == "contiguous":
        return dim, contiguous_index(full[name].shape[dim], dist.get_rank(group) if tp > 1 else 0, tp)
    if dim == 1:                               # c_proj's columns: found among the full weight's columns
        return dim, index_by_value(p.T, full[name].T)
    # c_attn's rows, found with their biases (a row and its bias move together)
    prefix = name.rsplit(".", 1)[0]
    params = dict(model.named_parameters())
    mine, whole = params[f"{prefix}.weight"], full[f"{prefix}.weight"]
    if f"{prefix}.bias" in params:
        mine = torch.cat([mine.detach(), params[f"{prefix}.bias"].detach()[:, None]], 1)
        whole = torch.cat([whole, full[f"{prefix}.bias"][:, None]], 1)
    return dim, index_by_value(mine, whole)


def full_gradients(model: nn.Module, group=None, tp: int = 1,
                   full: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient, as the single-process model names and orders it: DTensor gradients
    gathered (``full_tensor``), SeparateQKV's q, k and v put back into one c_attn; apply_by_hand's shards placed
    by BY_HAND_LAYOUT, which needs ``full``: the single-process model's parameters as they were when the shards
    were copied (its attention's rows are found there by value). A shard row found nowhere leaves inf."""
    out: dict[str, torch.Tensor | list] = {}
    for name, p in model.named_parameters():
        grad = torch.zeros_like(local_tensor(p)) if p.grad is None else p.grad
        if hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        elif full is not None and (placed := _by_hand_index(name, p, model, full, group, tp)) is not None:
            dim, index = placed
            grad = assembled(grad, index, dim, full[name].shape[dim], group, tp)
        head, sep, tail = name.rpartition(".c_attn.")
        if sep and tail[:2] in ("q.", "k.", "v."):        # named_parameters gives q, then k, then v
            out.setdefault(f"{head}.c_attn.{tail[2:]}", []).append(grad)
        else:
            out[name] = grad
    return {name: torch.cat(g) if isinstance(g, list) else g for name, g in out.items()}


def apply_2d(model: nn.Module, mesh) -> nn.Module:
    """A (dp, tp) mesh: tensor parallelism inside each group of mesh["tp"] ranks (``apply_dtensor``), then FSDP2's
    ``fully_shard`` across mesh["dp"], each block a unit and the rest in the root's, in torchtitan's order (tensor
    parallel first, so FSDP2 shards the DTensors tensor parallelism made)."""
    from torch.distributed.fsdp import fully_shard

    apply_dtensor(model, mesh["tp"])
    for unit in model.h:
        fully_shard(unit, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])
