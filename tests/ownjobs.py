"""The processes a test started, from the launcher's own record of each job (``lablib.jobs.job.Job``: the process it
started, its descendants, their process groups and sessions), never from a scan of every process on the machine for a
name: another checkout's tests, or an instructor grading on the same machine, run the same steps.

    from ownjobs import own_jobs  # noqa: F401 - the fixture, for every test of the module

Every job a test starts in this process (``launch.run``, ``run_script``, ``multinode.run_nodes``, ``kill_run``) is
recorded; when the test ends, any process of those jobs still there is a failure, and is stopped (SIGKILL) so the next
test starts clean.
"""

from __future__ import annotations

import signal

import pytest

from lablib.jobs import job


class OwnJobs(list):
    def remaining(self) -> list[int]:
        """pids of the test's own jobs' processes still alive."""
        return sorted(pid for j in list(self) for pid in j.remaining())


@pytest.fixture(autouse=True)
def own_jobs(monkeypatch):
    started = OwnJobs()

    class Recorded(job.Job):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(job, "Job", Recorded)
    yield started
    left = started.remaining()
    if left:
        job.stop(list(started), "the test's cleanup", first=signal.SIGKILL)
        pytest.fail(f"processes of this test's own jobs were still running when it ended (now killed): {left}")
