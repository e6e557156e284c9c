"""Lab 06's overlap verdicts: was each all-reduce launched as early as the rule allows, and waited for only
after the backward? Pure functions of one step's record (``probe.probe_case``), never a duration.

The record holds, per step, on one rank: ``ready``, the order in which the parameters' gradients became final on
this rank (the probe's own ``register_post_accumulate_grad_hook``, registered before the student's, so it runs
first for each parameter), as (perf_counter seconds, index into the ready-order list); ``launched`` and
``bytes``, each all-reduce's launch time and message size in launch order (``lablib.measure.counting``);
``backward_done``, when ``loss.backward()`` returned; ``waits_in_backward``, the ``Work.wait`` and
``Future.wait`` calls made before it returned.

The rules, the same that PyTorch's reducer follows (torch/csrc/distributed/c10d/reducer.hpp: ``next_bucket_``,
line 232; ``unused_parameters_``, 243, found by a search of the autograd graph at the end of the forward and
marked ready at the backward's start; ``local_used_map_``, 253-263, all-reduced after the backward to find the
globally unused parameters):

- per parameter (exercise 1): the all-reduce of the k-th gradient to become final is launched after it and
  before the next gradient becomes final (the last one: before ``backward()`` returns);
- per bucket (exercise 3): buckets are launched strictly in index order; bucket k may go once its own used
  gradients and every earlier bucket are done, and must go before the next gradient after that moment becomes
  final. A parameter this rank does not use counts as ready from the first hook on (at the end of the forward
  at the latest);
- nobody waits for a collective inside the forward or the backward.
"""

from __future__ import annotations


def usage_map_sizes(n_params: int) -> set[int]:
    """Bytes of the one extra all-reduce a bucketed class may issue: one flag per trainable parameter, in any
    dtype from 1 to 8 bytes (DDP's ``local_used_map_`` is int32)."""
    return {n_params * size for size in (1, 2, 4, 8)}


def split_usage_map(sent: list[int], expected: list[int], n_params: int) -> tuple[list[int], int | None]:
    """The positions in ``sent`` (bytes per all-reduce, launch order) of the buckets, and that of the usage map
    (None if there is none): ``sent`` must be ``expected`` in index order, with at most one usage map
    anywhere. Returns ([], None) when it is not."""
    if list(sent) == list(expected):
        return list(range(len(sent))), None
    for j in reversed(range(len(sent))):           # the map usually goes last: try there first
        n = sent[j]
        if n in usage_map_sizes(n_params) and list(sent[:j]) + list(sent[j + 1:]) == list(expected):
            return [i for i in range(len(sent)) if i != j], j
    return [], None


def buckets_and_usage_map(sent: list[int], grad_bytes: int, n_params: int) -> tuple[list[int], int | None]:
    """For a measurement, where the expected buckets are not known: the positions in ``sent`` (bytes per
    all-reduce, launch order) of the buckets, and that of the usage map (None if there is none). The buckets
    together carry every gradient byte once; the map is the one all-reduce of ``n_params`` flags beside them.
    When no such split exists, every all-reduce counts as a bucket."""
    if sum(sent) != grad_bytes:
        for j in reversed(range(len(sent))):       # the map usually goes last: try there first
            if sent[j] in usage_map_sizes(n_params) and sum(sent) - sent[j] == grad_bytes:
                return [i for i in range(len(sent)) if i != j], j
    return list(range(len(sent))), None


def _deadline(step: dict, j: int) -> tuple[float, str]:
    ready = step["ready"]
    if j + 1 < len(ready):
        return ready[j + 1][0], (f"gradient {ready[j + 1][1]} became final (its index in reverse registration "
                                 f"order, the order the gradients are assumed to become ready)")
    return step["backward_done"], "backward() returned"


def plural(n: int, noun: str) -> str:
    """'1 all-reduce', '2 all-reduces'."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _were(n: int, noun: str) -> str:
    return plural(n, noun) + (" was" if n == 1 else " were")


def individual_problems(step: dict, param_bytes: list[int]) -> list[str]:
    """Per parameter: the k-th all-reduce launched during the backward carries the k-th gradient to become final,
    launched after it and before the next one. Zero all-reduces for unused parameters after the backward are
    allowed (another way to keep the ranks' sequences equal)."""
    during = [(t, n) for t, n in zip(step["launched"], step["bytes"]) if t < step["backward_done"]]
    problems = []
    if len(during) != len(step["ready"]):
        return [f"{_were(len(during), 'all-reduce')} launched before backward() returned, for "
                f"{plural(len(step['ready']), 'gradient')} that became final in it: launch one from each parameter's hook"]
    for k, ((t_ready, i), (t_launch, n)) in enumerate(zip(step["ready"], during)):
        deadline, what = _deadline(step, k)
        if n != param_bytes[i]:
            problems.append(f"all-reduce {k} sent {n} bytes, but the gradient that became final then has "
                            f"{param_bytes[i]}: all-reduce each gradient from its own hook")
        elif not t_ready <= t_launch < deadline:
            problems.append(f"all-reduce {k} was launched {1e3 * (t_launch - t_ready):.2f} ms after its gradient "
                            f"became final, after {what}: launch it inside that parameter's hook")
    return problems[:3]


def launch_order_problems(step: dict, bucket_bytes: list[int], n_params: int) -> list[str]:
    """Per bucket: the all-reduces' sizes in launch order are the buckets' in index order, every bucket every step
    (plus at most one usage map). Not an overlap verdict: a wrapper that overlaps nothing can pass it."""
    positions, _ = split_usage_map(step["bytes"], bucket_bytes, n_params)
    if not positions and bucket_bytes:
        return [f"all-reduces sent {step['bytes']} bytes in launch order; the buckets, in index order, hold "
                f"{bucket_bytes} (plus at most one usage map of {n_params} flags): launch bucket k+1 only after "
                f"bucket k, every bucket every step"]
    return []


def bucket_problems(step: dict, buckets: list[list[int]], bucket_bytes: list[int], n_params: int) -> list[str]:
    """Per bucket, once the launch order is right (``launch_order_problems``): each launched as soon as it and
    every earlier bucket are complete."""
    positions, _ = split_usage_map(step["bytes"], bucket_bytes, n_params)
    if not positions and bucket_bytes:
        return launch_order_problems(step, bucket_bytes, n_params)
    at = {i: k for k, (_, i) in enumerate(step["ready"])}
    problems, j = [], 0
    for k, bucket in enumerate(buckets):
        used = [at[i] for i in bucket if i in at]
        j = max([j, *used])
        launched = step["launched"][positions[k]]
        deadline, what = _deadline(step, j)
        if used and launched < step["ready"][max(used)][0]:
            problems.append(f"bucket {k} was launched before its last gradient became final")
        elif step["ready"] and launched >= deadline:
            problems.append(f"bucket {k} was launched {1e3 * (launched - deadline):.2f} ms after {what}, although "
                            f"it and every earlier bucket were complete before: launch it from the hook that "
                            f"completes it (a parameter unused on this rank counts as ready from the forward's end)")
    return problems[:3]


def wait_problems(step: dict) -> list[str]:
    if step["waits_in_backward"]:
        return [f"{step['waits_in_backward']} wait() call(s) on a collective before backward() returned: the "
                f"backward stalls there; wait for the handles in finish_gradient_synchronization"]
    return []
