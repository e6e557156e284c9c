"""Lab 07 answers written by a reviewer who had read only the released notebook (no tests, no solution), before
the collectives, the backward and gradient accumulation were graded: plausible wrong answers and a correct variant
per exercise. tests/labkit.py appends them to answers.py's lists; the ZeRO3 correct variant (and the
baseline) overwrite the shard's gradient on a second backward, which the exercise now says to add to, so there
it is a wrong answer, and the same code with the addition a correct variant."""



def _mut(base, *pairs):
    """base with each (old, new) replaced; every old must occur in base (guards against silent no-op mutations)."""
    out = base
    for old, new in pairs:
        assert old in out, old
        out = out.replace(old, new)
    assert out != base
    return out


# ----------------------------------------------------------------------------------------------- exercise 1: ZeRO-1
Z1 = r'''%%writefile zero1_impl.py
"""Exercise 1 of lab 07: ZeRO-1, the optimizer state sharded over the ranks (this file is written by the notebook)."""
import torch
import torch.distributed as dist


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 (Rajbhandari et al., 2020): every parameter has one owner rank; only the owner's inner
    optimizer keeps that parameter's state and updates it, then the owner sends the new values to every rank."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.owner = {}                                 # id(parameter) -> owner rank
        self.load = [0] * self.world_size               # bytes owned per rank so far
        self.inner = None
        super().__init__(params, dict(kwargs))          # calls self.add_param_group for every group
        self.inner = optimizer_cls(self._owned(self.param_groups), **kwargs)
        self.state = self.inner.state

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in sorted(group["params"], key=lambda t: t.numel() * t.element_size(), reverse=True):
            r = min(range(self.world_size), key=lambda i: self.load[i])
            self.owner[id(p)] = r
            self.load[r] += p.numel() * p.element_size()
        if self.inner is not None:
            self.inner.add_param_group(self._owned([group])[0])

    def _owned(self, groups):
        """The same groups with only this rank's parameters (one inner group per group, possibly empty)."""
        return [{**{k: v for k, v in g.items() if k != "params"},
                 "params": [p for p in g["params"] if self.owner[id(p)] == self.rank]} for g in groups]

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            for k, v in outer.items():
                if k != "params":
                    inner[k] = v
        self.inner.step()
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    dist.broadcast(p, src=self.owner[id(p)])
        return loss
'''

Z1_WRONG = [
    ("owners round-robin by count (i % N) instead of largest-first to the least-loaded rank: on 2 ranks one rank owns "
     "every weight; breaks 'chosen by size' and the fullest-rank bound (average + largest parameter's state)",
     _mut(Z1, ("        for p in sorted(group[\"params\"], key=lambda t: t.numel() * t.element_size(), reverse=True):\n"
               "            r = min(range(self.world_size), key=lambda i: self.load[i])\n",
               "        for p in group[\"params\"]:\n"
               "            r = len(self.owner) % self.world_size\n"))),
    ("inner optimizer built on all parameters (every rank steps everything, the broadcasts just confirm): the state is "
     "replicated, not sharded; breaks 'the inner optimizer holds only this rank's parameters' / state once over all ranks",
     _mut(Z1, ("        self.inner = optimizer_cls(self._owned(self.param_groups), **kwargs)\n",
               "        self.inner = optimizer_cls([{**g, \"params\": list(g[\"params\"])} for g in self.param_groups], **kwargs)\n"),
              ("            self.inner.add_param_group(self._owned([group])[0])\n",
               "            self.inner.add_param_group({**group, \"params\": list(group[\"params\"])})\n"))),
    ("add_param_group after construction only records the group and assigns owners, never gives it to the inner "
     "optimizer: the added parameters are never updated (hidden: group added after 3 steps)",
     _mut(Z1, ("        if self.inner is not None:\n            self.inner.add_param_group(self._owned([group])[0])\n", ""))),
    ("all owned parameters in ONE inner group built with **kwargs: per-group lr / weight_decay lost; breaks 'one inner "
     "group per group (with the group's hyperparameters)' (hidden: two groups with their own lr and weight_decay)",
     _mut(Z1, ("        self.inner = optimizer_cls(self._owned(self.param_groups), **kwargs)\n",
               "        self.inner = optimizer_cls([p for g in self._owned(self.param_groups) for p in g[\"params\"]], **kwargs)\n"),
              ("        for outer, inner in zip(self.param_groups, self.inner.param_groups):\n"
               "            for k, v in outer.items():\n"
               "                if k != \"params\":\n"
               "                    inner[k] = v\n", ""))),
    ("hyperparameters never copied from the outer groups at step(): a learning-rate schedule (which changes the outer "
     "groups) has no effect; breaks 'step(): copy the outer groups' hyperparameters to the inner groups'",
     _mut(Z1, ("        for outer, inner in zip(self.param_groups, self.inner.param_groups):\n"
               "            for k, v in outer.items():\n"
               "                if k != \"params\":\n"
               "                    inner[k] = v\n", ""))),
    ("only the owner calls broadcast (`if owner == rank`): the other ranks never join the collective (hang, or "
     "mismatched broadcasts); breaks 'every parameter travels from its owner to every rank'",
     _mut(Z1, ("                    dist.broadcast(p, src=self.owner[id(p)])\n",
               "                    if self.owner[id(p)] == self.rank:\n"
               "                        dist.broadcast(p, src=self.rank)\n"))),
    ("loads reset for each group (balance computed per group): a group added later starts again at rank 0, so the "
     "fullest rank can exceed average + largest parameter's state; breaks 'each to the rank that owns the fewest bytes so far'",
     _mut(Z1, ("        group = self.param_groups[-1]\n",
               "        group = self.param_groups[-1]\n        self.load = [0] * self.world_size\n"))),
    ("self.state left as the outer optimizer's own (empty) dict, never set to the inner optimizer's state: breaks "
     "'self.state is that inner state' (state_dict()/inspection of optimizer.state shows nothing)",
     _mut(Z1, ("        self.state = self.inner.state\n", ""))),
    ("the gradient is all-reduced (summed) before the inner step, as DDP would: the gradient becomes N times too big; "
     "breaks the bit-for-bit equality with AdamW on the same gradient (ZeRO-1 does no gradient reduction itself here)",
     _mut(Z1, ("        self.inner.step()\n",
               "        for group in self.param_groups:\n"
               "            for p in group[\"params\"]:\n"
               "                if p.grad is not None:\n"
               "                    dist.all_reduce(p.grad)\n"
               "        self.inner.step()\n"))),
]

Z1_CORRECT = [
    ("`from torch.distributed import broadcast, get_rank, get_world_size`, owners from a heap of (bytes, rank), the "
     "owner recorded on a per-id dict, @torch.no_grad() on the whole step; same algorithm (ties to the lowest rank)",
     r'''%%writefile zero1_impl.py
"""Exercise 1 of lab 07: ZeRO-1, the optimizer state sharded over the ranks (this file is written by the notebook)."""
import heapq

import torch
from torch.distributed import broadcast, get_rank, get_world_size


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 (Rajbhandari et al., 2020): every parameter has one owner rank; only the owner's inner
    optimizer keeps that parameter's state and updates it, then the owner sends the new values to every rank."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self._rank = get_rank()
        self._heap = [(0, r) for r in range(get_world_size())]   # (bytes owned, rank): least loaded first
        self._owner_of = {}
        self._inner = None
        super().__init__(params, kwargs)
        self._inner = optimizer_cls(self._owned(self.param_groups), **kwargs)
        self.state = self._inner.state

    def _assign(self, params):
        for p in sorted(params, key=lambda t: -t.numel() * t.element_size()):
            load, r = heapq.heappop(self._heap)
            self._owner_of[id(p)] = r
            heapq.heappush(self._heap, (load + p.numel() * p.element_size(), r))

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        self._assign(self.param_groups[-1]["params"])
        if self._inner is not None:
            (mine,) = self._owned(self.param_groups[-1:])
            self._inner.add_param_group(mine)

    def _owned(self, groups):
        """The same groups with only this rank's parameters (one inner group per group, possibly empty)."""
        out = []
        for g in groups:
            inner = dict(g)
            inner["params"] = [p for p in g["params"] if self._owner_of[id(p)] == self._rank]
            out.append(inner)
        return out

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for outer, inner in zip(self.param_groups, self._inner.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        self._inner.step()
        for g in self.param_groups:
            for p in g["params"]:
                broadcast(p, src=self._owner_of[id(p)])
        return loss
'''),
]

# ----------------------------------------------------------------------------------------------- exercise 2: ZeRO-2
Z2 = r'''%%writefile zero2_impl.py
"""Exercise 2 of lab 07: ZeRO-2, gradients and optimizer state sharded (this file is written by the notebook)."""
import torch
import torch.distributed as dist


class ZeRO2:
    """ZeRO stage 2: the trainable parameters become views of one flat buffer, padded to N equal shards;
    rank r owns shard r: only its gradient (reduce-scattered) and its optimizer state live on rank r."""

    def __init__(self, model, optimizer_cls, **kwargs):
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.params = [p for p in model.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in self.params)
        N = self.world_size
        self.shard_numel = S = (numel + N - 1) // N
        first = self.params[0]
        self.flat = torch.zeros(N * S, dtype=first.dtype, device=first.device)
        offset = 0
        for p in self.params:
            n = p.numel()
            self.flat[offset:offset + n].copy_(p.detach().reshape(-1))
            p.data = self.flat[offset:offset + n].view_as(p)
            offset += n
        self.shard = torch.nn.Parameter(self.flat[self.rank * S:(self.rank + 1) * S])
        self.optimizer = optimizer_cls([self.shard], **kwargs)

    def step(self):
        N, S = self.world_size, self.shard_numel
        grad = torch.zeros(N * S, dtype=self.flat.dtype, device=self.flat.device)
        offset = 0
        for p in self.params:
            n = p.numel()
            if p.grad is not None:
                grad[offset:offset + n].copy_(p.grad.reshape(-1))
            p.grad = None
            offset += n
        shard_grad = torch.empty(S, dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(shard_grad, grad)
        del grad
        shard_grad.div_(N)
        self.shard.grad = shard_grad
        self.optimizer.step()
        dist.all_gather_into_tensor(self.flat, self.shard.detach().clone())

    def zero_grad(self):
        for p in self.params:
            p.grad = None
        self.shard.grad = None
'''

Z2_WRONG = [
    ("S = numel // N (floor) and no padding: the last numel mod N elements belong to no shard (never updated) or the "
     "buffer size mismatches; breaks 'S = ceil(numel / N), padded' (hidden: a model that needs padding on 4 ranks)",
     _mut(Z2, ("        self.shard_numel = S = (numel + N - 1) // N\n", "        self.shard_numel = S = numel // N\n"),
              ("        self.flat = torch.zeros(N * S, dtype=first.dtype, device=first.device)\n",
               "        self.flat = torch.zeros(numel, dtype=first.dtype, device=first.device)\n"),
              ("        grad = torch.zeros(N * S, dtype=self.flat.dtype, device=self.flat.device)\n",
               "        grad = torch.zeros(numel_all := self.flat.numel(), dtype=self.flat.dtype, device=self.flat.device)\n"),
              ("        dist.reduce_scatter_tensor(shard_grad, grad)\n", "        dist.reduce_scatter_tensor(shard_grad, grad[:N * S])\n"),
              ("        dist.all_gather_into_tensor(self.flat, self.shard.detach().clone())\n",
               "        dist.all_gather_into_tensor(self.flat[:N * S], self.shard.detach().clone())\n"))),
    ("no division by N after the reduce-scatter: the shard's gradient is the SUM over ranks; breaks 'divide by N (the mean)'",
     _mut(Z2, ("        shard_grad.div_(N)\n", ""))),
    ("all_reduce of the whole flat gradient, then the shard sliced out: right numbers but the taught reduce-scatter "
     "is replaced by an all-reduce (twice the bytes of a reduce-scatter, a full summed gradient on every rank)",
     _mut(Z2, ("        shard_grad = torch.empty(S, dtype=grad.dtype, device=grad.device)\n"
               "        dist.reduce_scatter_tensor(shard_grad, grad)\n",
               "        dist.all_reduce(grad)\n"
               "        shard_grad = grad[self.rank * S:(self.rank + 1) * S].clone()\n"))),
    ("parameters copied into the flat buffer but p.data not rebound to views: the buffer is a second copy (params held "
     "twice) and the all-gathered updates never reach the model; breaks 'the buffer *is* the parameters'",
     _mut(Z2, ("            p.data = self.flat[offset:offset + n].view_as(p)\n", ""))),
    ("the full p.grad are kept after step() (not freed): every rank still holds the whole gradient; breaks 'free every "
     "p.grad' / 'no full gradient' after step",
     _mut(Z2, ("            p.grad = None\n            offset += n\n", "            offset += n\n"))),
    ("padding put at the front of the buffer (parameters start at offset N*S - numel): rank r's shard is no longer "
     "elements [rS, (r+1)S) of the parameters; breaks 'the last N*S - numel of them padding'",
     _mut(Z2, ("        offset = 0\n        for p in self.params:\n            n = p.numel()\n            self.flat",
               "        offset = N * S - numel\n        self.pad = offset\n        for p in self.params:\n            n = p.numel()\n            self.flat"),
              ("        offset = 0\n        for p in self.params:\n            n = p.numel()\n            if p.grad",
               "        offset = self.pad\n        for p in self.params:\n            n = p.numel()\n            if p.grad"))),
    ("zero_grad clears the parameters' gradients but leaves the shard's .grad: breaks 'zero_grad(): no gradient left, "
     "the shard's included'",
     _mut(Z2, ("        for p in self.params:\n            p.grad = None\n        self.shard.grad = None\n",
               "        for p in self.params:\n            p.grad = None\n"))),
    ("frozen parameters included (`model.parameters()` without the requires_grad filter): AdamW's weight decay moves "
     "them and their missing gradient is treated as 0; breaks 'the trainable parameters (... with requires_grad)'",
     _mut(Z2, ("        self.params = [p for p in model.parameters() if p.requires_grad]\n",
               "        self.params = list(model.parameters())\n"))),
    ("all-gather of the parameters left out (each rank only has its own shard updated, the rest stale): breaks "
     "'then all_gather_into_tensor(flat, ...) so every rank has every updated parameter'",
     _mut(Z2, ("        dist.all_gather_into_tensor(self.flat, self.shard.detach().clone())\n", ""))),
]

Z2_CORRECT = [
    ("`import torch.distributed as c10d`; the flat buffer built with torch.cat + F.pad, the gradient buffer the same "
     "way (zeros for missing grads), the mean via torch.div into the shard's grad; same layout and collectives",
     r'''%%writefile zero2_impl.py
"""Exercise 2 of lab 07: ZeRO-2, gradients and optimizer state sharded (this file is written by the notebook)."""
import torch
import torch.distributed as c10d
import torch.nn.functional as F


class ZeRO2:
    """ZeRO stage 2: the trainable parameters become views of one flat buffer, padded to N equal shards;
    rank r owns shard r: only its gradient (reduce-scattered) and its optimizer state live on rank r."""

    def __init__(self, model, optimizer_cls, **kwargs):
        self.n, self.r = c10d.get_world_size(), c10d.get_rank()
        self.params = []
        for p in model.parameters():
            if p.requires_grad and all(p is not q for q in self.params):
                self.params.append(p)
        self.numel = sum(p.numel() for p in self.params)
        self.S = -(-self.numel // self.n)
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in self.params])
            self.flat = F.pad(flat, (0, self.n * self.S - self.numel))
        self.sizes = [p.numel() for p in self.params]
        for p, view in zip(self.params, torch.split(self.flat[:self.numel], self.sizes)):
            p.data = view.view_as(p)
        self.shard = torch.nn.Parameter(self.flat.narrow(0, self.r * self.S, self.S))
        self.optimizer = optimizer_cls([self.shard], **kwargs)

    def step(self):
        parts = [torch.zeros(p.numel(), dtype=self.flat.dtype, device=self.flat.device) if p.grad is None
                 else p.grad.reshape(-1) for p in self.params]
        grad = F.pad(torch.cat(parts), (0, self.n * self.S - self.numel))
        for p in self.params:
            p.grad = None
        del parts
        mine = grad.new_empty(self.S)
        c10d.reduce_scatter_tensor(mine, grad, op=c10d.ReduceOp.SUM)
        del grad
        self.shard.grad = torch.div(mine, self.n)
        self.optimizer.step()
        c10d.all_gather_into_tensor(self.flat, self.shard.detach().clone())

    def zero_grad(self):
        for p in self.params + [self.shard]:
            p.grad = None
'''),
]

# ----------------------------------------------------------------------------------------------- exercise 3: ZeRO-3
Z3 = r'''%%writefile zero3_impl.py
"""Exercise 3 of lab 07: ZeRO-3, the parameters sharded too (this file is written by the notebook)."""
import torch
import torch.distributed as dist


class Unit:
    """One block as ZeRO-3 keeps it. ``full``: a flat buffer of N * S elements, S = ceil(numel / N), that the block's
    parameters are views of, its storage allocated only while the block is gathered; ``shard``: this rank's S
    elements of it (its own storage), the only copy kept at rest and the parameter the inner optimizer updates."""

    def __init__(self, module, params, world_size, rank):
        self.module, self.params = module, params
        numel = sum(p.numel() for p in params)
        # As in ZeRO2: self.shard_numel = S; self.full, zeros of (N * S,); every p.data a view of its slice of
        # self.full; self.shard, an nn.Parameter of this rank's S elements, cloned (it must outlive free()).
        self.shard_numel = S = (numel + world_size - 1) // world_size
        self.full = torch.zeros(world_size * S, dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for p in params:
            n = p.numel()
            self.full[offset:offset + n].copy_(p.detach().reshape(-1))
            p.data = self.full[offset:offset + n].view_as(p)
            offset += n
        self.shard = torch.nn.Parameter(self.full[rank * S:(rank + 1) * S].clone())
        self.grads_ready = 0                                       # the block's parameters whose .grad is complete


class ZeRO3:
    """ZeRO stage 3 (Rajbhandari et al., 2020): parameters, gradients and optimizer state all sharded. A block's
    parameters exist in full only while it runs: all-gathered before its forward, freed after it, all-gathered
    again before its backward, freed once its gradients are reduce-scattered to their owners."""

    def __init__(self, model, blocks, optimizer_cls, **kwargs):
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        rest = [p for p in model.parameters() if id(p) not in in_blocks]   # embeddings, final norm, head...
        self.units = [Unit(b, list(b.parameters()), self.world_size, self.rank) for b in blocks]
        self.root = Unit(model, rest, self.world_size, self.rank) if rest else None
        for unit in self.all_units():   # the root's hooks are the model's: it is gathered during the whole forward
            unit.module.register_forward_pre_hook(lambda module, args, u=unit: self.gather(u))
            unit.module.register_forward_hook(lambda module, args, output, u=unit: self.after_forward(u))
            # Runs when the gradient of the module's output is known, before autograd enters the module's backward.
            unit.module.register_full_backward_pre_hook(lambda module, grad_output, u=unit: self.before_backward(u))
            for p in unit.params:
                p.register_post_accumulate_grad_hook(lambda p, u=unit: self._grad_ready(u))
            self.free(unit)                                        # at rest: only the shards
        self.optimizer = optimizer_cls([u.shard for u in self.all_units()], **kwargs)

    def all_units(self):
        return self.units + ([self.root] if self.root is not None else [])

    def _grad_ready(self, unit):
        """After each parameter's .grad is complete; once the whole block's are, reduce-scatter them."""
        unit.grads_ready += 1
        if unit.grads_ready == len(unit.params):
            unit.grads_ready = 0
            self.reduce_scatter_grads(unit)

    def gather(self, unit):
        """Allocate the full buffer's storage again (``untyped_storage().resize_`` to its bytes) and all-gather every
        rank's shard into it (``dist.all_gather_into_tensor``): the parameters, views of it, are whole again."""
        full = unit.full
        full.untyped_storage().resize_(full.numel() * full.element_size())
        dist.all_gather_into_tensor(full, unit.shard.detach())

    def free(self, unit):
        """Release the full buffer's memory (its storage resized to 0 bytes); the parameters stay views of it."""
        unit.full.untyped_storage().resize_(0)

    def after_forward(self, unit):
        """The unit's forward is done: its full parameters are not needed until its backward."""
        self.free(unit)

    def before_backward(self, unit):
        """The unit's backward is about to run and needs its full parameters (autograd saved views of them)."""
        self.gather(unit)

    def reduce_scatter_grads(self, unit):
        """Every .grad of the unit is complete. A zero-padded flat gradient of N * S elements (each p.grad copied into
        its slice, then p.grad = None); ``dist.reduce_scatter_tensor`` into a new (S,) tensor; divided by N (the mean
        over ranks), it becomes ``unit.shard.grad``; then free the unit: its backward is over."""
        N, S = self.world_size, unit.shard_numel
        flat = torch.zeros(N * S, dtype=unit.shard.dtype, device=unit.shard.device)
        offset = 0
        for p in unit.params:
            n = p.numel()
            if p.grad is not None:
                flat[offset:offset + n].copy_(p.grad.reshape(-1))
            p.grad = None
            offset += n
        shard_grad = torch.empty(S, dtype=flat.dtype, device=flat.device)
        dist.reduce_scatter_tensor(shard_grad, flat)
        del flat
        shard_grad.div_(N)
        unit.shard.grad = shard_grad
        self.free(unit)

    def step(self):
        """Update the shards (the inner optimizer's parameters); the next forward gathers them."""
        self.optimizer.step()

    def zero_grad(self):
        for unit in self.all_units():
            unit.shard.grad = None
'''

Z3_WRONG = [
    ("free() does nothing (the buffer stays allocated; gather just all-gathers into it): correct numbers, but every "
     "unit is whole at rest and during the forward; breaks 'at rest each rank holds 1/N' and the forward-peak bound",
     _mut(Z3, ("        unit.full.untyped_storage().resize_(0)\n", "        pass   # keep the buffer: re-allocating every time is slow\n"))),
    ("before_backward does nothing ('autograd saved the weights'): the saved views point at freed storage, so the "
     "backward reads nothing/garbage; breaks 'all-gathered again before its backward'",
     _mut(Z3, ("    def before_backward(self, unit):\n        \"\"\"The unit's backward is about to run and needs its full parameters (autograd saved views of them).\"\"\"\n        self.gather(unit)\n",
               "    def before_backward(self, unit):\n        \"\"\"The unit's backward is about to run and needs its full parameters (autograd saved views of them).\"\"\"\n        pass\n"))),
    ("after_forward does not free (every unit kept gathered from its forward to its backward, i.e. "
     "reshard_after_forward=False): breaks 'never more than the root's and one block's full parameters during the forward'",
     _mut(Z3, ("    def after_forward(self, unit):\n        \"\"\"The unit's forward is done: its full parameters are not needed until its backward.\"\"\"\n        self.free(unit)\n",
               "    def after_forward(self, unit):\n        \"\"\"The unit's forward is done: its full parameters are not needed until its backward.\"\"\"\n        pass\n"),
              ("    def before_backward(self, unit):\n        \"\"\"The unit's backward is about to run and needs its full parameters (autograd saved views of them).\"\"\"\n        self.gather(unit)\n",
               "    def before_backward(self, unit):\n        \"\"\"The unit's backward is about to run and needs its full parameters (autograd saved views of them).\"\"\"\n        if unit.full.untyped_storage().nbytes() == 0:\n            self.gather(unit)\n"))),
    ("S = numel // N and no padding (full has numel elements, the tail split off): sizes that N does not divide lose "
     "elements or crash; breaks 'N*S elements, S = ceil(numel/N), padded with zeros' (the visible 3:gpt needs padding)",
     _mut(Z3, ("        self.shard_numel = S = (numel + world_size - 1) // world_size\n",
               "        self.shard_numel = S = numel // world_size\n"),
              ("        self.full = torch.zeros(world_size * S, dtype=params[0].dtype, device=params[0].device)\n",
               "        self.full = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)\n"),
              ("        dist.all_gather_into_tensor(full, unit.shard.detach())\n",
               "        dist.all_gather_into_tensor(full[:self.world_size * unit.shard_numel], unit.shard.detach())\n"),
              ("        flat = torch.zeros(N * S, dtype=unit.shard.dtype, device=unit.shard.device)\n",
               "        flat = torch.zeros(unit.full.numel(), dtype=unit.shard.dtype, device=unit.shard.device)\n"),
              ("        dist.reduce_scatter_tensor(shard_grad, flat)\n", "        dist.reduce_scatter_tensor(shard_grad, flat[:N * S])\n"))),
    ("the reduce-scattered gradient is not divided by N: the shard gets the SUM of the ranks' gradients; breaks "
     "'divided by N (the mean over ranks)'",
     _mut(Z3, ("        shard_grad.div_(N)\n", ""))),
    ("the unit is not freed after its gradients are reduce-scattered: after the backward every unit stays gathered "
     "until the next forward; breaks 'then free the unit: its backward is over' and the 1/N at rest",
     _mut(Z3, ("        unit.shard.grad = shard_grad\n        self.free(unit)\n", "        unit.shard.grad = shard_grad\n"))),
    ("the full p.grad are kept (never set to None) after the reduce-scatter: a full gradient per parameter at rest; "
     "breaks 'each p.grad copied into its slice, then p.grad = None' and the 1/N gradient bytes",
     _mut(Z3, ("                flat[offset:offset + n].copy_(p.grad.reshape(-1))\n            p.grad = None\n",
               "                flat[offset:offset + n].copy_(p.grad.reshape(-1))\n"))),
    ("the shard is a view of full, not a clone (copied from ZeRO2): free() resizes the storage under it to 0 bytes, so "
     "the shard, the optimizer's parameter, loses its values; breaks 'the shard is a .clone(): it must survive free'",
     _mut(Z3, ("        self.shard = torch.nn.Parameter(self.full[rank * S:(rank + 1) * S].clone())\n",
               "        self.shard = torch.nn.Parameter(self.full[rank * S:(rank + 1) * S])\n"))),
    ("step() all-gathers every unit after the optimizer step (a ZeRO-2 habit: 'so every rank has the new parameters'): "
     "every unit is whole between steps; breaks 'the next forward gathers them' and 1/N of the parameters at rest",
     _mut(Z3, ("        self.optimizer.step()\n\n    def zero_grad", "        self.optimizer.step()\n        for unit in self.all_units():\n            self.gather(unit)\n\n    def zero_grad"))),
    ("all_reduce of the flat gradient and the shard sliced out instead of a reduce-scatter: the same mean, but 2 instead "
     "of 1 (N-1)/N S bytes per unit, so 2x instead of 1.5x DDP's traffic; breaks 'dist.reduce_scatter_tensor into a new (S,) tensor'",
     _mut(Z3, ("        shard_grad = torch.empty(S, dtype=flat.dtype, device=flat.device)\n        dist.reduce_scatter_tensor(shard_grad, flat)\n",
               "        dist.all_reduce(flat)\n        shard_grad = flat[self.rank * S:(self.rank + 1) * S].clone()\n"))),
    ("gather all-gathers into the buffer without resizing its storage back (free() left 0 bytes): the collective "
     "writes into a tensor with no memory (error); breaks 'allocate the full buffer's storage again'",
     _mut(Z3, ("        full.untyped_storage().resize_(full.numel() * full.element_size())\n", ""))),
]

Z3_CORRECT = [
    ("`torch.distributed.*` in full; the padded gradient built with torch.cat of the p.grad and a zero tail; the "
     "storage size from untyped_storage().nbytes() kept on the unit; gather skips nothing; same algorithm",
     _mut(Z3, ("import torch.distributed as dist\n", "import torch.distributed\n"),
              ("        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()\n",
               "        self.world_size, self.rank = torch.distributed.get_world_size(), torch.distributed.get_rank()\n"),
              ("        self.shard = torch.nn.Parameter(self.full[rank * S:(rank + 1) * S].clone())\n",
               "        self.shard = torch.nn.Parameter(self.full[rank * S:(rank + 1) * S].clone())\n"
               "        self.full_nbytes = self.full.untyped_storage().nbytes()\n"),
              ("        full = unit.full\n        full.untyped_storage().resize_(full.numel() * full.element_size())\n"
               "        dist.all_gather_into_tensor(full, unit.shard.detach())\n",
               "        unit.full.untyped_storage().resize_(unit.full_nbytes)\n"
               "        torch.distributed.all_gather_into_tensor(unit.full, unit.shard.detach())\n"),
              ("        N, S = self.world_size, unit.shard_numel\n"
               "        flat = torch.zeros(N * S, dtype=unit.shard.dtype, device=unit.shard.device)\n"
               "        offset = 0\n"
               "        for p in unit.params:\n"
               "            n = p.numel()\n"
               "            if p.grad is not None:\n"
               "                flat[offset:offset + n].copy_(p.grad.reshape(-1))\n"
               "            p.grad = None\n"
               "            offset += n\n"
               "        shard_grad = torch.empty(S, dtype=flat.dtype, device=flat.device)\n"
               "        dist.reduce_scatter_tensor(shard_grad, flat)\n"
               "        del flat\n"
               "        shard_grad.div_(N)\n"
               "        unit.shard.grad = shard_grad\n",
               "        N, S = self.world_size, unit.shard_numel\n"
               "        pieces = [p.grad.reshape(-1) if p.grad is not None else unit.shard.new_zeros(p.numel())\n"
               "                  for p in unit.params]\n"
               "        used = sum(t.numel() for t in pieces)\n"
               "        flat = torch.cat(pieces + [unit.shard.new_zeros(N * S - used)])\n"
               "        for p in unit.params:\n"
               "            p.grad = None\n"
               "        del pieces\n"
               "        out = unit.shard.new_empty(S)\n"
               "        torch.distributed.reduce_scatter_tensor(out, flat, op=torch.distributed.ReduceOp.SUM)\n"
               "        del flat\n"
               "        unit.shard.grad = out / N\n"))),
]

# Z3_CORRECT overwrites the shard's gradient on a second backward before step(): written before the text asked for
# accumulation, it is a wrong answer now (answers.py adds the accumulation and keeps it as a correct variant).
WRONG_ANSWERS = {"sharded_optimizer": Z1_WRONG, "zero2": Z2_WRONG,
                 "zero3": [*Z3_WRONG, *[(f"(written before accumulation was asked for) {d}", s) for d, s in Z3_CORRECT]]}
CORRECT_VARIANTS = {"sharded_optimizer": Z1_CORRECT, "zero2": Z2_CORRECT}
BASELINES = {"sharded_optimizer": Z1, "zero2": Z2, "zero3": Z3}
