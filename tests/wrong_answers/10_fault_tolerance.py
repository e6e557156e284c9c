"""Wrong answers for lab 10 (see tests/wrong_answers/__init__.py): the solution's own cells, one mistake each."""

from __future__ import annotations

from wrong_answers import SolutionCells

LAB = "10_fault_tolerance"
_cells = SolutionCells(LAB)
_changed = _cells.changed

_RESTORE_RNG = '''        rng = this_rank(state["rng"])
        if rng is not None:                      # None: saved at another world size, keep this process's seeds
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
            if rng["cuda"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
'''
_START = '''    model = shard(model)                         # first the parallel layout: the parameters are now its own
    optimizer = make_optimizer(model.parameters())
    state = AppState(model, optimizer, make_scheduler(optimizer), sampler)
    if checkpoint is not None:
        dcp.load({"app": state}, checkpoint_id=checkpoint)   # every rank reads its own shards
'''

WRONG_ANSWERS = {
    "app_state": [
        # Caught in this process at world size 1 (seconds, no torchrun start):
        ("the sampler's position is not restored: the epoch's first batches are seen twice", _changed(
            "app_state", ('        self.sampler.load_state_dict(state["sampler"])\n', ""))),
        ("the random generators are saved but not restored", _changed("app_state", (_RESTORE_RNG, ""))),
        ("Python's random is not restored (torch's is): the windows' shifts differ", _changed(
            "app_state", ('            random.setstate(rng["python"])\n', ""))),
        ("the learning-rate schedule is not restored: warm-up starts again", _changed(
            "app_state", ('        self.scheduler.load_state_dict(state["scheduler"])\n', ""))),
        ("the step counter is not restored: the run trains from step 1 again", _changed(
            "app_state", ('        self.step = state["step"]\n', ""))),
        ("loads before the model is sharded: the optimizer is built on (and loaded into) the plain parameters",
         _changed("app_state", (_START, '''    optimizer = make_optimizer(model.parameters())
    state = AppState(model, optimizer, make_scheduler(optimizer), sampler)
    if checkpoint is not None:
        dcp.load({"app": state}, checkpoint_id=checkpoint)
    state.model = shard(model)
'''))),
        # Caught only on 2 real ranks (one torchrun start each):
        ("saves on rank 0 only (as with torch.save): DCP's save is a collective, the other rank's shards are never written",
         _changed("app_state", ('    dcp.save({"app": state}, checkpoint_id=checkpoint)\n',
                                '    if torch.distributed.get_rank() == 0:\n'
                                '        dcp.save({"app": state}, checkpoint_id=checkpoint)\n'))),
    ],
    "young_daly": [
        ("the factor 2 is missing: sqrt(C M)", _changed(
            "young_daly", ("math.sqrt(2.0 * checkpoint_s * mtbf_s)", "math.sqrt(checkpoint_s * mtbf_s)"))),
        ("the job's MTBF is one component's MTBF", _changed(
            "young_daly", ("    return component_mtbf_s / n_components\n", "    return component_mtbf_s\n"))),
        ("a failure loses the whole interval, not half of it on average", _changed(
            "young_daly", ("(interval_s / 2.0 + restart_s) / mtbf_s", "(interval_s + restart_s) / mtbf_s"))),
        ("the restart cost is left out of the overhead", _changed(
            "young_daly", ("(interval_s / 2.0 + restart_s) / mtbf_s", "(interval_s / 2.0) / mtbf_s"))),
    ],
    "per_rank_answer": [
        ("the sampler's position", _changed("per_rank_answer", ('"c"', '"b"'))),
    ],
}

_RNG_PER_KEY = _changed(
    "app_state",
    ('                "rng": per_rank(rng)}            # each rank\'s own generators, gathered: DCP keeps one copy per key\n',
     '                f"rng_rank{torch.distributed.get_rank()}": rng}   # one key per rank\n'),
    ('        rng = this_rank(state["rng"])\n', '        rng = state[f"rng_rank{torch.distributed.get_rank()}"]\n'))

CORRECT_VARIANTS = {
    "app_state": [
        ("each rank's generators under a key of its own instead of per_rank (fine at a fixed world size)", _RNG_PER_KEY),
    ],
}
