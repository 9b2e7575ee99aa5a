"""The drafter protocol (docs/INTERFACES.md) and the proposal type every drafter kind returns.

Protocol in one line: `observe` hands the drafter the committed positions (tokens, the target's post-norm hidden,
taps); `propose` drafts up to n tokens after the anchor. A drafter keeps only what `observe` gave it, so rejected
rows never leave a trace. Neither needs a host read on a GPU: tokens, hidden states and taps stay on the device,
and a proposal's floor cut may stay there too (`Proposal.keep`); the loop reads once per window (docs/models.md,
"Speculative loop").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from runtime.sampling import SamplingParams


@dataclass
class Proposal:
    """A drafter's rows. From a graph path they are the graph's output buffers: valid until that drafter's next
    replay, which the loop queues only after the window's verify and acceptance have read them (stream order)."""

    tokens: Tensor            # [m] int64, m <= n, on any device (the loop reads them once per window, if at all)
    q: Tensor | None          # [m, V] float32 draft distribution per row (sampling only)
    confidence: Tensor        # [m] float32 (the spec_min_p statistic)
    # 0-d int64 on the device, or None (all m rows): only rows < keep are proposals. A drafter that cuts at the
    # floor on the device returns all rows and this count, so the host reads nothing before the verify window.
    keep: Tensor | None = None


def floor_keep(conf: Tensor, min_p: float | Tensor) -> Tensor:
    """How many drafted rows stay (0-d int64 on conf's device): up to, not including, the first row whose confidence
    is under the floor `min_p` (a float, or a device tensor so that one CUDA graph serves every floor). Made on the
    device, so a window's floor cut needs no host read."""
    ok = (conf >= min_p).to(torch.int32)
    return torch.cumprod(ok, 0).sum().to(torch.long)


@runtime_checkable
class Drafter(Protocol):
    kind: str
    max_block: int
    tap_layers: tuple[int, ...]

    def reset(self) -> None: ...

    def observe(self, tokens: Tensor, hidden: Tensor, taps: Tensor | None, start: int) -> None: ...

    def propose(self, anchor: int, pos: int, n: int, *, min_p: float, sampling: SamplingParams | None,
                generator: torch.Generator | None) -> Proposal: ...
    # Optional, used when present: `draft_ahead(window, hidden, taps, pos, acc, anchor, n, *, min_p, sampling,
    # generator) -> bool` queues the observation of a whole verified window (acc, the accepted count, and anchor,
    # the next anchor, as device tensors) and the next window's proposal before the loop reads the window, and
    # `settle(acc)` then does the host's bookkeeping instead of `observe` (docs/models.md, "Drafting ahead");
    # `make_graphs()` -> a CUDA graph runner for greedy windows (the engine calls it
    # on CUDA), `memory_report()` -> {budget name: bytes} of what the drafter holds, and `use_compiled(root,
    # build=False)` -> "" or why not: a compiled CPU step from the store attached (runtime/drafters/mtp_compiled.py).
