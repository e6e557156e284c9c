"""A course step across several machines ("nodes"): the torchrun command each node runs, and a runner that
starts several nodes on this one machine to rehearse it.

On a cluster every node runs the same command; torchrun's c10d rendezvous on one node's address makes them one
job (no node ranks to hand out):

    launchers/multinode zero_stages --nnodes 2 --nproc-per-node 4 --rdzv-endpoint node001:29500 -- --steps 3
    sbatch --nodes 2 launchers/slurm.sbatch zero_stages --steps 3      # Slurm: srun starts one agent per node

``launchers/multinode`` is ``python -m lablib.jobs.multinode`` in the course environment: it checks the step's options
before anything starts (the step's own checks, and its ``validate_world`` for every world size ``--nnodes MIN:MAX``
x ``--nproc-per-node`` allows: a global batch that one of them does not divide is refused on the node, not inside
the workers), prints the torchrun command it runs (``--dry-run`` only prints it) and runs it.

``run_nodes`` starts ``nodes`` torchrun agents on 127.0.0.1, each with its own processes, as separate machines
would (the tests use it for a world of 4 = 2 nodes x 2 processes; lab 10 uses it for elastic membership).
``leave=(agent, marker)`` makes a node die when a rank prints a line containing ``marker``: that agent and all
of its workers are SIGKILLed at once, as a power cut would. With ``min_nodes`` below ``nodes`` and
``max_restarts`` >= 1 the surviving agents restart their workers in a smaller job; its rendezvous settles in a
few seconds because the agents here send a heartbeat every second and call a node dead after 3 missed ones
(torch's defaults, 5 s x 3 plus a 30 s last call, suit real clusters: ``RDZV_CONF``).

``join=(agent, marker)`` starts that agent only when a rank prints ``marker``: a node that joins a running job,
whose agents then restart their workers in a larger one.

Agent 0 hosts the rendezvous store (a TCPStore on the endpoint's port; ``is_host=true``, the others
``is_host=false``; torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py, ``_create_tcp_store``), so agent 0
cannot be the one that leaves: on a cluster, the node named in ``--rdzv-endpoint`` leaving ends the whole job. The
c10d backend is a single point of failure; a rendezvous that survives any node needs an external, replicated
store (``--rdzv-backend etcd-v2`` with an etcd cluster run apart from the job). All agents start at once and import torch side by side, the others waiting for agent
0's store: had they been started only once the store was up, a node slower to start than the round's last call
(3 s) would have begun the job without it (and then joined it, with a restart). Agent 0 is started first: the
rendezvous numbers nodes by process id, so it is node 0 and holds rank 0.

Every agent started here (and by ``launchers/multinode``) runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``. In
torch 2.13 the agents otherwise share one TCPStore for every rendezvous round, and the rank-0 agent publishes the
store's address only in the first round it leads: a node that joins a running job then waits forever (60 s, then
fails) for a key nobody writes, while the others wait for it (``dynamic_rendezvous.py``, ``next_rendezvous``).
With the variable set, each round's rank 0 publishes a fresh store: a node can join. Leaving works either way.
pytorch/pytorch#135712 ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0 is not compatible with torchelastic restarts") is the
upstream report of the shared store's failures, with this variable as its workaround.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from lablib.jobs import config as cfg
from lablib.jobs import job, launch, outcome, processes, supervisor

# torch 2.13: without this, a node that joins a running job waits forever (see the module docstring).
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
# Heartbeats every second, a node is dead after 3 missed; a round closes 3 s after its minimum size is reached.
RDZV_CONF = {"keep_alive_interval": 1, "keep_alive_max_attempt": 3, "last_call_timeout": 3}


def torchrun_command(step: str, step_argv: Sequence[str], *, nnodes: str, nproc_per_node: int, rdzv_endpoint: str,
                     rdzv_id: str, out: str, max_restarts: int = 0, rdzv_conf: Mapping | None = None,
                     python: str = sys.executable) -> list[str]:
    """The command one node runs: a torchrun agent for the step's run script (``launch.step_module``) joining the c10d rendezvous."""
    conf = ",".join(f"{k}={v}" for k, v in (rdzv_conf or {}).items())
    return [python, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}",
            *([f"--rdzv-conf={conf}"] if conf else []), f"--max-restarts={max_restarts}",
            "-m", launch.step_module(step), "--out", out, *step_argv]


def _positive(name: str, value, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return value


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NodesResult(launch.RunResult):
    """Rank 0's JSON result (as ``launch.run`` returns it), plus how each agent ended.

    agents     one dict per agent: ``returncode`` (torchrun's exit code; -9 for the one that was killed),
               ``left`` (it was made to leave), ``output`` (what its workers printed)
    left_s     seconds from the start to the moment the leaving node was killed (None if none left)
    joined_s   seconds from the start to the moment the joining node was started (None if none joined)
    elapsed_s  seconds from the start until every agent had ended
    """

    def __init__(self, data: Mapping, output: str, agents: list[dict], left_s: float | None,
                 joined_s: float | None, elapsed_s: float):
        super().__init__(data, output)
        self.agents = agents
        self.left_s = left_s
        self.joined_s = joined_s
        self.elapsed_s = elapsed_s


def run_nodes(step: str, options: Mapping | None = None, *, nodes: int = 2, nproc_per_node: int = 1,
              min_nodes: int | None = None, max_restarts: int = 0, timeout_s: float = 300.0,
              leave: tuple[int, str] | None = None, join: tuple[int, str] | None = None,
              env: Mapping | None = None, quiet: bool = False) -> NodesResult:
    """Run a step's run script (``launch.step_module``) as ``nodes`` torchrun agents on this machine (c10d rendezvous on 127.0.0.1).

    options: the step's own options (checked against its Config before anything starts), as in ``launch.run``.
    min_nodes: the smallest job that may go on (``--nnodes min_nodes:nodes``); default ``nodes``.
    leave: ``(agent, marker)``: kill that agent and its workers when any rank prints a line containing marker.
    join: ``(agent, marker)``: start that agent only when any rank prints a line containing marker.
    timeout_s covers everything; on a timeout every process of every agent is stopped and RunTimeout raised.
    """
    _positive("nodes", nodes)
    _positive("nproc_per_node", nproc_per_node)
    _positive("max_restarts", max_restarts, 0)
    min_nodes = nodes if min_nodes is None else _positive("min_nodes", min_nodes)
    if min_nodes > nodes:
        raise ValueError(f"min_nodes={min_nodes} is more than nodes={nodes}")
    launch.check_launcher_options(nproc_per_node, timeout_s)
    if leave is not None:
        if not (isinstance(leave, tuple) and len(leave) == 2 and isinstance(leave[0], int)
                and isinstance(leave[1], str) and leave[1]):
            raise TypeError(f"leave must be (agent index, marker text), e.g. (1, 'checkpoint saved'), got {leave!r}")
        if not 1 <= leave[0] < nodes:
            raise ValueError(f"leave=({leave[0]}, ...): the agent that leaves must be 1..{nodes - 1}; agent 0 hosts "
                             f"the rendezvous store, and without it no job can go on")
        if min_nodes > nodes - 1 or max_restarts < 1:
            raise ValueError(f"a node leaves but the job cannot go on without it: use min_nodes <= {nodes - 1} "
                             f"and max_restarts >= 1 (got min_nodes={min_nodes}, max_restarts={max_restarts})")
    if join is not None:
        if not (isinstance(join, tuple) and len(join) == 2 and isinstance(join[0], int)
                and isinstance(join[1], str) and join[1]):
            raise TypeError(f"join must be (agent index, marker text), e.g. (1, 'round 3'), got {join!r}")
        if not 1 <= join[0] < nodes or (leave is not None and leave[0] == join[0]):
            raise ValueError(f"join=({join[0]}, ...): the agent that joins must be 1..{nodes - 1} (agent 0 hosts the "
                             f"rendezvous store) and not the one that leaves")
        if min_nodes > nodes - 1:
            raise ValueError(f"a node joins later, so the job must start without it: use min_nodes <= {nodes - 1}")
    module = launch.load_step(step)
    config = cfg.from_options(module.Config, dict(options or {}))
    if hasattr(config, "validate_world"):
        config.validate_world(nodes * nproc_per_node)
    launch.refuse_unwritten_exercises(config)

    threads = launch.default_threads_per_rank(nodes * nproc_per_node)
    port = free_port()
    with supervisor.Supervisor(timeout_s, prefix=f"lablib-{step}-nodes-", quiet=quiet) as run:
        out = run.run_dir / "result.json"
        markers = [f"{run.run_id}-node{i}" for i in range(nodes)]

        def start(i: int) -> None:
            command = torchrun_command(step, cfg.to_argv(config), nnodes=f"{min_nodes}:{nodes}",
                                       nproc_per_node=nproc_per_node, rdzv_endpoint=f"127.0.0.1:{port}",
                                       rdzv_id=run.run_id, out=str(out), max_restarts=max_restarts,
                                       rdzv_conf={**RDZV_CONF, "is_host": "true" if i == 0 else "false"})
            env_i = launch.rank_environment(markers[i], run.run_dir, timeout_s, threads, {**AGENT_ENV, **(env or {})})
            run.start(command, env_i, marker=markers[i], key=i,
                      log=processes.TORCHRUN_LOG if i == 0 else f"torchrun-node{i}.txt")

        left_s = joined_s = None
        # all at once, agent 0 first (the lowest process id: node 0); the others wait for its store
        for i in range(nodes):
            if join is None or i != join[0]:
                start(i)
        for _, line in run.lines():
            if join is not None and joined_s is None and join[1] in line:
                joined_s = run.elapsed_s()
                start(join[0])
                if not quiet:
                    print(f"[multinode] node {join[0]} started {joined_s:.1f} s after the start, to join the job",
                          flush=True)
            if leave is not None and left_s is None and leave[1] in line:
                left_s = run.elapsed_s()
                # the agent and every worker at once, each death recorded first: the course's doing
                job.stop([run.jobs[leave[0]]], "run_nodes(leave=...): the node leaves", first=signal.SIGKILL,
                         folder=run.run_dir)
                if not quiet:
                    print(f"[multinode] node {leave[0]} was killed {left_s:.1f} s after the start "
                          f"(its agent and workers, SIGKILL)", flush=True)
        if run.timed_out:
            raise launch.RunTimeout(
                f"step {step!r} on {nodes} nodes x {nproc_per_node} ran past its timeout of {timeout_s:.0f} s; "
                f"every process of every node was stopped. Last output:\n{outcome.tail(run.output(), 15)}", None, "")
        if join is not None and joined_s is None:
            raise launch.RunError(f"no rank printed a line containing {join[1]!r}, so node {join[0]} never joined; "
                                  f"check the marker against the step's output", None, outcome.tail(run.output()))
        codes = [run.wait(i) for i in range(nodes)]
        elapsed = run.elapsed_s()
        agents = [{"returncode": c, "left": leave is not None and i == leave[0], "output": run.output(i)}
                  for i, c in enumerate(codes)]
        if leave is not None and left_s is None:
            raise launch.RunError(f"no rank printed a line containing {leave[1]!r}, so node {leave[0]} never left; "
                                  f"check the marker against the step's output", None, outcome.tail(run.output()))
        bad = [(i, c) for i, c in enumerate(codes) if c != 0 and not agents[i]["left"]]
        if bad:
            raise outcome.failure_error(step, nodes * nproc_per_node, bad[0][1], run.run_dir, run.output())
        if not out.exists():
            raise launch.RunError(f"step {step!r} finished on {nodes} nodes but wrote no result JSON", None,
                                  outcome.tail(run.output()))
        return NodesResult(json.loads(out.read_text()), run.output(), agents, left_s, joined_s, elapsed)


# --- the command line: one node's agent (launchers/multinode, launchers/slurm.sbatch) ---------------------------

def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    step_argv = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="launchers/multinode",
        description="Run a course step (lablib/labs/<lab>/run*.py, or lablib/runs/<step>.py) as one node of a multi-node torchrun job. Run the "
                    "same command on every node; step options go after --.")
    parser.add_argument("step", help="the step to run, e.g. hello, zero_stages (lablib/labs/<lab>/run.py or run_<step>.py, or lablib/runs/<step>.py)")
    parser.add_argument("--nnodes", required=True, help="how many nodes, N or MIN:MAX (elastic)")
    parser.add_argument("--nproc-per-node", type=int, required=True, help="processes on this node (its GPUs)")
    parser.add_argument("--rdzv-endpoint", required=True,
                        help="HOST:PORT of one node every node can reach (the same on every node)")
    parser.add_argument("--rdzv-id", default=os.environ.get("SLURM_JOB_ID", "labs"),
                        help="the job's name, the same on every node (default: $SLURM_JOB_ID, else 'labs')")
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("--rdzv-conf", default="", help="e.g. last_call_timeout=30,keep_alive_interval=5")
    parser.add_argument("--out", default=None, help="rank 0's JSON result (default results/<step>-<rdzv-id>.json)")
    parser.add_argument("--dry-run", action="store_true", help="print the torchrun command, run nothing")
    args = parser.parse_args(argv)
    return args, step_argv


def _check_nnodes(text: str) -> str:
    parts = text.split(":")
    if not (1 <= len(parts) <= 2 and all(p.isdigit() and int(p) >= 1 for p in parts)
            and int(parts[0]) <= int(parts[-1])):
        raise ValueError(f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return text


def _check_endpoint(text: str) -> str:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--rdzv-endpoint must be HOST:PORT (the first node's address), got {text!r}")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    args, step_argv = _parse(sys.argv[1:] if argv is None else argv)
    try:
        _check_nnodes(args.nnodes)
        _check_endpoint(args.rdzv_endpoint)
        _positive("--nproc-per-node", args.nproc_per_node)
        _positive("--max-restarts", args.max_restarts, 0)
        module = launch.load_step(args.step)
        config = cfg.from_argv(module.Config, step_argv)     # a typo fails here, on the node, before torchrun
        launch.refuse_unwritten_exercises(config)
        if hasattr(config, "validate_world"):                # every world size the job may take, before torchrun
            low, _, high = args.nnodes.partition(":")
            for nodes in range(int(low), int(high or low) + 1):
                try:
                    config.validate_world(nodes * args.nproc_per_node)
                except ValueError as e:
                    raise ValueError(f"{e}: with --nnodes {args.nnodes} and --nproc-per-node {args.nproc_per_node} "
                                     f"the job may run on {nodes} node(s), world size {nodes * args.nproc_per_node}; "
                                     f"choose sizes every world size of the job divides") from None
    except (ValueError, TypeError, OSError, cfg.ConfigError, launch.RunError, NotImplementedError) as e:
        print(f"[multinode] {e}", file=sys.stderr)
        return 2
    out = args.out or str(Path("results") / f"{args.step}-{args.rdzv_id}.json")
    conf = dict(item.split("=", 1) for item in args.rdzv_conf.split(",") if item)
    command = torchrun_command(args.step, cfg.to_argv(config), nnodes=args.nnodes,
                               nproc_per_node=args.nproc_per_node, rdzv_endpoint=args.rdzv_endpoint,
                               rdzv_id=args.rdzv_id, out=out, max_restarts=args.max_restarts, rdzv_conf=conf)
    print("[multinode] " + shlex.join(command), file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(launch.default_threads_per_rank(args.nproc_per_node)))
    for name, value in AGENT_ENV.items():
        env.setdefault(name, value)
    return subprocess.call(command, env=env)


if __name__ == "__main__":
    sys.exit(main())
