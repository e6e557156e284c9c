"""Wrong answers for lab 10 (tests/labkit.py: the lab's answer files): the solution's own cells, one mistake each. The
red team's (a reviewer who had read only the released notebook) come from ``redteam_10_fault_tolerance.py`` beside
this file and are added to each list."""

from __future__ import annotations


from labkit import SolutionCells


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

WRONG_ANSWERS = {
    "app_state": [
        # Caught in this process at world size 1 (seconds, no torchrun start). Where the red team's answer makes
        # the same mistake (the sampler, Python's random, the schedule or the step not restored; the optimizer
        # built before the model is sharded), the course's own is left out; numpy's generator once (not restored).
        ("the random generators are saved but not restored", _changed("app_state", (_RESTORE_RNG, ""))),
        # Caught only on a GPU, or by the check that the GPU's state is there (instructor/hidden_kinds.py: a CPU run
        # shows the answer a GPU whose generator state is a marker): dropout on a GPU draws from the CUDA generators.
        ("the GPU's generators are not saved: a CPU run cannot tell, a resumed GPU run draws other dropout masks",
         _changed("app_state", ('               "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}',
                                '               }'),
                  ('            if rng["cuda"] and torch.cuda.is_available():\n                torch.cuda.set_rng_state_all(rng["cuda"])\n',
                   ""))),
        ("the GPU's generators are saved but never restored", _changed(
            "app_state", ('            if rng["cuda"] and torch.cuda.is_available():\n                torch.cuda.set_rng_state_all(rng["cuda"])\n',
                          ""))),
        ("numpy's generator is not restored: the token noise differs", _changed(
            "app_state", ('            np.random.set_state(rng["numpy"])\n', ""))),
        # Caught only by the reshard (2 ranks saved, 1 rank resumes): exact at the same world size
        ("model and optimizer in per-rank torch.save files beside DCP's checkpoint: exact at 2 ranks, not resharded",
         _changed("app_state",
                  ('        return {"model": model_state, "optimizer": optimizer_state,',
                   '        return {'),
                  ('        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],\n'
                   '                       optim_state_dict=state["optimizer"])\n', ''),
                  ('        dcp.load({"app": state}, checkpoint_id=checkpoint)   # every rank reads its own shards\n',
                   '        dcp.load({"app": state}, checkpoint_id=checkpoint)   # every rank reads its own shards\n'
                   '        r = torch.distributed.get_rank()\n'
                   '        model_state, optimizer_state = torch.load(f"{checkpoint}/rank{r}.pt", weights_only=False)\n'
                   '        set_state_dict(state.model, state.optimizer, model_state_dict=model_state,\n'
                   '                       optim_state_dict=optimizer_state)\n'),
                  ('    dcp.save({"app": state}, checkpoint_id=checkpoint)\n',
                   '    dcp.save({"app": state}, checkpoint_id=checkpoint)\n'
                   '    r = torch.distributed.get_rank()\n'
                   '    torch.save(get_state_dict(state.model, state.optimizer), f"{checkpoint}/rank{r}.pt")\n'))),
        # Caught only on 2 real ranks: the red team's "save only on rank 0" (below)
    ],
    "young_daly": [   # the red team's cover sqrt(C M), a whole interval per failure and the restart left out
        ("the job's MTBF is one component's MTBF", _changed(
            "young_daly", ("    return component_mtbf_s / n_components\n", "    return component_mtbf_s\n"))),
        ("Daly's interval without its '- C'", _changed(
            "young_daly", ("    return math.sqrt(2.0 * checkpoint_s * mtbf_s)\n",
                           "    r = checkpoint_s / (2.0 * mtbf_s)\n"
                           "    return math.sqrt(2.0 * checkpoint_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9)\n"))),
    ],
}

CORRECT_VARIANTS = {
    "young_daly": [
        ("Daly's higher-order interval instead of Young's", _changed(
            "young_daly", ("    return math.sqrt(2.0 * checkpoint_s * mtbf_s)\n",
                           "    if checkpoint_s >= 2.0 * mtbf_s:\n"
                           "        return mtbf_s\n"
                           "    r = checkpoint_s / (2.0 * mtbf_s)\n"
                           "    return math.sqrt(2.0 * checkpoint_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - checkpoint_s\n"))),
    ],
}

