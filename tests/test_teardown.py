"""Why ranks end through ``lablib.jobs.processes.end_rank`` (see its docstring), shown on the pinned torch.

A gloo worker thread that needs the GIL while the interpreter finalizes aborts the rank with "terminate
called without an active exception" (SIGABRT) after its work is done: the intermittent failure that cost
correct answers points under load. Here the late thread is made certain, so the failure is too.
"""

import os
import subprocess
import sys
from pathlib import Path


STEP = Path(__file__).parent / "steps" / "late_callback.py"


def torchrun(ending: str, marker: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "--max-restarts=0", str(STEP), "--ending", ending, "--marker", str(marker)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_worker_thread_that_needs_the_gil_at_finalization_aborts_the_rank(tmp_path):
    result = torchrun("plain", tmp_path)
    assert result.returncode != 0
    assert "terminate called without an active exception" in result.stderr
    assert "SIGABRT" in result.stderr


def test_lablib_ranks_end_cleanly_without_finalizing(tmp_path):
    result = torchrun("lablib", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "terminate called" not in result.stderr
    assert not list(tmp_path.glob("finalized*")), "the interpreter finalized: end_rank was not used"
