"""Start a step's run script (a lab package's ``run``/``run_<step>``, or ``lablib.runs.<step>``) under torchrun from a notebook or a test, and get its JSON back.

    result = launch.run("grad_accum", {"accum_steps": 4}, nproc=2, timeout_s=120)
    result.metrics.no_sync.median_step_s          # the same as result["metrics"]["no_sync"]["median_step_s"]

The step's own options (checked against its Config) go in one mapping; the launcher's options are keywords.
The two never share a namespace, so a step option can never be taken by the launcher by accident.
``run_script(path, nproc=...)`` runs any script file (one a notebook wrote) under the same supervision and
reports how it ended instead of raising: the tool for studying a script that fails or hangs.

What it guarantees, because a notebook must never hang or leak processes:
- the options are checked against the step's Config before anything starts;
- torchrun's ``--standalone`` rendezvous picks a free port, so two notebooks never collide
  (an explicit ``port=`` is checked and refused with a clear message when taken);
- rank 0's output streams live into the notebook; its progress reports become a progress bar;
- a timeout, an error or Ctrl-C / "interrupt kernel" stops the *whole* run within a bounded time, whatever it
  is doing: torchrun starts each worker in a session of its own, so the launcher keeps its own record of the
  job (``lablib.jobs.job``: every process group of it) and escalates SIGINT -> SIGTERM -> SIGKILL on its own
  clock (about 11 s at most); on Ctrl-C it says what that took and raises the KeyboardInterrupt on;
- when a rank fails, ``RunError`` carries that rank's traceback (the first rank to fail, the root cause, in
  the last attempt when torchrun restarted the group); a rank killed by a signal that nothing in the course
  recorded sending (``processes.record_deliberate_kill``) is ``RankKilledError``, the machine's failure.
The watching (output, deadline, stopping every process) is ``lablib.jobs.supervisor``'s, shared with multinode;
the results and errors, and how a failure is read, are ``lablib.jobs.outcome``'s.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from lablib.jobs import config as cfg
from lablib.jobs import exercise, job, outcome, processes, supervisor
from lablib.jobs.outcome import (STACK_DUMP_MARKER, PortInUseError, RankKilledError,  # noqa: F401 - interface
                                 RunError, RunResult, RunTimeout, ScriptRun)
from lablib.jobs.job import kill_run  # noqa: F401 - part of this module's interface
from lablib.jobs.processes import RUN_MARKER  # noqa: F401 - part of this module's interface


def _step_files() -> dict[str, Path]:
    """Step name -> its run script. A lab package holds its steps as ``run.py`` (the step named like the package)
    or ``run_<step>.py`` (a lab with several steps); ``lablib/runs/<step>.py`` holds the shared ones (``hello``)."""
    root = Path(__file__).parent.parent
    found: dict[str, list[Path]] = {}
    for path in (root / "runs").glob("*.py"):
        if not path.stem.startswith("_"):
            found.setdefault(path.stem, []).append(path)
    for path in (root / "labs").glob("*/run.py"):
        found.setdefault(path.parent.name, []).append(path)
    for path in (root / "labs").glob("*/run_*.py"):
        found.setdefault(path.stem[len("run_"):], []).append(path)
    clashes = {step: paths for step, paths in found.items() if len(paths) > 1}
    if clashes:
        raise RuntimeError("two run scripts claim one step name: " + "; ".join(
            f"{step}: {', '.join(str(p.relative_to(root.parent)) for p in paths)}" for step, paths in clashes.items()))
    return {step: paths[0] for step, paths in found.items()}


def available_steps() -> list[str]:
    """Every step name (see ``_step_files`` for where a step's run script lives)."""
    return sorted(_step_files())


def step_module(step: str) -> str:
    """The module a step name runs: ``lablib.labs.<lab>.run`` or ``lablib.labs.<lab>.run_<step>`` when a lab's
    package holds it, else ``lablib.runs.<step>``."""
    path = _step_files().get(step)
    if path is None:
        return f"lablib.runs.{step}"
    root = Path(__file__).parent.parent.parent
    return ".".join(path.relative_to(root).with_suffix("").parts)


def load_step(step: str):
    """The run script module for a step name, with a clear error for a name that does not exist."""
    if step not in available_steps():
        raise ValueError(f"unknown step {step!r}; available steps: {', '.join(available_steps())}")
    # The first import of a step imports torch. A Ctrl-C that lands while torch's C extension imports numpy is
    # swallowed there (torch carries on without numpy; the interrupt is lost and the run starts anyway: seen in
    # tests/stress_interrupt.py). So an interrupt waits until the import is done, then stops the cell here.
    with job.interrupts_deferred():
        return importlib.import_module(step_module(step))


CORES_VARIABLE = "LABLIB_CORES"


def available_cores() -> int:
    """The cores this course's jobs may use: LABLIB_CORES when set (a grading job's share of the machine), else
    this process's CPU affinity (what Slurm, a container or taskset grants), else every core of the machine."""
    share = os.environ.get(CORES_VARIABLE, "").strip()
    if share:
        if not share.isdigit() or int(share) < 1:
            raise ValueError(f"{CORES_VARIABLE}={share!r}: set it to a whole number of cores (1 or more), or unset it")
        return int(share)
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def default_threads_per_rank(nproc: int) -> int:
    """Split the available cores evenly between ranks (torchrun alone would give each rank 1 thread)."""
    return max(1, available_cores() // nproc)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class ExerciseNotWrittenError(NotImplementedError):
    """A step was asked to run an exercise module whose functions are still the released stubs."""


def refuse_unwritten_exercises(config) -> None:
    """Before anything starts: an exercise module file (an option naming an existing .py file) whose functions
    still raise NotImplementedError would only fail on every rank a few seconds later."""
    for name, value in vars(config).items():
        if isinstance(value, str) and value.endswith(".py") and Path(value).expanduser().is_file():
            stubs = exercise.unwritten(Path(value).expanduser())
            if stubs:
                raise ExerciseNotWrittenError(
                    f"{', '.join(stubs)} in {value} still raise{'s' if len(stubs) == 1 else ''} NotImplementedError: "
                    f"write the exercise cell that starts with %%writefile {Path(value).name}, run it (it rewrites "
                    f"the file), then run this cell again. Nothing was started.")


def rank_environment(run_id: str, run_dir: Path, timeout_s: float, threads: int, extra: Mapping | None) -> dict:
    """The ranks' environment: the caller's, the launcher-rank contract, and the caller's extra variables."""
    env = {**os.environ, RUN_MARKER: run_id, processes.RUN_DIR_ENV: str(run_dir), "PYTHONUNBUFFERED": "1",
           processes.PG_TIMEOUT_ENV: f"{processes.rank_timeout_s(timeout_s):g}",
           "OMP_NUM_THREADS": str(threads), "TORCHELASTIC_ERROR_FILE": str(run_dir / "elastic_error.json")}
    env.pop("TORCHELASTIC_RUN_ID", None)
    for name, value in (extra or {}).items():
        if not isinstance(name, str) or not isinstance(value, (str, int, float)):
            raise TypeError(f"env must map variable names to strings or numbers, got {name!r}: {value!r}")
        env[name] = str(value)
    return env


def check_launcher_options(nproc, timeout_s) -> None:
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer number of ranks, got {nproc!r}")
    if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")


def run(step: str, options: Mapping | None = None, *, nproc: int = 2, timeout_s: float = 300.0,
        threads_per_rank: int | None = None, port: int | None = None, quiet: bool = False,
        show_progress: bool = True, env: Mapping | None = None, max_restarts: int = 0,
        **unexpected) -> RunResult:
    """Run a step's run script (``step_module``) on nproc ranks under torchrun and return rank 0's JSON result.

    options: the step's own options (a mapping checked against its Config; tuples for sequences).
    env: extra environment variables for every rank (e.g. ``{"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}``).
    max_restarts: how often torchrun restarts the whole worker group after a rank fails (``--max-restarts``);
    each attempt's ranks see ``TORCHELASTIC_RESTART_COUNT`` (0, 1, ...) and get a fresh rendezvous namespace
    (``lablib.jobs.distenv.attempt_store``). ``timeout_s`` covers all attempts together.
    The ranks' collectives time out a little before ``timeout_s`` (one clock for both).
    """
    if unexpected:
        raise TypeError(f"launch.run got unknown keyword(s) {sorted(unexpected)}: a step's options go in one "
                        f"mapping, e.g. launch.run({step!r}, {{{', '.join(f'{k!r}: ...' for k in unexpected)}}}, "
                        f"nproc={nproc!r}); the keywords are the launcher's own (nproc, timeout_s, "
                        f"threads_per_rank, port, quiet, show_progress, env, max_restarts)")
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"options must be a mapping of the step's options (a dict), got {type(options).__name__}")
    check_launcher_options(nproc, timeout_s)
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise ValueError(f"max_restarts must be a whole number of restarts, 0 or more, got {max_restarts!r}")
    module = load_step(step)
    config = cfg.from_options(module.Config, dict(options or {}))
    if hasattr(config, "validate_world"):
        config.validate_world(nproc)
    refuse_unwritten_exercises(config)
    if port is not None and not port_is_free(port):
        raise PortInUseError(f"port {port} on 127.0.0.1 is already in use (another notebook's run, or "
                             f"another program). Leave port=None to let torchrun pick a free port, or "
                             f"choose a different port.")
    threads = threads_per_rank or default_threads_per_rank(nproc)
    bar = None

    def progress(event: str) -> None:
        nonlocal bar
        if show_progress and not quiet:
            bar = _update_bar(bar, json.loads(event), step)

    with supervisor.Supervisor(timeout_s, prefix=f"lablib-{step}-", quiet=quiet, on_progress=progress) as run:
        out = run.run_dir / "result.json"
        rendezvous = (["--standalone"] if port is None else
                      ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                       f"--rdzv-id={run.run_id}"])
        cmd = [sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--nproc-per-node={nproc}",
               f"--max-restarts={max_restarts}", "-m", step_module(step), "--out", str(out),
               *cfg.to_argv(config)]
        try:
            # torchrun's own messages (agent logs, its failure summary) go to a file: the notebook gets rank 0's
            # stdout live, and on failure the failing rank's traceback, not three screens of launcher noise.
            run.start(cmd, rank_environment(run.run_id, run.run_dir, timeout_s, threads, env), marker=run.run_id)
            for _ in run.lines():
                pass
            if run.timed_out:
                failure = processes.first_failure(run.run_dir)
                raise RunTimeout(
                    f"step {step!r} on {nproc} ranks ran past its timeout of {timeout_s:.0f} s; all of its "
                    f"processes were stopped. Last output of rank 0:\n{outcome.tail(run.output(), 15)}",
                    failure.rank, failure.details or outcome.hint("timed out"))
            rc = run.wait()
            if rc != 0:
                raise outcome.failure_error(step, nproc, rc, run.run_dir, run.output())
            if not out.exists():
                raise RunError(f"step {step!r} finished but wrote no result JSON", None, outcome.tail(run.output()))
            return RunResult(json.loads(out.read_text()), run.output())
        finally:
            if bar is not None:
                bar.close()


def run_script(path, args: Sequence[str] = (), *, nproc: int = 2, timeout_s: float = 60.0,
               env: Mapping | None = None, quiet: bool = False, hang_after: tuple[str, float] | None = None) -> ScriptRun:
    """Run a Python script file on nproc ranks under torchrun (``--standalone``) and report how it ended.

    The script is any torchrun script (one a notebook cell wrote, say): it reads RANK, WORLD_SIZE, ... and
    sets up its own process group. Each rank's output is kept apart (``rank_output``). On a timeout every
    rank still running first dumps its Python stacks (the launcher sends it SIGABRT with faulthandler
    enabled), then the whole run is stopped, torchrun's session included. The ranks see the caller's
    environment plus ``env``; LABLIB_PG_TIMEOUT_S tells a script that wants it a collective timeout a
    little shorter than the run's.

    ``hang_after=(text, seconds)`` is for a run that is meant to hang: once every rank has printed a line holding
    ``text`` (it reached the point to show), the run gets ``seconds`` more, then is stopped as on a timeout; its
    start-up, however slow on a busy machine, is not counted. ``timeout_s`` still caps the whole run.
    """
    script_path = Path(path).expanduser().resolve()
    if not script_path.is_file():
        raise FileNotFoundError(f"script {path} does not exist (looked for {script_path}); run the cell that "
                                f"writes it (%%writefile {Path(path).name}) first")
    check_launcher_options(nproc, timeout_s)
    args = [str(a) for a in args]
    with supervisor.Supervisor(timeout_s, prefix=f"lablib-script-{script_path.stem}-") as run:
        rank_env = rank_environment(run.run_id, run.run_dir, timeout_s, default_threads_per_rank(nproc),
                                     {"PYTHONFAULTHANDLER": "1", **(env or {})})
        rank_env.pop(processes.RUN_DIR_ENV)   # the script keeps its own stdout and stderr (torchrun files them)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "--max-restarts=0", f"--log-dir={run.run_dir / 'logs'}", "--redirects=3", str(script_path), *args]
        timed_out, t0 = False, time.monotonic()
        proc = run.start(cmd, rank_env, marker=run.run_id, cwd=script_path.parent, read_output=False)
        returncode = _wait_for_script(proc, run.run_dir / "logs", nproc, t0 + timeout_s, hang_after)
        if returncode is None:
            timed_out = True
            outcome.dump_stacks(run.jobs[0])
            run.stop()
        elapsed = time.monotonic() - t0
        rank_output = outcome.rank_logs(run.run_dir / "logs")
    stacks = {}
    if timed_out:
        for rank, text in rank_output.items():
            if STACK_DUMP_MARKER in text:
                stacks[rank] = text[text.index(STACK_DUMP_MARKER):]
                rank_output[rank] = text[:text.index(STACK_DUMP_MARKER)]
    result = ScriptRun(returncode, timed_out, rank_output.get(0, ""), rank_output, stacks, elapsed)
    if not quiet:
        how = (f"stopped after its timeout of {timeout_s:g} s" if timed_out and elapsed >= timeout_s - 0.5 else
               f"stopped {hang_after[1]:g} s after every rank printed {hang_after[0]!r}" if timed_out else
               "finished" if returncode == 0 else f"failed (torchrun exit code {returncode})")
        print(f"{script_path.name} on {nproc} ranks {how} in {elapsed:.1f} s")
    return result


def _wait_for_script(proc, log_dir: Path, nproc: int, deadline: float, hang_after) -> int | None:
    """torchrun's exit code, or None once the deadline (or hang_after's grace, see run_script) has passed."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            return proc.wait(timeout=min(left, 0.5) if hang_after else left)
        except subprocess.TimeoutExpired:
            pass
        if hang_after:
            logs = outcome.rank_logs(log_dir)
            if len(logs) == nproc and all(hang_after[0] in text for text in logs.values()):
                deadline, hang_after = min(deadline, time.monotonic() + hang_after[1]), None


def _update_bar(bar, event: dict, step: str):
    from tqdm.auto import tqdm

    if bar is None:
        bar = tqdm(total=event["total"], desc=step, leave=True)
    bar.n = event["step"]
    metrics = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in event.items()
               if k not in ("step", "total")}
    if metrics:
        bar.set_postfix(metrics, refresh=False)
    bar.refresh()
    return bar
