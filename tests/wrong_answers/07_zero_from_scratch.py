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
    ],
}
