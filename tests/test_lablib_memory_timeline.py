"""lablib.measure.memory.MemoryTimeline: what a rank holds through one step, against the counts it must agree with
(model_state_bytes between steps, SavedActivations at the end of the forward)."""

from __future__ import annotations

import torch

from lablib.measure import memory
from lablib.course.models import GPT, GPTConfig


def _step(model, optimizer, x):
    model(x, x)[1].backward()
    optimizer.step()
    optimizer.zero_grad()


def test_timeline_of_one_step_agrees_with_the_other_counters():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 65, (4, 16))
    _step(model, optimizer, x)                                   # AdamW's state exists from here on
    with memory.SavedActivations(parameters_of=model) as saved:
        loss = model(x, x)[1]
    del loss
    states = memory.model_state_bytes(model.parameters(), optimizer)

    with memory.MemoryTimeline(model, optimizer, persistent={"buckets": 1000}) as timeline:
        _step(model, optimizer, x)
    samples = timeline.samples
    phases = [s["phase"] for s in samples]
    assert phases[0] == "start" and phases[-1] == "end"
    assert phases.index("backward") > max(i for i, p in enumerate(phases) if p == "forward")
    assert "optimizer" in phases
    # every module that runs (a ModuleList does not): a sample before and after its forward, one as its backward starts
    n_modules = sum(not isinstance(m, torch.nn.ModuleList) for m in model.modules())
    assert phases.count("forward") == 2 * n_modules
    assert phases.count("backward") == n_modules
    for s in samples:
        assert s["total"] == s["params"] + s["grads"] + s["optimizer"] + s["activations"] + 1000
        assert s["params"] == states["params"]                   # a plain model: its parameters, always
    assert samples[0]["grads"] == 0 and samples[0]["activations"] == 0
    assert samples[0]["optimizer"] == states["optimizer"]
    at_step = next(s for s in samples if s["event"] == "optimizer.step")
    assert at_step["grads"] == states["params"]                  # one fp32 gradient per weight
    assert max(s["activations"] for s in samples) == saved.bytes   # all held at the end of the forward
    assert samples[-1]["activations"] <= x.numel() * x.element_size()   # only what the caller still holds


def test_live_peak_holds_one_micro_batch_where_counting_by_address_sums_several():
    """Gradient accumulation: each micro-batch's backward frees what its forward saved. The peak of what autograd
    holds is one micro-batch's activations; SavedActivations.bytes counts every storage of the step once per address,
    so a later micro-batch's storages at new addresses are added to the earlier ones'."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16))
    x = torch.randint(0, 65, (16, 16))
    with memory._LiveSavedActivations(parameters_of=model) as one:
        loss = model(x[:4], x[:4])[1]
        one_micro_batch = one.held_bytes()
    loss.backward()
    assert one.held_bytes() == 0                       # the backward freed every saved storage
    keep = []                                          # storages kept alive between micro-batches: new addresses
    with memory._LiveSavedActivations(parameters_of=model, track_peak=True) as live:
        for k in range(4):
            loss = model(x[4 * k:4 * k + 4], x[4 * k:4 * k + 4])[1]
            (loss / 4).backward()
            keep.append(torch.empty(one_micro_batch // 4 + 1))
    assert live.peak_held == one_micro_batch
    assert live.bytes > live.peak_held                 # the address count sums storages never held at once
    with memory._LiveSavedActivations(parameters_of=model, track_peak=True) as whole:
        model(x[:4], x[:4])[1].backward()
    assert whole.peak_held == whole.bytes == one_micro_batch     # one forward: both counts agree
