"""Run the selected steps under one time budget, compare their figures with the CPU's, write the report.

The budget is enforced here, not hoped for: each step gets ``min(step_limit_s, what is left of budget_s)`` as its
``launch.run`` timeout (which stops every process of the step when it passes), and a step that would start with
less than ``MIN_START_S`` left reports "not run" instead. A hang costs one step's limit; the run always ends with a
report. Order: the GPU-only checks, then every lab's steps, then the CPU runs of the steps whose figures are
compared (each only while the budget lasts).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from lablib.gpucheck import exercise_files, gpu_checks
from lablib.gpucheck.steps import FRESH_DIR, GPU_ONLY, Step, lab_steps
from lablib.jobs import config as cfg
from lablib.jobs import distenv, launch

MIN_START_S = 15.0        # a torchrun start (interpreters, torch import, rendezvous) needs a few seconds at least


@dataclass
class Outcome:
    name: str
    lab: str
    step: str
    nproc: int
    status: str                      # pass, fail, not run
    device: str = ""
    backend: str = ""
    seconds: float = 0.0
    error: str = ""                  # why it failed, or why it did not run
    fallback: str = ""               # distenv's: ranks sharing a GPU over gloo that run on the CPU instead
    judged_by: str = ""              # "ran" (it ended well, wrote its JSON), "lab checks" or "GPU check" besides
    source: str = ""                 # where the exercise files came from
    compare: dict = field(default_factory=dict)   # against the CPU run: see compare_figures
    figures: dict = field(default_factory=dict)   # the compared figures of this run, {path: number}


def visible_gpus() -> int:
    """GPUs the steps may use: none when ``LABLIB_DEVICE=cpu`` forces the CPU (as ``distenv`` does)."""
    if os.environ.get("LABLIB_DEVICE", "").lower() == "cpu" or not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


def cuda_problem() -> str:
    """A machine with an NVIDIA driver whose torch cannot use it: said aloud, so that a GPU machine never passes off
    the CPU quick path as its GPU check ("" when torch sees a GPU, or when there is no NVIDIA driver)."""
    if torch.cuda.is_available() or not (shutil.which("nvidia-smi") or Path("/proc/driver/nvidia").exists()):
        return ""
    if torch.version.cuda is None:
        return (f"this machine has an NVIDIA driver but torch {torch.__version__} is a CPU-only build: install torch "
                f"2.13.0's CUDA build into .venv (pip install torch==2.13.0 from the download.pytorch.org/whl/cuXXX "
                f"index that matches the driver), then run again")
    return (f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but torch.cuda.is_available() is False "
            f"(a driver older than that CUDA, or CUDA_VISIBLE_DEVICES hiding the GPUs)")


def select(gpus: int, quick: bool, only: tuple[str, ...] = ()) -> list[Step]:
    """The GPU-only checks, then the labs' steps (only the quick ones when ``quick``); ``only`` keeps the steps whose
    lab number or name (``04``, ``zero_memory``, ``gpu:``) matches one of its items."""
    chosen = GPU_ONLY + [s for s in lab_steps(gpus > 0) if s.quick or not quick]
    if only:
        chosen = [s for s in chosen if any(o == s.number or o in s.name or o == s.step for o in only)]
        if not chosen:
            raise ValueError(f"--steps {','.join(only)} matches no step; steps: "
                             + ", ".join(s.name for s in GPU_ONLY + lab_steps(gpus > 0)))
    return chosen


def why_not_run(step: Step, gpus: int) -> str:
    if step.needs and gpus == 0:
        forced = os.environ.get("LABLIB_DEVICE", "").lower() == "cpu"
        return ("not run: LABLIB_DEVICE=cpu forces the CPU" if forced else
                f"not run: {cuda_problem() or 'no CUDA device (torch.cuda.is_available() is False)'}") + \
            "; this check needs a GPU"
    if step.needs == "cuda2" and gpus < 2:
        return (f"not run: needs 2 GPUs for NCCL (found {gpus}); ranks sharing one GPU over gloo stage their "
                f"collectives through the host, so there are no NCCL kernels on the GPU's clock to time")
    return ""


def expected_placement(nproc: int) -> tuple[str, str]:
    backend, device = distenv.select_backend_and_device(0, nproc)
    return str(device), backend


def plain(value):
    """A RunResult (or anything Mapping-like) as plain JSON values with string keys."""
    if hasattr(value, "items"):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def figures(result: dict, keys: tuple[str, ...]) -> dict[str, float]:
    """{path: number} of every number in the result's metrics under a key named in ``keys`` (at any depth)."""
    out = {}

    def walk(node, path, inside):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}.{k}" if path else k, inside or k in keys)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}.{i}", inside)
        elif inside and isinstance(node, (int, float)) and not isinstance(node, bool):
            out[path] = node

    walk(result.get("metrics", {}), "", False)
    return out


def compare_figures(gpu: dict[str, float], cpu: dict[str, float], exact: tuple[str, ...]) -> dict:
    """The GPU run's figures against the CPU run's. Counts (paths through a key in ``exact``) must be equal; for the
    rest (losses) the largest relative difference is reported, ``|gpu - cpu| / max(|cpu|, tiny)``."""
    def is_exact(path):
        return any(part in exact for part in path.split("."))

    only_one = sorted(set(gpu) ^ set(cpu))
    common = sorted(set(gpu) & set(cpu))
    unequal = [p for p in common if is_exact(p) and gpu[p] != cpu[p]]
    rel = [abs(gpu[p] - cpu[p]) / max(abs(cpu[p]), 1e-30) for p in common if not is_exact(p)]
    return {"figures": len(common), "exact": sum(is_exact(p) for p in common), "unequal": unequal[:10],
            "n_unequal": len(unequal), "only_in_one_run": only_one[:10], "max_rel_diff": max(rel) if rel else None,
            "agree": not unequal and not only_one}


def describe_comparison(c: dict) -> str:
    if not c:
        return ""
    if "not_run" in c:
        return c["not_run"]
    parts = [f"{c['exact']} counts " + ("equal" if not c["n_unequal"] else f"{c['n_unequal']} differ")]
    if c["max_rel_diff"] is not None:
        parts.append(f"{c['figures'] - c['exact']} values max rel diff {c['max_rel_diff']:.1e}")
    if c["only_in_one_run"]:
        parts.append(f"{len(c['only_in_one_run'])} figures in one run only")
    return "; ".join(parts)


class Runner:
    def __init__(self, repo: Path, work: Path, budget_s: float, step_limit_s: float, gpus: int):
        self.repo, self.work, self.gpus = repo, work, gpus
        self.budget_s, self.step_limit_s = budget_s, step_limit_s
        self.t0 = time.monotonic()
        self.fresh = 0
        self.sources: dict[str, tuple[str, str]] = {}

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def folder(self, lab: str) -> Path:
        return self.work / lab

    def prepare_labs(self) -> None:
        """Every lab's exercise files once (lab 11's step reads labs 06-08's from the folders beside its own)."""
        needed: dict[str, set] = {}
        for s in lab_steps(self.gpus > 0) + GPU_ONLY:
            needed.setdefault(s.lab, set()).update(s.files)
        for lab, files in sorted(needed.items()):
            self.sources[lab] = exercise_files.prepare(self.repo, lab, tuple(sorted(files)), self.folder(lab))

    def options(self, step: Step) -> dict:
        out = {}
        for k, v in step.options.items():
            if v == FRESH_DIR:
                self.fresh += 1
                v = str(self.folder(step.lab) / f"checkpoints-{self.fresh}")
            out[k] = v
        return out

    def run_step(self, step: Step, cpu: bool = False) -> tuple[dict | None, str, float]:
        """(rank 0's result, the error, seconds) of one start of the step, under the budget."""
        limit = min(self.step_limit_s, step.limit_s or self.step_limit_s, self.left())
        nproc = step.nproc_for(self.gpus) if step.nproc_for and self.gpus else step.nproc
        extra = {**step.env, **({"LABLIB_DEVICE": "cpu"} if cpu else {})}
        here, t0 = os.getcwd(), time.monotonic()
        os.chdir(self.folder(step.lab))
        try:
            if step.script:
                out = self.folder(step.lab) / f"{step.step}-result.json"
                out.unlink(missing_ok=True)
                args = ["--out", str(out), "--check", step.step,
                        *cfg.to_argv(cfg.from_options(gpu_checks.Config, {"check": step.step, **step.options}))[2:]]
                run = launch.run_script(gpu_checks.__file__, args, nproc=nproc, timeout_s=limit, env=extra, quiet=True)
                if run.timed_out:
                    return None, f"stopped at its limit of {limit:.0f} s (every process ended)", time.monotonic() - t0
                if run.returncode != 0 or not out.exists():
                    text = "\n".join(run.rank_output.values())
                    return None, f"exit code {run.returncode}: {launch.outcome.tail(text, 8)}", time.monotonic() - t0
                return json.loads(out.read_text()), "", time.monotonic() - t0
            result = launch.run(step.step, self.options(step), nproc=nproc, timeout_s=limit, quiet=True,
                                show_progress=False, threads_per_rank=step.threads_per_rank, env=extra,
                                max_restarts=step.max_restarts)
            return result, "", time.monotonic() - t0    # a RunResult: the labs' checks read it by attribute too
        except launch.RunTimeout:
            return None, f"stopped at its limit of {limit:.0f} s (every process ended)", time.monotonic() - t0
        except launch.RunError as exc:
            detail = f"\n{launch.outcome.tail(exc.details, 8)}" if getattr(exc, "details", "") else ""
            return None, f"{type(exc).__name__}: {str(exc)[:600]}{detail}", time.monotonic() - t0
        except Exception as exc:  # noqa: BLE001 - a broken step is this step's failure, never the whole run's
            return None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}", time.monotonic() - t0
        finally:
            os.chdir(here)

    def one(self, step: Step) -> Outcome:
        nproc = step.nproc_for(self.gpus) if step.nproc_for and self.gpus else step.nproc
        device, backend = expected_placement(nproc)
        outcome = Outcome(step.name, step.lab, step.step, nproc, "not run", device, backend)
        source, missing = self.sources.get(step.lab, ("", ""))
        outcome.source = source if step.files else ""
        reason = why_not_run(step, self.gpus) or (f"not run: {missing}" if step.files and missing else "")
        if not reason and self.left() < MIN_START_S:
            reason = f"not run: the whole run's budget of {self.budget_s:.0f} s is spent"
        if reason:
            outcome.error = reason.removeprefix("not run: ")
            if step.needs:
                outcome.device = outcome.backend = ""     # nothing was placed anywhere
            return outcome
        outcome.judged_by = "GPU check" if step.needs else "lab checks" if step.verdict else "ran"
        result, error, outcome.seconds = self.run_step(step)
        if result is not None:
            env = plain(result.get("env", {}))
            outcome.device, outcome.backend = str(env.get("device", device)), env.get("backend", backend)
            outcome.fallback = env.get("fallback", "")
            try:
                problems = step.verdict(result) if step.verdict else []
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                problems = [f"the result lacks what the check reads: {type(exc).__name__}: {exc}"]
            error = "; ".join(problems)
            outcome.figures = figures(plain(result), step.exact + step.close)
        outcome.status, outcome.error = ("fail", error) if error else ("pass", "")
        return outcome

    def compare_with_cpu(self, step: Step, outcome: Outcome) -> None:
        if self.left() < MIN_START_S:
            outcome.compare = {"not_run": f"CPU run not run: the budget of {self.budget_s:.0f} s is spent"}
            return
        result, error, seconds = self.run_step(step, cpu=True)
        if result is None:
            outcome.compare = {"not_run": f"CPU run failed after {seconds:.0f} s: {error.splitlines()[0][:200]}"}
            return
        outcome.compare = compare_figures(outcome.figures, figures(plain(result), step.exact + step.close), step.exact)
        outcome.compare["cpu_seconds"] = round(seconds, 1)


def run_all(repo: Path, out_dir: Path, quick: bool, only: tuple[str, ...], budget_s: float, step_limit_s: float,
            compare: bool = True, echo=print) -> dict:
    """Run, compare, write ``<out_dir>/gpu-check-<time>.json`` and ``.md``; the report as a dict."""
    gpus = visible_gpus()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work = out_dir / f"gpu-check-{stamp}-work"
    runner = Runner(repo, work, budget_s, step_limit_s, gpus)
    steps = select(gpus, quick, only)
    runner.prepare_labs()
    if cuda_problem() and os.environ.get("LABLIB_DEVICE", "").lower() != "cpu":
        echo(f"[gpu-check] WARNING: {cuda_problem()}; the steps below run on the CPU")
    echo(f"[gpu-check] {len(steps)} steps on {gpus} GPU(s){' (quick path)' if quick else ''}; budget {budget_s:.0f} s, "
         f"at most {step_limit_s:.0f} s a step")
    out_dir.mkdir(parents=True, exist_ok=True)
    base = out_dir / f"gpu-check-{stamp}"
    machine = {"gpus": gpus, "gpu_names": [torch.cuda.get_device_name(i) for i in range(gpus)],
               "cores": launch.available_cores(), "torch": torch.__version__, "python": platform.python_version(),
               "torch_cuda": torch.version.cuda, "LABLIB_DEVICE": os.environ.get("LABLIB_DEVICE", ""),
               "cuda_problem": "" if os.environ.get("LABLIB_DEVICE", "").lower() == "cpu" else cuda_problem()}
    outcomes: list[Outcome] = []

    def write(finished: bool) -> dict:
        """The report so far, on disk after every step: a run stopped from outside (a machine's time running out)
        still leaves the steps it finished, and says it did not finish."""
        report = {"machine": machine, "quick": quick, "budget_s": budget_s, "step_limit_s": step_limit_s,
                  "finished": finished, "total_s": round(time.monotonic() - runner.t0, 1),
                  "sources": {lab: {"files_from": s, "missing": m} for lab, (s, m) in runner.sources.items()},
                  "steps": [asdict(replace(o, seconds=round(o.seconds, 1))) for o in outcomes]}
        base.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        base.with_suffix(".md").write_text(markdown(report))
        return report

    try:
        for step in steps:
            o = runner.one(step)
            outcomes.append(o)
            write(False)
            echo(f"[gpu-check] {o.name:42s} {o.status:8s} {o.seconds:6.1f} s  {o.device} {o.backend}"
                 + (f"  {o.error.splitlines()[0][:120]}" if o.error else ""))
        if compare and gpus:
            for step, o in zip(steps, outcomes):
                if o.status == "pass" and (step.exact or step.close) and not step.needs:
                    runner.compare_with_cpu(step, o)
                    write(False)
                    echo(f"[gpu-check] {o.name:42s} vs CPU: {describe_comparison(o.compare)}")
        report = write(True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["paths"] = [str(base.with_suffix(".json")), str(base.with_suffix(".md"))]
    return report


def markdown(report: dict) -> str:
    m = report["machine"]
    gpus = ", ".join(m["gpu_names"]) or "no GPU"
    counts = {s: sum(o["status"] == s for o in report["steps"]) for s in ("pass", "fail", "not run")}
    unfinished = "" if report.get("finished", True) else " (unfinished: stopped from outside, or still running)"
    lines = [f"# gpu-check: {counts['pass']} pass, {counts['fail']} fail, {counts['not run']} not run{unfinished}",
             "",
             f"{m['gpus']} GPU(s) ({gpus}), {m['cores']} cores, torch {m['torch']}; "
             f"{'quick path' if report['quick'] else 'every step'}; {report['total_s']:.0f} s of a budget of "
             f"{report['budget_s']:.0f} s (at most {report['step_limit_s']:.0f} s a step)",
             "",
             "pass (ran): the step ended well and wrote its result; (lab checks): and the lab's own checks of that "
             "result passed; (GPU check): and the GPU-only check's verdict passed.",
             "",
             "| step | ranks | device | backend | result | s | vs the CPU run |",
             "|---|---|---|---|---|---|---|"]
    for o in report["steps"]:
        result = (f"pass ({o['judged_by']})" if o["status"] == "pass" else
                  f"{o['status']}: {o['error'].splitlines()[0][:140]}")
        versus = describe_comparison(o["compare"]) or ("(this is the CPU run)" if not m["gpus"] and o["status"] == "pass"
                                                       else "")
        lines.append(f"| {o['name']} | {o['nproc']} | {o['device'] or '-'} | {o['backend'] or '-'} | {result.replace('|', '/')} | "
                     f"{o['seconds']:.1f} | {versus} |")
    if m.get("cuda_problem"):
        lines += ["", f"**Not a GPU check:** {m['cuda_problem']}."]
    fallbacks = [o for o in report["steps"] if o["fallback"]]
    if fallbacks:
        lines += ["", "Fallbacks to the CPU (gloo cannot run these collectives on GPU tensors):", ""]
        lines += [f"- {o['name']}: {o['fallback']}" for o in fallbacks]
    return "\n".join(lines) + "\n"
