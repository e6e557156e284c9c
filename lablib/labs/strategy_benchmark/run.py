"""Lab 11's harness: every strategy trains the course GPT under identical conditions; one table checks them all.

    torchrun --standalone --nproc-per-node 4 -m lablib.labs.strategy_benchmark.run --quick --out strategies.json

Every row (``ROWS``) builds the same GPT from the same seed, wraps it with its strategy
(``lablib.labs.strategy_benchmark.strategies``: wrap_model, wrap_optimizer, forward_backward, sync_gradients, full_weights) and takes
the same SGD-with-momentum steps on the same global batches of Tiny Shakespeare. Then, for each row:

- correctness: the full weights (DTensors' ``full_tensor``, tensor-parallel shards put back, pipeline stages
  gathered) against ``single``'s, which every rank trains alone: the largest difference, next to the bound
  ``weight_bound`` derives from the arithmetic; and how far the ranks' full weights are apart (0.0: bit-identical);
- memory on each rank, counted from storages (``lablib.measure.memory``), two ways: ``peak_per_rank``, the
  largest sample of the last step's ``MemoryTimeline`` (sampled at every module's forward and backward boundary
  and around ``optimizer.step``) by kind: parameters (under FSDP2 also the units gathered at that moment),
  gradients, optimizer state, saved activations still alive; and ``memory_per_rank``, what the rank holds right
  after the backward: model states, ``buffers`` (anything else the wrapper keeps: lab 06's flat buffers in
  flight) and every activation the forward saved; on a GPU also ``torch.cuda.max_memory_allocated`` of the row
  alone (the single-process reference and the timing baseline are freed or not yet built while a row is measured);
- collectives of the last step, by name, calls and bytes (``lablib.measure.counting``);
- throughput: each row timed in turns with a freshly built PyTorch DDP (``rounds`` rounds, an even number, who
  goes first alternating), each side a window of ``timed_steps`` steps (the median of the per-step slowest-rank
  times); per round the ratio row / DDP; the row's figure is the median of the per-round ratios with their
  spread (min, max). ``torch_ddp`` timed against DDP is the noise floor: a row is "slower" ("faster") than DDP
  only when enough of its per-round ratios lie above (below) every one of the floor's, enough that noise alone
  prints any verdict in the table with a chance of at most 5% (``timing.noise_verdict``: all 6 of 6 rounds with
  --quick and about 11 timed rows); otherwise "within noise". tokens/s = tokens per step / (one DDP reference
  step time, the median of every DDP window of the run, x the row's ratio), so the two columns never disagree,
  and every row's tokens/s moves with that one reference from run to run.

The students' rows take their lab 11 ``YourDDP`` class (``--impl``) around lab 06's and lab 07's classes found in
``--labs-dir``, or stand-ins where those files are missing (``lablib.labs.strategy_benchmark.rows``); ``--standins true``
always uses the stand-ins (the grading run: no cascade from earlier labs).
"""

from __future__ import annotations

import importlib.util
import platform
import sys
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from lablib.jobs.distenv import gather_objects
from lablib.course import data
from lablib.course.models import GPT, GPTConfig
from lablib.jobs import script
from lablib.jobs.exercise import load_module, require_file
from lablib.measure import counting, memory, rankcheck, timing
from lablib.labs.strategy_benchmark import strategies as S
from lablib.labs.strategy_benchmark import rows as R

YOURS = ("yours_individual", "yours_bucketed", "yours_individual_zero1", "yours_bucketed_zero1")
ROWS = ("single", "torch_ddp", "torch_ddp_zero1", "fsdp2", *YOURS, "yours_tp", "fsdp2_x_tp", "pipeline_gpipe",
        "control_sum_not_mean", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3")
DATA_PARALLEL = ("torch_ddp", "torch_ddp_zero1", "fsdp2", *YOURS, "control_sum_not_mean", "deepspeed_zero1",
                 "deepspeed_zero2", "deepspeed_zero3")


@dataclass(frozen=True)
class Config:
    impl: str = "strategies_impl.py"   # the exercise file the notebook writes ("" : no rows of yours)
    labs_dir: str = ".."               # where labs 06, 07 and 08 keep the students' files
    standins: bool = False             # always use the stand-ins for labs 06-08 (grading)
    rows: tuple[str, ...] = ROWS
    quick: bool = False                # the source's --quick: 6 timing rounds of 10-step windows (about 0.3-0.6 s a side here)
    steps: int = 3
    global_batch: int = 8              # sequences per step over all ranks
    n_layer: int = 4                   # >= the pipeline's stages (one per rank)
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    bucket_size_mb: float = 0.05       # lab 06's DDPBucketed: a few buckets for this small model
    rounds: int = 8                    # paired timing rounds against torch DDP, even (6 with --quick; 0: none)
    timed_steps: int = 20              # steps per side per round, each on its own batch after the trained ones
    seed: int = 0

    def validate(self) -> None:
        unknown = [r for r in self.rows if r not in ROWS]
        if unknown or not self.rows:
            raise ValueError(f"rows={self.rows!r}: unknown {unknown}; choose from {', '.join(ROWS)}")
        if self.steps < 1 or self.rounds < 0 or self.timed_steps < 1:
            raise ValueError(f"steps={self.steps} and timed_steps={self.timed_steps} must be >= 1, rounds >= 0")
        if self.rounds % 2:
            raise ValueError(f"rounds={self.rounds} must be even: who goes first alternates, so each side must go "
                             f"first equally often (6 or more to see a spread; 0: no timing)")
        if self.impl and any(r in YOURS for r in self.rows):
            require_file(self.impl)

    def validate_world(self, world_size: int) -> None:
        if self.global_batch % world_size:
            raise ValueError(f"global_batch={self.global_batch} does not split over {world_size} ranks")
        if "pipeline_gpipe" in self.rows and world_size > self.n_layer:
            raise ValueError(f"pipeline_gpipe puts one stage per rank: n_layer={self.n_layer} < {world_size} ranks")
        if self.n_head % world_size and ("yours_tp" in self.rows):
            raise ValueError(f"yours_tp splits n_head={self.n_head} heads over {world_size} ranks: choose a divisor")

    def gpt(self) -> GPTConfig:
        return GPTConfig(block_size=self.block_size, n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd)

    def hyper(self) -> dict:
        return {"lr": self.lr, "momentum": self.momentum}


def global_batches(config: Config, count: int | None = None, first: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` (default ``steps``) global batches (B, T) from batch ``first`` on, the same on every rank;
    strategies take their share (``Strategy.local_batch``)."""
    count = config.steps if count is None else count
    _, dataset, _ = data.shakespeare_datasets(config.block_size)
    if (first + count) * config.global_batch > len(dataset):
        raise ValueError(f"{first + count} batches of {config.global_batch} sequences need more than the "
                         f"{len(dataset)} sequences of the dataset: fewer steps or timed_steps")
    rows = [[dataset[(first + s) * config.global_batch + i] for i in range(config.global_batch)] for s in range(count)]
    return [(torch.stack([x for x, _ in r]), torch.stack([y for _, y in r])) for r in rows]


def build(row: str, env, config: Config, pieces, impl):
    """The strategy of a row, and where its pieces came from."""
    simple = {"single": S.Strategy, "torch_ddp": S.TorchDDP, "torch_ddp_zero1": S.TorchDDPZeRO1, "fsdp2": S.FSDP2,
              "fsdp2_x_tp": S.FSDP2TP, "pipeline_gpipe": S.TorchPipeline, "control_sum_not_mean": S.SumNotMean}
    if row == "single":
        return _Alone(env), "PyTorch"
    if row in simple:
        return simple[row](env), "PyTorch"
    if row.startswith("deepspeed"):
        return R.DeepSpeedZeRO(env, int(row[-1])), "DeepSpeed"
    if row == "yours_tp":
        if pieces.tp is None:
            return R.DTensorTP(env), pieces.source["tp"]
        return R.ByHandTP(env, *pieces.tp), pieces.source["tp"]
    bucketed = "bucketed" in row
    ddp_cls = pieces.bucketed if bucketed else pieces.individual
    kwargs = {"bucket_size_mb": config.bucket_size_mb} if bucketed else {}
    opt = pieces.sharded_optimizer if row.endswith("zero1") else None
    where = [pieces.source["bucketed" if bucketed else "individual"]]
    where += [pieces.source["sharded_optimizer"]] if opt is not None else []
    return impl.YourDDP(env, ddp_cls, kwargs, opt), "; ".join(where)


class _Alone(S.Strategy):
    """``single``: the whole batch in this process, world size 1 whatever the job's (every rank trains it)."""

    def data_parallel(self):
        return 0, 1


def train(strategy, config: Config, batches, measure: bool = True) -> dict:
    """The one loop. In the last step: a memory timeline, what the rank holds after the backward, the activations
    saved, the collectives called."""
    torch.manual_seed(config.seed)                      # the same initial weights in every row and on every rank
    model = strategy.wrap_model(GPT(config.gpt()))
    opt = strategy.wrap_optimizer(model, torch.optim.SGD, **config.hyper())
    log, out = counting.CollectiveLog(), {"max_grad": 0.0}
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and not isinstance(strategy, S.SumNotMean):
        counting.count_ddp(model, log)
    env = strategy.env
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)
        allocated_before = torch.cuda.memory_allocated(env.device)
    for i, (x, y) in enumerate(batches):
        last = measure and i == len(batches) - 1
        log.reset()
        opt.zero_grad()
        with counting.count_collectives(log), _timeline(model, opt, last) as timeline:
            strategy.forward_backward(model, x, y)
            if last:
                out["memory"] = held_bytes(strategy, model, opt, timeline.saved.bytes)
            strategy.sync_gradients(model)
            out["max_grad"] = max([out["max_grad"]] + [memory.local_tensor(p.grad).abs().max().item()
                                                       for p in model.parameters() if p.grad is not None])
            opt.step()
        if last:
            out["peak"] = peak_by_kind(timeline.samples)
    if measure:
        out["collectives"] = {}
        for c in log.calls:
            entry = out["collectives"].setdefault(c.name, {"calls": 0, "bytes": 0})
            entry["calls"] += 1
            entry["bytes"] += c.bytes
        if env.device.type == "cuda":       # the row's own peak: nothing else of the run is alive on the GPU
            out["memory"]["cuda_max_allocated"] = torch.cuda.max_memory_allocated(env.device) - allocated_before
    out["weights"] = strategy.full_weights(model)
    out["model"], out["opt"] = model, opt
    return out


def _timeline(model, opt, on: bool):
    """The last step's ``MemoryTimeline`` (its optimizer hooks only on a torch optimizer; DeepSpeed's engine
    steps itself), or nothing."""
    import contextlib

    if not on:
        return contextlib.nullcontext(None)
    inner = getattr(model, "module", model)
    return memory.MemoryTimeline(inner, opt if isinstance(opt, torch.optim.Optimizer) else None)


def peak_by_kind(samples: list[dict]) -> dict:
    """The timeline's largest sample, by kind, and where in the step it was."""
    top = max(samples, key=lambda r: r["total"])
    return {k: top[k] for k in ("params", "grads", "optimizer", "activations", "total")} | {"event": top["event"]}


def held_bytes(strategy, model, opt, activation_bytes: int) -> dict:
    """Storages this rank holds after the backward (before sync_gradients: lab 06's buckets still in flight), each
    once, by kind; ``buffers``: the module's buffers and whatever else the wrapper and strategy keep."""
    from lablib.labs.zero_from_scratch.held import reachable_tensors

    kinds = strategy.held_tensors(model, opt)
    counter = memory.StorageCounter()
    out = {k: counter.add(kinds[k]) for k in ("params", "grads", "optimizer")}
    extra = [t for obj in (model, strategy) for t, _ in reachable_tensors(obj, depth=4)]
    out["buffers"] = counter.add([memory.local_tensor(t) for t in kinds["buffers"] + extra])
    out["activations"] = activation_bytes
    out["total"] = sum(out.values())
    return out


def weight_bound(config: Config, max_grad: float, max_weight: float, world_size: int) -> float:
    """How far two rows' weights may end apart when they differ only in the order of floating-point sums.

    SGD with momentum beta: w_T = w_0 - lr sum_t v_t, v_t = beta v_(t-1) + g_t, so a gradient difference dg_s moves
    w_T by at most lr dg_s (1 + beta + beta^2 + ...) < lr dg_s / (1 - beta): ``rankcheck.sgd_rounding_bound`` at
    the effective rate lr / (1 - beta). Longest sum: a weight gradient adds B*T token terms, and a split matrix
    product (tensor parallel) adds 4 n_embd terms in another grouping: gamma_(B T + 4 n_embd) bounds both
    (gamma_a + gamma_b <= gamma_(a+b)). The momentum buffer's own rounding (a product and a sum per step, |v| <=
    max|g| / (1 - beta)) adds 2 u max|g| / (1 - beta) per step at the same rate.
    """
    lr_eff = config.lr / (1 - config.momentum)
    longest = config.global_batch * config.block_size + 4 * config.n_embd
    u = rankcheck.FP32_UNIT_ROUNDOFF
    return (rankcheck.sgd_rounding_bound(config.steps, lr_eff, longest, max_grad, max_weight)
            + config.steps * lr_eff * 2 * u * max_grad / (1 - config.momentum))


def paired(env, config: Config, rounds: int, row, baseline, batches) -> dict:
    """The row and a DDP in turns, a window of ``timed_steps`` steps each per round, who goes first alternating
    (an even number of rounds: each first equally often); per round the ratio of the two windows' median step
    times (each step the slowest rank's). The figure: the median of the per-round ratios, and their spread."""
    if len(batches) != config.timed_steps:
        raise ValueError(f"{len(batches)} timing batches for timed_steps={config.timed_steps}")
    results = []
    for r in range(rounds):
        order = [("row", row), ("ddp", baseline)] if r % 2 == 0 else [("ddp", baseline), ("row", row)]
        times = {}
        for key, (strategy, trained) in order:
            per_step = []
            for x, y in batches:
                timing.barrier(env.device)
                with timing.stopwatch(per_step, env.device):
                    trained["opt"].zero_grad()
                    strategy.forward_backward(trained["model"], x, y)
                    strategy.sync_gradients(trained["model"])
                    trained["opt"].step()
            slowest = timing.slowest_rank(per_step, env.device)
            times[key], times[key + "_window_s"] = timing.median(slowest), sum(slowest)
        results.append({**times, "ratio": times["row"] / times["ddp"]})
    ratios = [r["ratio"] for r in results]
    return {"rounds": results, "ratio_to_ddp": timing.median(ratios) if ratios else None,
            "ratio_spread": [min(ratios), max(ratios)] if ratios else None}


def compare(env, weights: dict, reference: dict) -> dict:
    """Largest |w - w_single| over every parameter (the tied head's pipeline copy against wte) and over the
    ranks (MAX-reduced), and the ranks' spread (how far apart their full weights are: 0.0 is bit-identical)."""
    missing = sorted(set(reference) - set(weights))
    if missing:
        return {"error": f"full_weights lacks {missing[:3]}{'...' if len(missing) > 3 else ''}"}
    diff = 0.0
    for name, w in weights.items():
        ref = reference["wte.weight" if name == "lm_head_copy.weight" else name]
        if w.shape != ref.shape:
            return {"error": f"full_weights[{name!r}] has shape {tuple(w.shape)}, the model's is {tuple(ref.shape)}"}
        diff = max(diff, (w.float().cpu() - ref.float().cpu()).abs().max().item())
    flat = torch.cat([weights[n].detach().float().flatten() for n in sorted(weights)]).to(env.device)
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    largest = torch.tensor([diff], dtype=torch.float64, device=env.device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return {"max_abs_diff": largest.item(), "rank_spread": (hi - lo).abs().max().item()}


def run(env, config: Config) -> dict:
    rounds = min(config.rounds, 6) if config.quick else config.rounds
    timed_steps = min(config.timed_steps, 10) if config.quick else config.timed_steps
    config = replace(config, rounds=rounds, timed_steps=timed_steps)
    config_used = dict(vars(config))
    batches = global_batches(config)
    timed = global_batches(config, config.timed_steps, first=config.steps) if rounds else []
    impl = None
    if config.impl and any(r in YOURS for r in config.rows):
        impl = load_module(config.impl, ("YourDDP",))
    pieces, source = R.lab_modules(config.labs_dir, config.standins, config.bucket_size_mb)
    pieces.source = source
    reference = train(_Alone(env), config, batches, measure=True)
    reference["weights"] = {k: w.detach().cpu().clone() for k, w in reference["weights"].items()}
    del reference["model"], reference["opt"]            # freed before any row runs (on a GPU: not in its peak)
    _free(env)
    max_weight = max(w.abs().max().item() for w in reference["weights"].values())
    bound = weight_bound(config, reference["max_grad"], max_weight, env.world_size)
    table = {}
    for i, row in enumerate(config.rows):
        entry = _row(env, config, row, pieces, impl, batches, timed, reference, rounds)
        entry["within_bound"] = ("max_abs_diff" in entry and entry["max_abs_diff"] <= bound
                                 and entry["rank_spread"] == 0.0)
        table[row] = entry
        script.progress(env, i + 1, len(config.rows), row=row)
    ddp_windows = [r["ddp"] for e in table.values() for r in e.get("rounds", [])]
    floor_row = table.get("torch_ddp", {})
    if rounds and "rounds" not in floor_row:             # torch_ddp not among the rows: DDP against DDP anyway
        floor_row = _row(env, config, "torch_ddp", pieces, impl, batches, timed, reference, rounds)
    floor = [r["ratio"] for r in floor_row.get("rounds", [])]
    noise = [min(floor), max(floor)] if floor else None
    ddp_step_s = timing.median(ddp_windows) if ddp_windows else None
    compared = [n for n, e in table.items() if e.get("ratio_to_ddp") and n != "torch_ddp"]
    for name, e in table.items():
        if e.get("ratio_to_ddp"):
            e["tokens_per_s"] = config.global_batch * config.block_size / (ddp_step_s * e["ratio_to_ddp"])
        if name in compared:
            e["vs_ddp"] = timing.noise_verdict([r["ratio"] for r in e["rounds"]], floor, len(compared))
            e["within_noise"] = e["vs_ddp"]["verdict"] == "within noise"
    dist.barrier()
    return {"rows": table, "bound": bound, "max_grad": reference["max_grad"], "max_weight": max_weight,
            "world_size": env.world_size, "config": config_used, "n_params": sum(
                p.numel() for p in GPT(config.gpt()).parameters()),
            "tokens_per_step": config.global_batch * config.block_size, "ddp_step_s": ddp_step_s,
            "noise_floor": noise, "noise_floor_rounds": floor,
            "machine": {"python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform(),
                        "processor": platform.processor() or platform.machine(), "backend": env.backend,
                        "device": str(env.device), "threads_per_rank": torch.get_num_threads()}}


def _free(env) -> None:
    import gc

    gc.collect()
    if env.device.type == "cuda":
        torch.cuda.empty_cache()


def _row(env, config, row, pieces, impl, batches, timed, reference, rounds) -> dict:
    if row.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        return {"skipped": "DeepSpeed is optional and not installed here: launchers/deepspeed installs it (see the notebook's section 7)"}
    if row in YOURS and impl is None:
        return {"skipped": "exercise 1 (strategies_impl.py) is not written yet"}
    try:
        strategy, source = build(row, env, config, pieces, impl)
        trained = train(strategy, config, batches)
    except Exception as exc:            # noqa: BLE001 - one broken row must not stop the table
        return {"error": f"{type(exc).__name__}: {exc}"}
    entry = {"source": source, **compare(env, trained["weights"], reference["weights"]),
             "memory_per_rank": gather_objects(trained["memory"], env),
             "peak_per_rank": gather_objects(trained["peak"], env), "collectives": trained["collectives"],
             "collectives_per_step": sum(c["calls"] for c in trained["collectives"].values())}
    del trained["weights"]
    if rounds:
        # the baseline is built after the row's memory was measured, and freed with the row
        baseline = S.TorchDDP(env)
        base = train(baseline, config, batches, measure=False)
        entry.update(paired(env, config, rounds, (strategy, trained), (baseline, base), timed))
        del base
    del trained
    _free(env)
    return entry


def main() -> None:
    argv = sys.argv[1:]
    if "--quick" in argv:               # the source's bare flag
        i = argv.index("--quick")
        if i + 1 == len(argv) or argv[i + 1].startswith("--"):
            argv.insert(i + 1, "true")
    script.main(Config, run, argv)


if __name__ == "__main__":
    main()
