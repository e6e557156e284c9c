"""The skeleton every run script shares (``lablib/labs/<lab>/run*.py``, ``lablib/runs/hello.py``).

A run script is thin: it declares a config dataclass and a ``run(env, config) -> dict`` function (what every
rank does; it trains, measures or checks), and its ``main()`` is ``script.main(Config, run)``. This module
does the rest, the same way every time:

- parses ``--out PATH`` plus the config's options strictly (unknown or mistyped options are errors);
- initialises the process group with a timeout and always destroys it (``distenv.distributed``);
- under the launcher sends everything but rank 0's stdout to per-rank log files, so only rank 0 talks
  to the notebook, and leaves any rank's traceback for the launcher (the contract: ``lablib.jobs.processes``);
- has rank 0 write one JSON file: step, config, environment, metrics, elapsed time;
- under torchrun, ends the rank with ``processes.end_rank`` (exit code 0, or 1 after a traceback), never
  through the interpreter's finalization, where gloo's worker threads can abort a finished rank.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

from lablib.jobs import config as cfg
from lablib.jobs import distenv, processes


def progress(env: distenv.DistEnv, step: int, total: int, **metrics: float) -> None:
    """Report training progress; the launcher draws it as a progress bar (rank 0 only)."""
    if env.is_main:
        print(processes.PROGRESS_PREFIX + json.dumps({"step": step, "total": total, **metrics}), flush=True)


def jsonable(value):
    """Tensors, numpy numbers, tuples and dataclasses to plain JSON values (NaN/inf as strings)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def case_dicts(cases_json: str) -> list[dict]:
    """A ``cases_json`` option (the hidden tests' drawn cases, handed to a run script as text): a JSON list of case
    dicts, each with a "name"; "" is none. Each lab's probe checks the dicts' other keys."""
    cases = json.loads(cases_json) if cases_json else []
    if not isinstance(cases, list) or not all(isinstance(c, dict) and "name" in c for c in cases):
        raise ValueError(f"cases_json={cases_json!r} must be a JSON list of case dicts, each with a 'name'")
    return cases


def _split_out(argv: list[str]) -> tuple[str | None, list[str]]:
    out, rest, i = None, [], 0
    while i < len(argv):
        if argv[i] == "--out":
            if i + 1 >= len(argv):
                raise cfg.ConfigError("--out needs a file path")
            out = argv[i + 1]
            i += 2
        elif argv[i].startswith("--out="):
            out = argv[i].split("=", 1)[1]
            i += 1
        else:
            rest.append(argv[i])
            i += 1
    return out, rest


def _redirect_to_file(path: Path, stdout: bool) -> None:
    """Point stderr (and stdout if asked) at path, at the file-descriptor level so C++ output follows."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    if stdout:
        os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main(config_cls, run: Callable, argv: list[str] | None = None) -> None:
    """Run ``run`` as a rank of a torchrun job (or as a plain single process). See the module docstring."""
    if not processes.is_torchrun_worker():
        _run(config_cls, run, argv)
        return
    try:
        _run(config_cls, run, argv)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            processes.end_rank(exc.code or 0)
        print(exc.code, file=sys.stderr)
        processes.end_rank(1)
    except BaseException:  # noqa: BLE001 - printed here, and the exit code tells torchrun the rank failed
        traceback.print_exc()
        processes.end_rank(1)
    processes.end_rank(0)


def _run(config_cls, run: Callable, argv: list[str] | None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    run_dir = processes.run_dir()
    rank = int(os.environ.get("RANK", "0"))
    if run_dir:
        # Rank 0's stdout stays live for the notebook; everything else goes to per-rank logs.
        _redirect_to_file(processes.rank_log(run_dir, rank), stdout=rank != 0)
    t0 = time.perf_counter()
    try:
        out, rest = _split_out(argv)
        config = cfg.from_argv(config_cls, rest)
        with distenv.distributed() as env:
            try:
                if hasattr(config, "validate_world"):
                    config.validate_world(env.world_size)
                metrics = run(env, config)
            except BaseException as exc:
                # Recorded before the process group is torn down: tearing it down makes the other ranks
                # fail too, and the launcher reports the earliest failure as the root cause.
                processes.record_error(rank, exc)
                raise
            if env.is_main and out:
                record = {
                    "step": config_cls.__module__.rsplit(".", 1)[-1],
                    "config": dataclasses.asdict(config),
                    "env": env.describe(),
                    "elapsed_s": time.perf_counter() - t0,
                    "metrics": metrics,
                }
                Path(out).parent.mkdir(parents=True, exist_ok=True)
                tmp = Path(out).with_suffix(".tmp")
                tmp.write_text(json.dumps(jsonable(record), indent=1))
                tmp.replace(out)  # atomic: the launcher never reads half a file
    except BaseException as exc:  # noqa: BLE001 - record, then re-raise
        processes.record_error(rank, exc)
        raise


class _WithoutProgress:
    """A stdout that passes every line but the launcher's progress events (a run in this process has no
    launcher to draw them)."""

    def __init__(self, out):
        self.out, self.pending = out, ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if not line.startswith(processes.PROGRESS_PREFIX):
                self.out.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.out.flush()


def run_in_this_process(step, options: dict, threads: int = 1) -> dict:
    """A run script's ``run`` in this process: world size 1, no torchrun (a single-process baseline from a
    notebook, without a process start). ``step`` is the run module itself (``from lablib.labs.gpt_migration import
    run``), so this library never imports a run script. The same ``run`` every torchrun rank calls,
    the options checked against the same ``Config``, ``threads`` CPU threads like every rank of the lab's
    runs. Returns what a run records: {"config", "env", "metrics"}."""
    import contextlib

    import torch

    config = cfg.from_options(step.Config, dict(options))
    env = distenv.from_env()
    if hasattr(config, "validate_world"):
        config.validate_world(env.world_size)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with contextlib.redirect_stdout(_WithoutProgress(sys.stdout)):
            metrics = step.run(env, config)
        described = env.describe()
    finally:
        torch.set_num_threads(before)
    return jsonable({"config": dataclasses.asdict(config), "env": described, "metrics": metrics})
