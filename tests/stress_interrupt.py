"""Stress benchmark: interrupt ``launch.run`` at random moments of a run's life, many times, several runs at once (a
loaded machine), and count how long each stop took and whether any process was left. Not part of the suite (it takes
minutes of CPU); run it by hand after touching how the launcher starts or stops a job:

    .venv/bin/python tests/stress_interrupt.py --runs 200 --parallel 3 --targets time,job,teardown

Each run is a fresh Python process (a notebook kernel) that calls ``launch.run("hello", ...)`` and, after a random
delay from its start, gets SIGINT on its process group, as Jupyter's "interrupt kernel" (jupyter_client's
LocalProvisioner.send_signal, ``os.killpg``) and a terminal's Ctrl-C send it. The runs are a mix: a rank that
hangs (the other waits in its all-reduce), a run that finishes, a run whose rank fails, so the interrupt lands before
torchrun exists, while the launcher or the workers import torch, inside the hang, and while a run tears down.

Processes left are found without the launcher's help: this script makes itself the subreaper of everything it starts
(Linux ``PR_SET_CHILD_SUBREAPER``), so every process of a run, even one orphaned in a session of its own, stays its
descendant; each run's processes carry ``STRESS_RUN=<n>`` in their environment. A kernel that has not ended
``--exit-limit`` seconds after its interrupt is a hang: its Python stacks are dumped (faulthandler, SIGABRT) and shown.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
PR_SET_CHILD_SUBREAPER = 36

SCENARIOS = {                        # name -> the step's options
    "hang": {"hang_rank": 0},        # rank 0 sleeps, rank 1 waits in its all-reduce until stopped
    "finish": {},                    # the run ends by itself: a late interrupt lands in its teardown
    "fail": {"fail_rank": 1},        # rank 1 raises: torchrun tears the group down, the launcher reads why
}

KERNEL = """
import json, sys, time
t0 = time.monotonic()
try:
    from lablib.jobs import launch
    launch.run("hello", json.loads(sys.argv[1]), nproc=2, timeout_s=300, quiet=True, show_progress=False)
    print("ended: finished", flush=True)
except KeyboardInterrupt as exc:
    stop = getattr(exc, "stop", None)
    print("ended: interrupted", flush=True)
    if stop is not None:
        print("stop: " + json.dumps(stop.to_dict()), flush=True)
except Exception as exc:
    print(f"ended: error {type(exc).__name__}", flush=True)
"""


def own_processes(tag: str) -> list[psutil.Process]:
    """This script's descendants (every process of every run, orphans included: we are their subreaper) that carry
    ``STRESS_RUN=tag``, zombies apart (``reap_orphans`` reaps them)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get("STRESS_RUN") == tag:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def reap_orphans(children: set[int]) -> None:
    """Reap zombies that were reparented to us (never a kernel a thread still waits for)."""
    for p in psutil.Process().children():
        try:
            if p.pid not in children and p.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(p.pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError, OSError):
            pass


def phase(kernel: psutil.Process, seen: set) -> str:
    """Where the run was when the interrupt was sent, read from the kernel's process tree (``seen``: what was seen of
    it before: "torchrun", "workers")."""
    try:
        tree = kernel.children(recursive=True)
        parents = {p: p.ppid() for p in tree}
    except psutil.Error:                               # a process of the tree ended meanwhile: look again
        return phase(kernel, seen) if kernel.is_running() else "kernel gone"
    torchrun = [p for p in tree if parents[p] == kernel.pid]
    workers = [p for p in tree if parents[p] != kernel.pid]
    seen.update(["torchrun"] * bool(torchrun) + ["workers"] * bool(workers))
    if not torchrun:
        return ("teardown (torchrun ended, launcher reading it)" if "torchrun" in seen else
                "before torchrun (kernel importing, checking)")
    if not workers:
        return "teardown (workers ended)" if "workers" in seen else "torchrun starting (no workers)"
    try:
        connected = any(w.net_connections(kind="tcp") for w in workers)
    except psutil.Error:
        connected = False
    return "workers in the job (connected)" if connected else "workers starting (importing torch)"


# --target: when the delay starts counting. "time": at the kernel's start; the others: once the run is seen in that
# phase (the polls are 0.3 s apart), so the interrupts also land inside the hang and in a run's teardown however
# long a loaded machine takes to import torch.
TARGETS = {"time": "", "job": "workers in the job", "teardown": "teardown"}


def one_run(n: int, scenario: str, target: str, delay_s: float, exit_limit_s: float, children: set, lock,
            tree: Path) -> dict:
    tag = f"{os.getpid()}-{n}"
    env = {**os.environ, "STRESS_RUN": tag, "PYTHONFAULTHANDLER": "1"}
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL, json.dumps(SCENARIOS[scenario])], cwd=tree, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    with lock:
        children.add(kernel.pid)
    record = {"run": n, "scenario": scenario, "target": target, "delay_s": round(delay_s, 2)}
    try:
        seen: set = set()
        until = time.monotonic() + delay_s if target == "time" else float("inf")
        limit = time.monotonic() + exit_limit_s * 5             # a target never reached: interrupt anyway
        while kernel.poll() is None and time.monotonic() < min(until, limit):
            where = phase(psutil.Process(kernel.pid), seen)     # what the run has been through so far
            if until == float("inf") and where.startswith(TARGETS[target]):
                until = time.monotonic() + delay_s              # the target phase is reached: the delay counts now
            time.sleep(min(0.3, max(0.0, until - time.monotonic())))
        if kernel.poll() is not None:
            record["phase"] = "kernel ended before the interrupt"
        else:
            record["phase"] = phase(psutil.Process(kernel.pid), seen)
            t_int = time.monotonic()
            os.killpg(kernel.pid, signal.SIGINT)
            try:
                kernel.wait(timeout=exit_limit_s)
                record["exit_s"] = round(time.monotonic() - t_int, 2)
            except subprocess.TimeoutExpired:
                record["exit_s"] = None
                kernel.send_signal(signal.SIGABRT)           # faulthandler: where the kernel is stuck
                kernel.wait(timeout=30)
        out, err = kernel.communicate(timeout=30)
        ended = [line for line in out.splitlines() if line.startswith("ended: ")]
        record["ended"] = ended[0][len("ended: "):] if ended else f"no report (exit code {kernel.returncode})"
        stop = [line for line in out.splitlines() if line.startswith("stop: ")]
        if stop:
            record["stop"] = json.loads(stop[0][len("stop: "):])
        if record.get("exit_s", 0) is None or not ended:
            record["stderr"] = err[-4000:]
        left = own_processes(tag)
        record["left"] = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in left]
        for p in left:                                       # clean up, so the next run starts clean
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=5)
    finally:
        with lock:
            children.discard(kernel.pid)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--parallel", type=int, default=2, help="runs at once")
    parser.add_argument("--max-delay", type=float, default=30.0,
                        help="the interrupt comes 0..this many seconds after the kernel starts (uniform)")
    parser.add_argument("--exit-limit", type=float, default=60.0,
                        help="seconds after the interrupt by which the kernel must have ended")
    parser.add_argument("--targets", default="time",
                        help="comma-separated, drawn per run: time (delay from the kernel's start), job (from the "
                             "moment the workers are connected), teardown (from the moment the workers have ended)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tree", type=Path, default=REPO,
                        help="the checkout whose lablib the runs use (default: this one), e.g. an older commit's copy")
    parser.add_argument("--log", type=Path, default=None, help="write every run's record here (JSON lines)")
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        sys.exit("needs Linux (PR_SET_CHILD_SUBREAPER) to find every process a run leaves")
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.exit(f"prctl(PR_SET_CHILD_SUBREAPER) failed: errno {ctypes.get_errno()}")
    # A process started in the background by a non-interactive shell (``cmd &``, nohup) inherits SIGINT *ignored*,
    # and Python then installs no KeyboardInterrupt handler: every kernel would ignore its interrupt. Handling SIGINT
    # here makes the kernels start with the default disposition (exec resets a handled signal, keeps an ignored one).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rng = random.Random(args.seed)
    targets = args.targets.split(",")
    if not set(targets) <= set(TARGETS):
        sys.exit(f"--targets: choose from {', '.join(TARGETS)}, got {args.targets!r}")
    plan = []
    for n in range(args.runs):
        target = rng.choice(targets)
        scenario = rng.choice(["finish", "fail"] if target == "teardown" else list(SCENARIOS))
        plan.append((n, scenario, target, rng.uniform(0, args.max_delay if target == "time" else 2.0)))
    children, lock = set(), threading.Lock()
    log = open(args.log, "w") if args.log else None
    stop_reap = threading.Event()

    def reaper():
        while not stop_reap.wait(1.0):
            with lock:
                known = set(children)
            reap_orphans(known)

    threading.Thread(target=reaper, daemon=True).start()
    t0 = time.monotonic()
    records = []
    with ThreadPoolExecutor(args.parallel) as pool:
        for record in pool.map(lambda job: one_run(*job, args.exit_limit, children, lock, args.tree.resolve()), plan):
            records.append(record)
            if log:
                log.write(json.dumps(record) + "\n")
                log.flush()
            if record.get("exit_s", 0) is None or record["left"]:
                print(json.dumps(record, indent=1), flush=True)
            if len(records) % 20 == 0:
                print(f"{len(records)} runs, {time.monotonic() - t0:.0f} s, load {os.getloadavg()[0]:.1f}", flush=True)
    stop_reap.set()
    interrupted = [r for r in records if "exit_s" in r]
    exits = sorted(r["exit_s"] for r in interrupted if r["exit_s"] is not None)
    print(f"\n{len(records)} runs ({args.parallel} at once) in {time.monotonic() - t0:.0f} s, "
          f"load average {os.getloadavg()[0]:.1f} at the end")
    print(f"  interrupted: {len(interrupted)}; kernel ended within {args.exit_limit:g} s: {len(exits)}; "
          f"hung: {len(interrupted) - len(exits)}")
    if exits:
        print(f"  seconds from interrupt to kernel exit: median {exits[len(exits) // 2]:.2f}, "
              f"max {exits[-1]:.2f}")
    print(f"  runs that left processes: {sum(bool(r['left']) for r in records)} "
          f"({sum(len(r['left']) for r in records)} processes)")
    by = collections.Counter((r["phase"], r["ended"]) for r in records)
    print("  where the interrupt landed -> how the kernel's call ended:")
    for (where, ended), count in sorted(by.items()):
        print(f"  {count:4d}  {where:45s} -> {ended}")
    signals = collections.Counter(r["stop"]["needed"] for r in records if "stop" in r)
    if signals:
        print("  what stopping needed: " + ", ".join(f"{k}: {v}" for k, v in sorted(signals.items())))


if __name__ == "__main__":
    main()
