"""launchers/grade --slurm on the real two-node Slurm cluster tests/test_multinode.py starts: a job array of two
tasks (one student each) on the cluster, its results merged into the one gradebook and CSV."""

import csv
import subprocess

import nbformat
import pytest

import labkit
from test_grade_cli import HANGS, class_timeout, first_cell_runs, lr_scaling_only
from test_grade_parallel import gradebook_scores
from test_multinode import slurm_cluster  # noqa: F401 - the fixture

LAB = "01_gradient_accumulation"


@pytest.mark.slow
def test_a_slurm_job_array_grades_the_class(slurm_cluster, tmp_path):  # noqa: F811 - the imported fixture
    env, _ = slurm_cluster
    subs = tmp_path / "submissions"
    # bob's task hangs while alice's is graded beside it: the per-student timeout reaches the array's tasks.
    notebooks = {"alice": lr_scaling_only(), "bob": first_cell_runs(HANGS)}
    for student, nb in notebooks.items():
        (subs / student).mkdir(parents=True)
        nbformat.write(nb, subs / student / f"{LAB}.ipynb")
    out = tmp_path / "grades"
    timeout = class_timeout()
    result = subprocess.run(["bash", str(labkit.REPO / "launchers" / "grade"), "01", str(subs), "--out", str(out),
                             "--slurm", "--slurm-tasks", "2", "--timeout", str(timeout)],
                            env=env, capture_output=True, text=True, timeout=timeout + labkit.scaled_timeout(180))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Slurm job array" in result.stdout and "2/2 done, 1 failed" in result.stdout, result.stdout
    rows = {row["student"]: row for row in csv.DictReader(open(out / "grades.csv"))}
    assert {s: (r["status"], float(r["auto_score"])) for s, r in rows.items()} == \
           {"alice": ("ok", 2.0), "bob": ("timeout", 0.0)}, rows
    scores = gradebook_scores(out / "course")
    assert scores[("alice", "test_lr_scaling")][0] == 2.0, scores
    assert (out / "feedback" / "alice" / LAB / f"{LAB}.html").is_file()
