"""launchers/grade --jobs: a submission that hangs, forks, fills the disk or eats memory costs that student, never
the run or another student. Each hostile notebook does its damage in its first code cell, then waits; the limits
are set low (the CLI's --job-* options) so the planted damage stays cheap."""

import csv

import nbformat
import psutil
import pytest

import labkit
from instructor.parallel_grade import JOB_MARKER
from test_grade_cli import HANGS, class_timeout, first_cell_runs, lr_scaling_only, run_grade

LAB = "01_gradient_accumulation"

# Students are graded in the order of their names, 3 at a time: "asleep" (the one that hangs) starts at once beside
# alice, so its timeout runs while she is graded and the other three are stopped one after the other.
HOSTILE = {
    "asleep": HANGS,
    "forks": "import os, time\nfor _ in range(40):\n    if os.fork() == 0:\n        time.sleep(3600)\n        os._exit(0)\n"
             "time.sleep(3600)\n",
    "fills_disk": "import os, tempfile, time\nfor i in range(12):\n"
                  "    with open(os.path.join(tempfile.gettempdir(), f'fill{i}'), 'wb') as f:\n"
                  "        f.write(b'x' * (30 << 20))\ntime.sleep(3600)\n",
    "eats_memory": "import time\nhog = b'x' * (1536 << 20)\ntime.sleep(3600)\n",
}


def marked_processes(folder):
    """Processes of this test's grading jobs (others may be grading at the same time): marked, TMPDIR inside folder."""
    found = []
    for p in psutil.process_iter():
        try:
            env = p.environ()
            if JOB_MARKER in env and env.get("TMPDIR", "").startswith(str(folder)):
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


@pytest.mark.slow
def test_hostile_submissions_cost_their_student_only(tmp_path):
    subs = tmp_path / "submissions"
    # alice answered exercise 4 (2 points) and is graded next to the hostile ones.
    notebooks = {"alice": lr_scaling_only(), **{student: first_cell_runs(code) for student, code in HOSTILE.items()}}
    for student, nb in notebooks.items():
        (subs / student).mkdir(parents=True)
        nbformat.write(nb, subs / student / f"{LAB}.ipynb")

    out = tmp_path / "grades"
    run_grade(subs, "--out", out, "--jobs", "3", "--job-memory", "1", "--job-disk", "0.25", "--job-processes", "24",
              timeout=class_timeout(), students=2)
    rows = {row["student"]: row for row in csv.DictReader(open(out / "grades.csv"))}
    status = {s: (row["status"], float(row["auto_score"])) for s, row in rows.items()}
    assert status == {"alice": ("ok", 2.0), "asleep": ("timeout", 0.0), "forks": ("limits", 0.0),
                      "fills_disk": ("limits", 0.0), "eats_memory": ("limits", 0.0)}, rows
    assert "processes" in rows["forks"]["message"] and "memory" in rows["eats_memory"]["message"]
    assert "disk" in rows["fills_disk"]["message"], rows["fills_disk"]["message"]
    assert not marked_processes(tmp_path), "a process of a grading job survived"
