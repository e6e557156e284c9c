"""Instructor tooling that needs no notebook execution: lab names and submission collection."""

import zipfile

import pytest

from lablib import course


def test_find_lab_accepts_numbers_and_names():
    assert course.find_lab("1") == course.find_lab("01") == course.find_lab("01_gradient_accumulation")
    with pytest.raises(SystemExit, match="no lab '99'; the labs are: 01_gradient_accumulation"):
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
