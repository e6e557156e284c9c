"""Instructor tooling: release labs, execute them headless, autograde submissions (nbgrader).

    python -m instructor.course release [NN ...]          labs/ from solutions/ (launchers/release)
    python -m instructor.course execute NN [--lab]        run a lab headless, keep executed/NN_*.ipynb
    python -m instructor.course grade NN SUBMISSIONS      autograde a folder or zip; grades CSV + feedback

Grading runs nbgrader on the repository's course (grading/, the gradebook JupyterLab's Formgrader shows),
one subprocess per student with an overall time limit, so a broken or hanging submission costs that
student points, never the run. Grades CSV and feedback HTML are copied to grades/<lab>/.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from instructor.dispatch import grade_class
from instructor.grading import (CourseLayout, StudentGrade, _nbgrader, collect_submissions, grade,  # noqa: F401
                                infrastructure_failures, write_report)

REPO = Path(__file__).resolve().parent.parent
SOLUTIONS, LABS = REPO / "solutions", REPO / "labs"


def all_labs() -> list[str]:
    return sorted(p.name for p in SOLUTIONS.iterdir() if p.is_dir() and p.name[:2].isdigit())


def find_lab(name: str) -> str:
    """'01', '1' or '01_gradient_accumulation' -> '01_gradient_accumulation'."""
    labs = all_labs()
    if name in labs:
        return name
    matches = [lab for lab in labs if name.isdigit() and lab.split("_", 1)[0] == f"{int(name):02d}"]
    if len(matches) != 1:
        raise SystemExit(f"no lab {name!r}; the labs are: {', '.join(labs)}")
    return matches[0]


# --- release -------------------------------------------------------------------------------------------

def release(labs: list[str] | None = None) -> None:
    for lab in labs or all_labs():
        t0 = time.perf_counter()
        rc, out = _nbgrader(["generate_assignment", lab, "--force", "--no-db"], cwd=REPO, timeout_s=300)
        if rc != 0:
            raise SystemExit(f"nbgrader generate_assignment {lab} failed:\n{out}")
        print(f"released {lab} -> labs/{lab}/ ({time.perf_counter() - t0:.1f} s)")


# --- execute -------------------------------------------------------------------------------------------

def execute(lab: str, student_version: bool = False, out_root: Path = REPO / "executed",
            cell_timeout_s: float = 600) -> tuple[Path, float]:
    """Execute a lab top to bottom in a copy of its folder; return the executed notebook and seconds."""
    import nbformat
    from nbclient import NotebookClient

    src = (LABS if student_version else SOLUTIONS) / lab
    dst = out_root / (lab + ("_student" if student_version else ""))
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    path = dst / f"{lab}.ipynb"
    nb = nbformat.read(path, as_version=4)
    from traitlets.config import Config

    t0 = time.perf_counter()
    os.environ["LABLIB_HEADLESS"] = "1"  # the kernel inherits it: widgets draw once, statically
    os.environ.pop("NBGRADER_EXECUTION", None)  # the sizes a student runs, never nbgrader's (inherited from a shell)
    with tempfile.TemporaryDirectory(prefix="lablib-kernel-") as sockets:
        # The kernel talks over Unix sockets in a private folder, not TCP on localhost: nothing else on the machine
        # can reach it, and ipykernel has no "running over TCP without encryption" warning to print.
        ipc = Config({"KernelManager": {"transport": "ipc", "ip": str(Path(sockets) / "kernel")}})
        client = NotebookClient(nb, timeout=cell_timeout_s, kernel_name="python3", config=ipc,
                                allow_errors=student_version, resources={"metadata": {"path": str(dst)}})
        try:
            client.execute()
        finally:
            seconds = time.perf_counter() - t0
            nbformat.write(nb, path)
    return path, seconds


# --- grade: instructor/grading.py (serial), instructor/parallel_grade.py (--jobs, --slurm) ---------------

# --- command line --------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m instructor.course", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("release", help="regenerate labs/ from solutions/")
    p.add_argument("labs", nargs="*")
    p = sub.add_parser("execute", help="run a lab headless and keep the executed notebook")
    p.add_argument("lab")
    p.add_argument("--lab", dest="student", action="store_true", help="the student version (labs/)")
    p = sub.add_parser("grade", help="autograde a folder or zip of submissions")
    p.add_argument("lab")
    p.add_argument("submissions", type=Path)
    p.add_argument("--out", type=Path, default=None, help="default: grades/<lab>")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per student (default 1800)")
    p.add_argument("--jobs", type=int, default=None,
                   help="grade N students side by side, each with 1/N of the cores (default: one at a time)")
    p.add_argument("--job-memory", type=float, default=8, metavar="GiB",
                   help="--jobs: resident memory of one student's job, all its processes (default 8)")
    p.add_argument("--job-disk", type=float, default=4, metavar="GiB",
                   help="--jobs: what one student's job may write (default 4)")
    p.add_argument("--job-processes", type=int, default=64, help="--jobs: processes of one job (default 64)")
    p.add_argument("--slurm", action="store_true",
                   help="grade in a Slurm job array (sbatch); --jobs is then the students graded at once per task")
    p.add_argument("--slurm-tasks", type=int, default=None, help="--slurm: tasks in the array (default: 4 "
                   "students per job slot)")
    p.add_argument("--slurm-args", default="", help="--slurm: more sbatch options, e.g. '--partition=cpu'")
    p.add_argument("--force", action="store_true",
                   help="grade again students whose notebook and the lab are unchanged since the last run")
    args = parser.parse_args(argv)

    if args.command == "release":
        release([find_lab(x) for x in args.labs] or None)
    elif args.command == "execute":
        lab = find_lab(args.lab)
        path, seconds = execute(lab, student_version=args.student)
        print(f"executed {lab} in {seconds:.1f} s -> {path.relative_to(REPO)}")
    elif args.command == "grade":
        lab = find_lab(args.lab)
        out = args.out or REPO / "grades" / lab
        # The repository's course (grading/gradebook.db, seen by the Formgrader), unless --out asks for a
        # separate one: then the whole course lives in <out>/course.
        layout = CourseLayout.isolated(out / "course", lab) if args.out else CourseLayout.repository()
        subs = collect_submissions(args.submissions, lab, out / "unzipped")
        print(f"grading {len(subs)} submission(s) of {lab}: {', '.join(subs)}")
        from instructor.parallel_grade import GiB, Limits
        limits = Limits(memory_bytes=int(args.job_memory * GiB), disk_bytes=int(args.job_disk * GiB),
                        file_bytes=int(min(args.job_disk, 2) * GiB), processes=args.job_processes)
        slurm = {"tasks": args.slurm_tasks, "sbatch_args": args.slurm_args} if args.slurm else None
        results = grade_class(lab, subs, layout, out, args.jobs, args.timeout, force=args.force, limits=limits,
                              slurm=slurm)
        csv_path = write_report(lab, results, layout, out)
        for r in results:
            print(f"  {r.student:20s} {r.status:10s} {r.auto_score:g}/{r.auto_max:g} auto"
                  f" (+{r.manual_max:g} to grade by hand)  {r.seconds:.0f} s")
        print(f"grades: {csv_path}\nfeedback: {out / 'feedback'}")


if __name__ == "__main__":
    main()
