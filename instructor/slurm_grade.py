"""Grade a class on a Slurm cluster: ``launchers/grade LAB SUBMISSIONS --slurm [--slurm-tasks K] [--jobs N]``.

The class is split into K chunks; one sbatch job array runs a task per chunk (``python -m
instructor.slurm_grade _chunk``), which grades its students N at a time with instructor.parallel_grade's jobs
(the same course copies, limits and share of the task's cores, SLURM_CPUS_PER_TASK). The course environment is
shared: the tasks run this repository's Python (sys.executable) in this repository, and write into the work
folder, which must be on a file system every node sees (the --out folder; a cluster's shared home or
scratch). The submitting process waits for the array, then merges every result into the one gradebook and CSV
exactly as --jobs does. A student whose task ended without a result (a node lost, the array cancelled) is
marked ``infrastructure``: the same command grades them again.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from lablib.jobs.launch import available_cores

from instructor.grading import REPO, CourseLayout, StudentGrade
from instructor.parallel_grade import Limits, finish_class, run_jobs, setup


def grade_slurm(lab: str, submissions: dict[str, Path], layout: CourseLayout, work: Path, jobs: int,
                per_student_timeout_s: float = 1800, limits: Limits | None = None, progress=print,
                tasks: int | None = None, sbatch_args: str = "", feedback: bool = True,
                poll_s: float = 2.0) -> list[StudentGrade]:
    limits = limits or Limits()
    setup(lab, layout, work)
    students = list(submissions)
    tasks = max(1, min(tasks or math.ceil(len(students) / max(1, 4 * jobs)), len(students)))
    chunks = [students[i::tasks] for i in range(tasks)]
    (work / "chunks").mkdir()
    (work / "results").mkdir()
    for i, chunk in enumerate(chunks):
        (work / "chunks" / f"{i}.json").write_text(json.dumps({s: str(Path(submissions[s]).resolve())
                                                               for s in chunk}))
    (work / "limits.json").write_text(json.dumps(asdict(limits)))
    script = work / "array.sh"
    script.write_text("#!/bin/bash\n"
                      f"exec {shlex.quote(sys.executable)} -m instructor.slurm_grade _chunk {shlex.quote(lab)} "
                      f"{shlex.quote(str(work))} \"$SLURM_ARRAY_TASK_ID\" {jobs} {per_student_timeout_s:g}\n")
    minutes = math.ceil(max(map(len, chunks)) / jobs) * (per_student_timeout_s + 180) / 60 + 5
    cmd = ["sbatch", "--parsable", f"--array=0-{tasks - 1}", f"--cpus-per-task={jobs}", f"--chdir={REPO}",
           f"--time={math.ceil(minutes)}", f"--job-name=grade-{lab[:2]}", f"--output={work}/slurm-%A_%a.out",
           *shlex.split(sbatch_args), str(script)]
    submit = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if submit.returncode != 0:
        raise SystemExit(f"sbatch refused the grading array: {submit.stdout}{submit.stderr}\n({shlex.join(cmd)})")
    array = submit.stdout.strip().split(";")[0]
    progress(f"[grade {lab}] Slurm job array {array}: {tasks} task(s) of up to {max(map(len, chunks))} students")

    last_line, deadline = 0.0, time.monotonic() + minutes * 60 + 300
    while time.monotonic() < deadline:
        squeue = subprocess.run(["squeue", "-h", "-j", array, "-o", "%i"], capture_output=True, text=True)
        queued, done = squeue.stdout, len(list((work / "results").glob("*.json")))
        if squeue.returncode == 0 and not queued.strip():
            break
        if time.monotonic() - last_line > 30:
            progress(f"[grade {lab}] {done}/{len(students)} done, {len(queued.split())} task(s) queued or running")
            last_line = time.monotonic()
        time.sleep(poll_s)
    else:
        subprocess.run(["scancel", array], capture_output=True)

    results = {}
    for student in students:
        found = work / "results" / f"{student}.json"
        if found.is_file():
            results[student] = StudentGrade(**json.loads(found.read_text()))
        else:
            logs = " ".join(p.read_text(errors="replace")[-300:] for p in sorted(work.glob("slurm-*.out")))
            results[student] = StudentGrade(student, status="infrastructure",
                                            message=f"its Slurm task ended without a result; grade again. {logs}")
    failed = sum(r.status != "ok" for r in results.values())
    progress(f"[grade {lab}] {len(students)}/{len(students)} done, {failed} failed (Slurm array {array})")
    return finish_class(lab, layout, work, submissions, results, feedback)


def _chunk(lab: str, work: str, task: str, jobs: str, timeout_s: str) -> None:
    """One array task: its chunk of students, `jobs` at a time, each result in work/results/<student>.json."""
    work_dir = Path(work)
    chunk = {s: Path(nb) for s, nb in json.loads((work_dir / "chunks" / f"{task}.json").read_text()).items()}
    limits = Limits(**json.loads((work_dir / "limits.json").read_text()))
    cpus = int(os.environ.get("SLURM_CPUS_PER_TASK") or available_cores())
    results = run_jobs(lab, chunk, work_dir, int(jobs), max(1, cpus // int(jobs)), float(timeout_s), limits,
                       progress=lambda line: print(line, flush=True))
    for student, result in results.items():
        partial = work_dir / "results" / f".{student}.json"
        partial.write_text(json.dumps(asdict(result)))
        partial.rename(work_dir / "results" / f"{student}.json")


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "_chunk":
        _chunk(*sys.argv[2:])
    else:
        raise SystemExit("internal entry point of launchers/grade --slurm")
