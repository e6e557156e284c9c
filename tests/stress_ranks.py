"""Stress benchmark: run multi-rank lab steps many times, several at once (a loaded machine), and count how
each run ended. Not part of the suite (minutes of CPU); run it by hand after touching how ranks start or end:

    .venv/bin/python tests/stress_ranks.py --runs 60 --parallel 3 hello:3 grad_accum:3

Each STEP:NPROC is launched ``--runs`` times through ``lablib.jobs.launch.run``. Outcomes: ok, killed (a rank
died by a signal, e.g. the SIGABRT of a gloo worker meeting interpreter finalization), error, timeout.
Steps that import the student's exercise module get the solution's, extracted from solutions/.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import labkit  # noqa: E402
from lablib.jobs import launch  # noqa: E402

# step -> (lab, exercise grade_id whose %%writefile cell writes the module, options for a small run)
EXERCISE_MODULES = {
    "grad_accum": ("01_gradient_accumulation", "accumulation_step",
                   {"accum_steps": 3, "steps": 2, "micro_batch_size": 8, "d_hidden": 128}),
}


def write_solution_module(step: str, folder: Path) -> dict:
    lab, grade_id, options = EXERCISE_MODULES[step]
    nb = labkit.read(lab)
    cell = nb.cells[labkit.exercises(nb)[grade_id]]
    first, _, body = cell.source.partition("\n")
    name = first.split()[-1]
    body = "\n".join(line for line in body.splitlines() if "### BEGIN SOLUTION" not in line and "### END SOLUTION" not in line)
    (folder / name).write_text(body + "\n")
    return {"impl": str(folder / name), **options}


def one_run(step: str, nproc: int, options: dict) -> str:
    try:
        launch.run(step, {**options}, nproc=nproc, timeout_s=240, quiet=True, show_progress=False)
        return "ok"
    except launch.RankKilledError as exc:
        return f"killed ({exc.signal})"
    except launch.RunTimeout:
        return "timeout"
    except launch.RunError as exc:
        return f"error ({str(exc).splitlines()[0][:80]})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("steps", nargs="+", help="STEP:NPROC, e.g. grad_accum:3")
    parser.add_argument("--runs", type=int, default=40, help="runs per step")
    parser.add_argument("--parallel", type=int, default=3, help="runs at once")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lablib-stress-"))
    os.chdir(work)
    jobs = []
    for spec in args.steps:
        step, _, nproc = spec.partition(":")
        options = write_solution_module(step, work) if step in EXERCISE_MODULES else {}
        jobs += [(step, int(nproc or 2), options)] * args.runs
    t0 = time.perf_counter()
    counts = collections.defaultdict(collections.Counter)
    with ThreadPoolExecutor(args.parallel) as pool:
        for (step, nproc, _), outcome in zip(jobs, pool.map(lambda job: one_run(*job), jobs)):
            counts[f"{step} x{nproc}"][outcome] += 1
    print(f"{len(jobs)} runs, {args.parallel} at once, {time.perf_counter() - t0:.0f} s, load average "
          f"{os.getloadavg()[0]:.1f}")
    for key, outcomes in counts.items():
        print(f"  {key:20s} " + ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items())))


if __name__ == "__main__":
    main()
