"""Start a ``lablib.runs.<step>`` script under torchrun from a notebook or a test, and get its JSON back.

    result = launch.run("grad_accum", nproc=2, accum_steps=4, timeout_s=120)

What it guarantees, because a notebook must never hang or leak processes:
- the options are checked against the step's Config before anything starts;
- torchrun's ``--standalone`` rendezvous picks a free port, so two notebooks never collide
  (an explicit ``port=`` is checked and refused with a clear message when taken);
- rank 0's output streams live into the notebook; its progress reports become a progress bar;
- a timeout, an error or Ctrl-C / "interrupt kernel" kills the *whole* run: torchrun starts each worker
  in a session of its own, so killing torchrun alone would leave them behind. Every process carrying
  this run's marker in its environment is terminated, then killed;
- when a rank fails, ``RunError`` carries that rank's traceback (the first rank to fail, the root cause).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from lablib import config as cfg
from lablib import processes
from lablib.processes import RUN_MARKER, kill_run  # noqa: F401 - part of this module's interface


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
    runs_dir = Path(__file__).parent / "runs"
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


def _reader(stream, lines: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        lines.put(line)
    lines.put(None)


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


LAUNCHER_OPTIONS = ("nproc", "timeout_s", "threads_per_rank", "port", "quiet", "show_progress")


def check_step_options(module) -> None:
    """A step's Config may not name an option the launcher takes itself: it would never reach the step."""
    clash = sorted(set(f.name for f in dataclasses.fields(module.Config)) & set(LAUNCHER_OPTIONS))
    if clash:
        raise TypeError(f"{module.__name__}.Config has option(s) {clash} with the same name as launch.run's "
                        f"own {LAUNCHER_OPTIONS}; rename them in the Config (e.g. step_{clash[0]})")


def run(step: str, nproc: int = 2, *, timeout_s: float = 300.0, threads_per_rank: int | None = None,
        port: int | None = None, quiet: bool = False, show_progress: bool = True, **options) -> dict:
    """Run ``lablib.runs.<step>`` on nproc ranks under torchrun and return rank 0's JSON result.

    Keyword arguments other than the launcher's own (``LAUNCHER_OPTIONS``) are the step's options, checked
    against its Config. The ranks' collectives time out a little before ``timeout_s`` (one clock for both).
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer number of ranks, got {nproc!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    module = load_step(step)
    check_step_options(module)
    config = cfg.from_options(module.Config, options)
    if hasattr(config, "validate_world"):
        config.validate_world(nproc)
    if port is not None and not port_is_free(port):
        raise PortInUseError(f"port {port} on 127.0.0.1 is already in use (another notebook's run, or "
                             f"another program). Leave port=None to let torchrun pick a free port, or "
                             f"choose a different port.")
    threads = threads_per_rank or default_threads_per_rank(nproc)
    run_id = uuid.uuid4().hex
    run_dir = Path(tempfile.mkdtemp(prefix=f"lablib-{step}-"))
    out = run_dir / "result.json"
    rendezvous = (["--standalone"] if port is None else
                  ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                   f"--rdzv-id={run_id}"])
    cmd = [sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--nproc-per-node={nproc}",
           "--max-restarts=0", "-m", f"lablib.runs.{step}", "--out", str(out), *cfg.to_argv(config)]
    env = {**os.environ, RUN_MARKER: run_id, processes.RUN_DIR_ENV: str(run_dir), "PYTHONUNBUFFERED": "1",
           processes.PG_TIMEOUT_ENV: f"{processes.rank_timeout_s(timeout_s):g}",
           "OMP_NUM_THREADS": str(threads), "TORCHELASTIC_ERROR_FILE": str(run_dir / "elastic_error.json")}
    env.pop("TORCHELASTIC_RUN_ID", None)

    lines: queue.Queue = queue.Queue()
    output: list[str] = []
    bar = None
    proc = None
    deadline = time.monotonic() + timeout_s
    try:
        # torchrun's own messages (agent logs, its failure summary) go to a file: the notebook gets rank 0's
        # stdout live, and on failure the failing rank's traceback, not three screens of launcher noise.
        with open(run_dir / processes.TORCHRUN_LOG, "w") as torchrun_log:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=torchrun_log, stdin=subprocess.DEVNULL,
                                    text=True, bufsize=1, env=env, start_new_session=True)
        threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
        while True:
            if time.monotonic() > deadline:
                kill_run(proc, run_id)
                failure = processes.first_failure(run_dir)
                raise RunTimeout(
                    f"step {step!r} on {nproc} ranks ran past its timeout of {timeout_s:.0f} s; all of its "
                    f"processes were stopped. Last output of rank 0:\n{_tail(''.join(output), 15)}",
                    failure.rank, failure.details or _hint("timed out"))
            try:
                line = lines.get(timeout=0.1)
            except queue.Empty:
                continue
            if line is None:
                break
            if line.startswith(processes.PROGRESS_PREFIX):
                if show_progress and not quiet:
                    bar = _update_bar(bar, json.loads(line[len(processes.PROGRESS_PREFIX):]), step)
                continue
            output.append(line)
            if not quiet:
                sys.stdout.write(line)
                sys.stdout.flush()
        rc = proc.wait()
        if rc != 0:
            raise _failure(step, nproc, rc, run_dir, output)
        if not out.exists():
            raise RunError(f"step {step!r} finished but wrote no result JSON", None, _tail("".join(output)))
        result = json.loads(out.read_text())
        result["output"] = "".join(output)
        return result
    except KeyboardInterrupt:
        if proc is not None:
            kill_run(proc, run_id)
        raise
    finally:
        if bar is not None:
            bar.close()
        if proc is not None and (proc.poll() is None or processes.run_processes(proc, run_id)):
            kill_run(proc, run_id)
        shutil.rmtree(run_dir, ignore_errors=True)


def _failure(step: str, nproc: int, rc: int, run_dir: Path, output: list[str]) -> RunError:
    failure = processes.first_failure(run_dir)
    if failure.signal:
        return RankKilledError(
            f"step {step!r} on {nproc} ranks failed: rank {failure.rank} was killed by {failure.signal}, not by "
            f"an exception in the code it ran. This is the machine's doing (a library abort, the out-of-memory "
            f"killer, a crash), not an error in your answer: run the cell again. When grading, this cell's "
            f"points were lost to the infrastructure.", failure.rank, failure.details, failure.signal)
    where = f"rank {failure.rank} raised an error" if failure.rank is not None else f"torchrun exited with code {rc}"
    hint = _hint(failure.details)
    return RunError(f"step {step!r} on {nproc} ranks failed: {where}." + (f"\n{hint}" if hint else ""),
                    failure.rank, failure.details or _tail("".join(output)))


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
