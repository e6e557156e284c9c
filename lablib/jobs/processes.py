"""The contract between the launcher (``lablib.jobs.launch``) and its ranks (``lablib.jobs.script``), and finding and
stopping a run's processes (``lablib.jobs.supervisor`` watches them). Both sides take every name from here; no other
module spells them.

A run has a folder, ``LABLIB_RUN_DIR``, where each rank leaves
- ``rank<r>.log``: its stderr (and its stdout, except rank 0's, which streams live to the notebook);
- ``rank<r>.attempt<a>.error``: the time it failed and its traceback, written *before* the process group is
  torn down, so the launcher can name the first rank that failed (the cause), not the ones that failed after
  it; one per attempt (``torchrun --max-restarts`` starts the group again), and the last attempt's is reported;
- ``pid<p>.killed_on_purpose``: written by whatever kills a process of the run on purpose (a fault a lab
  plays, a node made to leave, the launcher stopping a run), *before* it kills it;
and the launcher keeps torchrun's own log, ``torchrun.log``, whose failure summary holds the last attempt's
exit codes: a negative one is a signal (SIGABRT, SIGKILL, SIGSEGV), a death from outside Python. A death
that no record claims is the machine's (the out-of-memory killer's SIGKILL, a library's abort).
Lines of rank 0's stdout that start with ``PROGRESS_PREFIX`` are progress events (one JSON object each).

Timeouts come from one number, the run's ``timeout_s``: a rank's ``init_process_group`` and collectives
give up after ``rank_timeout_s(timeout_s)`` (passed as ``LABLIB_PG_TIMEOUT_S``), a little before the
launcher stops the whole run, so a hang ends with a rank's traceback ("timed out" in a named collective)
rather than with a kill. Every process of a run carries ``LABLIB_RUN_ID`` in its environment: the last sweep of
``lablib.jobs.job`` (the launcher's record of a job, and stopping it) finds by it a process that left the job's sessions.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path


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


def error_file(folder: Path, rank: int, attempt: int) -> Path:
    return folder / f"rank{rank}.attempt{attempt}.error"


def restart_attempt() -> int:
    """Which attempt of the worker group this is: 0 on the first start, then 1, 2, ... after each restart by
    ``torchrun --max-restarts`` (``TORCHELASTIC_RESTART_COUNT``; 0 without torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def record_error(rank: int, error: BaseException | str) -> None:
    """Leave this rank's traceback (or message) for the launcher, stamped with the time it happened.

    Only the first error of a rank in each attempt of the worker group is kept (``torchrun --max-restarts``
    starts the group again; a new attempt's error is not hidden by the last one's), and a clean
    ``SystemExit`` is not an error.
    """
    folder = run_dir()
    if folder is None or isinstance(error, SystemExit):
        return
    path = error_file(folder, rank, restart_attempt())
    if path.exists():
        return
    text = error if isinstance(error, str) else "".join(traceback.format_exception(error))
    path.write_text(f"{time.time():.6f}\n{text}")


def record_deliberate_kill(pid: int, why: str, folder: Path | None = None) -> None:
    """Say, *before* killing process ``pid`` on purpose, that its death is the course's doing, not the machine's.

    The launcher reports a rank killed by a signal as lost to the infrastructure (``launch.RankKilledError``),
    unless a record names its pid. ``folder`` is the run's (default: this rank's ``LABLIB_RUN_DIR``; nothing is
    written outside a launcher's run). A rank that kills itself calls ``record_deliberate_kill(os.getpid(), ...)``.
    """
    folder = run_dir() if folder is None else folder
    if folder is not None and folder.is_dir():
        (folder / f"pid{pid}.killed_on_purpose").write_text(f"{time.time():.6f} {why}\n")


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

# torchrun stops the surviving ranks of a failed group with SIGTERM, the launcher stops a run with SIGTERM
# (then SIGKILL, recorded), Ctrl-C is SIGINT. SIGKILL is not here: the out-of-memory killer sends it too.
SIGNALS_WE_SEND = {signal.SIGTERM, signal.SIGINT}


@dataclass(frozen=True)
class Failure:
    """Why a run failed: the first rank to fail, what it left, and the signal if it was killed by one."""
    rank: int | None
    details: str
    signal: str | None = None      # e.g. "SIGABRT": the rank died from outside Python, not by an exception
    attempt: int = 0               # the attempt of the worker group that failed so (torchrun's restart count)
    earlier: tuple[str, ...] = ()  # how each earlier attempt failed: "attempt 0: rank 1: RuntimeError: ..."


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _tail(text: str, n: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


def rank_exit_codes(torchrun_log: str) -> list[tuple[int, int, int | None]]:
    """(rank, exit code, pid) from torchrun's failure summary (the last attempt's), root cause first."""
    # Only the summary's records: the agent's own lines before it also say "local_rank: 0 ... exitcode", and a
    # match that started there paired rank 0 with another rank's exit code (seen: rank 0 reported as SIGABRT).
    start = torchrun_log.rfind("Failures:")
    summary = torchrun_log[start:] if start >= 0 else torchrun_log
    root = summary.find("Root Cause")
    if root >= 0:  # torchrun prints the other failures first, then the root cause: put that first
        summary = summary[root:] + "\n" + summary[:root]
    # One record: "  rank      : 1 (local_rank: 1)" then, before the next "[k]:" header, "  exitcode  : -6 (pid: 3379)".
    found = re.findall(r"^\s*rank\s*:\s*(\d+)[^\n]*\n(?:(?!\s*\[\d+\]:)[^\n]*\n)*?\s*exitcode\s*:\s*(-?\d+)"
                       r"(?:\s*\(pid:\s*(\d+)\))?", summary, re.M)
    return [(int(r), int(c), int(pid) if pid else None) for r, c, pid in found]


def _recorded_errors(folder: Path) -> dict[int, list[tuple[float, int, str]]]:
    """The ranks' recorded errors by attempt: {attempt: [(time, rank, traceback), ...]}."""
    by_attempt: dict[int, list[tuple[float, int, str]]] = {}
    for path in folder.glob("rank*.attempt*.error"):
        match = re.fullmatch(r"rank(\d+)\.attempt(\d+)\.error", path.name)
        if match:
            stamp, _, text = path.read_text().partition("\n")
            by_attempt.setdefault(int(match[2]), []).append((float(stamp), int(match[1]), text))
    return by_attempt


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1].strip() if lines else ""


# What a rank raises when a peer's process is gone (gloo's TCP transport; NCCL's watchdog names the peer's exit).
PEER_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|remote worker crashing|"
                       r"ECONNRESET|EPIPE", re.I)


def first_failure(folder: Path) -> Failure:
    """Why the run failed, in this order:
    - a rank of the last attempt killed by SIGKILL that no record claims (``record_deliberate_kill``): the
      out-of-memory killer, or a person; what its peers raised after it lost them is the consequence;
    - a rank killed by another signal nobody in the course sent, when every error of the last attempt is only a
      rank losing its peer (``PEER_LOST``);
    - the traceback of the first rank that raised (earliest timestamp) in the last attempt that recorded errors,
      with one line for each earlier attempt's first error;
    - a rank killed by another signal nobody in the course sent (SIGABRT, SIGSEGV), with its log's last lines;
    - else the ranks' log tails.
    """
    log = folder / TORCHRUN_LOG
    exits = rank_exit_codes(log.read_text(errors="replace") if log.exists() else "")
    on_purpose = {int(p.name[3:].partition(".")[0]) for p in folder.glob("pid*.killed_on_purpose")}
    killed = [(rank, -code) for rank, code, pid in exits
              if code < 0 and -code not in SIGNALS_WE_SEND and pid not in on_purpose]

    def killed_by(rank: int, number: int) -> Failure:
        path = rank_log(folder, rank)
        return Failure(rank, _tail(path.read_text(errors="replace")) if path.exists() else "", _signal_name(number))

    for rank, number in killed:
        if number == signal.SIGKILL:
            return killed_by(rank, number)
    errors = _recorded_errors(folder)
    if killed and errors and all(PEER_LOST.search(text) for _, _, text in errors[max(errors)]):
        # Every error of the last attempt is a rank losing its peer: a rank that died by a signal without raising
        # is the cause (gloo reports the closed socket at once, often before torchrun notices the death; the rank
        # that raised may itself then abort in gloo's teardown, so it is a consequence, not a candidate).
        raised = {rank for _, rank, _ in errors[max(errors)]}
        silent = [(rank, number) for rank, number in killed if rank not in raised]
        return killed_by(*(silent or killed)[0])
    if errors:
        last = max(errors)
        _, rank, text = min(errors[last])
        earlier = tuple(f"attempt {a}: rank {min(errors[a])[1]}: {_last_line(min(errors[a])[2])}"
                        for a in sorted(errors) if a < last)
        return Failure(rank, text, attempt=last, earlier=earlier)
    if killed:
        return killed_by(*killed[0])
    logs = [f"--- {p.stem} log (last lines) ---\n{_tail(p.read_text(errors='replace'))}"
            for p in sorted(folder.glob("*.log")) if p.name != TORCHRUN_LOG and p.read_text(errors="replace").strip()]
    return Failure(None, "\n".join(logs))
