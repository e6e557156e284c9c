"""Lab 08's GPT step: the course GPT three ways in one run, on the same batches from the same weights:

- ``single``: one process (every rank computes it; the reference);
- ``by_hand``: every block's MLP and attention replaced by the students' classes (``lablib.parallel.tensor_parallel.
  apply_by_hand``), their own f and g, collectives counted with ``lablib.measure.counting``;
- ``dtensor_blocks``: PyTorch's ``parallelize_module`` on the blocks (``apply_dtensor``), the same split as by hand;
- ``dtensor``: the same with the vocabulary split too, the loss under ``loss_parallel``;
- ``dtensor_sp``: the blocks with sequence parallelism (``SequenceParallel`` on the norms), torchtitan's plan;
- ``dtensor_sp_local``: the same with the attention's and the MLP's gathered input handed on as a plain tensor
  (``PrepareModuleInput(..., use_local_output=True)``): its backward all-reduces where ``dtensor_sp``
  reduce-scatters (``lablib.parallel.tensor_parallel.apply_dtensor``'s ``local_input`` says why).

DTensor's collectives are counted with ``torch.distributed.tensor.debug.CommDebugMode`` (and their message
bytes with ``lablib.measure.counting``, which sees functional collectives too); the activation bytes each rank
saves for the backward in the first forward with ``lablib.measure.memory.SavedActivations``. Then the variants are
timed in ``timed_steps`` rounds: in each round every variant runs one more step, uninstrumented, after a barrier
(the slowest rank's step, ``lablib.measure.timing``), in an order shuffled afresh each round, so that a burst of
load falls on all of them alike and none always runs first or after the same arm. For each pair the notebook
orders (``PAIRS``), its noisier arm is timed twice in each round (``twin_step_s``): the same code against itself,
the noise floor that pair's per-round ratio is read against. The first round is a warm-up, left out.

    torchrun --standalone --nproc-per-node 2 -m lablib.labs.tensor_parallel.run_tp_gpt --mlp-impl tp_mlp_impl.py \\
        --attention-impl tp_attention_impl.py --steps 3 --out out.json

Each variant trains ``steps`` plain SGD steps; the losses per step, the largest difference of every gathered
gradient from the single process's after the first backward, the collectives per forward and backward and
the parameter and saved-activation bytes per rank and the median step time are written by rank 0.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist

from lablib.measure import counting, timing
from lablib.course import data
from lablib.jobs import script
from lablib.parallel import tensor_parallel
from lablib.labs.tensor_parallel import probe as tp_probes
from lablib.probes.harness import sgd_step_, zero_grad_
from lablib.measure.memory import SavedActivations
from lablib.course.models import GPT, gpt_config


@dataclass(frozen=True)
class Config:
    mlp_impl: str = "tp_mlp_impl.py"               # exercise 2's file
    attention_impl: str = "tp_attention_impl.py"   # exercise 3's file (both import exercise 1's f and g)
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 32
    batch_size: int = 8
    steps: int = 3
    pad_vocab: bool = True                         # vocabulary padded to a multiple of the ranks (Megatron's way)
    timed_steps: int = 9                           # rounds of one uninstrumented step per variant (the first left out)
    lr: float = 0.1
    seed: int = 0

    def validate(self) -> None:
        if min(self.n_layer, self.n_head, self.n_embd, self.block_size, self.batch_size, self.steps) < 1:
            raise ValueError("every size and steps must be at least 1")
        if self.timed_steps < 2:
            raise ValueError(f"timed_steps={self.timed_steps}: at least 2 (the first is a warm-up, left out)")
        gpt_config(self)                           # n_embd divisible by n_head, said in full there


def _comm_counts(mode) -> dict[str, int]:
    """CommDebugMode's counts by the collective's name (c10d_functional.all_reduce -> all_reduce)."""
    return {str(op).rsplit(".", 1)[-1]: n for op, n in mode.get_comm_counts().items()}


def _rows_per_rank(rows: int, mesh) -> list[int]:
    """How many of ``rows`` embedding rows each rank holds under DTensor's Shard(0) (read from the shards)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    local = distribute_tensor(torch.zeros(rows, 1), mesh, [Shard(0)]).to_local().shape[0]
    sizes = [None] * mesh.size()
    dist.all_gather_object(sizes, local)
    return sizes


# Each pair the notebook orders, and the arm timed twice in every round for it (its twin): the noise floor of that
# pair is the twin's step over the arm's own, the same code against itself, and it is the pair's slower, noisier
# arm (more collectives, DTensor's dispatch) that is twinned, so that the floor is at least as spread as the pair.
PAIRS = (("by_hand", "single", "by_hand"), ("dtensor_blocks", "by_hand", "dtensor_blocks"),
         ("dtensor_sp_local", "dtensor_sp", "dtensor_sp"))
TWINS = tuple(dict.fromkeys(twin for _, _, twin in PAIRS))


def _timed_rounds(variants: dict, batches, loss_contexts: dict, config: Config, env) -> dict:
    """``timed_steps`` rounds; in each, every variant one uninstrumented SGD step (forward, backward, update) after a
    barrier, and each of ``TWINS`` a second time (key ``"<name>_twin"``), in an order shuffled afresh every round
    (``timing.turn_order``: the same on every rank), so that no arm always runs right after the same one. Returns
    each arm's step times by ``lablib.measure.timing``'s one definition (slowest rank, median; the first round left
    out)."""
    arms = list(variants) + [f"{name}_twin" for name in TWINS]
    per_step: dict[str, list[float]] = {arm: [] for arm in arms}
    for r in range(config.timed_steps):
        x, y = batches[r % len(batches)]
        for arm in timing.turn_order(arms, r, config.seed):
            name = arm.removesuffix("_twin")
            model = variants[name]
            timing.barrier(env.device)
            with timing.stopwatch(per_step[arm], env.device), loss_contexts[name]():
                zero_grad_(model.parameters())
                _, loss = model(x, y)
                loss.backward()
                sgd_step_(model.parameters(), config.lr)
    return {arm: timing.step_times(times, env.device, warmup=1) for arm, times in per_step.items()}


def run(env, config: Config) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel

    tp = env.world_size
    tokenizer, train, _ = data.shakespeare_datasets(config.block_size)
    # Whole global batches on every rank (a loader for a world of one): the single process trains on them too.
    whole = data.global_batch_loader(train, config.batch_size, SimpleNamespace(rank=0, world_size=1), config.seed)
    batches = list(itertools.islice(whole, config.steps))
    torch.manual_seed(config.seed)
    # Padded, every model here (the single process too) has the same vocabulary of V' rows, V' a multiple of tp;
    # the padded tokens never occur in the data. Unpadded, DTensor splits V rows unevenly (torch.chunk's sizes).
    vocab = tensor_parallel.padded_vocab_size(tokenizer.vocab_size, tp) if config.pad_vocab else tokenizer.vocab_size
    single = GPT(gpt_config(config, vocab))
    # The weights every variant starts from: by_hand's attention rows are found in them by value (full_gradients).
    initial = {name: p.detach().clone() for name, p in single.named_parameters()}
    mlp = tp_probes.load_impl(config.mlp_impl, ("TensorParallelMLP",), reference_comm=False)
    attention = tp_probes.load_impl(config.attention_impl, ("TensorParallelAttention",), reference_comm=False)
    group = dist.group.WORLD
    by_hand = tensor_parallel.apply_by_hand(copy.deepcopy(single), group, mlp.TensorParallelMLP,
                                            attention.TensorParallelAttention, tp)
    mesh = init_device_mesh(env.device.type, (tp,))
    variants = {
        "single": single,
        "by_hand": by_hand,
        "dtensor_blocks": tensor_parallel.apply_dtensor(copy.deepcopy(single), mesh),
        "dtensor": tensor_parallel.apply_dtensor(copy.deepcopy(single), mesh, vocab_parallel=True),
        "dtensor_sp": tensor_parallel.apply_dtensor(copy.deepcopy(single), mesh, sequence_parallel=True),
        "dtensor_sp_local": tensor_parallel.apply_dtensor(copy.deepcopy(single), mesh, sequence_parallel=True,
                                                          local_input=True),
    }
    out = {"tp": tp, "losses": {}, "grad_max_diff": {}, "comm": {}, "saved_activation_bytes": {},
           "bytes_per_rank": {name: tensor_parallel.local_param_bytes(model) for name, model in variants.items()},
           "activation_bytes": config.batch_size * config.block_size * config.n_embd * 4,
           "vocab_size": tokenizer.vocab_size, "padded_vocab_size": vocab, "median_step_s": {},
           "step_s": {},                                 # each variant's timed steps (slowest rank): their spread
           "vocab_rows_per_rank": {"unpadded": _rows_per_rank(tokenizer.vocab_size, mesh),
                                   "padded": _rows_per_rank(tensor_parallel.padded_vocab_size(tokenizer.vocab_size, tp),
                                                            mesh)}}
    for name, model in variants.items():
        losses, comm = [], {"forward": [], "backward": []}
        # loss_parallel: the cross-entropy of vocabulary-sharded logits, forward and backward inside the context
        loss_context = loss_parallel if name == "dtensor" else contextlib.nullcontext
        for step, (x, y) in enumerate(batches):
            zero_grad_(model.parameters())
            for phase in ("forward", "backward"):
                log, mode = counting.CollectiveLog(), CommDebugMode()
                saved = SavedActivations(parameters_of=model) if phase == "forward" else contextlib.nullcontext()
                with loss_context(), counting.count_collectives(log), mode, saved:
                    if phase == "forward":
                        _, loss = model(x, y)
                    else:
                        loss.backward()
                if phase == "forward" and step == 0:
                    out["saved_activation_bytes"][name] = saved.bytes
                # Collectives the course's code calls are from lablib.measure.counting's log; DTensor's (functional
                # collectives) from CommDebugMode's counts, as the notebook labels them.
                mine = [c for c in log.calls if not c.functional]
                counts = dict(Counter(c.name for c in mine)) if mine else _comm_counts(mode)
                # message bytes S (nccl-tests' convention) and what each rank sends on a ring, per collective kind
                comm[phase].append({"counts": counts, "bytes": sum(c.bytes for c in log.calls),
                                    "bus_bytes": sum(c.bus_bytes for c in log.calls),
                                    "bytes_by_kind": dict(sum((Counter({c.name: c.bytes}) for c in log.calls),
                                                              Counter()))})
            losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
            if step == 0:
                grads = tensor_parallel.full_gradients(model, group, 1 if name == "single" else tp,
                                                       initial if name == "by_hand" else None)
                if name == "single":
                    reference = grads
                else:
                    out["grad_max_diff"][name] = max((grads[k] - reference[k]).abs().max().item() for k in reference)
            sgd_step_(model.parameters(), config.lr)
        out["losses"][name] = losses
        if name != "single":
            out["comm"][name] = comm
        script.progress(env, list(variants).index(name) + 1, len(variants) + 1)
    contexts = {name: loss_parallel if name == "dtensor" else contextlib.nullcontext for name in variants}
    timed = _timed_rounds(variants, batches, contexts, config, env)
    for name in variants:
        out["median_step_s"][name], out["step_s"][name] = timed[name]["median_step_s"], timed[name]["step_s"]
    out["twin_step_s"] = {name: timed[f"{name}_twin"]["step_s"] for name in TWINS}
    out["pairs"] = [list(pair) for pair in PAIRS]
    script.progress(env, len(variants) + 1, len(variants) + 1)
    return out


def main() -> None:
    script.main(Config, run)


if __name__ == "__main__":
    main()
