"""Lab 11's planner, the reference the hidden tests compare the students' ``predict`` and ``plan`` with (instructor
only: students never import it). The notebook's section 6 derives every term; in short, per GPU:

Degrees: data-parallel dp, ZeRO stage zero, tensor-parallel tp (within a node), pipeline pp, micro-batch size mbs
(sequences), recomputation ``none`` (eager attention: the a s x s scores are stored), ``selective`` (Korthikanti
et al., 2022: the scores recomputed; the same memory as fused attention, e.g. the course GPT's SDPA, which never
stores them) or ``full`` (only each layer's input kept, the layer's forward run again in the backward). The global
batch B is dp * mbs * m sequences: m micro-batches per step (gradient accumulation without pp, the pipeline's
micro-batches with pp). Mesh order tp (innermost), dp, pp (Megatron's): a dp group sits in one node when
tp * dp <= gpus_per_node, a pipeline's neighbours when all N GPUs do.

Memory: model states Psi' = P / (tp pp) parameters of (w, g, o) bytes, ZeRO z dividing o (z >= 1), g (z >= 2), w
(z = 3) by dp; activations per layer and micro-batch s b h (10 + 24/tp) bytes plus 5 a s^2 b / tp for stored
scores (Korthikanti eq. 2 without sequence parallelism), 2 s b h for a full-recomputation layer plus one layer's
working set; 1F1B keeps min(pp, m) micro-batches on the first stage, one on the last, which also holds the fp32
logits 4 s b v / tp. A plan fits when memory <= memory_bytes - reserve_bytes.

Time: (m + pp - 1) micro-batch slots (lab 09's bubble) of one micro-batch's compute 6 Psi' b s / F (8/6 of it
under full recomputation), tensor-parallel all-reduces (4 per layer, 6 with full recomputation, of 2 b s h bytes,
lab 02's ring within a node) and pipeline sends (one activation forward, one gradient back, 2 b s h bytes each);
then the data-parallel gradient reduction's exposed part: DDP's 25 MiB buckets overlap the last micro-batch's
backward except the last bucket (``lablib.course.scaling.bucketed_backward``'s schedule in closed form), an
all-reduce for z = 0, a reduce-scatter for z >= 1, once per step for z <= 1 (whole gradients accumulate). ZeRO-2
shards the gradients, so every micro-batch's are reduce-scattered: m reductions on one link, each further one adding
what exceeds a micro-batch's compute (the same schedule over m backwards, checked by simulation in
tests/test_lablib_strategies.py). ZeRO-1/2 then all-gather the updated parameters (exposed). ZeRO-3 gathers the
parameters twice per micro-batch (forward, backward) and reduce-scatters once: 3 m collectives on one link, hidden
at most behind the m micro-batches' compute, the last bucket exposed. ZeRO-2/3 with pp > 1 is refused here, as
DeepSpeed's PipelineEngine refuses it (its __init__ asserts a ZeRO stage below ZeroStageEnum.gradients, message
"ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism", deepspeed 0.19.8 runtime/pipe/engine.py:76-77): the
engine reduces the gradients once per step, after the last micro-batch.
"""

from __future__ import annotations

MIXED_ADAM = (2, 2, 12)
BUCKET_BYTES = 25 * 2**20                  # DDP: _DEFAULT_BUCKET_CAP_MB = 25 (MiB), torch/nn/parallel/distributed.py:31
RECOMPUTE = ("none", "selective", "full")
TIME_RTOL = 0.01                           # a plan within 1% of the fastest predicted step is graded right


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _all_reduce_s(nbytes: float, n: int, bw: float) -> float:
    return 2 * (n - 1) / n * nbytes / bw


def _half_ring_s(nbytes: float, n: int, bw: float) -> float:
    """A ring reduce-scatter or all-gather: half an all-reduce."""
    return (n - 1) / n * nbytes / bw


def predict(model: dict, cluster: dict, dp: int, zero: int, tp: int, pp: int, mbs: int, recompute: str,
            state_bytes=MIXED_ADAM) -> dict:
    P, L, h, a, s, B, v = (model[k] for k in ("params", "layers", "hidden", "heads", "seq", "batch", "vocab"))
    N, g, F = cluster["gpus"], cluster["gpus_per_node"], cluster["flops"]
    if (min(dp, tp, pp, mbs) < 1 or dp * tp * pp != N or B % (dp * mbs) or L % pp or a % tp or tp > g
            or zero not in (0, 1, 2, 3) or recompute not in RECOMPUTE or (zero >= 2 and pp > 1)):
        raise ValueError("invalid degrees")
    psi = P / (tp * pp)
    wb, gb, ob = state_bytes
    states = psi * (wb / (dp if zero >= 3 else 1) + gb / (dp if zero >= 2 else 1) + ob / (dp if zero >= 1 else 1))
    m, b = B // (dp * mbs), mbs
    layer = s * b * h * (10 + 24 / tp)                       # one layer, one micro-batch, scores not stored
    kept, working = {"none": (layer + 5 * a * s * s * b / tp, 0.0), "selective": (layer, 0.0),
                     "full": (2 * s * b * h, layer)}[recompute]
    first = (L // pp) * kept * min(pp, m) + working
    last = (L // pp) * kept + working + 4 * s * b * v / tp
    activations = max(first, last)

    full = recompute == "full"
    compute_mb = (8 if full else 6) * psi * b * s / F
    tp_mb = (L // pp) * (6 if full else 4) * _all_reduce_s(2 * b * s * h, tp, cluster["bw_intra"])
    pp_bw = cluster["bw_intra"] if N <= g else cluster["bw_inter"]
    pp_mb = 2 * (2 * b * s * h) / pp_bw if pp > 1 else 0.0
    pipeline = (m + pp - 1) * (compute_mb + tp_mb + pp_mb)

    dp_bw = cluster["bw_intra"] if tp * dp <= g else cluster["bw_inter"]
    exposed = 0.0
    if dp > 1:
        reduce = _all_reduce_s if zero == 0 else _half_ring_s
        grads = gb * psi
        bucket = min(BUCKET_BYTES, grads)
        last_bucket = reduce(bucket, dp, dp_bw)
        if zero <= 2:
            # z <= 1: the gradients accumulate whole and are reduced once, during the last micro-batch's backward.
            # z = 2: they are sharded, so each micro-batch's are reduce-scattered (m reductions on one link); while the
            # link keeps up each is hidden but the last's last bucket, once it falls behind each further reduction
            # adds what exceeds one micro-batch's compute (the link busy from the first micro-batch's first bucket).
            backward = (6 if full else 4) * psi * b * s / F      # the last micro-batch's backward
            reductions = m if zero == 2 else 1
            one = reduce(grads, dp, dp_bw) - backward * (grads - bucket) / grads
            exposed = max(last_bucket, one + (reductions - 1) * max(0.0, reduce(grads, dp, dp_bw) - compute_mb))
            if zero >= 1:
                exposed += _half_ring_s(wb * psi, dp, dp_bw)   # the updated parameters all-gathered (exposed)
        else:
            # z = 3: two gathers of the parameters (forward, backward) and one reduce-scatter per micro-batch, all on
            # one link, prefetched behind the m micro-batches' compute; the last bucket's reduce-scatter stays exposed
            link = m * (2 * _half_ring_s(wb * psi, dp, dp_bw) + reduce(grads, dp, dp_bw))
            exposed = max(last_bucket, link - m * compute_mb)
    return {"memory_bytes": states + activations, "step_s": pipeline + exposed, "states_bytes": states,
            "activation_bytes": activations, "compute_s": m * compute_mb, "pipeline_s": pipeline,
            "tp_comm_s": m * tp_mb, "pp_comm_s": m * pp_mb, "dp_exposed_s": exposed, "micro_batches": m}


def candidates(model: dict, cluster: dict, state_bytes=MIXED_ADAM, zero_stages=(0, 1, 2, 3)):
    N = cluster["gpus"]
    for tp in divisors(N):
        for pp in divisors(N // tp):
            dp = N // (tp * pp)
            if model["batch"] % dp:
                continue
            for mbs in divisors(model["batch"] // dp):
                for zero in zero_stages:
                    for recompute in RECOMPUTE:
                        try:
                            yield ((dp, zero, tp, pp, mbs, recompute),
                                   predict(model, cluster, dp, zero, tp, pp, mbs, recompute, state_bytes))
                        except ValueError:
                            continue


def fits(prediction: dict, cluster: dict) -> bool:
    return prediction["memory_bytes"] <= cluster["memory_bytes"] - cluster["reserve_bytes"]


def best(model: dict, cluster: dict, zero_stages=(0, 1, 2, 3)):
    """(degrees, prediction) of the fastest predicted step among the degrees that fit (None: nothing fits)."""
    fitting = [(d, p) for d, p in candidates(model, cluster, zero_stages=zero_stages) if fits(p, cluster)]
    return min(fitting, key=lambda dp_: dp_[1]["step_s"]) if fitting else None


_NODE = {"gpus": 8, "gpus_per_node": 8, "memory_bytes": 80e9, "reserve_bytes": 8e9, "flops": 300e12,
         "bw_intra": 300e9, "bw_inter": 25e9}
# The hidden tests' (model, cluster) cases: the notebook's examples, a 70B on 64 GPUs, a batch smaller than d p
# (m < p), and a tight 20 GB where recomputation and ZeRO decide what fits.
CASES = [
    ({"params": 1.5e9, "layers": 48, "hidden": 1600, "heads": 25, "seq": 1024, "batch": 64, "vocab": 50257}, _NODE),
    ({"params": 7e9, "layers": 32, "hidden": 4096, "heads": 32, "seq": 2048, "batch": 32, "vocab": 32000},
     {"gpus": 16, "gpus_per_node": 8, "memory_bytes": 40e9, "reserve_bytes": 4e9, "flops": 150e12,
      "bw_intra": 300e9, "bw_inter": 25e9}),
    ({"params": 1.24e8, "layers": 12, "hidden": 768, "heads": 12, "seq": 1024, "batch": 48, "vocab": 50257},
     {"gpus": 4, "gpus_per_node": 4, "memory_bytes": 16e9, "reserve_bytes": 1.6e9, "flops": 100e12,
      "bw_intra": 32e9, "bw_inter": 12e9}),
    ({"params": 7e10, "layers": 80, "hidden": 8192, "heads": 64, "seq": 2048, "batch": 64, "vocab": 32000},
     {"gpus": 64, "gpus_per_node": 8, "memory_bytes": 80e9, "reserve_bytes": 8e9, "flops": 400e12,
      "bw_intra": 450e9, "bw_inter": 50e9}),
    ({"params": 1.3e10, "layers": 40, "hidden": 5120, "heads": 40, "seq": 2048, "batch": 8, "vocab": 50257},
     {"gpus": 32, "gpus_per_node": 8, "memory_bytes": 80e9, "reserve_bytes": 8e9, "flops": 300e12,
      "bw_intra": 300e9, "bw_inter": 25e9}),
    ({"params": 6e9, "layers": 30, "hidden": 3200, "heads": 25, "seq": 1024, "batch": 64, "vocab": 50257},
     dict(_NODE, memory_bytes=20e9, reserve_bytes=2e9)),
]
