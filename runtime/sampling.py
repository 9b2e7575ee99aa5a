"""Sampling parameters and the one definition of "the distribution we sample from" (temperature, top-k, top-p).

Target and drafters both go through `probs`, so the draft distribution q and the target distribution p are
processed identically, which is what lossless rejection sampling requires.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from runtime.errors import UsageError

# the sampled acceptance's CUDA graphs kept per device (runtime/speculative.py `_SampledRule`; the least recently
# used is dropped: a server's requests may each bring their own temperature); the budget counts their pools
# (setup_wizard/budget.py `sampling_graph_bytes`)
RULE_GRAPHS_KEPT = 4


@dataclass
class SamplingParams:
    temperature: float = 0.0   # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0             # 0 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise UsageError(f"temperature must be >= 0, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise UsageError(f"top_k must be >= 0, got {self.top_k}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs(logits: Tensor, sp: SamplingParams) -> Tensor:
    """fp32 probabilities [..., V] after temperature, top-k, then top-p (nucleus keeps at least one token)."""
    x = logits.float() / max(sp.temperature, 1e-6)
    if sp.top_k and sp.top_k < x.shape[-1]:
        kth = torch.topk(x, sp.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if sp.top_p < 1.0:
        sp_, idx = torch.sort(p, dim=-1, descending=True)
        cum = torch.cumsum(sp_, dim=-1)
        drop_sorted = (cum - sp_) >= sp.top_p          # mass before this token already reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        p = p.masked_fill(drop, 0.0)
        p = p / p.sum(dim=-1, keepdim=True)
    return p


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A generator on `device`, seeded from `seed` (or from fresh entropy when None)."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed))
    return g


def gumbel_pick(logp: Tensor, u: Tensor) -> Tensor:
    """argmax(logp + g) with Gumbel noise g = -log(-log(u)) from uniforms u in [0, 1) (same shape): a draw from
    softmax(logp) along the last dim (from p itself when logp = log p; -inf entries are never drawn). The randomness
    comes in as a tensor filled before the call, so a CUDA graph can hold the draw itself."""
    return torch.argmax(logp - torch.log(-torch.log(u)), dim=-1)


def sampling_key(sp: SamplingParams | None) -> tuple | None:
    """What a captured sampler depends on (the seed is not: the noise is filled outside the graph)."""
    return None if sp is None or sp.greedy else (sp.temperature, sp.top_k, sp.top_p)


def draw(p: Tensor, generator: torch.Generator | None) -> int:
    """One token id from a probability row [V]."""
    return int(torch.multinomial(p, 1, generator=generator).item())


def pick(logits: Tensor, sp: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy argmax or a draw from `probs` (one row [V])."""
    if sp.greedy:
        return int(torch.argmax(logits).item())
    return draw(probs(logits, sp), generator)
