"""The launcher's failure paths: every one ends in a clear exception, quickly, with no process left behind."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

import labkit
from ownjobs import own_jobs  # noqa: F401 - every test here checks and cleans up its own jobs

from lablib.jobs import job, launch, processes
from lablib.jobs.config import ConfigError


def test_success_streams_rank0_and_returns_json(capsys):
    result = launch.run("hello", nproc=2, timeout_s=120)
    assert result["metrics"]["all_reduce_sum"] == 3
    assert result["config"] == {"fail_rank": -1, "hang_rank": -1, "hang_s": 3600.0, "abort_rank": -1,
                                "fail_attempts": 0, "rounds": 0, "round_s": 0.2}
    # The ranks' collectives time out a little before the run does: one clock, derived from timeout_s.
    assert result["metrics"]["rank_timeout_s"] == pytest.approx(0.9 * 120)
    out = capsys.readouterr().out
    assert "2 rank(s) on backend gloo; all-reduce sum = 3" in out
    assert out.count("all-reduce sum") == 1, "only rank 0 prints"


def test_failing_rank_raises_with_its_traceback(own_jobs):
    t0 = time.monotonic()
    with pytest.raises(launch.RunError) as info:
        launch.run("hello", {"fail_rank": 1}, nproc=2, timeout_s=120, quiet=True)
    assert info.value.rank == 1
    assert "rank 1 failed on purpose (fail_rank=1)" in str(info.value)
    assert "Traceback" in info.value.details
    assert time.monotonic() - t0 < 60
    assert not own_jobs.remaining()


def test_rank_killed_by_a_signal_is_reported_as_such(own_jobs):
    """A rank that dies by SIGABRT after its work (as gloo's teardown race did) is not the code's error."""
    with pytest.raises(launch.RankKilledError) as info:
        launch.run("hello", {"abort_rank": 1}, nproc=2, timeout_s=120, quiet=True)
    assert info.value.rank == 1 and info.value.signal == "SIGABRT"
    assert "not by an exception" in str(info.value) and "infrastructure" in str(info.value)
    assert not own_jobs.remaining()


def test_max_restarts_restarts_the_group_after_a_failed_attempt(own_jobs):
    """launch.run(max_restarts=1): rank 1 fails on attempt 0 only; torchrun restarts both ranks, attempt 1
    initialises a fresh group (distenv.attempt_store) and finishes. Without restarts the same run fails."""
    result = launch.run("hello", {"fail_rank": 1, "fail_attempts": 1}, nproc=2, timeout_s=150, quiet=True,
                        max_restarts=1)
    assert result["metrics"]["attempt"] == 1 and result["metrics"]["all_reduce_sum"] == 3.0
    with pytest.raises(launch.RunError):
        launch.run("hello", {"fail_rank": 1, "fail_attempts": 1}, nproc=2, timeout_s=150, quiet=True)
    with pytest.raises(ValueError, match="max_restarts"):
        launch.run("hello", nproc=2, max_restarts=-1)
    assert not own_jobs.remaining()


def test_a_restarted_run_reports_the_last_attempts_error(own_jobs):
    """max_restarts=1 and rank 1 fails on both attempts, with a different error each time (A on attempt 0, B on
    attempt 1): the launcher reports B, the error of the attempt that ended the run, and mentions A. (Lab 10:
    a student's traceback on attempt 1 must not be hidden behind the peer error of the deliberate kill before.)"""
    with pytest.raises(launch.RunError) as info:
        launch.run("hello", {"fail_rank": 1}, nproc=2, timeout_s=150, quiet=True, max_restarts=1)
    assert info.value.rank == 1
    assert "rank 1 failed on purpose (fail_rank=1) on attempt 1" in info.value.details        # B
    assert "on attempt 0" not in info.value.details
    message = str(info.value).split("\n\n")[0]
    assert "on attempt 1" in message and "attempt 0: rank 1: RuntimeError: rank 1 failed on purpose" in message  # A
    assert not own_jobs.remaining()


def _kill_rank_when(text: str, rank: int, own_jobs, on_purpose: bool):
    """A stand-in for sys.stdout (launch.run echoes rank 0's lines through it) that SIGKILLs ``rank`` of the test's
    own run (its job's record) the first time a line containing ``text`` is printed; with ``on_purpose``, after
    recording the kill in the run's folder as the course's lab 10 faults do."""
    class Stdout:
        killed = None

        def write(self, line):
            if text in line and self.killed is None:
                for p in (p for j in own_jobs for p in j.members()):
                    try:
                        env = p.environ()
                    except psutil.Error:
                        continue
                    if env.get("RANK") == str(rank):
                        if on_purpose:
                            processes.record_deliberate_kill(p.pid, "test", Path(env[processes.RUN_DIR_ENV]))
                        p.send_signal(signal.SIGKILL)
                        self.killed = p.pid
            return len(line)

        def flush(self):
            pass

    return Stdout()


@pytest.mark.parametrize("on_purpose", [False, True], ids=["out_of_memory_killer", "recorded_deliberate_kill"])
def test_a_rank_sigkilled_from_outside_is_the_machines_failure(monkeypatch, on_purpose, own_jobs):
    """Rank 1 SIGKILLed mid-job, as the out-of-memory killer does: RankKilledError naming SIGKILL, whatever rank 0
    raised after losing its peer. The same kill recorded first (record_deliberate_kill) is the course's doing,
    not the machine's: an ordinary RunError."""
    stdout = _kill_rank_when("round 3 of 200", rank=1, own_jobs=own_jobs, on_purpose=on_purpose)
    monkeypatch.setattr(sys, "stdout", stdout)
    with pytest.raises(launch.RunError) as info:
        launch.run("hello", {"rounds": 200, "round_s": 0.1}, nproc=2, timeout_s=120)
    monkeypatch.undo()
    assert stdout.killed is not None, "rank 1 was never found to be killed"
    if on_purpose:
        assert not isinstance(info.value, launch.RankKilledError), str(info.value)
    else:
        assert isinstance(info.value, launch.RankKilledError), str(info.value)
        assert info.value.rank == 1 and info.value.signal == "SIGKILL"
        assert "killed by SIGKILL" in str(info.value) and "infrastructure" in str(info.value)
    assert not own_jobs.remaining()


def test_first_failure_orders_signals_records_and_attempts(tmp_path):
    """The rules of processes.first_failure on a run folder written by hand: a SIGKILL nobody recorded comes
    before the errors its peers raised; a recorded one does not count; of the errors, the last attempt's."""
    summary = textwrap.dedent("""
        Failures:
        [1]:
          rank      : 0 (local_rank: 0)
          exitcode  : 1 (pid: 501)
        Root Cause (first observed failure):
        [0]:
          rank      : 1 (local_rank: 1)
          exitcode  : -9 (pid: 502)  (SIGKILL)
        """)
    (tmp_path / processes.TORCHRUN_LOG).write_text(summary)
    processes.error_file(tmp_path, 1, 0).write_text("10.0\nRuntimeError: A\n")
    processes.error_file(tmp_path, 0, 0).write_text("11.0\nRuntimeError: peer closed\n")
    processes.error_file(tmp_path, 0, 1).write_text("21.0\nRuntimeError: connection closed by peer\n")
    killed = processes.first_failure(tmp_path)
    assert (killed.rank, killed.signal) == (1, "SIGKILL")
    processes.record_deliberate_kill(502, "a fault the test plays", tmp_path)
    failure = processes.first_failure(tmp_path)
    assert (failure.rank, failure.signal, failure.attempt) == (0, None, 1)
    assert "connection closed by peer" in failure.details
    assert failure.earlier == ("attempt 0: rank 1: RuntimeError: A",)


def test_a_rank_gloo_aborts_for_a_collective_mismatch_is_the_codes_fault_not_the_machines(tmp_path):
    """gloo aborts (SIGABRT) a rank that receives a message larger than the collective it posted: ranks that called
    different collectives, or the same with other sizes. That is an error in the code, reported as such."""
    from lablib.jobs import outcome

    (tmp_path / processes.TORCHRUN_LOG).write_text(textwrap.dedent("""
        Root Cause (first observed failure):
        [0]:
          rank      : 1 (local_rank: 1)
          exitcode  : -6 (pid: 602)  (SIGABRT)
        """))
    processes.rank_log(tmp_path, 1).write_text(
        "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n  what():  [enforce fail at "
        "gloo/transport/tcp/pair.cc:456] op.preamble.length <= op.nbytes. 1000 vs 12. Received data size doesn't "
        "match expected size. Is there a distributed collective mismatch in your code?\nFatal Python error: Aborted\n"
        + "".join(f"  File \"x.py\", line {i} in f\n" for i in range(60)))
    error = outcome.failure_error("hello", 2, 1, tmp_path, "")
    assert not isinstance(error, launch.RankKilledError) and error.rank == 1
    assert "collectives did not match" in str(error)
    processes.rank_log(tmp_path, 1).write_text("Fatal Python error: Segmentation fault\n")
    assert isinstance(outcome.failure_error("hello", 2, 1, tmp_path, ""), launch.RankKilledError)


def test_torchrun_exit_codes_are_read_root_cause_first():
    summary = textwrap.dedent("""
        Failures:
        [1]:
          time      : 2026-11-22_15:23:49
          rank      : 0 (local_rank: 0)
          exitcode  : -15 (pid: 2116)
        ------------------------------------------------------------
        Root Cause (first observed failure):
        [0]:
          time      : 2026-11-22_15:23:49
          host      : localhost
          rank      : 2 (local_rank: 2)
          exitcode  : -6 (pid: 2117)
        """)
    assert processes.rank_exit_codes(summary) == [(2, -6, 2117), (0, -15, 2116)]


def test_step_options_and_launcher_options_never_share_a_namespace():
    # A step option passed as a keyword is refused with the call to write instead (nothing starts).
    with pytest.raises(TypeError, match=r"launch.run\('hello', \{'hang_rank': ...\}, nproc=2\)"):
        launch.run("hello", nproc=2, hang_rank=1)
    # A step option may be called like a launcher option: it goes to the step's Config, which refuses it here
    # because hello has no such option (the launcher's own timeout_s is untouched).
    with pytest.raises(ConfigError, match="timeout_s"):
        launch.run("hello", {"timeout_s": 5}, nproc=2, timeout_s=60)
    with pytest.raises(TypeError, match="mapping"):
        launch.run("hello", [("fail_rank", 1)], nproc=2)


def test_run_result_reads_by_key_and_attribute_with_integer_keys_restored():
    r = launch.RunResult({"metrics": {"by_world_size": {"1": {"t": 2.0}, "4": {"t": 0.5}}, "xs": [{"a": 1}]},
                          "step": "x"}, output="hi\n")
    assert r.metrics.by_world_size[4].t == 0.5 == r["metrics"]["by_world_size"][4]["t"]
    assert sorted(r.metrics.by_world_size) == [1, 4] and r.metrics.xs[0].a == 1 and r.output == "hi\n"
    assert r.to_dict()["metrics"]["by_world_size"][1] == {"t": 2.0}
    with pytest.raises(AttributeError, match="has no 'metric'"):
        r.metric
    with pytest.raises(TypeError):
        r["step"] = "y"                                  # read-only


HANG_SCRIPT = """
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
print(f"rank {dist.get_rank()} of {dist.get_world_size()} up", flush=True)
if dist.get_rank() == 1:
    time.sleep(600)                                     # the culprit: rank 1 never joins
t = torch.ones(3)
dist.all_reduce(t)
dist.destroy_process_group()
"""


def test_run_script_reports_a_hang_with_every_ranks_stack(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANG_SCRIPT)
    window = labkit.scaled_timeout(20)            # both ranks are up within 20 s on an idle 2-core machine
    r = launch.run_script(script, nproc=2, timeout_s=window, quiet=True)
    assert r.timed_out and r.returncode is None and window <= r.elapsed_s < 3 * window
    assert "rank 0 of 2 up" in r.output and "rank 1 of 2 up" in r.rank_output[1] and r.output == r.rank_output[0]
    assert "in all_reduce" in r.stacks[0] and "hang.py\", line 8" in r.stacks[0]      # rank 0 waits in the all-reduce
    assert "hang.py\", line 6" in r.stacks[1] and "all_reduce" not in r.stacks[1]    # rank 1 is in its sleep


def test_a_run_meant_to_hang_is_stopped_soon_after_every_rank_reaches_the_hang(tmp_path):
    """hang_after: the grace counts from the moment every rank printed the text, not from torchrun's start (so a slow
    start on a busy machine still reaches the hang, and an idle one does not wait out a long timeout)."""
    script = tmp_path / "hang.py"
    script.write_text(HANG_SCRIPT)
    cap = labkit.scaled_timeout(120)
    r = launch.run_script(script, nproc=2, timeout_s=cap, quiet=True, hang_after=(" up", 2.0))
    assert r.timed_out and r.returncode is None and r.elapsed_s < cap / 2, r.elapsed_s
    assert "rank 0 of 2 up" in r.output and "rank 1 of 2 up" in r.rank_output[1]
    assert "in all_reduce" in r.stacks[0] and "hang.py\", line 6" in r.stacks[1]
    ok = tmp_path / "ok.py"
    ok.write_text("print('done', flush=True)\n")
    r = launch.run_script(ok, nproc=2, timeout_s=cap, quiet=True, hang_after=("done", 30.0))
    assert (r.returncode, r.timed_out) == (0, False), "a run that ends by itself inside the grace is not stopped"


def test_run_script_reports_success_and_failure_without_raising(tmp_path):
    ok = tmp_path / "ok.py"
    ok.write_text("import os, sys\nprint('rank', os.environ['RANK'], sys.argv[1:])\n")
    r = launch.run_script(ok, ["--x", 3], nproc=3, timeout_s=60, quiet=True)
    assert (r.returncode, r.timed_out, r.stacks) == (0, False, {})
    assert {k: v.strip() for k, v in r.rank_output.items()} == {k: f"rank {k} ['--x', '3']" for k in range(3)}
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nif os.environ['RANK'] == '1':\n    raise ValueError('boom')\n")
    r = launch.run_script(bad, nproc=2, timeout_s=60, quiet=True)
    assert r.returncode not in (0, None) and not r.timed_out and "ValueError: boom" in r.rank_output[1]
    with pytest.raises(FileNotFoundError, match="%%writefile nope.py"):
        launch.run_script(tmp_path / "nope.py")


def test_hanging_rank_times_out_and_leaves_no_process(own_jobs):
    t0 = time.monotonic()
    with pytest.raises(launch.RunTimeout, match="ran past its timeout of 10 s"):
        launch.run("hello", {"hang_rank": 1}, nproc=2, timeout_s=10, quiet=True)
    assert time.monotonic() - t0 < 30
    assert not own_jobs.remaining(), "workers survived the timeout"


# A notebook kernel that runs a step and reports how an interrupt ended it. It handles SIGINT as ipykernel does while
# it executes a cell (signal(SIGINT, default_int_handler)): a process started in the background by a non-interactive
# shell (`cmd &`, nohup, some CI runners) inherits SIGINT *ignored*, Python then installs no handler, and an
# interrupt never reaches the launcher at all (the test then timed out with the run left behind for its 300 s).
KERNEL = textwrap.dedent("""
    import json, signal, sys
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from lablib.jobs import launch
    try:
        CALL
    except KeyboardInterrupt as exc:
        print("interrupted " + json.dumps(exc.stop.to_dict()), flush=True)
""")


def _interrupt_kernel(call: str, ready, settle_s: float = 0.0):
    """Start a kernel running ``call``; once ``ready(tree)`` is true of its processes (its own descendants: torchrun
    and the workers), SIGINT it, as "interrupt kernel" does. Returns (the kernel's stop report, seconds from the
    interrupt to the kernel's exit, the processes it had). Whatever happens, those processes are gone afterwards."""
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL.replace("CALL", call)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    tree = []
    try:
        deadline = time.monotonic() + labkit.scaled_timeout(60)
        while not ready(tree) and time.monotonic() < deadline and kernel.poll() is None:
            time.sleep(0.2)
            tree = [p for p in psutil.Process(kernel.pid).children(recursive=True)]
        assert ready(tree), f"the run never got ready: {tree}\n{kernel.stderr.read() if kernel.poll() is not None else ''}"
        time.sleep(settle_s)
        tree = [p for p in psutil.Process(kernel.pid).children(recursive=True)]
        t0 = time.monotonic()
        os.killpg(kernel.pid, signal.SIGINT)          # jupyter_client signals the kernel's process group
        out, err = kernel.communicate(timeout=2 * job.GRACE_S + job.KILL_WAIT_S + 30)
        exit_s = time.monotonic() - t0
        line = [x for x in out.splitlines() if x.startswith("interrupted ")]
        assert line, f"the kernel did not report an interrupt:\n{out}\n{err[-3000:]}"
        return json.loads(line[0][len("interrupted "):]), exit_s, tree
    finally:
        if kernel.poll() is None:
            kernel.kill()
            kernel.wait()
        for p in tree:                                  # the test's own job, whatever went wrong
            try:
                if p.is_running():
                    p.kill()
            except psutil.Error:
                pass


def _alive(tree):
    alive = []
    for p in tree:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p.pid)
        except psutil.Error:
            pass
    return alive


def test_keyboard_interrupt_kills_every_worker():
    """Ctrl-C while rank 1 waits in its all-reduce and rank 0 sleeps: every process of the run is gone when
    launch.run raises, and the KeyboardInterrupt says what stopping took."""
    stop, exit_s, tree = _interrupt_kernel(
        'launch.run("hello", {"hang_rank": 0}, nproc=2, timeout_s=300, quiet=True)',
        ready=lambda tree: len(tree) >= 3, settle_s=1.0)                  # torchrun and its 2 workers
    assert not _alive(tree), "processes of the run survived Ctrl-C"
    assert {p.pid for p in tree} <= set(stop["pids"]), "the launcher's record missed a process of its job"
    assert stop["why"] == "interrupted" and stop["sent"][0][0] == "SIGINT" and not stop["left"]
    assert stop["elapsed_s"] <= 2 * job.GRACE_S + job.KILL_WAIT_S + 2.0


ROBUST_RANK = """
import os, signal, sys, time
from pathlib import Path
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
Path(sys.argv[1], "ready" + os.environ["RANK"]).touch()
time.sleep(600)
"""


def test_an_interrupt_stops_ranks_that_ignore_sigint_and_sigterm_with_sigkill(tmp_path):
    """Ranks that ignore SIGINT and SIGTERM: the launcher's escalation reaches SIGKILL on its own clock (SIGINT, then
    SIGTERM GRACE_S later, then SIGKILL GRACE_S after that), every process is gone, and the report says SIGKILL was
    needed."""
    script = tmp_path / "robust.py"
    script.write_text(ROBUST_RANK)
    stop, exit_s, tree = _interrupt_kernel(
        f"launch.run_script({str(script)!r}, [{str(tmp_path)!r}], nproc=2, timeout_s=300, quiet=True)",
        ready=lambda tree: len(list(tmp_path.glob("ready*"))) == 2)
    assert not _alive(tree), "processes of the run survived the interrupt"
    assert [name for name, _, _ in stop["sent"]] == ["SIGINT", "SIGTERM", "SIGKILL"] and stop["needed"] == "SIGKILL"
    # SIGKILL goes out 2 x GRACE_S after SIGINT, plus at most the last look at the job's processes (a scan of the
    # process table, under a second even on a loaded machine); the kernel removes SIGKILLed processes at once.
    assert 2 * job.GRACE_S <= stop["sent"][2][1] <= 2 * job.GRACE_S + 1.0, stop
    assert not stop["left"] and stop["elapsed_s"] <= 2 * job.GRACE_S + job.KILL_WAIT_S, stop
    assert exit_s <= 2 * job.GRACE_S + job.KILL_WAIT_S + 5.0, exit_s


def test_port_in_use_is_refused_clearly():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(launch.PortInUseError, match=f"port {port} on 127.0.0.1 is already in use"):
            launch.run("hello", nproc=2, port=port, quiet=True)


def test_explicit_free_port_works():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert launch.run("hello", nproc=2, port=port, timeout_s=120, quiet=True)["metrics"]["all_reduce_sum"] == 3


def test_two_runs_at_once_do_not_collide():
    results, errors = [], []

    def one():
        try:
            results.append(launch.run("hello", nproc=2, timeout_s=180, quiet=True))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 2
    assert all(r["metrics"]["all_reduce_sum"] == 3 for r in results)


def test_unknown_option_and_bad_world_size_fail_before_starting():
    launch.load_step("hello")                          # importing torch is not what is timed (18 s at load 28)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="unknown option.*fial_rank"):
        launch.run("hello", {"fial_rank": 1}, nproc=2)
    with pytest.raises(ValueError, match="fail_rank=2 does not exist with 2 ranks"):
        launch.run("hello", {"fail_rank": 2}, nproc=2)
    with pytest.raises(ValueError, match="nproc must be a positive integer"):
        launch.run("hello", nproc=0)
    with pytest.raises(ValueError, match="unknown step 'helo'; available steps: .*hello"):
        launch.run("helo")
    assert time.monotonic() - t0 < 5, "validation must not start torchrun"


def test_every_step_name_is_one_run_script_in_a_lab_package_or_the_shared_folder():
    """launch finds a step in lablib/labs/<lab>/run.py (named like the package), lablib/labs/<lab>/run_<step>.py, or
    lablib/runs/<step>.py; a name claimed twice is refused (_step_files raises), so each name runs one file."""
    root = Path(launch.__file__).parent.parent.parent
    steps = launch.available_steps()
    assert "hello" in steps and "context_parallel" in steps
    for step in steps:
        module = launch.step_module(step)
        assert (root / Path(*module.split("."))).with_suffix(".py").is_file(), (step, module)
        assert module.startswith(("lablib.labs.", "lablib.runs.")), module


def test_a_released_stub_is_refused_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "accum_impl.py").write_text(
        "def accumulation_step(model, optimizer, micro_batches, loss_fn):\n    \"\"\"Doc.\"\"\"\n"
        "    raise NotImplementedError()\n")
    launch.load_step("grad_accum")                     # importing torch is not what is timed
    t0 = time.monotonic()
    with pytest.raises(launch.ExerciseNotWrittenError, match="accumulation_step in accum_impl.py still raises "
                                                             "NotImplementedError: write the exercise cell"):
        launch.run("grad_accum", {"steps": 2}, nproc=2, timeout_s=120, quiet=True)
    assert time.monotonic() - t0 < 5, "a stub is found before torchrun starts"


def test_only_nbgraders_bare_stub_is_unwritten(tmp_path):
    # A student's own NotImplementedError with a message (an abstract helper, a refused case) is written code:
    # refusing to start would cost a correct answer its points.
    from lablib.jobs import exercise

    path = tmp_path / "buckets_impl.py"
    path.write_text("def stub(x):\n    \"\"\"Doc.\"\"\"\n    # YOUR CODE HERE\n    raise NotImplementedError()\n\n\n"
                    "def bare(x):\n    raise NotImplementedError\n\n\n"
                    "class Base:\n    def hook(self, param):\n        raise NotImplementedError('subclasses say when')\n\n\n"
                    "def refuse(x):\n    raise NotImplementedError(f'{x} ranks: not supported')\n")
    assert exercise.unwritten(path) == ["stub", "bare"]


def test_a_not_implemented_error_on_the_ranks_gets_a_hint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "accum_impl.py").write_text(
        "def accumulation_step(model, optimizer, micro_batches, loss_fn):\n    K = len(micro_batches)\n"
        "    raise NotImplementedError(f'{K} micro-batches: not yet')\n")
    with pytest.raises(launch.RunError, match="still raises NotImplementedError") as info:
        launch.run("grad_accum", {"steps": 2}, nproc=2, timeout_s=120, quiet=True)
    assert "NotImplementedError" in info.value.details


def test_missing_exercise_module_names_the_cell_to_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    launch.load_step("grad_accum")                     # importing torch is not what is timed
    t0 = time.monotonic()
    with pytest.raises(FileNotFoundError, match="Run the exercise cell that starts with %%writefile nope_impl.py first"):
        launch.run("grad_accum", {"impl": "nope_impl.py"}, nproc=2, timeout_s=120, quiet=True)
    assert time.monotonic() - t0 < 5, "a missing module is found before torchrun starts"


def test_threads_are_split_between_ranks(monkeypatch):
    monkeypatch.delenv(launch.CORES_VARIABLE, raising=False)
    assert launch.default_threads_per_rank(1) == len(os.sched_getaffinity(0))
    assert launch.default_threads_per_rank(10 * os.cpu_count()) == 1
    monkeypatch.setenv(launch.CORES_VARIABLE, "6")     # a grading job's share of the machine
    assert launch.default_threads_per_rank(2) == 3 and launch.default_threads_per_rank(4) == 1
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(launch.CORES_VARIABLE, bad)
        with pytest.raises(ValueError, match="whole number of cores"):
            launch.default_threads_per_rank(2)
    monkeypatch.delenv(launch.CORES_VARIABLE)
    result = launch.run("hello", nproc=2, threads_per_rank=1, timeout_s=120, quiet=True)
    assert {r["threads_per_rank"] for r in result["metrics"]["ranks"]} == {1}


def test_exit_codes_read_only_the_summary_records():
    """torchrun's agent logs 'failed (exitcode: 1) local_rank: 0 (pid: ...)' before its summary; a match starting
    there paired rank 0 with rank 1's SIGABRT, and a rank that died by a signal was reported as the wrong rank."""
    log = ("I1125 api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 3378) of binary: /venv/bin/python\n"
           "Failures:\n[1]:\n  time      : 2026-11-25_01:00:22\n  host      : localhost\n"
           "  rank      : 1 (local_rank: 1)\n  exitcode  : -6 (pid: 3379)  (SIGABRT)\n  error_file: <N/A>\n"
           "------------------------------------------------------------\nRoot Cause (first observed failure):\n[0]:\n"
           "  time      : 2026-11-25_01:00:22\n  host      : localhost\n  rank      : 0 (local_rank: 0)\n"
           "  exitcode  : 1 (pid: 3378) \n")
    assert processes.rank_exit_codes(log) == [(0, 1, 3378), (1, -6, 3379)]
