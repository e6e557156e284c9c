"""What ``launchers/gpu-check`` runs: every lab's multi-process steps as the solution notebooks start them, and the
checks only a GPU can show.

A ``Step`` is one ``lablib.jobs.launch.run`` call: the run script, its options and rank count as the notebook's
cell passes them when a student runs it (not the smaller sizes of autograding, not the hidden cases), the lab's
exercise files it imports, and which figures of its result must agree with the same step on the CPU:
``exact`` figures are counts (bytes, calls: the same arithmetic on any device), ``close`` figures are
floating-point results (losses) whose difference is reported. ``quick`` marks the steps of the quick path that CI
runs on the CPU. The GPU-only checks (``GPU_ONLY``) say what they need and how their result is judged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

FRESH_DIR = "<fresh dir>"      # an option value replaced by a new empty folder for each run (checkpoint folders)


@dataclass(frozen=True)
class Step:
    name: str                                   # unique, "<lab number> <what>"
    lab: str                                    # the lab folder, e.g. "01_gradient_accumulation"
    step: str                                   # a step name (lablib.jobs.launch.step_module finds its run script)
    options: dict
    nproc: int
    files: tuple[str, ...] = ()                 # the lab's exercise files the step imports
    threads_per_rank: int | None = None
    env: dict = field(default_factory=dict)
    max_restarts: int = 0
    exact: tuple[str, ...] = ()                 # result keys whose numbers must equal the CPU run's
    close: tuple[str, ...] = ()                 # result keys whose numbers are compared with the CPU run's
    quick: bool = False                         # part of the quick path (CI, on the CPU)
    needs: str = ""                             # "cuda", "cuda2" (two GPUs): a GPU-only check
    verdict: Callable[[dict], list[str]] | None = None   # problems found in the result (GPU-only checks)
    nproc_for: Callable[[int], int] | None = None         # rank count from the number of GPUs (GPU-only checks)
    script: str = ""                            # a torchrun script of this package instead of the step's
    limit_s: float | None = None                # this step's own limit, below the run's --step-limit

    @property
    def number(self) -> str:
        return self.lab[:2]


L00, L01, L02, L03, L04 = ("00_collectives", "01_gradient_accumulation", "02_ring_allreduce", "03_amdahl_scaling",
                           "04_zero_memory")
L05, L06, L07, L08, L09 = ("05_gpt_migration", "06_ddp_from_scratch", "07_zero_from_scratch", "08_tensor_parallel",
                           "09_pipeline_parallel")
L10, L11, L12, L13 = "10_fault_tolerance", "11_strategy_benchmark", "12_context_parallel", "13_expert_parallel"

MiB = 2 ** 20
# Lab 05's workload (its first cell); on a GPU a student runs the source tutorial's GPT (lablib.labs.gpt_migration.training.SOURCE_GPT). Those
# runs are not compared with the CPU: the same GPT on the CPU would take most of the budget.
WORKLOAD = dict(steps=34, eval_every=10, batch_size=32, block_size=64, n_layer=2, n_head=4, n_embd=64, lr=3e-3,
                seed=1, val_batch_size=32, val_blocks=64, measure_steps=10)
SOURCE_GPT_WORKLOAD = dict(WORKLOAD, block_size=256, n_layer=6, n_head=6, n_embd=384, batch_size=64, lr=1e-3)
FOUR_RANKS = {"fsdp_impl": "fsdp_impl.py", "steps": 5, "eval_every": 5, "batch_size": 24, "val_batch_size": 24,
              "val_blocks": 48, "n_layer": 3, "n_embd": 48, "seed": 1}
LOSSES = ("losses", "loss", "train_losses", "val_losses")


def _lab_checks(check: Callable[[dict], None]) -> Callable[[dict], list[str]]:
    """A verdict from the lab's own checks of the step's result (``lablib.probes``: the checks the notebook applies to
    the same result after the same run): what they raise is the problem."""
    def verdict(result) -> list[str]:
        try:
            check(result["metrics"])
        except AssertionError as exc:            # lablib.checks.CheckFailed is one
            return [f"the lab's check: {str(exc).strip().splitlines()[0][:300]}"]
        return []
    return verdict


def _each(records_of: Callable, check: Callable) -> Callable[[dict], None]:
    return lambda metrics: [check(r) for r in records_of(metrics)]


def _grad_accum(m) -> None:
    from lablib import checks
    checks.check_equal(m["no_sync"]["weight_spread_across_ranks"], 0.0, "weights identical on every rank")
    checks.check_close(m["max_abs_diff_vs_single_process"], 0.0, "max |w_DDP - w_single-process|",
                       atol=m["rounding_bound"])


def _probes():
    """The labs' probe modules (imported when a verdict runs: the table itself stays cheap to import)."""
    from lablib.labs.context_parallel import cp_ring, cp_ulysses
    from lablib.labs.expert_parallel import probes as expert_parallel
    from lablib.labs.ddp_from_scratch import probe as ddp
    from lablib.labs.fault_tolerance import probes as fault_tolerance
    from lablib.labs.pipeline_parallel import probe as pipeline
    from lablib.labs.tensor_parallel import probe as tensor_parallel
    from lablib.labs.zero_from_scratch import zero12, zero3
    return locals()


def _probe(module: str, name: str, *args, **kwargs) -> Callable:
    return lambda r: getattr(_probes()[module], name)(r, *args, **kwargs)


def _records(check: Callable) -> Callable[[dict], None]:
    return lambda m: [check(records) for records in m["records"].values()]


def lab_steps(gpu: bool) -> list[Step]:
    """Every lab's multi-process steps; ``gpu``: lab 05's workload is the one its notebook picks on a GPU."""
    workload = SOURCE_GPT_WORKLOAD if gpu else WORKLOAD
    return [
        Step("00 hello", L00, "hello", {}, 2),
        Step("00 collectives", L00, "collectives",
             {"world_sizes": (2, 3, 4), "per_rank": 2, "bench_bytes": tuple(4096 * 4 ** k for k in range(7)),
              "bench_ranks": 2, "repeats": 16, "wire_bytes": MiB, "detail_repeats": 10}, 4),
        Step("01 grad_accum", L01, "grad_accum",
             {"impl": "accum_impl.py", "accum_steps": 4, "last_micro_batch_size": 8, "steps": 12}, 2,
             files=("accum_impl.py",), exact=("allreduce_calls_per_step",), quick=True, verdict=_lab_checks(_grad_accum)),
        Step("02 ring check", L02, "ring_allreduce",
             {"impl": "ring_impl.py", "deadlock_s": 10.0, "world_sizes": (2, 3, 4),
              "sizes": (12, 1001, 12288, 65537, 262144)}, 4, files=("ring_impl.py",)),
        Step("02 ring bench", L02, "ring_allreduce",
             {"impl": "ring_impl.py", "sizes": (), "bench_bytes": tuple(1024 * 4 ** k for k in range(9)), "repeats": 5},
             2, files=("ring_impl.py",)),
        Step("03 amdahl", L03, "amdahl_scaling", {"world_sizes": (1, 2, 4), "samples": 2048 * 20}, 4,
             threads_per_rank=1, exact=("comm_bytes",)),
        *[Step(f"04 zero_memory x{n}", L04, "zero_memory",
               {"steps": 4, "variants": "ddp,zero1,fsdp_grad_op,fsdp_full,fsdp_grad_op_bf16"}, n,
               exact=("params", "grads", "optimizer"), close=("losses",), quick=n == 2) for n in (2, 4)],
        Step("05 ddp", L05, "gpt_migration",
             {"variants": "ddp,ddp_accum", "exchange_rounds": 12, "ddp_impl": "ddp_impl.py", "ckpt_dir": FRESH_DIR,
              "trace_step": True, **workload}, 2, files=("ddp_impl.py",), threads_per_rank=1),
        Step("05 fsdp", L05, "gpt_migration",
             {"variants": "fsdp,fsdp_ac", "fsdp_impl": "fsdp_impl.py", "ckpt_dir": FRESH_DIR, "trace_step": True,
              **workload}, 2, files=("fsdp_impl.py",), threads_per_rank=1),
        Step("05 fsdp+hsdp x4", L05, "gpt_migration", dict(FOUR_RANKS, variants="fsdp,hsdp", trace_step=True), 4,
             files=("fsdp_impl.py",), threads_per_rank=1, close=LOSSES),
        Step("05 accelerate", L05, "gpt_migration",
             {"variants": "accelerate", "accelerate_impl": "accelerate_impl.py", **workload}, 2,
             files=("accelerate_impl.py",), threads_per_rank=1),
        Step("06 individual", L06, "ddp_scratch",
             {"impl": "ddp_individual_impl.py", "wrapper": "individual", "world_sizes": (2, 3), "cases": ("mlp", "tied")},
             3, files=("ddp_individual_impl.py",),
             verdict=_lab_checks(_each(lambda m: m["runs"].values(), _probe("ddp", "check_probe", "individual")))),
        Step("06 bucketed", L06, "ddp_scratch",
             {"impl": "ddp_bucketed_impl.py", "wrapper": "bucketed", "world_sizes": (2, 3),
              "cases": ("mlp", "tied", "one_bucket", "reordered")}, 3, files=("buckets_impl.py", "ddp_bucketed_impl.py"),
             verdict=_lab_checks(_each(lambda m: m["runs"].values(), _probe("ddp", "check_probe", "bucketed")))),
        Step("06 overlap", L06, "ddp_overlap", {}, 2, threads_per_rank=1,
             files=("ddp_individual_impl.py", "buckets_impl.py", "ddp_bucketed_impl.py")),
        Step("07 zero1", L07, "zero_scratch", {"impl": "zero1_impl.py", "exercise": "zero1", "runs": ("2:mlp", "3:mlp")},
             3, files=("zero1_impl.py",),
             verdict=_lab_checks(_each(lambda m: m["runs"].values(), _probe("zero12", "check_probe", "zero1")))),
        Step("07 zero2", L07, "zero_scratch", {"impl": "zero2_impl.py", "exercise": "zero2", "runs": ("2:mlp", "3:mlp")},
             3, files=("zero1_impl.py", "zero2_impl.py"),
             verdict=_lab_checks(_each(lambda m: m["runs"].values(), _probe("zero12", "check_probe", "zero2")))),
        Step("07 zero3", L07, "zero_scratch", {"impl": "zero3_impl.py", "exercise": "zero3", "runs": ("2:mlp", "3:gpt")},
             3, files=("zero1_impl.py", "zero2_impl.py", "zero3_impl.py"),
             verdict=_lab_checks(_each(lambda m: m["runs"].values(), _probe("zero3", "check")))),
        *[Step(f"07 zero_stages x{n}", L07, "zero_stages", {}, n, files=("zero1_impl.py", "zero2_impl.py", "zero3_impl.py"))
          for n in (2, 4)],
        Step("08 f_g", L08, "tensor_parallel",
             {"impl": "tp_comm_impl.py", "exercise": "f_g", "groups": ("2",), "cases": ("plain",)}, 2,
             files=("tp_comm_impl.py",),
             verdict=_lab_checks(_each(lambda m: m["runs"].values(), _probe("tensor_parallel", "check_f_g")))),
        Step("08 mlp", L08, "tensor_parallel",
             {"impl": "tp_mlp_impl.py", "exercise": "mlp", "groups": ("2",), "cases": ("bias", "nobias", "indivisible"),
              "steps": 2}, 2, files=("tp_comm_impl.py", "tp_mlp_impl.py"),
             verdict=_lab_checks(_each(lambda m: m["runs"].values(), _probe("tensor_parallel", "check_record")))),
        Step("08 attention", L08, "tensor_parallel",
             {"impl": "tp_attention_impl.py", "exercise": "attention", "groups": ("2",), "cases": ("bias", "indivisible"),
              "steps": 2}, 2, files=("tp_comm_impl.py", "tp_attention_impl.py"),
             verdict=_lab_checks(_each(lambda m: m["runs"].values(), _probe("tensor_parallel", "check_record")))),
        Step("08 tp_gpt", L08, "tp_gpt", {"mlp_impl": "tp_mlp_impl.py", "attention_impl": "tp_attention_impl.py",
                                          "steps": 3}, 2,
             files=("tp_comm_impl.py", "tp_mlp_impl.py", "tp_attention_impl.py"), close=LOSSES),
        Step("08 tp_2d", L08, "tp_2d", {"steps": 3}, 4, close=LOSSES),
        # The orders the notebook writes out for exercise 2 (GPipe, and exercise 1's worked example).
        Step("09 engine", L09, "pipeline",
             {"impl": "engine_impl.py", "cases": ("gpipe:2:4", "1f1b:2:3"),
              "orders": ("F0 F1 F2 F3 B0 B1 B2 B3/F0 F1 F2 F3 B0 B1 B2 B3", "F0 F1 B0 F2 B1 B2/F0 B0 F1 B1 F2 B2"),
              "p2p_timeout_s": 10.0}, 2, files=("engine_impl.py",),
             verdict=_lab_checks(_each(lambda m: m["runs"].values(), _probe("pipeline", "check_engine")))),
        Step("09 pipeline_torch", L09, "pipeline_torch", {"n_microbatches": 8, "rounds": 10}, 2, threads_per_rank=1),
        Step("10 kill and resume", L10, "fault_tolerance",
             {"impl": "ft_impl.py", "ckpt_dir": FRESH_DIR, "faults": ("kill:1@5",), "reference": True}, 2,
             files=("ft_impl.py",), max_restarts=1, env={"LABLIB_PG_TIMEOUT_S": "60"}, close=("loss",),
             verdict=_lab_checks(_probe("fault_tolerance", "check_resumed", ("kill:1@5",)))),
        Step("10 reshard", L10, "fault_tolerance",
             {"dropout": 0.0, "jitter": False, "steps": 8, "ckpt_every": 4,
              "reshards": ("fsdp2:4->2", "fsdp2:4->1", "ddp:2->4"), "ckpt_dir": FRESH_DIR}, 4, files=("ft_impl.py",),
             close=("loss",)),
        Step("11 strategies", L11, "strategy_benchmark",
             {"impl": "strategies_impl.py", "labs_dir": "..", "quick": True}, 2, files=("strategies_impl.py",),
             exact=("calls",)),
        Step("12 ring forward", L12, "context_parallel",
             {"impl": "cp_ring_impl.py", "exercise": "ring_forward", "cases": ("causal", "shuffled")}, 2,
             files=("cp_ring_impl.py",),
             verdict=_lab_checks(_records(_probe("cp_ring", "check_ring", "ring_forward")))),
        Step("12 ring backward", L12, "context_parallel",
             {"impl": "cp_ring_backward_impl.py", "exercise": "ring_backward", "cases": ("causal", "shuffled")}, 2,
             files=("cp_ring_impl.py", "cp_ring_backward_impl.py"),
             verdict=_lab_checks(_records(_probe("cp_ring", "check_ring", "ring_backward")))),
        Step("12 idle", L12, "context_parallel", {"impl": "cp_split_impl.py", "exercise": "idle", "seq_len": 1024}, 2,
             files=("cp_split_impl.py",)),
        Step("12 ulysses", L12, "context_parallel",
             {"impl": "cp_ulysses_impl.py", "exercise": "ulysses", "cases": ("basic",)}, 2, files=("cp_ulysses_impl.py",),
             verdict=_lab_checks(_records(_probe("cp_ulysses", "check_ulysses")))),
        Step("13 dispatch", L13, "expert_parallel",
             {"impl": "ep_dispatch_impl.py", "exercise": "dispatch", "cases": ("uneven", "empty", "one")}, 2,
             files=("moe_routing_impl.py", "ep_dispatch_impl.py"),
             verdict=_lab_checks(lambda m: _probes()["expert_parallel"].check_records(m["records"], "dispatch", real_ranks=True))),
        Step("13 ep x dp", L13, "expert_parallel",
             {"impl": "ep_dp_impl.py", "exercise": "ep_dp", "mesh": "2x2", "cases": ("fp32", "frozen")}, 4,
             files=("moe_routing_impl.py", "ep_dispatch_impl.py", "ep_dp_impl.py"),
             verdict=_lab_checks(lambda m: _probes()["expert_parallel"].check_records(m["records"], "ep_dp", real_ranks=True))),
    ]


# --- the GPU-only checks --------------------------------------------------------------------------------------

def _on_cuda(result: dict) -> list[str]:
    env = result.get("env", {})
    if not str(env.get("device", "")).startswith("cuda"):
        return [f"ran on {env.get('device')} ({env.get('fallback') or 'no fallback recorded'}), not on a GPU"]
    return []


def _memory_verdict(result: dict) -> list[str]:
    """Lab 04 (``gpu_checks.zero_memory_on_gpu``): the model-state bytes a rank counts in its storages are part of what
    the caching allocator handed out, so the count can never exceed ``memory_allocated`` at that moment, nor
    ``max_memory_allocated`` over the same steps."""
    problems = _on_cuda(result)
    for variant, rows in result["metrics"]["variants"].items():
        for rank, row in enumerate(rows):
            if not row["counted_peak"] <= row["allocator_peak"]:
                problems.append(f"{variant} rank {rank}: counted {row['counted_peak']:,} B of model states, more than "
                                f"the allocator's peak {row['allocator_peak']:,} B")
            for name, m in row["moments"].items():
                if not m["counted"] <= m["allocated"]:
                    problems.append(f"{variant} rank {rank} {name}: counted {m['counted']:,} B, more than the "
                                    f"{m['allocated']:,} B allocated then")
    return problems


def _strategy_memory_verdict(result: dict) -> list[str]:
    """Lab 11: each row's storages held after the backward (parameters, gradients, optimizer state, activations,
    buffers; counted once each) were all allocated on the GPU, so their sum is at most the allocator's peak."""
    problems = _on_cuda(result)
    rows = {name: r for name, r in result["metrics"]["rows"].items() if "memory_per_rank" in r}
    problems += [f"{name}: {r['error']}" for name, r in result["metrics"]["rows"].items() if "error" in r]
    if not rows:
        problems.append("no row has a memory figure")
    for name, r in rows.items():
        for rank, m in enumerate(r["memory_per_rank"]):
            if "cuda_max_allocated" not in m:
                problems.append(f"{name} rank {rank}: no cuda_max_allocated recorded")
            elif not m["total"] <= m["cuda_max_allocated"]:
                problems.append(f"{name} rank {rank}: counted {m['total']:,} B, more than max_memory_allocated "
                                f"{m['cuda_max_allocated']:,} B")
    return problems


def _overlap_verdict(result: dict) -> list[str]:
    """Lab 06 on NCCL: the timeline comes from the GPU's own clock (the profiler's kernel timestamps, not NCCL's
    futures, which complete at enqueue), it holds NCCL kernels, and the hidden fraction is a fraction."""
    problems = _on_cuda(result)
    for variant, per_rank in result["metrics"]["timeline"].items():
        for rank, mine in enumerate(per_rank):
            if mine["clock"] != "gpu profiler trace":
                problems.append(f"{variant} rank {rank}: timed by {mine['clock']}")
            if not mine["step"]["comm"]:
                problems.append(f"{variant} rank {rank}: no NCCL kernel in the step's trace")
            if not 0.0 <= mine["median_overlap_fraction"] <= 1.0:
                problems.append(f"{variant} rank {rank}: hidden fraction {mine['median_overlap_fraction']}")
    return problems


def _resume_verdict(result: dict) -> list[str]:
    """Lab 10 on the GPU: with deterministic algorithms and a fixed cuBLAS workspace, every resumed step's loss
    equals the uninterrupted run's bit for bit, as it does on the CPU."""
    problems = _on_cuda(result)
    m = result["metrics"]
    reference = {r["step"]: r["loss"] for r in m["reference"]}
    if len(m.get("attempts", [])) < 2:
        problems.append(f"{len(m.get('attempts', []))} attempt(s): the killed rank was not restarted")
    differ = [(r["step"], r["loss"], reference.get(r["step"])) for r in m["steps"] if r["loss"] != reference.get(r["step"])]
    if differ:
        problems.append(f"{len(differ)} step(s) differ from the uninterrupted run, first: step {differ[0][0]} "
                        f"{differ[0][1]!r} vs {differ[0][2]!r}")
    return problems


def _cp_verdict(result: dict) -> list[str]:
    """Lab 12 (``gpu_checks.torch_cp_on_gpu``): torch's ring attention equals plain SDPA within its bf16 bound."""
    problems = _on_cuda(result)
    m = result["metrics"]
    if not m["max_abs_diff"] <= m["bound"]:
        problems.append(f"max |context_parallel - SDPA| = {m['max_abs_diff']:.3g} > bound {m['bound']:.3g}")
    return problems


GPU_ONLY = [
    Step("gpu:04 memory vs max_memory_allocated", L04, "zero_memory", {"steps": 4}, 2, needs="cuda",
         script="gpu_checks", verdict=_memory_verdict, nproc_for=lambda gpus: min(2, gpus)),
    Step("gpu:06 overlap timeline on the GPU clock", L06, "ddp_overlap", {"parts": ("timeline",)}, 2, needs="cuda2",
         threads_per_rank=1, files=("ddp_individual_impl.py", "buckets_impl.py", "ddp_bucketed_impl.py"),
         verdict=_overlap_verdict),
    Step("gpu:10 resume bit for bit (deterministic)", L10, "fault_tolerance",
         {"impl": "ft_impl.py", "ckpt_dir": FRESH_DIR, "faults": ("kill:0@5",), "reference": True}, 2, needs="cuda",
         files=("ft_impl.py",), max_restarts=1, env={"LABLIB_PG_TIMEOUT_S": "60", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
         verdict=_resume_verdict, nproc_for=lambda gpus: min(2, gpus) if gpus >= 2 else 1),
    Step("gpu:11 memory vs max_memory_allocated", L11, "strategy_benchmark",
         {"impl": "strategies_impl.py", "labs_dir": "..", "quick": True, "rounds": 0}, 2, needs="cuda",
         files=("strategies_impl.py",), verdict=_strategy_memory_verdict, nproc_for=lambda gpus: min(2, gpus)),
    Step("gpu:12 torch context_parallel on SDPA", L12, "cp_sdpa", {}, 1, needs="cuda", script="gpu_checks",
         verdict=_cp_verdict, nproc_for=lambda gpus: gpus if gpus >= 2 else 1),
]
