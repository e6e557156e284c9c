"""Red-team answers for lab 08 (tensor parallelism): written by a reviewer who had read only the released notebook,
without the tests. Cell sources are full replacements of the answer cells. Used by 08_tensor_parallel.py.

Written against the release before the question of exercise 4 changed (it asked for the message size of one
forward, answer "a"; it now asks how what each rank sends changes from N = 4 to 8, answer "c"): their multiple-choice
answers are kept where they are still wrong ("b", "d", "A") and their correct ones re-keyed to "c" (``MC_CORRECT``);
their "c" is now the right answer and left out. Their attention answers copy the old solution's ``nn.Linear(...)``
without the full layer's dtype, which the contract now asks for (bf16 is a hidden case): ``ATT_CORRECT`` passes
the dtype (``_with_dtype``); the unmodified one is reported in the lab's note."""


def _mut(base, *pairs):
    """base with each (old, new) replaced; every old must occur in base (guards against silent no-op mutations)."""
    out = base
    for old, new in pairs:
        assert old in out, old
        out = out.replace(old, new)
    assert out != base
    return out


# ----------------------------------------------------------------------------------------------- exercise 1: f and g
FG = r'''%%writefile tp_comm_impl.py
"""Exercise 1 of lab 08: Megatron's f and g (this file is written by the notebook)."""
import torch
import torch.distributed as dist


class CopyToTensorParallel(torch.autograd.Function):
    """f: the identity forward; backward, the gradient summed over the tensor-parallel group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad_output):
        grad = grad_output.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: forward, the sum over the tensor-parallel group; the identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


def f(x, group):
    return CopyToTensorParallel.apply(x, group)


def g(x, group):
    return ReduceFromTensorParallel.apply(x, group)
'''

FG_WRONG = [
    ("g's forward all-reduces the caller's x in place and returns it: breaks 'without changing the caller's x in place'",
     _mut(FG, ("        y = x.contiguous().clone()\n        dist.all_reduce(y, group=group)\n        return y",
               "        dist.all_reduce(x, group=group)\n        return x"))),
    ("f's backward averages (all-reduce then / N) instead of summing: breaks 'the gradient summed over group'",
     _mut(FG, ("        dist.all_reduce(grad, group=ctx.group)\n        return grad, None",
               "        dist.all_reduce(grad, group=ctx.group)\n        grad /= dist.get_world_size(ctx.group)\n        return grad, None"))),
    ("both all-reduces use the default group (group= dropped): breaks 'always with the group you were given' (hidden 2 groups of 2)",
     _mut(FG, ("dist.all_reduce(grad, group=ctx.group)", "dist.all_reduce(grad)"),
              ("dist.all_reduce(y, group=group)", "dist.all_reduce(y)"))),
    ("skips the all-reduce when the group has one rank ('nothing to sum'): breaks 'Always call the all-reduce, also on one rank'",
     _mut(FG, ("        dist.all_reduce(grad, group=ctx.group)\n",
               "        if dist.get_world_size(ctx.group) > 1:\n            dist.all_reduce(grad, group=ctx.group)\n"),
              ("        dist.all_reduce(y, group=group)\n",
               "        if dist.get_world_size(group) > 1:\n            dist.all_reduce(y, group=group)\n"))),
    ("f and g swapped (f all-reduces forward, g backward): f must be identity forward / sum backward, g the reverse",
     r'''%%writefile tp_comm_impl.py
"""Exercise 1 of lab 08: Megatron's f and g (this file is written by the notebook)."""
import torch
import torch.distributed as dist


class CopyToTensorParallel(torch.autograd.Function):
    """f: the identity forward; backward, the gradient summed over the tensor-parallel group."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: forward, the sum over the tensor-parallel group; the identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad_output):
        grad = grad_output.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def f(x, group):
    return CopyToTensorParallel.apply(x, group)


def g(x, group):
    return ReduceFromTensorParallel.apply(x, group)
'''),
    ("g's backward also all-reduces the gradient ('the conjugate needs a sum too'): g's backward must be the identity; gradient N times too big",
     _mut(FG, ("    def backward(ctx, grad_output):\n        return grad_output, None",
               "    def backward(ctx, grad_output):\n        grad = grad_output.clone()\n        dist.all_reduce(grad, group=ctx.group)\n        return grad, None"),
              ("        y = x.contiguous().clone()\n", "        ctx.group = group\n        y = x.contiguous().clone()\n"))),
    ("backward returns only the gradient for x, not None for group: breaks 'one value per input of forward' (autograd raises)",
     _mut(FG, ("        return grad, None", "        return grad"), ("        return grad_output, None", "        return grad_output"))),
    ("uses functional collectives (funcol.all_reduce) instead of dist.all_reduce: the notebook says the check refuses them",
     _mut(FG, ("import torch.distributed as dist\n", "import torch.distributed as dist\nimport torch.distributed._functional_collectives as funcol\n"),
              ("        grad = grad_output.contiguous().clone()\n        dist.all_reduce(grad, group=ctx.group)\n",
               "        grad = funcol.all_reduce(grad_output.contiguous(), \"sum\", ctx.group)\n"),
              ("        y = x.contiguous().clone()\n        dist.all_reduce(y, group=group)\n",
               "        y = funcol.all_reduce(x.contiguous(), \"sum\", group)\n"))),
]

FG_CORRECT = [
    ("imports `from torch.distributed import all_reduce, ReduceOp`, explicit op=SUM, f returns a view_as(x); same semantics",
     r'''%%writefile tp_comm_impl.py
"""Exercise 1 of lab 08: Megatron's f and g (this file is written by the notebook)."""
import torch
from torch.distributed import all_reduce, ReduceOp


class CopyToTensorParallel(torch.autograd.Function):
    """f: the identity forward; backward, the gradient summed over the tensor-parallel group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_output):
        total = grad_output.clone(memory_format=torch.contiguous_format)
        all_reduce(total, op=ReduceOp.SUM, group=ctx.group)
        return total, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: forward, the sum over the tensor-parallel group; the identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        total = x.detach().clone(memory_format=torch.contiguous_format)
        all_reduce(total, op=ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output.clone(), None


def f(x, group):
    return CopyToTensorParallel.apply(x, group)


def g(x, group):
    return ReduceFromTensorParallel.apply(x, group)
'''),
    ("`import torch.distributed as c10d`, a shared helper `_summed` for both directions; same semantics",
     r'''%%writefile tp_comm_impl.py
"""Exercise 1 of lab 08: Megatron's f and g (this file is written by the notebook)."""
import torch
import torch.distributed as c10d


def _summed(t, group):
    """A new contiguous tensor: t summed over group (t itself is left untouched)."""
    out = torch.empty_like(t, memory_format=torch.contiguous_format)
    out.copy_(t)
    c10d.all_reduce(out, group=group)
    return out


class CopyToTensorParallel(torch.autograd.Function):
    """f: the identity forward; backward, the gradient summed over the tensor-parallel group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad_output):
        return _summed(grad_output, ctx.group), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: forward, the sum over the tensor-parallel group; the identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _summed(x, group)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


def f(x, group):
    return CopyToTensorParallel.apply(x, group)


def g(x, group):
    return ReduceFromTensorParallel.apply(x, group)
'''),
]

# ----------------------------------------------------------------------------------------------- exercise 2: the MLP
MLP = r'''%%writefile tp_mlp_impl.py
"""Exercise 2 of lab 08: column- and row-parallel linear layers and the MLP (this file is written by the notebook)."""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tp_comm_impl import f, g   # exercise 1


def my_slice(size, group):
    """This rank's contiguous share of ``size`` features: [r * size / N, (r + 1) * size / N)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if size % n:
        raise ValueError(f"{size} features do not split evenly over a tensor-parallel group of {n} ranks")
    return slice(r * size // n, (r + 1) * size // n)


class ColumnParallelLinear(nn.Module):
    """Y_r = X A_r + b_r: this rank's block of output features. Input: the whole x; output: (..., out / N)."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        self.group = group
        rows = my_slice(linear.out_features, group)
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach()[rows].clone())
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        return F.linear(f(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = sum_r X_r A_r + b: input (..., in / N), this rank's features; output: the whole y on every rank."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        self.group = group
        cols = my_slice(linear.in_features, group)
        self.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach().clone())
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        y = g(F.linear(x, self.weight), self.group)
        if self.bias is not None:
            y = y + self.bias
        return y


class TensorParallelMLP(nn.Module):
    """The course GPT's MLPBlock split over the group: c_fc column-parallel, GELU on each rank's own
    features, c_proj row-parallel. One all-reduce forward (g), one backward (f)."""

    def __init__(self, mlp, group):
        super().__init__()
        self.c_fc = ColumnParallelLinear(mlp.c_fc, group)
        self.c_proj = RowParallelLinear(mlp.c_proj, group)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))
'''

MLP_WRONG = [
    ("row-parallel bias added on every rank before g: the output gets Y + (N-1) b, breaks 'the bias added once'",
     _mut(MLP, ("        y = g(F.linear(x, self.weight), self.group)\n        if self.bias is not None:\n            y = y + self.bias\n        return y",
                "        return g(F.linear(x, self.weight, self.bias), self.group)"))),
    ("row-parallel bias stored as b / N on every rank and added before g: forward sum is right but the parameter is not "
     "'the whole bias' and its gradient is 1/N of the full one (gathered bias gradient and later steps wrong)",
     _mut(MLP, ("            self.bias = nn.Parameter(linear.bias.detach().clone())\n",
                "            self.bias = nn.Parameter(linear.bias.detach().clone() / dist.get_world_size(group))\n"),
               ("        y = g(F.linear(x, self.weight), self.group)\n        if self.bias is not None:\n            y = y + self.bias\n        return y",
                "        return g(F.linear(x, self.weight, self.bias), self.group)"))),
    ("strided split (rows r::N of c_fc, columns r::N of c_proj): the MLP's math is right, but the contract's contiguous "
     "blocks [r k/N, (r+1) k/N) are broken, so gathered shards/gradients are permuted",
     _mut(MLP, ("        rows = my_slice(linear.out_features, group)\n",
                "        rows = slice(dist.get_rank(group), None, dist.get_world_size(group))\n"),
               ("        cols = my_slice(linear.in_features, group)\n",
                "        cols = slice(dist.get_rank(group), None, dist.get_world_size(group))\n"))),
    ("column-parallel forward without f: the input's gradient is only this rank's partial term, breaks 'with f in front' "
     "(and the backward all-reduce count is 0)",
     _mut(MLP, ("        return F.linear(f(x, self.group), self.weight, self.bias)", "        return F.linear(x, self.weight, self.bias)"))),
    ("shards are views, not copies (`nn.Parameter(linear.weight[rows])`, no clone): the optimizer steps write into the "
     "full reference layer too, and the storages held are the full ones; breaks 'Copy the weights (.detach()[...].clone())'",
     _mut(MLP, ("nn.Parameter(linear.weight.detach()[rows].clone())", "nn.Parameter(linear.weight.detach()[rows])"),
               ("nn.Parameter(linear.bias.detach()[rows].clone())", "nn.Parameter(linear.bias.detach()[rows])"),
               ("nn.Parameter(linear.weight.detach()[:, cols].clone())", "nn.Parameter(linear.weight.detach()[:, cols])"),
               ("nn.Parameter(linear.bias.detach().clone())", "nn.Parameter(linear.bias.detach())"))),
    ("TensorParallelMLP keeps a reference to the full MLP (`self.full = mlp`) for convenience: breaks 'nothing else with "
     "parameters' and holds the full weights on every rank",
     _mut(MLP, ("        self.c_fc = ColumnParallelLinear(mlp.c_fc, group)\n",
                "        self.full = mlp   # kept for debugging\n        self.c_fc = ColumnParallelLinear(mlp.c_fc, group)\n"))),
    ("shards cut with torch.chunk (ceil-sized pieces) instead of my_slice: a feature count N does not divide is silently "
     "split unevenly instead of raising; breaks 'a size that N does not divide is an error'",
     _mut(MLP, ("        rows = my_slice(linear.out_features, group)\n        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())\n",
                "        n, r = dist.get_world_size(group), dist.get_rank(group)\n        self.weight = nn.Parameter(linear.weight.detach().chunk(n, dim=0)[r].clone())\n        rows = slice(r * -(-linear.out_features // n), (r + 1) * -(-linear.out_features // n))\n"),
               ("        cols = my_slice(linear.in_features, group)\n        self.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())\n",
                "        n, r = dist.get_world_size(group), dist.get_rank(group)\n        self.weight = nn.Parameter(linear.weight.detach().chunk(n, dim=1)[r].clone())\n"))),
    ("rank and size of the default group (dist.get_rank()) instead of the group's: with 2 groups of 2 on 4 ranks, ranks 2 "
     "and 3 take slices 2 and 3 of 4; breaks 'rank r is dist.get_rank(group) of N = dist.get_world_size(group)'",
     _mut(MLP, ("        rows = my_slice(linear.out_features, group)\n",
                "        n, r = dist.get_world_size(), dist.get_rank()\n        rows = slice(r * linear.out_features // n, (r + 1) * linear.out_features // n)\n"),
               ("        cols = my_slice(linear.in_features, group)\n",
                "        n, r = dist.get_world_size(), dist.get_rank()\n        cols = slice(r * linear.in_features // n, (r + 1) * linear.in_features // n)\n"))),
]

MLP_CORRECT = [
    ("one helper `_shard(t, dim, group)` with torch.tensor_split after a divisibility check, bias added via torch.add; "
     "contiguous blocks as required, bias once after g",
     r'''%%writefile tp_mlp_impl.py
"""Exercise 2 of lab 08: column- and row-parallel linear layers and the MLP (this file is written by the notebook)."""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tp_comm_impl import f, g   # exercise 1


def my_slice(size, group):
    """This rank's contiguous share of ``size`` features: [r * size / N, (r + 1) * size / N)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if size % n:
        raise ValueError(f"{size} features do not split evenly over a tensor-parallel group of {n} ranks")
    return slice(r * size // n, (r + 1) * size // n)


def _shard(t, dim, group):
    """This rank's contiguous block of t along dim, as a new parameter (or None)."""
    if t is None:
        return None
    n, r = dist.get_world_size(group), dist.get_rank(group)
    if t.shape[dim] % n:
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} does not divide by {n} ranks")
    return nn.Parameter(torch.tensor_split(t.detach(), n, dim=dim)[r].clone())


class ColumnParallelLinear(nn.Module):
    """Y_r = X A_r + b_r: this rank's block of output features. Input: the whole x; output: (..., out / N)."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        self.group = group
        self.weight = _shard(linear.weight, 0, group)
        self.bias = _shard(linear.bias, 0, group)

    def forward(self, x):
        x = f(x, self.group)
        out = torch.matmul(x, self.weight.t())
        return out if self.bias is None else torch.add(out, self.bias)


class RowParallelLinear(nn.Module):
    """Y = sum_r X_r A_r + b: input (..., in / N), this rank's features; output: the whole y on every rank."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        self.group = group
        self.weight = _shard(linear.weight, 1, group)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        partial = torch.matmul(x, self.weight.t())
        y = g(partial, self.group)
        return y if self.bias is None else torch.add(y, self.bias)


class TensorParallelMLP(nn.Module):
    """The course GPT's MLPBlock split over the group: c_fc column-parallel, GELU on each rank's own
    features, c_proj row-parallel. One all-reduce forward (g), one backward (f)."""

    def __init__(self, mlp, group):
        super().__init__()
        self.c_fc = ColumnParallelLinear(mlp.c_fc, group)
        self.c_proj = RowParallelLinear(mlp.c_proj, group)
        self.act = nn.GELU()

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))
'''),
]

# ----------------------------------------------------------------------------------------------- exercise 3: attention
ATT = r'''%%writefile tp_attention_impl.py
"""Exercise 3 of lab 08: causal self-attention with the heads split over the ranks (written by the notebook)."""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tp_comm_impl import f, g   # exercise 1


class TensorParallelAttention(nn.Module):
    """The course GPT's CausalSelfAttention with n_head / N whole heads on each rank.

    c_attn: an nn.Linear holding the q, k and v rows of this rank's whole heads (3 * n_head / N * head_size
    of them, in the order forward reads them); c_proj: an nn.Linear of the same heads' head_size * n_head / N
    input columns, whose bias is added once, after the all-reduce."""

    def __init__(self, attn, group):
        super().__init__()
        self.group = group
        n, r = dist.get_world_size(group), dist.get_rank(group)
        n_head = attn.n_head
        if n_head % n:
            raise ValueError(f"n_head={n_head} heads do not split over a tensor-parallel group of {n} ranks")
        n_embd = attn.c_attn.in_features
        w = n_embd // n
        self.n_head = n_head // n
        rows = torch.cat([torch.arange(i * n_embd + r * w, i * n_embd + (r + 1) * w) for i in range(3)])
        has_bias = attn.c_attn.bias is not None
        self.c_attn = nn.Linear(n_embd, 3 * w, bias=has_bias)
        self.c_proj = nn.Linear(w, n_embd, bias=attn.c_proj.bias is not None)
        with torch.no_grad():
            self.c_attn.weight.copy_(attn.c_attn.weight[rows])
            if has_bias:
                self.c_attn.bias.copy_(attn.c_attn.bias[rows])
            self.c_proj.weight.copy_(attn.c_proj.weight[:, r * w:(r + 1) * w])
            if self.c_proj.bias is not None:
                self.c_proj.bias.copy_(attn.c_proj.bias)

    def forward(self, x):
        B, T, C = x.shape
        x = f(x, self.group)
        q, k, v = F.linear(x, self.c_attn.weight, self.c_attn.bias).chunk(3, dim=2)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        y = g(F.linear(y, self.c_proj.weight), self.group)
        if self.c_proj.bias is not None:
            y = y + self.c_proj.bias
        return y
'''

ATT_WRONG = [
    ("c_attn split as one contiguous block of its 3*n_embd rows (what ColwiseParallel would do): rank 0 gets only q rows; "
     "breaks 'the q, k and v rows of this rank's heads' / whole heads",
     _mut(ATT, ("        rows = torch.cat([torch.arange(i * n_embd + r * w, i * n_embd + (r + 1) * w) for i in range(3)])\n",
                "        rows = torch.arange(r * 3 * w, (r + 1) * 3 * w)\n"))),
    ("each rank keeps half of every head's channels (channels strided over heads) with all n_head heads: a split inside "
     "heads, the scores become partial sums; breaks 'whole heads, every head on exactly one rank'",
     _mut(ATT, ("        self.n_head = n_head // n\n        rows = torch.cat([torch.arange(i * n_embd + r * w, i * n_embd + (r + 1) * w) for i in range(3)])\n",
                "        self.n_head = n_head\n        d = n_embd // n_head\n        mine = torch.cat([torch.arange(h * d + r * (d // n), h * d + (r + 1) * (d // n)) for h in range(n_head)])\n        rows = torch.cat([i * n_embd + mine for i in range(3)])\n"),
               ("            self.c_proj.weight.copy_(attn.c_proj.weight[:, r * w:(r + 1) * w])\n",
                "            self.c_proj.weight.copy_(attn.c_proj.weight[:, mine])\n"))),
    ("c_proj's bias passed to F.linear before g: added on every rank, Y + (N-1) b; breaks 'whole bias, added once after g'",
     _mut(ATT, ("        y = g(F.linear(y, self.c_proj.weight), self.group)\n        if self.c_proj.bias is not None:\n            y = y + self.c_proj.bias\n",
                "        y = g(F.linear(y, self.c_proj.weight, self.c_proj.bias), self.group)\n"))),
    ("no divisibility check: n_head // N silently floors, no ValueError; breaks 'raise a ValueError in __init__ when N does not divide attn.n_head'",
     _mut(ATT, ("        if n_head % n:\n            raise ValueError(f\"n_head={n_head} heads do not split over a tensor-parallel group of {n} ranks\")\n", ""))),
    ("ValueError raised but its message gives neither number: breaks 'whose message gives both numbers'",
     _mut(ATT, ("raise ValueError(f\"n_head={n_head} heads do not split over a tensor-parallel group of {n} ranks\")",
                "raise ValueError(\"the number of heads must be divisible by the tensor-parallel size\")"))),
    ("assert instead of ValueError for the head count: AssertionError (and none at all under python -O); breaks 'raise a ValueError'",
     _mut(ATT, ("        if n_head % n:\n            raise ValueError(f\"n_head={n_head} heads do not split over a tensor-parallel group of {n} ranks\")\n",
                "        assert n_head % n == 0, f\"n_head={n_head} not divisible by {n}\"\n"))),
    ("attention without is_causal (copied the SDPA call without the mask): every position sees the future; breaks 'causal attention'",
     _mut(ATT, ("F.scaled_dot_product_attention(q, k, v, is_causal=True)", "F.scaled_dot_product_attention(q, k, v)"))),
    ("keeps self.n_head = attn.n_head (all heads) with this rank's w channels: view() makes n_head heads of d/N channels, "
     "a split inside every head; breaks 'n_head / N whole heads per rank'",
     _mut(ATT, ("        self.n_head = n_head // n\n", "        self.n_head = n_head\n"))),
    ("no f in front of c_attn: the input's gradient is this rank's partial term only; breaks 'f in front of c_attn'",
     _mut(ATT, ("        x = f(x, self.group)\n", ""))),
]

ATT_CORRECT = [
    ("Megatron-LM's interleaved order (each head's q, k, v rows together), heads kept as a (B, T, heads, 3, d) view; "
     "explicitly allowed by the contract, `torch.distributed.get_rank` in full",
     r'''%%writefile tp_attention_impl.py
"""Exercise 3 of lab 08: causal self-attention with the heads split over the ranks (written by the notebook)."""
import torch
import torch.distributed
import torch.nn as nn
import torch.nn.functional as F

from tp_comm_impl import f, g   # exercise 1


class TensorParallelAttention(nn.Module):
    """The course GPT's CausalSelfAttention with n_head / N whole heads on each rank.

    c_attn: an nn.Linear holding the q, k and v rows of this rank's whole heads (3 * n_head / N * head_size
    of them, in the order forward reads them); c_proj: an nn.Linear of the same heads' head_size * n_head / N
    input columns, whose bias is added once, after the all-reduce."""

    def __init__(self, attn, group):
        super().__init__()
        self.group = group
        tp = torch.distributed.get_world_size(group)
        rank = torch.distributed.get_rank(group)
        if attn.n_head % tp != 0:
            raise ValueError(f"cannot split {attn.n_head} heads over {tp} tensor-parallel ranks")
        n_embd = attn.c_attn.in_features
        d = n_embd // attn.n_head
        self.heads = attn.n_head // tp
        self.d = d
        my_heads = range(rank * self.heads, (rank + 1) * self.heads)
        # Megatron order: for each of my heads, its q rows, then its k rows, then its v rows
        rows = [part * n_embd + h * d + i for h in my_heads for part in range(3) for i in range(d)]
        cols = [h * d + i for h in my_heads for i in range(d)]
        rows, cols = torch.tensor(rows), torch.tensor(cols)
        self.c_attn = nn.Linear(n_embd, 3 * self.heads * d, bias=attn.c_attn.bias is not None)
        self.c_proj = nn.Linear(self.heads * d, n_embd, bias=attn.c_proj.bias is not None)
        with torch.no_grad():
            self.c_attn.weight.copy_(attn.c_attn.weight.index_select(0, rows))
            if attn.c_attn.bias is not None:
                self.c_attn.bias.copy_(attn.c_attn.bias.index_select(0, rows))
            self.c_proj.weight.copy_(attn.c_proj.weight.index_select(1, cols))
            if attn.c_proj.bias is not None:
                self.c_proj.bias.copy_(attn.c_proj.bias)

    def forward(self, x):
        B, T, _ = x.shape
        qkv = F.linear(f(x, self.group), self.c_attn.weight, self.c_attn.bias)
        qkv = qkv.view(B, T, self.heads, 3, self.d).permute(3, 0, 2, 1, 4)   # (3, B, heads, T, d)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, self.heads * self.d)
        out = g(F.linear(y, self.c_proj.weight), self.group)
        return out if self.c_proj.bias is None else out + self.c_proj.bias
'''),
]

# ----------------------------------------------------------------------------------------------- exercise 4: multiple choice
MC = '# YOUR CODE HERE\nforward_bytes_answer = "{}"\n'
MC_WRONG = [
    ("(b) counts the backward all-reduces too; the question asks for one forward only (2 all-reduces of b s h fp32 values)",
     MC.format("b")),
    ("(d) the block's weights: that is data parallelism's gradient all-reduce, not tensor parallelism's activations",
     MC.format("d")),
    ("upper-case 'A': right idea, but the check accepts only 'a', 'b', 'c' or 'd' (the visible check fails)",
     MC.format("A")),
]
MC_CORRECT = [
    ("(c) written in upper case then normalised (their variant, re-keyed to the new question)",
     'forward_bytes_answer = "C".lower()\n'),
]



def _with_dtype(source: str) -> str:
    """Their attention cell with its new nn.Linear layers made in the full layer's dtype (the contract now asks it)."""
    return source.replace("bias=has_bias)", "bias=has_bias, dtype=attn.c_attn.weight.dtype)").replace(
        "bias=attn.c_attn.bias is not None)", "bias=attn.c_attn.bias is not None, dtype=attn.c_attn.weight.dtype)").replace(
        "bias=attn.c_proj.bias is not None)", "bias=attn.c_proj.bias is not None, dtype=attn.c_attn.weight.dtype)")


ATT_CORRECT_AS_WRITTEN = ATT_CORRECT
ATT_WRONG = [(d, _with_dtype(src)) for d, src in ATT_WRONG]
ATT_CORRECT = [(d + " (with the full layer's dtype)", _with_dtype(src)) for d, src in ATT_CORRECT]
assert all("dtype=attn.c_attn.weight.dtype" in src for _, src in ATT_CORRECT)

WRONG_ANSWERS = {"tp_f_g": FG_WRONG, "tp_mlp": MLP_WRONG, "tp_attention": ATT_WRONG, "forward_bytes_answer": MC_WRONG}
CORRECT_VARIANTS = {"tp_f_g": FG_CORRECT, "tp_mlp": MLP_CORRECT, "tp_attention": ATT_CORRECT,
                    "forward_bytes_answer": MC_CORRECT}
BASELINES = {"tp_f_g": FG, "tp_mlp": MLP, "tp_attention": ATT, "forward_bytes_answer": MC.format("a")}
