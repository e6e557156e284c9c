"""Wrong answers for lab 13 (tests/labkit.py: the lab's answer files): the solution's own cells with one mistake each,
and correct answers written another way (CORRECT_VARIANTS), which must keep full marks.

Exercises 3 and 4 are rehearsed on threads before their torchrun start, so every wrong answer below fails there,
without a process start. Entries marked "(red team)" repeat mistakes and correct variants that a reviewer who had
read only the released notebook wrote; three of them had kept full marks before the checks that catch them now (the
expert-parallel group ignored for the default one, an all-reduce not waited on, a trainable parameter without a
gradient).
"""

from __future__ import annotations

from labkit import SolutionCells

_cells = SolutionCells("13_expert_parallel")
_changed = _cells.changed

_KEEP_BODY = _cells.source("moe_routing").split("    by_priority = ")[1].split("\n\n")[0]
_KEEP_BODY = "    by_priority = " + _KEEP_BODY


def _keep_replaced(body: str) -> str:
    return _changed("moe_routing", (_KEEP_BODY, body.strip("\n")))


WRONG_ANSWERS = {
    "moe_routing": [
        ("first choices first, then each token's remaining choices together (right for k <= 2, wrong for k = 3; red "
         "team: kept full marks before the hidden k = 3 routings)", _keep_replaced('''
    first = expert_index[:, :1].t().reshape(-1)                      # every first choice, tokens in order
    rest = expert_index[:, 1:].reshape(-1)                           # then token by token, its other choices
    by_priority = torch.cat([first, rest])
    one_hot = torch.nn.functional.one_hot(by_priority, num_experts)
    position = one_hot.cumsum(0) - 1
    fits = (position.gather(1, by_priority.unsqueeze(1)).squeeze(1) < capacity)
    t, k = expert_index.shape
    return torch.cat([fits[:t].view(t, 1), fits[t:].view(t, k - 1)], 1)
''')),
        ("capacity rounded down", _changed("moe_routing", (
            "    return math.ceil(Fraction(str(capacity_factor)) * k * num_tokens / num_experts)",
            "    return math.floor(Fraction(str(capacity_factor)) * k * num_tokens / num_experts)"))),
        ("capacity forgets the k assignments per token", _changed("moe_routing", (
            "    return math.ceil(Fraction(str(capacity_factor)) * k * num_tokens / num_experts)",
            "    return math.ceil(Fraction(str(capacity_factor)) * num_tokens / num_experts)"))),
        ("priority token by token (each token's choices together), not first choices first", _changed("moe_routing", (
            "    by_priority = expert_index.t().reshape(-1)", "    by_priority = expert_index.reshape(-1)"), (
            "    return fits.view(expert_index.shape[1], -1).t().contiguous()",
            "    return fits.view(expert_index.shape)"))),
        ("each expert keeps its last `capacity` assignments instead of its first", _keep_replaced('''
    by_priority = expert_index.t().reshape(-1).flip(0)                # walked from the end
    one_hot = torch.nn.functional.one_hot(by_priority, num_experts)
    position = one_hot.cumsum(0) - 1
    fits = (position.gather(1, by_priority.unsqueeze(1)).squeeze(1) < capacity).flip(0)
    return fits.view(expert_index.shape[1], -1).t().contiguous()''')),
        ("(red team) expert_index transposed in place: the mask is right, the caller's tensor comes back (k, T)",
         _changed("moe_routing", ("    by_priority = expert_index.t().reshape(-1)",
                                  "    num_tokens, k = expert_index.shape\n"
                                  "    by_priority = expert_index.t_().reshape(-1)"), (
             "    return fits.view(expert_index.shape[1], -1).t().contiguous()",
             "    return fits.view(k, num_tokens).t().contiguous()"))),
        ("the dropped assignments also marked -1 in the caller's expert_index (the mask is right; the caller's "
         "routing is changed): caught by the visible check now", _changed("moe_routing", (
             "    return fits.view(expert_index.shape[1], -1).t().contiguous()",
             "    keep = fits.view(expert_index.shape[1], -1).t().contiguous()\n"
             "    expert_index[~keep] = -1\n"
             "    return keep"))),
        ("(red team) one_hot without num_classes: fails when no token comes (T = 0)", _changed("moe_routing", (
            "torch.nn.functional.one_hot(by_priority, num_experts)", "torch.nn.functional.one_hot(by_priority)"))),
        ("(red team) off by one: an expert keeps capacity + 1 assignments", _changed("moe_routing", (
            "squeeze(1) < capacity)", "squeeze(1) <= capacity)"))),
        ("capacity applied to the whole batch (the first E x capacity assignments kept, whatever their expert), "
         "not per expert", _keep_replaced('''
    by_priority = expert_index.t().reshape(-1)
    fits = torch.arange(by_priority.numel()) < capacity * num_experts
    return fits.view(expert_index.shape[1], -1).t().contiguous()''')),
        ("the mask cached by (shape, experts, capacity), since a training step's batch has the same shape every step: "
         "the second step gets the first step's mask (kept full marks before the three routing steps of issue 42)",
         _changed("moe_routing",
                  ("import torch\n", "import torch\n\n_PLANS = {}   # (shape, experts, capacity) -> mask: a training "
                                     "step's batch has the same shape every step\n"),
                  ("    by_priority = expert_index.t().reshape(-1)",
                   "    key = (tuple(expert_index.shape), num_experts, capacity)\n    if key in _PLANS:\n"
                   "        return _PLANS[key]\n    by_priority = expert_index.t().reshape(-1)"),
                  ("    return fits.view(expert_index.shape[1], -1).t().contiguous()",
                   "    _PLANS[key] = fits.view(expert_index.shape[1], -1).t().contiguous()\n    return _PLANS[key]"))),
    ],
    "moe_aux_loss": [
        ("P_i from the chosen experts' probabilities only (the top-k gates), not the softmax over all experts",
         _changed("moe_aux_loss", ("    P = router_probs.mean(dim=0)",
                                   "    chosen = torch.zeros_like(router_probs).scatter(1, expert_index, 1.0)\n"
                                   "    P = (router_probs * chosen).mean(dim=0)"))),
        ("the factor E (the number of experts) left out", _changed("moe_aux_loss", (
            "    return alpha * num_experts * torch.sum(f * P)", "    return alpha * torch.sum(f * P)"))),
        ("f_i divided by T, not by the T k assignments (k = 2 counts every token twice)", _changed("moe_aux_loss", (
            "    f = counts.to(router_probs.dtype) / expert_index.numel()",
            "    f = counts.to(router_probs.dtype) / num_tokens"))),
        ("(red team) f_i in float64: the loss comes back float64 for float32 probabilities", _changed("moe_aux_loss", (
            "    f = counts.to(router_probs.dtype) / expert_index.numel()",
            "    f = counts.double() / expert_index.numel()"))),
        ("(red team) f_i from the first choices only (the k = 1 definition used for top-2)", _changed("moe_aux_loss", (
            "    counts = torch.bincount(expert_index.reshape(-1), minlength=num_experts)\n"
            "    f = counts.to(router_probs.dtype) / expert_index.numel()",
            "    counts = torch.bincount(expert_index[:, 0], minlength=num_experts)\n"
            "    f = counts.to(router_probs.dtype) / num_tokens"))),
        ("(red team) P_i detached: no gradient reaches the router", _changed("moe_aux_loss", (
            "    P = router_probs.mean(dim=0)", "    P = router_probs.detach().mean(dim=0)"))),
        ("f_i taken from the probabilities (soft counts: f = P), so the loss is E sum P_i^2", _changed("moe_aux_loss", (
            "    f = counts.to(router_probs.dtype) / expert_index.numel()", "    f = router_probs.mean(dim=0)"))),
    ],
    "ep_dispatch": [
        ("an expert that received no row is not run (its gradient stays None; the text asks to run it on zero rows; red "
         "team: kept full marks before every local expert's gradient was required)", _changed("ep_dispatch", (
            "        rows = (local_id == i).nonzero().squeeze(1)\n        out = out.index_copy(0, rows, expert(tokens[rows]))",
            "        rows = (local_id == i).nonzero().squeeze(1)\n        if len(rows) == 0:\n            continue\n"
            "        out = out.index_copy(0, rows, expert(tokens[rows]))"), (
            "    back = AllToAll.apply(out, recv_splits, send_splits, group)",
            "    back = AllToAll.apply(out + tokens.sum() * 0, recv_splits, send_splits, group)"))),
        ("combine in dispatch order: the i-th result back goes to the i-th kept token, not to its own token",
         _changed("ep_dispatch", ("    return torch.zeros_like(x).index_add(0, order // k, weighted)",
                                  "    return torch.zeros_like(x).index_add(0, torch.sort(order // k).values, weighted)"))),
        ("the counts are not exchanged: each rank assumes it receives what it sends (equal splits)", _changed(
            "ep_dispatch", ("    dist.all_to_all_single(received, per_expert, group=group)",
                            "    received.copy_(per_expert)"))),
        ("the all-to-all's backward sends the gradient with the same splits as the forward (not swapped)", _changed(
            "ep_dispatch", ("        grad_in = grad_out.new_empty((sum(ctx.in_splits),) + tuple(grad_out.shape[1:]))\n"
                            "        dist.all_to_all_single(grad_in, grad_out.contiguous(), output_split_sizes=ctx.in_splits,\n"
                            "                               input_split_sizes=ctx.out_splits, group=ctx.group)",
                            "        grad_in = grad_out.new_empty((sum(ctx.out_splits),) + tuple(grad_out.shape[1:]))\n"
                            "        dist.all_to_all_single(grad_in, grad_out.contiguous(), output_split_sizes=ctx.out_splits,\n"
                            "                               input_split_sizes=ctx.in_splits, group=ctx.group)"))),
        ("the gates are not applied to the experts' outputs", _changed("ep_dispatch", (
            "    weighted = back * gates.reshape(-1)[order].unsqueeze(1)", "    weighted = back"))),
        ("an expert that received no row is skipped, so that rank's backward skips the combine's all-to-all "
         "(its next all-to-all meets a peer's other one: the rehearsal reports the mismatched sizes at once)",
         _changed("ep_dispatch", (
            "        out = out.index_copy(0, rows, expert(tokens[rows]))",
            "        if rows.numel():\n            out = out.index_copy(0, rows, expert(tokens[rows]))"))),
        ("(red team) the world size of the default group, not of the expert-parallel group passed in", _changed(
            "ep_dispatch", ("    n, per_rank = dist.get_world_size(group), len(local_experts)",
                            "    n, per_rank = dist.get_world_size(), len(local_experts)"))),
        ("(red team) assignment a taken as token a % T (choice-major) while expert_index is flattened token by token "
         "(right for k = 1 only)", _changed("ep_dispatch", ("order // k", "order % expert_index.shape[0]"))),
        ("(red team) the output made in float32 whatever x's dtype", _changed("ep_dispatch", (
            "    return torch.zeros_like(x).index_add(0, order // k, weighted)",
            "    return torch.zeros(x.shape).index_add(0, order // k, weighted.float())"))),
        ("(red team) the dropped assignments sent too (as expert 0 with gate 0): right values, extra rows and bytes",
         _changed("ep_dispatch", ("    flat = expert_index.reshape(-1)",
                                  "    flat = expert_index.reshape(-1).clamp(min=0)"), (
             "    weighted = back * gates.reshape(-1)[order].unsqueeze(1)",
             "    weighted = back * (gates * (expert_index >= 0)).reshape(-1)[order].unsqueeze(1)"))),
    ],
    "ep_dp": [
        ("the experts' gradients reduced over every rank (the wrong group: different experts added together)",
         _changed("ep_dp", ("(expert_params, dp_group)", "(expert_params, world_group)"))),
        ("the experts' gradients averaged over their data-parallel group (divided by dp, not by the world size)",
         _changed("ep_dp", ("            p.grad.div_(world)", "            p.grad.div_(dist.get_world_size(group))"))),
        ("the dense gradients reduced over the data-parallel group only", _changed("ep_dp", (
            "(dense_params, world_group)", "(dense_params, dp_group)"))),
        ("the reduced gradient assigned as a new tensor, not written into the .grad the optimizer holds", _changed(
            "ep_dp", ("            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)\n"
                      "            p.grad.div_(world)",
                      "            total = p.grad.clone()\n"
                      "            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)\n"
                      "            p.grad = total / world"))),
        ("the dense gradients reduced over dist.group.WORLD (\"they are on every rank\"), not the world_group given: "
         "wrong when the MoE layer's world is a part of the job, e.g. one pipeline stage (kept full marks before the "
         "other world groups of issue 42)", _changed("ep_dp", (
            "    for params, group in ((dense_params, world_group), (expert_params, dp_group)):",
            "    for params, group in ((dense_params, dist.group.WORLD), (expert_params, dp_group)):   # dense: on every rank"))),
        ("divided by dist.get_world_size() of the default group, not of world_group (kept full marks before the other "
         "world groups of issue 42)", _changed("ep_dp", (
            "    world = dist.get_world_size(world_group)", "    world = dist.get_world_size()"))),
        ("all-zero gradients skipped as nothing to reduce: after zero_grad(set_to_none=False) a parameter no token of "
         "this rank reached holds zeros here and values elsewhere, so the ranks' all-reduces no longer match (kept full "
         "marks before the gradient starts of issue 42)", _changed("ep_dp", (
            "            if p.grad is None:                  # frozen, or never reached: nothing to reduce",
            "            if p.grad is None or not p.grad.any():   # frozen, never reached, or all zeros: nothing to reduce"))),
    ],
    "dispatch_bytes_answer": [
        ("(c): counts the rank's own block as sent away", 'dispatch_bytes_answer = "c"'),
        ("(a): the dispatch only, no combine, k forgotten", 'dispatch_bytes_answer = "a"'),
        ("(red team) (d): divides by N instead of keeping the (N-1)/N that leaves", 'dispatch_bytes_answer = "d"'),
    ],
}
WRONG_ANSWERS["ep_dp"] += [
    ("(red team) an asynchronous all-reduce never waited on: the division races the reduction (on gloo too)",
     _changed("ep_dp", ("            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)",
                        "            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group, async_op=True)"))),
    ("(red team) skips only frozen parameters (requires_grad False): all_reduce(None) on a trainable parameter the "
     "loss never reached", _changed("ep_dp", ("            if p.grad is None:",
                                             "            if not p.requires_grad:"))),
    ("(red team) the experts' gradients divided by dp squared (dp taken for the expert-parallel degree too: right on "
     "a square mesh only)", _changed("ep_dp", (
         "            p.grad.div_(world)",
         "            p.grad.div_(world if group is world_group else dist.get_world_size(group) ** 2)"))),
]

CORRECT_VARIANTS = {
    "moe_routing": [
        ("loops over choices and tokens, a counter per expert", _keep_replaced('''
    num_tokens, k = expert_index.shape
    keep = torch.zeros(num_tokens, k, dtype=torch.bool)
    used = [0] * num_experts
    for j in range(k):
        for t in range(num_tokens):
            e = int(expert_index[t, j])
            keep[t, j] = used[e] < capacity
            used[e] += 1
    return keep''')),
        ("capacity as a float ceiling (the graded factors are exact in binary)", _changed("moe_routing", (
            "    from fractions import Fraction\n"
            "    return math.ceil(Fraction(str(capacity_factor)) * k * num_tokens / num_experts)",
            "    return math.ceil(capacity_factor * k * num_tokens / num_experts)"))),
    ],
    "moe_aux_loss": [
        ("f from a one-hot mean, P by sum / T", _changed("moe_aux_loss", (
            "    counts = torch.bincount(expert_index.reshape(-1), minlength=num_experts)\n"
            "    f = counts.to(router_probs.dtype) / expert_index.numel()\n"
            "    P = router_probs.mean(dim=0)",
            "    one_hot = torch.nn.functional.one_hot(expert_index, num_experts).to(router_probs.dtype)\n"
            "    f = one_hot.sum(dim=(0, 1)) / (num_tokens * expert_index.shape[1])\n"
            "    P = router_probs.sum(dim=0) / num_tokens"))),
    ],
    "ep_dispatch": [
        ("PyTorch's autograd all-to-all (torch.distributed.nn.functional.all_to_all_single) instead of the own "
         "Function", _changed("ep_dispatch", (
            "    tokens = AllToAll.apply(x[order // k], send_splits, recv_splits, group)",
            "    from torch.distributed.nn.functional import all_to_all_single as a2a\n"
            "    send = x[order // k]\n"
            "    tokens = a2a(send.new_empty((sum(recv_splits),) + tuple(send.shape[1:])), send, recv_splits,\n"
            "                 send_splits, group)"), (
            "    back = AllToAll.apply(out, recv_splits, send_splits, group)",
            "    back = a2a(out.new_empty((sum(send_splits),) + tuple(out.shape[1:])), out, send_splits, recv_splits,\n"
            "               group)"))),
    ],
    "ep_dp": [
        ("one flat buffer per group: one all-reduce each, copied back into the .grad tensors", _changed("ep_dp", (
            "        for p in params:\n"
            "            if p.grad is None:                  # frozen, or never reached: nothing to reduce\n"
            "                continue\n"
            "            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)\n"
            "            p.grad.div_(world)                  # W, not the group's size: see the derivation above",
            "        grads = [p.grad for p in params if p.grad is not None]\n"
            "        if not grads:\n"
            "            continue\n"
            "        flat = torch.cat([g.reshape(-1) for g in grads])\n"
            "        dist.all_reduce(flat, group=group)\n"
            "        flat /= world\n"
            "        for g, part in zip(grads, flat.split([g.numel() for g in grads])):\n"
            "            g.copy_(part.view_as(g))"), (
            "import torch.distributed as dist", "import torch\nimport torch.distributed as dist"))),
    ],
}


def _body_replaced(grade_id: str, function: str, body: str) -> str:
    """The solution cell with ``function``'s body (after its docstring) replaced by ``body``."""
    source = _cells.source(grade_id)
    after_docstring = source.split(f"def {function}(", 1)[1].split('"""\n', 1)[1]
    old_body = after_docstring.split("\n\n\n")[0].rstrip("\n")
    return _changed(grade_id, (old_body, body.strip("\n")))


CORRECT_VARIANTS["moe_routing"].append(
    ("(red team) each assignment's place in its expert's queue from cumsum * one_hot summed over experts",
     _keep_replaced('''
    T, k = expert_index.shape
    flat = expert_index.t().reshape(-1)                       # choice-major: all first choices, then all second
    onehot = torch.nn.functional.one_hot(flat, num_experts)   # (kT, E)
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1        # rank of this assignment within its expert
    return (position < capacity).reshape(k, T).t()''')))
CORRECT_VARIANTS["moe_aux_loss"].append(
    ("(red team) f from a one-hot under no_grad, P = sum / T, the product by einsum", _changed("moe_aux_loss", (
        "    counts = torch.bincount(expert_index.reshape(-1), minlength=num_experts)\n"
        "    f = counts.to(router_probs.dtype) / expert_index.numel()\n"
        "    P = router_probs.mean(dim=0)\n"
        "    return alpha * num_experts * torch.sum(f * P)",
        "    with torch.no_grad():\n"
        "        one_hot = torch.nn.functional.one_hot(expert_index, num_experts).to(router_probs.dtype)\n"
        "        f = one_hot.sum(dim=(0, 1)) / (num_tokens * expert_index.shape[1])\n"
        "    P = router_probs.sum(0) / num_tokens\n"
        "    return torch.einsum(\"e,e->\", f, P) * (alpha * num_experts)"))))
WRONG_ANSWERS["ep_dispatch"] += [
    ("every rank's whole batch and its routing sent to every rank, dense (T, k, h) results back: right values and "
     "rows, 800-2672 bytes where the formula gives 256-1248 (it kept full marks under the old bound "
     "2 k T h b + 4096)", _body_replaced("ep_dispatch", "expert_parallel_moe", '''
    n, me, per_rank = dist.get_world_size(group), dist.get_rank(group), len(local_experts)
    T, k = expert_index.shape
    h = x.shape[1]
    sizes = torch.full((n,), T, dtype=torch.int64, device=x.device)
    theirs = torch.empty_like(sizes)
    dist.all_to_all_single(theirs, sizes, group=group)               # every rank's T
    recv = theirs.tolist()
    xs = AllToAll.apply(x.repeat(n, 1), [T] * n, recv, group)         # the whole batch to every rank
    idx = expert_index.new_empty((sum(recv), k))
    dist.all_to_all_single(idx, expert_index.repeat(n, 1), output_split_sizes=recv, input_split_sizes=[T] * n,
                           group=group)
    dense = xs.new_zeros((sum(recv), k, h))
    for i, expert in enumerate(local_experts):
        t, j = (idx == me * per_rank + i).nonzero(as_tuple=True)
        dense = dense.index_put((t, j), expert(xs[t]))
    back = AllToAll.apply(dense.reshape(sum(recv), k * h), recv, [T] * n, group).view(n, T, k, h).sum(0)
    return (back * gates.unsqueeze(-1)).sum(1)''')),
    ("the backward exchanges the counts again (splits recomputed from an all-to-all of the sizes) instead of "
     "keeping the forward's: right values, 8 N bytes more per backward exchange", _changed("ep_dispatch", (
        "        grad_in = grad_out.new_empty((sum(ctx.in_splits),) + tuple(grad_out.shape[1:]))",
        "        sizes = torch.tensor(ctx.out_splits, dtype=torch.int64, device=grad_out.device)\n"
        "        theirs = torch.empty_like(sizes)\n"
        "        dist.all_to_all_single(theirs, sizes, group=ctx.group)\n"
        "        ctx.in_splits = theirs.tolist()\n"
        "        grad_in = grad_out.new_empty((sum(ctx.in_splits),) + tuple(grad_out.shape[1:]))"))),
]
_FROM_IMPORTED = _cells.source("ep_dispatch").replace(
    "import torch.distributed as dist\n",
    "import torch.distributed as dist\nfrom torch.distributed import all_to_all_single\n").replace(
    "dist.all_to_all_single(", "all_to_all_single(")
CORRECT_VARIANTS["ep_dispatch"].append(
    ("from torch.distributed import all_to_all_single: the thread rehearsals step aside, the real run grades it",
     _FROM_IMPORTED))
CORRECT_VARIANTS["ep_dp"].append(
    ("from torch.distributed import all_reduce, get_world_size, ReduceOp: the rehearsals step aside",
     _cells.source("ep_dp").replace("import torch.distributed as dist\n",
                                    "from torch.distributed import ReduceOp, all_reduce, get_world_size\n")
     .replace("dist.get_world_size(", "get_world_size(").replace("dist.all_reduce(", "all_reduce(")
     .replace("dist.ReduceOp", "ReduceOp")))
# The red team's "no sort" dispatch (assignments found per expert by nonzero) is a correct variant. It once seemed to
# fail on a rank whose every assignment is dropped ("element 0 of tensors does not require grad"): that error was the
# probe's own float64 reference, which has no graph on such a rank (the model answer failed there too, about one
# drawn case in eight); a fixed hidden case ("a rank sends nothing") now reaches such a rank at every grading.
CORRECT_VARIANTS["ep_dispatch"].append(
    ("(red team) no sort: each expert's assignments found by nonzero, the results split per source and expert",
     _body_replaced("ep_dispatch", "expert_parallel_moe", '''
    world = dist.get_world_size(group)
    per_rank = num_experts // world
    T, k = expert_index.shape
    flat_expert = expert_index.reshape(-1)
    flat_token = torch.arange(T, device=x.device).repeat_interleave(k)
    flat_gate = gates.reshape(-1)
    sel = torch.cat([(flat_expert == e).nonzero(as_tuple=True)[0] for e in range(num_experts)])
    sel_expert, sel_token = flat_expert[sel], flat_token[sel]
    send_counts = torch.bincount(sel_expert, minlength=num_experts).to(torch.int64)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    recv_matrix = recv_counts.view(world, per_rank)            # [source rank, local expert]
    send_splits = send_counts.view(world, per_rank).sum(1).tolist()
    recv_splits = recv_matrix.sum(1).tolist()
    received = AllToAll.apply(x[sel_token], send_splits, recv_splits, group)
    pieces = list(received.split(recv_matrix.reshape(-1).tolist()))
    results = [None] * len(pieces)
    for e, expert in enumerate(local_experts):
        idx = [s * per_rank + e for s in range(world)]
        out = expert(torch.cat([pieces[i] for i in idx]))
        for i, part in zip(idx, out.split([pieces[i].shape[0] for i in idx])):
            results[i] = part
    back = AllToAll.apply(torch.cat(results), recv_splits, send_splits, group)
    weighted = back * flat_gate[sel].unsqueeze(-1)
    return torch.zeros_like(x).index_add(0, sel_token, weighted.to(x.dtype))''')))
CORRECT_VARIANTS["ep_dp"].append(
    ("(red team) each gradient scaled by 1/W first, then all-reduced in place", _changed("ep_dp", (
        "            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)\n"
        "            p.grad.div_(world)                  # W, not the group's size: see the derivation above",
        "            p.grad.mul_(1.0 / world)\n"
        "            dist.all_reduce(p.grad, group=group)"))))
