"""Start a ``lablib.runs.<step>`` script under torchrun from a notebook or a test, and get its JSON back.

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
- a timeout, an error or Ctrl-C / "interrupt kernel" kills the *whole* run: torchrun starts each worker
  in a session of its own, so killing torchrun alone would leave them behind. Every process carrying
  this run's marker in its environment is terminated, then killed;
- when a rank fails, ``RunError`` carries that rank's traceback (the first rank to fail, the root cause, in
  the last attempt when torchrun restarted the group); a rank killed by a signal that nothing in the course
  recorded sending (``processes.record_deliberate_kill``) is ``RankKilledError``, the machine's failure.
The watching (output, deadline, stopping every process) is ``lablib.jobs.supervisor``'s, shared with multinode.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from lablib.jobs import config as cfg
from lablib.jobs import exercise, processes, supervisor
from lablib.jobs.processes import RUN_MARKER, kill_run  # noqa: F401 - part of this module's interface


class RunError(RuntimeError):
    """A torchrun step failed. ``rank`` is the failing rank (or None), ``details`` its traceback/log."""

    def __init__(self, message: str, rank: int | None = None, details: str = ""):
        super().__init__(message + (f"\n\n{details}" if details else ""))
        self.rank = rank
        self.details = details


class RunTimeout(RunError):
    """The step ran past its timeout; all of its processes were killed."""


class RankKilledError(RunError):
    """A rank was killed by a signal (``signal``, e.g. "SIGABRT") instead of failing with a Python exception:
    a death from outside the code the rank ran (the machine, a library, the operating system). Grading
    reports cells that fail this way as lost to the infrastructure, not as wrong answers."""

    def __init__(self, message: str, rank: int | None, details: str, signal: str):
        super().__init__(message, rank, details)
        self.signal = signal


class PortInUseError(RunError):
    """The explicitly requested rendezvous port is taken."""


def available_steps() -> list[str]:
    runs_dir = Path(__file__).parent.parent / "runs"
    return sorted(p.stem for p in runs_dir.glob("*.py") if not p.stem.startswith("_"))


def load_step(step: str):
    """The run script module for a step name, with a clear error for a name that does not exist."""
    if step not in available_steps():
        raise ValueError(f"unknown step {step!r}; available steps: {', '.join(available_steps())}")
    return importlib.import_module(f"lablib.runs.{step}")


def default_threads_per_rank(nproc: int) -> int:
    """Split the machine's cores evenly between ranks (torchrun alone would give each rank 1 thread)."""
    return max(1, (os.cpu_count() or 1) // nproc)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _tail(text: str, n: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


def _hint(details: str) -> str:
    if "NotImplementedError" in details:
        return ("Hint: your exercise code still raises NotImplementedError. Fill in the exercise cell, "
                "run it again (it rewrites the module file), then re-run this step.")
    if "Timeout" in details or "timed out" in details:
        return ("Hint: a collective waited for a rank that never joined. Check that every rank calls the "
                "same collectives in the same order (no rank-dependent branch around a collective).")
    return ""


class RunResult(Mapping):
    """Rank 0's JSON result, read-only, by key or by attribute: ``r.metrics.ddp`` is ``r["metrics"]["ddp"]``.

    JSON can only have string keys; keys that are decimal integers (world sizes, ranks, steps) come back as
    ints, so ``r.metrics.runs[2]`` works. Nested objects are RunResults, lists stay lists. ``output`` is what
    rank 0 printed.
    """

    def __init__(self, data: Mapping, output: str = ""):
        self._data = {_key(k): _wrap(v) for k, v in data.items()}
        self.output = output

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._data[name]
        except KeyError:
            raise AttributeError(f"this result has no {name!r}; it has {sorted(map(str, self._data))}") from None

    def __repr__(self) -> str:
        return f"RunResult({self.to_dict()!r})"

    def to_dict(self) -> dict:
        """Plain nested dicts and lists (e.g. to save with json)."""
        return {k: _unwrap(v) for k, v in self._data.items()}


def _key(k):
    return int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k


def _wrap(v):
    if isinstance(v, Mapping):
        return RunResult(v)
    if isinstance(v, list):
        return [_wrap(x) for x in v]
    return v


def _unwrap(v):
    if isinstance(v, RunResult):
        return v.to_dict()
    if isinstance(v, list):
        return [_unwrap(x) for x in v]
    return v


class ExerciseNotWrittenError(NotImplementedError):
    """A step was asked to run an exercise module whose functions are still the released stubs."""


def _refuse_unwritten_exercises(config) -> None:
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


def _rank_environment(run_id: str, run_dir: Path, timeout_s: float, threads: int, extra: Mapping | None) -> dict:
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


def _check_launcher_options(nproc, timeout_s) -> None:
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer number of ranks, got {nproc!r}")
    if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")


def run(step: str, options: Mapping | None = None, *, nproc: int = 2, timeout_s: float = 300.0,
        threads_per_rank: int | None = None, port: int | None = None, quiet: bool = False,
        show_progress: bool = True, env: Mapping | None = None, max_restarts: int = 0,
        **unexpected) -> RunResult:
    """Run ``lablib.runs.<step>`` on nproc ranks under torchrun and return rank 0's JSON result.

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
    _check_launcher_options(nproc, timeout_s)
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise ValueError(f"max_restarts must be a whole number of restarts, 0 or more, got {max_restarts!r}")
    module = load_step(step)
    config = cfg.from_options(module.Config, dict(options or {}))
    if hasattr(config, "validate_world"):
        config.validate_world(nproc)
    _refuse_unwritten_exercises(config)
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
               f"--max-restarts={max_restarts}", "-m", f"lablib.runs.{step}", "--out", str(out),
               *cfg.to_argv(config)]
        try:
            # torchrun's own messages (agent logs, its failure summary) go to a file: the notebook gets rank 0's
            # stdout live, and on failure the failing rank's traceback, not three screens of launcher noise.
            run.start(cmd, _rank_environment(run.run_id, run.run_dir, timeout_s, threads, env), marker=run.run_id)
            for _ in run.lines():
                pass
            if run.timed_out:
                failure = processes.first_failure(run.run_dir)
                raise RunTimeout(
                    f"step {step!r} on {nproc} ranks ran past its timeout of {timeout_s:.0f} s; all of its "
                    f"processes were stopped. Last output of rank 0:\n{_tail(run.output(), 15)}",
                    failure.rank, failure.details or _hint("timed out"))
            rc = run.wait()
            if rc != 0:
                raise _failure(step, nproc, rc, run.run_dir, run.output())
            if not out.exists():
                raise RunError(f"step {step!r} finished but wrote no result JSON", None, _tail(run.output()))
            return RunResult(json.loads(out.read_text()), run.output())
        finally:
            if bar is not None:
                bar.close()


@dataclass(frozen=True)
class ScriptRun:
    """How a script run by ``run_script`` ended. Nothing is raised for a script that fails or hangs.

    returncode   torchrun's exit code (0: every rank finished), None when the run was stopped by its timeout
    timed_out    the run passed ``timeout_s`` and was stopped
    output       rank 0's stdout and stderr
    rank_output  every rank's stdout and stderr, by rank
    stacks       on a timeout, the Python stack of every thread of each rank still running, dumped by
                 faulthandler just before the run was stopped (which line each rank was stuck on)
    elapsed_s    wall-clock seconds
    """

    returncode: int | None
    timed_out: bool
    output: str
    rank_output: dict
    stacks: dict
    elapsed_s: float


STACK_DUMP_MARKER = "Fatal Python error: Aborted"


def run_script(path, args: Sequence[str] = (), *, nproc: int = 2, timeout_s: float = 60.0,
               env: Mapping | None = None, quiet: bool = False) -> ScriptRun:
    """Run a Python script file on nproc ranks under torchrun (``--standalone``) and report how it ended.

    The script is any torchrun script (one a notebook cell wrote, say): it reads RANK, WORLD_SIZE, ... and
    sets up its own process group. Each rank's output is kept apart (``rank_output``). On a timeout every
    rank still running first dumps its Python stacks (the launcher sends it SIGABRT with faulthandler
    enabled), then the whole run is stopped, torchrun's session included. The ranks see the caller's
    environment plus ``env``; LABLIB_PG_TIMEOUT_S tells a script that wants it a collective timeout a
    little shorter than the run's.
    """
    script_path = Path(path).expanduser().resolve()
    if not script_path.is_file():
        raise FileNotFoundError(f"script {path} does not exist (looked for {script_path}); run the cell that "
                                f"writes it (%%writefile {Path(path).name}) first")
    _check_launcher_options(nproc, timeout_s)
    args = [str(a) for a in args]
    with supervisor.Supervisor(timeout_s, prefix=f"lablib-script-{script_path.stem}-") as run:
        rank_env = _rank_environment(run.run_id, run.run_dir, timeout_s, default_threads_per_rank(nproc),
                                     {"PYTHONFAULTHANDLER": "1", **(env or {})})
        rank_env.pop(processes.RUN_DIR_ENV)   # the script keeps its own stdout and stderr (torchrun files them)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "--max-restarts=0", f"--log-dir={run.run_dir / 'logs'}", "--redirects=3", str(script_path), *args]
        timed_out, t0 = False, time.monotonic()
        proc = run.start(cmd, rank_env, marker=run.run_id, cwd=script_path.parent, read_output=False)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out, returncode = True, None
            _dump_stacks(proc, run.run_id)
            run.stop()
        elapsed = time.monotonic() - t0
        rank_output = _rank_logs(run.run_dir / "logs")
    stacks = {}
    if timed_out:
        for rank, text in rank_output.items():
            if STACK_DUMP_MARKER in text:
                stacks[rank] = text[text.index(STACK_DUMP_MARKER):]
                rank_output[rank] = text[:text.index(STACK_DUMP_MARKER)]
    result = ScriptRun(returncode, timed_out, rank_output.get(0, ""), rank_output, stacks, elapsed)
    if not quiet:
        how = (f"stopped after its timeout of {timeout_s:g} s" if timed_out else
               "finished" if returncode == 0 else f"failed (torchrun exit code {returncode})")
        print(f"{script_path.name} on {nproc} ranks {how} in {elapsed:.1f} s")
    return result


def _dump_stacks(proc: subprocess.Popen, run_id: str, wait_s: float = 3.0) -> None:
    """SIGABRT to every rank of the run (faulthandler, enabled by PYTHONFAULTHANDLER, prints each thread's
    Python stack to the rank's stderr), then a short wait for the dumps to be written."""
    workers = [p for p in processes.run_processes(proc, run_id) if p.pid != proc.pid and _is_rank(p)]
    for p in workers:
        try:
            p.send_signal(signal.SIGABRT)
        except Exception:  # noqa: BLE001 - it may have ended meanwhile
            pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(p.is_running() and p.status() != "zombie" for p in workers):
        time.sleep(0.05)


def _is_rank(p) -> bool:
    try:
        return "LOCAL_RANK" in p.environ()
    except Exception:  # noqa: BLE001 - gone, or not ours to read
        return False


def _rank_logs(log_dir: Path) -> dict:
    """torchrun's --log-dir with --redirects: <run id>/attempt_<k>/<local rank>/{stdout,stderr}.log."""
    out: dict[int, str] = {}
    for folder in sorted(log_dir.glob("*/attempt_*/*")):
        if folder.is_dir() and folder.name.isdigit():
            parts = [(folder / name).read_text(errors="replace") for name in ("stdout.log", "stderr.log")
                     if (folder / name).exists()]
            out[int(folder.name)] = "".join(parts)
    return out


def _failure(step: str, nproc: int, rc: int, run_dir: Path, output: str) -> RunError:
    failure = processes.first_failure(run_dir)
    if failure.signal:
        return RankKilledError(
            f"step {step!r} on {nproc} ranks failed: rank {failure.rank} was killed by {failure.signal}, not by "
            f"an exception in the code it ran. This is the machine's doing (a library abort, the out-of-memory "
            f"killer, a crash), not an error in your answer: run the cell again. When grading, this cell's "
            f"points were lost to the infrastructure.", failure.rank, failure.details, failure.signal)
    where = f"rank {failure.rank} raised an error" if failure.rank is not None else f"torchrun exited with code {rc}"
    if failure.attempt:
        where += (f" on attempt {failure.attempt} (torchrun restarted the group {failure.attempt} time"
                  f"{'s' if failure.attempt > 1 else ''}; this is the last attempt's error)")
    earlier = "".join(f"\n  {line}" for line in failure.earlier)
    earlier = f"\nThe earlier attempts failed first:{earlier}" if earlier else ""
    hint = _hint(failure.details)
    return RunError(f"step {step!r} on {nproc} ranks failed: {where}." + earlier + (f"\n{hint}" if hint else ""),
                    failure.rank, failure.details or _tail(output))


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
