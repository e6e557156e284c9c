"""Wrong answers for lab 07 (see tests/wrong_answers/__init__.py): the solution's own cells, one mistake each."""

from __future__ import annotations

from wrong_answers import SolutionCells

LAB = "07_zero_from_scratch"
_cells = SolutionCells(LAB)
_changed = _cells.changed

_GREEDY = '''        for p in sorted(group["params"], key=lambda p: p.numel() * p.element_size(), reverse=True):
            rank = min(range(self.world_size), key=lambda r: self.owned_bytes[r])
            self.owner[p] = rank'''

WRONG_ANSWERS = {
    "sharded_optimizer": [
        # Every one fails in the rehearsal on ranks that are threads (no torchrun start). This one at world size 1:
        # the late group's parameters are never updated.
        ("add_param_group after construction records the group but never gives it to the inner optimizer", _changed(
            "sharded_optimizer", ("        if self.inner is not None:                    # a group added after construction\n"
                                  "            self.inner.add_param_group(self._owned([group])[0])\n", ""))),
        ("no sharding: every rank's inner optimizer gets every parameter (plain AdamW on each rank)", _changed(
            "sharded_optimizer", ('"params": [p for p in g["params"] if self.owner[p] == self.rank]}',
                                  '"params": list(g["params"])}'))),
        ("the owner forgets to send: no broadcast after the inner step", _changed(
            "sharded_optimizer", ("                    dist.broadcast(p, src=self.owner[p])   # the owner's updated values, on every rank",
                                  "                    pass"))),
        ("every parameter broadcast from rank 0, not from its owner", _changed(
            "sharded_optimizer", ("dist.broadcast(p, src=self.owner[p])", "dist.broadcast(p, src=0)"))),
        ("owners assigned round-robin by count, not balanced by size", _changed(
            "sharded_optimizer", (_GREEDY, '''        for p in group["params"]:
            rank = len(self.owner) % self.world_size
            self.owner[p] = rank'''))),
        ("step() never copies the outer groups' hyperparameters: an lr schedule does not reach the inner optimizer",
         _changed("sharded_optimizer", ("            mine.update({k: v for k, v in group.items() if k != \"params\"})   "
                                        "# e.g. an lr schedule's new lr\n", "            pass\n"))),
    ],
    "zero2": [
        # Caught in this process (world size 1): the full gradients are still there after step().
        ("keeps the full gradients after the reduce-scatter (p.grad never freed)", _changed(
            "zero2", ("            p.grad = None                                         # the full gradient is not kept\n", ""))),
        ("sums the gradients over the ranks instead of averaging them", _changed(
            "zero2", ("        self.shard.grad = shard_grad.div_(self.world_size)        # the mean\n",
                      "        self.shard.grad = shard_grad\n"))),
        ("no all-gather after the step: each rank has only its own shard updated", _changed(
            "zero2", ("        dist.all_gather_into_tensor(self.flat, self.shard.detach().clone())   # every rank's new shard\n", ""))),
        ("a padding element leaks into the update: shard r starts at r * (numel // N), not r * S", _changed(
            "zero2", ("        start = self.rank * self.shard_numel\n",
                      "        start = self.rank * (numel // self.world_size)\n"))),
        ("all-reduces the whole flat gradient and keeps its own slice (right numbers, twice the bytes)", _changed(
            "zero2", ("        dist.reduce_scatter_tensor(shard_grad, grads)             # sum over ranks of shard r -> rank r\n",
                      "        dist.all_reduce(grads)\n"
                      "        shard_grad.copy_(grads[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel])\n"))),
        ("all-gathers the parameters with N broadcasts, one per owner", _changed(
            "zero2", ("        dist.all_gather_into_tensor(self.flat, self.shard.detach().clone())   # every rank's new shard\n",
                      "        for r in range(self.world_size):\n"
                      "            dist.broadcast(self.flat[r * self.shard_numel:(r + 1) * self.shard_numel], src=r)\n"))),
    ],
}

WRONG_ANSWERS["zero3"] = [
    # Each fails in the rehearsal on ranks that are threads (no torchrun start); the first two at world size 1.
    ("never frees a block after its forward: every block's full parameters stay gathered through the forward",
     _changed("zero3", ("until its backward.\"\"\"\n        self.free(unit)\n", "until its backward.\"\"\"\n        pass\n"))),
    ("does not gather a block again for its backward (the backward finds its weights freed)",
     _changed("zero3", ("saved views of them).\"\"\"\n        self.gather(unit)\n",
                        "saved views of them).\"\"\"\n        pass\n"))),
    ("sums the gradients over the ranks instead of averaging them", _changed(
        "zero3", ("        shard_grad.div_(self.world_size)                           # the mean\n", ""))),
    ("a second micro-batch overwrites the shard's gradient instead of adding to it", _changed(
        "zero3", ("        if unit.shard.grad is None:\n            unit.shard.grad = shard_grad\n"
                  "        else:                                                      # a second micro-batch: accumulate\n"
                  "            unit.shard.grad += shard_grad\n", "        unit.shard.grad = shard_grad\n"))),
    ("frees the blocks only in step(), not during the backward", _changed(
        "zero3", ("        self.free(unit)                                            # its backward is done\n", ""),
                 ("        self.optimizer.step()\n", "        self.optimizer.step()\n"
                  "        for unit in self.all_units():\n            self.free(unit)\n"))),
    ("all-reduces each block's gradient and keeps its own slice", _changed(
        "zero3", ("        dist.reduce_scatter_tensor(shard_grad, grads)              # sum over ranks of shard r -> rank r\n",
                  "        dist.all_reduce(grads)\n"
                  "        shard_grad.copy_(grads[self.rank * unit.shard_numel:(self.rank + 1) * unit.shard_numel])\n"))),
    ("gathers a block with N broadcasts, one per rank's shard", _changed(
        "zero3", ("        dist.all_gather_into_tensor(unit.full, unit.shard.detach())\n",
                  "        for r in range(self.world_size):\n"
                  "            piece = unit.full[r * unit.shard_numel:(r + 1) * unit.shard_numel]\n"
                  "            if r == self.rank:\n                piece.copy_(unit.shard.detach())\n"
                  "            dist.broadcast(piece, src=r)\n"))),
    ("a padding element leaks into the update: shard r starts at r * (numel // N), not r * S", _changed(
        "zero3", ("        start = rank * self.shard_numel\n", "        start = rank * (numel // world_size)\n"))),
    ("keeps the full gradients after the reduce-scatter (p.grad never freed)", _changed(
        "zero3", ("            p.grad = None                                          # the full gradient is not kept\n",
                  ""))),
]


def _by_name(exercise: str, functions: str, *calls: str) -> str:
    """The solution's cell with its torch.distributed functions imported by name (``from torch.distributed import
    broadcast``) instead of called through the module: counting and the thread rehearsal must not mind."""
    return _changed(exercise, ("import torch.distributed as dist\n", f"from torch.distributed import {functions}\n"),
                    *((f"dist.{name}(", f"{name}(") for name in calls))


CORRECT_VARIANTS = {
    "sharded_optimizer": [
        ("the collectives imported by name: from torch.distributed import broadcast, get_rank, get_world_size",
         _by_name("sharded_optimizer", "broadcast, get_rank, get_world_size", "get_world_size", "get_rank", "broadcast")),
    ],
    "zero2": [
        ("the collectives imported by name: from torch.distributed import reduce_scatter_tensor, ...",
         _by_name("zero2", "all_gather_into_tensor, get_rank, get_world_size, reduce_scatter_tensor",
                  "get_world_size", "get_rank", "reduce_scatter_tensor", "all_gather_into_tensor")),
    ],
    "zero3": [
        ("divides before the reduce-scatter and pads the gradient with torch.cat (the mean of the ranks' 1/N-scaled "
         "gradients)", _changed("zero3", (
             """        grads = torch.zeros(self.world_size * unit.shard_numel, dtype=unit.shard.dtype, device=unit.shard.device)
        offset = 0
        for p in unit.params:
            grads[offset:offset + p.numel()].copy_(p.grad.flatten())
            p.grad = None                                          # the full gradient is not kept
            offset += p.numel()
        shard_grad = torch.empty_like(unit.shard)                  # (S,)
        dist.reduce_scatter_tensor(shard_grad, grads)              # sum over ranks of shard r -> rank r
        shard_grad.div_(self.world_size)                           # the mean
        if unit.shard.grad is None:
            unit.shard.grad = shard_grad
        else:                                                      # a second micro-batch: accumulate
            unit.shard.grad += shard_grad
""",
             """        flat = [p.grad.flatten() / self.world_size for p in unit.params]
        padding = self.world_size * unit.shard_numel - sum(g.numel() for g in flat)
        grads = torch.cat(flat + [flat[0].new_zeros(padding)])
        for p in unit.params:
            p.grad = None
        mine = torch.empty_like(unit.shard)
        dist.reduce_scatter_tensor(mine, grads)
        unit.shard.grad = mine if unit.shard.grad is None else unit.shard.grad + mine
"""))),
    ],
}
