"""Wrong answers for lab 06 (tests/labkit.py: the lab's answer files).

Most are the solution's own cell with one mistake put in (``_changed`` checks that the text it replaces is
there, so a change to the solution cannot silently turn a wrong answer into the right one); the red team's,
written from the released notebook alone, come from ``redteam.py`` beside this file, which labkit appends. Where one
of ours made the same mistake as one of the red team's, caught by the same check, the red team's is kept (ours
dropped: broadcasting the trainable parameters only; all-reduces started in finish_gradient_synchronization; a tied
weight hooked twice; a bucket that may not reach the cap; buckets launched as they complete, not in index order (the
red team's old-contract answers); buckets in registration order; bookkeeping never reset; every bucket launched in
finish_gradient_synchronization; the multiple choice's (a) and (d)).
"""

from __future__ import annotations


from labkit import SolutionCells

LAB = "06_ddp_from_scratch"
_cells = SolutionCells(LAB)
_solution, _changed = _cells.source, _cells.changed



_MARK_UNUSED = '''        if torch.is_grad_enabled():                        # unused parameters are ready now: no hook will come
            reached = reached_parameters(output)
            for i, p in enumerate(self.params):
                if id(p) not in reached:
                    self._mark_ready(i)
'''
_USED_LINE = ("        self.used = torch.zeros(len(self.params), device=self.params[0].device)   # 1 where this rank's "
              "backward\n")
_COUNT_DOWN = ("        self.waiting[self.bucket_of[i]] -= 1\n"
               "        while self.next_bucket < len(self.buckets) and self.waiting[self.next_bucket] == 0:\n")
_NEXT_BUCKET = "        self.next_bucket = 0                               # buckets go strictly in index order\n"
WRONG_ANSWERS = {
    "ddp_individual": [
        ("launches every all-reduce from the last hook (the first parameter's): async, before backward() returns, "
         "but nothing overlaps", _changed(
            "ddp_individual",
            ("        param.grad.div_(self.world_size)           # the sum over ranks of grad / N is the mean\n"
             "        self.handles.append(dist.all_reduce(param.grad, async_op=True))\n",
             "        first = next(p for p in self.module.parameters() if p.requires_grad)\n"
             "        if param is not first:\n"
             "            return\n"
             "        for p in self.module.parameters():\n"
             "            if p.grad is not None:\n"
             "                p.grad.div_(self.world_size)\n"
             "                self.handles.append(dist.all_reduce(p.grad, async_op=True))\n"))),
    # The hidden kinds (instructor/hidden_kinds.py): each kept full marks before them.
    ("steps: the list of handles is never cleared, so every step waits again for every earlier step's all-reduces "
     "(and keeps their gradients alive)", _changed("ddp_individual", ("        self.handles.clear()\n", ""))),
    ("gradients: the forward clears the module's gradients (every step starts clean), which throws away what a loop "
     "accumulates over several backwards", _changed(
         "ddp_individual", ("        return self.module(*args, **kwargs)\n",
                            "        self.module.zero_grad()\n        return self.module(*args, **kwargs)\n"))),
    ],
    "assign_buckets": [
        ("after a parameter larger than the cap, the next ones join its bucket", _changed(
            "assign_buckets", ("        current.append(i)\n        filled += size\n",
                               "        current.append(i)\n        filled += size if size <= cap else 0\n"))),
    ],
    "ddp_bucketed": [
        ("marks unused parameters only at the end of the backward, in finish: the first bucket (the parameters "
         "registered last) holds back every other", _changed(
            "ddp_bucketed", (_MARK_UNUSED, ""),
            ("        if self.next_bucket < len(self.buckets):\n            raise",
             "        reached = {id(p) for p in self.params if p.grad is not None}\n"
             "        for i, p in enumerate(self.params):\n"
             "            if id(p) not in reached:\n"
             "                self._mark_ready(i)\n"
             "        if self.next_bucket < len(self.buckets):\n            raise"))),
        ("zeros for a parameter no rank used (.grad set even where DDP leaves None)", _changed(
            "ddp_bucketed", ("                if used[i] > 0:                              # no rank used it: .grad stays None, as in DDP\n",
                             "                if True:\n"))),
        ("waits for each bucket inside the hook that launched it", _changed(
            "ddp_bucketed", ("        self.in_flight.append((flat.div_(self.world_size), dist.all_reduce(flat, async_op=True)))\n",
                             "        self.in_flight.append((flat.div_(self.world_size), dist.all_reduce(flat, async_op=True)))\n"
                             "        self.in_flight[-1][1].wait()\n"))),
        ("ignores assign_buckets: one bucket per parameter", _changed(
            "ddp_bucketed", ("self.buckets = assign_buckets([p.numel() * p.element_size() for p in self.params], bucket_size_mb)",
                             "self.buckets = [[i] for i in range(len(self.params))]"))),
        ("a refusal of unused parameters instead of handling them (allowed by the old contract, not by DDP's)", _changed(
            "ddp_bucketed", (_MARK_UNUSED, "        if torch.is_grad_enabled() and len(reached_parameters(output)) < len(self.params):\n"
                                           "            raise RuntimeError('a parameter got no gradient (unused in forward)')\n"))),
        # The hidden kinds (instructor/hidden_kinds.py): each kept full marks before them.
        ("steps: the usage map is made once in __init__, not every step: a parameter used in an earlier step counts "
         "as used (its .grad set to zeros) in a step where no rank uses it", _changed(
            "ddp_bucketed", (_USED_LINE, ""), ("        self._new_step()\n\n    def _new_step",
                                               _USED_LINE + "        self._new_step()\n\n    def _new_step"))),
        ("gradients: a bucket counts as complete once every parameter in it has a .grad (or is unused), which "
         "zero_grad(set_to_none=False) and accumulated gradients make true before the backward starts", _changed(
            "ddp_bucketed", (_COUNT_DOWN, "        if self.params[i].grad is None:\n            self.no_grad.add(i)\n"
                                          "        while self.next_bucket < len(self.buckets) and all(\n"
                                          "                self.params[j].grad is not None or j in self.no_grad "
                                          "for j in self.buckets[self.next_bucket]):\n"),
            (_NEXT_BUCKET, _NEXT_BUCKET + "        self.no_grad = set()\n"))),
        ("readiness: a bucket counts as complete when its last parameter in bucket order is ready (gradients assumed "
         "to arrive in reverse registration order)", _changed(
            "ddp_bucketed", ("        self.waiting[self.bucket_of[i]] -= 1\n",
                             "        self.waiting[self.bucket_of[i]] -= 1\n"
                             "        if i == self.buckets[self.bucket_of[i]][-1]:\n"
                             "            self.waiting[self.bucket_of[i]] = 0\n"))),
    ],
    # one_bucket_answer: the red team's (a) and (d) (redteam.py), the same two choices ours were
}

# A correct variant runs every test cell (torchrun starts, visible and hidden): a few, each a different spelling.
CORRECT_VARIANTS = {
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
        ("`import buckets_impl`, persistent flat buckets with every gradient a view into them (DDP's "
         "gradient_as_bucket_view), unused parameters marked at the first hook (as DDP's reducer does), an int32 "
         "usage map, and an abstract helper raising NotImplementedError with a message", '''
%%writefile ddp_bucketed_impl.py
import torch
import torch.distributed as dist
import torch.nn as nn

import buckets_impl


class _Synchronizer(nn.Module):
    def _reduce(self, flat):
        raise NotImplementedError("subclasses choose how a bucket is reduced")


def _leaves(output):
    todo, seen, found = [output], set(), set()
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            todo.append(x.grad_fn)
        elif isinstance(x, (tuple, list)):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif x is not None and not isinstance(x, (int, float, str)) and id(x) not in seen:
            seen.add(id(x))
            if type(x).__name__ == "AccumulateGrad":
                found.add(id(x.variable))
            todo.extend(f for f, _ in x.next_functions)
    return found


class DDPBucketed(_Synchronizer):
    def __init__(self, module, bucket_size_mb):
        super().__init__()
        self.module = module
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.detach(), 0)
        order = [p for p in module.parameters() if p.requires_grad][::-1]
        groups = buckets_impl.assign_buckets([p.numel() * p.element_size() for p in order], bucket_size_mb)
        self._groups = [[order[i] for i in g] for g in groups]
        self._flat = [torch.zeros(sum(p.numel() for p in g), dtype=g[0].dtype) for g in self._groups]
        self._where, self._slot = {}, {}
        for k, g in enumerate(self._groups):
            offset = 0
            for p in g:
                self._where[id(p)], self._slot[id(p)] = k, (offset, p.numel())
                offset += p.numel()
                p.register_post_accumulate_grad_hook(self._grad_ready)
        self._order, self._pos = order, {id(p): i for i, p in enumerate(order)}
        self._reset()

    def _reset(self):
        self._left = [len(g) for g in self._groups]
        self._next, self._works, self._unused, self._local = 0, [], None, torch.zeros(len(self._order), dtype=torch.int32)

    def _view(self, p):
        k = self._where[id(p)]
        offset, n = self._slot[id(p)]
        return self._flat[k][offset:offset + n].view_as(p)

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        reached = _leaves(out)
        self._unused = [p for p in self._order if id(p) not in reached]
        return out

    def _ready(self, p):
        self._left[self._where[id(p)]] -= 1
        while self._next < len(self._groups) and self._left[self._next] == 0:
            self._works.append(self._reduce(self._flat[self._next]))
            self._next += 1

    def _grad_ready(self, param):
        if self._unused:                       # the first hook of the step marks the unused ones, as DDP's reducer
            unused, self._unused = self._unused, None
            for p in unused:                   # its .grad (a loop may keep one) in its place, zeros where None
                if p.grad is None:
                    self._view(p).zero_()
                else:
                    self._view(p).copy_(p.grad)
                self._ready(p)
        self._local[self._pos[id(param)]] = 1
        view = self._view(param)
        if param.grad is not view:
            view.copy_(param.grad)
            param.grad = view                  # from now on autograd writes into the bucket itself
        self._ready(param)

    def _reduce(self, flat):
        flat.div_(dist.get_world_size())
        return dist.all_reduce(flat, async_op=True)

    def finish_gradient_synchronization(self):
        anyone = self._local.clone()
        dist.all_reduce(anyone)
        for work in self._works:
            work.wait()
        for i, p in enumerate(self._order):
            if anyone[i] > 0:
                p.grad = self._view(p)
        self._reset()
'''),
    ],
}
