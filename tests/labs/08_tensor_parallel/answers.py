"""Wrong answers for lab 08 (tests/labkit.py: the lab's answer files): the solution's own cells with one mistake each.

Only the mistakes the issue names, plus those the world-size-1 pre-check catches without a torchrun start (every
other wrong answer costs one 4-rank start of CI time). Among the latter, the ways to take exercise 1 from the
course instead of writing it: lablib's old reference pair (gone from lablib: the import and the code-object copy
fail), DTensor's f and g that stand in for exercise 1 while exercises 2 and 3 are graded (copied or called: the
check refuses functional collectives, and they send nothing on one rank), and the instructor's package (the
grader's kernel and ranks can import ``instructor``; lab 08 keeps no f and g there). Where the red team's answer
makes the same mistake as one of the course's, the course's is left out: f and g swapped, g's backward summing
too, f's backward returning one value; the row-parallel bias added on every rank; no check that N divides n_head,
heads split inside a head; answer (b).
"""

from __future__ import annotations


from labkit import SolutionCells

# The red team's (a reviewer who had read only the released notebook): added to each list below.

_cells = SolutionCells("08_tensor_parallel")
_changed = _cells.changed
_F_AND_G = ("def f(x, group):\n    return CopyToTensorParallel.apply(x, group)\n\n\n"
            "def g(x, group):\n    return ReduceFromTensorParallel.apply(x, group)")


def _f_g_replaced(by: str) -> str:
    """Exercise 1's cell with its f and g replaced by ``by`` (the autograd functions left unused above it)."""
    return _changed("tp_f_g", (_F_AND_G, by.strip("\n")))


WRONG_ANSWERS = {
    "tp_f_g": [
        ("f and g imported from lablib's old reference pair (reference_f and reference_g of lab 08's probe, gone: "
         "the import fails)", _f_g_replaced(
            "from lablib.labs.tensor_parallel.probe import reference_f as f  # noqa: E402\n"
            "from lablib.labs.tensor_parallel.probe import reference_g as g  # noqa: E402")),
        ("f and g copied when the module loads from the code objects of lablib's old reference pair (which "
         "checks.answer_without, swapping the original's code during the check, never saw): gone, the copy fails",
         _f_g_replaced('''
import types  # noqa: E402

from lablib.labs.tensor_parallel import probe as tp_probes  # noqa: E402

f = types.FunctionType(tp_probes.reference_f.__code__, tp_probes.reference_f.__globals__)
g = types.FunctionType(tp_probes.reference_g.__code__, tp_probes.reference_g.__globals__)
''')),
        ("f and g copied when the module loads from the code of lablib's DTensorFG (exercises 2 and 3's stand-in): "
         "DTensor's functional collectives, and none at all on one rank", _f_g_replaced('''
import types  # noqa: E402

from lablib.labs.tensor_parallel.probe import DTensorFG  # noqa: E402

_pair = DTensorFG()
f = types.MethodType(types.FunctionType(DTensorFG.f.__code__, DTensorFG.f.__globals__), _pair)
g = types.MethodType(types.FunctionType(DTensorFG.g.__code__, DTensorFG.g.__globals__), _pair)
''')),
        ("f and g delegate to lablib's DTensorFG (exercises 2 and 3's stand-in) instead of the autograd functions",
         _f_g_replaced('''
from lablib.labs.tensor_parallel.probe import DTensorFG  # noqa: E402

_COURSE = DTensorFG()


def f(x, group):
    return _COURSE.f(x, group)


def g(x, group):
    return _COURSE.g(x, group)
''')),
        ("f and g as plain functions (a gradient hook and a straight-through sum), not the autograd Functions the "
         "exercise asks for: right values, refused by the form check", _f_g_replaced('''
def _summed(t, group):
    out = t.detach().clone()
    dist.all_reduce(out, group=group)
    return out


def f(x, group):
    out = x.view_as(x)
    if out.requires_grad:
        out.register_hook(lambda grad: _summed(grad, group))
    return out


def g(x, group):
    return x + (_summed(x, group) - x.detach())
''')),
        ("f and g taken from the course repository's instructor package (importable where the grader runs): lab 08 "
         "keeps no f and g there, the import fails", _f_g_replaced(
            "from instructor.references.tensor_parallel import reference_f as f, reference_g as g  # noqa: E402")),
        # Issue 42 (instructor/hidden_kinds.py's steps kind): full marks before it (every probe calls g once per
        # input case, and each case's output is checked before the next call); three calls in a row now see the
        # first output overwritten by the second.
        ("g all-reduces into one buffer per shape and dtype, allocated once and returned on every call (Megatron "
         "keeps a global buffer too)", _changed(
            "tp_f_g", ("        total = x.contiguous().clone()             # never all-reduce the caller's tensor in place\n",
                       "        key = (tuple(x.shape), x.dtype, x.device)\n"
                       "        if key not in _BUFFERS:                    # allocated once per shape, then reused\n"
                       "            _BUFFERS[key] = torch.empty(x.shape, dtype=x.dtype, device=x.device)\n"
                       "        total = _BUFFERS[key].copy_(x)\n"),
            ("class ReduceFromTensorParallel(", "_BUFFERS = {}\n\n\nclass ReduceFromTensorParallel("))),
    ],
    "tp_mlp": [
        ("f moved from ColumnParallelLinear into the MLP (the MLP alone still computes the right thing)", _changed(
            "tp_mlp", ("        return F.linear(f(x, self.group), self.weight, self.bias)",
                       "        return F.linear(x, self.weight, self.bias)"),
            ("        hidden = F.gelu(self.c_fc(x))", "        hidden = F.gelu(self.c_fc(f(x, self.c_fc.group)))"))),
        ("g and the bias moved from RowParallelLinear into the MLP (the MLP alone still computes the right thing)",
         _changed("tp_mlp",
                  ("        y = g(F.linear(x, self.weight), self.group)      # the partial sums, added over the ranks\n"
                   "        return y if self.bias is None else y + self.bias  # once, after the sum: not N times",
                   "        return F.linear(x, self.weight)                  # g and the bias: the MLP's job"),
                  ("        return self.c_proj(hidden)",
                   "        y = g(self.c_proj(hidden), self.c_proj.group)\n"
                   "        return y if self.c_proj.bias is None else y + self.c_proj.bias"))),
        ("no check that N divides the width: 3 features split 1 and 2 over 2 ranks", _changed(
            "tp_mlp", ("    if size % n:\n        raise ValueError(f\"{size} features do not split evenly over a "
                       "tensor-parallel group of {n} ranks\")\n", ""))),
        ("the width refused with a message that gives neither number", _changed(
            "tp_mlp", ("f\"{size} features do not split evenly over a tensor-parallel group of {n} ranks\"",
                       "\"the features do not split evenly over the tensor-parallel group\""))),
        ("the shards made float32 whatever the layer's dtype (bf16 layers get fp32 weights)", _changed(
            "tp_mlp", ("        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())",
                       "        self.weight = nn.Parameter(linear.weight.detach()[rows].clone().float())"))),
        ("ColumnParallelLinear reads (B, T, C) from its input: 2-D or 4-D inputs fail", _changed(
            "tp_mlp", ("        return F.linear(f(x, self.group), self.weight, self.bias)",
                       "        B, T, C = x.shape\n"
                       "        return F.linear(f(x, self.group).view(B * T, C), self.weight, self.bias).view(B, T, -1)"))),
        ("column-parallel weight split along the input dimension (the columns of nn.Linear's weight)", _changed(
            "tp_mlp", ("        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())",
                       "        self.weight = nn.Parameter(linear.weight.detach()[:, rows].clone())"))),
    ],
    "tp_attention": [
        ("the head count refused with a fixed text that happens to hold the numbers of the visible case",
         _changed("tp_attention", ("f\"n_head={attn.n_head} heads cannot be split over a tensor-parallel group of {n} \"\n"
                                   "                             f\"ranks: choose a group size that divides {attn.n_head}\"",
                                   "\"n_head=3 heads cannot be split over a tensor-parallel group of 2 ranks\""))),
        ("the new layers made in float32 whatever the attention's dtype", _changed(
            "tp_attention", ("        like = dict(dtype=w_qkv.dtype, device=w_qkv.device)", "        like = dict()"))),
        ("c_attn's rows taken with lablib's old qkv_rows_by_rank (the DTensor section's helper, gone since: DTensor "
         "now splits separate q, k and v layers; the import fails)", _changed(
            "tp_attention", ("            self.c_attn.weight.copy_(w_qkv[:, mine].flatten(0, 1))",
                             "            from lablib.parallel.tensor_parallel import qkv_rows_by_rank\n"
                             "            order = qkv_rows_by_rank(n_embd, n).chunk(n)[r]\n"
                             "            self.c_attn.weight.copy_(attn.c_attn.weight.detach()[order])"),
            ("                self.c_attn.bias.copy_(attn.c_attn.bias.detach().unflatten(0, (3, n_embd))[:, mine].flatten())",
             "                self.c_attn.bias.copy_(attn.c_attn.bias.detach()[order])"))),
        # Issue 42 (instructor/hidden_kinds.py's extremes kind): full marks before it (at the probe's scale the
        # scores stay far below 88.7); inputs scaled by 100 overflow exp and give inf / inf = nan.
        ("the softmax written by its formula, exp(s) / sum(exp(s)), instead of torch's (which subtracts the row's "
         "maximum first)", _changed(
            "tp_attention", ("        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)\n",
                             "        att = (q @ k.transpose(-2, -1)) / (q.size(-1) ** 0.5)                  # (B, h/N, T, T)\n"
                             "        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)\n"
                             "        att = att.masked_fill(causal, float(\"-inf\"))\n"
                             "        att = att.exp() / att.exp().sum(-1, keepdim=True)                     # softmax, by its formula\n"
                             "        y = att @ v\n"))),
    ],
    "forward_bytes_answer": [
        ("each rank holds half the activations at twice the ranks, so it sends half", _changed(
            "forward_bytes_answer", ('"c"', '"a"'))),
    ],
}

# The attention split another valid way: the check finds the rows by value and asks only for whole heads, each on
# one rank. The red team's (added below) spell f and g's all-reduce other ways, counted all the same
# (lablib.measure.counting counts torch's ops, not names; a name imported from torch.distributed was once missed, "no
# all-reduce was called"), and shard the MLP with torch.tensor_split and torch.add: the course's own variants that
# did the same (all_reduce imported by name, torch.distributed without an alias, torch.chunk) are left out, each
# one 4-rank start less.
CORRECT_VARIANTS = {
    "tp_attention": [
        ("Megatron-LM's layout: each head's q, k and v rows together in c_attn, and the heads dealt round-robin "
         "(rank r: heads r, r + N, ...), c_proj's columns in the same order", _changed(
            "tp_attention",
            ("        mine = slice(r * width, (r + 1) * width)",
             "        size = n_embd // attn.n_head\n"
             "        mine = torch.cat([torch.arange(h * size, (h + 1) * size) for h in range(r, attn.n_head, n)])"),
            ("            self.c_attn.weight.copy_(w_qkv[:, mine].flatten(0, 1))",
             "            # (3, heads * size, n_embd) -> (heads, 3, size, n_embd): head by head, its q, k and v rows\n"
             "            self.c_attn.weight.copy_(w_qkv[:, mine].unflatten(1, (self.n_head, size)).transpose(0, 1).flatten(0, 2))"),
            ("                self.c_attn.bias.copy_(attn.c_attn.bias.detach().unflatten(0, (3, n_embd))[:, mine].flatten())",
             "                b_qkv = attn.c_attn.bias.detach().unflatten(0, (3, n_embd))[:, mine]\n"
             "                self.c_attn.bias.copy_(b_qkv.unflatten(1, (self.n_head, size)).transpose(0, 1).flatten())"),
            ("        q, k, v = self.c_attn(f(x, self.group)).chunk(3, dim=2)          # (B, T, width) each\n"
             "        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))  # (B, h/N, T, hs)",
             "        qkv = self.c_attn(f(x, self.group)).view(B, T, self.n_head, 3, -1)   # per head: q, k, v\n"
             "        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))             # (B, h/N, T, hs)"))),
    ],
}

