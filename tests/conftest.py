"""Shared test set-up: the data file, and a summary of each lab's measured times at the end of the run."""

from __future__ import annotations

import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the instructor package lives beside lablib, in the repository only
SHARED_TEXT = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"

if "LABLIB_SHAKESPEARE" not in os.environ and SHARED_TEXT.is_file():
    os.environ["LABLIB_SHAKESPEARE"] = str(SHARED_TEXT)

# Every test file belongs to one tier (a marker of the same name on each of its tests):
#   unit:   seconds, no process started;
#   ranks:  multi-process steps on gloo (torchrun, the launcher, teardown and hangs);
#   labs:   whole notebooks (nbgrader autogrades, live kernels, the book);
#   system: the browser, JupyterLab, Slurm, grading a class, several nodes, the student repository.
# The files of shared code and the cross-lab checks stand in tests/; one lab's own tests in tests/labs/<lab>/ (beside
# its answers.py and redteam.py). `launchers/test --fast` runs unit and ranks (-m "unit or ranks"); a new test file
# is added here, or collection fails (tests/test_tiers.py: each file in exactly one tier).
TIERS = {
    "unit": ["test_checks", "test_config", "test_data", "test_hidden_kinds", "test_layout", "test_models", "test_plots",
             "test_tiers", "test_lablib_commcost", "test_lablib_memory_timeline",
             # tests/labs/<lab>/
             "test_cp", "test_ep_probes"],
    "ranks": ["test_distenv", "test_launch", "test_teardown", "test_lablib_benchmark", "test_lablib_counting",
              "test_lablib_memory", "test_lablib_p2p", "test_lablib_timing",
              # tests/labs/<lab>/
              "test_scaling", "test_ddp_scratch", "test_zero_probes", "test_tp_probes", "test_pipeline_probes",
              "test_checkpointing", "test_strategies"],
    "labs": ["test_labs", "test_book", "test_course", "test_grade_in_place"],
    "system": ["test_browser", "test_gpu_check", "test_jupyter", "test_multinode", "test_grade_cli", "test_grade_parallel",
               "test_grade_slurm", "test_grade_hostile", "test_student_repo"],
}
TIER_OF = {module: tier for tier, modules in TIERS.items() for module in modules}


def pytest_configure(config):
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: a test of the {tier} tier (tests/conftest.py TIERS)")


def pytest_collection_modifyitems(config, items):
    unknown = sorted({item.path.stem for item in items if item.path.stem not in TIER_OF})
    if unknown:
        raise pytest.UsageError(f"test files with no tier: {unknown}; add each to TIERS in tests/conftest.py")
    for item in items:
        tier = TIER_OF[item.path.stem]
        others = [m.name for m in item.iter_markers() if m.name in TIERS and m.name != tier]
        if others:
            raise pytest.UsageError(f"{item.nodeid} is marked {others} besides its file's tier {tier}: one tier per test")
        item.add_marker(getattr(pytest.mark, tier))


LAB_TIMES: dict[str, dict[str, float]] = {}
SESSION_START = time.time()   # conftest is imported when the session starts
# Every test parametrized with a lab (its id names it) is charged to that lab: the CI cost of a lab, all of
# its checks included, against the course's budget of about 3 minutes per lab (fourteen labs in 42 minutes).
LAB_CI_BUDGET_S = 180.0
LAB_CI_COST: dict[str, float] = {}
LAB_ID = re.compile(r"\[(\d\d_[a-z0-9_]+)\]")


@pytest.fixture(scope="session")
def lab_times():
    return LAB_TIMES


# lab -> the solution notebook as nbgrader's autograding executed it in this run (tests/test_labs.py records
# it; tests/test_book.py builds the book from these executions instead of running every lab again).
AUTOGRADED_SOLUTIONS: dict[str, Path] = {}


@pytest.fixture(scope="session")
def autograded_solutions():
    return AUTOGRADED_SOLUTIONS


# lab -> the solution notebook executed top to bottom at the sizes a student runs (NBGRADER_EXECUTION unset), with
# its outputs: tests/test_labs.py::test_wrong_answers_lose_points records it, tests/test_book.py builds the book from it.
INTERACTIVE_SOLUTIONS: dict[str, Path] = {}


@pytest.fixture(scope="session")
def interactive_solutions():
    return INTERACTIVE_SOLUTIONS


@pytest.fixture(scope="session", autouse=True)
def background_autogrades(request, tmp_path_factory):
    """The selected labs' solution and release autograded by nbgrader in a background thread from the session's
    first test on (labkit.BackgroundAutogrades); None when no test_solution_full_marks_and_release_zero is selected."""
    selected = [item.callspec.params["lab"] for item in request.session.items
                if item.originalname == "test_solution_full_marks_and_release_zero"]
    if not selected:
        yield None
        return
    import labkit

    autogrades = labkit.BackgroundAutogrades(selected, tmp_path_factory.mktemp("autograded"))
    yield autogrades
    autogrades.close()


@pytest.fixture(scope="session", autouse=True)
def background_lab_checks(request, tmp_path_factory, background_autogrades):
    """The second lane of the labs' live checks (labkit.BackgroundLabChecks), queued on the autogrades' pool after
    them; None when fewer than two labs' test_wrong_answers_lose_points are selected (the test then runs its own)."""
    selected = [item.callspec.params["lab"] for item in request.session.items
                if item.originalname == "test_wrong_answers_lose_points"]
    if len(selected) < 2:
        yield None
        return
    import labkit

    pool = background_autogrades.pool if background_autogrades else ThreadPoolExecutor(1, "lab-checks")
    lane = labkit.BackgroundLabChecks(selected, tmp_path_factory.mktemp("lab_checks"), pool)
    yield lane
    lane.close()
    if not background_autogrades:
        pool.shutdown(wait=True)


def pytest_runtest_logreport(report):
    match = LAB_ID.search(report.nodeid)
    if match:
        LAB_CI_COST[match.group(1)] = LAB_CI_COST.get(match.group(1), 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not LAB_CI_COST:
        return
    terminalreporter.section(f"CI cost per lab (2-core machine; budget {LAB_CI_BUDGET_S:.0f} s per lab)")
    terminalreporter.write_line("(the labs' autogrades run in the background from the session's first test on: their seconds "
                                "are listed, and charged to a lab only while its test waits for them; a lab whose live "
                                "check ran in the background lane is charged its seconds there)")
    terminalreporter.write_line("(seconds of wall time; while the background lane runs, two labs share the two cores, so a "
                                "lab's seconds there are up to twice its seconds alone: the budget is checked on the "
                                "whole session, its wall time per lab)")
    for lab, cost in sorted(LAB_CI_COST.items()):
        # A lab checked in the background lane cost its seconds there, beside the foreground's tests.
        cost += LAB_TIMES.get(lab, {}).get("background lane", 0.0)
        parts = ", ".join(f"{k} {v:.0f} s" for k, v in LAB_TIMES.get(lab, {}).items())
        terminalreporter.write_line(f"{lab}: {cost:.0f} s in all" + (f" ({parts})" if parts else ""))
    background = sum(v for times in LAB_TIMES.values() for k, v in times.items() if k.endswith("autograde"))
    lane = sum(times.get("background lane", 0.0) for times in LAB_TIMES.values())
    terminalreporter.write_line(f"all labs: {sum(LAB_CI_COST.values()) + lane:.0f} s (autogrades, overlapped: {background:.0f} s; "
                                f"live checks in the background lane, overlapped: {lane:.0f} s)")
    wall = time.time() - SESSION_START
    per_lab = wall / len(LAB_CI_COST)
    flag = "  OVER BUDGET" if per_lab > LAB_CI_BUDGET_S else ""
    terminalreporter.write_line(f"whole session: {wall:.0f} s of wall time for {len(LAB_CI_COST)} labs, {per_lab:.0f} s per lab "
                                f"(budget {LAB_CI_BUDGET_S:.0f} s){flag}")
