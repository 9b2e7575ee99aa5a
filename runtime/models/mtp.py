"""MTP head (Qwen3-Next layout, docs/models.md, "MTP head"): one extra decoder layer that predicts token t+2.

Step at position p: h = fc(cat(pre_fc_norm_embedding(embed(x[p])), pre_fc_norm_hidden(g[p-1]))) → layers.0 (causal
attention over the head's own cache, RoPE at p) → norm. Embeddings and lm_head are the target's (shared).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from runtime.kv import LayerKV
from runtime.models.layers import DecoderLayer, RMSNorm, Rotary
from runtime.models.target_config import Qwen3MoeConfig


class MTPHead(nn.Module):
    """Parameters `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.fc`, `mtp.layers.0.*`, `mtp.norm`."""

    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(cfg, cfg.mtp_sparse)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        mlp = self.layers[0].mlp
        if hasattr(mlp, "layer_idx"):
            mlp.layer_idx = cfg.num_hidden_layers   # the expert cache addresses the MTP layer after the target's

    def forward(self, emb: Tensor, g: Tensor, positions: Tensor, rotary: Rotary,
                cache: tuple[LayerKV, int] | None = None) -> Tensor:
        """emb = embed(x[p]) [B, T, H], g = target hidden after final norm at p-1 [B, T, H] (or the previous
        MTP output when chaining), positions p [B or 1, T]. Without `cache`: causal over the T rows (training).
        With cache = (a KV cache layer, start): rows written at slots start.. and attention over slots 0..start+T-1.
        Returns the output after `mtp.norm` [B, T, H]."""
        x = self.fc(torch.cat((self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(g)), dim=-1))
        cos, sin = rotary(positions, x.dtype)
        x = self.layers[0](x, cos, sin, cache)
        return self.norm(x)
