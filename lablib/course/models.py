"""Plain PyTorch models for the labs. Nothing here knows about parallelism: DDP, FSDP2 and friends are
applied from outside, by the run scripts.

``GPT`` follows nanoGPT (Karpathy, 2022) and its names: n_layer, n_head, n_embd, block_size.
``MLP`` is a small multi-layer perceptron for quick experiments (optionally with BatchNorm).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    """Defaults are CPU-friendly: ~0.4M parameters, trains visibly on Tiny Shakespeare in a minute."""

    vocab_size: int = 65
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self):
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")


def gpt_config(fields, vocab_size: int = 65) -> GPTConfig:
    """The GPTConfig of a run script's Config (any object with block_size, n_layer, n_head and n_embd): the one
    place a run's options become a model's shape."""
    return GPTConfig(vocab_size=vocab_size, block_size=fields.block_size, n_layer=fields.n_layer,
                     n_head=fields.n_head, n_embd=fields.n_embd)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # batch, time, channels (n_embd)
        # Sizes are read from c_attn's output, not from C: under tensor parallelism (lab 08) a rank's c_attn
        # holds its n_head heads' q, k and v rows only (3 * n_head * head_size of them) and n_head is its own.
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        # (B, T, n_head * head_size) -> (B, n_head, T, head_size)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1))


class MLPBlock(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    """One transformer block: pre-LayerNorm attention and MLP, each with a residual connection."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLPBlock(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)   # token embeddings
        self.wpe = nn.Embedding(config.block_size, config.n_embd)   # position embeddings
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx, targets: (B, T) token ids. Returns logits (B, T, vocab_size) and the mean loss (or None)."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, n_embd)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU}


class MLP(nn.Module):
    """d_in -> [d_hidden] * n_hidden -> d_out with ReLU (or GELU); optional BatchNorm after each hidden layer.

    GELU's derivative is continuous, ReLU's jumps at 0: two runs that differ only by rounding can put one
    sample's pre-activation on opposite sides of 0 under ReLU, and their gradients then differ by that
    sample's whole contribution, not by rounding (lab 01 compares DDP with one process for this reason on GELU).
    """

    def __init__(self, d_in: int = 32, d_hidden: int = 64, d_out: int = 1, n_hidden: int = 2,
                 batchnorm: bool = False, activation: str = "relu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not one of {sorted(ACTIVATIONS)}")
        layers: list[nn.Module] = []
        width = d_in
        for _ in range(n_hidden):
            layers.append(nn.Linear(width, d_hidden))
            if batchnorm:
                layers.append(nn.BatchNorm1d(d_hidden))
            layers.append(ACTIVATIONS[activation]())
            width = d_hidden
        layers.append(nn.Linear(width, d_out))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
