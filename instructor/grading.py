"""Autograde submissions with nbgrader, one student at a time (``launchers/grade LAB SUBMISSIONS``).

Grading runs nbgrader on the repository's course (grading/, the gradebook JupyterLab's Formgrader shows),
one subprocess per student with an overall time limit, so a broken or hanging submission costs that
student points, never the run. instructor/parallel_grade.py grades many students side by side (--jobs N,
--slurm) and merges their results into the same gradebook through nbgrader itself.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOLUTIONS = REPO / "solutions"


def _nbgrader(args: list[str], cwd: Path, timeout_s: float | None = None, env: dict | None = None):
    """Run nbgrader in cwd, killing it *and its kernel* if it outlives timeout_s."""
    from lablib.jobs.job import kill_run
    from lablib.jobs.processes import RUN_MARKER

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


def prepare(lab: str, layout: CourseLayout) -> None:
    """Record the lab's grade cells in the course's gradebook (nbgrader generate_assignment)."""
    layout.db.parent.mkdir(parents=True, exist_ok=True)
    rc, out = _nbgrader(["generate_assignment", lab, "--force", *layout.generate_args], cwd=layout.root,
                        timeout_s=300)
    if rc != 0:
        raise SystemExit(f"nbgrader generate_assignment {lab} failed:\n{out}")


def grade_student(lab: str, student: str, notebook: Path, layout: CourseLayout,
                  per_student_timeout_s: float = 1800, env: dict | None = None) -> StudentGrade:
    """Autograde one student's notebook in a prepared course; scores are read later (read_scores)."""
    import nbformat

    result = StudentGrade(student)
    target = layout.submitted / student / lab
    in_place = Path(notebook).resolve() == (target / f"{lab}.ipynb").resolve()   # nbgrader collect put it there
    if not in_place:
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
    try:
        nbformat.validate(nbformat.read(notebook, as_version=4))
    except Exception as exc:  # noqa: BLE001 - any unreadable file is that student's problem only
        result.status, result.message = "unreadable", f"not a valid notebook: {exc}"[:500]
        return result
    if not in_place:
        shutil.copy(notebook, target / f"{lab}.ipynb")
    t0 = time.perf_counter()
    rc, out = _nbgrader(["autograde", lab, "--student", student, "--force"], cwd=layout.root,
                        timeout_s=per_student_timeout_s, env=env)
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
    return result


def read_scores(lab: str, layout: CourseLayout, results: list[StudentGrade]) -> list[StudentGrade]:
    """Fill each result's cells and totals from the course's gradebook (0 unless its status is ok)."""
    from nbgrader.api import Gradebook, MissingEntry

    with Gradebook(f"sqlite:///{layout.db}") as gb:
        assignment = gb.find_assignment(lab)
        for result in results:
            result.auto_score = result.auto_max = result.manual_max = 0.0
            result.cells = {}
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


def grade(lab: str, submissions: dict[str, Path], layout: CourseLayout | None = None,
          per_student_timeout_s: float = 1800, feedback: bool = True, env: dict | None = None,
          progress=None) -> list[StudentGrade]:
    """Autograde each student's notebook for lab (in the repository's course unless layout says otherwise);
    env adds to nbgrader's environment (e.g. LABLIB_CORES, a share of the machine's cores); progress, when given,
    gets the side-by-side grader's progress line after each student (done, failed, time left)."""
    layout = layout or CourseLayout.repository()
    prepare(lab, layout)
    results, failed, t0 = [], 0, time.monotonic()
    for student, notebook in submissions.items():
        results.append(grade_student(lab, student, notebook, layout, per_student_timeout_s, env=env))
        failed += results[-1].status != "ok"
        if progress:
            left = (time.monotonic() - t0) / len(results) * (len(submissions) - len(results))
            progress(f"[grade {lab}] {len(results)}/{len(submissions)} done, {failed} failed, "
                     f"about {left / 60:.1f} min left")
    if feedback:
        _nbgrader(["generate_feedback", lab, "--force"], cwd=layout.root, timeout_s=600, env=env)
    return read_scores(lab, layout, results)


# A rank killed by a signal, and the course's data set out of reach (lablib.course.data.DataUnavailableError, raised in
# the notebook's kernel or, under torchrun, named in the RunError the kernel gets): the machine's failure, not the answer's.
INFRASTRUCTURE_ERRORS = ("RankKilledError", "DataUnavailableError")


def infrastructure_failures(notebook: Path) -> list[str]:
    """grade_ids of the graded cells in an autograded notebook that failed because of the machine (a rank
    killed by a signal, lablib.jobs.launch.RankKilledError; the data set unreachable, DataUnavailableError), not
    because of the answer."""
    import nbformat

    if not notebook.exists():
        return []
    lost = []
    for cell in nbformat.read(notebook, as_version=4).cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.cell_type == "code" and meta.get("grade") and any(
                out.get("output_type") == "error" and (out.get("ename") in INFRASTRUCTURE_ERRORS or any(
                    f"{name}:" in out.get("evalue", "") for name in INFRASTRUCTURE_ERRORS))
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


