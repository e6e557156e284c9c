"""Grade a class side by side: ``launchers/grade LAB SUBMISSIONS --jobs N``.

Each student is graded by a worker process of its own, in a copy of the course of its own (its own gradebook,
working folder and session), with the machine's cores divided between the N jobs and with limits per job, so
a submission that hangs, forks, fills the disk or eats memory costs that student only:

- time: one timeout per student (the serial mode's), a hard stop a minute later for the whole job;
- memory: RLIMIT_AS per process, and the job's resident memory summed over its processes;
- disk: RLIMIT_FSIZE per file, and the size of the job's folder (its TMPDIR too);
- processes: the number of processes in the job (RLIMIT_NPROC counts a whole user, and not root at all).
A job that passes a limit is stopped (its session, then every process still carrying its GRADE_JOB marker),
status ``limits``. Threads: lablib.jobs.launch.default_threads_per_rank divides the cores the course may use
between ranks; a job sets LABLIB_CORES (launch.CORES_VARIABLE) to its share, so a student's torchrun steps split
that share, and OMP/MKL threads of the kernel itself are the share too.

Rendezvous ports: the course's launcher runs torchrun ``--standalone``: its rendezvous store binds port 0 (the
OS picks and holds a free port, torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py:156) and
the workers' MASTER_PORT is the agent's shared store, also bound on port 0 and held
(elastic/rendezvous/dynamic_rendezvous.py:1209-1216): no port is chosen then released, so two students'
jobs cannot collide. Only TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 brings back a probe-then-bind port
(rendezvous/api.py, get_free_port): the jobs' environment removes it.

The results are merged into the one course (the gradebook Formgrader shows) by nbgrader itself: each
worker's executed notebook is autograded again there with execution and output clearing switched off, so
SaveAutoGrades scores the very outputs the worker produced: a student's grade is the serial mode's.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lablib.jobs.launch import CORES_VARIABLE, available_cores

from instructor.grading import (CourseLayout, StudentGrade, _nbgrader, grade_student, prepare,
                                read_scores)

JOB_MARKER = "GRADE_JOB"
MERGE_ARGS = (
    "--Autograde.sanitize_preprocessors=['nbgrader.preprocessors.DeduplicateIds',"
    "'nbgrader.preprocessors.OverwriteKernelspec','nbgrader.preprocessors.OverwriteCells',"
    "'nbgrader.preprocessors.CheckCellMetadata']",
    "--Autograde.autograde_preprocessors=['nbgrader.preprocessors.IgnorePattern',"
    "'nbconvert.preprocessors.ClearMetadataPreprocessor','nbgrader.preprocessors.LimitOutput',"
    "'nbgrader.preprocessors.SaveAutoGrades','nbgrader.preprocessors.AssignLatePenalties',"
    "'nbgrader.preprocessors.CheckCellMetadata']",
)
GiB = 1 << 30


@dataclass
class Limits:
    memory_bytes: int = 8 * GiB      # resident memory of a job, all its processes together
    address_space_bytes: int = 16 * GiB   # RLIMIT_AS of each process (torch reserves far more than it touches)
    file_bytes: int = 2 * GiB        # RLIMIT_FSIZE: the largest file a job may write
    disk_bytes: int = 4 * GiB        # the job's folder (course copy, TMPDIR)
    processes: int = 64              # kernel + torchrun + ranks of the largest lab are far fewer


def cpu_share(jobs: int) -> int:
    return max(1, available_cores() // max(1, jobs))


def _set_limits(limits: Limits):
    def apply():
        os.setsid()
        resource.setrlimit(resource.RLIMIT_AS, (limits.address_space_bytes, limits.address_space_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    return apply


def marked(job_id: str) -> list:
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(JOB_MARKER) == job_id:
                found.append(p)
        except psutil.Error:
            pass
    return found


def kill_job(pid: int, job_id: str) -> None:
    """Stop a job: its session at once, then every process still carrying its marker (double forks too)."""
    import psutil

    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    for _ in range(20):
        left = marked(job_id)
        if not left:
            return
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        time.sleep(0.1)


def _usage(pid: int, folder: Path, with_disk: bool) -> tuple[int, int, int]:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0, 0, 0
    rss = 0
    for p in procs:
        try:
            rss += p.memory_info().rss
        except psutil.Error:
            pass
    disk = 0
    if with_disk:
        for dirpath, _, files in os.walk(folder):
            for f in files:
                try:
                    disk += os.lstat(os.path.join(dirpath, f)).st_size
                except OSError:
                    pass
    return len(procs), rss, disk


@dataclass
class _Job:
    student: str
    notebook: Path
    folder: Path
    proc: subprocess.Popen
    started: float
    job_id: str
    disk: int = 0
    checked_disk: float = 0.0
    stopped: str = ""


def _job_env(job_id: str, folder: Path, share: int) -> dict:
    env = {**os.environ, JOB_MARKER: job_id, CORES_VARIABLE: str(share), "OMP_NUM_THREADS": str(share),
           "MKL_NUM_THREADS": str(share), "TMPDIR": str(folder / "tmp")}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    return env


def setup(lab: str, layout: CourseLayout, work: Path) -> Path:
    """Record the lab in the class's course and in a template course each job copies (side by side)."""
    from concurrent.futures import ThreadPoolExecutor

    shutil.rmtree(work, ignore_errors=True)
    template = CourseLayout.isolated(work / "template", lab)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda course: prepare(lab, course), (layout, template)))
    return template.root


def grade_parallel(lab: str, submissions: dict[str, Path], layout: CourseLayout, work: Path, jobs: int,
                   per_student_timeout_s: float = 1800, feedback: bool = True, limits: Limits | None = None,
                   progress=print) -> list[StudentGrade]:
    """grading.grade's results for the same submissions, graded `jobs` at a time (see the module's notes)."""
    setup(lab, layout, work)
    results = run_jobs(lab, submissions, work, jobs, cpu_share(jobs), per_student_timeout_s, limits, progress)
    return finish_class(lab, layout, work, submissions, results, feedback)


def run_jobs(lab: str, submissions: dict[str, Path], work: Path, jobs: int, share: int,
             per_student_timeout_s: float, limits: Limits | None = None, progress=print) -> dict[str, StudentGrade]:
    """Grade each student in a job of its own under work/jobs/, `jobs` at a time, each job `share` cores."""
    limits = limits or Limits()
    template = work / "template"
    queue = list(submissions.items())
    running: list[_Job] = []
    results: dict[str, StudentGrade] = {}
    last_line = 0.0
    while queue or running:
        while queue and len(running) < jobs:
            student, notebook = queue.pop(0)
            folder = work / "jobs" / student
            (folder / "tmp").mkdir(parents=True)
            job_id = f"{os.getpid()}-{student}-{time.monotonic_ns()}"
            cmd = [sys.executable, "-m", "instructor.parallel_grade", "_one", lab, student, str(notebook),
                   str(folder), str(template), str(per_student_timeout_s)]
            with open(folder / "worker.log", "w") as log:
                proc = subprocess.Popen(cmd, cwd=folder, env=_job_env(job_id, folder, share), stdout=log,
                                        stderr=subprocess.STDOUT, preexec_fn=_set_limits(limits))
            running.append(_Job(student, Path(notebook), folder, proc, time.monotonic(), job_id))
        time.sleep(0.5)
        now = time.monotonic()
        for job in list(running):
            if job.proc.poll() is None and not job.stopped:
                check_disk = now - job.checked_disk > 3
                nproc, rss, disk = _usage(job.proc.pid, job.folder, check_disk)
                if check_disk:
                    job.disk, job.checked_disk = disk, now
                if nproc > limits.processes:
                    job.stopped = f"started more than {limits.processes} processes"
                elif rss > limits.memory_bytes:
                    job.stopped = f"used more than {limits.memory_bytes / GiB:g} GiB of memory"
                elif job.disk > limits.disk_bytes:
                    job.stopped = f"wrote more than {limits.disk_bytes / GiB:g} GiB to disk"
                elif now - job.started > per_student_timeout_s + 120:
                    job.stopped = f"ran past {per_student_timeout_s:.0f} s"
                if job.stopped:
                    kill_job(job.proc.pid, job.job_id)
            if job.proc.poll() is None:
                continue
            running.remove(job)
            kill_job(job.proc.pid, job.job_id)   # nothing of a finished job outlives it
            results[job.student] = _finish(job, per_student_timeout_s, now)
        done = len(results)
        if done and (now - last_line > 30 or not (queue or running)):
            failed = sum(r.status != "ok" for r in results.values())
            mean = sum(r.seconds for r in results.values()) / done    # seconds a student takes, so far
            left = (sum(max(0.0, mean - (now - j.started)) for j in running) + mean * len(queue)) / jobs
            progress(f"[grade {lab}] {done}/{len(submissions)} done, {failed} failed, {len(running)} running,"
                     f" about {left / 60:.1f} min left")
            last_line = now
    return results


def finish_class(lab: str, layout: CourseLayout, work: Path, submissions: dict[str, Path],
                 results: dict[str, StudentGrade], feedback: bool = True) -> list[StudentGrade]:
    """Merge the jobs' results into the class's course, write feedback, read every score from its gradebook."""
    merge(lab, layout, work, submissions, results)
    shutil.rmtree(work, ignore_errors=True)
    if feedback:
        _nbgrader(["generate_feedback", lab, "--force"], cwd=layout.root, timeout_s=600)
    return read_scores(lab, layout, [results[s] for s in submissions])


def _finish(job: _Job, per_student_timeout_s: float, now: float) -> StudentGrade:
    result_file = job.folder / "result.json"
    if job.stopped:
        status = "timeout" if job.stopped.startswith("ran past") else "limits"
        return StudentGrade(job.student, status=status, seconds=now - job.started,
                            message=f"grading stopped: this submission {job.stopped}")
    if result_file.exists():
        return StudentGrade(**json.loads(result_file.read_text()))
    log = (job.folder / "worker.log").read_text(errors="replace")[-1500:]
    return StudentGrade(job.student, status="error", seconds=now - job.started,
                        message=f"the grading job ended with {job.proc.returncode}: {log}")


def merge(lab: str, layout: CourseLayout, work: Path, submissions: dict[str, Path],
          results: dict[str, StudentGrade]) -> None:
    """Each worker's executed notebook into the one course: nbgrader autograde, without executing."""
    staging = work / "merge"
    shutil.rmtree(staging, ignore_errors=True)
    for student, result in results.items():
        target = layout.submitted / student / lab
        if Path(submissions[student]).resolve() != (target / f"{lab}.ipynb").resolve():  # not collected there
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            if result.status != "unreadable":
                shutil.copy(submissions[student], target / f"{lab}.ipynb")
        executed = work / "jobs" / student / "course" / "autograded" / student / lab / f"{lab}.ipynb"
        if result.status in ("ok", "infrastructure") and executed.is_file():
            (staging / student / lab).mkdir(parents=True)
            shutil.copy(executed, staging / student / lab / f"{lab}.ipynb")
    if not staging.exists():
        return
    rc, out = _nbgrader(["autograde", lab, "--force", f"--CourseDirectory.submitted_directory={staging}",
                         *MERGE_ARGS], cwd=layout.root, timeout_s=600)
    if rc != 0:
        raise SystemExit(f"merging the graded notebooks into {layout.db} failed:\n{out[-3000:]}")


def _one(lab: str, student: str, notebook: str, folder: str, template: str, timeout_s: str) -> None:
    """A worker: one student in a copy of the prepared course."""
    course = Path(folder) / "course"
    shutil.copytree(template, course)
    layout = CourseLayout.isolated(course, lab)
    result = grade_student(lab, student, Path(notebook), layout, float(timeout_s))
    (Path(folder) / "result.json").write_text(json.dumps(asdict(result)))


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "_one":
        _one(*sys.argv[2:])
    else:
        raise SystemExit("internal entry point of launchers/grade --jobs")
