"""A mixture-of-experts MLP for the course GPT, in one process (lab 13). Plain PyTorch: no communication here.

Shazeer et al. (2017) replace a block's MLP by E experts (each the course GPT's ``MLPBlock``) and a router, a
linear map ``n_embd -> E`` followed by a softmax: p(x) (T, E). Each token goes to its k most probable experts
(Switch Transformer, Fedus et al. 2021: k = 1; GShard, Lepikhin et al. 2020: k = 2) and the layer's output is

    y_t = sum_j gate_tj * expert_{e_tj}(x_t),   j = 1..k

with gate = p_e for k = 1 (Switch: the probability itself, so the router gets a gradient) and, for k > 1, the k
chosen probabilities renormalised to sum to 1 (GShard, Mixtral). An assignment an expert has no room for
(capacity) is *dropped*: it adds nothing, and the block's residual connection carries the token past the layer
unchanged. Which assignments are dropped, and the load-balancing loss, are lab 13's exercises 1 and 2: this
module takes them as functions (``keep_fn``, ``aux_loss_fn``) and never computes them itself.

``combine_in_one_process`` is the single-process reference of exercise 3 (expert parallelism: the same sum with
the experts on other ranks).
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from lablib.course.models import GPT, GPTConfig, MLPBlock

DROPPED = -1      # an expert index that means: this assignment was dropped (no expert computes it)


class Router(nn.Module):
    """p = softmax(x W_r^T): (T, n_embd) -> probs (T, E); the top-k experts (T, k) and their gates (T, k)."""

    def __init__(self, n_embd: int, num_experts: int, k: int):
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ValueError(f"k={k} experts per token must be between 1 and num_experts={num_experts}")
        self.k = k
        self.weight = nn.Parameter(torch.randn(num_experts, n_embd) * 0.02)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs = F.softmax(F.linear(x, self.weight).float(), dim=-1)      # fp32 softmax, as Switch does
        top, expert_index = probs.topk(self.k, dim=-1)                    # ties: the lower index first
        gates = top if self.k == 1 else top / top.sum(-1, keepdim=True)
        return probs, expert_index, gates.to(x.dtype)


def combine_in_one_process(x: torch.Tensor, expert_index: torch.Tensor, gates: torch.Tensor,
                           experts: nn.ModuleList) -> torch.Tensor:
    """y (T, h): y_t = sum_j gates[t, j] * experts[expert_index[t, j]](x[t]); DROPPED assignments add nothing.
    Each expert runs once, on all the tokens routed to it (in token order)."""
    y = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        token, choice = (expert_index == e).nonzero(as_tuple=True)
        if token.numel():
            y = y.index_add(0, token, gates[token, choice].unsqueeze(-1) * expert(x[token]))
    return y


class MoEMLP(nn.Module):
    """The MoE layer in place of a block's MLP: (B, T, n_embd) -> (B, T, n_embd).

    keep_fn(expert_index, num_experts, capacity) -> bool (T, k), capacity_fn(num_tokens, num_experts, k, factor)
    -> int: exercise 1's rule (None: nothing is dropped). aux_loss_fn(probs, expert_index, alpha) -> scalar:
    exercise 2's loss (None: 0). After each forward: ``aux_loss``, ``tokens_per_expert`` (kept assignments per
    expert) and ``dropped`` (assignments dropped), for the caller to add to the loss and to plot.
    """

    def __init__(self, config: GPTConfig, num_experts: int, k: int = 1, capacity_factor: float | None = None,
                 keep_fn: Callable | None = None, capacity_fn: Callable | None = None,
                 aux_loss_fn: Callable | None = None, alpha: float = 0.01):
        super().__init__()
        if capacity_factor is not None and (keep_fn is None or capacity_fn is None):
            raise ValueError("a capacity_factor needs exercise 1's keep_fn and capacity_fn")
        self.num_experts, self.k, self.capacity_factor, self.alpha = num_experts, k, capacity_factor, alpha
        self.keep_fn, self.capacity_fn, self.aux_loss_fn = keep_fn, capacity_fn, aux_loss_fn
        self.router = Router(config.n_embd, num_experts, k)
        self.experts = nn.ModuleList(MLPBlock(config) for _ in range(num_experts))
        self.aux_loss = torch.zeros(())
        self.tokens_per_expert = torch.zeros(num_experts, dtype=torch.long)
        self.dropped = 0

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, h) -> probs (T, E), expert_index (T, k) with DROPPED where capacity ran out, gates (T, k)."""
        probs, expert_index, gates = self.router(x)
        self.aux_loss = (self.aux_loss_fn(probs, expert_index, self.alpha) if self.aux_loss_fn
                         else probs.new_zeros(()))
        if self.capacity_factor is not None:
            capacity = self.capacity_fn(x.shape[0], self.num_experts, self.k, self.capacity_factor)
            keep = self.keep_fn(expert_index, self.num_experts, capacity)
            expert_index = torch.where(keep, expert_index, torch.full_like(expert_index, DROPPED))
        kept = expert_index[expert_index != DROPPED]
        self.tokens_per_expert = torch.bincount(kept, minlength=self.num_experts)
        self.dropped = int((expert_index == DROPPED).sum())
        return probs, expert_index, gates

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])                       # (B*T, h): tokens in batch-major order
        _, expert_index, gates = self.route(flat)
        return combine_in_one_process(flat, expert_index, gates, self.experts).view_as(x)


def moe_gpt(config: GPTConfig, num_experts: int, seed: int = 0, **moe_options) -> GPT:
    """The course GPT with every block's MLP replaced by an ``MoEMLP`` (same seed, same dense weights)."""
    torch.manual_seed(seed)
    model = GPT(config)
    for block in model.h:
        block.mlp = MoEMLP(config, num_experts, **moe_options)
    return model


def aux_loss_of(model: nn.Module) -> torch.Tensor:
    """The sum of the MoE layers' load-balancing losses from the last forward (0 without any)."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoEMLP)]
    return sum(losses) if losses else torch.zeros(())


# --- production form: all experts in grouped matrix products ----------------------------------------------------

def experts_in_a_loop(tokens: torch.Tensor, counts: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
    """tokens (R, h) sorted by expert, counts (E,) rows per expert -> (R, h): each expert on its rows, one Python
    iteration (two matrix products, launched separately) per expert: what exercise 3 and this module do."""
    pieces = tokens.split(counts.tolist())
    return torch.cat([expert(piece) for expert, piece in zip(experts, pieces)])


def stack_experts(experts: nn.ModuleList) -> dict:
    """The experts' weights stacked once, as a grouped-GEMM MoE layer stores them (one (E, ...) tensor per weight,
    not E modules): fc (E, h, 4h), proj (E, 4h, h), and their biases (E, 4h), (E, h) or None. Each expert must be
    the course GPT's ``MLPBlock`` (c_fc, GELU, c_proj)."""
    def biases(name):
        return None if getattr(experts[0], name).bias is None else torch.stack([getattr(e, name).bias for e in experts])
    return {"fc": torch.stack([e.c_fc.weight.t() for e in experts]).contiguous(),
            "proj": torch.stack([e.c_proj.weight.t() for e in experts]).contiguous(),
            "fc_bias": biases("c_fc"), "proj_bias": biases("c_proj")}


def experts_grouped_mm(tokens: torch.Tensor, counts: torch.Tensor, stacked: dict) -> torch.Tensor:
    """The same (R, h) result as ``experts_in_a_loop`` in two grouped matrix products for all E experts
    (``stacked``: ``stack_experts``), dropless: each expert takes exactly its rows, however uneven (no capacity,
    no padding to C rows), as dropless MoE layers do (MegaBlocks with block-sparse products,
    Megatron-core's grouped-GEMM experts).
    ``torch._grouped_mm(a (R, h), b (E, h, 4h), offs)`` multiplies row block e of a (rows offs[e-1]..offs[e]) by
    b[e]; it runs on the CPU in torch 2.13 (float32; its backward there needs a contiguous upstream gradient: an
    expanded one, from ``.sum()``, fails with "Invalid strides/sizes")."""
    offs = counts.cumsum(0).to(torch.int32)
    row_expert = torch.repeat_interleave(torch.arange(len(counts), device=tokens.device), counts)
    hidden = torch._grouped_mm(tokens, stacked["fc"], offs=offs)
    if stacked["fc_bias"] is not None:
        hidden = hidden + stacked["fc_bias"][row_expert]
    out = torch._grouped_mm(F.gelu(hidden), stacked["proj"], offs=offs)
    if stacked["proj_bias"] is not None:
        out = out + stacked["proj_bias"][row_expert]
    return out


def time_grouped_vs_loop(tokens: torch.Tensor, counts: torch.Tensor, experts: nn.ModuleList, rounds: int = 8,
                         calls: int = 10) -> dict:
    """Forward seconds per call of the loop and of the grouped product, and the loop timed against itself (the
    noise floor: two names for one function). Each round times a window of ``calls`` calls of each, in an order
    that alternates round by round (A B A' then A' B A), after one warm-up window; per function: the per-round
    values (median and spread over rounds are the caller's to show)."""
    stacked = stack_experts(experts)                                   # once, outside the timed windows
    fns = {"loop": lambda: experts_in_a_loop(tokens, counts, experts),
           "grouped": lambda: experts_grouped_mm(tokens, counts, stacked),
           "loop again": lambda: experts_in_a_loop(tokens, counts, experts)}
    times: dict[str, list[float]] = {name: [] for name in fns}
    with torch.no_grad():
        for r in range(rounds + 1):
            for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                start = time.perf_counter()
                for _ in range(calls):
                    fns[name]()
                if r:                                                   # round 0: warm-up
                    times[name].append((time.perf_counter() - start) / calls)
    return times


# --- formulas --------------------------------------------------------------------------------------------------

def uniform_capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float) -> float:
    """What each expert receives on average, times the factor: k T c / E (Switch's 'tokens per batch / number of
    experts x capacity factor', with k assignments per token). Not rounded: exercise 1 says how."""
    return capacity_factor * k * num_tokens / num_experts


def all_to_all_bytes_per_rank(tokens: int, k: int, n_embd: int, world_size: int, value_bytes: int = 4,
                              num_experts: int | None = None, sent_away_fraction: float | None = None) -> dict:
    """Bytes one rank's ``all_to_all_single`` calls carry in one forward (message size, nccl-tests' convention:
    the input tensor's bytes, its own block included), none dropped: the dispatch sends each of its k T
    assignments' h values once, the combine sends as many result rows back (uniform routing: each rank's experts
    run k T rows); plus one exchange of the E int64 counts (``num_experts``; 0 when not given). Of these, the
    fraction (N-1)/N leaves the rank when the experts are spread evenly and routing is uniform
    (``sent_away_fraction`` overrides it). The backward sends the same rows again, in the other direction, without
    counts."""
    payload = k * tokens * n_embd * value_bytes
    counts = 8 * (num_experts or 0)
    away = (world_size - 1) / world_size if sent_away_fraction is None else sent_away_fraction
    return {"dispatch": payload, "combine": payload, "counts": counts, "forward_total": 2 * payload + counts,
            "backward_total": 2 * payload, "forward_leaving_rank": 2 * payload * away}


def dropped_fraction_uniform(num_tokens: int, num_experts: int, k: int, capacity_factor: float) -> float:
    """The dropped fraction if routing were uniform at random: E[max(0, X - C)] / (k T / E), C the capacity
    rounded up, X the assignments one expert receives. Top-k picks k *distinct* experts, so each token picks a
    given expert at most once, with probability k/E, independently of the other tokens: X ~ Binomial(T, k/E)
    (not Binomial(k T, 1/E), which lets a token pick an expert twice; at E = k every expert gets exactly T and
    nothing drops at c >= 1). What the dropped-fraction plot draws beside the measured points."""
    if not 1 <= k <= num_experts:
        raise ValueError(f"k={k} must be between 1 and num_experts={num_experts}")
    n, p = num_tokens, k / num_experts
    capacity = math.ceil(uniform_capacity(num_tokens, num_experts, k, capacity_factor))
    def pmf(x: int) -> float:          # in logs: comb(n, x) overflows a float past n ~ 1000
        if p == 1.0:
            return float(x == n)
        return math.exp(math.lgamma(n + 1) - math.lgamma(x + 1) - math.lgamma(n - x + 1)
                        + x * math.log(p) + (n - x) * math.log1p(-p))
    excess = sum((x - capacity) * pmf(x) for x in range(capacity + 1, n + 1))
    return excess / (n * p) if n else 0.0


# --- training in one process ----------------------------------------------------------------------------------

def train_in_one_process(model: GPT, train_set, steps: int, batch_size: int, lr: float = 3e-3,
                         seed: int = 0, use_aux_loss: bool = True) -> dict:
    """AdamW on random batches of ``train_set`` (a BlockDataset); per step: the language-model loss, the
    layers' load-balancing loss, and per MoE layer the kept assignments per expert and the dropped ones. With
    ``use_aux_loss`` False the loss is still computed (to plot) but not added to what is minimised."""
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    layers = [m for m in model.modules() if isinstance(m, MoEMLP)]
    history = {"loss": [], "aux_loss": [], "tokens_per_expert": [], "dropped": []}
    for _ in range(steps):
        rows = torch.randint(len(train_set), (batch_size,), generator=gen).tolist()
        x, y = (torch.stack(t) for t in zip(*(train_set[i] for i in rows)))
        _, loss = model(x, y)
        aux = aux_loss_of(model)
        optimizer.zero_grad()                      # torch 2: grads set to None
        (loss + aux if use_aux_loss else loss).backward()
        optimizer.step()
        history["loss"].append(loss.item())
        history["aux_loss"].append(float(aux.detach()))
        history["tokens_per_expert"].append([m.tokens_per_expert.tolist() for m in layers])
        history["dropped"].append([m.dropped for m in layers])
    return history
