"""Wrong answers for lab 00 (tests/labkit.py: the lab's answer files). The red team's (a reviewer who had read only the
released notebook) come from ``redteam.py`` beside this file, which labkit appends and are added to each list. Where one of
ours made the same mistake as one of the red team's, caught by the same check, the red team's is kept (ours dropped:
all_reduce summing in place into inputs[0]; reduce_scatter by torch.chunk without the divisibility error;
destroy_process_group outside a finally; and the correct variant that asks rank 0's decision before averaging, which
the red team's "the fix the other way round" is)."""



_PREDICT_REST = '''

def _same_shapes(inputs, name):
    shapes = [tuple(x.shape) for x in inputs]
    if len(set(shapes)) != 1:
        raise ValueError(f"{name}: different shapes {shapes}")


def predict_all_to_all(inputs, splits=None):
    n = len(inputs)
    if splits is None:
        if any(x.shape[0] % n for x in inputs):
            raise ValueError("rows do not split evenly")
        splits = [[x.shape[0] // n] * n for x in inputs]
    if len(splits) != n or any(len(row) != n or sum(row) != x.shape[0] for row, x in zip(splits, inputs)):
        raise ValueError(f"bad splits {splits}")
    pieces = [torch.split(x, list(row)) for x, row in zip(inputs, splits)]
    return [torch.cat([pieces[s][r] for s in range(n)]) for r in range(n)]
'''

_REDUCE_SCATTER = '''

def predict_reduce_scatter(inputs):
    n = len(inputs)
    _same_shapes(inputs, "reduce_scatter")
    if inputs[0].shape[0] % n:
        raise ValueError("rows do not divide")
    return [c.clone() for c in torch.stack(inputs).sum(0).chunk(n)]
'''

_ALL_REDUCE = '''
def predict_all_reduce(inputs):
    _same_shapes(inputs, "all_reduce")
    total = torch.stack(inputs).sum(0)
    return [total.clone() for _ in inputs]
'''

_ALL_GATHER = '''

def predict_all_gather(inputs):
    _same_shapes(inputs, "all_gather")
    return [torch.cat(inputs) for _ in inputs]
'''

_JOB_HEADER = '''%%writefile job_setup_impl.py
import datetime
import os

import torch
import torch.distributed as dist
'''

_SETUP_RIGHT = '''

def setup_distributed(timeout_s=60.0):
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world, local_world = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n_gpus >= local_world:
        backend, device = "nccl", torch.device(f"cuda:{local_rank}")
    elif n_gpus:
        backend, device = "gloo", torch.device("cuda:0")
    else:
        backend, device = "gloo", torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if backend == "nccl":
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), device_id=device)
    else:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dict(rank=rank, local_rank=local_rank, world_size=world, backend=backend, device=device)
'''

_LOG0 = '''

def log0(info, message):
    if info["rank"] == 0:
        print(message, flush=True)
'''

_ROUND_TRIP_RIGHT = '''

def checkpoint_round_trip(state, path, info):
    if info["rank"] == 0:
        torch.save(state, path)
    dist.barrier()
    return torch.load(path, map_location=info["device"])
'''

_RUN_JOB_RIGHT = '''

def run_job(train, path, timeout_s=60.0):
    info = setup_distributed(timeout_s)
    try:
        loaded = checkpoint_round_trip(train(info), path, info)
        log0(info, f"checkpoint {path} saved and loaded")
        return loaded
    finally:
        dist.destroy_process_group()
'''


def _setup_with(backend_line: str) -> str:
    return f'''

def setup_distributed(timeout_s=60.0):
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    {backend_line}
    kwargs = dict(timeout=datetime.timedelta(seconds=timeout_s))
    if backend == "nccl":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(backend, **kwargs)
    return dict(rank=rank, local_rank=local_rank, world_size=int(os.environ["WORLD_SIZE"]), backend=backend,
                device=device)
'''


_FIXED_HEAD = '''%%writefile fixed_train_impl.py
import datetime
import os

import torch
import torch.distributed as dist

STEPS, LR, TARGET_LOSS = 30, 0.1, 1.0


def average_gradients(model, world_size):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world_size


def should_stop(loss):
    stop = torch.tensor([float(loss.item() < TARGET_LOSS)])
    dist.broadcast(stop, src=0)
    return bool(stop.item())


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("PG_TIMEOUT_S", "60"))))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        torch.manual_seed(0)
        X = torch.randn(64, 4)
        y = X @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.25
        shard = slice(rank * len(X) // world_size, (rank + 1) * len(X) // world_size)
        model = torch.nn.Linear(4, 1)
        for step in range(STEPS):
            model.zero_grad()
            loss = torch.nn.functional.mse_loss(model(X[shard]).squeeze(1), y[shard])
            loss.backward()
'''

_FIXED_TAIL = '''            with torch.no_grad():
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

WRONG_ANSWERS = {
    "predict": [
        ("all_gather and all_reduce confused: all_gather returns the sum, all_reduce the concatenation",
         _PREDICT_REST + _REDUCE_SCATTER + '''

def predict_all_reduce(inputs):
    return [torch.cat(inputs) for _ in inputs]


def predict_all_gather(inputs):
    total = torch.stack(inputs).sum(0)
    return [total.clone() for _ in inputs]
'''),
        ("reduce_scatter returns the whole reduced tensor on every rank", _PREDICT_REST + _ALL_REDUCE + _ALL_GATHER + '''

def predict_reduce_scatter(inputs):
    total = torch.stack(inputs).sum(0)
    return [total.clone() for _ in inputs]
'''),
        ("all_to_all that gives rank r the pieces of its own input (no exchange)",
         _ALL_REDUCE.replace("def predict_all_reduce", "def _unused") + '''

def _same_shapes(inputs, name):
    if len({tuple(x.shape) for x in inputs}) != 1:
        raise ValueError(name)


def predict_all_to_all(inputs, splits=None):
    return [x.clone() for x in inputs]
''' + _ALL_REDUCE + _ALL_GATHER + _REDUCE_SCATTER),
        ("all_to_all as a transpose of elements: rank r gets element r of every rank (right only for chunks of 1)",
         _PREDICT_REST.split("def predict_all_to_all")[0] + _ALL_REDUCE + _ALL_GATHER + _REDUCE_SCATTER + '''

def predict_all_to_all(inputs, splits=None):
    n = len(inputs)
    if any(x.shape[0] % n for x in inputs):
        raise ValueError("rows do not split evenly")
    return [torch.stack([x[r] for x in inputs]) for r in range(n)]
'''),
        ("all_gather concatenates along the last dimension (the same as dim 0 for 1-D tensors only)",
         _PREDICT_REST + _ALL_REDUCE + _REDUCE_SCATTER + '''

def predict_all_gather(inputs):
    _same_shapes(inputs, "all_gather")
    return [torch.cat(inputs, dim=-1) for _ in inputs]
'''),
        ("reduce_scatter cuts the last dimension (the same as dim 0 for 1-D tensors only)",
         _PREDICT_REST + _ALL_REDUCE + _ALL_GATHER + '''

def predict_reduce_scatter(inputs):
    n = len(inputs)
    _same_shapes(inputs, "reduce_scatter")
    if inputs[0].shape[0] % n:
        raise ValueError("rows do not divide")
    return [c.clone() for c in torch.stack(inputs).sum(0).chunk(n, dim=-1)]
'''),
        ("all_reduce accumulates into a float32 zeros tensor: an int64 input comes back as float32",
         _PREDICT_REST + _ALL_GATHER + _REDUCE_SCATTER + '''

def predict_all_reduce(inputs):
    _same_shapes(inputs, "all_reduce")
    total = torch.zeros(inputs[0].shape)
    for x in inputs:
        total += x
    return [total.clone() for _ in inputs]
'''),
        ("all_to_all with uneven splits read the wrong way: splits[s][r] taken as what rank s receives from r",
         _PREDICT_REST.replace("pieces = [torch.split(x, list(row)) for x, row in zip(inputs, splits)]",
                               "pieces = [torch.split(x, [splits[r][s] for r in range(n)]) for s, x in enumerate(inputs)]")
         + _ALL_REDUCE + _ALL_GATHER + _REDUCE_SCATTER),
        # issue 42, kind "aliasing" (instructor/hidden_kinds.py): right values, one tensor object for all n ranks, so a
        # rank that writes into its result changes every rank's; it kept full marks before the hidden cell went through
        # hk.call (the check looked only for memory shared with the inputs)
        ("all_reduce returns the same tensor object for every rank ([total] * n)", _PREDICT_REST + _ALL_GATHER
         + _REDUCE_SCATTER + '''

def predict_all_reduce(inputs):
    _same_shapes(inputs, "all_reduce")
    total = torch.stack(inputs).sum(0)
    return [total] * len(inputs)
'''),
        # issue 42, kind "inputs": the caller's splits emptied in place; it kept full marks before (the check passed a
        # fresh copy of the splits and never looked at them afterwards)
        ("all_to_all pops each rank's split sizes off the caller's splits lists while handing out its rows",
         _PREDICT_REST.split("def predict_all_to_all")[0] + _ALL_REDUCE + _ALL_GATHER + _REDUCE_SCATTER + '''

def predict_all_to_all(inputs, splits=None):
    n = len(inputs)
    if splits is None:
        if any(x.shape[0] % n for x in inputs):
            raise ValueError("rows do not split evenly")
        splits = [[x.shape[0] // n] * n for x in inputs]
    if len(splits) != n or any(len(row) != n or sum(row) != x.shape[0] for row, x in zip(splits, inputs)):
        raise ValueError(f"bad splits {splits}")
    received = [[] for _ in range(n)]
    for x, row in zip(inputs, splits):
        start, r = 0, 0
        while row:                                  # hand this rank's rows out, one destination at a time
            size = row.pop(0)
            received[r].append(x[start:start + size])
            start, r = start + size, r + 1
    return [torch.cat(parts) for parts in received]
'''),
    ],
    "job_setup": [
        ("backend hard-coded to nccl", _JOB_HEADER + _setup_with(
            'backend, device = "nccl", torch.device("cuda", local_rank)') + _LOG0 + _ROUND_TRIP_RIGHT + _RUN_JOB_RIGHT),
        ("the barrier before the save instead of between the save and the loads", _JOB_HEADER + _SETUP_RIGHT + _LOG0 + '''

def checkpoint_round_trip(state, path, info):
    dist.barrier()
    if info["rank"] == 0:
        torch.save(state, path)
    return torch.load(path, map_location=info["device"])
''' + _RUN_JOB_RIGHT),
        ("the GPU chosen by RANK, not LOCAL_RANK (right on one node only)", _JOB_HEADER
         + _SETUP_RIGHT.replace('torch.device(f"cuda:{local_rank}")', 'torch.device(f"cuda:{rank}")')
         + _LOG0 + _ROUND_TRIP_RIGHT + _RUN_JOB_RIGHT),
        ("one GPU per rank judged against WORLD_SIZE, not LOCAL_WORLD_SIZE", _JOB_HEADER
         + _SETUP_RIGHT.replace("if n_gpus >= local_world:", "if n_gpus >= world:")
         + _LOG0 + _ROUND_TRIP_RIGHT + _RUN_JOB_RIGHT),
        ("no torch.cuda.set_device", _JOB_HEADER
         + _SETUP_RIGHT.replace("    if device.type == \"cuda\":\n        torch.cuda.set_device(device)\n", "")
         + _LOG0 + _ROUND_TRIP_RIGHT + _RUN_JOB_RIGHT),
        # issue 42, kind "inputs": the caller's state changed (a key added before the save); it kept full marks before
        # (only what the ranks loaded was checked, and an extra key is no error there)
        ("checkpoint_round_trip writes the world size into the caller's state before saving it", _JOB_HEADER
         + _SETUP_RIGHT + _LOG0 + '''

def checkpoint_round_trip(state, path, info):
    if info["rank"] == 0:
        state["world_size"] = info["world_size"]      # a note for whoever loads it
        torch.save(state, path)
    dist.barrier()
    return torch.load(path, map_location=info["device"])
''' + _RUN_JOB_RIGHT),
        # issue 42, kind "aliasing": rank 0 hands back the caller's own state (the live training tensors) instead of the
        # copy it read back; it kept full marks before (every rank loads once and gets rank 0's values)
        ("checkpoint_round_trip hands rank 0 back its own state object (it already holds it) instead of what it loaded",
         _JOB_HEADER + _SETUP_RIGHT + _LOG0 + '''

def checkpoint_round_trip(state, path, info):
    if info["rank"] == 0:
        torch.save(state, path)
    dist.barrier()
    loaded = torch.load(path, map_location=info["device"])
    return state if info["rank"] == 0 else loaded      # rank 0 saved this very state: no need for the copy
''' + _RUN_JOB_RIGHT),
    ],
    "fix_script": [
        ("stop when any rank's loss is low enough (an all-reduce of the flags with MAX)", _FIXED_HEAD + '''            if rank == 0:
                print(f"step {step:2d}: loss on rank 0 {loss.item():.5f}", flush=True)
            average_gradients(model, world_size)
            flag = torch.tensor([float(loss.item() < TARGET_LOSS)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
''' + _FIXED_TAIL),
    ],
    "tool_answer": [
        ("DETAIL: it does name the rank (its monitored barrier before every collective)", '''
tool_answer = "a"
'''),
        ("monitored_barrier, which names the rank that does not arrive", '''
tool_answer = "b"
'''),
    ],
}

CORRECT_VARIANTS = {
    "predict": [
        ("written with loops and explicit slicing instead of torch.stack/chunk", '''
def _check(inputs, name):
    if len({tuple(x.shape) for x in inputs}) != 1:
        raise ValueError(f"{name}: the ranks' tensors differ in shape")


def predict_all_reduce(inputs):
    _check(inputs, "all_reduce")
    total = inputs[0].clone()
    for x in inputs[1:]:
        total = total + x
    return [total.clone() for _ in inputs]


def predict_all_gather(inputs):
    _check(inputs, "all_gather")
    return [torch.cat([x.clone() for x in inputs]) for _ in inputs]


def predict_reduce_scatter(inputs):
    n = len(inputs)
    _check(inputs, "reduce_scatter")
    rows = inputs[0].shape[0]
    if rows % n != 0:
        raise ValueError(f"{rows} rows on {n} ranks")
    total = predict_all_reduce(inputs)[0]
    k = rows // n
    return [total[r * k:(r + 1) * k].clone() for r in range(n)]


def predict_all_to_all(inputs, splits=None):
    n = len(inputs)
    if splits is None:
        if any(x.shape[0] % n for x in inputs):
            raise ValueError("uneven rows without splits")
        splits = [[x.shape[0] // n] * n for x in inputs]
    out = [[] for _ in range(n)]
    for s, (x, row) in enumerate(zip(inputs, splits)):
        if len(row) != n or sum(row) != x.shape[0]:
            raise ValueError(f"rank {s}: splits {row} for {x.shape[0]} rows")
        start = 0
        for r, size in enumerate(row):
            out[r].append(x[start:start + size])
            start += size
    return [torch.cat(parts) for parts in out]
'''),
    ],
    "job_setup": [
        ("reads the environment with os.environ.get, torch.device strings, and destroys the group in an outer finally",
         _JOB_HEADER + '''

def setup_distributed(timeout_s=60.0):
    env = {k: int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_WORLD_SIZE", 1))}
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and gpus >= env["LOCAL_WORLD_SIZE"]:
        backend, device = "nccl", torch.device(f"cuda:{env['LOCAL_RANK']}")
        torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl", timeout=datetime.timedelta(seconds=timeout_s), device_id=device)
    else:
        backend, device = "gloo", torch.device("cuda:0" if gpus else "cpu")
        dist.init_process_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return {"rank": env["RANK"], "local_rank": env["LOCAL_RANK"], "world_size": env["WORLD_SIZE"],
            "backend": backend, "device": device}


def log0(info, message):
    if info["rank"] == 0:
        print(message)


def checkpoint_round_trip(state, path, info):
    if info["rank"] == 0:
        torch.save(state, path)
    dist.barrier()
    return torch.load(path, map_location=str(info["device"]), weights_only=True)


def run_job(train, path, timeout_s=60.0):
    try:
        info = setup_distributed(timeout_s)
        state = train(info)
        result = checkpoint_round_trip(state, path, info)
        log0(info, "checkpoint written by rank 0 and loaded everywhere")
        return result
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
'''),
        ("device_id and set_device given as the GPU's index (an int), rank and world size read from the group",
         _JOB_HEADER + '''

def setup_distributed(timeout_s=60.0):
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    options = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if n_gpus >= local_world:
        torch.cuda.set_device(local_rank)
        backend, device, options["device_id"] = "nccl", torch.device("cuda", local_rank), local_rank
    else:
        backend, device = "gloo", torch.device("cuda:0" if n_gpus else "cpu")
    dist.init_process_group(backend=backend, **options)
    return {"rank": dist.get_rank(), "local_rank": local_rank, "world_size": dist.get_world_size(),
            "backend": backend, "device": device}
''' + _LOG0 + _ROUND_TRIP_RIGHT + _RUN_JOB_RIGHT),
    ],
}

