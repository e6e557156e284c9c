"""Watching a run's torchrun processes from the notebook: their output live, one deadline, and every process
stopped when the run ends, however it ends (finished, failed, timed out, Ctrl-C / "interrupt kernel").

``launch.run`` watches one torchrun, ``multinode.run_nodes`` one torchrun agent per node; both through this:

    with Supervisor(timeout_s, prefix="lablib-hello-", quiet=quiet) as run:
        run.start(command, env, marker=run.run_id)        # env carries RUN_MARKER=marker (launch.rank_environment)
        for key, line in run.lines():                    # each line, as it comes, already echoed and kept
            ...                                          # (run_nodes starts or kills a node here)
        if run.timed_out:                                # every process is stopped already
            raise launch.RunTimeout(...)
        code = run.wait()

Each started process is a ``lablib.jobs.job.Job``: the launcher's own record of it and of every process it starts
(torchrun's workers live in sessions of their own), looked at while the output is read. On leaving the ``with`` block
every process of every job still there is stopped (``job.stop``: SIGINT, then SIGTERM, then SIGKILL, on the
launcher's clock) and the run's folder is removed. Leaving by Ctrl-C / "interrupt kernel" starts the escalation at
SIGINT, says what stopping needed (``stop_report``, also on the KeyboardInterrupt as ``.stop`` and a note), and
raises the KeyboardInterrupt on.
"""

from __future__ import annotations

import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from lablib.jobs import job as jobs
from lablib.jobs import processes

OBSERVE_EVERY_S = 0.5   # how often the jobs' process trees are looked at while a run is watched


class Supervisor:
    """The processes of one run, their output merged line by line, one deadline ``timeout_s`` from now.

    run_dir      the run's folder (``LABLIB_RUN_DIR`` for its ranks), made here and removed on leaving
    run_id       a fresh name for the run (a marker for its processes, a rendezvous id)
    quiet        keep the output, but do not echo it to this process's stdout
    on_progress  where progress lines (``processes.PROGRESS_PREFIX``) go instead of the output, if given
    """

    def __init__(self, timeout_s: float, *, prefix: str, quiet: bool = False,
                 on_progress: Callable[[str], None] | None = None):
        self.run_id = uuid.uuid4().hex
        self.run_dir = Path(tempfile.mkdtemp(prefix=prefix))
        self.quiet = quiet
        self.on_progress = on_progress
        self.t0 = time.monotonic()
        self.deadline = self.t0 + timeout_s
        self.timed_out = False
        self._procs: dict = {}       # key -> (Popen, marker)
        self.jobs: dict = {}         # key -> jobs.Job, the record of that process and everything it started
        self.stop_report: jobs.StopReport | None = None
        self._output: dict = {}      # key -> lines printed by that process (progress lines apart)
        self._lines: queue.Queue = queue.Queue()
        self._open = 0               # output streams not yet at their end

    def __enter__(self) -> "Supervisor":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        interrupted = isinstance(exc, KeyboardInterrupt)
        try:
            if interrupted:
                report = self.stop(first=signal.SIGINT, why="interrupted")
                exc.stop = report
                if hasattr(exc, "add_note"):                    # Python 3.11+
                    exc.add_note(f"lablib: the run was {report}")
                if not self.quiet:
                    print(f"[lablib] run {report}", flush=True)
            else:
                self.stop(why="the run ended" if exc is None else f"the run raised {type(exc).__name__}")
        finally:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def start(self, command: Sequence[str], env: Mapping[str, str], *, marker: str, key=0,
              log: str = processes.TORCHRUN_LOG, cwd: Path | None = None, read_output: bool = True) -> subprocess.Popen:
        """Start ``command`` in a session of its own (``env`` must hold ``RUN_MARKER=marker``), its stderr to
        ``log`` in the run's folder (torchrun's messages), its stdout read line by line under ``key``; with
        ``read_output=False`` its stdout goes to ``log`` too (``launch.run_script`` keeps output in files)."""
        common = dict(stdin=subprocess.DEVNULL, env=dict(env), start_new_session=True, cwd=cwd)
        # A Ctrl-C between the process starting and its record being kept would leave a run nobody stops: it waits.
        with jobs.interrupts_deferred(), open(self.run_dir / log, "w") as log_file:
            if not read_output:
                proc = subprocess.Popen(list(command), stdout=log_file, stderr=subprocess.STDOUT, **common)
                self._procs[key] = (proc, marker)
                self.jobs[key] = jobs.Job(proc, marker)
                return proc
            proc = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=log_file, text=True, bufsize=1,
                                    **common)
            self._procs[key] = (proc, marker)
            self.jobs[key] = jobs.Job(proc, marker)
        self._output.setdefault(key, [])
        self._open += 1
        threading.Thread(target=self._read, args=(key, proc.stdout), daemon=True).start()
        return proc

    def _read(self, key, stream) -> None:
        for line in iter(stream.readline, ""):
            self._lines.put((key, line))
        self._lines.put((key, None))

    def lines(self) -> Iterator[tuple[object, str]]:
        """(key, line) for each line a process prints, until every started process has closed its stdout or
        the deadline passes; then every process is stopped first and ``timed_out`` is set."""
        looked = time.monotonic()
        while self._open:
            if time.monotonic() > self.deadline:
                self.timed_out = True
                self.stop(first=signal.SIGTERM, why="timed out")
                return
            if time.monotonic() - looked > OBSERVE_EVERY_S:
                self.observe()
                looked = time.monotonic()
            try:
                key, line = self._lines.get(timeout=0.1)
            except queue.Empty:
                continue
            if line is None:
                self._open -= 1
                continue
            if self.on_progress is not None and line.startswith(processes.PROGRESS_PREFIX):
                self.on_progress(line[len(processes.PROGRESS_PREFIX):])
                continue
            self._output[key].append(line)
            if not self.quiet:
                sys.stdout.write(line)
                sys.stdout.flush()
            yield key, line

    def output(self, key=None) -> str:
        """What process ``key`` printed (progress lines apart); every process's, in key order, by default."""
        keys = sorted(self._output) if key is None else [key]
        return "".join(line for k in keys for line in self._output[k])

    def process(self, key=0) -> tuple[subprocess.Popen, str]:
        """The process started under ``key`` and its marker."""
        return self._procs[key]

    def wait(self, key=0) -> int:
        return self._procs[key][0].wait()

    def elapsed_s(self) -> float:
        return time.monotonic() - self.t0

    def observe(self) -> None:
        """Look at every job's process tree now (its new workers, their groups): a job's record stays whole even if
        torchrun dies first and leaves its workers behind."""
        for job in self.jobs.values():
            job.observe()

    def stop(self, first=signal.SIGTERM, why: str = "stopped") -> jobs.StopReport:
        """Stop every process of every job still there, together: ``first``, then the stronger signals on the
        launcher's clock (``job.stop``), each SIGKILL recorded in the run's folder as the launcher's doing."""
        self.stop_report = jobs.stop(list(self.jobs.values()), why, first=first, folder=self.run_dir)
        return self.stop_report

    def remaining(self) -> list[int]:
        """pids of the run's processes still alive (empty once the run is stopped)."""
        return sorted(pid for job in self.jobs.values() for pid in job.remaining())
