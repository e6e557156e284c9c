"""The class dispatcher (``launchers/grade``): which students need grading again, and which of the three ways grades
them: one at a time (instructor/grading.py), side by side (instructor/parallel_grade.py, ``--jobs``) or as a Slurm job
array (instructor/slurm_grade.py, ``--slurm``). It sits above all three, which never import it."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from instructor.grading import REPO, SOLUTIONS, CourseLayout, StudentGrade, grade, read_scores
from instructor.parallel_grade import grade_parallel
from instructor.slurm_grade import grade_slurm


def lab_fingerprint(lab: str) -> str:
    """What a grade depends on besides the notebook: the lab's source (its tests, hidden ones too), the
    references hidden tests use, and lablib (the visible checks)."""
    import hashlib

    h = hashlib.sha256()
    for root in (SOLUTIONS / lab, REPO / "instructor" / "references", REPO / "lablib"):
        for f in sorted(root.rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts and ".ipynb_checkpoints" not in f.parts:
                h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def grade_class(lab: str, submissions: dict[str, Path], layout: CourseLayout, out: Path, jobs: int | None,
                per_student_timeout_s: float, force: bool = False, limits=None,
                progress=print, slurm: dict | None = None) -> list[StudentGrade]:
    """launchers/grade: keep the grade of a student whose notebook and the lab are unchanged since the last
    run in this course (unless force; never one marked infrastructure), grade the others serially (jobs None),
    side by side, or in a Slurm job array (slurm: instructor.slurm_grade.grade_slurm's options), and read
    every score from the one gradebook."""
    import hashlib

    state_file = out / "grading_state.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {}
    fingerprint = lab_fingerprint(lab)
    keys = {s: hashlib.sha256(fingerprint.encode() + Path(nb).read_bytes()).hexdigest()
            for s, nb in submissions.items()}
    kept = {} if force else {
        s: StudentGrade(**state[s]["result"]) for s in submissions
        if s in state and state[s]["key"] == keys[s] and state[s]["result"]["status"] != "infrastructure"
        and (layout.autograded / s / lab).exists() == (state[s]["result"]["status"] == "ok")}
    todo = {s: nb for s, nb in submissions.items() if s not in kept}
    if kept:
        progress(f"[grade {lab}] {len(kept)} unchanged since the last run keep their grade (--force grades "
                 f"them again): {', '.join(kept)}")
    new: list[StudentGrade] = []
    if todo and slurm is not None:
        new = grade_slurm(lab, todo, layout, out / "jobs", jobs or 1, per_student_timeout_s, limits=limits,
                          progress=progress, **slurm)
    elif todo and jobs is None:
        new = grade(lab, todo, layout, per_student_timeout_s=per_student_timeout_s, progress=progress)
    elif todo:
        new = grade_parallel(lab, todo, layout, out / "jobs", jobs, per_student_timeout_s, limits=limits,
                             progress=progress)
    by_student = {**kept, **{r.student: r for r in new}}
    results = read_scores(lab, layout, [by_student[s] for s in submissions])
    state.update({r.student: {"key": keys[r.student], "result": asdict(r)} for r in results})
    out.mkdir(parents=True, exist_ok=True)
    state_file.write_text(json.dumps(state, indent=1))
    return results
