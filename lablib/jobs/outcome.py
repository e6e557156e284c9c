"""What a run gives back: rank 0's result, or the error that says how it ended.

``lablib.jobs.launch`` (one node) and ``lablib.jobs.multinode`` (several) raise these errors and return these
results; ``launch.run_script`` returns a ``ScriptRun``. The failure analysis reads what the ranks left in the
run's folder (``lablib.jobs.processes``: each rank's traceback per attempt, torchrun's summary records), so a
notebook is told the root cause, not torchrun's noise.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from lablib.jobs import processes

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


def tail(text: str, n: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


def hint(details: str) -> str:
    if "NotImplementedError" in details:
        return ("Hint: your exercise code still raises NotImplementedError. Fill in the exercise cell, "
                "run it again (it rewrites the module file), then re-run this step.")
    if "Timeout" in details or "timed out" in details:
        return ("Hint: a collective waited for a rank that never joined. Check that every rank calls the "
                "same collectives in the same order (no rank-dependent branch around a collective), and that every "
                "isend/irecv and every async_op=True work is waited on (.wait()) before the step ends.")
    return ""


# What gloo writes before it aborts a rank whose collective received a message of another size than it posted.
GLOO_MISMATCH = re.compile(r"Received data size doesn't match expected size|collective mismatch|"
                           r"op\.preamble\.length <= op\.nbytes")


def _rank_log_text(run_dir: Path, rank: int) -> str:
    path = processes.rank_log(run_dir, rank)
    return path.read_text(errors="replace") if path.exists() else ""


def failure_error(step: str, nproc: int, rc: int, run_dir: Path, output: str) -> RunError:
    """The error a failed run raises: the first failure of its last attempt (a signal death is the machine's)."""
    first = processes.first_failure(run_dir)
    if first.signal and first.rank is not None and GLOO_MISMATCH.search(_rank_log_text(run_dir, first.rank)):
        # gloo aborts the process (SIGABRT) when a message does not fit the buffer the receiving collective posted
        # (gloo/transport/tcp/pair.cc:456 in torch 2.13's build enforces op.preamble.length <= op.nbytes, seen in a
        # run): the ranks called different collectives, or the
        # same one with different sizes. That is the code's doing, not the machine's.
        return RunError(
            f"step {step!r} on {nproc} ranks failed: rank {first.rank} was aborted by gloo because the ranks' "
            f"collectives did not match (a rank received more bytes than the collective it was in expected). Check "
            f"that every rank calls the same collectives, in the same order, with tensors of the same size.",
            first.rank, first.details)
    if first.signal:
        return RankKilledError(
            f"step {step!r} on {nproc} ranks failed: rank {first.rank} was killed by {first.signal}, not by "
            f"an exception in the code it ran. This is the machine's doing (a library abort, the out-of-memory "
            f"killer, a crash), not an error in your answer: run the cell again. When grading, this cell's "
            f"points were lost to the infrastructure.", first.rank, first.details, first.signal)
    where = f"rank {first.rank} raised an error" if first.rank is not None else f"torchrun exited with code {rc}"
    if first.attempt:
        where += (f" on attempt {first.attempt} (torchrun restarted the group {first.attempt} time"
                  f"{'s' if first.attempt > 1 else ''}; this is the last attempt's error)")
    earlier = "".join(f"\n  {line}" for line in first.earlier)
    earlier = f"\nThe earlier attempts failed first:{earlier}" if earlier else ""
    advice = hint(first.details)
    return RunError(f"step {step!r} on {nproc} ranks failed: {where}." + earlier + (f"\n{advice}" if advice else ""),
                    first.rank, first.details or tail(output))


def dump_stacks(job, wait_s: float = 3.0) -> None:
    """SIGABRT to every rank of the run (``job``: its ``lablib.jobs.job.Job``; faulthandler, enabled by
    PYTHONFAULTHANDLER, prints each thread's Python stack to the rank's stderr), then a short wait for the dumps."""
    workers = [p for p in job.members() if p.pid != job.root.pid and is_rank(p)]
    for p in workers:
        try:
            p.send_signal(signal.SIGABRT)
        except Exception:  # noqa: BLE001 - it may have ended meanwhile
            pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(p.is_running() and p.status() != "zombie" for p in workers):
        time.sleep(0.05)


def is_rank(p) -> bool:
    try:
        return "LOCAL_RANK" in p.environ()
    except Exception:  # noqa: BLE001 - gone, or not ours to read
        return False


def rank_logs(log_dir: Path) -> dict:
    """torchrun's --log-dir with --redirects: <run id>/attempt_<k>/<local rank>/{stdout,stderr}.log."""
    out: dict[int, str] = {}
    for folder in sorted(log_dir.glob("*/attempt_*/*")):
        if folder.is_dir() and folder.name.isdigit():
            parts = [(folder / name).read_text(errors="replace") for name in ("stdout.log", "stderr.log")
                     if (folder / name).exists()]
            out[int(folder.name)] = "".join(parts)
    return out
