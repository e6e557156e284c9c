"""Wrong answers for lab 06 (see tests/wrong_answers/__init__.py).

Each is the solution's own cell with one mistake put in (``_changed`` checks that the text it replaces is
there, so a change to the solution cannot silently turn a wrong answer into the right one).
"""

from __future__ import annotations

from wrong_answers import SolutionCells

LAB = "06_ddp_from_scratch"
_cells = SolutionCells(LAB)
_solution, _changed = _cells.source, _cells.changed


_HOOK_LOOP = '''        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._grad_ready)'''

WRONG_ANSWERS = {
    "ddp_individual": [
        ("sums the gradients instead of averaging them", _changed(
            "ddp_individual", ("        param.grad.div_(self.world_size)           # the sum over ranks of grad / N is the mean\n", ""))),
        ("broadcasts only the trainable parameters (frozen ones and buffers keep each rank's own values)", _changed(
            "ddp_individual", ("for tensor in [*module.parameters(), *module.buffers()]:",
                               "for tensor in [p for p in module.parameters() if p.requires_grad]:"))),
        ("broadcasts the parameters but not the buffers", _changed(
            "ddp_individual", ("for tensor in [*module.parameters(), *module.buffers()]:", "for tensor in module.parameters():"))),
        ("all-reduces after the backward, in finish_gradient_synchronization: right numbers, no overlap", _changed(
            "ddp_individual", (_HOOK_LOOP, "        pass"),
            ("        for handle in self.handles:",
             "        for param in self.module.parameters():\n"
             "            if param.grad is not None:\n"
             "                self._grad_ready(param)\n"
             "        for handle in self.handles:"))),
        ("a blocking all-reduce inside the hook (no async_op): the backward waits for every all-reduce", _changed(
            "ddp_individual", ("        self.handles.append(dist.all_reduce(param.grad, async_op=True))",
                               "        dist.all_reduce(param.grad)"))),
        ("hooks registered per module (recurse=False): a tied weight is all-reduced twice", _changed(
            "ddp_individual", ("        for param in module.parameters():\n            if param.requires_grad:",
                               "        for param in [p for m in module.modules() for p in m.parameters(recurse=False)]:\n"
                               "            if param.requires_grad:"))),
    ],
    "assign_buckets": [
        ("closes a bucket once it reaches the cap (DDP's rule): a large parameter joins a partly filled bucket", _changed(
            "assign_buckets",
            ("        if current and filled + size > cap:        # does not fit: close the bucket, start a new one\n"
             "            buckets.append(current)\n            current, filled = [], 0\n        current.append(i)\n"
             "        filled += size\n",
             "        current.append(i)\n        filled += size\n        if filled >= cap:\n"
             "            buckets.append(current)\n            current, filled = [], 0\n"))),
        ("a bucket may not reach the cap exactly (>= instead of >)", _changed(
            "assign_buckets", ("if current and filled + size > cap:", "if current and filled + size >= cap:"))),
        ("counts MB as 10**6 bytes, not MiB", _changed("assign_buckets", ("cap = bucket_size_mb * MIB", "cap = bucket_size_mb * 1e6"))),
        ("returns the buckets last first", _changed("assign_buckets", ("    return buckets\n", "    return buckets[::-1]\n"))),
        ("after a parameter larger than the cap, the next ones join its bucket", _changed(
            "assign_buckets", ("        current.append(i)\n        filled += size\n",
                               "        current.append(i)\n        filled += size if size <= cap else 0\n"))),
    ],
    "ddp_bucketed": [
        ("sums the gradients instead of averaging them", _changed(
            "ddp_bucketed", ("flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.world_size)",
                             "flat = torch.cat([g.reshape(-1) for g in grads])"))),
        ("buckets filled in forward (registration) order", _changed(
            "ddp_bucketed", ("ready_order = [p for p in reversed(list(module.parameters())) if p.requires_grad]",
                             "ready_order = [p for p in module.parameters() if p.requires_grad]"))),
        ("a bucket whose parameter got no gradient is never flushed", _changed(
            "ddp_bucketed", ("            if self.in_flight[index] is None:      # (the same buckets, in the same order, on every rank)\n"
                             "                self._launch(index)\n", ""),
            ("        for index, (flat, handle) in enumerate(self.in_flight):\n",
             "        for index, launched in enumerate(self.in_flight):\n            if launched is None:\n"
             "                continue\n            flat, handle = launched\n"))),
        ("every bucket all-reduced in finish_gradient_synchronization: right numbers, no overlap", _changed(
            "ddp_bucketed", ("        if self.waiting[index] == 0:\n            self._launch(index)\n", ""))),
        ("not ready for the next step: the bucket counters are never reset", _changed(
            "ddp_bucketed", ("        self.waiting = [len(b) for b in self.buckets]     # ready for the next step\n"
                             "        self.in_flight = [None] * len(self.buckets)\n", ""))),
        ("ignores assign_buckets: one bucket per parameter", _changed(
            "ddp_bucketed", ("self.buckets = [[ready_order[i] for i in b] for b in assign_buckets(sizes, bucket_size_mb)]",
                             "self.buckets = [[p] for p in ready_order]"))),
        ("parameters collected per module: a tied weight is in two buckets", _changed(
            "ddp_bucketed", ("ready_order = [p for p in reversed(list(module.parameters())) if p.requires_grad]",
                             "ready_order = [p for m in reversed(list(module.modules())) for p in m.parameters(recurse=False)\n"
                             "                       if p.requires_grad]"))),
    ],
    "one_bucket_answer": [
        ("believes one bucket starts with the first gradient", 'one_bucket_answer = "a"'),
    ],
}

# A correct variant runs every test cell (a torchrun start each); the one here takes the other branch the
# contract allows for a parameter without a gradient (refuse, clearly, instead of sending zeros).
CORRECT_VARIANTS = {
    # The collectives spelled other ways: counted all the same (lablib.measure.counting counts torch's ops, not names).
    "ddp_individual": [
        ("all_reduce and broadcast imported by name (from torch.distributed import ...)", _changed(
            "ddp_individual", ("import torch.distributed as dist\n",
                               "import torch.distributed as dist\nfrom torch.distributed import all_reduce, broadcast\n"),
            ("                dist.broadcast(tensor, src=0)", "                broadcast(tensor, src=0)"),
            ("self.handles.append(dist.all_reduce(param.grad, async_op=True))",
             "self.handles.append(all_reduce(param.grad, async_op=True))"))),
        ("torch.distributed spelled in full, no alias", _changed(
            "ddp_individual", ("import torch.distributed as dist\n", "import torch.distributed\n"),
            ("self.world_size = dist.get_world_size()", "self.world_size = torch.distributed.get_world_size()"),
            ("                dist.broadcast(tensor, src=0)", "                torch.distributed.broadcast(tensor, src=0)"),
            ("self.handles.append(dist.all_reduce(param.grad, async_op=True))",
             "self.handles.append(torch.distributed.all_reduce(param.grad, async_op=True))"))),
    ],
    "assign_buckets": [
        ("builds the buckets from the boundaries", '''
%%writefile buckets_impl.py
def assign_buckets(param_bytes, bucket_size_mb):
    limit = bucket_size_mb * 1024 * 1024
    starts, total = [], None
    for i, n in enumerate(param_bytes):
        if total is None or total + n > limit:
            starts.append(i)
            total = 0
        total += n
    ends = starts[1:] + [len(param_bytes)]
    return [list(range(a, b)) for a, b in zip(starts, ends)]
'''),
    ],
    "ddp_bucketed": [
        ("refuses a parameter without a gradient with a clear error instead of sending zeros", _changed(
            "ddp_bucketed",
            ("            if self.in_flight[index] is None:      # (the same buckets, in the same order, on every rank)\n"
             "                self._launch(index)\n",
             "            if self.in_flight[index] is None:\n"
             "                for launched in self.in_flight:\n"
             "                    if launched is not None:\n"
             "                        launched[1].wait()\n"
             "                missing = [p.shape for p in self.buckets[index] if p.grad is None]\n"
             "                self.waiting, self.in_flight = [len(b) for b in self.buckets], [None] * len(self.buckets)\n"
             "                raise RuntimeError(f'parameters of shapes {missing} got no gradient (unused in forward); '\n"
             "                                   'this class needs every parameter used in every step')\n"))),
    ],
}
