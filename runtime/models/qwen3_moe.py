"""Qwen3-MoE target: the project's single definition of the architecture (training and inference).

Semantics follow transformers' `Qwen3MoeForCausalLM` (docs/models.md, "Qwen3-MoE target"); parameter names are the on-disk Hub names
so `load_state_dict` takes a checkpoint as is. The plain forward (no cache) works under autograd; passing a
`KVCache` turns it into the inference path (static cache, appends at `kv.length`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from runtime.models.layers import DecoderLayer, RMSNorm, Rotary, SparseMoe
from runtime.models.mtp import MTPHead
from runtime.models.target_config import Qwen3MoeConfig


@dataclass
class TargetOutput:
    logits: Tensor | None        # [B, T, V] (or the last `logits_to_keep` rows; None when logits_to_keep < 0)
    hidden: Tensor               # [B, T, H] after the final norm (MTP's g)
    taps: Tensor | None          # [B, T, len(taps)*H]: outputs of decoder layers `taps`, in that order


class Backbone(nn.Module):
    """`model.*`: embeddings, decoder layers, final norm."""

    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, cfg.is_sparse(i)) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, SparseMoe):
                layer.mlp.layer_idx = i


class Qwen3MoeModel(nn.Module):
    """`Qwen3MoeForCausalLM` with Hub parameter names; `mtp` (an `MTPHead`) when the config has one."""

    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(cfg)
        self.mtp = MTPHead(cfg) if cfg.mtp_layers else None

    def forward(self, input_ids: Tensor, positions: Tensor | None = None, kv=None, taps: tuple[int, ...] = (),
                logits_to_keep: int = 0) -> TargetOutput:
        """Full-sequence causal forward (training) or, with `kv` (a `runtime.kv.KVCache`), an inference chunk
        appended at `kv.length` (the cache's length advances by T; roll back with `kv.rollback`).

        logits_to_keep: 0 = logits for all rows, n > 0 = the last n rows, -1 = none.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, time], got shape {tuple(input_ids.shape)}.")
        B, T = input_ids.shape
        start = 0 if kv is None else kv.length
        if kv is not None:
            if B != kv.batch:
                raise ValueError(f"batch {B} does not match the KV cache batch {kv.batch}.")
            if start + T > kv.capacity:
                raise ValueError(f"{start + T} positions exceed the KV cache capacity {kv.capacity}; raise the context.")
        if positions is None:
            positions = torch.arange(start, start + T, device=input_ids.device)[None]
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        wanted = {t: j for j, t in enumerate(taps)}
        tap_out: list[Tensor | None] = [None] * len(taps)
        for i, layer in enumerate(self.model.layers):
            cache = None if kv is None else (kv.layer(i), start)
            x = layer(x, cos, sin, cache)
            if i in wanted:
                tap_out[wanted[i]] = x
        if kv is not None:
            kv.length = start + T
        hidden = self.model.norm(x)
        logits = None
        if logits_to_keep >= 0:
            h = hidden if logits_to_keep == 0 else hidden[:, -logits_to_keep:]
            logits = self.lm_head(h)
        tap_t = torch.cat(tap_out, dim=-1) if taps else None  # type: ignore[arg-type]
        return TargetOutput(logits=logits, hidden=hidden, taps=tap_t)

    def mtp_logits(self, input_ids: Tensor, hidden: Tensor) -> Tensor:
        """Teacher-forced MTP over whole sequences (training): row p-1 of the result is the MTP step at
        position p (embed(x[p]) with g[p-1]) and predicts x[p+1]. Returns [B, T-1, V]."""
        if self.mtp is None:
            raise ValueError("this model has no MTP head (config num_nextn_predict_layers is 0).")
        T = input_ids.shape[1]
        pos = torch.arange(1, T, device=input_ids.device)[None]
        h = self.mtp(self.model.embed_tokens(input_ids[:, 1:]), hidden[:, :-1], pos, self.rotary)
        return self.lm_head(h)
