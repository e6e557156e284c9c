"""The repository students clone (launchers/release --student-repo): built, audited, installed in a fresh
virtual environment, and run there, with no solution line, hidden test or test suite anywhere in it."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import labkit
from instructor import student_repo

REPO = labkit.REPO


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("student") / "repo"
    result = subprocess.run([str(REPO / "launchers" / "release"), "--student-repo", str(dest)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return dest


def test_it_holds_the_labs_and_what_runs_them_and_nothing_else(built):
    top = sorted(p.name for p in built.iterdir() if p.name != ".git")
    assert top == sorted([".gitignore", "README.md", "environment.yml", "lablib", "labs", "launchers",
                          "pyproject.toml", "requirements.txt", "requirements-deepspeed.txt"])
    assert sorted(p.name for p in (built / "labs").iterdir()) == labkit.labs()
    assert sorted(p.name for p in (built / "launchers").iterdir()) == ["_setup.sh", "deepspeed", "gpu-check", "lab", "multinode",
                                                                                "slurm.sbatch"]
    assert "launchers/lab" in (built / "README.md").read_text()
    assert student_repo.audit(built) == []
    log = subprocess.run(["git", "-C", str(built), "log", "--oneline"], capture_output=True, text=True)
    assert len(log.stdout.splitlines()) == 1, "one commit, no history from the course repository"


def test_it_ships_all_of_lablib_and_no_other_python(built):
    # A rule on folders, not a list of names: every module of lablib/ (what the labs import) and no other Python
    # file, instructor/ above all (the hidden tests' references). What may not stand in lablib/ (an answer line, a
    # hidden case) is the audit's and tests/test_labs.py's to refuse.
    repo = Path(__file__).resolve().parent.parent
    expected = {str(p.relative_to(repo)) for p in (repo / "lablib").rglob("*.py") if "__pycache__" not in p.parts}
    shipped = {str(p.relative_to(built)) for p in built.rglob("*.py") if ".git" not in p.relative_to(built).parts}
    assert shipped == expected, (f"missing: {sorted(expected - shipped)}; not from lablib/: {sorted(shipped - expected)}")
    assert not (built / "instructor").exists() and not (built / "solutions").exists() and not (built / "tests").exists()


def test_the_audit_refuses_code_that_reaches_the_references(tmp_path):
    (tmp_path / "lablib").mkdir()
    (tmp_path / "lablib" / "helpers.py").write_text("from instructor.references import pipeline\n")
    (tmp_path / "lablib" / "fine.py").write_text('"""Instructor tooling lives in the instructor package."""\n')
    problems = student_repo.audit(tmp_path)
    assert len(problems) == 1 and "helpers.py" in problems[0] and "instructor" in problems[0], problems


def test_the_audit_finds_a_planted_answer(built, tmp_path):
    lab, line = next(iter(student_repo.protected_lines().values()))
    planted = tmp_path / "lablib" / "helpers.py"
    planted.parent.mkdir()
    planted.write_text(f"def f():\n    {line}\n")
    assert any(lab in problem for problem in student_repo.audit(tmp_path))


def test_a_comment_or_spacing_does_not_hide_an_answer_line(tmp_path):
    # Compared as code: the same answer line with a trailing comment and other spacing is still found.
    lab, line = next((lab, line) for lab, line in student_repo.protected_lines().values() if "(" in line)
    disguised = line.replace("(", " ( ", 1) + "   # my own helper"
    planted = tmp_path / "lablib" / "helpers.py"
    planted.parent.mkdir()
    planted.write_text(f"def f():\n    {disguised}\n")
    assert any(lab in problem for problem in student_repo.audit(tmp_path)), disguised
    assert student_repo.code_key("x = f(a)  # why") == student_repo.code_key("x=f( a )") == "x=f(a)"


def test_a_hidden_test_line_that_lablib_holds_is_no_secret_but_a_solution_line_stays_one(monkeypatch):
    """A hidden test may call the library as any caller does (``owned = not dist.is_initialized()``); that line in
    lablib tells a student nothing, so the audit does not protect it. A model-answer line stays protected even when
    lablib holds it (that would be the leak). Checked by pretending lablib holds every line of every region."""
    before = set(student_repo.protected_lines())
    cells = [cell for lab in student_repo.all_labs() for cell in labkit.read(lab).cells]
    # every line of every region, also the hidden-test lines the real lablib already holds (exempt before as after)
    every = {student_repo.code_key(line) for cell in cells
             for region in student_repo.SOLUTION_REGION.findall(cell.source) + student_repo.HIDDEN_REGION.findall(cell.source)
             for line in region.splitlines()}
    monkeypatch.setattr(student_repo, "library_lines", lambda: every)
    still = student_repo.protected_lines()
    solution_keys = {student_repo.code_key(line) for cell in cells
                     for region in student_repo.SOLUTION_REGION.findall(cell.source) for line in region.splitlines()}
    assert still and set(still) <= solution_keys, "only model-answer lines stay protected"
    assert set(still) == before & solution_keys
    assert before - solution_keys, "some hidden-test lines were protected before (else this test shows nothing)"


def test_solution_only_launcher_options_are_refused(built):
    result = subprocess.run(["bash", str(built / "launchers" / "lab"), "--solutions"], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 2 and "labs only" in result.stderr


def test_installed_in_a_fresh_venv_it_imports_and_runs_a_step(built, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # The pinned dependencies (torch, ...) come from the course environment, read-only through a path line;
    # lablib itself is installed from the student repository, not in editable mode.
    (site / "course_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                              "--no-build-isolation", str(built)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    assert student_repo.audit(site / "lablib") == []
    probe = ("import lablib, lablib.jobs.launch as L; print(lablib.__file__); "
             "r = L.run('hello', nproc=2, timeout_s=120, quiet=True); print(r['metrics']['all_reduce_sum'])\n"
             "try:\n    import instructor\nexcept ImportError:\n    print('no instructor package')")
    run = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=240, cwd=tmp_path,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith(str(site)), f"lablib was imported from {lines[0]}, not from the fresh venv"
    assert lines[1:] == ["3.0", "no instructor package"]
