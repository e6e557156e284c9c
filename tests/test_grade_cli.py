"""launchers/grade end to end on an LMS-style zip: partial credit, an untouched release, a corrupt file and a
hanging notebook. The bad submissions cost their students points, never the run, and no kernel survives."""

import csv
import subprocess
import zipfile

import nbformat
import psutil
import pytest

import labkit

LAB = "01_gradient_accumulation"


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
    """The release with exercise 4 (the learning-rate functions) answered and nothing else: 2 points."""
    nb = labkit.read(LAB, released=True)
    answer = next(c for c in labkit.read(LAB).cells if labkit.nbg(c).get("grade_id") == "lr_scaling")
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
    release = labkit.read(LAB, released=True)
    alice = lr_scaling_only()
    dave = first_cell_runs("import time\ntime.sleep(3600)\n")   # dave's notebook hangs in its first code cell

    export = tmp_path / "export.zip"
    with zipfile.ZipFile(export, "w") as zf:
        zf.writestr(f"alice_1001_2001_{LAB}.ipynb", nbformat.writes(alice))
        zf.writestr(f"bob_1002_2002_{LAB}.ipynb", nbformat.writes(release))
        zf.writestr(f"carol_1003_2003_{LAB}.ipynb", '{"cells": [ this is not json')
        zf.writestr(f"dave_1004_2004_{LAB}.ipynb", nbformat.writes(dave))

    out = tmp_path / "grades"
    timeout = labkit.scaled_timeout(60)   # alice must finish within it (about 25 s idle); dave costs all of it
    result = subprocess.run(["bash", str(labkit.REPO / "launchers" / "grade"), "01", str(export), "--out", str(out),
                             "--timeout", str(timeout)], capture_output=True, text=True, timeout=900 + 4 * timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {row["student"]: row for row in csv.DictReader(open(out / "grades.csv"))}
    assert set(rows) == {"alice", "bob", "carol", "dave"}, rows
    max_auto = float(rows["bob"]["auto_max"])
    assert max_auto > 2
    assert (rows["alice"]["status"], float(rows["alice"]["auto_score"])) == ("ok", 2.0), rows["alice"]
    assert float(rows["alice"]["test_lr_scaling"]) == 2.0
    assert (rows["bob"]["status"], float(rows["bob"]["auto_score"])) == ("ok", 0.0), rows["bob"]
    assert (rows["carol"]["status"], float(rows["carol"]["auto_score"])) == ("unreadable", 0.0)
    assert (rows["dave"]["status"], float(rows["dave"]["auto_score"])) == ("timeout", 0.0)
    assert float(rows["alice"]["manual_max_pending"]) > 0, "free-text answers are left for manual grading"
    assert (out / "feedback" / "alice" / LAB / f"{LAB}.html").is_file()
    assert not kernels_under(tmp_path), "a grading kernel survived"
