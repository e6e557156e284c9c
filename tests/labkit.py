"""Helpers for the per-lab grading checks: read nbgrader metadata, run wrong answers in a live kernel."""

from __future__ import annotations

import ast
import copy
import importlib.util
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from instructor.course import LABS, REPO, SOLUTIONS, all_labs

from instructor.student_repo import (FAIR_TO_SHARE, HIDDEN_REGION, SOLUTION_REGION, code_key,  # noqa: F401 - the tests'
                                     substantial)


def labs() -> list[str]:
    return all_labs()


def read(lab: str, released: bool = False) -> nbformat.NotebookNode:
    return nbformat.read((LABS if released else SOLUTIONS) / lab / f"{lab}.ipynb", as_version=4)


def nbg(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def exercises(nb) -> dict[str, int]:
    """grade_id -> cell index, for the answer cells of code exercises (solution, not graded itself)."""
    return {nbg(c)["grade_id"]: i for i, c in enumerate(nb.cells)
            if c.cell_type == "code" and nbg(c).get("solution") and not nbg(c).get("grade")}


def test_cells(nb, exercise: str) -> dict[str, tuple[int, float]]:
    """grade_id -> (cell index, points) of the test cells of one exercise (grade_id test_<exercise>...)."""
    return {nbg(c)["grade_id"]: (i, float(nbg(c).get("points", 0))) for i, c in enumerate(nb.cells)
            if nbg(c).get("grade") and c.cell_type == "code" and nbg(c)["grade_id"].startswith(f"test_{exercise}")}


# Each lab's tests live in tests/labs/<lab>/: its probe and unit tests (test_*.py), and its answers as a fixed pair of
# files, each holding WRONG_ANSWERS and CORRECT_VARIANTS = {exercise grade_id: [(description, cell source)]}:
#   answers.py  the mistakes students really make and correct answers written another way, ours (required: every
#               exercise needs a wrong answer, tests/test_labs.py);
#   redteam.py  the same, written by a reviewer who had read only the released notebook (optional).
# The loader below reads both and appends the red team's to ours, so no file loads another.
LAB_TESTS = REPO / "tests" / "labs"
ANSWER_FILES = ("answers", "redteam")


def lab_file(lab: str, name: str):
    """tests/labs/<lab>/<name>.py as a module (None when the lab has no such file)."""
    if name not in ANSWER_FILES:
        raise ValueError(f"{name!r} is not one of a lab's answer files {ANSWER_FILES}")
    path = LAB_TESTS / lab / f"{name}.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(f"{name}_{lab}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _answers(lab: str, table: str) -> dict[str, list[tuple[str, str]]]:
    ours, red = (getattr(lab_file(lab, name), table, {}) for name in ANSWER_FILES)
    merged = {exercise: list(answers) for exercise, answers in ours.items()}
    for exercise, answers in red.items():
        merged.setdefault(exercise, []).extend((f"red team: {description}", source) for description, source in answers)
    return merged


def wrong_answers(lab: str) -> dict[str, list[tuple[str, str]]]:
    """exercise -> [(the mistake, its source)]: each must lose points (tests/labs/<lab>/answers.py, then redteam.py)."""
    return _answers(lab, "WRONG_ANSWERS")


def replays_solution_runs(lab: str) -> bool:
    """Whether the lab's wrong answers are judged first with the solution's torchrun results replayed
    (``REPLAY_SOLUTION_RUNS = True`` in tests/labs/<lab>/answers.py; see ``LiveLab.try_wrong_answer``)."""
    return bool(getattr(lab_file(lab, "answers"), "REPLAY_SOLUTION_RUNS", False))


def correct_variants(lab: str) -> dict[str, list[tuple[str, str]]]:
    """exercise -> [(how it differs, its source)]: correct answers written differently, which must keep
    full marks (``CORRECT_VARIANTS`` beside the wrong answers, ours then the red team's; optional)."""
    return _answers(lab, "CORRECT_VARIANTS")


_MARKERS = re.compile(r"^[ \t]*### (BEGIN|END) SOLUTION[ \t]*(\n|$)", re.MULTILINE)


class SolutionCells:
    """A lab's solution cells as answers: ``source(grade_id)`` is the cell without the solution markers, and
    ``changed(grade_id, (old, new), ...)`` is that cell with one mistake put in. It checks that each text it
    replaces is there, so a change to the solution cannot silently turn a wrong answer into the right one.

        _cells = SolutionCells("06_ddp_from_scratch")
        WRONG_ANSWERS = {"assign_buckets": [("returns the buckets last first",
                         _cells.changed("assign_buckets", ("    return buckets\\n", "    return buckets[::-1]\\n")))]}
    """

    def __init__(self, lab: str):
        self.lab = lab
        self.nb = read(lab)

    def source(self, grade_id: str) -> str:
        for cell in self.nb.cells:
            if nbg(cell).get("grade_id") == grade_id:
                return _MARKERS.sub("", cell.source)
        raise KeyError(f"{self.lab} has no cell with grade_id {grade_id!r}")

    def changed(self, grade_id: str, *replacements: tuple[str, str]) -> str:
        source = self.source(grade_id)
        for old, new in replacements:
            assert old in source, f"{self.lab} {grade_id}: the solution no longer contains {old!r}"
            source = source.replace(old, new)
        return source


GRADING_READ = re.compile(r"^GRADING\s*=.*NBGRADER_EXECUTION", re.M)


def cell_errors(cell) -> list[str]:
    return [f"{o.get('ename')}: {o.get('evalue')}" for o in cell.get("outputs", []) if o.output_type == "error"]


@dataclass
class WrongAnswerResult:
    exercise: str
    description: str
    failed_tests: dict[str, str]     # test grade_id -> error line
    points_lost: float
    points_possible: float
    replayed: bool = False           # judged with the solution's torchrun results replayed (no torchrun start)


def _statements(source: str) -> list[ast.stmt]:
    """A cell's top-level statements, IPython magics and shell lines left out ([] when it is not Python)."""
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
    try:
        return ast.parse(code).body
    except SyntaxError:
        return []


def _stored_and_loaded(statement: ast.stmt) -> tuple[set[str], set[str]]:
    names = [n for n in ast.walk(statement) if isinstance(n, ast.Name)]
    return ({n.id for n in names if isinstance(n.ctx, ast.Store)}, {n.id for n in names if isinstance(n.ctx, ast.Load)})


def size_dependent_cells(nb) -> list[int]:
    """Indices of the code cells to re-run when NBGRADER_EXECUTION changes: the cells that assign a value computed
    from GRADING, or from a value so computed, transitively (``STEPS = 6 if GRADING else 12``; then a baseline
    trained for STEPS steps). A statement that reads such a name makes the names it assigns size-dependent;
    function and class definitions do not (they read GRADING when called). Exercise answers and graded checks
    are left out: the wrong-answer checks re-run those themselves."""
    tainted = {"GRADING"}
    rerun = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or nbg(cell).get("solution") or nbg(cell).get("grade"):
            continue
        assigns = GRADING_READ.search(cell.source) is not None
        for statement in _statements(cell.source):
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)):
                continue
            stored, loaded = _stored_and_loaded(statement)
            if stored and loaded & tainted:
                tainted |= stored
                assigns = True
        if assigns:
            rerun.append(i)
    return rerun


class LabRaised(AssertionError):
    """A cell of the solution raised while the notebook ran top to bottom: which cell, and its error."""


GRADING_SWITCH = 'import os\nos.environ["NBGRADER_EXECUTION"] = "autograde"'

# Installed in the live kernel of a lab that opts in (``replays_solution_runs``): ``launch.run`` wrapped so that the
# solution's own runs are recorded by their call (step, options, launcher keywords) while the solution runs top to
# bottom, and can be replayed afterwards instead of a torchrun start. A call not recorded raises ``Unrecorded``
# (a BaseException, so no cell's ``except Exception`` swallows it).
RUN_REPLAY = r'''
import json as _replay_json
from lablib.jobs import launch as _replay_launch


class _SolutionRuns:
    class Unrecorded(BaseException):
        """A torchrun start the solution did not make: the answer is judged on real ranks instead."""

    def __init__(self, run):
        self.run, self.results, self.mode = run, {}, "record"   # mode: record, replay or pass (run, keep nothing)

    def __call__(self, step, options=None, **launcher):
        key = _replay_json.dumps([step, options, launcher], sort_keys=True, default=repr)
        if self.mode == "replay":
            if key not in self.results:
                raise self.Unrecorded(f"launch.run({step!r}, ...) was not made by the solution")
            return self.results[key]
        result = self.run(step, options, **launcher)
        if self.mode == "record":
            self.results[key] = result
        return result


_replay_launch.run = _SolutionRuns(_replay_launch.run)
'''


class LiveLab:
    """The solution notebook executed in a kernel that stays up, to re-run single cells afterwards.

    ``run_all`` executes it top to bottom at the sizes a student runs (NBGRADER_EXECUTION unset), stopping at the
    first cell that raises; ``use_grading_sizes`` then sets NBGRADER_EXECUTION in the kernel and re-runs the cells
    that read it into GRADING, so the checks re-run afterwards (wrong answers, correct variants) run at the sizes
    nbgrader grades with. One execution serves both: the student's sizes once, the grading sizes for each check.
    """

    def __init__(self, lab: str, workdir: Path, cell_timeout_s: float = 600, env: dict[str, str] | None = None):
        self.lab = lab
        self.env = env or {}
        self.workdir = workdir
        shutil.copytree(SOLUTIONS / lab, workdir, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__", "*_impl.py"))
        self.nb = read(lab)
        self.client = NotebookClient(self.nb, timeout=cell_timeout_s, kernel_name="python3", allow_errors=True,
                                     resources={"metadata": {"path": str(workdir)}})

    def __enter__(self):
        env = {k: v for k, v in os.environ.items() if k != "NBGRADER_EXECUTION"}
        self._ctx = self.client.setup_kernel(env={**env, **self.env, "LABLIB_HEADLESS": "1"})
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)

    def in_kernel(self, code: str) -> list[str]:
        """Run ``code`` in the kernel (not a cell of the notebook); its errors."""
        first = self.nb.cells[0]
        try:   # nbclient stores an executed cell at its index: keep the notebook's own cell there
            return cell_errors(self.client.execute_cell(nbformat.v4.new_code_cell(code), 0))
        finally:
            self.nb.cells[0] = first

    def replay_mode(self, mode: str) -> None:
        """RUN_REPLAY's mode: "record" (from ``record_solution_runs`` to the end of ``run_all``), "replay" or "pass"."""
        errors = self.in_kernel(f"from lablib.jobs import launch as _replay_launch\n_replay_launch.run.mode = {mode!r}")
        if errors:
            raise LabRaised(f"{self.lab}: cannot set the replay of the solution's runs to {mode!r}: {errors}")

    def record_solution_runs(self) -> None:
        """Before ``run_all``: record the solution's torchrun results by their call (RUN_REPLAY)."""
        errors = self.in_kernel(RUN_REPLAY)
        if errors:
            raise LabRaised(f"{self.lab}: cannot record the solution's runs: {errors}")

    def run_cell(self, index: int, source: str | None = None):
        """Execute the notebook's cell ``index`` (with ``source`` instead of its own, when given) and return the
        executed copy. The notebook keeps its own cell: nbclient stores the cell it executed at its index
        (nbclient/client.py:1064), so a wrong answer run here would otherwise become the cell that "put the correct
        answer back" re-runs."""
        original = self.nb.cells[index]
        cell = copy.deepcopy(original)
        if source is not None:
            cell.source = source
        cell.outputs = []
        try:
            return self.client.execute_cell(cell, index)
        finally:
            self.nb.cells[index] = original

    def run_all(self) -> nbformat.NotebookNode:
        """Execute every code cell in order and return the executed notebook (outputs included); raise
        ``LabRaised`` at the first cell with an error output, naming the cell and its error."""
        executed = copy.deepcopy(self.nb)
        for i, cell in enumerate(self.nb.cells):
            if cell.cell_type == "code":
                done = self.run_cell(i)
                executed.cells[i] = done
                if cell_errors(done):
                    head = "\n".join(cell.source.splitlines()[:3])
                    raise LabRaised(f"{self.lab}: code cell {i} raised at the sizes a student runs "
                                    f"(NBGRADER_EXECUTION unset): {cell_errors(done)}\n--- the cell begins:\n{head}")
        return executed

    def use_grading_sizes(self) -> list[int]:
        """Switch the live kernel to nbgrader's sizes: NBGRADER_EXECUTION set, then every cell re-run whose result
        depends on it (``size_dependent_cells``: the cell that sets GRADING, and each later cell that reads a name
        one of them assigned, e.g. a baseline trained for STEPS steps), so that the checks re-run afterwards compare
        with what nbgrader's run compares with. Returns the indices of the cells re-run."""
        errors = self.in_kernel(GRADING_SWITCH)
        rerun = size_dependent_cells(self.nb)
        if errors or not rerun:
            raise LabRaised(f"{self.lab}: cannot switch to grading sizes ({errors or 'no cell sets GRADING'})")
        for i in rerun:
            errors = cell_errors(self.run_cell(i))
            if errors:
                raise LabRaised(f"{self.lab}: code cell {i}, re-run at grading sizes, raised: {errors}")
        return rerun



    def try_wrong_answer(self, exercise: str, description: str, source: str,
                         stop_at_first_failure: bool = True, replay_first: bool = False) -> WrongAnswerResult:
        """Run ``source`` as the exercise's answer, then its test cells in order; put the answer back.

        A wrong answer only has to lose points, so by default the test cells stop at the first one that
        fails (``points_lost`` is then a lower bound): most test cells of the multi-rank labs start torchrun.
        A correct variant runs every cell (it must pass them all).

        ``replay_first`` (a wrong answer of a lab that opts in, ``replays_solution_runs``): the test cells run first
        with every torchrun start answered by the solution's own result for the same call (``record_solution_runs``).
        Those results pass every check on them, so a test cell that fails then fails on what the answer does in this
        process (its rehearsal on thread ranks), which grading runs too, before and beside the same checks: a test
        cell that reads an earlier cell's run (lab 07's mixed-precision cell reads exercise 3's) is judged without
        that earlier torchrun start. When nothing fails so, or a call the solution did not make is reached, the
        answer is judged again with real runs, as without replay.
        """
        tests = test_cells(self.nb, exercise)
        replayed = replay_first and self.judge_with_solution_runs(exercise, source, stop_at_first_failure)
        failed = replayed or self._judge(exercises(self.nb)[exercise], source, tests, stop_at_first_failure)
        return WrongAnswerResult(exercise, description, failed, sum(tests[g][1] for g in failed),
                                 sum(p for _, p in tests.values()), replayed=bool(replayed))

    def judge_with_solution_runs(self, exercise: str, source: str, stop_at_first_failure: bool = True) -> dict[str, str]:
        """The failed test cells of ``source`` with every torchrun start replayed from the solution's runs ({} when
        none failed or a run the solution did not make was reached); no torchrun start."""
        self.replay_mode("replay")
        try:
            return self._judge(exercises(self.nb)[exercise], source, test_cells(self.nb, exercise),
                               stop_at_first_failure, replaying=True)
        finally:
            self.replay_mode("pass")

    def _judge(self, ex_index: int, source: str, tests: dict, stop_at_first_failure: bool,
               replaying: bool = False) -> dict[str, str]:
        """Run ``source`` as the answer, then the test cells in order; put the answer back. Returns
        {test grade_id: its last error line}; replaying, {} as soon as a run the solution did not make is reached."""
        self.run_cell(ex_index, source.strip("\n"))
        failed = {}
        for grade_id, (index, _) in tests.items():
            errors = cell_errors(self.run_cell(index))
            if replaying and errors and errors[-1].startswith("Unrecorded"):
                failed = {}
                break
            if errors:
                failed[grade_id] = errors[-1][:300]
                if stop_at_first_failure:
                    break
        self.run_cell(ex_index)  # put the correct answer back for the next exercise
        return failed


def load_factor() -> float:
    """How many times slower than idle this machine runs now: the 1-minute load per core, at least 1. A test
    whose timeout must cover a real start-up (torch imports, torchrun, a kernel) scales it by this."""
    return max(1.0, os.getloadavg()[0] / len(os.sched_getaffinity(0)))


def scaled_timeout(idle_s: float) -> float:
    """A timeout measured as enough on an idle machine, stretched by the load now (never flaky under load)."""
    return round(idle_s * load_factor())


# Autograding one notebook may take at most this long on the idle 2-core CI machine, stretched by the load (the solution's
# own budget is 180 s at full size; under nbgrader sizes shrink).
AUTOGRADE_LIMIT_S = 300


def worker_env() -> dict[str, str]:
    """The environment of a lab's kernels and torchrun steps when the suite runs on several pytest-xdist workers: each
    worker's share of the cores (lablib.jobs.launch.available_cores reads LABLIB_CORES; parallel grading does the
    same), so two labs checked side by side never oversubscribe the machine. Empty on one worker."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        return {}
    share = str(max(1, len(os.sched_getaffinity(0)) // workers))
    return {"LABLIB_CORES": share, "OMP_NUM_THREADS": share, "MKL_NUM_THREADS": share}


@dataclass
class LabGrading:
    layout: object   # instructor.course.CourseLayout
    results: list


def autograde(lab: str, work: Path) -> LabGrading:
    """nbgrader autogrades the lab's solution and its unmodified release in a course of its own under ``work`` (each its
    own process: nbgrader and its kernel), one after the other, each within AUTOGRADE_LIMIT_S stretched by the load."""
    from instructor import course

    submissions = {"solution": SOLUTIONS / lab / f"{lab}.ipynb", "release": LABS / lab / f"{lab}.ipynb"}
    layout = course.CourseLayout.isolated(work / lab / "course", lab)
    results = course.grade(lab, submissions, layout, per_student_timeout_s=scaled_timeout(AUTOGRADE_LIMIT_S),
                           feedback=True, env=worker_env())
    return LabGrading(layout, results)


# The solution notebooks executed by tests/test_labs.py::test_wrong_answers_lose_points in this run, at a student's
# sizes, one file per lab (<lab>.ipynb, or <lab>.failed when the test failed before one existed): tests/test_book.py
# builds the book from these files. The controller of the run empties the folder when the run starts (conftest.py).
EXECUTIONS = REPO / "test-artifacts" / "executions"


def record_execution(lab: str, executed: Path | None, why: str = "") -> None:
    """Leave the lab's executed notebook (or why there is none) in EXECUTIONS, whole: written beside, then renamed."""
    EXECUTIONS.mkdir(parents=True, exist_ok=True)
    partial = EXECUTIONS / f".{lab}.partial"
    if executed is None:
        partial.write_text(why or "no execution")
        os.replace(partial, EXECUTIONS / f"{lab}.failed")
    else:
        shutil.copy(executed, partial)
        os.replace(partial, EXECUTIONS / f"{lab}.ipynb")


def wait_for_executions(labs: list[str], limit_s: float) -> dict[str, Path | str]:
    """lab -> its executed notebook (a Path) or why there is none (a str), for each of ``labs``, waiting up to limit_s
    for those whose test is still running on another worker (the book's test runs last in its worker's queue, after
    every lab that worker was given; a lab given to the other worker may still be running)."""
    deadline = time.monotonic() + limit_s
    found: dict[str, Path | str] = {}
    while True:
        for lab in labs:
            if lab in found:
                continue
            if (EXECUTIONS / f"{lab}.ipynb").is_file():
                found[lab] = EXECUTIONS / f"{lab}.ipynb"
            elif (EXECUTIONS / f"{lab}.failed").is_file():
                found[lab] = (EXECUTIONS / f"{lab}.failed").read_text()
        if len(found) == len(labs) or time.monotonic() > deadline:
            return found
        time.sleep(2)


def live_check(lab: str, workdir: Path, env: dict[str, str] | None = None) -> dict:
    """tests/test_labs.py::test_wrong_answers_lose_points's work for one lab, in a LiveLab under ``workdir``: the
    solution top to bottom at a student's sizes (the executed notebook is written to workdir/<lab>.ipynb), the
    switch to nbgrader's sizes, then every wrong answer and correct variant. Returns a JSON-ready dict: ``times``
    (seconds per phase), ``report`` (one line per answer), ``missed`` (wrong answers that lost nothing),
    ``punished`` (correct variants that lost points), ``executed`` (the notebook's path, None when the solution
    raised) and ``raised`` (the LabRaised message, or None)."""
    result = {"times": {}, "report": [], "missed": [], "punished": [], "executed": None, "raised": None}
    times, report = result["times"], result["report"]
    t0 = time.perf_counter()
    try:
        replay = replays_solution_runs(lab)
        with LiveLab(lab, workdir, env=env) as live:
            if replay:
                live.record_solution_runs()
            executed = live.run_all()
            if replay:
                live.replay_mode("pass")
            times["interactive run"] = time.perf_counter() - t0
            result["executed"] = str(workdir / f"{lab}.ipynb")
            nbformat.write(executed, result["executed"])
            t1 = time.perf_counter()
            rerun = live.use_grading_sizes()
            times["re-run at grading sizes"] = time.perf_counter() - t1
            report.append(f"switched to nbgrader's sizes: re-ran code cells {rerun} in "
                          f"{times['re-run at grading sizes']:.0f} s")
            t1 = time.perf_counter()
            for exercise, answers in wrong_answers(lab).items():
                for description, source in answers:
                    t2 = time.perf_counter()
                    r = live.try_wrong_answer(exercise, description, source, replay_first=replay)
                    report.append(f"{exercise}: '{description}' lost at least {r.points_lost:g}/{r.points_possible:g} "
                                  f"({', '.join(r.failed_tests) or 'no test failed'}"
                                  f"{', the solution runs replayed' if r.replayed else ''}; {time.perf_counter() - t2:.1f} s)")
                    if r.points_lost == 0:
                        result["missed"].append(report[-1])
            for exercise, variants in correct_variants(lab).items():
                for description, source in variants:
                    t2 = time.perf_counter()
                    r = live.try_wrong_answer(exercise, description, source, stop_at_first_failure=False)
                    report.append(f"{exercise}: correct variant '{description}' lost "
                                  f"{r.points_lost:g}/{r.points_possible:g} ({time.perf_counter() - t2:.1f} s)")
                    if r.points_lost:
                        result["punished"].append(f"{report[-1]} ({r.failed_tests})")
                    if replay:   # the replay must never fail a right answer either (seconds: no torchrun start)
                        failed = live.judge_with_solution_runs(exercise, source, stop_at_first_failure=False)
                        if failed:
                            result["punished"].append(f"{exercise}: correct variant '{description}' fails with the "
                                                      f"solution's runs replayed: {failed}")
            times["wrong-answer checks"] = time.perf_counter() - t1
    except LabRaised as e:
        result["raised"] = str(e)
    return result


# A lab's live check takes at most this long on the idle 2-core CI machine (lab 00, the dearest, took 209 s at a load
# of about 2), stretched by the load when it starts: the labs tier's time limit per test (conftest.py).
LIVE_CHECK_LIMIT_S = 600
