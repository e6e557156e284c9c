"""Wrong answers for lab 08 (see tests/wrong_answers/__init__.py): the solution's own cells with one mistake each.

Only the mistakes the issue names, plus two that the world-size-1 pre-check catches without a torchrun start:
every other wrong answer costs one 4-rank start of CI time.
"""

from __future__ import annotations

from wrong_answers import SolutionCells

_cells = SolutionCells("08_tensor_parallel")
_changed = _cells.changed

WRONG_ANSWERS = {
    "tp_f_g": [
        ("f and g swapped: f all-reduces in the forward, g in the backward", _changed(
            "tp_f_g", ("    return CopyToTensorParallel.apply(x, group)", "    return SWAPPED_F.apply(x, group)"),
            ("    return ReduceFromTensorParallel.apply(x, group)", "    return CopyToTensorParallel.apply(x, group)"),
            ("    return SWAPPED_F.apply(x, group)", "    return ReduceFromTensorParallel.apply(x, group)"))),
        ("g's backward all-reduces the gradient too", _changed(
            "tp_f_g", ("        return grad_output, None                   # d(sum_r x_r)/dx_r = 1",
                       "        grad_output = grad_output.clone()\n"
                       "        dist.all_reduce(grad_output, group=ctx.group)\n"
                       "        return grad_output, None                   # d(sum_r x_r)/dx_r = 1"),
            ("        total = x.contiguous().clone()", "        ctx.group = group\n        total = x.contiguous().clone()"))),
        ("f and g taken from lablib's reference pair instead of written (the pre-check refuses it in process)", _changed(
            "tp_f_g", ("def f(x, group):\n    return CopyToTensorParallel.apply(x, group)",
                       "from lablib.tp_probes import reference_f as f  # noqa: E402"),
            ("def g(x, group):\n    return ReduceFromTensorParallel.apply(x, group)",
             "from lablib.tp_probes import reference_g as g  # noqa: E402"))),
    ],
    "tp_mlp": [
        ("the row-parallel bias added on every rank, before the all-reduce", _changed(
            "tp_mlp", ("        y = g(F.linear(x, self.weight), self.group)", "        y = g(F.linear(x, self.weight, self.bias), self.group)"),
            ("        return y if self.bias is None else y + self.bias", "        return y"))),
        ("column-parallel weight split along the input dimension (the columns of nn.Linear's weight)", _changed(
            "tp_mlp", ("        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())",
                       "        self.weight = nn.Parameter(linear.weight.detach()[:, rows].clone())"))),
    ],
    "tp_attention": [
        ("heads split inside a head: every rank keeps all n_head heads, each with head_size / N channels", _changed(
            "tp_attention", ("        self.n_head = attn.n_head // n                       # whole heads on this rank",
                             "        self.n_head = attn.n_head"),
            ("        width = self.n_head * (n_embd // attn.n_head)", "        width = n_embd // n"))),
        ("c_attn's rows taken with lablib's qkv_rows_by_rank (the DTensor section's helper) instead of split by "
         "head (the pre-check refuses it in process)", _changed(
            "tp_attention", ("            self.c_attn.weight.copy_(w_qkv[:, mine].flatten(0, 1))",
                             "            from lablib.tensor_parallel import qkv_rows_by_rank\n"
                             "            order = qkv_rows_by_rank(n_embd, n).chunk(n)[r]\n"
                             "            self.c_attn.weight.copy_(attn.c_attn.weight.detach()[order])"),
            ("                self.c_attn.bias.copy_(attn.c_attn.bias.detach().unflatten(0, (3, n_embd))[:, mine].flatten())",
             "                self.c_attn.bias.copy_(attn.c_attn.bias.detach()[order])"))),
    ],
    "forward_bytes_answer": [
        ("counts the backward's all-reduces too", _changed("forward_bytes_answer", ('"a"', '"b"'))),
    ],
}

# f and g with the all-reduce spelled other ways: counted all the same (lablib.counting counts torch's ops, not
# names; a name imported from torch.distributed was once missed, "no all-reduce was called").
CORRECT_VARIANTS = {
    "tp_f_g": [
        ("all_reduce imported by name (from torch.distributed import all_reduce)", _changed(
            "tp_f_g", ("import torch.distributed as dist\n",
                       "import torch.distributed as dist\nfrom torch.distributed import all_reduce\n"),
            ("        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)",
             "        all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)"),
            ("        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)",
             "        all_reduce(total, op=dist.ReduceOp.SUM, group=group)"))),
        ("torch.distributed spelled in full, no alias", _changed(
            "tp_f_g", ("import torch.distributed as dist\n", "import torch.distributed\n"),
            ("        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)",
             "        torch.distributed.all_reduce(grad, op=torch.distributed.ReduceOp.SUM, group=ctx.group)"),
            ("        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)",
             "        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=group)"))),
    ],
}
