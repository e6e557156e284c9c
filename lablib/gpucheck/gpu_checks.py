"""The GPU-only checks that no run script covers, as one torchrun script (``launchers/gpu-check`` starts it through
``lablib.jobs.launch.run_script``):

    torchrun --standalone --nproc-per-node 1 lablib/gpucheck/gpu_checks.py --check zero_memory --out out.json
    torchrun --standalone --nproc-per-node 2 lablib/gpucheck/gpu_checks.py --check cp_sdpa --out out.json

- ``zero_memory``: lab 04's four variants set up and trained as ``lablib.labs.zero_memory.run`` does, with the CUDA
  caching allocator's figures next to the model-state bytes the lab counts from storages: at each of the lab's three
  moments ``memory_allocated`` then, and over the steps ``max_memory_allocated``. The counted bytes are tensors the
  allocator handed out, alive together at that moment, so they can never exceed either; what the allocator holds
  beyond them (activations, temporaries, its rounding to 512-byte blocks) is what storage counting leaves out, and
  the report gives the share. (AdamW's per-tensor step counts are CPU tensors unless capturable or fused,
  torch/optim/adam.py:168-176, off the GPU's books: a few hundred
  bytes, counted but not allocated there, far inside the margin of the activations.)
- ``cp_sdpa``: torch's ``context_parallel`` (ring attention swapped in for ``F.scaled_dot_product_attention``) on a
  mesh of every rank, the sequence sharded over them (head-tail balanced, as section 4's zigzag), against plain SDPA
  on the whole sequence, causal, bf16, the flash kernel: CUDA-only in torch 2.13
  (torch/distributed/tensor/experimental/_context_parallel/_attention.py:918-934).

On the CPU there is nothing to check: rank 0 writes ``{"not_run": reason}`` (the launcher does not start it there).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lablib.jobs import script
from lablib.jobs.distenv import gather_objects

CHECKS = ("zero_memory", "cp_sdpa")
BF16_UNIT_ROUNDOFF = 2.0 ** -8
FP32_UNIT_ROUNDOFF = 2.0 ** -24


@dataclass(frozen=True)
class Config:
    check: str = "zero_memory"     # zero_memory or cp_sdpa
    steps: int = 4                 # zero_memory: AdamW steps per variant (lab 04's notebook: 4)
    seq_len: int = 1024            # cp_sdpa: the whole sequence (lab 12's section 6)
    n_head: int = 8
    head_dim: int = 64
    seed: int = 0

    def validate(self) -> None:
        if self.check not in CHECKS:
            raise ValueError(f"check={self.check!r} must be one of {CHECKS}")
        if min(self.steps - 1, self.seq_len, self.n_head, self.head_dim) < 1:
            raise ValueError("steps must be at least 2; seq_len, n_head and head_dim at least 1")


def zero_memory_on_gpu(env, config: Config) -> dict:
    """Lab 04's variants set up as ``lablib.labs.zero_memory.run`` sets them up (``lablib.parallel.zero_states``), trained
    ``steps`` AdamW steps; in the last step, at each of lab 04's three moments, the model-state bytes counted from
    storages (``memory.model_state_bytes``) next to ``torch.cuda.memory_allocated`` at the same moment, and over the
    variant's steps ``max_memory_allocated``. A count can never exceed what is allocated at that moment."""
    from lablib.course.models import GPT
    from lablib.measure import memory
    from lablib.parallel import zero_states as zs

    zero = zs.Config(steps=config.steps)
    steps = zs.batches(zero, env.rank, env.world_size)
    out = {}
    for variant in zero.variants:
        gc.collect()
        torch.cuda.synchronize(env.device)
        before = torch.cuda.memory_allocated(env.device)   # what an earlier variant left (0 when all was freed)
        torch.cuda.reset_peak_memory_stats(env.device)
        torch.manual_seed(zero.seed)
        model = GPT(zero.gpt()).to(env.device)
        if variant in ("ddp", "zero1"):
            wrapped, opt = zs.apply_ddp(model, zero, zero1=variant == "zero1")
            sharded = []
        else:
            wrapped = zs.shard_every_layer(model, reshard_after_forward=variant == "fsdp_full")
            opt = torch.optim.AdamW(model.parameters(), lr=zero.lr, weight_decay=zero.weight_decay)
            sharded = list(model.parameters())
        moments = {}

        def moment(name):
            torch.cuda.synchronize(env.device)
            moments[name] = {"counted": memory.model_state_bytes(zs.held_params(model, sharded), opt)["total"],
                             "allocated": torch.cuda.memory_allocated(env.device) - before}

        for step, (x, y) in enumerate(steps):
            last = step == len(steps) - 1
            opt.zero_grad(set_to_none=True)
            _, loss = wrapped(x.to(env.device), y.to(env.device))
            if last:
                moment("after_forward")
            loss.backward()
            if last:
                moment("after_backward")
            opt.step()
            if last:
                moment("after_step")
        torch.cuda.synchronize(env.device)
        peak = torch.cuda.max_memory_allocated(env.device) - before
        counted = max(m["counted"] for m in moments.values())
        row = {"moments": moments, "counted_peak": counted, "allocator_peak": peak, "left_before": before,
               "counted_share_of_peak": counted / peak if peak else None}
        out[variant] = gather_objects(row, env)
        if env.is_main:
            print(f"{variant:13s} rank 0: counted at most {counted / 1e6:.3f} MB of model states, allocator peak "
                  f"{peak / 1e6:.3f} MB", flush=True)
        wrapped = opt = model = sharded = None   # freed before the next variant's baseline (moment() read them)
    return {"variants": out}


def cp_bound(max_abs_v: float, seq_len: int) -> float:
    """|ring - plain| for bf16 outputs of the same causal attention. Each output is a convex combination of rows of V
    (softmax weights sum to 1), so an error of e in every partial block output moves the merged one by at most e.
    The ring rounds each block's output to bf16 once (u max|V|, u = 2^-8) before merging; the merged output is
    rounded to bf16 once more (u max|V|); plain SDPA rounds its output once (u max|V|). The fp32 accumulation
    inside the kernels adds at most seq_len roundings of 2^-24 of max|V|. Together 3u max|V| + T 2^-24 max|V|."""
    return (3 * BF16_UNIT_ROUNDOFF + seq_len * FP32_UNIT_ROUNDOFF) * max_abs_v


def torch_cp_on_gpu(env, config: Config) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cuda", (env.world_size,))
    gen = torch.Generator(device=env.device).manual_seed(config.seed)    # the same q, k, v on every rank
    shape = (1, config.n_head, config.seq_len, config.head_dim)
    q, k, v = (torch.randn(shape, device=env.device, dtype=torch.bfloat16, generator=gen) for _ in range(3))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            local = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            local_len = local.shape[2]
            (ring,) = context_parallel_unshard(mesh, [local], [2])
    diff = (ring.float() - plain.float()).abs().max().item()
    return {"world_size": env.world_size, "seq_len": config.seq_len, "local_seq_len": local_len,
            "max_abs_diff": diff, "bound": cp_bound(v.float().abs().max().item(), config.seq_len),
            "gpu": torch.cuda.get_device_name(env.device)}


def run(env, config: Config) -> dict:
    if env.device.type != "cuda":
        return {"not_run": f"this rank runs on {env.device}{': ' + env.fallback if env.fallback else ''}"}
    if config.check == "zero_memory":
        return zero_memory_on_gpu(env, config)
    result = torch_cp_on_gpu(env, config)
    if dist.is_initialized():
        dist.barrier()
    return result


def main() -> None:
    script.main(Config, run)


if __name__ == "__main__":
    main()
