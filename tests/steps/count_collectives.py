"""Every collective the course counts, on 2 ranks, through lablib.measure.counting (tests/test_lablib_counting.py)."""

import json
import time

import torch
import torch.distributed as d
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import all_reduce                      # bound before any block, as a student's module does
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.distributed_c10d import all_reduce as c10d_all_reduce
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP

from lablib.measure import counting

dist.init_process_group("gloo")
rank = dist.get_rank()
x = torch.ones(16)                                        # 64 bytes
with counting.count_collectives() as log:
    dist.all_reduce(x.clone())
    dist.all_gather_into_tensor(torch.empty(32), x)
    dist.all_gather([torch.empty(16), torch.empty(16)], x)
    dist.reduce_scatter_tensor(torch.empty(16), torch.ones(32))
    dist.all_to_all_single(torch.empty(16), x)
    dist.broadcast(x.clone(), src=0)
    dist.scatter(torch.empty(16), [torch.ones(16), torch.ones(16)] if rank == 0 else None, src=0)
    dist.gather(x, [torch.empty(16), torch.empty(16)] if rank == 0 else None, dst=0)
    if rank == 0:
        dist.isend(x, dst=1).wait()
    else:
        dist.irecv(torch.empty(16), src=0).wait()
    dist.barrier()
calls = [c.__dict__ for c in log.calls]

mesh = init_device_mesh("cpu", (2,))
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
for unit in (model[0], model[1], model):
    fully_shard(unit, mesh=mesh)
with counting.count_collectives() as fsdp:
    model(torch.randn(4, 8)).sum().backward()

ddp = DDP(torch.nn.Linear(8, 8))
with counting.count_collectives() as wrapper:
    hook = counting.count_ddp(ddp)
    hook.phase = "backward"
    ddp(torch.randn(4, 8)).sum().backward()
    backward_returned = time.perf_counter()
    hook.phase = None
    async_log = counting.CollectiveLog(phase="async")
with counting.count_collectives(async_log):
    work = dist.all_reduce(torch.ones(1 << 16), async_op=True)
    work.wait()
    deadline = time.monotonic() + 30                      # the future's callback runs on gloo's thread: wait for
    while async_log.calls[0].done_s is None and time.monotonic() < deadline:   # it, however busy the machine
        time.sleep(0.01)
bucket = hook.calls[0]


# However the collective is spelled, each in its own block: what was recorded, and whether it completed.
def spelled(run) -> list[dict]:
    with counting.count_collectives() as log:
        run()
    return [{k: getattr(c, k) for k in ("name", "function", "bytes", "ranks", "asynchronous")}
            | {"done": c.done_s is not None and c.done_s >= c.launched_s} for c in log.calls]


sharded = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])           # (2, 4) on each rank
ddp_plain = DDP(torch.nn.Linear(8, 8))
styles = {
    "from_import": lambda: all_reduce(x.clone()),
    "c10d_from_import": lambda: c10d_all_reduce(x.clone()),
    "module": lambda: dist.all_reduce(x.clone()),
    "module_alias": lambda: d.all_reduce(x.clone()),
    "module_in_full": lambda: torch.distributed.all_reduce(x.clone()),
    "c10d_module": lambda: torch.distributed.distributed_c10d.all_reduce(x.clone()),
    "process_group_method": lambda: dist.group.WORLD.allreduce([x.clone()]).wait(),
    "functional": lambda: funcol.all_reduce(x.clone(), "sum", dist.group.WORLD).wait(),
    "functional_reduce_scatter":
        lambda: funcol.reduce_scatter_single(torch.ones(32), "sum", 0, dist.group.WORLD).wait(),
    "dtensor_redistribute": lambda: sharded.redistribute(mesh, [Replicate()]).to_local(),
    "object": lambda: dist.all_gather_object([None, None], {"rank": rank}),
    "ddp_without_hook": lambda: ddp_plain(torch.randn(4, 8)).sum().backward(),
}
spellings = {name: spelled(run) for name, run in styles.items()}
if rank == 0:
    print(json.dumps({"calls": calls, "fsdp": fsdp.counts(), "ddp_hook": hook.counts(), "ddp_bytes": hook.bytes(),
                      "ddp_seen_by_wrapper": wrapper.counts(),
                      "ddp_bucket": {"phase": bucket.phase, "asynchronous": bucket.asynchronous,
                                     "in_order": bucket.launched_s <= bucket.done_s <= backward_returned},
                      "async": {k: getattr(async_log.calls[0], k) for k in ("asynchronous", "phase")}
                      | {"done": async_log.calls[0].done_s is not None
                         and async_log.calls[0].done_s >= async_log.calls[0].launched_s},
                      "spellings": spellings}))
dist.destroy_process_group()
