"""Wrong answers for lab 02 (tests/labkit.py: the lab's answer files)."""

_RING_HEADER = '''%%writefile ring_impl.py
import torch


def ring_all_reduce(tensor, comm):
    n, rank = comm.world_size, comm.rank
    if n == 1:
        return tensor
'''

from labkit import SolutionCells

_changed = SolutionCells("02_ring_allreduce").changed
_SPLIT = ("    flat = tensor.view(-1)                       # (M,) a view: writing a chunk writes into tensor\n"
          "    chunks = torch.tensor_split(flat, n)         # N views of floor(M/N) or ceil(M/N) elements, larger first\n")

WRONG_ANSWERS = {
    "ring_cost": [
        ("forgets the (N-1)/N factor: 2M bytes per rank", '''
def ring_bytes_per_rank(n_bytes, world_size):
    return 2 * n_bytes


def ring_allreduce_time(n_bytes, world_size, bandwidth_bytes_per_s, alpha_s=0.0):
    return 2 * (world_size - 1) * alpha_s + ring_bytes_per_rank(n_bytes, world_size) / bandwidth_bytes_per_s
'''),
        ("pays the latency alpha once instead of once per step", '''
def ring_bytes_per_rank(n_bytes, world_size):
    return 2 * (world_size - 1) / world_size * n_bytes


def ring_allreduce_time(n_bytes, world_size, bandwidth_bytes_per_s, alpha_s=0.0):
    return alpha_s + ring_bytes_per_rank(n_bytes, world_size) / bandwidth_bytes_per_s
'''),
    ],
    "ring_allreduce": [
        ("blocking send before recv on every rank: deadlock", _RING_HEADER + '''
    chunks = torch.tensor_split(tensor.view(-1), n)
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send_i, recv_i = (rank - step) % n, (rank - step - 1) % n
        incoming = torch.empty_like(chunks[recv_i])
        comm.send(chunks[send_i], right)
        comm.recv(incoming, left)
        chunks[recv_i].add_(incoming)
    for step in range(n - 1):
        send_i, recv_i = (rank + 1 - step) % n, (rank - step) % n
        comm.send(chunks[send_i], right)
        comm.recv(chunks[recv_i], left)
    return tensor
'''),
        ("gathers everything to rank 0 and broadcasts through comm: right sum, not a ring, rank 0 sends (N-1) x M", _RING_HEADER + '''
    if rank == 0:
        incoming = torch.empty_like(tensor)
        for src in range(1, n):
            comm.recv(incoming, src)
            tensor += incoming
        for work in [comm.isend(tensor, dst) for dst in range(1, n)]:
            work.wait()
    else:
        comm.send(tensor, 0)
        comm.recv(tensor, 0)
    return tensor
'''),
        ("calls dist.all_reduce instead of writing a ring: right sum, no ring, nothing through comm", '''%%writefile ring_impl.py
import torch.distributed as dist


def ring_all_reduce(tensor, comm):
    if comm.world_size > 1:
        dist.all_reduce(tensor, group=comm.group)
    return tensor
'''),
        ("pads every chunk to ceil(M/N) elements: right sum, padding bytes on the wire", _RING_HEADER + '''
    flat = tensor.view(-1)
    c = -(-flat.numel() // n)
    padded = torch.zeros(n * c, dtype=tensor.dtype)
    padded[: flat.numel()] = flat
    chunks = padded.view(n, c)
    right, left = (rank + 1) % n, (rank - 1) % n
    incoming = torch.empty(c, dtype=tensor.dtype)
    for step in range(n - 1):
        send_i, recv_i = (rank - step) % n, (rank - step - 1) % n
        works = [comm.isend(chunks[send_i], right), comm.irecv(incoming, left)]
        for w in works:
            w.wait()
        chunks[recv_i].add_(incoming)
    for step in range(n - 1):
        send_i, recv_i = (rank + 1 - step) % n, (rank - step) % n
        works = [comm.isend(chunks[send_i], right), comm.irecv(chunks[recv_i], left)]
        for w in works:
            w.wait()
    flat.copy_(padded[: flat.numel()])
    return tensor
'''),
        ("stops after the reduce-scatter: each rank holds only its own reduced chunk", _RING_HEADER + '''
    chunks = torch.tensor_split(tensor.view(-1), n)
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send_i, recv_i = (rank - step) % n, (rank - step - 1) % n
        incoming = torch.empty_like(chunks[recv_i])
        works = [comm.isend(chunks[send_i], right), comm.irecv(incoming, left)]
        for w in works:
            w.wait()
        chunks[recv_i].add_(incoming)
    return tensor
'''),
        ("scratch buffer in float32 whatever the tensor's dtype: right on float32, wrong on bf16/int64", _RING_HEADER + '''
    chunks = torch.tensor_split(tensor.view(-1), n)
    right, left = (rank + 1) % n, (rank - 1) % n
    scratch = torch.empty(chunks[0].numel(), dtype=torch.float32)
    for step in range(n - 1):
        send_i, recv_i = (rank - step) % n, (rank - step - 1) % n
        incoming = scratch[: chunks[recv_i].numel()]
        works = [comm.isend(chunks[send_i], right), comm.irecv(incoming, left)]
        for w in works:
            w.wait()
        chunks[recv_i].add_(incoming.to(tensor.dtype))
    for step in range(n - 1):
        send_i, recv_i = (rank + 1 - step) % n, (rank - step) % n
        works = [comm.isend(chunks[send_i], right), comm.irecv(chunks[recv_i], left)]
        for w in works:
            w.wait()
    return tensor
'''),
        ("splits the first dimension instead of the flattened tensor: right on 1-D, uneven chunks on 2-D", _RING_HEADER + '''
    chunks = torch.tensor_split(tensor, n)
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send_i, recv_i = (rank - step) % n, (rank - step - 1) % n
        incoming = torch.empty_like(chunks[recv_i])
        works = [comm.isend(chunks[send_i], right), comm.irecv(incoming, left)]
        for w in works:
            w.wait()
        chunks[recv_i].add_(incoming)
    for step in range(n - 1):
        send_i, recv_i = (rank + 1 - step) % n, (rank - step) % n
        works = [comm.isend(chunks[send_i], right), comm.irecv(chunks[recv_i], left)]
        for w in works:
            w.wait()
    return tensor
'''),
        # The hidden kinds (instructor/hidden_kinds.py): each kept full marks before them.
        ("steps: keeps the chunk views of the first call for each (world size, rank, size, dtype), so a second "
         "all-reduce of another tensor of the same size sums into the first one's memory", _changed(
            "ring_allreduce", ("def ring_all_reduce(tensor, comm):", "_CHUNKS = {}\n\n\ndef ring_all_reduce(tensor, comm):"),
            (_SPLIT, "    key = (n, rank, tensor.numel(), tensor.dtype)\n"
                     "    if key not in _CHUNKS:                       # split once per size\n"
                     "        _CHUNKS[key] = torch.tensor_split(tensor.view(-1), n)\n"
                     "    chunks = _CHUNKS[key]\n"))),
        ("inputs: works on a copy and hands the result over with tensor.data = ..., which gives the caller's tensor new "
         "memory: a caller's view into a larger buffer (a bucket, a .grad) never sees the sum", _changed(
            "ring_allreduce", (_SPLIT.split("\n")[0] + "\n", "    flat = tensor.reshape(-1).clone()            # a copy\n"),
            ("            work.wait()\n    return tensor", "            work.wait()\n"
                                                          "    tensor.data = flat.view(tensor.shape)\n    return tensor"))),
    ],
    "gradient_cost": [
        ("assumes 4 bytes per parameter whatever the dtype", '''
def gradient_allreduce_cost(n_params, dtype, world_size, bandwidth_bytes_per_s, alpha_s=0.0):
    n_bytes = n_params * 4
    return ring_bytes_per_rank(n_bytes, world_size), ring_allreduce_time(n_bytes, world_size, bandwidth_bytes_per_s, alpha_s)
'''),
        ("drops alpha_s: the latency term never reaches ring_allreduce_time", '''
def gradient_allreduce_cost(n_params, dtype, world_size, bandwidth_bytes_per_s, alpha_s=0.0):
    n_bytes = n_params * torch.empty((), dtype=dtype).element_size()
    return ring_bytes_per_rank(n_bytes, world_size), ring_allreduce_time(n_bytes, world_size, bandwidth_bytes_per_s)
'''),
    ],
    "latency_answer": [
        ("picks the ring because it is bandwidth-optimal", '''
latency_answer = "a"
'''),
    ],
}

# Right answers written otherwise (they must keep full marks).
CORRECT_VARIANTS = {
    "ring_cost": [
        ("the factor written as 2M - 2M/N, the latency term first; N = 1 handled without a division by zero", '''
def ring_bytes_per_rank(n_bytes, world_size):
    if world_size == 1:
        return 0.0
    return 2 * n_bytes - 2 * n_bytes / world_size


def ring_allreduce_time(n_bytes, world_size, bandwidth_bytes_per_s, alpha_s=0.0):
    latency = alpha_s * 2 * (world_size - 1)
    return latency + ring_bytes_per_rank(n_bytes, world_size) / bandwidth_bytes_per_s
'''),
    ],
    "ring_allreduce": [
        ("blocking send and recv, ordered by rank parity (even ranks send first, odd ranks receive first): no "
         "deadlock for any N >= 2, the same bytes to the same neighbour", _RING_HEADER + '''
    chunks = torch.tensor_split(tensor.view(-1), n)
    right, left = (rank + 1) % n, (rank - 1) % n

    def exchange(out, into):
        if rank % 2 == 0:
            comm.send(out, right)
            comm.recv(into, left)
        else:
            comm.recv(into, left)
            comm.send(out, right)

    for step in range(n - 1):
        send_i, recv_i = (rank - step) % n, (rank - step - 1) % n
        incoming = torch.empty_like(chunks[recv_i])
        exchange(chunks[send_i], incoming)
        chunks[recv_i].add_(incoming)
    for step in range(n - 1):
        send_i, recv_i = (rank + 1 - step) % n, (rank - step) % n
        exchange(chunks[send_i], chunks[recv_i])
    return tensor
'''),
        ("chunk bounds computed by hand (narrow on the flattened view), a while loop, the waits in reverse order",
         _RING_HEADER + '''
    flat = tensor.view(-1)
    m = flat.numel()
    base, extra = divmod(m, n)
    bounds = [(i * base + min(i, extra), base + (1 if i < extra else 0)) for i in range(n)]
    chunk = lambda i: flat.narrow(0, *bounds[i])
    right, left = (rank + 1) % n, (rank - 1) % n
    step = 0
    while step < n - 1:
        out, into = chunk((rank - step) % n), chunk((rank - step - 1) % n)
        buf = torch.empty_like(into)
        recv = comm.irecv(buf, left)
        send = comm.isend(out, right)
        recv.wait()
        send.wait()
        into.add_(buf)
        step += 1
    step = 0
    while step < n - 1:
        send = comm.isend(chunk((rank + 1 - step) % n), right)
        recv = comm.irecv(chunk((rank - step) % n), left)
        recv.wait()
        send.wait()
        step += 1
    return tensor
'''),
    ],
    "gradient_cost": [
        ("bytes per element from dtype.itemsize", '''
def gradient_allreduce_cost(n_params, dtype, world_size, bandwidth_bytes_per_s, alpha_s=0.0):
    n_bytes = n_params * dtype.itemsize
    seconds = ring_allreduce_time(n_bytes, world_size, bandwidth_bytes_per_s, alpha_s=alpha_s)
    return ring_bytes_per_rank(n_bytes, world_size), seconds
'''),
    ],
}
