import math

import pytest
import torch

from lablib.course.models import GPT, MLP, GPTConfig


def test_gpt_shapes_init_loss_and_tying():
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    idx, targets = torch.randint(0, 65, (3, 64)), torch.randint(0, 65, (3, 64))
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 64, 65)
    assert abs(loss.item() - math.log(65)) < 0.3, "a fresh model should predict close to uniform"
    assert model.lm_head.weight is model.wte.weight
    assert model.num_params() == sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match="exceeds block_size=64"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="divisible by n_head"):
        GPTConfig(n_embd=100, n_head=3)


def test_gpt_learns_a_repeating_sequence():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=8, block_size=16, n_layer=1, n_head=2, n_embd=32))
    data = torch.arange(17).remainder(8).repeat(8, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(30):
        _, loss = model(data[:, :-1], data[:, 1:])
        first = first or loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2 * first


def test_mlp_with_and_without_batchnorm():
    x = torch.randn(8, 5)
    assert MLP(5, 7, 2)(x).shape == (8, 2)
    bn = MLP(5, 7, 2, batchnorm=True)
    norm = [m for m in bn.modules() if isinstance(m, torch.nn.BatchNorm1d)]
    assert len(norm) >= 1
    seen = {}
    norm[0].register_forward_hook(lambda module, inputs, out: seen.setdefault("out", out))
    bn.train()(x)
    # In training mode the layer normalises over the batch: every feature has mean 0 and variance 1.
    torch.testing.assert_close(seen["out"].mean(0), torch.zeros(7), atol=1e-5, rtol=0)
    torch.testing.assert_close(seen["out"].var(0, unbiased=False), torch.ones(7), atol=1e-3, rtol=0)
