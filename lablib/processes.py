"""The contract between the launcher (``lablib.launch``) and its ranks (``lablib.script``), and the
supervision of a run's processes. Both sides take every name from here; no other module spells them.

A run has a folder, ``LABLIB_RUN_DIR``, where each rank leaves
- ``rank<r>.log``: its stderr (and its stdout, except rank 0's, which streams live to the notebook);
- ``rank<r>.error``: the time it failed and its traceback, written *before* the process group is torn
  down, so the launcher can name the first rank that failed (the cause), not the ones that failed after it;
and the launcher keeps torchrun's own log, ``torchrun.log``, whose failure summary holds every rank's exit
code: a negative one is a signal (SIGABRT, SIGKILL, SIGSEGV), a death from outside Python.
Lines of rank 0's stdout that start with ``PROGRESS_PREFIX`` are progress events (one JSON object each).

Timeouts come from one number, the run's ``timeout_s``: a rank's ``init_process_group`` and collectives
give up after ``rank_timeout_s(timeout_s)`` (passed as ``LABLIB_PG_TIMEOUT_S``), a little before the
launcher stops the whole run, so a hang ends with a rank's traceback ("timed out" in a named collective)
rather than with a kill. Every process of a run carries ``LABLIB_RUN_ID`` in its environment, which is how
``kill_run`` finds workers that torchrun started in sessions of their own.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import psutil

RUN_DIR_ENV = "LABLIB_RUN_DIR"
RUN_MARKER = "LABLIB_RUN_ID"
PG_TIMEOUT_ENV = "LABLIB_PG_TIMEOUT_S"
PROGRESS_PREFIX = "@@lablib-progress "
TORCHRUN_LOG = "torchrun.log"
DEFAULT_RANK_TIMEOUT_S = 60.0   # a rank started by hand (plain torchrun, no launcher)


# --- timeouts ------------------------------------------------------------------------------------------

def rank_timeout_s(run_timeout_s: float) -> float:
    """How long a rank's init and collectives may wait, for a run the launcher stops after run_timeout_s:
    90% of it, so the ranks report a hang themselves before the launcher has to kill them."""
    return max(1.0, 0.9 * run_timeout_s)


def number_from_env(name: str, default, kind=float, hint: str = ""):
    """Environment variable ``name`` as ``kind`` (int or float), ``default`` when unset, a clear error when
    it is not a number. The one reader of numeric variables (torchrun's and the launcher's)."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return kind(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"environment variable {name}={value!r} is not {what}{hint}") from None


def rank_timeout_from_env() -> float:
    """The timeout this rank was given by its launcher, in seconds (read when called, not at import)."""
    return number_from_env(PG_TIMEOUT_ENV, DEFAULT_RANK_TIMEOUT_S)


# --- the rank's side -----------------------------------------------------------------------------------

def run_dir() -> Path | None:
    value = os.environ.get(RUN_DIR_ENV)
    return Path(value) if value else None


def rank_log(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.log"


def record_error(rank: int, error: BaseException | str) -> None:
    """Leave this rank's traceback (or message) for the launcher, stamped with the time it happened.

    Only the first error of a rank is kept, and a clean ``SystemExit`` is not an error.
    """
    folder = run_dir()
    if folder is None or isinstance(error, SystemExit):
        return
    path = folder / f"rank{rank}.error"
    if path.exists():
        return
    text = error if isinstance(error, str) else "".join(traceback.format_exception(error))
    path.write_text(f"{time.time():.6f}\n{text}")


def end_rank(code: int) -> None:
    """End a torchrun worker with exit code ``code``, skipping the interpreter's finalization.

    Why: gloo runs collectives on C++ worker threads, and a work object there holds references to tensors
    and, for DDP's communication hooks, to Python callbacks. When such a thread drops the last reference
    to a Python object while the interpreter is finalizing, it must take the GIL to free it; a finalizing
    CPython ends any thread that asks for the GIL with ``pthread_exit``, whose forced unwind through a
    ``noexcept`` C++ destructor calls ``std::terminate``: "terminate called without an active exception",
    SIGABRT, a rank lost after its work was done and its result written. It happens only when a worker
    thread is late (a loaded machine: 3 ranks on 2 cores) - the same race pytorch/pytorch#179291 describes.
    By the time this is called the rank has passed a barrier, destroyed its process group and collected
    garbage while the interpreter was fully alive (``distenv.distributed``); its result is on disk and its
    logs are file descriptors, so finalization has nothing left to do that a worker needs.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def is_torchrun_worker() -> bool:
    """True in a process that torchrun started (it sets TORCHELASTIC_RUN_ID for every worker)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


# --- the launcher's side -------------------------------------------------------------------------------

SIGNALS_WE_SEND = {signal.SIGTERM, signal.SIGKILL, signal.SIGINT}


@dataclass(frozen=True)
class Failure:
    """Why a run failed: the first rank to fail, what it left, and the signal if it was killed by one."""
    rank: int | None
    details: str
    signal: str | None = None      # e.g. "SIGABRT": the rank died from outside Python, not by an exception


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _tail(text: str, n: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


def rank_exit_codes(torchrun_log: str) -> list[tuple[int, int]]:
    """(rank, exit code) pairs from torchrun's failure summary, root cause first."""
    summary = torchrun_log
    root = summary.find("Root Cause")
    if root >= 0:  # torchrun prints the other failures first, then the root cause: put that first
        summary = summary[root:] + "\n" + summary[:root]
    pairs = re.findall(r"rank\s*:\s*(\d+)[^\n]*\n(?:[^\n]*\n)*?\s*exitcode\s*:\s*(-?\d+)", summary)
    return [(int(r), int(c)) for r, c in pairs]


def first_failure(folder: Path) -> Failure:
    """The traceback of the first rank that raised (earliest timestamp); else, when a rank was killed by a
    signal, that rank and signal with its log's last lines; else the ranks' log tails."""
    errors = []
    for path in folder.glob("rank*.error"):
        stamp, _, text = path.read_text().partition("\n")
        errors.append((float(stamp), int(path.stem[4:]), text))
    if errors:
        _, rank, text = min(errors)
        return Failure(rank, text)
    log = folder / TORCHRUN_LOG
    for rank, code in rank_exit_codes(log.read_text(errors="replace") if log.exists() else ""):
        if code < 0 and -code not in SIGNALS_WE_SEND:
            rank_log_path = rank_log(folder, rank)
            tail = _tail(rank_log_path.read_text(errors="replace")) if rank_log_path.exists() else ""
            return Failure(rank, tail, _signal_name(-code))
    logs = [f"--- {p.stem} log (last lines) ---\n{_tail(p.read_text(errors='replace'))}"
            for p in sorted(folder.glob("*.log")) if p.name != TORCHRUN_LOG and p.read_text(errors="replace").strip()]
    return Failure(None, "\n".join(logs))


def run_processes(root_proc: subprocess.Popen, run_id: str) -> list[psutil.Process]:
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
        for proc in run_processes(root_proc, run_id):
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
