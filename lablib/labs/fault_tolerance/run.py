"""Lab 10's step: a training run that checkpoints, is killed (or hangs), and resumes, with the students' AppState.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 -m lablib.labs.fault_tolerance.run \\
        --impl ft_impl.py --ckpt-dir /tmp/ckpt --faults kill:1@5 --reference true --out out.json

Every attempt (torchrun restarts the whole group after a rank fails; ``TORCHELASTIC_RESTART_COUNT`` numbers them)
runs ``checkpoint_run.train``: the students' ``start`` restores the latest complete checkpoint in
``ckpt_dir`` (or ``resume_from`` on the first attempt), the loop trains to ``steps`` and calls the students' ``save``
every ``ckpt_every`` steps, rank 0 prints "checkpoint saved at step N" after each, and fault i of ``faults``
(``kill:RANK@STEP``, ``hang:RANK@STEP``, or ``savekill:RANK@STEP``: killed in the middle of that step's save) is
played on attempt i. With ``reference``, attempt 0 first trains the
same run uninterrupted with lablib's own parts. The world size may differ between attempts (DDP: the sampler's
position is global). Everything is logged in ``ckpt_dir``; the last attempt returns the whole log.

With ``reshards`` ("fsdp2:4->2", ...; section 3) the start runs, instead, each reshard's two jobs one after the
other, its ranks regrouped into a process group of each job's size (``checkpoint_run.reshard_runs``): run it
with as many ranks as the largest job has.

A ``ckpt_dir`` that already holds a complete checkpoint is resumed from, on the first attempt too (rank 0 says so):
that is what makes a restarted job go on, and what makes a reused folder continue an old run instead of starting
a new one. Give each new run a fresh folder.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lablib.labs.fault_tolerance import checkpoint_run, checkpointing
from lablib.jobs import distenv, script
from lablib.jobs.exercise import load_module, require_file


@dataclass(frozen=True)
class Config(checkpointing.Recipe):
    impl: str = "ft_impl.py"             # the module file the notebook's exercise cell writes
    ckpt_dir: str = ""                   # checkpoints and the run's log (a fresh folder per run)
    ckpt_every: int = 2
    faults: tuple[str, ...] = ()         # fault i on attempt i: "kill:1@5" (rank 1 SIGKILLs itself after step 5)
    resume_from: str = ""                # a checkpoint folder to start from on attempt 0 (resharding)
    reference: bool = False              # attempt 0 trains the uninterrupted run first
    save_wait_s: float = 6.0             # how long a rank back from save() waits for the others
    reshards: tuple[str, ...] = ()       # "fsdp2:4->2": 4 ranks write, 2 resume (every job in this one start)

    def validate(self) -> None:
        if not self.ckpt_dir:
            raise ValueError("ckpt_dir is required: a fresh folder for this run's checkpoints and log")
        if self.steps < 1 or self.ckpt_every < 1:
            raise ValueError(f"steps={self.steps} and ckpt_every={self.ckpt_every} must be at least 1")
        for i, text in enumerate(self.faults):
            fault = checkpoint_run.Fault.parse(text, i)
            if not 1 <= fault.step <= self.steps:
                raise ValueError(f"fault {text!r}: step {fault.step} is outside 1..{self.steps}")
            if fault.kind == "savekill" and fault.step % self.ckpt_every:
                raise ValueError(f"fault {text!r}: step {fault.step} writes no checkpoint (ckpt_every={self.ckpt_every})")
        for text in self.reshards:
            checkpoint_run.parse_reshard(text)
        if self.reshards and (self.faults or self.resume_from or self.reference):
            raise ValueError("reshards runs its own jobs: give it without faults, resume_from or reference")
        require_file(self.impl)

    def validate_world(self, world_size: int) -> None:
        for text in self.faults:
            rank = checkpoint_run.Fault.parse(text, 0).rank
            if rank >= world_size:
                raise ValueError(f"fault {text!r}: rank {rank} does not exist with {world_size} ranks")
        sizes = [n for text in self.reshards for n in checkpoint_run.parse_reshard(text)[1:]] or [world_size]
        if max(sizes) != world_size:
            raise ValueError(f"reshards {self.reshards} need {max(sizes)} ranks (the largest job), not {world_size}")
        for n in sizes:
            if self.global_batch % n:
                raise ValueError(f"global_batch={self.global_batch} must be a multiple of the world size {n}")


def run(env, config: Config) -> dict:
    impl = load_module(config.impl, ("AppState", "start", "save"))
    recipe = checkpointing.Recipe(**{f.name: getattr(config, f.name) for f in dataclasses.fields(checkpointing.Recipe)})
    if config.reshards:
        return checkpoint_run.reshard_runs(impl, recipe, env, config.ckpt_dir, config.reshards,
                                           ckpt_every=config.ckpt_every)
    checkpoint_run.train(impl, recipe, env, config.ckpt_dir, ckpt_every=config.ckpt_every, faults=config.faults,
                        resume_from=config.resume_from, reference=config.reference, save_wait_s=config.save_wait_s)
    log = checkpoint_run.RunLog(config.ckpt_dir, env.rank).read()
    return {"attempt": distenv.restart_attempt(),
            "reference": [r for r in log if r["kind"] == "reference"],
            "steps": [r for r in log if r["kind"] == "step"],
            "attempts": [r for r in log if r["kind"] == "attempt"],
            "saves": [r for r in log if r["kind"] == "save"],
            "faults": checkpoint_run.faults_seen(config.ckpt_dir)}


def main() -> None:
    script.main(Config, run)


if __name__ == "__main__":
    main()
