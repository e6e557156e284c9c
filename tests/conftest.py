"""Shared test set-up: the data file, and a summary of each lab's measured times at the end of the run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the instructor package lives beside lablib, in the repository only
SHARED_TEXT = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"

if "LABLIB_SHAKESPEARE" not in os.environ and SHARED_TEXT.is_file():
    os.environ["LABLIB_SHAKESPEARE"] = str(SHARED_TEXT)

LAB_TIMES: dict[str, dict[str, float]] = {}


@pytest.fixture(scope="session")
def lab_times():
    return LAB_TIMES


def pytest_terminal_summary(terminalreporter):
    if not LAB_TIMES:
        return
    terminalreporter.section("lab execution times (2-core CI machine, NBGRADER_EXECUTION sizes)")
    for lab, times in sorted(LAB_TIMES.items()):
        parts = ", ".join(f"{k} {v:.0f} s" for k, v in times.items())
        terminalreporter.write_line(f"{lab}: {parts}")
