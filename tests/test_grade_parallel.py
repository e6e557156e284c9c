"""launchers/grade --jobs N: the same submissions (the release, and a student with two exercises right and one of
the course's wrong answers) graded one at a time and side by side get identical grades, cell by cell, in the same
kind of gradebook, CSV and feedback folder; a second run keeps the unchanged student's grades and grades again only
the one marked infrastructure.

The class holds no copy of the solution: its full marks through the same grading code (instructor.course.grade) are
tests/test_labs.py's, for every lab, and here it would add two runs of the whole lab (26 s each, idle) while the
partly-right student already has graded cells that pass, one that fails and cells that stop at once."""

import csv
import json
import subprocess
import sys

import nbformat
import pytest

import labkit
from test_grade_cli import run_grade

LAB = "01_gradient_accumulation"


def answered(nb: nbformat.NotebookNode, exercise: str, source: str) -> None:
    for cell in nb.cells:
        if labkit.nbg(cell).get("grade_id") == exercise:
            cell.source = source


def partly_wrong() -> nbformat.NotebookNode:
    """The release with exercises 2 and 4 answered as the solution does (5 points) and exercise 3 with the course's
    wrong answer (its visible check passes, its hidden test fails): some graded cells pass, a hidden one fails, the
    rest stop at once (NotImplementedError), so the student costs about what the release does."""
    nb = labkit.read(LAB, released=True)
    solution = {labkit.nbg(c).get("grade_id"): c.source for c in labkit.read(LAB).cells}
    for exercise in ("microbatch_loss", "lr_scaling"):
        answered(nb, exercise, "\n".join(line for line in solution[exercise].splitlines() if "### " not in line))
    [(_, wrong)] = labkit.wrong_answers(LAB)["bn_answer"][:1]
    answered(nb, "bn_answer", wrong)
    return nb


def class_folder(tmp_path):
    subs = tmp_path / "submissions"
    notebooks = {"release": labkit.read(LAB, released=True), "wrong": partly_wrong()}
    for student, nb in notebooks.items():
        (subs / student).mkdir(parents=True)
        nbformat.write(nb, subs / student / f"{LAB}.ipynb")
    return subs


def grade(subs, out, *extra):
    # Nobody hangs here: the timeout only has to let the partly-right student (under the solution's 26 s, idle)
    # finish, 5 times over.
    result = run_grade(subs, "--out", out, *extra, timeout=labkit.scaled_timeout(130), students=2)
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
    log, parallel = grade(subs, tmp_path / "parallel", "--jobs", "2")

    assert "2/2 done, 0 failed" in log, log
    assert same_grades(serial, parallel), (serial, parallel)
    assert gradebook_scores(tmp_path / "serial" / "course") == gradebook_scores(tmp_path / "parallel" / "course")
    assert float(serial["wrong"]["auto_max"]) == float(serial["release"]["auto_max"]) > 5
    assert float(serial["release"]["auto_score"]) == 0
    wrong = {cell: float(score) for cell, score in serial["wrong"].items() if cell.startswith("test_")}
    assert wrong["test_microbatch_loss"] == 3 and wrong["test_lr_scaling"] == 2 and wrong["test_bn_answer"] == 0, wrong
    assert float(serial["wrong"]["auto_score"]) == 5, serial["wrong"]
    for student in serial:
        assert (tmp_path / "parallel" / "feedback" / student / LAB / f"{LAB}.html").is_file(), student
    assert not (tmp_path / "parallel" / "jobs").exists(), "the jobs' course copies are removed after the merge"

    # Unchanged since the last run: every grade kept, nothing graded.
    state_file = tmp_path / "parallel" / "grading_state.json"
    state = json.loads(state_file.read_text())
    state["release"]["result"]["status"] = "infrastructure"   # as if a rank had been killed
    state_file.write_text(json.dumps(state))
    log, again = grade(subs, tmp_path / "parallel", "--jobs", "2")
    # Each student's key hashes the notebook with the lab's fingerprint as that run saw it: when someone edited
    # lablib/ or the lab between the two runs (a shared working tree), every student is graded again, as it should.
    if json.loads(state_file.read_text())["wrong"]["key"] == state["wrong"]["key"]:
        assert "1 unchanged since the last run keep their grade" in log and "1/1 done, 0 failed" in log, log
    else:
        assert "2/2 done, 0 failed" in log, log
    assert same_grades(again, parallel), (again, parallel)


def test_a_job_splits_its_share_of_the_cores_between_its_ranks(tmp_path):
    """A grading job's torchrun steps divide the job's share of the cores, not the machine's (no oversubscription)."""
    from instructor.parallel_grade import _job_env

    probe = "from lablib.jobs import launch; print(launch.available_cores(), launch.default_threads_per_rank(2))"
    seen = subprocess.run([sys.executable, "-c", probe], env=_job_env("probe", tmp_path, 3), capture_output=True,
                          text=True, check=True).stdout.split()
    assert seen == ["3", "1"], f"a job with 3 cores saw (cores, threads per rank of 2) = {seen}"
