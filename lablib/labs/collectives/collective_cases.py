"""Lab 00's exercise 1 checked on the ranks: each collective run on tensors whose values name their rank, the
errors torch raises for bad calls, and the check cases the notebook draws (``run`` runs them)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from lablib.jobs.distenv import gather_objects

# The barrier's rounds: delayed (rank r arrives r x delay_s late) and simultaneous, in A B B A A B order.
BARRIER_ROUNDS = 6


def uneven_splits(n: int) -> list[list[int]]:
    """splits[r][s]: how many elements rank r sends to rank s in the uneven all_to_all (1 or 2)."""
    return [[1 + (r + s) % 2 for s in range(n)] for r in range(n)]


def start_tensor(rank: int, numel: int) -> torch.Tensor:
    """[10 r, 10 r + 1, ...]: each value names the rank it started on."""
    return torch.arange(numel, dtype=torch.float32) + 10 * rank


def one_rank(name: str, rank: int, n: int, numel: int, group, delay_s: float):
    """(input or None, output or None, extra) of this rank for one collective of the group."""
    x = start_tensor(rank, numel)
    if name == "broadcast":
        out = x.clone()
        dist.broadcast(out, src=0, group=group)
        return x, out, {}
    if name == "reduce":
        out = x.clone()
        dist.reduce(out, dst=0, group=group)
        return x, out if rank == 0 else None, {"undefined_on": "every rank but the destination"}
    if name == "all_reduce":
        out = x.clone()
        dist.all_reduce(out, group=group)
        return x, out, {}
    if name == "all_gather":
        out = torch.empty(n * numel)
        dist.all_gather_single(out, x, group=group)
        return x, out, {}
    if name == "reduce_scatter":
        out = torch.empty(numel // n)
        dist.reduce_scatter_single(out, x, group=group)
        return x, out, {}
    if name == "all_to_all":
        out = torch.empty(numel)
        dist.all_to_all_single(out, x, group=group)
        return x, out, {}
    if name == "all_to_all_uneven":
        splits = uneven_splits(n)
        send = splits[rank]
        receive = [splits[s][rank] for s in range(n)]
        x = start_tensor(rank, sum(send))
        out = torch.empty(sum(receive))
        dist.all_to_all_single(out, x, output_split_sizes=receive, input_split_sizes=send, group=group)
        return x, out, {"splits": splits}
    if name == "scatter":
        out = torch.empty(numel // n)
        dist.scatter(out, list(x.chunk(n)) if rank == 0 else None, src=0, group=group)
        return x if rank == 0 else None, out, {}
    if name == "gather":
        out = [torch.empty(numel) for _ in range(n)] if rank == 0 else None
        dist.gather(x, out, dst=0, group=group)
        return x, torch.cat(out) if rank == 0 else None, {}
    if name == "send_recv":
        # pairs (0 -> 1), (2 -> 3), ...; an odd last rank sits out. The group's ranks 0..n-1 are the global ones.
        out = x.clone()
        if rank % 2 == 0 and rank + 1 < n:
            dist.send(x, dst=rank + 1, group=group)
        elif rank % 2 == 1:
            dist.recv(out, src=rank - 1, group=group)
        return x, out, {"pairs": [[r, r + 1] for r in range(0, n - 1, 2)]}
    if name == "barrier":
        # BARRIER_ROUNDS rounds: in the delayed ones (A B B A order) rank r sleeps r x delay_s before the barrier;
        # in the others every rank arrives at once (the same barrier: its exit spread is the floor to read against).
        # Times on the machine's wall clock (time.time(), one clock for every process), in seconds.
        rounds = []
        for k in range(BARRIER_ROUNDS):
            delayed = k % 4 in (0, 3)
            dist.barrier(group=group)
            start = time.time()
            time.sleep(rank * delay_s if delayed else 0.0)
            arrived = time.time()
            dist.barrier(group=group)
            rounds.append({"delayed": delayed, "start": start, "arrived": arrived, "left": time.time()})
        first = rounds[0]
        return x, x.clone(), {"arrived_s": first["arrived"] - first["start"], "left_s": first["left"] - first["start"],
                              "rounds": rounds}
    raise ValueError(f"unknown collective {name!r}")


def expected_errors(rank: int, n: int, group) -> dict:
    """What PyTorch says when the inputs cannot go through the collective (checked before any byte moves,
    the same on every rank, so the group stays usable)."""
    errors = {}
    try:
        dist.reduce_scatter_single(torch.empty(1), torch.ones(n + 1), group=group)
        errors["reduce_scatter_not_divisible"] = ""
    except (RuntimeError, ValueError) as exc:
        errors["reduce_scatter_not_divisible"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
    try:
        dist.all_to_all_single(torch.empty(n), torch.ones(n), output_split_sizes=[1] * n,
                               input_split_sizes=[2] * n, group=group)
        errors["all_to_all_splits_do_not_add_up"] = ""
    except (RuntimeError, ValueError) as exc:
        errors["all_to_all_splits_do_not_add_up"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
    return errors


def check_case(spec: dict, rank: int, n: int, group) -> list:
    """This rank's output of one exercise 1 check case (see the module docstring), in the current collective names."""
    name, dtype, splits = spec["collective"], getattr(torch, spec["dtype"]), spec.get("splits")
    x = torch.tensor(spec["inputs"][rank], dtype=dtype)
    if name == "all_reduce":
        out = x.clone()
        dist.all_reduce(out, group=group)
    elif name == "all_gather":
        out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=dtype)
        dist.all_gather_single(out, x, group=group)
    elif name == "reduce_scatter":
        out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=dtype)
        dist.reduce_scatter_single(out, x, group=group)
    elif name == "all_to_all" and splits:
        receive = [splits[s][rank] for s in range(n)]
        out = torch.empty((sum(receive), *x.shape[1:]), dtype=dtype)
        dist.all_to_all_single(out, x, output_split_sizes=receive, input_split_sizes=splits[rank], group=group)
    elif name == "all_to_all":
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
    else:
        raise ValueError(f"check case of collective {name!r}: choose all_reduce, all_gather, reduce_scatter or all_to_all")
    return out.tolist()


def check_cases(env, cases: dict, world_size: int, default_group) -> dict | None:
    """The check cases of one world size on ranks 0..world_size-1; rank 0 returns {"after": {case: [output per
    rank]}, "errors": expected_errors}."""
    sub = default_group if world_size == env.world_size else dist.new_group(list(range(world_size)), backend="gloo")
    member = env.rank < world_size
    mine = {case: check_case(spec, env.rank, world_size, sub) for case, spec in cases.items()} if member else None
    errors = expected_errors(env.rank, world_size, sub) if member else None
    per_rank = [r for r in gather_objects((mine, errors), env, group=default_group) if r[0] is not None]
    if not env.is_main:
        return None
    return {"after": {case: [r[0][case] for r in per_rank] for case in cases}, "errors": per_rank[0][1]}
