"""How many students an hour launchers/grade gets through, one at a time and side by side (not a test).

    .venv/bin/python -m instructor.grading_benchmark 01 03 --copies 2 --jobs 2

For each lab: a class of K copies of the solution, the release and one submission per wrong answer of
tests/labs/<lab>/ (tests/labkit.py reads them; one per exercise, its first; none with --no-wrong-answers), graded
with --jobs 1 and with --jobs N in fresh courses; prints seconds, students/hour, the ratio, and the load average
before and after (the figures mean little on a machine that is busy with other work: say what the load was).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lablib.jobs.launch import available_cores

REPO = Path(__file__).resolve().parent.parent


def _class(lab: str, copies: int, into: Path, wrong_answers: bool = True) -> int:
    import nbformat

    solution = nbformat.read(REPO / "solutions" / lab / f"{lab}.ipynb", as_version=4)
    notebooks = {f"solution{i}": solution for i in range(copies)}
    notebooks["release"] = nbformat.read(REPO / "labs" / lab / f"{lab}.ipynb", as_version=4)
    if wrong_answers:
        sys.path.insert(0, str(REPO / "tests"))
        import labkit   # the tests' loader of a lab's answer files (tests/labs/<lab>/answers.py and redteam.py)

        for exercise, answers in sorted(labkit.wrong_answers(lab).items()):
            nb = nbformat.from_dict(solution)
            for cell in nb.cells:
                if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == exercise:
                    cell.source = answers[0][1]
            notebooks[f"wrong-{exercise}".replace("_", "-")] = nb
    for student, nb in notebooks.items():
        (into / student).mkdir(parents=True)
        nbformat.write(nb, into / student / f"{lab}.ipynb")
    return len(notebooks)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("labs", nargs="+")
    parser.add_argument("--copies", type=int, default=2, help="copies of the solution in the class (default 2)")
    parser.add_argument("--jobs", type=int, default=available_cores(), help="the side-by-side run (default: cores)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--no-wrong-answers", action="store_true",
                        help="a class of the solution's copies and the release only (every submission runs the whole lab)")
    args = parser.parse_args(argv)
    from instructor.course import find_lab

    print(f"{available_cores()} cores; load average before: {os.getloadavg()[0]:.1f}")
    for lab in map(find_lab, args.labs):
        with tempfile.TemporaryDirectory(prefix=f"grading-benchmark-{lab[:2]}-") as tmp:
            n = _class(lab, args.copies, Path(tmp) / "class", wrong_answers=not args.no_wrong_answers)
            rates = {}
            for jobs in (1, args.jobs):
                load0 = os.getloadavg()[0]
                t0 = time.perf_counter()
                run = subprocess.run(["bash", str(REPO / "launchers" / "grade"), lab, str(Path(tmp) / "class"),
                                      "--out", str(Path(tmp) / f"out{jobs}"), "--jobs", str(jobs),
                                      "--timeout", str(args.timeout), "--force"], capture_output=True, text=True)
                seconds = time.perf_counter() - t0
                if run.returncode != 0:
                    raise SystemExit(f"grading {lab} with --jobs {jobs} failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
                rates[jobs] = n * 3600 / seconds
                print(f"{lab} --jobs {jobs}: {n} students in {seconds:.0f} s = {rates[jobs]:.0f} students/hour"
                      f" ({seconds / n:.0f} s per student; load average {load0:.1f} -> {os.getloadavg()[0]:.1f})",
                      flush=True)
            print(f"{lab}: --jobs {args.jobs} / --jobs 1 = {rates[args.jobs] / rates[1]:.2f}x", flush=True)


if __name__ == "__main__":
    main()
