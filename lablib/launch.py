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

import importlib
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil

from lablib import config as cfg
from lablib.script import PROGRESS_PREFIX

RUN_MARKER = "LABLIB_RUN_ID"


class RunError(RuntimeError):
    """A torchrun step failed. ``rank`` is the failing rank (or None), ``details`` its traceback/log."""

    def __init__(self, message: str, rank: int | None = None, details: str = ""):
        super().__init__(message + (f"\n\n{details}" if details else ""))
        self.rank = rank
        self.details = details


class RunTimeout(RunError):
    """The step ran past its timeout; all of its processes were killed."""


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


def _run_processes(root_proc: subprocess.Popen, run_id: str) -> list[psutil.Process]:
    """The root process, its descendants, and any orphan that still carries this run's marker."""
    found: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(root_proc.pid)
        found[root.pid] = root
        for child in root.children(recursive=True):
            found[child.pid] = child
    except psutil.NoSuchProcess:
        pass
    for proc in psutil.process_iter():
        if proc.pid in found or proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(RUN_MARKER) == run_id:
                found[proc.pid] = proc
        except (psutil.Error, OSError):
            continue
    return list(found.values())


def kill_run(root_proc: subprocess.Popen, run_id: str, grace_s: float = 3.0, deadline_s: float = 15.0) -> None:
    """Terminate every process of a run: SIGTERM, then SIGKILL after grace_s, repeated until none is left.

    root_proc must have been started with ``RUN_MARKER=run_id`` in its environment; every descendant
    inherits it, so even workers started in sessions of their own, or orphaned, or spawned while we were
    killing the others, are found.
    """
    def alive() -> list[psutil.Process]:
        root_proc.poll()  # reap our own child, so it does not linger as a zombie
        found = []
        for proc in _run_processes(root_proc, run_id):
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
            except psutil.Error:
                pass
        return found

    procs = alive()
    for proc in procs:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=grace_s)
    deadline = time.monotonic() + deadline_s
    while (left := alive()) and time.monotonic() < deadline:
        for proc in left:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=1.0)
    try:
        root_proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass


def _reader(stream, lines: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        lines.put(line)
    lines.put(None)


def _tail(text: str, n: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


def _failure_details(run_dir: Path) -> tuple[int | None, str]:
    """The traceback of the first rank that failed (earliest timestamp), else the ranks' log tails."""
    errors = []
    for path in run_dir.glob("rank*.error"):
        stamp, _, text = path.read_text().partition("\n")
        errors.append((float(stamp), int(path.stem[4:]), text))
    if errors:
        _, rank, text = min(errors)
        return rank, text
    logs = [f"--- {p.stem} log (last lines) ---\n{_tail(p.read_text())}"
            for p in sorted(run_dir.glob("*.log")) if p.read_text().strip()]
    return None, "\n".join(logs)


def _hint(details: str) -> str:
    if "NotImplementedError" in details:
        return ("Hint: your exercise code still raises NotImplementedError. Fill in the exercise cell, "
                "run it again (it rewrites the module file), then re-run this step.")
    if "Timeout" in details or "timed out" in details:
        return ("Hint: a collective waited for a rank that never joined. Check that every rank calls the "
                "same collectives in the same order (no rank-dependent branch around a collective).")
    return ""


def run(step: str, nproc: int = 2, *, timeout_s: float = 300.0, threads_per_rank: int | None = None,
        port: int | None = None, quiet: bool = False, show_progress: bool = True, **options) -> dict:
    """Run ``lablib.runs.<step>`` on nproc ranks under torchrun and return rank 0's JSON result."""
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer number of ranks, got {nproc!r}")
    module = load_step(step)
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
    env = {**os.environ, RUN_MARKER: run_id, "LABLIB_RUN_DIR": str(run_dir), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": str(threads), "TORCHELASTIC_ERROR_FILE": str(run_dir / "elastic_error.json")}
    env.pop("TORCHELASTIC_RUN_ID", None)

    lines: queue.Queue = queue.Queue()
    output: list[str] = []
    bar = None
    deadline = time.monotonic() + timeout_s
    # torchrun's own messages (agent logs, its failure summary) go to a file: the notebook gets rank 0's
    # stdout live, and on failure the failing rank's traceback, not three screens of launcher noise.
    with open(run_dir / "torchrun.log", "w") as torchrun_log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=torchrun_log, stdin=subprocess.DEVNULL,
                                text=True, bufsize=1, env=env, start_new_session=True)
    try:
        threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
        while True:
            if time.monotonic() > deadline:
                kill_run(proc, run_id)
                rank, details = _failure_details(run_dir)
                raise RunTimeout(
                    f"step {step!r} on {nproc} ranks ran past its timeout of {timeout_s:.0f} s; all of its "
                    f"processes were stopped. Last output of rank 0:\n{_tail(''.join(output), 15)}",
                    rank, details or _hint("timed out"))
            try:
                line = lines.get(timeout=0.1)
            except queue.Empty:
                continue
            if line is None:
                break
            if line.startswith(PROGRESS_PREFIX):
                if show_progress and not quiet:
                    bar = _update_bar(bar, json.loads(line[len(PROGRESS_PREFIX):]), step)
                continue
            output.append(line)
            if not quiet:
                sys.stdout.write(line)
                sys.stdout.flush()
        rc = proc.wait()
        if rc != 0:
            rank, details = _failure_details(run_dir)
            where = f"rank {rank} raised an error" if rank is not None else f"torchrun exited with code {rc}"
            hint = _hint(details)
            raise RunError(f"step {step!r} on {nproc} ranks failed: {where}." + (f"\n{hint}" if hint else ""),
                           rank, details or _tail("".join(output)))
        if not out.exists():
            raise RunError(f"step {step!r} finished but wrote no result JSON", None, _tail("".join(output)))
        result = json.loads(out.read_text())
        result["output"] = "".join(output)
        return result
    except KeyboardInterrupt:
        kill_run(proc, run_id)
        raise
    finally:
        if bar is not None:
            bar.close()
        if proc.poll() is None or _run_processes(proc, run_id):
            kill_run(proc, run_id)
        shutil.rmtree(run_dir, ignore_errors=True)


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
