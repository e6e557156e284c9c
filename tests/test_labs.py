"""The course's grading integrity, checked for every lab in solutions/ (COURSE_STANDARD.md):

- labs/ is exactly what nbgrader generate_assignment makes from solutions/;
- labs/ contains no solution code and no hidden-test text;
- every exercise has test cells and at least one plausible wrong answer (tests/labs/<lab>/answers.py);
- the solution autogrades to full marks and the unmodified release to zero, with nbgrader, in time;
- the solution runs top to bottom without an error at the sizes a student runs (NBGRADER_EXECUTION unset);
- each wrong answer fails at least one of its exercise's tests (run in a live kernel, not a whole re-execution).
"""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

import pytest

import labkit

LABS = labkit.labs()


def _diff(a, b) -> list[str]:
    cmp = filecmp.dircmp(a, b, ignore=["__pycache__", ".ipynb_checkpoints"])
    out = [f"only in {cmp.left}: {x}" for x in cmp.left_only] + [f"only in {cmp.right}: {x}" for x in cmp.right_only]
    out += [f"differs: {x}" for x in cmp.diff_files]
    for sub in cmp.common_dirs:
        out += _diff(a / sub, b / sub)
    return out


@pytest.mark.parametrize("lab", LABS)
def test_release_is_regenerated_from_solutions(lab, tmp_path):
    result = subprocess.run([sys.executable, "-m", "nbgrader", "generate_assignment", lab, "--force", "--no-db",
                             f"--CourseDirectory.release_directory={tmp_path}"],
                            cwd=labkit.REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    differences = _diff(tmp_path / lab, labkit.LABS / lab)
    assert not differences, f"labs/{lab} is stale; run launchers/release {lab[:2]} and commit:\n" + "\n".join(differences)


@pytest.mark.parametrize("lab", LABS)
def test_release_has_no_solution_or_hidden_tests(lab):
    released = labkit.LABS / lab
    text = "\n".join(p.read_text(errors="replace") for p in released.rglob("*") if p.is_file())
    for marker in ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"):
        assert marker not in text, f"labs/{lab} contains '{marker}'"
    # Every line of answer code or hidden test must be absent from the released cells, unless the same line
    # also stands outside those regions in the source (then it is meant to be visible).
    # Lines are compared as code (labkit.code_key: no comment, no spaces), so a trailing comment hides nothing.
    nb = labkit.read(lab)
    released = {labkit.code_key(line) for c in labkit.read(lab, released=True).cells for line in c.source.splitlines()}
    visible = set()
    for cell in nb.cells:
        outside = labkit.HIDDEN_REGION.sub("", labkit.SOLUTION_REGION.sub("", cell.source))
        visible.update(labkit.code_key(line) for line in outside.splitlines())
    for cell in nb.cells:
        regions = labkit.SOLUTION_REGION.findall(cell.source) + labkit.HIDDEN_REGION.findall(cell.source)
        for region in regions:
            for line in region.splitlines():
                key = labkit.code_key(line)
                if len(key) > 20 and not line.strip().startswith("#") and key not in visible:
                    assert key not in released, f"labs/{lab} leaks solution/hidden-test text: {line.strip()!r}"


@pytest.mark.parametrize("lab", LABS)
def test_no_solution_line_is_in_lablib(lab):
    """Students install lablib: no line of a graded answer may be importable or readable there."""
    # Compared as code (labkit.code_key): the same line with another comment or spacing is the same answer.
    library = {}
    for path in sorted((labkit.REPO / "lablib").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            library.setdefault(labkit.code_key(line), f"{path.relative_to(labkit.REPO)}:{number}")
    found = [f"{library[labkit.code_key(line)]}: {line.strip()}"
             for cell in labkit.read(lab).cells for region in labkit.SOLUTION_REGION.findall(cell.source)
             for line in region.splitlines() if labkit.substantial(line) and labkit.code_key(line) in library
             and labkit.code_key(line) not in labkit.FAIR_TO_SHARE]
    assert not found, f"lines of {lab}'s answers stand in lablib/ (redesign, do not reformat):\n" + "\n".join(found)


@pytest.mark.parametrize("lab", LABS)
def test_every_exercise_has_tests_and_a_wrong_answer(lab):
    nb = labkit.read(lab)
    ids = [labkit.nbg(c)["grade_id"] for c in nb.cells if labkit.nbg(c)]
    assert len(ids) == len(set(ids)), f"duplicate grade_ids in {lab}: {ids}"
    exercises = labkit.exercises(nb)
    assert exercises, f"{lab} has no exercises"
    wrong = labkit.wrong_answers(lab)
    for exercise in exercises:
        assert labkit.test_cells(nb, exercise), f"exercise {exercise} has no test cell test_{exercise}..."
        assert wrong.get(exercise), f"exercise {exercise} has no wrong answer in tests/labs/{lab}/answers.py"
    for cell in nb.cells:
        meta = labkit.nbg(cell)
        if meta.get("grade") and cell.cell_type == "code":
            assert meta.get("locked") and meta.get("points", 0) > 0, f"test cell {meta['grade_id']} must be locked, with points"


@pytest.mark.slow
@pytest.mark.parametrize("lab", LABS)
def test_wrong_answers_lose_points(lab, tmp_path, record_property):
    """The solution runs top to bottom at the sizes a student runs (the first error fails the test at once, with
    its cell); the same kernel then switches to nbgrader's sizes, and every wrong answer must lose points there
    and every correct variant keep them (labkit.live_check). The executed notebook is the book's page of the lab:
    it is left in labkit.EXECUTIONS for tests/test_book.py (or why there is none)."""
    try:
        result = labkit.live_check(lab, tmp_path / lab, env=labkit.worker_env())
    except BaseException as e:
        labkit.record_execution(lab, None, f"the live check raised {type(e).__name__}: {e}")
        raise
    for phase, seconds in result["times"].items():
        record_property(phase, seconds)
    labkit.record_execution(lab, Path(result["executed"]) if result["executed"] else None, result["raised"] or "")
    if result["raised"]:
        raise labkit.LabRaised(result["raised"])
    print("\n".join(result["report"]))
    assert not result["missed"], "wrong answers that lose no points:\n" + "\n".join(result["missed"])
    assert not result["punished"], "correct answers that lose points:\n" + "\n".join(result["punished"])


@pytest.mark.slow
@pytest.mark.parametrize("lab", LABS)
def test_solution_full_marks_and_release_zero(lab, tmp_path, record_property):
    grading = labkit.autograde(lab, tmp_path)
    results = {r.student: r for r in grading.results}
    solution, release = results["solution"], results["release"]
    record_property("solution autograde", solution.seconds)
    record_property("release autograde", release.seconds)
    assert solution.status == "ok", solution.message
    assert solution.auto_max > 0
    assert solution.auto_score == solution.auto_max, f"solution scored {solution.auto_score}/{solution.auto_max}: {solution.cells}"
    assert release.status == "ok", f"the release must autograde (to zero) within {labkit.AUTOGRADE_LIMIT_S} s idle (stretched by the load): {release.message}"
    assert release.auto_score == 0, f"the unmodified release scored {release.auto_score}: {release.cells}"
    course_dir = grading.layout.root
    assert (course_dir / "feedback" / "solution" / lab / f"{lab}.html").is_file(), "no feedback HTML generated"
    executed = course_dir / "autograded" / "solution" / lab / f"{lab}.ipynb"
    assert executed.is_file(), f"nbgrader left no autograded notebook at {executed}"


def test_a_live_lab_puts_the_correct_answer_back_after_a_wrong_one(tmp_path, monkeypatch):
    """nbclient stores each cell it executes at its index (nbclient/client.py:1064): a wrong answer run in a LiveLab
    must not become the notebook's cell, or "put the correct answer back" re-runs the wrong one and the next
    exercise's checks run beside it (its wrong answers then lose points for the earlier mistake)."""
    import nbformat

    lab = "99_restore"
    answer = nbformat.v4.new_code_cell("def f():\n    return 1\n",
                                       metadata={"nbgrader": {"grade_id": "f", "solution": True, "grade": False}})
    check = nbformat.v4.new_code_cell("assert f() == 1, 'f is wrong'\n",
                                      metadata={"nbgrader": {"grade_id": "test_f", "grade": True, "points": 1,
                                                             "solution": False, "locked": True}})
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# a lab"), answer, check])
    (tmp_path / "solutions" / lab).mkdir(parents=True)
    nbformat.write(nb, tmp_path / "solutions" / lab / f"{lab}.ipynb")
    monkeypatch.setattr(labkit, "SOLUTIONS", tmp_path / "solutions")
    with labkit.LiveLab(lab, tmp_path / "work") as live:
        live.run_all()
        wrong = live.try_wrong_answer("f", "returns 2", "def f():\n    return 2\n")
        assert wrong.points_lost == 1, wrong
        assert live.nb.cells[1].source == answer.source and live.nb.cells[0].cell_type == "markdown"
        assert live.in_kernel("assert f() == 1") == [], "the wrong answer stayed defined after the check"
        assert live.nb.cells[0].cell_type == "markdown"
