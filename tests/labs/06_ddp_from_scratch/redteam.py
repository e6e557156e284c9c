"""Lab 06 answers written by a reviewer who had read only the released notebook (no tests, no solution), before the
bucket-order contract: ten or more plausible wrong answers and two correct variants per exercise. tests/labkit.py
appends them to answers.py's lists; the bucketed "correct" ones launch each bucket when it is complete, which the
contract now forbids, so they are wrong answers (WRONG_ANSWERS below)."""


# ----------------------------------------------------------------------------------------------------------------
# ddp_individual
# ----------------------------------------------------------------------------------------------------------------
IND_HEAD = '''%%writefile ddp_individual_impl.py
"""Exercise 1 of lab 06: one asynchronous all-reduce per parameter (this file is written by the notebook)."""
import torch
import torch.distributed as dist
import torch.nn as nn
'''

IND_INIT = r'''

class DDPIndividualParameters(nn.Module):
    """Data parallelism with one all-reduce per parameter, started as soon as that gradient is ready."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self._handles = []
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=0)
        for p in module.parameters():                     # parameters() lists a tied weight once
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._grad_ready)
'''

IND_HOOK = r'''
    def _grad_ready(self, param):
        """The hook: runs inside backward once param.grad holds this step's whole gradient on this rank."""
        self._handles.append((param, dist.all_reduce(param.grad, async_op=True)))
'''

IND_FWD = r'''
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)
'''

IND_FINISH = r'''
    def finish_gradient_synchronization(self):
        world_size = dist.get_world_size()
        for param, handle in self._handles:
            handle.wait()
            param.grad.div_(world_size)
        self._handles.clear()
'''


def _ind(init=IND_INIT, hook=IND_HOOK, fwd=IND_FWD, finish=IND_FINISH):
    return IND_HEAD + init + hook + fwd + finish


IND_OK = _ind()

IND_WRONG = [
    ("sums the gradients without dividing by the world size: .grad must hold the MEAN over ranks",
     _ind(finish=IND_FINISH.replace("            param.grad.div_(world_size)\n", ""))),
    ("broadcasts only trainable parameters: frozen ones keep each rank's own values ('all of them, frozen ones "
     "included')",
     _ind(init=IND_INIT.replace("for tensor in [*module.parameters(), *module.buffers()]:",
                                "for tensor in [*(p for p in module.parameters() if p.requires_grad), *module.buffers()]:"))),
    ("broadcasts parameters but not buffers: a buffer (input scale, running mean) differs per rank ('and buffers')",
     _ind(init=IND_INIT.replace("for tensor in [*module.parameters(), *module.buffers()]:",
                                "for tensor in module.parameters():"))),
    ("blocking all-reduce in the hook (no async_op): nothing overlaps; breaks 'starts dist.all_reduce(..., "
     "async_op=True)'",
     _ind(hook=r'''
    def _grad_ready(self, param):
        """The hook: runs inside backward once param.grad holds this step's whole gradient on this rank."""
        dist.all_reduce(param.grad)
        self._handles.append(param)
''', finish=r'''
    def finish_gradient_synchronization(self):
        world_size = dist.get_world_size()
        for param in self._handles:
            param.grad.div_(world_size)
        self._handles.clear()
''')),
    ("hook only records the parameter; all all-reduces are launched in finish_gradient_synchronization after "
     "backward() returned: overlap lost",
     _ind(hook=r'''
    def _grad_ready(self, param):
        """The hook: runs inside backward once param.grad holds this step's whole gradient on this rank."""
        self._handles.append(param)
''', finish=r'''
    def finish_gradient_synchronization(self):
        world_size = dist.get_world_size()
        works = [(p, dist.all_reduce(p.grad, async_op=True)) for p in self._handles]
        for p, work in works:
            work.wait()
            p.grad.div_(world_size)
        self._handles.clear()
''')),
    ("never clears the handle list: the second step waits on the first step's handles again and divides those "
     "parameters' grads once more ('the next step starts clean')",
     _ind(finish=IND_FINISH.replace("        self._handles.clear()\n", ""))),
    ("registers hooks over named_parameters(remove_duplicate=False): a tied weight gets two hooks and is "
     "all-reduced twice per step ('all-reduced once per step'); the two in-flight all-reduces on one tensor race",
     _ind(init=IND_INIT.replace("        for p in module.parameters():                     # parameters() lists a tied weight once\n",
                                "        for _, p in module.named_parameters(remove_duplicate=False):\n"))),
    ("launches with async_op=True but waits on the handle right inside the hook: the backward blocks on every "
     "all-reduce, nothing overlaps (the wait belongs in finish_gradient_synchronization, 'before the optimizer "
     "step'); the order-of-events check cannot see it",
     _ind(hook=r'''
    def _grad_ready(self, param):
        """The hook: runs inside backward once param.grad holds this step's whole gradient on this rank."""
        handle = dist.all_reduce(param.grad, async_op=True)
        handle.wait()
        self._handles.append((param, handle))
''')),
    ("skips communication on one rank (if world_size == 1: return): breaks 'always all-reduce, also on one rank'",
     _ind(hook=r'''
    def _grad_ready(self, param):
        """The hook: runs inside backward once param.grad holds this step's whole gradient on this rank."""
        if dist.get_world_size() == 1:
            return
        self._handles.append((param, dist.all_reduce(param.grad, async_op=True)))
''')),
    ("divides by a hard-coded 2 (the worked example's N = 2): wrong mean on 3 or 4 ranks",
     _ind(finish=IND_FINISH.replace("param.grad.div_(world_size)", "param.grad.div_(2)"))),
    ("wraps a deep copy of the model (self.module = copy.deepcopy(module)): '.module is the wrapped model' and the "
     "caller's model/optimizer no longer see the trained weights",
     _ind(init=IND_INIT.replace("        self.module = module\n", "        import copy\n        self.module = copy.deepcopy(module)\n")
          .replace("module.parameters()", "self.module.parameters()").replace("module.buffers()", "self.module.buffers()"))),
]

IND_CORRECT = [
    ("`import torch.distributed as c10d`, divides BEFORE the all-reduce (sum of g/N is the mean), handles kept in a "
     "dict keyed by parameter name; broadcast through a flat buffer per dtype is avoided, plain per-tensor broadcast",
     IND_HEAD + r'''import torch.distributed as c10d


class DDPIndividualParameters(nn.Module):
    """Data parallelism with one all-reduce per parameter, started as soon as that gradient is ready."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self._works = {}
        for _, tensor in list(module.named_parameters()) + list(module.named_buffers()):
            with torch.no_grad():
                c10d.broadcast(tensor.detach(), src=0)
        self._names = {}
        for name, p in module.named_parameters():
            if p.requires_grad:
                self._names[p] = name
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, param):
        """The hook: runs inside backward once param.grad holds this step's whole gradient on this rank."""
        param.grad.div_(c10d.get_world_size())
        self._works[self._names[param]] = c10d.all_reduce(param.grad, op=c10d.ReduceOp.SUM, async_op=True)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        works, self._works = self._works, {}
        for work in works.values():
            work.wait()
'''),
    ("`from torch.distributed import ...` style, ReduceOp.AVG is not on gloo so it all-reduces SUM and uses "
     "torch.Tensor.mul_(1/N)... no: divides with torch.div out-of-place assigned back; handles as futures via "
     "get_future().wait()",
     IND_HEAD + r'''from torch.distributed import all_reduce, broadcast, get_world_size


class DDPIndividualParameters(nn.Module):
    """Data parallelism with one all-reduce per parameter, started as soon as that gradient is ready."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self._inflight = []
        with torch.no_grad():
            for p in self.module.parameters():
                broadcast(p, src=0)
            for b in self.module.buffers():
                broadcast(b, src=0)
        for p in self.module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, param):
        """The hook: runs inside backward once param.grad holds this step's whole gradient on this rank."""
        work = all_reduce(param.grad, async_op=True)
        self._inflight.append((param, work))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        n = get_world_size()
        while self._inflight:
            param, work = self._inflight.pop(0)
            work.get_future().wait()
            param.grad = torch.div(param.grad, n)
'''),
]

# ----------------------------------------------------------------------------------------------------------------
# assign_buckets
# ----------------------------------------------------------------------------------------------------------------
BUCKET_HEAD = '''%%writefile buckets_impl.py
"""Exercise 2 of lab 06: gradient buckets (this file is written by the notebook)."""

MIB = 2**20   # "MB" of a bucket cap, as DDP's bucket_cap_mb counts it

'''

ASSIGN_OK = BUCKET_HEAD + r'''
def assign_buckets(param_bytes, bucket_size_mb):
    """Buckets (lists of indices into param_bytes) of consecutive parameters, at most bucket_size_mb MiB each;
    a parameter larger than the cap alone in its bucket."""
    cap = bucket_size_mb * MIB
    buckets, current, filled = [], [], 0
    for i, size in enumerate(param_bytes):
        if current and filled + size <= cap:
            current.append(i)
            filled += size
        else:
            if current:
                buckets.append(current)
            current, filled = [i], size
    if current:
        buckets.append(current)
    return buckets
'''

ASSIGN_WRONG = [
    ("strict `<` against the cap: a bucket that would be exactly the cap is split ('stays within the cap' "
     "includes equal)",
     ASSIGN_OK.replace("filled + size <= cap", "filled + size < cap")),
    ("DDP's rule instead of the stated one: add first, close once the bucket REACHES/exceeds the cap, so a bucket "
     "can go over the cap and a large parameter shares a bucket",
     BUCKET_HEAD + r'''
def assign_buckets(param_bytes, bucket_size_mb):
    """Buckets (lists of indices into param_bytes) of consecutive parameters, at most bucket_size_mb MiB each;
    a parameter larger than the cap alone in its bucket."""
    cap = bucket_size_mb * MIB
    buckets, current, filled = [], [], 0
    for i, size in enumerate(param_bytes):
        current.append(i)
        filled += size
        if filled >= cap:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets
'''),
    ("MB read as 10^6 bytes instead of MiB (2^20), against 'MB means MiB as in DDP's bucket_cap_mb'",
     ASSIGN_OK.replace("cap = bucket_size_mb * MIB", "cap = bucket_size_mb * 1_000_000")),
    ("forgets the last bucket after the loop: the last parameters get no bucket ('every index exactly once')",
     ASSIGN_OK.replace("    if current:\n        buckets.append(current)\n    return buckets", "    return buckets")),
    ("a too-large parameter is put in its own bucket at once while the open bucket stays open: buckets no longer "
     "consecutive/in order",
     BUCKET_HEAD + r'''
def assign_buckets(param_bytes, bucket_size_mb):
    """Buckets (lists of indices into param_bytes) of consecutive parameters, at most bucket_size_mb MiB each;
    a parameter larger than the cap alone in its bucket."""
    cap = bucket_size_mb * MIB
    buckets, current, filled = [], [], 0
    for i, size in enumerate(param_bytes):
        if size > cap:
            buckets.append([i])
            continue
        if filled + size > cap:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += size
    if current:
        buckets.append(current)
    return buckets
'''),
    ("reverses the order itself (thinks it must turn registration order into ready order): the input is already "
     "in ready order, so buckets come out reversed",
     BUCKET_HEAD + r'''
def assign_buckets(param_bytes, bucket_size_mb):
    """Buckets (lists of indices into param_bytes) of consecutive parameters, at most bucket_size_mb MiB each;
    a parameter larger than the cap alone in its bucket."""
    cap = bucket_size_mb * MIB
    buckets, current, filled = [], [], 0
    for i in reversed(range(len(param_bytes))):
        size = param_bytes[i]
        if current and filled + size <= cap:
            current.append(i)
            filled += size
        else:
            if current:
                buckets.append(current)
            current, filled = [i], size
    if current:
        buckets.append(current)
    return buckets
'''),
    ("rounds the cap to whole bytes with round(): a fractional cap (e.g. 0.05 MiB = 52428.8 B) admits a "
     "52429-byte bucket, over the cap; passes the visible checks (whole-byte caps)",
     ASSIGN_OK.replace("cap = bucket_size_mb * MIB", "cap = round(bucket_size_mb * MIB)")),
    ("an empty first bucket when the first parameter is larger than the cap (appends `current` even when empty)",
     ASSIGN_OK.replace("            if current:\n                buckets.append(current)\n",
                       "            buckets.append(current)\n")),
]

ASSIGN_CORRECT = [
    ("builds buckets by start indices with itertools.accumulate-free index arithmetic; compares integer bytes "
     "against floor(cap), which is equivalent for whole-byte sizes",
     BUCKET_HEAD + r'''import math


def assign_buckets(param_bytes, bucket_size_mb):
    """Buckets (lists of indices into param_bytes) of consecutive parameters, at most bucket_size_mb MiB each;
    a parameter larger than the cap alone in its bucket."""
    cap = math.floor(bucket_size_mb * MIB)
    starts = []
    filled = None
    for i, size in enumerate(param_bytes):
        if filled is None or filled + size > cap:
            starts.append(i)
            filled = size
        else:
            filled += size
    ends = starts[1:] + [len(param_bytes)]
    return [list(range(a, b)) for a, b in zip(starts, ends)]
'''),
]

# ----------------------------------------------------------------------------------------------------------------
# ddp_bucketed
# ----------------------------------------------------------------------------------------------------------------
BUCK_HEAD = '''%%writefile ddp_bucketed_impl.py
"""Exercise 3 of lab 06: bucketed all-reduce overlapped with the backward (this file is written by the notebook)."""
import torch
import torch.distributed as dist
import torch.nn as nn

from buckets_impl import assign_buckets   # exercise 2
'''

BUCK_INIT = r'''

class DDPBucketed(nn.Module):
    """Data parallelism with one flat all-reduce per bucket, started when the bucket's last gradient is ready."""

    def __init__(self, module: nn.Module, bucket_size_mb: float):
        super().__init__()
        self.module = module
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=0)
        self._ready_order = [p for p in module.parameters() if p.requires_grad][::-1]
        sizes = [p.numel() * p.element_size() for p in self._ready_order]
        self._buckets = [list(b) for b in assign_buckets(sizes, bucket_size_mb)]
        self._bucket_of = {}
        for b, indices in enumerate(self._buckets):
            for i in indices:
                self._bucket_of[self._ready_order[i]] = b
        self._missing = [len(b) for b in self._buckets]
        self._works = {}
        for p in self._ready_order:
            p.register_post_accumulate_grad_hook(self._grad_ready)
'''

BUCK_HOOK = r'''
    def _grad_ready(self, param):
        """The hook: runs inside backward once param.grad holds this step's whole gradient on this rank."""
        b = self._bucket_of[param]
        self._missing[b] -= 1
        if self._missing[b] == 0:
            self._launch(b)
'''

BUCK_LAUNCH = r'''
    def _launch(self, index):
        """Start the asynchronous all-reduce of bucket ``index`` as one flat buffer."""
        params = [self._ready_order[i] for i in self._buckets[index]]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        self._works[index] = (dist.all_reduce(flat, async_op=True), flat)
'''

BUCK_FWD = r'''
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)
'''

BUCK_FINISH = r'''
    def finish_gradient_synchronization(self):
        for b in range(len(self._buckets)):        # buckets with a parameter that got no gradient: zeros in its place
            if b not in self._works:
                self._launch(b)
        world_size = dist.get_world_size()
        for b in sorted(self._works):
            work, flat = self._works[b]
            work.wait()
            flat.div_(world_size)
            offset = 0
            for i in self._buckets[b]:
                p = self._ready_order[i]
                n = p.numel()
                if p.grad is not None:
                    p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n
        self._works = {}
        self._missing = [len(b) for b in self._buckets]
'''


def _buck(init=BUCK_INIT, hook=BUCK_HOOK, launch=BUCK_LAUNCH, fwd=BUCK_FWD, finish=BUCK_FINISH):
    return BUCK_HEAD + init + hook + launch + fwd + finish


BUCK_OK = _buck()

BUCK_WRONG = [
    ("all-reduces the flat buffer but never copies the result back into .grad (thinks torch.cat returns views): "
     "grads stay local, replicas drift apart ('copy the means back into each .grad')",
     _buck(finish=BUCK_FINISH.replace("                if p.grad is not None:\n                    p.grad.copy_(flat[offset:offset + n].view_as(p.grad))\n", ""))),
    ("sums instead of averaging (no division by the world size)",
     _buck(finish=BUCK_FINISH.replace("            flat.div_(world_size)\n", ""))),
    ("counters not reset after a step and leftovers not launched: from the second step on no bucket reaches zero, "
     "no all-reduce runs ('ready for the next step without any reset call')",
     _buck(finish=r'''
    def finish_gradient_synchronization(self):
        world_size = dist.get_world_size()
        for b in sorted(self._works):
            work, flat = self._works[b]
            work.wait()
            flat.div_(world_size)
            offset = 0
            for i in self._buckets[b]:
                p = self._ready_order[i]
                n = p.numel()
                if p.grad is not None:
                    p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n
        self._works = {}
''')),
    ("one all-reduce per parameter inside _launch (loops over the bucket's grads): not 'one flat buffer' per bucket",
     _buck(launch=r'''
    def _launch(self, index):
        """Start the asynchronous all-reduce of bucket ``index`` as one flat buffer."""
        params = [self._ready_order[i] for i in self._buckets[index]]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        works = [dist.all_reduce(p.grad, async_op=True) for p in params]
        flat = None
        self._works[index] = (works, flat)
''', finish=r'''
    def finish_gradient_synchronization(self):
        for b in range(len(self._buckets)):
            if b not in self._works:
                self._launch(b)
        world_size = dist.get_world_size()
        for b in sorted(self._works):
            works, _ = self._works[b]
            for w in works:
                w.wait()
            for i in self._buckets[b]:
                self._ready_order[i].grad.div_(world_size)
        self._works = {}
        self._missing = [len(b) for b in self._buckets]
''')),
    ("sizes passed to assign_buckets in registration (forward) order, not reverse: the first bucket to fill is the "
     "last in the list, so every bucket launches only at the end of the backward and assign_buckets gets the wrong list",
     _buck(init=BUCK_INIT.replace("[p for p in module.parameters() if p.requires_grad][::-1]",
                                  "[p for p in module.parameters() if p.requires_grad]"))),
    ("all buckets launched from finish_gradient_synchronization (hooks only count): overlap lost, every all-reduce "
     "after backward() returned",
     _buck(hook=r'''
    def _grad_ready(self, param):
        """The hook: runs inside backward once param.grad holds this step's whole gradient on this rank."""
        self._missing[self._bucket_of[param]] -= 1
''')),
    ("blocking all-reduce of the bucket (no async_op): correct numbers, no overlap ('start one asynchronous "
     "all-reduce')",
     _buck(launch=BUCK_LAUNCH.replace("dist.all_reduce(flat, async_op=True), flat)",
                                      "dist.all_reduce(flat), flat)")
           , finish=BUCK_FINISH.replace("            work.wait()\n", "            work.wait() if work is not None else None\n"))),
    ("no handling of unused parameters: a bucket with a parameter that gets no gradient is never launched, its other "
     "gradients are never averaged (no error, no zeros): breaks 'must not hang ... handle it or refuse'",
     _buck(finish=BUCK_FINISH.replace("        for b in range(len(self._buckets)):        # buckets with a parameter that got no gradient: zeros in its place\n            if b not in self._works:\n                self._launch(b)\n", ""))),
    ("broadcasts parameters only, not buffers: the ToyNet's input_scale buffer differs per rank",
     _buck(init=BUCK_INIT.replace("for tensor in [*module.parameters(), *module.buffers()]:", "for tensor in module.parameters():"))),
    ("counts a tied weight twice (named_parameters(remove_duplicate=False)): sizes list has the tied weight twice "
     "('a tied weight once') and its bucket waits for a second hook that never comes",
     _buck(init=BUCK_INIT.replace("[p for p in module.parameters() if p.requires_grad][::-1]",
                                  "[p for _, p in module.named_parameters(remove_duplicate=False) if p.requires_grad][::-1]"))),
    ("calls assign_buckets again at every step in finish (not 'once')",
     _buck(finish=BUCK_FINISH.replace("        self._works = {}\n",
                                      "        self._works = {}\n        self._buckets = [list(b) for b in assign_buckets([p.numel() * p.element_size() for p in self._ready_order], self._cap)]\n")
           , init=BUCK_INIT.replace("        self.module = module\n", "        self.module = module\n        self._cap = bucket_size_mb\n"))),
]

BUCK_CORRECT = [
    ("`import torch.distributed as c10d`; the flat buffer is allocated once per bucket at construction and the "
     "grads are copied in by slices; bucket readiness tracked with sets of parameter ids; unused parameters filled "
     "with zeros in finish",
     BUCK_HEAD + r'''import torch.distributed as c10d


class DDPBucketed(nn.Module):
    """Data parallelism with one flat all-reduce per bucket, started when the bucket's last gradient is ready."""

    def __init__(self, module: nn.Module, bucket_size_mb: float):
        super().__init__()
        self.module = module
        for t in list(module.parameters()) + list(module.buffers()):
            with torch.no_grad():
                c10d.broadcast(t.detach(), src=0)
        trainable = [p for p in module.parameters() if p.requires_grad]
        self._order = list(reversed(trainable))
        buckets = assign_buckets([p.numel() * p.element_size() for p in self._order], bucket_size_mb)
        self._buckets = [[self._order[i] for i in b] for b in buckets]
        self._flats = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device)
                       for b in self._buckets]
        self._where = {id(p): k for k, b in enumerate(self._buckets) for p in b}
        self._arrived = [set() for _ in self._buckets]
        self._works = [None] * len(self._buckets)
        for p in trainable:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, param):
        """The hook: runs inside backward once param.grad holds this step's whole gradient on this rank."""
        k = self._where[id(param)]
        self._arrived[k].add(id(param))
        if len(self._arrived[k]) == len(self._buckets[k]):
            self._launch(k)

    def _launch(self, index):
        """Start the asynchronous all-reduce of bucket ``index`` as one flat buffer."""
        flat, offset = self._flats[index], 0
        for p in self._buckets[index]:
            n = p.numel()
            if p.grad is None:
                flat[offset:offset + n].zero_()
            else:
                flat[offset:offset + n].copy_(p.grad.reshape(-1))
            offset += n
        self._works[index] = c10d.all_reduce(flat, async_op=True)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for k in range(len(self._buckets)):
            if self._works[k] is None:
                self._launch(k)
        n_ranks = c10d.get_world_size()
        for k, work in enumerate(self._works):
            work.wait()
            flat, offset = self._flats[k], 0
            for p in self._buckets[k]:
                n = p.numel()
                if p.grad is not None:
                    p.grad.copy_(flat[offset:offset + n].view_as(p.grad) / n_ranks)
                offset += n
        self._works = [None] * len(self._buckets)
        self._arrived = [set() for _ in self._buckets]
'''),
    ("the direct version (dict of bucket -> (work, flat), counters reset in finish)", BUCK_OK),
]

# ----------------------------------------------------------------------------------------------------------------
# one_bucket_answer
# ----------------------------------------------------------------------------------------------------------------
ONE_WRONG = [
    ("(a): a bucket launches when its LAST gradient is ready, not its first", 'one_bucket_answer = "a"\n'),
    ("(d): gloo does not overlap chunks of an all-reduce with a backward that has already ended", 'one_bucket_answer = "d"\n'),
]
ONE_CORRECT = [
    ("(b), written through a variable", 'choice = "b"\none_bucket_answer = choice\n'),
]


# ----------------------------------------------------------------------------------------------------------------
# A later red team's answers that kept full marks (each cell is their reference answer with one change)
# ----------------------------------------------------------------------------------------------------------------
RT3_IND_REF = r'''%%writefile ddp_individual_impl.py
"""Exercise 1 of lab 06: one asynchronous all-reduce per parameter (this file is written by the notebook)."""
import torch
import torch.distributed as dist
import torch.nn as nn


class DDPIndividualParameters(nn.Module):
    """Data parallelism with one all-reduce per parameter, started as soon as that gradient is ready."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t.data, src=0)
        self._handles = []
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, param):
        """The hook: runs inside backward once param.grad holds this step's whole gradient on this rank."""
        param.grad.div_(dist.get_world_size())
        self._handles.append(dist.all_reduce(param.grad, async_op=True))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for h in self._handles:
            h.wait()
        self._handles = []
'''

RT3_ASSIGN_REF = r'''%%writefile buckets_impl.py
"""Exercise 2 of lab 06: gradient buckets (this file is written by the notebook)."""

MIB = 2**20   # "MB" of a bucket cap, as DDP's bucket_cap_mb counts it


def assign_buckets(param_bytes, bucket_size_mb):
    """Buckets (lists of indices into param_bytes) of consecutive parameters, at most bucket_size_mb MiB each;
    a parameter larger than the cap alone in its bucket."""
    cap = bucket_size_mb * MIB
    buckets, current, size = [], [], 0
    for i, b in enumerate(param_bytes):
        if current and size + b > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += b
    if current:
        buckets.append(current)
    return buckets
'''

RT3_BUCK_REF = r'''%%writefile ddp_bucketed_impl.py
"""Exercise 3 of lab 06: bucketed all-reduce overlapped with the backward (this file is written by the notebook)."""
import torch
import torch.distributed as dist
import torch.nn as nn

from buckets_impl import assign_buckets   # exercise 2


def reached_parameters(output) -> set:
    """ids of the leaf tensors the autograd graph of ``output`` (a tensor, or tuples, lists, dicts of them)
    reaches: DDP's search for unused parameters at the end of the forward. A leaf that requires grad appears
    in the graph as an AccumulateGrad node, whose ``.variable`` is the leaf."""
    roots, stack = [], [output]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            if o.grad_fn is not None:
                roots.append(o.grad_fn)
            elif o.requires_grad:
                roots.append(None); found_leaf = o
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    reached, seen, stack = set(), set(), [r for r in roots if r is not None]
    for o in ([output] if isinstance(output, torch.Tensor) else []):
        if o.grad_fn is None and o.requires_grad:
            reached.add(id(o))
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):
            reached.add(id(fn.variable))
        stack.extend(f for f, _ in fn.next_functions if f is not None)
    return reached


class DDPBucketed(nn.Module):
    """Data parallelism with one flat all-reduce per bucket, launched in bucket order as soon as it is full."""

    def __init__(self, module: nn.Module, bucket_size_mb: float):
        super().__init__()
        self.module = module
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t.data, src=0)
        self._params = list(reversed([p for p in module.parameters() if p.requires_grad]))
        self._index = {id(p): i for i, p in enumerate(self._params)}
        sizes = [p.numel() * p.element_size() for p in self._params]
        self._buckets = assign_buckets(sizes, bucket_size_mb)
        self._bucket_of = {}
        for k, b in enumerate(self._buckets):
            for i in b:
                self._bucket_of[i] = k
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        self._new_step()

    def _new_step(self):
        """Bookkeeping for a new step (the buckets stay): called at the end of __init__ and of
        finish_gradient_synchronization."""
        self._ready = [False] * len(self._params)
        self._missing = [len(b) for b in self._buckets]
        self._next = 0
        self._used = torch.zeros(len(self._params))
        self._flats = {}
        self._handles = []

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        if torch.is_grad_enabled():
            reached = reached_parameters(out)
            for i, p in enumerate(self._params):
                if id(p) not in reached:
                    self._mark_ready(i)
        return out

    def _grad_ready(self, param):
        """The hook: runs inside backward once param.grad holds this step's whole gradient on this rank."""
        i = self._index[id(param)]
        self._used[i] = 1.0
        self._mark_ready(i)

    def _mark_ready(self, i):
        """Parameter i (its index in reverse registration order, the order assign_buckets saw) is ready: launch
        every bucket that may go now, in index order."""
        if self._ready[i]:
            return
        self._ready[i] = True
        self._missing[self._bucket_of[i]] -= 1
        while self._next < len(self._buckets) and self._missing[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, index):
        """Start the asynchronous all-reduce of bucket ``index`` as one flat buffer."""
        parts = []
        for i in self._buckets[index]:
            p = self._params[i]
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            parts.append(g.detach().reshape(-1))
        flat = torch.cat(parts).div_(dist.get_world_size())
        self._flats[index] = flat
        self._handles.append(dist.all_reduce(flat, async_op=True))

    def finish_gradient_synchronization(self):
        for h in self._handles:
            h.wait()
        dist.all_reduce(self._used)
        for k, b in enumerate(self._buckets):
            flat, offset = self._flats[k], 0
            for i in b:
                p = self._params[i]
                n = p.numel()
                if self._used[i] > 0:
                    mean = flat[offset:offset + n].view_as(p)
                    if p.grad is None:
                        p.grad = mean.clone()
                    else:
                        p.grad.copy_(mean)
                offset += n
        self._new_step()
'''


def _rt3(old, new, ref=None):
    ref = RT3_BUCK_REF if ref is None else ref
    assert old in ref, old
    return ref.replace(old, new)


RT3_IND_WRONG = [
    ("waits only for the last handle ('gloo runs them in order'): the other all-reduces may still be writing their "
     ".grad when the optimizer reads it (caught by chance before: every handle must now be waited for)",
     _rt3("        for h in self._handles:\n            h.wait()\n",
          "        if self._handles:\n            self._handles[-1].wait()   # gloo runs them in order\n", RT3_IND_REF)),
]

RT3_ASSIGN_WRONG = [
    ("caches its answers and returns the same list again: a caller that changed the first answer gets the change "
     "back from the next call",
     _rt3("    cap = bucket_size_mb * MIB\n",
          "    key = (tuple(param_bytes), bucket_size_mb)\n    if key in _cache:\n        return _cache[key]\n"
          "    cap = bucket_size_mb * MIB\n", RT3_ASSIGN_REF)
     .replace("def assign_buckets(", "_cache = {}\n\n\ndef assign_buckets(", 1)
     .replace("        buckets.append(current)\n    return buckets", "        buckets.append(current)\n    _cache[key] = buckets\n    return buckets", 1)),
]


RT3_BUCK_WRONG = [
    ("zeros in the bucket for a parameter this rank did not use even where it already has a .grad (the loop "
     "accumulates): its .grad must go in its place, zeros only where .grad is None (routed with .grad kept: "
     "0.063 from the single process)",
     _rt3("g = p.grad if p.grad is not None else torch.zeros_like(p)",
          "g = p.grad if (p.grad is not None and self._used[i] > 0) else torch.zeros_like(p)")),
    ("reached_parameters ignores dict outputs ('a tensor, or tuples, lists, dicts of them'): on a forward that "
     "returns a dict it reaches no parameter, every bucket goes out with zeros at the forward's end",
     _rt3("        elif isinstance(o, dict):\n            stack.extend(o.values())\n", "")),
    ("reached_parameters follows output[0] only, and the forward marks unused parameters also in a no_grad "
     "forward: a second output's own parameters go out as zeros at the forward's end",
     _rt3("        if torch.is_grad_enabled():\n            reached = reached_parameters(out)",
          "        if True:\n            reached = reached_parameters(out)")
     .replace('    roots, stack = [], [output]\n',
              '    if isinstance(output, (tuple, list)):\n        output = output[0]          # the first output carries the graph\n'
              '    roots, stack = [], [output]\n', 1)),
]

WRONG_ANSWERS = {
    "ddp_individual": [*IND_WRONG, *RT3_IND_WRONG],
    "assign_buckets": [*ASSIGN_WRONG, *RT3_ASSIGN_WRONG],
    "ddp_bucketed": [*BUCK_WRONG, *[(f"(old contract's correct variant) {d}", s) for d, s in BUCK_CORRECT],
                     *RT3_BUCK_WRONG],
    "one_bucket_answer": ONE_WRONG,
}

CORRECT_VARIANTS = {
    "ddp_individual": IND_CORRECT,
    "assign_buckets": ASSIGN_CORRECT,
    "one_bucket_answer": ONE_CORRECT,
}
