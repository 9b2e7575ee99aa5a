"""The drafter protocol (docs/INTERFACES.md) and the proposal type every drafter kind returns.

Protocol in one line: `observe` hands the drafter the committed positions (tokens, the target's post-norm hidden,
taps); `propose` drafts up to n tokens after the anchor. A drafter keeps only what `observe` gave it, so rejected
rows never leave a trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from runtime.sampling import SamplingParams


@dataclass
class Proposal:
    tokens: Tensor            # [m] int64, m <= n
    q: Tensor | None          # [m, V] float32 draft distribution per row (sampling only)
    confidence: Tensor        # [m] float32 (the spec_min_p statistic)


@runtime_checkable
class Drafter(Protocol):
    kind: str
    max_block: int
    tap_layers: tuple[int, ...]

    def reset(self) -> None: ...

    def observe(self, tokens: Tensor, hidden: Tensor, taps: Tensor | None, start: int) -> None: ...

    def propose(self, anchor: int, pos: int, n: int, *, min_p: float, sampling: SamplingParams | None,
                generator: torch.Generator | None) -> Proposal: ...
    # Optional, used when present: `make_graphs()` -> a CUDA graph runner for greedy windows (the engine calls it
    # on CUDA) and `memory_report()` -> {budget name: bytes} of what the drafter holds.
