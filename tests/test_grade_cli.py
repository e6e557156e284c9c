"""launchers/grade end to end on an LMS-style zip: partial credit, a corrupt file and a hanging notebook. The bad
submissions cost their students points, never the run, and no kernel survives. (The untouched release's zero in
the serial mode is test_grade_parallel.py's release student.)"""

import csv
import html
import re
import subprocess
import zipfile

import nbformat
import psutil
import pytest

import labkit

LAB = "01_gradient_accumulation"
HANGS = "import time\ntime.sleep(3600)\n"

# One --timeout applies to every student of a run: it must let alice (lr_scaling_only) finish, and it is all that a
# hanging student costs. Alice costs about ALICE_IDLE_S to autograde on an idle 2-core machine (nbgrader's start, a
# kernel, torch's import through lablib.checks; measured 8.6 s of CPU, 89 s of wall at a load of 24). Beside the
# hostile students of test_grade_hostile.py she took 36.7 s at a load of 6-7 (load factor 3 at the start: 12 s per
# unit). The timeout is 5 times her idle cost, stretched by the load per core when the test starts
# (labkit.scaled_timeout): 3.3 times what she took there, for a load that rises after the start.
ALICE_IDLE_S = 8


def class_timeout() -> float:
    return labkit.scaled_timeout(5 * ALICE_IDLE_S)


def run_grade(*args, timeout: float, students: int) -> subprocess.CompletedProcess:
    """launchers/grade with one --timeout per student; the test itself gives up once every student could have run
    out of it one after the other, plus the set-up and feedback (2 minutes idle, stretched by the load)."""
    cmd = ["bash", str(labkit.REPO / "launchers" / "grade"), "01", *map(str, args), "--timeout", str(timeout)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=students * timeout + labkit.scaled_timeout(120))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def kernels_under(folder) -> list[int]:
    """Kernels still running with their working directory inside folder."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if "ipykernel_launcher" in " ".join(p.info["cmdline"] or []) and p.cwd().startswith(str(folder)):
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


def lr_scaling_only() -> nbformat.NotebookNode:
    """The release with exercise 4 (the learning-rate functions) answered and nothing else: 2 points. Its set-up
    cell keeps only the import exercise 4's check needs, so the lab's other cells stop at once (NameError) and her
    grading costs little more than nbgrader's and the kernel's start (what the hanging students' timeout covers)."""
    nb = labkit.read(LAB, released=True)
    answer = next(c for c in labkit.read(LAB).cells if labkit.nbg(c).get("grade_id") == "lr_scaling")
    next(c for c in nb.cells if c.cell_type == "code").source = "from lablib import checks\n"
    for cell in nb.cells:
        if labkit.nbg(cell).get("grade_id") == "lr_scaling":
            cell.source = "\n".join(line for line in answer.source.splitlines() if "### " not in line)
    return nb


def first_cell_runs(code: str) -> nbformat.NotebookNode:
    """The release with code put before its first code cell."""
    nb = labkit.read(LAB, released=True)
    first_code = next(c for c in nb.cells if c.cell_type == "code")
    first_code.source = code + first_code.source
    return nb


@pytest.mark.slow
def test_grade_a_zip_export(tmp_path):
    export = tmp_path / "export.zip"
    with zipfile.ZipFile(export, "w") as zf:
        zf.writestr(f"alice_1001_2001_{LAB}.ipynb", nbformat.writes(lr_scaling_only()))
        zf.writestr(f"carol_1003_2003_{LAB}.ipynb", '{"cells": [ this is not json')
        # dave's notebook hangs in its first code cell: graded last, after the others, it costs the whole timeout.
        zf.writestr(f"dave_1004_2004_{LAB}.ipynb", nbformat.writes(first_cell_runs(HANGS)))

    out = tmp_path / "grades"
    graded = run_grade(export, "--out", out, timeout=class_timeout(), students=2)
    # The serial mode says after each student how far it is, as --jobs does: never minutes of silence.
    assert re.search(rf"\[grade {LAB}\] 1/(\d+) done, .*\n(.*\n)*\[grade {LAB}\] \1/\1 done", graded.stdout), graded.stdout
    rows = {row["student"]: row for row in csv.DictReader(open(out / "grades.csv"))}
    assert set(rows) == {"alice", "carol", "dave"}, rows
    assert float(rows["alice"]["auto_max"]) > 2
    assert (rows["alice"]["status"], float(rows["alice"]["auto_score"])) == ("ok", 2.0), rows["alice"]
    assert float(rows["alice"]["test_lr_scaling"]) == 2.0
    assert (rows["carol"]["status"], float(rows["carol"]["auto_score"])) == ("unreadable", 0.0)
    assert (rows["dave"]["status"], float(rows["dave"]["auto_score"])) == ("timeout", 0.0)
    assert float(rows["alice"]["manual_max_pending"]) > 0, "free-text answers are left for manual grading"
    feedback = (out / "feedback" / "alice" / LAB / f"{LAB}.html").read_text()
    # Feedback goes back to the student: no hidden test's source in it (only outputs and points).
    released = {labkit.code_key(line) for cell in labkit.read(LAB, released=True).cells for line in cell.source.splitlines()}
    hidden = [line.strip() for cell in labkit.read(LAB).cells for region in labkit.HIDDEN_REGION.findall(cell.source)
              for line in region.splitlines() if labkit.substantial(line) and labkit.code_key(line) not in released]
    assert hidden and "BEGIN HIDDEN TESTS" not in feedback       # nor in a traceback (instructor.feedback)
    assert not [line for line in hidden if html.escape(line) in feedback or line in feedback], "hidden tests in feedback"
    assert not kernels_under(tmp_path), "a grading kernel survived"
