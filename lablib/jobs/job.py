"""The launcher's own record of a job it started, and stopping the whole job within a deadline, whatever state it is in.

A job is one command the launcher starts in a session of its own (torchrun, or a torchrun agent of one node) and
everything it starts. torchrun starts each worker in a session of its own too
(torch/distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py:66, ``start_new_session``), so a
signal to torchrun's process group never reaches its workers. The record therefore holds
- every process seen in the job (pid and start time, so a reused pid is never taken for ours): the root and its
  descendants, looked at while the job runs (``observe``, from the supervisor's loop) and again before each signal;
- the process group and session of each of them (never the caller's own), so a process started after the last look
  (a worker's own child) is still reached, and still found, through the group it was born in;
- the run's marker (``processes.RUN_MARKER`` in every process's environment): a last sweep, over the processes
  started since the job began, finds one that left both (a daemon that called setsid after its parent died).

``stop`` escalates on one clock the launcher owns: SIGINT to every group of the job (what Ctrl-C does: torchrun's
handler, torch/distributed/elastic/multiprocessing/api.py:546, shuts its workers down with the same signal; a rank in
Python code raises KeyboardInterrupt), then SIGTERM to what is left ``grace_s`` later, then SIGKILL, and waits for the
kernel to remove them. A rank blocked inside a C++ collective runs no Python signal handler until the collective
returns, so SIGINT alone cannot stop it; SIGTERM's default action can. A second Ctrl-C while stopping skips to SIGKILL.
What it had to do comes back as a ``StopReport``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from lablib.jobs import processes

ESCALATION = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)
GRACE_S = 3.0        # how long SIGINT, then SIGTERM, get before the next signal
KILL_WAIT_S = 5.0    # how long the kernel gets to remove SIGKILLed processes (only a process in the kernel's
                     # uninterruptible sleep, e.g. on a dead network file system, outlives it)
POLL_S = 0.1


@dataclass
class StopReport:
    """What stopping a job took. ``needed``: the last signal sent ("nothing" when the job had already ended);
    ``sent``: (signal, seconds since the stop began, processes alive when it was sent); ``left``: processes still
    there at the deadline (none, unless the kernel could not remove them); ``pids``: every process the job had."""

    why: str
    needed: str = "nothing"
    sent: list = field(default_factory=list)
    elapsed_s: float = 0.0
    left: list = field(default_factory=list)
    strays: int = 0
    pids: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"why": self.why, "needed": self.needed, "sent": self.sent, "elapsed_s": round(self.elapsed_s, 3),
                "left": self.left, "strays": self.strays, "pids": self.pids}

    def __str__(self) -> str:
        if not self.sent:
            return f"{self.why}: every process of the run had already ended"
        steps = ", then ".join(f"{name} at {t:.1f} s ({n} process{'es' if n != 1 else ''} left)"
                               for name, t, n in self.sent)
        end = (f"every process was gone {self.elapsed_s:.1f} s after the stop began" if not self.left else
               f"{len(self.left)} process(es) still there after {self.elapsed_s:.1f} s: {self.left}")
        return f"{self.why}: sent {steps}; {end}"


@contextlib.contextmanager
def interrupts_deferred(on_interrupt=None, deliver: bool = True):
    """While inside, Ctrl-C (SIGINT) does not raise where it lands (between starting a process and recording it,
    or halfway through stopping a job); it is noted and ``on_interrupt`` called. On leaving, a noted interrupt is
    raised again (``deliver``) through the handler that was there before. Only the main thread receives signals,
    so elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield []
        return
    noted: list = []

    def note(signum, frame):
        noted.append(signum)
        if on_interrupt is not None:
            on_interrupt()

    previous = signal.signal(signal.SIGINT, note)
    try:
        yield noted
    finally:
        signal.signal(signal.SIGINT, previous)
        if noted and deliver:
            signal.raise_signal(signal.SIGINT)


def _start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _children(pid: int) -> list[int]:
    """pid's children: Linux lists them per thread in /proc (no scan of every process); elsewhere psutil."""
    task = Path(f"/proc/{pid}/task")
    if task.is_dir():
        found = []
        try:
            for thread in task.iterdir():
                with contextlib.suppress(OSError):
                    found += [int(c) for c in (thread / "children").read_text().split()]
            return found
        except OSError:
            return []
    try:
        return [c.pid for c in psutil.Process(pid).children()]
    except psutil.Error:
        return []


class Job:
    """The record of one started process (``root``, in a session of its own) and everything it starts."""

    def __init__(self, root: subprocess.Popen, marker: str | None = None):
        self.root = root
        self.marker = marker
        start = _start_time(root.pid)
        self.since = start - 1.0 if start is not None else 0.0   # a process of the job started after this
        self.seen: dict[int, float] = {}                          # pid -> its start time
        self.groups: set[int] = set()
        self.sessions: set[int] = set()
        self._own = (os.getpgid(0), os.getsid(0))                # never signalled: the caller's group and session
        self.observe()

    def _add(self, pid: int) -> None:
        start = _start_time(pid)
        if start is None or start < self.since:
            return
        self.seen.setdefault(pid, start)
        with contextlib.suppress(OSError):
            group, session = os.getpgid(pid), os.getsid(pid)
            if group != self._own[0]:
                self.groups.add(group)
            if session != self._own[1]:
                self.sessions.add(session)

    def observe(self) -> None:
        """Record the root and every descendant it has now (and their groups and sessions)."""
        todo = [self.root.pid] if self.root.poll() is None else []
        todo += [pid for pid in list(self.seen) if pid != self.root.pid and psutil.pid_exists(pid)]
        done = set()
        while todo:
            pid = todo.pop()
            if pid in done:
                continue
            done.add(pid)
            self._add(pid)
            todo += _children(pid)

    def members(self, sweep: bool = False) -> list[psutil.Process]:
        """The job's processes alive now (zombies are dead): those seen, those in its groups or sessions and, with
        ``sweep``, any started since the job began that carries its marker."""
        self.observe()
        found = []
        for proc in psutil.process_iter():
            try:
                pid = proc.pid
                if pid == os.getpid() or proc.create_time() < self.since:
                    continue
                ours = self.seen.get(pid) == proc.create_time()
                if not ours:
                    ours = os.getpgid(pid) in self.groups or os.getsid(pid) in self.sessions
                if not ours and sweep and self.marker:
                    ours = proc.environ().get(processes.RUN_MARKER) == self.marker
                    if ours:
                        self._add(pid)
                if ours and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
            except (psutil.Error, OSError):
                continue
        return found

    def remaining(self) -> list[int]:
        """pids of the processes of this job still alive: empty once the job is gone."""
        self.root.poll()    # reap our own child
        return sorted(p.pid for p in self.members(sweep=True))

    def _signal(self, sig: signal.Signals, alive: list[psutil.Process]) -> None:
        for group in self.groups:
            with contextlib.suppress(OSError):
                os.killpg(group, sig)
        for proc in alive:              # a process that moved to a group of its own
            with contextlib.suppress(psutil.Error):
                proc.send_signal(sig)


def stop(jobs: list[Job], why: str, *, first: signal.Signals = signal.SIGINT, grace_s: float = GRACE_S,
         kill_wait_s: float = KILL_WAIT_S, folder: Path | None = None) -> StopReport:
    """Stop every process of ``jobs`` together: ``first`` (SIGINT, SIGTERM or SIGKILL), escalating to the next signal
    of SIGINT -> SIGTERM -> SIGKILL after ``grace_s`` each, then ``kill_wait_s`` for the kernel to remove them. A
    SIGKILL is recorded in ``folder`` first (``processes.record_deliberate_kill``: the launcher's doing, not the
    machine's). Returns within about 2 x grace_s + kill_wait_s whatever the processes do."""
    t0 = time.monotonic()
    report = StopReport(why)
    hurry = threading.Event()

    def alive(sweep=False) -> list[tuple[Job, psutil.Process]]:
        return [(job, p) for job in jobs for p in job.members(sweep)]

    with interrupts_deferred(on_interrupt=hurry.set, deliver=False) as noted:
        left = alive(sweep=True)
        steps = ESCALATION[ESCALATION.index(first):]
        for sig in steps:
            if not left:
                break
            if sig != signal.SIGKILL and hurry.is_set():
                continue                                # a second Ctrl-C: straight to SIGKILL
            if sig == signal.SIGKILL and folder is not None:
                for _, p in left:
                    processes.record_deliberate_kill(p.pid, f"the launcher stopped the run ({why})", folder)
            report.sent.append((sig.name, round(time.monotonic() - t0, 2), len(left)))
            report.needed = sig.name
            for job in jobs:
                job._signal(sig, [p for j, p in left if j is job])
            until = time.monotonic() + (kill_wait_s if sig == signal.SIGKILL else grace_s)
            while (left := alive()) and time.monotonic() < until and not (hurry.is_set() and sig != signal.SIGKILL):
                time.sleep(POLL_S)
        strays = alive(sweep=True)                      # one that left every group since
        if strays:
            report.strays = len(strays)
            for _, p in strays:
                with contextlib.suppress(psutil.Error):
                    if folder is not None:
                        processes.record_deliberate_kill(p.pid, f"the launcher stopped the run ({why})", folder)
                    p.kill()
            psutil.wait_procs([p for _, p in strays], timeout=kill_wait_s)
            left = alive()
        report.left = sorted(p.pid for _, p in left)
    for job in jobs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            job.root.wait(timeout=0 if report.left else 1.0)   # reap our own child
        report.pids += sorted(job.seen)
    report.elapsed_s = time.monotonic() - t0
    if noted and threading.current_thread() is threading.main_thread() and why != "interrupted":
        signal.raise_signal(signal.SIGINT)              # the Ctrl-C that came while stopping, now that all is stopped
    return report


def kill_run(root_proc: subprocess.Popen, run_id: str, grace_s: float = GRACE_S, deadline_s: float = KILL_WAIT_S,
             folder: Path | None = None) -> StopReport:
    """Stop a process started in a session of its own with ``RUN_MARKER=run_id`` in its environment, and everything
    it started: SIGTERM, then SIGKILL ``grace_s`` later, then up to ``deadline_s`` for the kernel to remove them
    (each SIGKILL recorded in ``folder`` when given)."""
    return stop([Job(root_proc, run_id)], "stopped", first=signal.SIGTERM, grace_s=grace_s, kill_wait_s=deadline_s,
                folder=folder)
