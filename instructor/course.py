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
import csv
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

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


def _nbgrader(args: list[str], cwd: Path, timeout_s: float | None = None, env: dict | None = None):
    """Run nbgrader in cwd, killing it *and its kernel* if it outlives timeout_s."""
    from lablib.jobs.processes import RUN_MARKER, kill_run

    marker = uuid.uuid4().hex
    # nbgrader calls its helper programs (alembic) by name: put this environment's bin/ first on PATH.
    bin_dir = str(Path(sys.executable).parent)
    run_env = {**os.environ, **(env or {}), RUN_MARKER: marker,
               "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "nbgrader", *args], cwd=cwd, env=run_env,
                                stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_run(proc, marker)
            rc = None
        finally:
            if proc.poll() is None:
                kill_run(proc, marker)
        log.seek(0)
        return rc, log.read()


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
    client = NotebookClient(nb, timeout=cell_timeout_s, kernel_name="python3",
                            allow_errors=student_version, resources={"metadata": {"path": str(dst)}})
    t0 = time.perf_counter()
    os.environ["LABLIB_HEADLESS"] = "1"  # the kernel inherits it: widgets draw once, statically
    os.environ.pop("NBGRADER_EXECUTION", None)  # the sizes a student runs, never nbgrader's (inherited from a shell)
    try:
        client.execute()
    finally:
        seconds = time.perf_counter() - t0
        nbformat.write(nb, path)
    return path, seconds


# --- grade ---------------------------------------------------------------------------------------------

@dataclass
class StudentGrade:
    student: str
    status: str = "ok"               # ok | infrastructure | unreadable | timeout | error
    auto_score: float = 0.0
    auto_max: float = 0.0
    manual_max: float = 0.0          # free-text answers, graded by hand in formgrader
    seconds: float = 0.0
    cells: dict = field(default_factory=dict)   # grade_id -> (score, max_score, needs_manual_grade)
    message: str = ""


def collect_submissions(path: Path, lab: str, into: Path) -> dict[str, Path]:
    """Student id -> notebook, from a folder (one sub-folder or one .ipynb per student) or an LMS zip.

    File names like ``alice_12345_67890_01_lab.ipynb`` (Canvas, Moodle) give the student id before the
    first underscore; a sub-folder's name is its student's id.
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".zip":
        into.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(path) as zf:
            zf.extractall(into)
        path = into
    if not path.is_dir():
        raise SystemExit(f"{path} is neither a folder of submissions nor a .zip file")
    found: dict[str, Path] = {}
    for item in sorted(path.iterdir()):
        if item.is_dir():
            notebooks = sorted(item.rglob("*.ipynb"))
            notebooks = [n for n in notebooks if ".ipynb_checkpoints" not in n.parts]
            preferred = [n for n in notebooks if n.name == f"{lab}.ipynb"] or notebooks
            if preferred:
                found[item.name] = preferred[0]
        elif item.suffix == ".ipynb":
            found[item.stem.split("_", 1)[0] if "_" in item.stem else item.stem] = item
    if not found:
        raise SystemExit(f"no notebooks found in {path}")
    return found


@dataclass(frozen=True)
class CourseLayout:
    """Where nbgrader keeps a course's folders. The repository itself is the default course (see
    nbgrader_config.py: solutions/ is the source, grading/ holds submissions, feedback and the gradebook),
    so JupyterLab's Formgrader, started by launchers/lab, shows what launchers/grade autograded."""

    root: Path
    submitted: Path
    feedback: Path
    db: Path
    generate_args: tuple[str, ...] = ()

    @property
    def autograded(self) -> Path:
        return self.submitted.parent / "autograded"

    @classmethod
    def repository(cls) -> "CourseLayout":
        grading = REPO / "grading"
        # Grading must not rewrite labs/: its generate_assignment (which records the grade cells in the
        # gradebook) releases into grading/release instead.
        return cls(REPO, grading / "submitted", grading / "feedback", grading / "gradebook.db",
                   (f"--CourseDirectory.release_directory={grading / 'release'}",))

    @classmethod
    def isolated(cls, work: Path, lab: str) -> "CourseLayout":
        """A self-contained course in work/ (tests, dry runs), with the repository's settings."""
        work.mkdir(parents=True, exist_ok=True)
        (work / "nbgrader_config.py").write_text(
            f"exec(compile(open({str(REPO / 'nbgrader_config.py')!r}).read(), 'nbgrader_config.py', 'exec'))\n"
            f"c.CourseDirectory.root = {str(work)!r}\n"
            "c.CourseDirectory.source_directory = 'source'\n"
            "c.CourseDirectory.release_directory = 'release'\n"
            "c.CourseDirectory.submitted_directory = 'submitted'\n"
            "c.CourseDirectory.autograded_directory = 'autograded'\n"
            "c.CourseDirectory.feedback_directory = 'feedback'\n"
            f"c.CourseDirectory.db_url = 'sqlite:///{work / 'gradebook.db'}'\n")
        shutil.rmtree(work / "source" / lab, ignore_errors=True)
        shutil.copytree(SOLUTIONS / lab, work / "source" / lab,
                        ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__", "*_impl.py"))
        return cls(work, work / "submitted", work / "feedback", work / "gradebook.db")


def grade(lab: str, submissions: dict[str, Path], layout: CourseLayout | None = None,
          per_student_timeout_s: float = 1800, feedback: bool = True) -> list[StudentGrade]:
    """Autograde each student's notebook for lab (in the repository's course unless layout says otherwise)."""
    import nbformat
    from nbgrader.api import Gradebook, MissingEntry

    layout = layout or CourseLayout.repository()
    work = layout.root
    layout.db.parent.mkdir(parents=True, exist_ok=True)
    rc, out = _nbgrader(["generate_assignment", lab, "--force", *layout.generate_args], cwd=work, timeout_s=300)
    if rc != 0:
        raise SystemExit(f"nbgrader generate_assignment {lab} failed:\n{out}")

    results = []
    for student, notebook in submissions.items():
        result = StudentGrade(student)
        results.append(result)
        target = layout.submitted / student / lab
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        try:
            nbformat.validate(nbformat.read(notebook, as_version=4))
        except Exception as exc:  # noqa: BLE001 - any unreadable file is that student's problem only
            result.status, result.message = "unreadable", f"not a valid notebook: {exc}"[:500]
            continue
        shutil.copy(notebook, target / f"{lab}.ipynb")
        t0 = time.perf_counter()
        rc, out = _nbgrader(["autograde", lab, "--student", student, "--force"], cwd=work,
                            timeout_s=per_student_timeout_s)
        result.seconds = time.perf_counter() - t0
        if rc is None:
            result.status, result.message = "timeout", f"autograding ran past {per_student_timeout_s:.0f} s"
        elif rc != 0:
            result.status, result.message = "error", out[-2000:]
        else:
            lost = infrastructure_failures(layout.autograded / student / lab / f"{lab}.ipynb")
            if lost:
                result.status = "infrastructure"
                result.message = (f"cells {', '.join(lost)} failed because a rank was killed by a signal, not by "
                                  f"this student's code: their points are not a grade; grade this student again")
    if feedback:
        _nbgrader(["generate_feedback", lab, "--force"], cwd=work, timeout_s=600)

    with Gradebook(f"sqlite:///{layout.db}") as gb:
        assignment = gb.find_assignment(lab)
        for result in results:
            for nb in assignment.notebooks:
                for cell in nb.grade_cells:
                    is_manual = cell.cell_type == "markdown"
                    if is_manual:
                        result.manual_max += cell.max_score
                    else:
                        result.auto_max += cell.max_score
                    score, needs_manual = 0.0, is_manual
                    if result.status == "ok":
                        try:
                            g = gb.find_grade(cell.name, nb.name, lab, result.student)
                            score, needs_manual = g.score, g.needs_manual_grade
                        except MissingEntry:
                            pass
                    if not is_manual:
                        result.auto_score += score
                    result.cells[cell.name] = (score, cell.max_score, needs_manual)
    return results


INFRASTRUCTURE_ERRORS = ("RankKilledError",)


def infrastructure_failures(notebook: Path) -> list[str]:
    """grade_ids of the graded cells in an autograded notebook that failed because of the machine (a rank
    killed by a signal, lablib.jobs.launch.RankKilledError), not because of the answer."""
    import nbformat

    if not notebook.exists():
        return []
    lost = []
    for cell in nbformat.read(notebook, as_version=4).cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.cell_type == "code" and meta.get("grade") and any(
                out.get("output_type") == "error" and out.get("ename") in INFRASTRUCTURE_ERRORS
                for out in cell.get("outputs", [])):
            lost.append(meta.get("grade_id", "?"))
    return lost


def write_report(lab: str, results: list[StudentGrade], layout: CourseLayout, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    grade_ids = sorted({gid for r in results for gid in r.cells})
    csv_path = out_dir / "grades.csv"
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", "lab", "status", "auto_score", "auto_max", "manual_max_pending",
                         "seconds", *grade_ids, "message"])
        for r in results:
            writer.writerow([r.student, lab, r.status, r.auto_score, r.auto_max, r.manual_max,
                             f"{r.seconds:.1f}", *[r.cells.get(g, ("", ""))[0] for g in grade_ids],
                             r.message.replace("\n", " ")[:300]])
    for r in results:  # this lab's feedback only, one folder per student
        fb_src = layout.feedback / r.student / lab
        if fb_src.exists():
            shutil.copytree(fb_src, out_dir / "feedback" / r.student / lab, dirs_exist_ok=True)
    return csv_path


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
        results = grade(lab, subs, layout, per_student_timeout_s=args.timeout)
        csv_path = write_report(lab, results, layout, out)
        for r in results:
            print(f"  {r.student:20s} {r.status:10s} {r.auto_score:g}/{r.auto_max:g} auto"
                  f" (+{r.manual_max:g} to grade by hand)  {r.seconds:.0f} s")
        print(f"grades: {csv_path}\nfeedback: {out / 'feedback'}")


if __name__ == "__main__":
    main()
