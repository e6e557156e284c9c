"""Wrong answers for lab 12 (tests/labkit.py: the lab's answer files): the solution's own cells with one mistake each,
the mistakes issue 28 names (a merge without the max, the mask from local positions, K/V the wrong way round, a
blocking send before the receive, Ulysses cut along the wrong dimension) and others students make. Every one is
caught on thread ranks before a torchrun start, except where said."""

from __future__ import annotations


from labkit import SolutionCells

# The red team's (a reviewer who had read only the released notebook): added to each list at the end.

_cells = SolutionCells("12_context_parallel")
_changed = _cells.changed

_FWD_POST = ("        if step < n - 1:                                        # post the next block's transfer first: overlap\n"
             "            incoming = torch.empty((2, B, H, len(positions[(src - 1) % n]), D), dtype=block.dtype)\n"
             "            works = [comm.isend(block, (rank + 1) % n), comm.irecv(incoming, (rank - 1) % n)]\n")
_FWD_WAIT = ("        if step < n - 1:\n"
             "            for work in works:\n"
             "                work.wait()\n")
_BWD_POST = ("        if step < n - 1:                                         # the next K/V, posted before computing\n"
             "            next_kv = torch.empty((2, B, H, len(positions[(src - 1) % n]), D), dtype=kv.dtype)\n"
             "            kv_works = [comm.isend(kv, right), comm.irecv(next_kv, left)]\n")

WRONG_ANSWERS = {
    "cp_ring_forward": [
        ("the online-softmax merge without the max: log(sum(exp)) overflows fp32 at scores near 100 (hidden case)",
         _changed("cp_ring_forward",
                  ("        block_lse = torch.logsumexp(scores, dim=-1)", "        block_lse = torch.log(torch.exp(scores).sum(-1))"),
                  ("        new_lse = torch.logaddexp(lse, block_lse)", "        new_lse = torch.log(torch.exp(lse) + torch.exp(block_lse))"))),
        ("the causal mask from local positions (row i sees columns <= i of every block)", _changed(
            "cp_ring_forward", ("            visible = my_pos[:, None] >= positions[src][None, :]",
                                "            visible = torch.arange(T_r)[:, None] >= torch.arange(len(positions[src]))[None, :]"))),
        ("K/V passed the wrong way round: to the left, from the right (the held block is not rank (r - s)'s)", _changed(
            "cp_ring_forward", ("comm.isend(block, (rank + 1) % n), comm.irecv(incoming, (rank - 1) % n)",
                                "comm.isend(block, (rank - 1) % n), comm.irecv(incoming, (rank + 1) % n)"))),
        ("blocking send before the receive on every rank: a deadlock, reported at once on thread ranks", _changed(
            "cp_ring_forward", ("            works = [comm.isend(block, (rank + 1) % n), comm.irecv(incoming, (rank - 1) % n)]",
                                "            comm.send(block, (rank + 1) % n)\n            comm.recv(incoming, (rank - 1) % n)\n"
                                "            works = []"))),
        ("no overlap: the next block is posted only after this block is computed", _changed(
            "cp_ring_forward", (_FWD_POST, ""),
            (_FWD_WAIT, _FWD_POST.replace("first: overlap", "after computing") + _FWD_WAIT))),
        ("the old partial output is not rescaled when a block is merged", _changed(
            "cp_ring_forward", ("        out = (out * torch.exp(lse - new_safe)[..., None] + ", "        out = (out + "))),
        ("the diagonal excluded: a query does not see its own key (> instead of >=)", _changed(
            "cp_ring_forward", ("            visible = my_pos[:, None] >= positions[src][None, :]",
                                "            visible = my_pos[:, None] > positions[src][None, :]"))),
        ("q scaled in place (the caller's q changes)", _changed(
            "cp_ring_forward", ("        scores = torch.matmul(q, block[0].transpose(-2, -1)) * scale",
                                "        scores = torch.matmul(q.mul_(1.0 + 1e-3), block[0].transpose(-2, -1)) * scale"))),
        ("lse returned for the last block only", _changed(
            "cp_ring_forward", ("    return out, lse\n", "    return out, block_lse\n"))),
        ("receive buffers sized by this rank's own block: uneven blocks cannot be received", _changed(
            "cp_ring_forward", ("            incoming = torch.empty((2, B, H, len(positions[(src - 1) % n]), D), dtype=block.dtype)",
                                "            incoming = torch.empty((2, B, H, T_r, D), dtype=block.dtype)"))),
        ("the output returned in float32 whatever q's dtype (float64 hidden case)", _changed(
            "cp_ring_forward", ("    return out, lse\n", "    return out.float(), lse\n"))),
        ("no online softmax: K/V passed round correctly and overlapped, but every block's scores kept and one softmax "
         "run over their concatenation at the end (the T/N x T memory the ring avoids; issue 38)", _changed(
            "cp_ring_forward",
            ("    my_pos = positions[rank]\n", "    my_pos = positions[rank]\n    kept_scores, kept_values = [], []\n"),
            ("        block_lse = torch.logsumexp(scores, dim=-1)                          # (B, H, T_r); -inf if all masked\n"
             "        seen = torch.isfinite(block_lse)\n"
             "        probs = torch.exp(scores - torch.where(seen, block_lse, 0.0)[..., None])   # rows of a masked block: 0\n"
             "        block_out = torch.matmul(probs, block[1])                            # softmax within the block @ V\n"
             "        new_lse = torch.logaddexp(lse, block_lse)                            # the online-softmax merge\n"
             "        new_safe = torch.where(torch.isfinite(new_lse), new_lse, 0.0)\n"
             "        out = (out * torch.exp(lse - new_safe)[..., None] + block_out * torch.exp(block_lse - new_safe)[..., None])\n"
             "        lse = new_lse\n",
             "        kept_scores.append(scores)\n        kept_values.append(block[1])\n"),
            ("    return out, lse\n", "    scores = torch.cat(kept_scores, -1)\n"
             "    out = torch.matmul(torch.softmax(scores, -1), torch.cat(kept_values, -2)).to(q.dtype)\n"
             "    return out, torch.logsumexp(scores, -1)\n"))),
        ("masked scores set to -1e4 (as older transformer code does) instead of -inf: the same as -inf while every "
         "query sees a score above -1e4, wrong when scores reach -1e4 (kept full marks before the extremes of issue 42: "
         "the cases stopped at scores near 100)", _changed(
            "cp_ring_forward", ("            scores = scores.masked_fill(~visible, -math.inf)",
                                "            scores = scores.masked_fill(~visible, -1e4)"))),
        ("every transfer waited once after the loop, each received block used before its wait (wrong whenever the "
         "neighbour is a step behind; caught before only when the thread ranks happened to race, now on every run: "
         "receives land only when waited, issue 42)", _changed(
            "cp_ring_forward", ("    my_pos = positions[rank]\n", "    my_pos = positions[rank]\n    pending = []\n"),
            ("            for work in works:\n                work.wait()\n            block = incoming\n",
             "            pending += works                                    # waited once, after the loop: more overlap\n"
             "            block = incoming\n"),
            ("    return out, lse\n", "    for work in pending:\n        work.wait()\n    return out, lse\n"))),
    ],
    "cp_ring_backward": [
        ("the dK/dV accumulators never make the last hop home: rank r returns rank r+1's gradients", _changed(
            "cp_ring_backward",
            ("        grad_works = [comm.isend(grads, right), comm.irecv(incoming, left)] if n > 1 else []",
             "        grad_works = [comm.isend(grads, right), comm.irecv(incoming, left)] if step < n - 1 else []"),
            ("    if n > 1:\n        grads = incoming\n", ""))),
        ("delta from the output's gradient alone (rowsum(dO), not rowsum(dO * O))", _changed(
            "cp_ring_backward", ("    delta = (grad_out * out).sum(-1, keepdim=True)", "    delta = grad_out.sum(-1, keepdim=True)"))),
        ("dK without the 1/sqrt(D) of the scores", _changed(
            "cp_ring_backward", ("torch.matmul(d_scores.transpose(-2, -1), q) * scale,", "torch.matmul(d_scores.transpose(-2, -1), q),"))),
        ("the causal mask from local positions", _changed(
            "cp_ring_backward", ("~(my_pos[:, None] >= positions[src][None, :])",
                                 "~(torch.arange(T_r)[:, None] >= torch.arange(len(positions[src]))[None, :])"))),
        ("the accumulators sent to the left while K/V go right", _changed(
            "cp_ring_backward", ("[comm.isend(grads, right), comm.irecv(incoming, left)]",
                                 "[comm.isend(grads, left), comm.irecv(incoming, right)]"))),
        ("no overlap: the next K/V posted after the block's products", _changed(
            "cp_ring_backward", (_BWD_POST, ""),
            ("        # pass this block's accumulators on", _BWD_POST + "        # pass this block's accumulators on"))),
        ("masked scores set to -1e4 instead of -inf: P = exp(s - lse) of a masked key is 0 only while lse is well above "
         "-1e4 (kept full marks before the extremes of issue 42)", _changed(
            "cp_ring_backward", ("            scores = scores.masked_fill(~(my_pos[:, None] >= positions[src][None, :]), -math.inf)",
                                 "            scores = scores.masked_fill(~(my_pos[:, None] >= positions[src][None, :]), -1e4)"))),
        ("delta computed in place in the caller's out (out.mul_(grad_out)): no temporary, but the forward's output the "
         "caller keeps is overwritten (kept full marks before issue 42: only q, k, v and grad_out were compared)", _changed(
            "cp_ring_backward", ("    delta = (grad_out * out).sum(-1, keepdim=True)               # rowsum(dO * O): (B, H, T_r, 1)",
                                 "    delta = out.mul_(grad_out).sum(-1, keepdim=True)             # rowsum(dO * O), in place"))),
        ("lse.unsqueeze_(-1) on the caller's lse (its shape changes under the caller; kept full marks before issue 42)",
         _changed("cp_ring_backward",
                  ("    my_pos = positions[rank]\n", "    my_pos = positions[rank]\n    lse.unsqueeze_(-1)\n"),
                  ("        probs = torch.exp(scores - lse[..., None])", "        probs = torch.exp(scores - lse)"))),
    ],
    "cp_zigzag": [
        ("rank r holds chunks r and N + r (striped, not mirrored): the causal work stays unbalanced", _changed(
            "cp_zigzag", ("chunks[2 * world_size - 1 - r]", "chunks[world_size + r]"))),
        ("chunks of T // 2N with the remainder in the last chunk (not tensor_split)", _changed(
            "cp_zigzag", ("    chunks = torch.tensor_split(torch.arange(seq_len), 2 * world_size)",
                          "    size = seq_len // (2 * world_size)\n"
                          "    chunks = [torch.arange(i * size, seq_len if i == 2 * world_size - 1 else (i + 1) * size)\n"
                          "              for i in range(2 * world_size)]"))),
        ("the idle fraction with the diagonal block counted as a full block: (N-1)/N", _changed(
            "cp_zigzag", ("    return (world_size - 1) / (2 * world_size - 1)", "    return (world_size - 1) / world_size"))),
        ("the idle fraction (N-1)/(2N): the diagonal step forgotten", _changed(
            "cp_zigzag", ("    return (world_size - 1) / (2 * world_size - 1)", "    return (world_size - 1) / (2 * world_size)"))),
        ("refuses exactly 2N positions too (<= instead of <): one position a chunk is a valid split (red team)",
         _changed("cp_zigzag", ("    if seq_len < 2 * world_size:\n", "    if seq_len <= 2 * world_size:\n"))),
        ("no check of the length: a short sequence gives empty chunks", _changed(
            "cp_zigzag", ("    if seq_len < 2 * world_size:\n", "    if False:\n"))),
        ("the idle fraction returned as lablib's own count at T = 4096, not the closed form (issue 38)", _changed(
            "cp_zigzag", ("    return (world_size - 1) / (2 * world_size - 1)",
                          "    from lablib.labs.context_parallel import cp_model\n"
                          "    return cp_model.idle_fraction(cp_model.causal_pairs_per_step(\n"
                          "        cp_model.contiguous_positions(4096, world_size)))"))),
        ("torch.chunk for the 2N chunks: fewer chunks when 2N does not divide T evenly (visible case (10, 3))", _changed(
            "cp_zigzag", ("torch.tensor_split(torch.arange(seq_len), 2 * world_size)",
                          "torch.chunk(torch.arange(seq_len), 2 * world_size)"))),
        ("zigzag_positions memoised with functools.lru_cache: every call returns the same tensors, so a caller that "
         "shifts its positions in place (a second packed sequence) changes every later call's (kept full marks before "
         "the steps of issue 42)", _changed(
            "cp_zigzag", ("import torch\n", "import functools\n\nimport torch\n"),
            ("def zigzag_positions(seq_len, world_size):",
             "@functools.lru_cache(maxsize=None)                 # the same split every time: compute it once\n"
             "def zigzag_positions(seq_len, world_size):"))),
    ],
    "cp_ulysses": [
        ("the all-to-all cut along the wrong dimension: heads dealt round-robin (rank j gets heads j, j + N, ...)", _changed(
            "cp_ulysses", ("    send = x.reshape(B, n, H // n, T_r, D).transpose(0, 1).contiguous()",
                           "    send = x.reshape(B, H // n, n, T_r, D).permute(2, 0, 1, 3, 4).contiguous()"))),
        ("no head-count check: the all-to-all goes ahead with H = N + 1", _changed(
            "cp_ulysses", ("    if H % n:\n        raise ValueError(", "    if False:\n        raise ValueError("))),
        ("the head-count error as a fixed text with the visible case's numbers", _changed(
            "cp_ulysses", ('f"Ulysses needs the head count divisible by the ranks: {H} heads over {n} ranks; "\n'
                           '                         f"use a world size that divides {H} (or ring attention)"',
                           '"Ulysses needs the head count divisible by the ranks: 3 heads over 2 ranks"'))),
        ("head_to_seq stacks the received pieces along heads without moving the rank axis", _changed(
            "cp_ulysses", ("    return recv.transpose(0, 1).reshape(B, n * H_r, T // n, D)",
                           "    return recv.reshape(B, n * H_r, T // n, D)"))),
        ("the attention on the re-sharded heads without the causal mask", _changed(
            "cp_ulysses", ("is_causal=causal)", "is_causal=False)"))),
        ("from torch.distributed import all_to_all_single, get_world_size, and the group ignored (kept full marks when "
         "the rehearsal stepped aside for names bound by import; the red team's): caught on two groups of 2", _changed(
            "cp_ulysses", ("import torch.distributed as dist\n",
                           "import torch.distributed as dist\nfrom torch.distributed import all_to_all_single, "
                           "get_world_size\n"),
            ("    n = dist.get_world_size(group)\n    B, H, T_r, D = x.shape", "    n = get_world_size()\n    B, H, T_r, D = x.shape"),
            ("    n = dist.get_world_size(group)\n    B, H_r, T, D = x.shape", "    n = get_world_size()\n    B, H_r, T, D = x.shape"),
            ("    dist.all_to_all_single(recv, send, group=group)\n    return recv.permute",
             "    all_to_all_single(recv, send)\n    return recv.permute"),
            ("    dist.all_to_all_single(recv, send, group=group)\n    return recv.transpose",
             "    all_to_all_single(recv, send)\n    return recv.transpose"))),
        ("an extra dist.barrier after the all-to-all (passed on thread ranks before, failed on 2 processes; issue 46)",
         _changed("cp_ulysses", ("    dist.all_to_all_single(recv, send, group=group)\n    return recv.permute",
                                 "    dist.all_to_all_single(recv, send, group=group)\n    dist.barrier(group=group)\n"
                                 "    return recv.permute"))),
        ("the head-count check refuses a single rank (N < 2) as well: wrong at world size 1 (hidden case)", _changed(
            "cp_ulysses", ("    if H % n:\n        raise ValueError(", "    if H % n or n < 2:\n        raise ValueError("))),
        ("the local attention written by hand as exp(s) / sum exp(s), without subtracting the row's max: overflows "
         "float32 at scores near 89 (kept full marks before the extremes of issue 42: the Ulysses cases stopped at "
         "scores near 3)", _changed(
            "cp_ulysses", ("    out = F.scaled_dot_product_attention(q_h, k_h, v_h, is_causal=causal)\n",
                           "    scores = q_h @ k_h.transpose(-2, -1) / q_h.shape[-1] ** 0.5\n"
                           "    if causal:\n"
                           "        T = scores.shape[-1]\n"
                           "        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float('-inf'))\n"
                           "    weights = scores.exp()\n"
                           "    out = (weights / weights.sum(-1, keepdim=True)) @ v_h\n"))),
    ],
    "ulysses_bytes_answer": [
        ("both move K and V once: the same bytes", _changed("ulysses_bytes_answer", ('"c"', '"a"'))),
        ("an eighth", _changed("ulysses_bytes_answer", ('"c"', '"d"'))),
    ],
}

# The same answers written other ways: K and V as two messages, the max subtracted by hand, fully masked blocks
# skipped; the zigzag built from a reversed list. (The re-shard's pieces cut with torch.chunk and stacked is the red
# team's Ulysses variant, below: one torchrun start less.)
CORRECT_VARIANTS = {
    "cp_ring_forward": [
        ("K and V sent as two messages; the max subtracted by hand; a fully masked block skipped", _changed(
            "cp_ring_forward",
            ("            works = [comm.isend(block, (rank + 1) % n), comm.irecv(incoming, (rank - 1) % n)]",
             "            works = [comm.isend(block[0].contiguous(), (rank + 1) % n),\n"
             "                     comm.isend(block[1].contiguous(), (rank + 1) % n),\n"
             "                     comm.irecv(incoming[0], (rank - 1) % n), comm.irecv(incoming[1], (rank - 1) % n)]"),
            ("        block_lse = torch.logsumexp(scores, dim=-1)                          # (B, H, T_r); -inf if all masked",
             "        row_max = scores.amax(-1, keepdim=True)\n"
             "        safe_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))\n"
             "        block_lse = (safe_max + torch.log(torch.exp(scores - safe_max).sum(-1, keepdim=True))).squeeze(-1)"))),
    ],
    "cp_ring_backward": [
        ("dK and dV kept and sent as two tensors", _changed(
            "cp_ring_backward",
            ("        grad_works = [comm.isend(grads, right), comm.irecv(incoming, left)] if n > 1 else []",
             "        grad_works = ([comm.isend(grads[0].contiguous(), right), comm.isend(grads[1].contiguous(), right),\n"
             "                       comm.irecv(incoming[0], left), comm.irecv(incoming[1], left)] if n > 1 else [])"))),
    ],
    "cp_ulysses": [
        ("from torch.distributed import all_to_all_single, get_world_size (names bound before the rehearsal: it "
         "rehearses them like any other style)", _changed(
            "cp_ulysses", ("import torch.distributed as dist\n",
                           "import torch.distributed as dist\nfrom torch.distributed import all_to_all_single, "
                           "get_world_size\n"),
            ("    n = dist.get_world_size(group)\n    B, H, T_r, D = x.shape", "    n = get_world_size(group)\n    B, H, T_r, D = x.shape"),
            ("    dist.all_to_all_single(recv, send, group=group)\n    return recv.permute",
             "    all_to_all_single(recv, send, group=group)\n    return recv.permute"))),
        ("q, k and v packed into one all-to-all (3 B H T/N D values) and the output back in a second", _changed(
            "cp_ulysses", ("    q_h, k_h, v_h = (seq_to_head(t, group) for t in (q, k, v))",
                           "    n = dist.get_world_size(group)\n    B, H, T_r, D = q.shape\n"
                           "    send = torch.cat([q, k, v], 1).reshape(B, 3, n, H // n, T_r, D).permute(2, 0, 1, 3, 4, 5).contiguous()\n"
                           "    recv = torch.empty_like(send)\n    dist.all_to_all_single(recv, send, group=group)\n"
                           "    q_h, k_h, v_h = recv.permute(2, 1, 3, 0, 4, 5).reshape(3, B, H // n, n * T_r, D)"))),
    ],
    "cp_zigzag": [
        ("the back chunk taken from a reversed list", _changed(
            "cp_zigzag", ("    return [torch.cat([chunks[r], chunks[2 * world_size - 1 - r]]) for r in range(world_size)]",
                          "    back = chunks[::-1]\n    return [torch.cat((chunks[r], back[r])) for r in range(world_size)]"))),
    ],
}

