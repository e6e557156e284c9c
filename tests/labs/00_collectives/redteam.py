"""Lab 00 answers written by a reviewer who had read only the released notebook (no tests, no solution): ten or more
plausible wrong answers and two correct variants per exercise. tests/labkit.py appends them to answers.py's
lists. Two changes since: the broken script's TARGET_LOSS is now 1.0 (the stop fires inside the run; the reviewer's
fixed scripts copy the broken one, so they carry the new value), and exercise 4 now asks which tool does *not* name
the stuck rank (DETAIL does name it), so the reviewer's (d) is now the answer and (b) a wrong one."""

# ----------------------------------------------------------------------------------------------------------------
# predict
# ----------------------------------------------------------------------------------------------------------------
PREDICT_OK = r'''def _same_shapes(inputs, what):
    shapes = {tuple(x.shape) for x in inputs}
    if len(shapes) != 1:
        raise ValueError(f"{what}: every rank must pass a tensor of the same shape, got {sorted(shapes)}")


def predict_all_reduce(inputs):
    """[sum of inputs] * n: what dist.all_reduce leaves on each of the n ranks."""
    _same_shapes(inputs, "all_reduce")
    total = torch.stack(inputs).sum(dim=0)
    return [total.clone() for _ in inputs]


def predict_all_gather(inputs):
    """What dist.all_gather_into_tensor leaves on each rank: every rank's tensor, concatenated in rank order."""
    _same_shapes(inputs, "all_gather")
    gathered = torch.cat(inputs, dim=0)
    return [gathered.clone() for _ in inputs]


def predict_reduce_scatter(inputs):
    """What dist.reduce_scatter_tensor leaves on rank r: chunk r of the sum (dim 0 cut into n equal chunks)."""
    _same_shapes(inputs, "reduce_scatter")
    n = len(inputs)
    rows = inputs[0].shape[0]
    if rows % n:
        raise ValueError(f"reduce_scatter: dim 0 ({rows}) does not divide by the world size {n}")
    total = torch.stack(inputs).sum(dim=0)
    return [c.clone() for c in torch.split(total, rows // n, dim=0)]


def predict_all_to_all(inputs, splits=None):
    """What dist.all_to_all_single leaves on rank r: piece r of every rank's input, in rank order.
    splits[s] = the rows rank s sends to each rank (its input_split_sizes); None = equal splits."""
    n = len(inputs)
    if splits is None:
        splits = []
        for s, x in enumerate(inputs):
            if x.shape[0] % n:
                raise ValueError(f"all_to_all: rank {s}'s dim 0 ({x.shape[0]}) does not divide by {n}")
            splits.append([x.shape[0] // n] * n)
    if len(splits) != n:
        raise ValueError(f"all_to_all: {len(splits)} split lists for {n} ranks")
    for s, (x, row) in enumerate(zip(inputs, splits)):
        if len(row) != n:
            raise ValueError(f"all_to_all: rank {s}'s splits {row} do not have {n} entries")
        if sum(row) != x.shape[0]:
            raise ValueError(f"all_to_all: rank {s}'s splits {row} add up to {sum(row)}, not its {x.shape[0]} rows")
    pieces = [torch.split(x, list(row), dim=0) for x, row in zip(inputs, splits)]
    return [torch.cat([pieces[s][r] for s in range(n)], dim=0) for r in range(n)]
'''


def _predict(**replace):
    """PREDICT_OK with one function replaced (name -> new source of that function)."""
    src = PREDICT_OK
    for name, new in replace.items():
        start = src.index(f"def {name}(")
        end = src.find("\n\n\ndef ", start)
        end = len(src) if end < 0 else end
        src = src[:start] + new.strip("\n") + src[end:]
    return src


PREDICT_WRONG = [
    ("all_reduce accumulates into inputs[0] in place: mutates the caller's input ('do not modify the inputs')",
     _predict(predict_all_reduce=r'''
def predict_all_reduce(inputs):
    """[sum of inputs] * n: what dist.all_reduce leaves on each of the n ranks."""
    _same_shapes(inputs, "all_reduce")
    total = inputs[0]
    for x in inputs[1:]:
        total += x
    return [total.clone() for _ in inputs]''')),
    ("all_reduce returns the MEAN instead of the sum (all_reduce's default op is SUM)",
     _predict(predict_all_reduce=r'''
def predict_all_reduce(inputs):
    """[sum of inputs] * n: what dist.all_reduce leaves on each of the n ranks."""
    _same_shapes(inputs, "all_reduce")
    total = torch.stack(inputs).mean(dim=0)
    return [total.clone() for _ in inputs]''')),
    ("all_gather uses torch.stack (a new dimension) instead of concatenating along dim 0",
     _predict(predict_all_gather=r'''
def predict_all_gather(inputs):
    """What dist.all_gather_into_tensor leaves on each rank: every rank's tensor, concatenated in rank order."""
    _same_shapes(inputs, "all_gather")
    gathered = torch.stack(inputs)
    return [gathered.clone() for _ in inputs]''')),
    ("all_gather and all_reduce never raise ValueError on different shapes (cat/broadcasting accept them): breaks "
     "'raise a ValueError ... tensors of different shapes'; passes the visible check",
     _predict(_same_shapes=r'''
def _same_shapes(inputs, what):
    return None''')),
    ("reduce_scatter uses torch.chunk with no divisibility check: dim 0 not divisible by n gives uneven chunks "
     "(or fewer than n) instead of a ValueError; passes the visible check",
     _predict(predict_reduce_scatter=r'''
def predict_reduce_scatter(inputs):
    """What dist.reduce_scatter_tensor leaves on rank r: chunk r of the sum (dim 0 cut into n equal chunks)."""
    _same_shapes(inputs, "reduce_scatter")
    total = torch.stack(inputs).sum(dim=0)
    return [c.clone() for c in torch.chunk(total, len(inputs), dim=0)]''')),
    ("reduce_scatter gives rank r chunk r of its OWN input (forgets the reduction)",
     _predict(predict_reduce_scatter=r'''
def predict_reduce_scatter(inputs):
    """What dist.reduce_scatter_tensor leaves on rank r: chunk r of the sum (dim 0 cut into n equal chunks)."""
    _same_shapes(inputs, "reduce_scatter")
    n = len(inputs)
    rows = inputs[0].shape[0]
    if rows % n:
        raise ValueError("dim 0 does not divide by the world size")
    return [inputs[r][r * (rows // n):(r + 1) * (rows // n)].clone() for r in range(n)]''')),
    ("reduce_scatter flattens before chunking: wrong shape for multi-dimensional inputs (must split along dim 0); "
     "the divisibility test is on numel, not dim 0",
     _predict(predict_reduce_scatter=r'''
def predict_reduce_scatter(inputs):
    """What dist.reduce_scatter_tensor leaves on rank r: chunk r of the sum (dim 0 cut into n equal chunks)."""
    _same_shapes(inputs, "reduce_scatter")
    n = len(inputs)
    total = torch.stack(inputs).sum(dim=0).flatten()
    if total.numel() % n:
        raise ValueError("size does not divide by the world size")
    return [c.clone() for c in total.split(total.numel() // n)]''')),
    ("all_to_all cuts every sender with the RECEIVER's split row (splits[r] instead of splits[s]): right for "
     "equal splits (visible check), wrong for uneven splits",
     _predict(predict_all_to_all=r'''
def predict_all_to_all(inputs, splits=None):
    """What dist.all_to_all_single leaves on rank r: piece r of every rank's input, in rank order.
    splits[s] = the rows rank s sends to each rank (its input_split_sizes); None = equal splits."""
    n = len(inputs)
    if splits is None:
        for x in inputs:
            if x.shape[0] % n:
                raise ValueError("dim 0 does not divide by the world size")
        splits = [[x.shape[0] // n] * n for x in inputs]
    if len(splits) != n or any(len(row) != n or sum(row) != x.shape[0] for row, x in zip(splits, inputs)):
        raise ValueError("bad splits")
    out = []
    for r in range(n):
        start = sum(splits[r][:r])
        out.append(torch.cat([x[start:start + splits[r][r]] for x in inputs], dim=0))
    return out''')),
    ("all_to_all takes a strided slice x[r::n] (interleaved rows) instead of the contiguous chunk r: equal only "
     "when each chunk is one row",
     _predict(predict_all_to_all=r'''
def predict_all_to_all(inputs, splits=None):
    """What dist.all_to_all_single leaves on rank r: piece r of every rank's input, in rank order.
    splits[s] = the rows rank s sends to each rank (its input_split_sizes); None = equal splits."""
    n = len(inputs)
    if splits is not None:
        if len(splits) != n or any(len(row) != n or sum(row) != x.shape[0] for row, x in zip(splits, inputs)):
            raise ValueError("bad splits")
        pieces = [torch.split(x, list(row), dim=0) for x, row in zip(inputs, splits)]
        return [torch.cat([pieces[s][r] for s in range(n)], dim=0) for r in range(n)]
    for x in inputs:
        if x.shape[0] % n:
            raise ValueError("dim 0 does not divide by the world size")
    return [torch.cat([x[r::n] for x in inputs], dim=0) for r in range(n)]''')),
    ("all_to_all with splits never validates them (wrong count or wrong sum): torch.split raises RuntimeError, "
     "or a short list silently drops ranks, instead of a ValueError",
     _predict(predict_all_to_all=r'''
def predict_all_to_all(inputs, splits=None):
    """What dist.all_to_all_single leaves on rank r: piece r of every rank's input, in rank order.
    splits[s] = the rows rank s sends to each rank (its input_split_sizes); None = equal splits."""
    n = len(inputs)
    if splits is None:
        for x in inputs:
            if x.shape[0] % n:
                raise ValueError("dim 0 does not divide by the world size")
        splits = [[x.shape[0] // n] * n for x in inputs]
    pieces = [torch.split(x, list(row), dim=0) for x, row in zip(inputs, splits)]
    return [torch.cat([p[r] for p in pieces], dim=0) for r in range(n)]''')),
]

PREDICT_CORRECT = [
    ("all pure Python over chunk lists with functools.reduce(operator.add) and explicit slicing, no stack/split",
     r'''import functools
import operator


def _check_shapes(inputs, name):
    first = inputs[0].shape
    for r, x in enumerate(inputs):
        if x.shape != first:
            raise ValueError(f"{name}: rank {r} has shape {tuple(x.shape)}, rank 0 {tuple(first)}")


def predict_all_reduce(inputs):
    """[sum of inputs] * n: what dist.all_reduce leaves on each of the n ranks."""
    _check_shapes(inputs, "all_reduce")
    total = functools.reduce(operator.add, inputs)          # operator.add makes new tensors
    return [total + 0 for _ in inputs]


def predict_all_gather(inputs):
    """What dist.all_gather_into_tensor leaves on each rank: every rank's tensor, concatenated in rank order."""
    _check_shapes(inputs, "all_gather")
    return [torch.cat(list(inputs)) for _ in inputs]


def predict_reduce_scatter(inputs):
    """What dist.reduce_scatter_tensor leaves on rank r: chunk r of the sum (dim 0 cut into n equal chunks)."""
    _check_shapes(inputs, "reduce_scatter")
    n = len(inputs)
    if inputs[0].shape[0] % n != 0:
        raise ValueError(f"reduce_scatter: {inputs[0].shape[0]} rows do not divide into {n} equal chunks")
    k = inputs[0].shape[0] // n
    total = functools.reduce(operator.add, inputs)
    return [total[r * k:(r + 1) * k].clone() for r in range(n)]


def predict_all_to_all(inputs, splits=None):
    """What dist.all_to_all_single leaves on rank r: piece r of every rank's input, in rank order.
    splits[s] = the rows rank s sends to each rank (its input_split_sizes); None = equal splits."""
    n = len(inputs)
    if splits is None:
        if any(x.shape[0] % n for x in inputs):
            raise ValueError(f"all_to_all: a rank's rows do not divide by {n} and no splits were given")
        splits = [[x.shape[0] // n] * n for x in inputs]
    if len(splits) != n or any(len(row) != n for row in splits):
        raise ValueError(f"all_to_all: splits must be {n} lists of {n} sizes")
    offsets = []
    for s, (x, row) in enumerate(zip(inputs, splits)):
        if sum(row) != x.shape[0]:
            raise ValueError(f"all_to_all: rank {s}'s splits add up to {sum(row)}, it has {x.shape[0]} rows")
        offsets.append([sum(row[:r]) for r in range(n)])
    return [torch.cat([inputs[s][offsets[s][r]:offsets[s][r] + splits[s][r]] for s in range(n)]) for r in range(n)]
'''),
    ("stack+sum, cat, torch.split with a shared shape-check helper and full split validation (the direct way)",
     PREDICT_OK),
]

# ----------------------------------------------------------------------------------------------------------------
# job_setup
# ----------------------------------------------------------------------------------------------------------------
JOB_HEAD = '''%%writefile job_setup_impl.py
"""Exercise 2 of lab 00: the set-up and tear-down every torchrun script needs (written by the notebook)."""
import datetime
import os

import torch
import torch.distributed as dist
'''

SETUP_OK = r'''

def setup_distributed(timeout_s=60.0):
    """Join the job torchrun started: returns {"rank", "local_rank", "world_size", "backend", "device"}."""
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    timeout = datetime.timedelta(seconds=timeout_s)
    if n_gpus >= local_world_size:
        backend, device = "nccl", torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=timeout, device_id=device)
    else:
        backend = "gloo"
        device = torch.device("cuda", 0) if n_gpus > 0 else torch.device("cpu")
        dist.init_process_group(backend, timeout=timeout)
    return {"rank": rank, "local_rank": local_rank, "world_size": world_size, "backend": backend, "device": device}
'''

LOG_OK = r'''

def log0(info, message):
    """Print message on rank 0 only."""
    if info["rank"] == 0:
        print(message, flush=True)
'''

CKPT_OK = r'''

def checkpoint_round_trip(state, path, info):
    """Rank 0 saves state to path; every rank waits for it, then loads it onto its own device."""
    if info["rank"] == 0:
        torch.save(state, path)
    dist.barrier()
    return torch.load(path, map_location=info["device"])
'''

RUN_OK = r'''

def run_job(train, path, timeout_s=60.0):
    """Set up, train, checkpoint round trip, log on rank 0, return what was loaded; always tear down."""
    info = setup_distributed(timeout_s)
    try:
        state = train(info)
        loaded = checkpoint_round_trip(state, path, info)
        log0(info, f"checkpoint written to {path} by rank 0 and loaded on {info['world_size']} ranks")
        return loaded
    finally:
        dist.destroy_process_group()
'''


def _job(setup=SETUP_OK, log=LOG_OK, ckpt=CKPT_OK, run=RUN_OK, head=JOB_HEAD):
    return head + setup + log + ckpt + run


JOB_WRONG = [
    ("timeout passed as a float number of seconds, not a datetime.timedelta (init_process_group 'with a "
     "datetime.timedelta timeout')",
     _job(setup=SETUP_OK.replace("timeout = datetime.timedelta(seconds=timeout_s)", "timeout = timeout_s"))),
    ("timeout truncated to whole seconds (timedelta(seconds=int(timeout_s))): a fractional timeout_s is not kept "
     "to half a microsecond; passes the visible check (timeout 30.0)",
     _job(setup=SETUP_OK.replace("datetime.timedelta(seconds=timeout_s)", "datetime.timedelta(seconds=int(timeout_s))"))),
    ("every rank saves the checkpoint (n writers to one file): 'Save a checkpoint on rank 0 only'",
     _job(ckpt=CKPT_OK.replace('    if info["rank"] == 0:\n        torch.save(state, path)', '    torch.save(state, path)'))),
    ("the barrier is inside `if rank == 0` (only rank 0 calls it): the job hangs",
     _job(ckpt=CKPT_OK.replace('        torch.save(state, path)\n    dist.barrier()',
                               '        torch.save(state, path)\n        dist.barrier()'))),
    ("no barrier between rank 0's save and the loads: other ranks read a file that is missing or half written "
     "(rank 0's save is slow in the check)",
     _job(ckpt=CKPT_OK.replace("    dist.barrier()\n", ""))),
    ("torch.load without map_location: a checkpoint saved from cuda:0 would load onto cuda:0 on every rank",
     _job(ckpt=CKPT_OK.replace('torch.load(path, map_location=info["device"])', "torch.load(path)"))),
    ("destroy_process_group only after success (not in finally): a train that raises leaves the group alive",
     _job(run=r'''

def run_job(train, path, timeout_s=60.0):
    """Set up, train, checkpoint round trip, log on rank 0, return what was loaded; always tear down."""
    info = setup_distributed(timeout_s)
    state = train(info)
    loaded = checkpoint_round_trip(state, path, info)
    log0(info, f"checkpoint written to {path} by rank 0 and loaded on {info['world_size']} ranks")
    dist.destroy_process_group()
    return loaded
''')),
    ("the error of train is caught and swallowed (except: print; return None): the error must come out of run_job",
     _job(run=r'''

def run_job(train, path, timeout_s=60.0):
    """Set up, train, checkpoint round trip, log on rank 0, return what was loaded; always tear down."""
    info = setup_distributed(timeout_s)
    try:
        state = train(info)
        loaded = checkpoint_round_trip(state, path, info)
        log0(info, f"checkpoint written to {path} by rank 0 and loaded on {info['world_size']} ranks")
        return loaded
    except Exception as exc:
        log0(info, f"training failed: {exc}")
        return None
    finally:
        dist.destroy_process_group()
''')),
    ("log0 prints on every rank (checks info['local_rank'] truthiness the wrong way round / no rank test)",
     _job(log=r'''

def log0(info, message):
    """Print message on rank 0 only."""
    print(f"[rank {info['rank']}] {message}", flush=True)
''')),
    ("nccl whenever a GPU exists (torch.cuda.is_available()), on cuda:LOCAL_RANK even with fewer GPUs than local "
     "ranks; and no device_id: breaks step 1 (gloo on cuda:0 then) and step 2; passes the visible CPU-only check",
     _job(setup=r'''

def setup_distributed(timeout_s=60.0):
    """Join the job torchrun started: returns {"rank", "local_rank", "world_size", "backend", "device"}."""
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        backend, device = "nccl", torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return {"rank": rank, "local_rank": local_rank, "world_size": world_size, "backend": backend, "device": device}
''')),
    ("with fewer GPUs than local ranks it falls back to gloo on the CPU instead of cuda:0 (step 1 says every rank "
     "on cuda:0); passes the visible CPU-only check",
     _job(setup=SETUP_OK.replace('device = torch.device("cuda", 0) if n_gpus > 0 else torch.device("cpu")',
                                 'device = torch.device("cpu")'))),
]

JOB_CORRECT = [
    ("`import torch.distributed as c10d` style, a small dataclass-free helper for the env, timedelta(milliseconds=...)"
     " equivalent built with microseconds, nested try/finally",
     JOB_HEAD + r'''import torch.distributed as c10d


def _env_int(name, default=None):
    value = os.environ.get(name)
    return int(value) if value is not None else default


def setup_distributed(timeout_s=60.0):
    """Join the job torchrun started: returns {"rank", "local_rank", "world_size", "backend", "device"}."""
    rank, local_rank, world_size = _env_int("RANK"), _env_int("LOCAL_RANK"), _env_int("WORLD_SIZE")
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    gpus = torch.cuda.device_count()
    if gpus > 0 and gpus >= local_world_size:
        device = torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)
        c10d.init_process_group(backend="nccl", timeout=datetime.timedelta(seconds=timeout_s), device_id=device)
        backend = "nccl"
    else:
        device = torch.device("cuda:0") if gpus > 0 else torch.device("cpu")
        c10d.init_process_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        backend = "gloo"
    return dict(rank=rank, local_rank=local_rank, world_size=world_size, backend=backend, device=device)


def log0(info, message):
    """Print message on rank 0 only."""
    if info["rank"] != 0:
        return
    print(message, flush=True)


def checkpoint_round_trip(state, path, info):
    """Rank 0 saves state to path; every rank waits for it, then loads it onto its own device."""
    if info["rank"] == 0:
        torch.save(state, path)
    c10d.barrier()
    return torch.load(path, map_location=info["device"], weights_only=False)


def run_job(train, path, timeout_s=60.0):
    """Set up, train, checkpoint round trip, log on rank 0, return what was loaded; always tear down."""
    info = setup_distributed(timeout_s=timeout_s)
    try:
        loaded = checkpoint_round_trip(train(info), path, info)
        log0(info, f"rank 0 wrote {path}; all {info['world_size']} ranks loaded it")
    finally:
        c10d.destroy_process_group()
    return loaded
'''),
    ("the straightforward version (torch.distributed calls through `dist.`)", _job()),
]

# ----------------------------------------------------------------------------------------------------------------
# fix_script
# ----------------------------------------------------------------------------------------------------------------
FIX_HEAD = '''%%writefile fixed_train_impl.py
"""Data-parallel linear regression, by hand: each rank fits y = X w + b on its own shard of the data and the
ranks average their gradients before every step. Rank 0 decides when to stop and tells the others.

    torchrun --standalone --nproc-per-node 2 fixed_train_impl.py
"""
import datetime
import os

import torch
import torch.distributed as dist
'''

FIX_BODY = r'''
STEPS, LR, TARGET_LOSS = 30, 0.1, 1.0


def average_gradients(model, world_size):
    for p in model.parameters():                 # weight (1 x 4), then bias (1): two all-reduces
        dist.all_reduce(p.grad)
        p.grad /= world_size


def should_stop(loss):
    """Rank 0 decides from its loss; a broadcast tells every rank (a one-element tensor)."""
    stop = torch.tensor([float(loss.item() < TARGET_LOSS)])
    dist.broadcast(stop, src=0)
    return bool(stop.item())


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("PG_TIMEOUT_S", "60"))))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        torch.manual_seed(0)                              # the same data and initial model on every rank
        X = torch.randn(64, 4)
        y = X @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.25
        shard = slice(rank * len(X) // world_size, (rank + 1) * len(X) // world_size)
        model = torch.nn.Linear(4, 1)
        for step in range(STEPS):
            model.zero_grad()
            loss = torch.nn.functional.mse_loss(model(X[shard]).squeeze(1), y[shard])
            loss.backward()
            if rank == 0:
                print(f"step {step:2d}: loss on rank 0 {loss.item():.5f}", flush=True)
            average_gradients(model, world_size)          # every rank: the same collectives in the same order
            stop = should_stop(loss)
            with torch.no_grad():
                for p in model.parameters():
                    p -= LR * p.grad
            if stop:
                break
        checksum = sum(p.double().sum().item() for p in model.parameters())
        print(f"rank {rank} done after {step + 1} steps: weight checksum {checksum:.6f}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''

FIX_OK = FIX_HEAD + FIX_BODY

BROKEN_LOOP = r'''            if rank == 0:
                print(f"step {step:2d}: loss on rank 0 {loss.item():.5f}", flush=True)
            average_gradients(model, world_size)          # every rank: the same collectives in the same order
            stop = should_stop(loss)
'''

FIX_WRONG = [
    ("adds a dist.barrier() before the branches but keeps rank 0's broadcast-before-all-reduce order: still hangs "
     "(a barrier does not reorder collectives)",
     FIX_OK.replace(BROKEN_LOOP, r'''            dist.barrier()                                # make the ranks meet first
            if rank == 0:
                print(f"step {step:2d}: loss on rank 0 {loss.item():.5f}", flush=True)
                stop = should_stop(loss)
                average_gradients(model, world_size)
            else:
                average_gradients(model, world_size)
                stop = should_stop(loss)
''')),
    ("every rank prints the per-step loss (the print moved out of the rank-0 branch): 'Only rank 0 should print "
     "the per-step loss'",
     FIX_OK.replace(BROKEN_LOOP, r'''            print(f"step {step:2d}: loss on rank {rank} {loss.item():.5f}", flush=True)
            average_gradients(model, world_size)
            stop = should_stop(loss)
''')),
    ("removes the division by world_size (sums the gradients): twice the learning rate, weights differ from the "
     "one-process training ('averaged gradients')",
     FIX_OK.replace("        dist.all_reduce(p.grad)\n        p.grad /= world_size\n", "        dist.all_reduce(p.grad)\n")),
    ("each rank decides to stop from its own loss without the broadcast: rank 1 may stop at another step than rank "
     "0 (breaks 'rank 0's stop decision broadcast to every rank'; the ranks' step counts can differ or hang)",
     FIX_OK.replace(BROKEN_LOOP, r'''            if rank == 0:
                print(f"step {step:2d}: loss on rank 0 {loss.item():.5f}", flush=True)
            average_gradients(model, world_size)
            stop = bool(loss.item() < TARGET_LOSS)
''')),
    ("fixes the order by making every rank broadcast first, but broadcasts from each rank's own src=rank: the "
     "decision is no longer rank 0's, and mismatched broadcast roots hang/garble on gloo",
     FIX_OK.replace("    dist.broadcast(stop, src=0)\n", "    dist.broadcast(stop, src=dist.get_rank())\n")),
    ("drops should_stop entirely and always runs 30 steps: breaks 'Keep ... rank 0's stop decision broadcast to "
     "every rank' (may still match the step count if the target loss is never reached)",
     FIX_OK.replace(BROKEN_LOOP, r'''            if rank == 0:
                print(f"step {step:2d}: loss on rank 0 {loss.item():.5f}", flush=True)
            average_gradients(model, world_size)
            stop = False
''')),
]

FIX_CORRECT = [
    ("the fix the other way round: every rank calls should_stop FIRST, then averages (the same order on all ranks; "
     "the decision depends only on rank 0's local loss, so the result is unchanged)",
     FIX_OK.replace(BROKEN_LOOP, r'''            if rank == 0:
                print(f"step {step:2d}: loss on rank 0 {loss.item():.5f}", flush=True)
            stop = should_stop(loss)                      # every rank: broadcast first ...
            average_gradients(model, world_size)          # ... then the two all-reduces
''')),
    ("`from torch.distributed import all_reduce, broadcast` style, in-place div_ and p.add_(grad, alpha=-LR)",
     FIX_HEAD + FIX_BODY.replace("        dist.all_reduce(p.grad)\n        p.grad /= world_size\n",
                                 "        all_reduce(p.grad)\n        p.grad.div_(world_size)\n")
     .replace("    dist.broadcast(stop, src=0)\n", "    broadcast(stop, src=0)\n")
     .replace("                    p -= LR * p.grad\n", "                    p.add_(p.grad, alpha=-LR)\n")
     .replace("\nSTEPS, LR", "from torch.distributed import all_reduce, broadcast\n\nSTEPS, LR")),
]

# ----------------------------------------------------------------------------------------------------------------
# tool_answer (multiple choice, autograded by the hidden test of test_tool_answer)
# ----------------------------------------------------------------------------------------------------------------
TOOL_WRONG = [
    ("(a) DETAIL names mismatched collectives; the stuck rank never reaches a collective, so nothing mismatches",
     'tool_answer = "a"\n'),
    ("(b), the reviewer's answer to the old question: monitored_barrier does name the rank",
     'tool_answer = "B".lower()\n'),
]
TOOL_CORRECT = [
    ("(d), the reviewer's wrong answer to the old question: a plain barrier cannot name the rank that did not arrive",
     'tool_answer = "d"\n'),
]

WRONG_ANSWERS = {
    "predict": PREDICT_WRONG,
    "job_setup": JOB_WRONG,
    "fix_script": FIX_WRONG,
    "tool_answer": TOOL_WRONG,
}

CORRECT_VARIANTS = {
    "predict": PREDICT_CORRECT,
    "job_setup": JOB_CORRECT,
    "fix_script": FIX_CORRECT,
    "tool_answer": TOOL_CORRECT,
}
