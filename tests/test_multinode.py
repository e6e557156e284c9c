"""Multi-node launch, for real on one machine: two torchrun agents on 127.0.0.1 that form one job of 4 ranks
(launchers/multinode, the command each node runs), a node that dies in an elastic job (lablib.jobs.multinode.run_nodes),
and launchers/slurm.sbatch submitted to a real Slurm cluster of two nodes (slurmctld, two slurmd, munge, all
started here from Debian's packages, on ports of their own).

The Slurm test needs root and the packages slurmctld, slurmd, slurm-client and munge (.ci/run installs them and
sets LABS_REQUIRE_SLURM=1, which turns a missing Slurm into a failure; elsewhere it is skipped, saying what to
install).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from ownjobs import own_jobs  # noqa: F401 - every test here checks and cleans up its own jobs

from lablib.jobs import job, launch, multinode

REPO = Path(__file__).resolve().parents[1]


def _ranks(result):
    return sorted((r["node"], r["rank"]) for r in result["metrics"]["ranks"])


def test_two_agents_on_loopback_form_one_job_of_four_ranks(tmp_path, own_jobs):
    """The command a cluster runs on each node, run twice here: 2 nodes x 2 processes = world 4, running lab 00's
    step (every collective on 4 ranks, before and after), one result."""
    port = multinode.free_port()
    out = tmp_path / "collectives.json"
    cmd = [str(REPO / "launchers" / "multinode"), "collectives", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "test-job", "--out", str(out), "--",
           "--world_sizes", "4"]
    logs = [tmp_path / f"agent{i}.txt" for i in range(2)]

    def agent(i):
        with open(logs[i], "w") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    agents = [agent(0)]
    time.sleep(1.0)   # the first agent hosts the rendezvous store
    agents.append(agent(1))
    jobs = [job.Job(a) for a in agents]     # this test's own record of each node's processes (own_jobs checks them)
    deadline = time.monotonic() + 180
    while any(a.poll() is None for a in agents) and time.monotonic() < deadline:
        for j in jobs:
            j.observe()
        time.sleep(0.5)
    outputs = [log.read_text() for log in logs]
    assert [a.poll() for a in agents] == [0, 0], outputs
    picture = json.loads(out.read_text())["metrics"]["pictures"]["4"]
    assert picture["world_size"] == 4
    all_reduce, all_gather = picture["collectives"]["all_reduce"], picture["collectives"]["all_gather"]
    total = [sum(column) for column in zip(*all_reduce["before"])]
    assert all_reduce["after"] == [total] * 4                       # every rank of both nodes took part
    assert all_gather["after"] == [sum(all_gather["before"], [])] * 4
    assert all(calls[0]["world_size"] == 4 for calls in all_reduce["calls"])
    assert all("--rdzv-endpoint=127.0.0.1" in o for o in outputs)   # each node printed the command it ran
    assert not own_jobs.remaining()


def test_the_node_command_checks_its_arguments_before_starting_anything():
    run = [sys.executable, "-m", "lablib.jobs.multinode"]
    ok = subprocess.run(run + ["hello", "--nnodes", "1:2", "--nproc-per-node", "4", "--rdzv-endpoint",
                               "node001:29500", "--rdzv-id", "7", "--dry-run", "--", "--rounds", "3"],
                        capture_output=True, text=True, cwd=REPO, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert ("--nnodes=1:2 --nproc-per-node=4 --rdzv-backend=c10d --rdzv-endpoint=node001:29500 --rdzv-id=7"
            in ok.stderr)
    assert "-m lablib.runs.hello --out results/hello-7.json" in ok.stderr and "--rounds 3" in ok.stderr
    for args, message in [(["--nnodes", "2:1"], "--nnodes must be N or MIN:MAX"),
                          (["--nnodes", "2", "--rdzv-endpoint", "node001"], "--rdzv-endpoint must be HOST:PORT"),
                          (["--nnodes", "2", "--", "--roundz", "3"], "unknown option(s) roundz"),
                          (["--nnodes", "2", "--nproc-per-node", "0"], "--nproc-per-node must be")]:
        argv = ["hello", "--nproc-per-node", "2", "--rdzv-endpoint", "node001:29500", *args]
        bad = subprocess.run(run + argv, capture_output=True, text=True, cwd=REPO, timeout=60)
        assert bad.returncode == 2 and message in bad.stderr, (args, bad.stderr)
    unknown = subprocess.run(run + ["no_such_step", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint",
                                    "h:1"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert unknown.returncode == 2 and "unknown step 'no_such_step'" in unknown.stderr
    no_module = subprocess.run(run + ["fault_tolerance", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint",
                                      "h:1", "--", "--impl", "nowhere/ft_impl.py", "--ckpt_dir", "ckpt"],
                               capture_output=True, text=True, cwd=REPO, timeout=60)
    assert no_module.returncode == 2 and "exercise module nowhere/ft_impl.py does not exist" in no_module.stderr
    impl = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
    impl.write("class AppState: pass\ndef start(*a): pass\ndef save(*a): pass\n")
    impl.close()
    # a global batch of 8 on 1..3 nodes of 1: world size 3 does not divide it, refused before torchrun starts
    uneven = subprocess.run(run + ["fault_tolerance", "--nnodes", "1:3", "--nproc-per-node", "1", "--rdzv-endpoint",
                                   "h:1", "--dry-run", "--", "--impl", impl.name, "--ckpt_dir", "ckpt"],
                            capture_output=True, text=True, cwd=REPO, timeout=60)
    assert uneven.returncode == 2 and "world size 3" in uneven.stderr and "torch.distributed.run" not in uneven.stderr
    os.unlink(impl.name)


def test_run_nodes_refuses_a_leave_the_job_cannot_survive():
    with pytest.raises(ValueError, match="agent 0 hosts the rendezvous store"):
        multinode.run_nodes("hello", nodes=2, min_nodes=1, max_restarts=1, leave=(0, "round"))
    with pytest.raises(ValueError, match="cannot go on without it"):
        multinode.run_nodes("hello", nodes=2, leave=(1, "round"))
    with pytest.raises(ValueError, match="min_nodes=3 is more than nodes=2"):
        multinode.run_nodes("hello", nodes=2, min_nodes=3)
    with pytest.raises(ValueError, match="must start without it"):
        multinode.run_nodes("hello", nodes=2, join=(1, "round"))


def test_a_node_that_joins_a_running_job_makes_it_larger(own_jobs):
    """nnodes 1:2, node 1 started only once node 0's job runs: both agents restart their workers in a job of
    world size 4 (a membership change: no restart is used up). Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    (multinode.AGENT_ENV) torch 2.13's agents wait on each other's rendezvous keys instead."""
    result = multinode.run_nodes("hello", {"rounds": 60, "round_s": 0.25}, nodes=2, nproc_per_node=2, min_nodes=1,
                                 join=(1, "round 3 of 60, world size 2"), timeout_s=240, quiet=True)
    assert [a["returncode"] for a in result.agents] == [0, 0]
    assert _ranks(result) == [(0, 0), (0, 1), (1, 2), (1, 3)]
    assert result["metrics"]["attempt"] == 0 and result["metrics"]["all_reduce_sum"] == 10.0
    out = result.agents[0]["output"]
    assert "round 3 of 60, world size 2" in out and "round 60 of 60, world size 4" in out
    assert "round 60 of 60, world size 2" not in out
    print(f"[multinode] node 1 started at {result.joined_s:.1f} s; job done at {result.elapsed_s:.1f} s")
    assert not own_jobs.remaining()


def test_an_elastic_job_goes_on_without_the_node_that_died(own_jobs):
    """nnodes 1:2: node 1 (agent and workers) is SIGKILLed mid-job; node 0's workers fail in their collective,
    its agent restarts them, the rendezvous drops the dead node, and the job finishes at world size 2."""
    t0 = time.monotonic()
    result = multinode.run_nodes("hello", {"rounds": 25, "round_s": 0.2}, nodes=2, nproc_per_node=2, min_nodes=1,
                                 max_restarts=1, leave=(1, "round 3 of 25, world size 4"), timeout_s=240,
                                 quiet=True)
    elapsed = time.monotonic() - t0
    assert [(a["returncode"], a["left"]) for a in result.agents] == [(0, False), (-signal.SIGKILL, True)]
    assert result["metrics"]["attempt"] == 1                   # the second attempt finished the job
    assert _ranks(result) == [(0, 0), (0, 1)]                  # on node 0 alone
    assert result["metrics"]["all_reduce_sum"] == 3.0
    out = result.agents[0]["output"]
    assert "round 3 of 25, world size 4" in out and "round 25 of 25, world size 2" in out
    assert result.left_s is not None and result.left_s < result.elapsed_s <= elapsed
    print(f"[multinode] node 1 killed at {result.left_s:.1f} s; job done at {result.elapsed_s:.1f} s")
    assert not own_jobs.remaining()


def test_a_job_of_two_nodes_that_hangs_is_stopped_at_its_timeout(own_jobs):
    """Rank 0 never joins the all-reduce: at timeout_s every process of both agents is stopped (the same supervisor
    as launch.run's), and RunTimeout says so."""
    t0 = time.monotonic()
    with pytest.raises(launch.RunTimeout, match="ran past its timeout of 12 s; every process of every node"):
        multinode.run_nodes("hello", {"hang_rank": 0}, nodes=2, nproc_per_node=1, timeout_s=12, quiet=True)
    assert time.monotonic() - t0 < 40
    assert not own_jobs.remaining()


# --- a real Slurm cluster of two nodes on this machine ------------------------------------------------------

SLURM_PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol")
SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"])


def _free_ports(n):
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture
def slurm_cluster():
    missing = [p for p in SLURM_PROGRAMS if shutil.which(p, path=SBIN_PATH) is None]
    problem = (f"Slurm programs missing: {', '.join(missing)} (apt-get install slurmctld slurmd slurm-client munge)"
               if missing else "" if os.geteuid() == 0 else "the Slurm daemons need root")
    if problem:
        if os.environ.get("LABS_REQUIRE_SLURM") == "1":
            pytest.fail(f"LABS_REQUIRE_SLURM=1 but {problem}")
        pytest.skip(problem)
    folder = Path(tempfile.mkdtemp(prefix="slurm-"))
    for sub in ("state", "spool", "log"):
        (folder / sub).mkdir()
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    host = socket.gethostname().split(".")[0]
    ctld_port, node1_port, node2_port = _free_ports(3)
    conf = folder / "slurm.conf"
    conf.write_text(f"""\
ClusterName=labs
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={folder}/munge.socket
CryptoType=crypto/munge
SlurmctldPort={ctld_port}
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/log/slurmctld.log
SlurmdLogFile={folder}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
NodeName=node[1-2] NodeHostname={host} NodeAddr=127.0.0.1 Port=[{node1_port},{node2_port}] CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
""")
    env = {**os.environ, "SLURM_CONF": str(conf), "PATH": SBIN_PATH}
    daemons = []

    def start(*cmd):
        daemons.append(subprocess.Popen(list(cmd), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                        start_new_session=True))

    try:
        start("munged", "-F", "-f", f"--key-file={key}", f"--socket={folder}/munge.socket",
              f"--pid-file={folder}/munged.pid", f"--log-file={folder}/log/munged.log",
              f"--seed-file={folder}/munge.seed")
        deadline = time.monotonic() + 20
        while not (folder / "munge.socket").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        start("slurmctld", "-D", "-i")
        time.sleep(1.0)
        start("slurmd", "-D", "-N", "node1")
        start("slurmd", "-D", "-N", "node2")
        deadline = time.monotonic() + 60
        states = ""
        while time.monotonic() < deadline:
            states = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env, capture_output=True,
                                    text=True).stdout
            if states.count("idle") == 2:
                break
            time.sleep(0.5)
        else:
            logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted((folder / "log").iterdir()))
            pytest.fail(f"the Slurm cluster did not come up in 60 s (sinfo: {states!r})\n{logs}")
        yield env, folder
    finally:
        for d in reversed(daemons):
            if d.poll() is None:
                os.killpg(d.pid, signal.SIGTERM)
        for d in daemons:
            try:
                d.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(d.pid, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)


def test_the_slurm_batch_script_runs_a_step_on_two_nodes(slurm_cluster):
    """sbatch --nodes 2 launchers/slurm.sbatch hello: srun starts one agent on each Slurm node, they meet on the
    first node's address, and the step runs with 2 nodes x 2 processes."""
    env, folder = slurm_cluster
    results = folder / "results"
    env = {**env, "LABS_NPROC_PER_NODE": "2", "LABS_RDZV_PORT": str(multinode.free_port()),
           "LABS_RESULTS": str(results)}
    submit = subprocess.run(["sbatch", "--parsable", "--nodes", "2", f"--output={folder}/job-%j.out",
                             str(REPO / "launchers" / "slurm.sbatch"), "hello", "--rounds", "2"],
                            env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert submit.returncode == 0, submit.stdout + submit.stderr
    job = submit.stdout.strip().split(";")[0]
    # (sbatch --wait would do, but it polls the job's state ever more slowly: about 40 s for a 10 s job)
    deadline, state = time.monotonic() + 240, ""
    while time.monotonic() < deadline:
        state = subprocess.run(["scontrol", "show", "job", job, "-o"], env=env, capture_output=True,
                               text=True).stdout
        if any(f"JobState={s}" in state for s in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")):
            break
        time.sleep(0.3)
    job_out = "\n".join(p.read_text() for p in folder.glob("job-*.out"))
    assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state, state + job_out
    [result_file] = results.glob("hello-*.json")
    result = json.loads(result_file.read_text())
    assert result["metrics"]["all_reduce_sum"] == 10.0
    assert _ranks(result) == [(0, 0), (0, 1), (1, 2), (1, 3)]
    slurm_nodes = {node: {r["slurm_node"] for r in result["metrics"]["ranks"] if r["node"] == node} for node in (0, 1)}
    assert sorted(slurm_nodes[0] | slurm_nodes[1]) == ["node1", "node2"], slurm_nodes   # one Slurm node each
    assert len(slurm_nodes[0]) == len(slurm_nodes[1]) == 1, slurm_nodes
    assert "2 node(s) x 2 process(es), rendezvous on node1 (127.0.0.1)" in job_out
    # The job's own processes (Slurm's daemons detach them, so they are no descendants of this test): each rank and
    # its torchrun agent reported their pids; none of them may outlive the job.
    ours = {pid for r in result["metrics"]["ranks"] for pid in (r["pid"], r["agent_pid"])}
    left = []
    for pid in ours:
        try:
            if psutil.Process(pid).environ().get("SLURM_CONF") == env["SLURM_CONF"]:
                left.append(pid)
        except psutil.Error:
            pass
    assert not left, f"processes of the Slurm job outlived it: {left}"
