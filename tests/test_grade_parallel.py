"""launchers/grade --jobs N: the same submissions (the solution, the release, two of the course's wrong answers)
graded one at a time and side by side get identical grades, in the same kind of gradebook, CSV and feedback
folder; a second run keeps the unchanged students' grades and grades again only one marked infrastructure."""

import csv
import json
import subprocess
import sys

import nbformat
import pytest

import labkit
from instructor.grading import lab_fingerprint

LAB = "01_gradient_accumulation"
GRADE = labkit.REPO / "launchers" / "grade"


def wrong_submission(exercise_index: int) -> nbformat.NotebookNode:
    """The solution with one exercise's cell replaced by its first wrong answer in tests/wrong_answers/."""
    nb = labkit.read(LAB)
    exercise, answers = sorted(labkit.wrong_answers(LAB).items())[exercise_index]
    for cell in nb.cells:
        if labkit.nbg(cell).get("grade_id") == exercise:
            cell.source = answers[0][1]
    return nb


def class_folder(tmp_path):
    subs = tmp_path / "submissions"
    notebooks = {"solution": labkit.read(LAB), "release": labkit.read(LAB, released=True),
                 "wrong_a": wrong_submission(0), "wrong_b": wrong_submission(1)}
    for student, nb in notebooks.items():
        (subs / student).mkdir(parents=True)
        nbformat.write(nb, subs / student / f"{LAB}.ipynb")
    return subs


def grade(subs, out, *extra):
    result = subprocess.run(["bash", str(GRADE), "01", str(subs), "--out", str(out), "--timeout", "300", *extra],
                            capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout, {row["student"]: row for row in csv.DictReader(open(out / "grades.csv"))}


def gradebook_scores(course):
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        return {(s.student.id, g.name): (g.score, g.needs_manual_grade)
                for s in gb.assignment_submissions(LAB) for n in s.notebooks for g in n.grades}


def same_grades(a, b):
    return {s: {k: v for k, v in row.items() if k not in ("seconds", "message")} for s, row in a.items()} == \
           {s: {k: v for k, v in row.items() if k not in ("seconds", "message")} for s, row in b.items()}


@pytest.mark.slow
def test_serial_and_parallel_grades_are_identical(tmp_path):
    subs = class_folder(tmp_path)
    _, serial = grade(subs, tmp_path / "serial")
    fingerprint = lab_fingerprint(LAB)
    log, parallel = grade(subs, tmp_path / "parallel", "--jobs", "2")

    assert "4/4 done, 0 failed" in log, log
    assert same_grades(serial, parallel), (serial, parallel)
    assert gradebook_scores(tmp_path / "serial" / "course") == gradebook_scores(tmp_path / "parallel" / "course")
    full = float(serial["solution"]["auto_max"])
    assert float(serial["solution"]["auto_score"]) == full > 0
    assert float(serial["release"]["auto_score"]) == 0
    assert all(float(serial[w]["auto_score"]) < full for w in ("wrong_a", "wrong_b")), serial
    for student in serial:
        assert (tmp_path / "parallel" / "feedback" / student / LAB / f"{LAB}.html").is_file(), student
    assert not (tmp_path / "parallel" / "jobs").exists(), "the jobs' course copies are removed after the merge"

    # Unchanged since the last run: every grade kept, nothing graded.
    state_file = tmp_path / "parallel" / "grading_state.json"
    state = json.loads(state_file.read_text())
    state["release"]["result"]["status"] = "infrastructure"   # as if a rank had been killed
    state_file.write_text(json.dumps(state))
    log, again = grade(subs, tmp_path / "parallel", "--jobs", "2")
    if lab_fingerprint(LAB) == fingerprint:   # (not when someone edited lablib/ or the lab meanwhile: all again)
        assert "3 unchanged since the last run keep their grade" in log and "1/1 done, 0 failed" in log, log
    else:
        assert "4/4 done, 0 failed" in log, log
    assert same_grades(again, parallel), (again, parallel)


def test_a_job_splits_its_share_of_the_cores_between_its_ranks(tmp_path):
    """A grading job's torchrun steps divide the job's share of the cores, not the machine's (no oversubscription)."""
    from instructor.parallel_grade import _job_env

    probe = "from lablib.jobs import launch; print(launch.available_cores(), launch.default_threads_per_rank(2))"
    seen = subprocess.run([sys.executable, "-c", probe], env=_job_env("probe", tmp_path, 3), capture_output=True,
                          text=True, check=True).stdout.split()
    assert seen == ["3", "1"], f"a job with 3 cores saw (cores, threads per rank of 2) = {seen}"
