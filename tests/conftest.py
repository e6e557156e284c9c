"""Shared test set-up: the data file, the tiers, the lab as the unit of scheduling (pytest-xdist, LabScheduling), each
test's time limit (pytest-timeout), and each lab's CI cost at the end of the run."""

from __future__ import annotations

import functools
import os
import re
import sys
import shutil
import time
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
             "test_cp", "test_ep_probes", "test_job_recorder", "test_collectives_bench"],
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

# Each test's time limit by tier, in seconds on the idle 2-core CI machine, stretched by the load when the test starts
# (labkit.scaled_timeout); past it pytest-timeout fails that test alone (signal method: the exception is raised in the
# test, the run goes on; nbgrader's process is killed in instructor/grading.py's finally, a LiveLab's kernel shut down
# as its context exits).
#   unit, ranks: the tier's slowest test, measured in `launchers/test --fast` on the 2-core machine at a 1-minute load
#         of about 12 (a load factor of about 6, so the figures are upper bounds for an idle machine): unit 7.2 s
#         (test_lablib_memory_timeline), ranks 114 s (test_launch's hang with every rank's stack); the limits are
#         about 8 and 2.6 times those, before the stretch by the load;
#   labs: a lab's live check or its two autogrades (labkit.LIVE_CHECK_LIMIT_S, 2 x labkit.AUTOGRADE_LIMIT_S); the
#         book's whole build waits for a last lab and then builds (twice that);
#   system: not measured here (browsers, Slurm, classes): the labs' limit, a backstop behind their own timeouts.
TIER_TIMEOUT_S = {"unit": 60, "ranks": 300, "labs": 600, "system": 600}
BOOK_TEST = "test_book.py::test_book_shows_every_lab_with_its_figures"

LAB_DIR = re.compile(r"tests/labs/(\d\d_[a-z0-9_]+)/")
LAB_ID = re.compile(r"\[(\d\d_[a-z0-9_]+)\]")


def lab_of(nodeid: str) -> str | None:
    """The lab a test belongs to: its folder tests/labs/<lab>/, else the lab its parameters name (its id)."""
    match = LAB_DIR.search(nodeid) or LAB_ID.search(nodeid)
    return match.group(1) if match else None


def pytest_configure(config):
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: a test of the {tier} tier (tests/conftest.py TIERS)")
    if not hasattr(config, "workerinput"):   # the run's controller (or the only process): this run's executions only
        import labkit

        shutil.rmtree(labkit.EXECUTIONS, ignore_errors=True)


@functools.cache
def _source(path: str) -> str:
    return (REPO / path).read_text() if (REPO / path).is_file() else ""


def work_unit(nodeid: str) -> str:
    """What one worker takes whole (tests/conftest.py LabScheduling): a test file whose module sets a fixture up once
    (module scope: a JupyterLab, a browser, two ranks), or starts a Slurm cluster, stays one unit; else a test of one
    lab goes with that lab's (one worker checks a lab from its unit tests to its autogrades); else a test is its own."""
    if nodeid.endswith(BOOK_TEST):   # handed out last, alone: it waits for the labs' executions (test_book.py)
        return nodeid
    path = nodeid.split("::", 1)[0]
    text = _source(path)
    if "slurm_cluster" in text:
        return "slurm"
    if 'scope="module"' in text:
        return path
    return lab_of(nodeid) or nodeid


@pytest.hookimpl(tryfirst=True)   # before xdist's own (dsession.py), which would answer first
def pytest_xdist_make_scheduler(config, log):
    """The lab as the unit of scheduling on the workers (launchers/test: -n 2). pytest-xdist's own --dist loadgroup
    would do this from xdist_group marks, but with pytest 9.2 it groups nothing: xdist 3.8.0 renames a test by setting
    item._nodeid (xdist/remote.py:254), and pytest 9.2's Node.nodeid returns str(self._id) (_pytest/nodes.py:290-292),
    so the workers report no group. The same scheduler (LoadScopeScheduling) is given the unit here instead."""
    from xdist.scheduler import LoadScopeScheduling

    class LabScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return LabScheduling(config, log)


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
    # The order the workers are handed the units in (LoadScopeScheduling gives out the units with the most tests first,
    # ties in this order; a unit stands where its first test does): the labs first, then the rest, the book last, after
    # every lab it is built from was handed out.
    labs = [i for i in items if lab_of(i.nodeid) and work_unit(i.nodeid) == lab_of(i.nodeid)]
    book = [i for i in items if i.nodeid.endswith(BOOK_TEST)]
    rest = [i for i in items if i not in labs and i not in book]
    items[:] = sorted(labs, key=lambda i: lab_of(i.nodeid)) + rest + book


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """The test's time limit, stretched by the load now (a wrapper that runs before pytest-timeout's reads it)."""
    import labkit

    idle = TIER_TIMEOUT_S[TIER_OF[item.path.stem]] * (2 if item.nodeid.endswith(BOOK_TEST) else 1)
    item.add_marker(pytest.mark.timeout(labkit.scaled_timeout(idle)))
    yield


SESSION_START = time.time()   # conftest is imported when the session starts
# Every test of a lab (its folder, or a lab in its id) is charged to that lab: the CI cost of a lab, all of its checks
# included, against the course's budget of about 3 minutes per lab (fourteen labs in 42 minutes).
LAB_CI_BUDGET_S = 180.0
LAB_CI_COST: dict[str, float] = {}
LAB_PHASES: dict[str, dict[str, float]] = {}


def pytest_runtest_logreport(report):
    lab = lab_of(report.nodeid)
    if lab:
        LAB_CI_COST[lab] = LAB_CI_COST.get(lab, 0.0) + report.duration
        for name, value in report.user_properties:   # phases a test recorded (record_property; xdist forwards them)
            if isinstance(value, (int, float)):
                LAB_PHASES.setdefault(lab, {})[name] = float(value)


def pytest_terminal_summary(terminalreporter, config):
    if not LAB_CI_COST:
        return
    workers = getattr(config.option, "numprocesses", None) or 1
    terminalreporter.section(f"CI cost per lab (2-core machine; budget {LAB_CI_BUDGET_S:.0f} s per lab)")
    terminalreporter.write_line(f"(seconds of wall time of each lab's tests on its worker; {workers} worker(s) share the "
                                f"cores, so a lab's seconds are its cost with 1/{workers} of the machine)")
    for lab, cost in sorted(LAB_CI_COST.items()):
        parts = ", ".join(f"{k} {v:.0f} s" for k, v in LAB_PHASES.get(lab, {}).items())
        terminalreporter.write_line(f"{lab}: {cost:.0f} s in all" + (f" ({parts})" if parts else ""))
    wall = time.time() - SESSION_START
    per_lab = wall / len(LAB_CI_COST)
    flag = "  OVER BUDGET" if per_lab > LAB_CI_BUDGET_S else ""
    terminalreporter.write_line(f"all labs: {sum(LAB_CI_COST.values()):.0f} s of tests on {workers} worker(s)")
    terminalreporter.write_line(f"whole session: {wall:.0f} s of wall time for {len(LAB_CI_COST)} labs, {per_lab:.0f} s per lab "
                                f"(budget {LAB_CI_BUDGET_S:.0f} s){flag}")
