"""Red-team answers for lab 12 (context parallelism): written by a reviewer who had read only the released notebook,
without the tests. Each wrong answer is one mistake put into the reviewer's own answer (_FWD, _BWD, _ZIG, _ULY:
correct, written their way, and checked to keep full marks when they were added); the correct variants are
other answers of theirs. Used by 12_context_parallel.py.

Left out of CI, each the same mistake as one of 12_context_parallel.py's answers and caught by the same test: the
merge without the max, float32 inside for float64 inputs, q scaled in place, waiting before the products (no
overlap), the mask from local positions (ring forward); dK without 1/sqrt(D) (backward); the remainder in the last
chunk, the idle fraction (N-1)/(2N) (zigzag); head_to_seq without moving the rank axis, heads dealt round-robin,
no head-count check (Ulysses); answers (a) and (d). Each lost its points when it was added.
"""


def _sub(src, *pairs):
    for old, new in pairs:
        assert old in src, old
        src = src.replace(old, new)
    return src


_FWD = r'''%%writefile cp_ring_impl.py
"""Exercise 1 of lab 12: ring attention's forward (this file is written by the notebook)."""
import math

import torch


def _merge(out, lse, block_out, block_lse):
    """Online-softmax merge of two normalised partial results (handles -inf log-sum-exps)."""
    new_lse = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_old = torch.exp(lse - safe).unsqueeze(-1)
    w_new = torch.exp(block_lse - safe).unsqueeze(-1)
    return w_old * out + w_new * block_out, new_lse


def ring_attention_forward(q, k, v, comm, positions, causal=True):
    """This rank's attention output over the whole sequence, with K/V passed round the ring."""
    rank, world = comm.rank, comm.world_size
    B, H, T_r, D = q.shape
    scale = 1.0 / math.sqrt(D)
    q_pos = positions[rank]
    out = torch.zeros(B, H, T_r, D, dtype=q.dtype)
    lse = torch.full((B, H, T_r), float("-inf"), dtype=q.dtype)
    cur_k, cur_v = k.contiguous(), v.contiguous()
    for step in range(world):
        src = (rank - step) % world
        works = []
        if step < world - 1:
            nxt = (rank - step - 1) % world
            t_next = positions[nxt].numel()
            next_k = torch.empty(B, H, t_next, D, dtype=k.dtype)
            next_v = torch.empty(B, H, t_next, D, dtype=v.dtype)
            works = [comm.isend(cur_k, (rank + 1) % world), comm.isend(cur_v, (rank + 1) % world),
                     comm.irecv(next_k, (rank - 1) % world), comm.irecv(next_v, (rank - 1) % world)]
        scores = torch.matmul(q, cur_k.transpose(-2, -1)) * scale
        if causal:
            visible = positions[src].view(1, -1) <= q_pos.view(-1, 1)
            scores = scores.masked_fill(~visible, float("-inf"))
        block_lse = torch.logsumexp(scores, dim=-1)
        safe = torch.where(torch.isinf(block_lse), torch.zeros_like(block_lse), block_lse)
        probs = torch.exp(scores - safe.unsqueeze(-1))
        block_out = torch.matmul(probs, cur_v)
        out, lse = _merge(out, lse, block_out, block_lse)
        for w in works:
            w.wait()
        if works:
            cur_k, cur_v = next_k, next_v
    return out.to(q.dtype), lse
'''

_BWD = r'''%%writefile cp_ring_backward_impl.py
"""Exercise 2 of lab 12: ring attention's backward (this file is written by the notebook)."""
import math

import torch


def ring_attention_backward(grad_out, q, k, v, out, lse, comm, positions, causal=True):
    """dq, dk, dv of this rank's blocks, from the forward's out and lse, with K/V and their gradients on the ring."""
    rank, world = comm.rank, comm.world_size
    right, left = (rank + 1) % world, (rank - 1) % world
    B, H, T_r, D = q.shape
    scale = 1.0 / math.sqrt(D)
    q_pos = positions[rank]
    delta = (grad_out * out).sum(dim=-1, keepdim=True)
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
    cur_k, cur_v = k.contiguous(), v.contiguous()
    cur_dk = torch.zeros(cur_k.shape, dtype=k.dtype)
    cur_dv = torch.zeros(cur_v.shape, dtype=k.dtype)
    for step in range(world):
        src = (rank - step) % world
        recvs, sends = [], []
        if world > 1:
            nxt = (rank - step - 1) % world
            t_next = positions[nxt].numel()
            if step < world - 1:
                next_k = torch.empty(B, H, t_next, D, dtype=k.dtype)
                next_v = torch.empty(B, H, t_next, D, dtype=v.dtype)
                sends += [comm.isend(cur_k, right), comm.isend(cur_v, right)]
                recvs += [comm.irecv(next_k, left), comm.irecv(next_v, left)]
            next_dk = torch.empty(B, H, t_next, D, dtype=k.dtype)
            next_dv = torch.empty(B, H, t_next, D, dtype=k.dtype)
            recvs += [comm.irecv(next_dk, left), comm.irecv(next_dv, left)]
        scores = torch.matmul(q, cur_k.transpose(-2, -1)) * scale
        if causal:
            visible = positions[src].view(1, -1) <= q_pos.view(-1, 1)
            scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.exp(scores - lse.unsqueeze(-1))
        cur_dv = cur_dv + torch.matmul(probs.transpose(-2, -1), grad_out)
        dprobs = torch.matmul(grad_out, cur_v.transpose(-2, -1))
        dscores = probs * (dprobs - delta)
        dq = dq + torch.matmul(dscores, cur_k) * scale
        cur_dk = cur_dk + torch.matmul(dscores.transpose(-2, -1), q) * scale
        if world > 1:
            sends += [comm.isend(cur_dk.contiguous(), right), comm.isend(cur_dv.contiguous(), right)]
            for w in recvs + sends:
                w.wait()
            cur_dk, cur_dv = next_dk, next_dv
            if step < world - 1:
                cur_k, cur_v = next_k, next_v
    return dq.to(q.dtype), cur_dk.to(k.dtype), cur_dv.to(v.dtype)
'''

_ZIG = r'''%%writefile cp_split_impl.py
"""Exercise 3 of lab 12: the load-balanced (zigzag) split."""
import torch


def zigzag_positions(seq_len, world_size):
    """The load-balanced split: torch.arange(seq_len) cut into 2N chunks (torch.tensor_split), rank r holding chunk r
    then chunk 2N - 1 - r; a list of N int64 tensors. Fewer than 2N positions: a ValueError giving the length."""
    n_chunks = 2 * world_size
    if seq_len < n_chunks:
        raise ValueError(f"sequence length {seq_len} is shorter than 2N = {n_chunks} chunks")
    chunks = torch.tensor_split(torch.arange(seq_len, dtype=torch.int64), n_chunks)
    return [torch.cat([chunks[r], chunks[n_chunks - 1 - r]]) for r in range(world_size)]


def contiguous_idle_fraction(world_size):
    """Share of the ranks' time spent idle in a causal ring over the contiguous split (half a block on the diagonal)."""
    return (world_size - 1) / (2 * world_size - 1)
'''

_ULY = r'''%%writefile cp_ulysses_impl.py
"""Exercise 4 of lab 12: DeepSpeed-Ulysses' re-shard (this file is written by the notebook)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F


def seq_to_head(x, group):
    """(B, H, T/N, D), this rank's positions of every head -> (B, H/N, T, D), every position of its H/N heads."""
    n = dist.get_world_size(group)
    B, H, T_local, D = x.shape
    if H % n:
        raise ValueError(f"Ulysses needs the head count H = {H} to divide by the ranks N = {n}")
    send = x.reshape(B, n, H // n, T_local, D).transpose(0, 1).contiguous()     # (N, B, H/N, T/N, D)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)                           # recv[j]: rank j's positions
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H // n, n * T_local, D)


def head_to_seq(x, group):
    """The inverse: (B, H/N, T, D) -> (B, H, T/N, D), with one dist.all_to_all_single over `group`."""
    n = dist.get_world_size(group)
    B, H_local, T, D = x.shape
    send = x.reshape(B, H_local, n, T // n, D).permute(2, 0, 1, 3, 4).contiguous()   # (N, B, H/N, T/N, D)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)                                  # recv[j]: rank j's heads
    return recv.transpose(0, 1).reshape(B, n * H_local, T // n, D)


def ulysses_attention(q, k, v, group, causal=True):
    """Attention over the whole sequence for sequence-split q, k, v (B, H, T/N, D)."""
    qh, kh, vh = (seq_to_head(t, group) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)
    return head_to_seq(out, group)
'''

WRONG_ANSWERS = {
    'cp_ring_forward': [
        ('receives the next K/V from (r+1)%N instead of (r-1)%N: identical at N=2, wrong neighbour (deadlock/mismatch) at N>=3',
         _sub(_FWD, ('comm.irecv(next_k, (rank - 1) % world), comm.irecv(next_v, (rank - 1) % world)',
               'comm.irecv(next_k, (rank + 1) % world), comm.irecv(next_v, (rank + 1) % world)'))),
        ('holds block (r+s)%N instead of (r-s)%N for the mask and buffer sizes: identical at N=2 only',
         _sub(_FWD, ('src = (rank - step) % world',
               'src = (rank + step) % world'),
              ('nxt = (rank - step - 1) % world',
               'nxt = (rank + step + 1) % world'))),
        ('always applies the causal mask, ignoring causal=False',
         _sub(_FWD, ('        if causal:\n            visible',
               '        if True:\n            visible'))),
        ("sends the caller's k and v without .contiguous(): comm.isend rejects non-contiguous views (BTHD layout)",
         _sub(_FWD, ('cur_k, cur_v = k.contiguous(), v.contiguous()',
               'cur_k, cur_v = k, v'))),
        ('posts the first exchange before the loop unconditionally: at world size 1 it sends to itself (error)',
         _sub(_FWD, ('    for step in range(world):\n        src = (rank - step) % world\n        works = []\n        if step < world - 1:',
               "    def post(step):\n        nxt = (rank - step - 1) % world\n        t_next = positions[nxt].numel()\n        nk = torch.empty(B, H, t_next, D, dtype=k.dtype)\n        nv = torch.empty(B, H, t_next, D, dtype=v.dtype)\n        ws = [comm.isend(cur_k, (rank + 1) % world), comm.isend(cur_v, (rank + 1) % world),\n              comm.irecv(nk, (rank - 1) % world), comm.irecv(nv, (rank - 1) % world)]\n        return ws, nk, nv\n\n    works, next_k, next_v = post(0)              # prefetch the first neighbour's block\n    for step in range(world):\n        src = (rank - step) % world\n        if step > 0 and step < world - 1:\n            works, next_k, next_v = post(step)\n        elif step > 0:\n            works = []\n        if False:"))),
        ('no guard for a fully masked block: exp(-inf - (-inf)) gives NaN',
         _sub(_FWD, ('        safe = torch.where(torch.isinf(block_lse), torch.zeros_like(block_lse), block_lse)\n        probs = torch.exp(scores - safe.unsqueeze(-1))',
               '        probs = torch.exp(scores - block_lse.unsqueeze(-1))'))),
    ],
    'cp_ring_backward': [
        ('receives K/V and dK/dV from (r+1)%N instead of (r-1)%N: same at N=2 only',
         _sub(_BWD, ('right, left = (rank + 1) % world, (rank - 1) % world',
               'right, left = (rank + 1) % world, (rank + 1) % world'))),
        ('dK/dV accumulators (and dq) created with torch.zeros(shape) without dtype: float32 for float64 inputs',
         _sub(_BWD, ('dq = torch.zeros_like(q, memory_format=torch.contiguous_format)',
               'dq = torch.zeros(q.shape)'),
              ('cur_dk = torch.zeros(cur_k.shape, dtype=k.dtype)',
               'cur_dk = torch.zeros(cur_k.shape)'),
              ('cur_dv = torch.zeros(cur_v.shape, dtype=k.dtype)',
               'cur_dv = torch.zeros(cur_v.shape)'),
              ('next_dk = torch.empty(B, H, t_next, D, dtype=k.dtype)',
               'next_dk = torch.empty(B, H, t_next, D)'),
              ('next_dv = torch.empty(B, H, t_next, D, dtype=k.dtype)',
               'next_dv = torch.empty(B, H, t_next, D)'))),
        ('always masks, ignoring causal=False',
         _sub(_BWD, ('        if causal:\n            visible',
               '        if True:\n            visible'))),
        ('always talks to the neighbours, even at world size 1 (sends to itself: error)',
         _sub(_BWD, ('        if world > 1:\n            nxt',
               '        if True:\n            nxt'),
              ('        if world > 1:\n            sends +=',
               '        if True:\n            sends +='))),
        ('softmax correction delta taken per block as rowsum(P*dP) of the current block instead of rowsum(dO*O)',
         _sub(_BWD, ('        dscores = probs * (dprobs - delta)',
               '        dscores = probs * (dprobs - (probs * dprobs).sum(dim=-1, keepdim=True))'))),
        ("sends the caller's k, v without .contiguous(): fails for non-contiguous (BTHD) inputs",
         _sub(_BWD, ('cur_k, cur_v = k.contiguous(), v.contiguous()',
               'cur_k, cur_v = k, v'))),
        ('uses exp(s - lse) where s is unmasked (mask applied only to dS afterwards, not to P for dV)',
         _sub(_BWD, ('        if causal:\n            visible = positions[src].view(1, -1) <= q_pos.view(-1, 1)\n            scores = scores.masked_fill(~visible, float("-inf"))\n        probs = torch.exp(scores - lse.unsqueeze(-1))\n        cur_dv = cur_dv + torch.matmul(probs.transpose(-2, -1), grad_out)\n        dprobs = torch.matmul(grad_out, cur_v.transpose(-2, -1))\n        dscores = probs * (dprobs - delta)',
               '        probs = torch.exp(scores - lse.unsqueeze(-1))\n        cur_dv = cur_dv + torch.matmul(probs.transpose(-2, -1), grad_out)\n        dprobs = torch.matmul(grad_out, cur_v.transpose(-2, -1))\n        dscores = probs * (dprobs - delta)\n        if causal:\n            visible = positions[src].view(1, -1) <= q_pos.view(-1, 1)\n            dscores = dscores.masked_fill(~visible, 0.0)'))),
    ],
    'cp_zigzag': [
        ('torch.chunk instead of torch.tensor_split: can return fewer than 2N chunks (e.g. T=9, N=2 or T=10, N=3)',
         _sub(_ZIG, ('chunks = torch.tensor_split(torch.arange(seq_len, dtype=torch.int64), n_chunks)',
               'chunks = torch.chunk(torch.arange(seq_len, dtype=torch.int64), n_chunks)'))),
        ('idle fraction (N-1)/(N+1): equal to the right 1/3 at N=2, wrong for N>=3',
         _sub(_ZIG, ('return (world_size - 1) / (2 * world_size - 1)',
               'return (world_size - 1) / (world_size + 1)'))),
        ('ValueError only below N positions (not 2N)',
         _sub(_ZIG, ('if seq_len < n_chunks:',
               'if seq_len < world_size:'))),
        ('rank r holds chunk 2N-1-r first, then chunk r',
         _sub(_ZIG, ('torch.cat([chunks[r], chunks[n_chunks - 1 - r]])',
               'torch.cat([chunks[n_chunks - 1 - r], chunks[r]])'))),
    ],
    'cp_ulysses': [
        ('seq_to_head reads the received (N, B, ...) buffer as (B, N, ...): right only when B = 1',
         _sub(_ULY, ('return recv.permute(1, 2, 0, 3, 4).reshape(B, H // n, n * T_local, D)',
               'return recv.reshape(B, n, H // n, T_local, D).transpose(1, 2).reshape(B, H // n, n * T_local, D)'))),
        ('ulysses_attention always passes is_causal=True, ignoring causal=False',
         _sub(_ULY, ('is_causal=causal)',
               'is_causal=True)'))),
        ('runs the attention in float32 (q.float()) and casts back: float64 precision lost',
         _sub(_ULY, ('out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)',
               'out = F.scaled_dot_product_attention(qh.float(), kh.float(), vh.float(), is_causal=causal).to(q.dtype)'))),
        ('ignores `group`: world size and all-to-all on the default group',
         _sub(_ULY, ('n = dist.get_world_size(group)',
               'n = dist.get_world_size()'),
              ('dist.all_to_all_single(recv, send, group=group)',
               'dist.all_to_all_single(recv, send)'))),
    ],
    'ulysses_bytes_answer': [
        ("answers (b): counts Ulysses' 4 tensors vs the ring's 2 but forgets the ring's N-1 hops", '# YOUR CODE HERE\nulysses_bytes_answer = "b"\n'),
    ],
}

CORRECT_VARIANTS = {
    'cp_ring_forward': [
        ('unnormalised accumulator with a running row max (FlashAttention style), K and V stacked into one message per hop, einsum',
         r'''%%writefile cp_ring_impl.py
"""Exercise 1 of lab 12: ring attention's forward (this file is written by the notebook)."""
import math

import torch


def ring_attention_forward(q, k, v, comm, positions, causal=True):
    """Ring attention with an unnormalised accumulator, a running row max and K/V stacked into one message."""
    r, n = comm.rank, comm.world_size
    *lead, t_q, d = q.shape
    q_pos = positions[r]
    neg_inf = torch.tensor(float("-inf"), dtype=q.dtype)
    row_max = torch.full((*lead, t_q), float("-inf"), dtype=q.dtype)
    denom = torch.zeros((*lead, t_q), dtype=q.dtype)
    acc = torch.zeros((*lead, t_q, d), dtype=q.dtype)
    kv = torch.stack((k, v))                           # a new contiguous tensor: the caller's k, v stay untouched
    for s in range(n):
        owner = (r - s) % n
        pending, incoming = [], None
        if s + 1 < n:
            incoming = torch.empty((2, *lead, positions[(r - s - 1) % n].shape[0], d), dtype=kv.dtype)
            pending.append(comm.irecv(incoming, (r - 1) % n))
            pending.append(comm.isend(kv, (r + 1) % n))
        scores = torch.einsum("bhqd,bhkd->bhqk", q, kv[0]) / math.sqrt(d)
        if causal:
            scores = torch.where(positions[owner][None, :] <= q_pos[:, None], scores, neg_inf)
        new_max = torch.maximum(row_max, scores.amax(dim=-1))
        finite_max = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
        correction = torch.exp(row_max - finite_max)
        weights = torch.exp(scores - finite_max[..., None])
        denom = denom * correction + weights.sum(dim=-1)
        acc = acc * correction[..., None] + torch.einsum("bhqk,bhkd->bhqd", weights, kv[1])
        row_max = new_max
        for work in pending:
            work.wait()
        if incoming is not None:
            kv = incoming
    out = acc / denom[..., None]
    lse = row_max + torch.log(denom)
    return out.to(q.dtype), lse
'''),
    ],
    'cp_ring_backward': [
        ('K/V stacked in one message and dK/dV stacked in another, torch.where mask, in-place dq accumulation',
         r'''%%writefile cp_ring_backward_impl.py
"""Exercise 2 of lab 12: ring attention's backward (this file is written by the notebook)."""
import math

import torch


def ring_attention_backward(grad_out, q, k, v, out, lse, comm, positions, causal=True):
    """FlashAttention's backward per block; K/V travel stacked in one message, their dK/dV stacked in another."""
    r, n = comm.rank, comm.world_size
    nxt_rank, prv_rank = (r + 1) % n, (r - 1) % n
    d = q.shape[-1]
    inv_sqrt_d = 1.0 / math.sqrt(d)
    delta = torch.sum(grad_out * out, dim=-1)[..., None]
    dq = torch.zeros(q.shape, dtype=q.dtype)
    kv = torch.stack((k, v))                     # (2, B, H, T_j, D): a copy, contiguous
    dkv = torch.zeros(kv.shape, dtype=k.dtype)   # accumulators of the block held now
    for s in range(n):
        owner = (r - s) % n
        works, kv_in, dkv_in = [], None, None
        if n > 1:
            shape_in = (2, *q.shape[:2], positions[(r - s - 1) % n].numel(), d)
            if s < n - 1:
                kv_in = torch.empty(shape_in, dtype=k.dtype)
                works += [comm.isend(kv, nxt_rank), comm.irecv(kv_in, prv_rank)]
            dkv_in = torch.empty(shape_in, dtype=k.dtype)
            works.append(comm.irecv(dkv_in, prv_rank))
        k_j, v_j = kv[0], kv[1]
        s_ij = (q @ k_j.transpose(-1, -2)) * inv_sqrt_d
        if causal:
            allowed = positions[owner].unsqueeze(0) <= positions[r].unsqueeze(1)
            s_ij = torch.where(allowed, s_ij, torch.full_like(s_ij, -math.inf))
        p_ij = torch.exp(s_ij - lse[..., None])
        dp_ij = grad_out @ v_j.transpose(-1, -2)
        ds_ij = p_ij * (dp_ij - delta)
        dq += (ds_ij @ k_j) * inv_sqrt_d
        dkv = dkv + torch.stack(((ds_ij.transpose(-1, -2) @ q) * inv_sqrt_d, p_ij.transpose(-1, -2) @ grad_out))
        if n > 1:
            works.append(comm.isend(dkv, nxt_rank))
            for w in works:
                w.wait()
            dkv = dkv_in
            if kv_in is not None:
                kv = kv_in
    return dq, dkv[0].clone(), dkv[1].clone()
'''),
    ],
    'cp_zigzag': [
        ('chunk sizes by divmod (larger first) and torch.arange slices, idle fraction from the busy/span sums',
         r'''%%writefile cp_split_impl.py
"""Exercise 3 of lab 12: the load-balanced (zigzag) split."""
import torch


def zigzag_positions(seq_len, world_size):
    """The load-balanced split: torch.arange(seq_len) cut into 2N chunks (torch.tensor_split), rank r holding chunk r
    then chunk 2N - 1 - r; a list of N int64 tensors. Fewer than 2N positions: a ValueError giving the length."""
    n_chunks = 2 * world_size
    if seq_len < n_chunks:
        raise ValueError(f"cannot cut {seq_len} positions into {n_chunks} non-empty chunks (need at least {n_chunks})")
    base, extra = divmod(seq_len, n_chunks)
    sizes = [base + 1 if i < extra else base for i in range(n_chunks)]     # the larger chunks first
    starts = [sum(sizes[:i]) for i in range(n_chunks)]
    chunk = lambda i: torch.arange(starts[i], starts[i] + sizes[i], dtype=torch.long)
    return [torch.cat((chunk(r), chunk(n_chunks - 1 - r))) for r in range(world_size)]


def contiguous_idle_fraction(world_size):
    """Share of the ranks' time spent idle in a causal ring over the contiguous split (half a block on the diagonal)."""
    n = world_size
    busy = sum(r + 0.5 for r in range(n))          # block-times each rank works, summed: N^2 / 2
    span = 0.5 + (n - 1)                            # block-times the layer takes
    return 1 - busy / (n * span)
'''),
        ("the reviewer's own answer: tensor_split of an int64 arange, the chunk count named",
         _ZIG),
    ],
    'cp_ulysses': [
        ('heads moved to dim 0 with permute, torch.stack/torch.cat for the re-order, explicit softmax attention with a triu mask',
         r'''%%writefile cp_ulysses_impl.py
"""Exercise 4 of lab 12: DeepSpeed-Ulysses' re-shard (this file is written by the notebook)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F


def seq_to_head(x, group):
    """(B, H, T/N, D), this rank's positions of every head -> (B, H/N, T, D), every position of its H/N heads."""
    world = dist.get_world_size(group=group)
    b, h, t_loc, d = x.shape
    if h % world != 0:
        raise ValueError(f"cannot split {h} heads over {world} ranks: N={world} must divide H={h}")
    send = x.permute(1, 0, 2, 3).contiguous()          # (H, B, T/N, D): dim 0 splits into N groups of H/N heads
    recv = torch.empty_like(send)                      # (N * H/N, B, T/N, D): group j = rank j's positions
    dist.all_to_all_single(recv, send, group=group)
    recv = recv.view(world, h // world, b, t_loc, d)
    return torch.cat(list(recv.unbind(0)), dim=2).permute(1, 0, 2, 3).contiguous()   # (B, H/N, T, D)


def head_to_seq(x, group):
    """The inverse: (B, H/N, T, D) -> (B, H, T/N, D), with one dist.all_to_all_single over `group`."""
    world = dist.get_world_size(group=group)
    b, h_loc, t, d = x.shape
    send = torch.stack(x.chunk(world, dim=2), dim=0).contiguous()     # (N, B, H/N, T/N, D): chunk j goes to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)                   # recv[j]: rank j's heads of my positions
    return torch.cat(list(recv.unbind(0)), dim=1)                     # (B, H, T/N, D)


def ulysses_attention(q, k, v, group, causal=True):
    """Attention over the whole sequence for sequence-split q, k, v (B, H, T/N, D)."""
    q_h, k_h, v_h = seq_to_head(q, group), seq_to_head(k, group), seq_to_head(v, group)
    d = q_h.shape[-1]
    scores = q_h @ k_h.transpose(-2, -1) / d ** 0.5
    if causal:
        t = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return head_to_seq(torch.softmax(scores, dim=-1) @ v_h, group)
'''),
    ],
    'ulysses_bytes_answer': [
        ("answer 'c' computed from the two byte formulas",
         r'''# YOUR CODE HERE
N = 8
ring_blocks = 2 * (N - 1)            # K and V, N - 1 hops
ulysses_blocks = 4 * (N - 1) / N     # q, k, v, out: each keeps 1/N of its all-to-all
ulysses_bytes_answer = {1.0: "a", 2.0: "b", 0.25: "c", 0.125: "d"}[ulysses_blocks / ring_blocks]
'''),
    ],
}
