"""lablib.measure.memory (storage counting, saved activations, recipes) and lablib.labs.zero_memory.run (a real 2-rank run)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lablib.jobs import launch
from lablib.measure import memory
from lablib.parallel.activation_checkpointing import apply_activation_checkpointing
from lablib.course.models import GPT, Block, GPTConfig


def test_recipes_are_sixteen_bytes():
    assert memory.MIXED_ADAM.total == 16 and memory.FP32_ADAM.total == 16
    assert memory.MIXED_ADAM.master_bytes == 4 and memory.FP32_ADAM.master_bytes == 0


def test_views_share_one_storage():
    base = torch.zeros(10, 4)
    views = [base, base[:5], base.view(40), base.t(), base[3]]
    assert memory.unique_storage_bytes(views) == 10 * 4 * 4
    assert memory.unique_storage_bytes([base, torch.zeros(3), None]) == 40 * 4 + 12


def test_a_view_counts_its_whole_storage():
    # A slice keeps its whole storage alive: that is what the rank holds (FSDP2's padded shards).
    padded = torch.zeros(17, 8)
    assert memory.unique_storage_bytes([padded[:14]]) == 17 * 8 * 4


def test_model_state_bytes_of_adamw_with_tied_weights():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=16))
    n_params = model.num_params()            # wte and lm_head are one tensor: counted once
    n_tensors = len(list(model.parameters()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 65, (2, 16))
    model(idx, idx)[1].backward()
    before = memory.model_state_bytes(model.parameters(), opt)
    assert before == {"params": 4 * n_params, "grads": 4 * n_params, "optimizer": 0, "total": 8 * n_params}
    opt.step()
    after = memory.model_state_bytes(model.parameters(), opt)
    # exp_avg and exp_avg_sq (8 bytes per parameter) plus one fp32 step counter per tensor
    assert after["optimizer"] == 8 * n_params + 4 * n_tensors


def test_saved_activations_of_a_block():
    B, T, C, H = 2, 16, 32, 4
    block = Block(GPTConfig(n_embd=C, n_head=H, block_size=T))
    x = torch.randn(B, T, C, requires_grad=True)
    saved, out = memory.saved_activation_bytes(lambda: block(x), exclude=block.parameters())
    assert saved.n_saved > len(saved.tensors)                       # views were seen and counted once
    assert saved.bytes == B * T * (16 * C + H + 4) * 4              # the lab's derivation, fp32, fused attention
    out.sum().backward()                                            # the hooks leave the graph usable
    assert x.grad is not None


def test_checkpointing_keeps_only_block_inputs():
    B, T, C = 2, 16, 32
    model = apply_activation_checkpointing(GPT(GPTConfig(n_layer=3, n_embd=C, n_head=4, block_size=T)))
    plain = GPT(GPTConfig(n_layer=3, n_embd=C, n_head=4, block_size=T))
    idx = torch.randint(0, 65, (B, T))
    ck, loss = memory.saved_activation_bytes(lambda: model(idx, idx)[1], exclude=model.parameters())
    full, _ = memory.saved_activation_bytes(lambda: plain(idx, idx)[1], exclude=plain.parameters())
    per_layer_saving = B * T * (16 * C + 4 + 4) * 4 - B * T * C * 4
    assert full.bytes - ck.bytes == 3 * per_layer_saving
    loss.backward()  # recomputation works
    assert all(p.grad is not None for p in model.parameters())


def test_layers_with_weights_are_the_blocks_linears_and_layernorms():
    from lablib.parallel.zero_states import layers_with_weights
    model = GPT(GPTConfig(n_layer=3, n_embd=32, n_head=2, block_size=16))
    layers = layers_with_weights(model)
    assert len(layers) == 3 * 6                     # ln_1, c_attn, c_proj, ln_2, c_fc, c_proj per block
    assert all(isinstance(m, (nn.Linear, nn.LayerNorm)) for m in layers)
    inside = {id(p) for m in layers for p in m.parameters()}
    outside = [n for n, p in model.named_parameters() if id(p) not in inside]
    assert sorted(outside) == ["ln_f.bias", "ln_f.weight", "wpe.weight", "wte.weight"]   # left to the root unit


def test_zero_memory_run_matches_the_formula_on_two_ranks():
    result = launch.run("zero_memory", {"steps": 2, "variants": "ddp,zero1,fsdp_full,fsdp_grad_op_bf16"},
                        nproc=2, timeout_s=180, quiet=True, show_progress=False)
    m = result["metrics"]
    phi, n_tensors = m["n_params"], len(m["param_shapes"])
    variants = m["variants"]
    for rank in variants["ddp"]["memory_per_rank"]:       # DDP: exactly 16 Phi plus the AdamW step counters
        assert rank["peak"]["total"] == 16 * phi + 4 * n_tensors
    fsdp = [r["peak"]["total"] for r in variants["fsdp_full"]["memory_per_rank"]]
    assert sum(fsdp) == pytest.approx(16 * phi, rel=2e-3)  # sharded over 2 ranks, up to padding and counters
    zero1 = [r["after_step"]["optimizer"] for r in variants["zero1"]["memory_per_rank"]]
    assert sum(zero1) == 8 * phi + 4 * n_tensors             # each tensor's state lives on exactly one rank
    for name in ("zero1", "fsdp_full"):
        assert variants[name]["losses"] == pytest.approx(variants["ddp"]["losses"], rel=1e-5), name
    bf16 = variants["fsdp_grad_op_bf16"]["memory_per_rank"][0]
    gathered = bf16["after_forward"]["params"] - bf16["after_step"]["params"]
    assert gathered == pytest.approx(2 * phi, rel=1e-3)      # bf16 copies of the gathered weights, 2 bytes each
    assert bf16["after_backward"]["grads"] == pytest.approx(4 * phi / 2, rel=1e-3)   # fp32 gradient shards


def test_zero_memory_config_is_validated():
    with pytest.raises(ValueError, match="does not split"):
        launch.run("zero_memory", nproc=3, timeout_s=10)
    with pytest.raises(ValueError, match="unknown"):
        launch.run("zero_memory", {"variants": "ddp,zero4"}, nproc=2, timeout_s=10)
