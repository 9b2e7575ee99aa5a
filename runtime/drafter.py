"""The drafter protocol (docs/INTERFACES.md) and the MTP drafter.

Protocol in one line: `observe` hands the drafter the committed positions (tokens, the target's post-norm hidden,
taps); `propose` drafts up to n tokens after the anchor. A drafter keeps only what `observe` gave it, so rejected
rows never leave a trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from runtime.kv import KVCache
from runtime.sampling import SamplingParams, draw, probs


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


class MTPDrafter:
    """Chained MTP drafting over the target's `mtp` head with a private one-layer KV cache.

    Cache slot s holds position p = s + 1 (p = 0 has no g[-1]). Committed entries are rebuilt in one batched
    forward from the target's true hidden states in `observe`; chained entries are dropped after each window,
    except the first step of a window, whose inputs (anchor, g[pos-1]) are already true.
    """

    kind = "mtp"
    tap_layers: tuple[int, ...] = ()

    def __init__(self, model, capacity: int, max_block: int = 16, kv_dtype: torch.dtype | None = None,
                 chunk: int = 512) -> None:
        if model.mtp is None:
            raise ValueError("the target has no MTP head (no mtp.* tensors); choose another drafter.")
        self.model, self.mtp, self.max_block, self.chunk = model, model.mtp, max_block, chunk
        cfg = model.cfg
        p = model.lm_head.weight
        self.kv = KVCache(1, cfg.num_key_value_heads, cfg.head_dim, capacity, dtype=kv_dtype or p.dtype,
                          device=p.device)
        self.logits_buf = torch.zeros(max_block, cfg.vocab_size, dtype=torch.float32, device=p.device)
        self.last_g: Tensor | None = None
        self.next_pos = 0
        self.graphs = None   # runtime.drafter_graphs.MTPGraphs, set by the engine on CUDA (greedy windows)

    def reset(self) -> None:
        self.kv.reset()
        self.last_g, self.next_pos = None, 0

    def _step(self, tok: Tensor, g: Tensor, first_pos: int) -> Tensor:
        """Run rows (tok [n], g [n, H]) at positions first_pos.. into the cache; returns MTP hidden [n, H]."""
        n = tok.shape[0]
        if self.kv.length != first_pos - 1:
            raise RuntimeError(f"MTP cache holds {self.kv.length} entries, position {first_pos} needs {first_pos - 1}.")
        if first_pos - 1 + n > self.kv.capacity:
            raise ValueError(f"MTP cache capacity {self.kv.capacity} exceeded at position {first_pos + n - 1}.")
        pos = torch.arange(first_pos, first_pos + n, device=tok.device)[None]
        emb = self.model.model.embed_tokens(tok)[None]
        h = self.mtp(emb, g[None].to(emb.dtype), pos, self.model.rotary, (self.kv.k[0], self.kv.v[0], self.kv.length))
        self.kv.length += n
        return h[0]

    @torch.no_grad()
    def observe(self, tokens: Tensor, hidden: Tensor, taps: Tensor | None, start: int) -> None:
        n = int(tokens.shape[0])
        if n == 0:
            return
        if start != self.next_pos:
            raise RuntimeError(f"MTP drafter observed position {start}, expected {self.next_pos}.")
        # entries for positions p in [start, start+n): token x[p] with g[p-1]
        g_prev = hidden[:-1] if self.last_g is None else torch.cat((self.last_g[None], hidden[:-1]), 0)
        toks = tokens if self.last_g is not None else tokens[1:]
        first = start if self.last_g is not None else start + 1
        have = self.kv.length            # slots already true (the kept first step of the last window)
        skip = max(0, have - (first - 1))
        if skip:
            g_prev, toks, first = g_prev[skip:], toks[skip:], first + skip
        toks = toks.to(self.kv.k.device)
        if self.graphs is None or not self.graphs.observe_rows(toks, g_prev, first):
            for s in range(0, int(toks.shape[0]), self.chunk):      # chunked like the target's prefill
                self._step(toks[s:s + self.chunk], g_prev[s:s + self.chunk], first + s)
        self.last_g = hidden[-1].detach()
        self.next_pos = start + n

    @torch.no_grad()
    def propose(self, anchor: int, pos: int, n: int, *, min_p: float = 0.0, sampling: SamplingParams | None = None,
                generator: torch.Generator | None = None) -> Proposal:
        if pos != self.next_pos or self.last_g is None:
            raise RuntimeError(f"MTP drafter asked to draft at position {pos}, it has observed up to {self.next_pos}.")
        n = min(n, self.max_block - 1)
        if self.graphs is not None and (sampling is None or sampling.greedy):
            prop = self.graphs.propose(anchor, pos, n, min_p)
            if prop is not None:
                return prop
        committed = self.kv.length
        dev = self.kv.k.device
        tok = torch.tensor([anchor], device=dev)
        g = self.last_g[None]
        out, qs, conf = [], [], []
        for i in range(n):
            h = self._step(tok, g, pos + i)
            if i == 0:
                committed = self.kv.length       # (anchor, g[pos-1]) are true: keep this entry
            lg = self.model.lm_head(h)[0].float()
            self.logits_buf[i].copy_(lg)
            p1 = torch.softmax(lg, -1)
            c = float(p1.max())
            if min_p > 0 and c < min_p:
                break
            if sampling is None or sampling.greedy:
                t = int(torch.argmax(lg))
            else:
                q = probs(lg, sampling)
                t = draw(q, generator)
                qs.append(q)
            out.append(t)
            conf.append(c)
            tok = torch.tensor([t], device=dev)
            g = h
        self.kv.rollback(committed)
        return Proposal(
            tokens=torch.tensor(out, dtype=torch.long),
            q=torch.stack(qs) if qs else None,
            confidence=torch.tensor(conf, dtype=torch.float32),
        )

    def memory_report(self) -> dict[str, int]:
        w = sum(p.numel() * p.element_size() for p in self.mtp.parameters())
        return {"drafter_weights": w, "drafter_kv": self.kv.nbytes,
                "logits": self.logits_buf.numel() * self.logits_buf.element_size()}
