"""Lab 10 answers written by a reviewer who had read only the released notebook (no tests, no solution): eleven
plausible wrong answers and two correct variants for exercise 1 (one of them run: see CORRECT_VARIANTS), six and two
for exercise 2 (Young/Daly), two and one for the multiple choice. tests/labkit.py appends them to answers.py's lists. Written before the
graded reshard: the reviewer's "this_rank(...) == None not handled" passed every check then (it resumes only at the
same world size) and is caught by the reshard now."""


def _sub(src, old, new, count=1):
    assert src.count(old) >= 1, (old, src)
    return src.replace(old, new, count)


HEADER = r'''%%writefile ft_impl.py
"""Exercise 1 of lab 10: everything a resumed run needs, saved and restored with DCP (written by the notebook)."""
import random

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from lablib.labs.fault_tolerance.checkpointing import per_rank, this_rank
'''

APP = HEADER + r'''

class AppState(Stateful):
    """The state of a training run: what dcp.save writes and dcp.load restores."""

    def __init__(self, model, optimizer, scheduler, sampler):
        self.model, self.optimizer, self.scheduler, self.sampler = model, optimizer, scheduler, sampler
        self.step = 0          # optimizer steps done

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {"model": model_sd, "optim": optim_sd, "scheduler": self.scheduler.state_dict(),
                "sampler": self.sampler.state_dict(), "step": self.step, "rng": per_rank(rng)}

    def load_state_dict(self, state):
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        self.step = int(state["step"])
        rng = this_rank(state["rng"])
        if rng is not None:
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])


def start(model, shard, make_optimizer, make_scheduler, sampler, checkpoint):
    """The AppState of a run that starts now, restored from `checkpoint` (a folder) unless it is None."""
    model = shard(model)
    optimizer = make_optimizer(model.parameters())
    scheduler = make_scheduler(optimizer)
    state = AppState(model, optimizer, scheduler, sampler)
    if checkpoint is not None:
        dcp.load({"app": state}, checkpoint_id=checkpoint)
    return state


def save(state, checkpoint):
    """Write `state` as a DCP checkpoint into the folder `checkpoint` (every rank calls this)."""
    dcp.save({"app": state}, checkpoint_id=checkpoint)
'''

APP_VARIANT = r'''%%writefile ft_impl.py
"""Exercise 1 of lab 10: everything a resumed run needs, saved and restored with DCP (written by the notebook)."""
import random

import numpy as np
import torch
from torch.distributed.checkpoint import load as dcp_load, save as dcp_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from lablib.labs.fault_tolerance import checkpointing


def _rng_now():
    state = {"torch_cpu": torch.get_rng_state(), "py": random.getstate(), "np": np.random.get_state()}
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def _rng_restore(state):
    if state is None:          # written at another world size: keep this process's fresh generators
        return
    torch.set_rng_state(state["torch_cpu"])
    random.setstate(state["py"])
    np.random.set_state(state["np"])
    if torch.cuda.is_available() and "torch_cuda" in state:
        torch.cuda.set_rng_state_all(state["torch_cuda"])


class AppState(Stateful):
    """The state of a training run: what dcp.save writes and dcp.load restores."""

    def __init__(self, model, optimizer, scheduler, sampler):
        self.model, self.optimizer, self.scheduler, self.sampler = model, optimizer, scheduler, sampler
        self.step = 0          # optimizer steps done

    def state_dict(self):
        msd, osd = get_state_dict(self.model, self.optimizer, options=StateDictOptions())
        return {
            "model": msd,
            "optimizer": osd,
            "lr_scheduler": self.scheduler.state_dict(),
            "data": self.sampler.state_dict(),
            "progress": {"step": self.step},
            "rng_per_rank": checkpointing.per_rank(_rng_now()),
        }

    def load_state_dict(self, state):
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=StateDictOptions())
        self.scheduler.load_state_dict(state["lr_scheduler"])
        self.sampler.load_state_dict(state["data"])
        self.step = int(state["progress"]["step"])
        _rng_restore(checkpointing.this_rank(state["rng_per_rank"]))


def start(model, shard, make_optimizer, make_scheduler, sampler, checkpoint):
    """The AppState of a run that starts now, restored from `checkpoint` (a folder) unless it is None."""
    sharded = shard(model)                              # parallelize first (FSDP2 in place, DDP a wrapper)
    optimizer = make_optimizer(sharded.parameters())    # then the optimizer on the parameters that train
    app = AppState(sharded, optimizer, make_scheduler(optimizer), sampler)
    if checkpoint:
        dcp_load(state_dict={"app": app}, checkpoint_id=checkpoint)
    return app


def save(state, checkpoint):
    """Write `state` as a DCP checkpoint into the folder `checkpoint` (every rank calls this)."""
    dcp_save(state_dict={"app": state}, checkpoint_id=checkpoint)
'''


# The red team's per-rank RNG files beside DCP's checkpoint (second round): exact at 2 ranks; at 2 -> 1 rank
# rng_rank0.pt exists, so old rank 0's generators come back (at 2 -> 4 ranks 2 and 3 would find no file).
APP_RNG_FILES = HEADER + r"""import os
import torch.distributed as dist
""" + APP[len(HEADER):APP.index("\n\ndef start(")] + r"""


class _WithoutRng(Stateful):
    '''DCP sees everything but the generators, which go to one file per rank.'''

    def __init__(self, app, rng_path=None):
        self.app, self.rng_path = app, rng_path

    def state_dict(self):
        sd = self.app.state_dict()
        sd.pop("rng")
        return sd

    def load_state_dict(self, sd):
        sd["rng"] = per_rank(torch.load(self.rng_path, weights_only=False))
        self.app.load_state_dict(sd)


def _rank():
    return dist.get_rank() if dist.is_initialized() else 0


def start(model, shard, make_optimizer, make_scheduler, sampler, checkpoint):
    model = shard(model)
    optimizer = make_optimizer(model.parameters())
    scheduler = make_scheduler(optimizer)
    state = AppState(model, optimizer, scheduler, sampler)
    if checkpoint is not None:
        dcp.load({"app": _WithoutRng(state, os.path.join(checkpoint, f"rng_rank{_rank()}.pt"))}, checkpoint_id=checkpoint)
    return state


def save(state, checkpoint):
    mine = this_rank(state.state_dict()["rng"])
    dcp.save({"app": _WithoutRng(state)}, checkpoint_id=checkpoint)
    torch.save(mine, os.path.join(checkpoint, f"rng_rank{_rank()}.pt"))
"""

W_APP = [
    ("RNG states saved under one key on every rank without per_rank: DCP keeps one rank's copy, both ranks get rank 1's "
     "dropout generator after a resume (breaks 'random generators ... stored per rank'; the 2-rank kill run differs)",
     APP.replace('"rng": per_rank(rng)}', '"rng": rng}').replace("rng = this_rank(state[\"rng\"])", "rng = state[\"rng\"]")),
    ("forgets Python's random state (only torch and numpy): the window shifts random.randrange differ after the resume "
     "(breaks 'this rank's random generators (torch CPU, Python's random, numpy)')",
     APP.replace(', "python": random.getstate()', '').replace("            random.setstate(rng[\"python\"])\n", "")),
    ("forgets the learning-rate scheduler: warm-up restarts after the resume, the learning rate jumps (breaks "
     "'the scheduler's ... state_dict()')",
     APP.replace('"scheduler": self.scheduler.state_dict(),\n                ', '')
        .replace("        self.scheduler.load_state_dict(state[\"scheduler\"])\n", "")),
    ("forgets the sampler: the resumed run restarts the epoch's permutation at position 0, samples seen twice (breaks "
     "'the sampler's state_dict()')",
     APP.replace('"sampler": self.sampler.state_dict(), ', '')
        .replace("        self.sampler.load_state_dict(state[\"sampler\"])\n", "")),
    ("saves `step` but never restores it: state.step stays 0 after the load, the steps up to the checkpoint are "
     "trained again (breaks 'puts every piece back')",
     _sub(APP, "        self.step = int(state[\"step\"])\n", "")),
    ("builds the optimizer before shard(model) (order trap 1): under FSDP2 the optimizer holds the old tensors and "
     "updates nothing the model uses (breaks 'parallelize, then build the optimizer, then load')",
     _sub(APP, "    model = shard(model)\n    optimizer = make_optimizer(model.parameters())\n",
          "    optimizer = make_optimizer(model.parameters())\n    model = shard(model)\n")),
    ("model.state_dict()/optimizer.state_dict() instead of get_state_dict: a fresh optimizer has no exp_avg/exp_avg_sq "
     "yet, so dcp.load's template has no moments and AdamW restarts from 0 (and the keys are parameter ids, which do not "
     "reshard)",
     APP.replace("        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)\n",
                 "        model_sd, optim_sd = self.model.state_dict(), self.optimizer.state_dict()\n")
        .replace('        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])\n',
                 '        self.model.load_state_dict(state["model"])\n        self.optimizer.load_state_dict(state["optim"])\n')),
    ("restores only the model (set_state_dict without the optimizer's state): AdamW's moments and step restart (breaks "
     "'the model's and the optimizer's state')",
     _sub(APP, 'set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])',
          'set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict={})')),
    ("does not handle this_rank(...) == None: resuming at another world size crashes with TypeError on None "
     "(breaks 'when this_rank gives None, keep the fresh generators')",
     APP.replace("        if rng is not None:\n            torch.set_rng_state", "        if True:\n            torch.set_rng_state")),
    ("save only on rank 0 (`if dist.get_rank() == 0`): dcp.save is a collective (per_rank gathers, DCP plans); rank 0 "
     "waits for the others -> hang, and FSDP2's other shards are never written (breaks 'every rank calls it')",
     APP.replace("    dcp.save({\"app\": state}, checkpoint_id=checkpoint)\n",
                 "    import torch.distributed as dist\n    if not dist.is_initialized() or dist.get_rank() == 0:\n        dcp.save({\"app\": state}, checkpoint_id=checkpoint)\n")),
    ("loads the checkpoint only into the model via a throwaway dict before building optimizer/scheduler: "
     "'restores' into a state that is then replaced by fresh objects (scheduler/sampler/step/rng lost)",
     _sub(APP, "    state = AppState(model, optimizer, scheduler, sampler)\n    if checkpoint is not None:\n        dcp.load({\"app\": state}, checkpoint_id=checkpoint)\n",
          "    state = AppState(model, optimizer, scheduler, sampler)\n    if checkpoint is not None:\n        dcp.load({\"app\": {\"model\": state.state_dict()[\"model\"]}}, checkpoint_id=checkpoint)\n")),
    # Second round (each kept full marks before the checks named):
    ("calls shard(model) without keeping what it returns (right for FSDP2, which shards in place; under DDP the "
     "wrapper is lost, so no all-reduce and the ranks drift apart; caught by the hidden start() with a shard that "
     "returns a wrapper)",
     _sub(APP, "    model = shard(model)\n", "    shard(model)   # shards in place\n")),
    ("reseeds every generator with 0 when this_rank gives None: after a reshard every rank draws the same dropout "
     "masks and noise (breaks 'keep the fresh generators'; caught by the hidden 2 -> 1 reshard's generator check)",
     _sub(APP, '                torch.cuda.set_rng_state_all(rng["cuda"])\n',
          '                torch.cuda.set_rng_state_all(rng["cuda"])\n'
          '        else:                          # another world size: reseed, deterministic\n'
          '            torch.manual_seed(0)\n            random.seed(0)\n            np.random.seed(0)\n')),
    ("the RNG states in one torch.save file per rank beside DCP's checkpoint: at 2 -> 1 rank old rank 0's generators "
     "come back, at 2 -> 4 ranks 2 and 3 find no file (breaks 'only the same world size can read ... loses these "
     "points'; caught by the hidden 2 -> 1 reshard's generator check)", APP_RNG_FILES),
]

YD = r'''import math


def job_mtbf_s(component_mtbf_s, n_components):
    """The MTBF of a job that stops when any one of n_components independent components fails."""
    return component_mtbf_s / n_components


def young_daly_interval(checkpoint_s, mtbf_s):
    """The checkpoint interval (seconds of work between checkpoints) that minimizes the time wasted."""
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def expected_overhead(interval_s, checkpoint_s, mtbf_s, restart_s=0.0):
    """Seconds wasted per second of work (first order): writing checkpoints, plus per failure the lost work and the restart."""
    return checkpoint_s / interval_s + (interval_s / 2.0 + restart_s) / mtbf_s
'''

YD_VARIANT = r'''from math import sqrt


def job_mtbf_s(component_mtbf_s, n_components):
    """The MTBF of a job that stops when any one of n_components independent components fails."""
    if n_components < 1:
        raise ValueError(f"n_components must be at least 1, got {n_components}")
    return float(component_mtbf_s) / n_components      # failure rates add: n / m, the mean time is its inverse


def young_daly_interval(checkpoint_s, mtbf_s):
    """The checkpoint interval (seconds of work between checkpoints) that minimizes the time wasted."""
    return (2 * checkpoint_s * mtbf_s) ** 0.5


def expected_overhead(interval_s, checkpoint_s, mtbf_s, restart_s=0.0):
    """Seconds wasted per second of work (first order): writing checkpoints, plus per failure the lost work and the restart."""
    writing = checkpoint_s / interval_s
    per_failure = 0.5 * interval_s + restart_s
    return writing + per_failure / mtbf_s
'''

W_YD = [
    ("job MTBF multiplied by n instead of divided (more GPUs = more reliable): breaks 'stops when any one fails'",
     _sub(YD, "return component_mtbf_s / n_components", "return component_mtbf_s * n_components")),
    ("interval sqrt(C*M), the factor 2 dropped: not the minimum of W (breaks 'minimizes the time wasted')",
     _sub(YD, "math.sqrt(2.0 * checkpoint_s * mtbf_s)", "math.sqrt(checkpoint_s * mtbf_s)")),
    ("overhead charges a whole interval per failure (tau/M instead of tau/2M): breaks 'per failure the lost work' "
     "(on average half an interval); also moves the optimum to sqrt(CM)",
     _sub(YD, "(interval_s / 2.0 + restart_s) / mtbf_s", "(interval_s + restart_s) / mtbf_s")),
    ("overhead ignores the restart argument: breaks 'plus per failure ... the restart' (visible checks pass: they use R=0)",
     _sub(YD, "(interval_s / 2.0 + restart_s) / mtbf_s", "(interval_s / 2.0) / mtbf_s")),
    ("restart charged per checkpoint (R/tau) instead of per failure (R/M): breaks 'per failure ... the restart'",
     _sub(YD, "checkpoint_s / interval_s + (interval_s / 2.0 + restart_s) / mtbf_s",
          "(checkpoint_s + restart_s) / interval_s + (interval_s / 2.0) / mtbf_s")),
    ("integer division m // n for the job MTBF: truncates "
     "(50,000 h over 16,384 GPUs: 10,986 s instead of 10,986.328125 s)",
     _sub(YD, "return component_mtbf_s / n_components", "return component_mtbf_s // n_components")),
]

W_MC = [
    ("answers (b): the sampler's position is global (samples served to all ranks), not per rank", 'per_rank_answer = "b"\n'),
    ("answers (d): AdamW's step counter is the same on every rank", 'per_rank_answer = "d"\n'),
]

WRONG_ANSWERS = {
    "app_state": W_APP,
    "young_daly": W_YD,
    "per_rank_answer": W_MC,
}

CORRECT_VARIANTS = {
    # The reviewer's straightforward answer (APP above, the base of W_APP) is not run as a variant: it is the solution
    # with one key renamed ("optim"; APP_VARIANT renames four others), int(step) and the CUDA state saved only on a
    # GPU (both in APP_VARIANT too). Each app_state variant costs a 2-rank kill-and-restart run.
    "app_state": [
        ("`from torch.distributed.checkpoint import load, save`, other key names, nested 'progress' dict, RNG helpers, "
         "`lablib.labs.fault_tolerance.checkpointing.per_rank` via the module", APP_VARIANT),
    ],
    "young_daly": [
        ("math.sqrt and the formulas as written", YD),
        ("** 0.5 instead of math.sqrt, float() conversion, terms split into named parts, input validation", YD_VARIANT),
    ],
    "per_rank_answer": [
        ("(c): each rank draws its own dropout masks, so each generator state differs per rank", 'per_rank_answer = "c"\n'),
    ],
}
