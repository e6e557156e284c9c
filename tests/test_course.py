"""Instructor tooling that needs no notebook execution: lab names and submission collection."""

import zipfile

import pytest

from instructor import course


def test_find_lab_accepts_numbers_and_names():
    assert course.find_lab("1") == course.find_lab("01") == course.find_lab("01_gradient_accumulation")
    with pytest.raises(SystemExit, match="no lab '99'; the labs are: " + ", ".join(course.all_labs())):
        course.find_lab("99")


def test_collect_from_folders_files_and_zip(tmp_path):
    lab = "01_gradient_accumulation"
    subs = tmp_path / "subs"
    (subs / "alice" / ".ipynb_checkpoints").mkdir(parents=True)
    (subs / "alice" / ".ipynb_checkpoints" / f"{lab}-checkpoint.ipynb").write_text("{}")
    (subs / "alice" / "scratch.ipynb").write_text("{}")
    (subs / "alice" / f"{lab}.ipynb").write_text("{}")
    (subs / f"bob_77_88_{lab}.ipynb").write_text("{}")
    (subs / "empty").mkdir()
    found = course.collect_submissions(subs, lab, tmp_path / "unzipped")
    assert found == {"alice": subs / "alice" / f"{lab}.ipynb", "bob": subs / f"bob_77_88_{lab}.ipynb"}

    export = tmp_path / "export.zip"
    with zipfile.ZipFile(export, "w") as zf:
        zf.writestr(f"carol_1_2_{lab}.ipynb", "{}")
    assert set(course.collect_submissions(export, lab, tmp_path / "unzipped")) == {"carol"}
    with pytest.raises(SystemExit, match="no notebooks found"):
        course.collect_submissions(subs / "empty", lab, tmp_path / "x")


def test_cells_lost_to_a_killed_rank_are_reported_not_graded(tmp_path):
    """A graded cell that failed with lablib.jobs.launch.RankKilledError is the machine's failure: listed, so the
    grade says so; a cell that failed with the student's own error is not."""
    import nbformat

    def graded(grade_id, ename, evalue="..."):
        cell = nbformat.v4.new_code_cell("launch.run(...)", metadata={"nbgrader": {"grade": True, "grade_id": grade_id}})
        cell.outputs = [nbformat.v4.new_output("error", ename=ename, evalue=evalue, traceback=[])]
        return cell

    nb = nbformat.v4.new_notebook(cells=[
        graded("test_ddp", "RankKilledError"), graded("test_loss", "AssertionError"),
        graded("test_data", "RunError", "step 'strategy_benchmark' on 2 ranks failed: rank 0: DataUnavailableError: "
                                        "Tiny Shakespeare could not be downloaded"),
        nbformat.v4.new_code_cell("x = 1")])
    path = tmp_path / "lab.ipynb"
    nbformat.write(nb, path)
    assert course.infrastructure_failures(path) == ["test_ddp", "test_data"]
    assert course.infrastructure_failures(tmp_path / "missing.ipynb") == []


def test_lablib_table_of_contents_lists_every_module():
    """lablib/__init__.py's docstring is the one table of contents (the README points at it): keep it true."""
    import re
    from pathlib import Path

    import lablib

    root = Path(lablib.__file__).parent
    modules = {".".join(p.relative_to(root).with_suffix("").parts) for p in root.glob("*.py")}
    modules |= {".".join(p.relative_to(root).with_suffix("").parts) for p in root.glob("*/*.py")
                if p.parent.name != "runs" and p.stem != "__init__"}
    modules |= {p.parent.name for p in root.glob("*/__init__.py")}
    modules |= {".".join(p.relative_to(root).with_suffix("").parts) for p in root.glob("labs/*/*.py")
                if p.stem != "__init__"}                              # a lab's package: its modules, run included
    modules |= {f"labs.{p.parent.name}" for p in root.glob("labs/*/__init__.py")}
    modules -= {"__init__"}
    listed = set(re.findall(r"``lablib\.([\w.]+)``", lablib.__doc__)) - {"runs.<step>"}
    assert listed == modules, f"missing from the table: {sorted(modules - listed)}; gone: {sorted(listed - modules)}"
