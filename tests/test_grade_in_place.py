"""Notebooks that nbgrader's exchange collected into the course (grading/submitted/<student>/<lab>/, with the
timestamp.txt that late penalties read) are graded where they are: neither mode deletes or replaces them. nbgrader
itself is replaced by a recorder here: what is tested is the files around it, in well under a second."""

from pathlib import Path

import nbformat

import labkit
from instructor import grading, parallel_grade
from instructor.grading import CourseLayout, StudentGrade

LAB = "01_gradient_accumulation"


def collected_class(root: Path) -> tuple[CourseLayout, dict[str, Path]]:
    layout = CourseLayout(root, root / "submitted", root / "feedback", root / "gradebook.db")
    submissions = {}
    for student in ("ada", "ben"):
        folder = layout.submitted / student / LAB
        folder.mkdir(parents=True)
        nbformat.write(labkit.read(LAB, released=True), folder / f"{LAB}.ipynb")
        (folder / "timestamp.txt").write_text("2026-11-20 09:00:00.000000 UTC")   # what nbgrader collect writes
        submissions[student] = folder / f"{LAB}.ipynb"
    return layout, submissions


def untouched(submissions: dict[str, Path], before: dict[str, bytes]) -> None:
    for student, notebook in submissions.items():
        assert notebook.read_bytes() == before[student], f"{student}'s collected notebook was replaced"
        assert (notebook.parent / "timestamp.txt").is_file(), f"{student}'s timestamp.txt (late penalties) was deleted"


def test_serial_grading_leaves_collected_notebooks_in_place(tmp_path, monkeypatch):
    layout, submissions = collected_class(tmp_path)
    before = {s: nb.read_bytes() for s, nb in submissions.items()}
    calls = []
    monkeypatch.setattr(grading, "_nbgrader", lambda args, **kw: calls.append(args) or (0, ""))
    monkeypatch.setattr(grading, "infrastructure_failures", lambda executed: [])
    for student, notebook in submissions.items():
        assert grading.grade_student(LAB, student, notebook, layout).status == "ok"
    assert [c[:4] for c in calls] == [["autograde", LAB, "--student", s] for s in submissions]
    untouched(submissions, before)


def test_parallel_merge_leaves_collected_notebooks_in_place(tmp_path, monkeypatch):
    layout, submissions = collected_class(tmp_path / "course")
    before = {s: nb.read_bytes() for s, nb in submissions.items()}
    work = tmp_path / "work"
    for student in submissions:            # what each worker left: its executed notebook
        executed = work / "jobs" / student / "course" / "autograded" / student / LAB / f"{LAB}.ipynb"
        executed.parent.mkdir(parents=True)
        executed.write_bytes(before[student])
    merged = []
    monkeypatch.setattr(parallel_grade, "_nbgrader", lambda args, **kw: merged.append(args) or (0, ""))
    parallel_grade.merge(LAB, layout, work, submissions, {s: StudentGrade(s) for s in submissions})
    assert len(merged) == 1 and merged[0][:2] == ["autograde", LAB], merged
    assert sorted(p.parent.parent.name for p in (work / "merge").glob(f"*/{LAB}/{LAB}.ipynb")) == sorted(submissions)
    untouched(submissions, before)
