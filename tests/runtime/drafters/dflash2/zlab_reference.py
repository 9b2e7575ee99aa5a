"""An independent transcription of z-lab's DFlash2 reference drafter (z-lab/dflash, `dflash/model.py`), for tests.

Written from the public reference's behaviour, not from this project's runtime: nothing here imports
`runtime.drafters`. The config goes through transformers' own `Qwen3Config`, as the reference's does, so its
defaults are the reference's defaults (`use_sliding_window` False, which also clears `sliding_window`;
`layer_types` derived from `max_window_layers`; no `is_causal` attribute unless the file has one). What the
reference does, step by step:

- Context features: `hidden_norm(fc(concat of the tapped target layers' outputs))`.
- Per layer: `x + conv1(attn(conv0(input_layernorm(x))))`, then `x + conv1'(mlp(conv0'(post_norm(x))))`. Only the
  block rows go through the norms and convolutions; the context features feed attention keys and values directly.
- Attention: queries from the block rows; keys and values from [context rows; block rows], keys and queries
  through their per-head RMSNorm, then RoPE at absolute positions. Keys/values are appended to a per-layer cache
  that the caller crops back to the committed length after each draft (block rows are never kept).
- A layer is causal when the config says `is_causal`; without that key, exactly the "sliding_attention" layers
  are causal. Such a layer's window is `sliding_window` (which may be None). With neither causality nor a window
  there is no mask at all. Otherwise query i (aligned to the end of the keys) sees key j when
  j <= i (causal), i - j < window, and, for a non-causal windowed layer, j - i < window too.
- Grouped dynamic convolution over the block rows: groups of `conv_group_size` channels; offsets 0..K-1 read the
  row `offset` above (zeros before the first row); each offset adds a static per-channel kernel and a dynamic
  per-group scalar predicted from the row by `kernel_projection` (two halves: before and after the sub-block).
- Logits: `lm_head(h) * output_multiplier`, then `cap * tanh(logits / cap)` when a positive softcap is set.
- Candidate selector (greedy): top-k of each row's logits; the walk starts from the anchor token; row r scores
  candidate c as `logit[c] + sum_r pred_codebook[prev] * hidden_projection(h_r) * succ_codebook[c]`; argmax; the
  chosen candidate becomes `prev`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half


def reference_config(config_json: dict) -> Qwen3Config:
    """The config object the reference builds from a drafter's config.json."""
    return Qwen3Config(**config_json)


def draft_setting(config: Qwen3Config, name: str, default=None):
    """`dflash_config` first, then the top-level attribute."""
    sub = getattr(config, "dflash_config", None) or {}
    return sub.get(name, getattr(config, name, default))


def layer_attention(config: Qwen3Config, i: int) -> tuple[bool, int | None]:
    """(causal, window) of draft layer i, by the reference's rule."""
    kinds = getattr(config, "layer_types", None)
    kind = kinds[i] if kinds else "full_attention"
    explicit = getattr(config, "is_causal", None)
    causal = (kind == "sliding_attention") if explicit is None else bool(explicit)
    return causal, (config.sliding_window if kind == "sliding_attention" else None)


def visibility(n_query: int, n_key: int, causal: bool, window: int | None) -> Tensor | None:
    """Bool [n_query, n_key]; queries are the last n_query key positions. None: everything visible."""
    if not causal and window is None:
        return None
    qi = torch.arange(n_key - n_query, n_key)[:, None]
    kj = torch.arange(n_key)[None, :]
    ok = torch.ones(n_query, n_key, dtype=torch.bool)
    if causal:
        ok = ok & (kj <= qi)
    if window is not None:
        ok = ok & (qi - kj < window)
        if not causal:
            ok = ok & (kj - qi < window)
    return ok


class LayerCache:
    """Per-layer keys/values (after norm and RoPE), cropped by the caller."""

    def __init__(self, n_layers: int) -> None:
        self.k: list[Tensor | None] = [None] * n_layers
        self.v: list[Tensor | None] = [None] * n_layers

    def extend(self, i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.k[i] is not None:
            k, v = torch.cat([self.k[i], k], dim=2), torch.cat([self.v[i], v], dim=2)
        self.k[i], self.v[i] = k, v
        return k, v

    def length(self) -> int:
        return 0 if self.k[0] is None else int(self.k[0].shape[2])

    def crop(self, n: int) -> None:
        for i in range(len(self.k)):
            if self.k[i] is not None:
                self.k[i], self.v[i] = self.k[i][:, :, :n], self.v[i][:, :, :n]


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, heads, T, hd] with cos/sin [B, T', hd] whose last T rows belong to x."""
    T = x.shape[2]
    c, s = cos[:, None, -T:], sin[:, None, -T:]
    return x * c + rotate_half(x) * s


class RefAttention(nn.Module):
    def __init__(self, config: Qwen3Config, i: int) -> None:
        super().__init__()
        self.i = i
        H = config.hidden_size
        self.n_heads, self.n_kv = config.num_attention_heads, config.num_key_value_heads
        self.hd = getattr(config, "head_dim", None) or H // self.n_heads
        bias = config.attention_bias
        self.q_proj = nn.Linear(H, self.n_heads * self.hd, bias=bias)
        self.k_proj = nn.Linear(H, self.n_kv * self.hd, bias=bias)
        self.v_proj = nn.Linear(H, self.n_kv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.hd, H, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.hd, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.hd, eps=config.rms_norm_eps)
        self.causal, self.window = layer_attention(config, i)

    def forward(self, block: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor, cache: LayerCache | None) -> Tensor:
        B, T, _ = block.shape
        C = ctx.shape[1]
        q = self.q_norm(self.q_proj(block).view(B, T, self.n_heads, self.hd)).transpose(1, 2)
        k = torch.cat([self.k_proj(ctx), self.k_proj(block)], dim=1).view(B, C + T, self.n_kv, self.hd)
        v = torch.cat([self.v_proj(ctx), self.v_proj(block)], dim=1).view(B, C + T, self.n_kv, self.hd)
        k = self.k_norm(k).transpose(1, 2)
        v = v.transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if cache is not None:
            k, v = cache.extend(self.i, k, v)
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        att = (q.float() @ k.float().transpose(-1, -2)) * self.hd ** -0.5
        ok = visibility(T, k.shape[2], self.causal, self.window)
        if ok is not None:
            att = att.masked_fill(~ok, float("-inf"))
        out = (torch.softmax(att, dim=-1) @ v.float()).to(block.dtype)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


def grouped_convolve(h: Tensor, dyn: Tensor, base: Tensor, group: int) -> Tensor:
    """h [B, T, H]; dyn [B, T, K, groups]; base [K, H]."""
    B, T, H = h.shape
    K, groups = base.shape[0], H // group
    x = h.view(B, T, groups, group)
    out = torch.zeros_like(x)
    for off in range(K):
        shifted = x if off == 0 else torch.cat([torch.zeros_like(x[:, :off]), x[:, : T - off]], dim=1)
        out = out + base[off].view(1, 1, groups, group).to(h.dtype) * shifted
        out = out + dyn[:, :, off].view(B, T, groups, 1) * shifted
    return out.view(B, T, H)


class RefConv(nn.Module):
    def __init__(self, H: int, K: int, group: int) -> None:
        super().__init__()
        self.K, self.group = K, group
        self.base_kernel = nn.Parameter(torch.zeros(2, K, H))
        self.kernel_projection = nn.Linear(H, 2 * K * (H // group), bias=False)

    def before(self, h: Tensor) -> tuple[Tensor, Tensor]:
        dyn = self.kernel_projection(h).view(*h.shape[:-1], 2, self.K, h.shape[-1] // self.group)
        return grouped_convolve(h, dyn[..., 0, :, :], self.base_kernel[0], self.group), dyn[..., 1, :, :]

    def after(self, h: Tensor, dyn: Tensor) -> Tensor:
        return grouped_convolve(h, dyn, self.base_kernel[1], self.group)


class RefLayer(nn.Module):
    def __init__(self, config: Qwen3Config, i: int, with_conv: bool) -> None:
        super().__init__()
        H = config.hidden_size
        self.self_attn = RefAttention(config, i)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        K, G = int(draft_setting(config, "conv_kernel_size", 2)), int(draft_setting(config, "conv_group_size", 16))
        self.attention_conv = RefConv(H, K, G) if with_conv else None
        self.mlp_conv = RefConv(H, K, G) if with_conv else None

    def forward(self, x: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor, cache: LayerCache | None) -> Tensor:
        h = self.input_layernorm(x)
        if self.attention_conv is not None:
            h, d = self.attention_conv.before(h)
        h = self.self_attn(h, ctx, cos, sin, cache)
        if self.attention_conv is not None:
            h = self.attention_conv.after(h, d)
        x = x + h
        h = self.post_attention_layernorm(x)
        if self.mlp_conv is not None:
            h, d = self.mlp_conv.before(h)
        h = self.mlp(h)
        if self.mlp_conv is not None:
            h = self.mlp_conv.after(h, d)
        return x + h


class RefSelector(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        rank = int(draft_setting(config, "selector_rank"))
        self.top_k = int(draft_setting(config, "selector_top_k"))
        self.predecessor_codebook = nn.Embedding(config.vocab_size, rank)
        self.successor_codebook = nn.Embedding(config.vocab_size, rank)
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    def greedy(self, h: Tensor, logits: Tensor, anchor: Tensor) -> Tensor:
        """h [B, R, H], logits [B, R, V], anchor [B] -> tokens [B, R]."""
        unary, cand = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        hp = self.hidden_projection(h)
        prev, out = anchor, []
        for r in range(h.shape[1]):
            pair = ((self.predecessor_codebook(prev) * hp[:, r])[:, None, :]
                    * self.successor_codebook(cand[:, r])).sum(-1)
            pick = torch.argmax(unary[:, r] + pair, dim=-1)
            prev = cand[:, r].gather(-1, pick[:, None])[:, 0]
            out.append(prev)
        return torch.stack(out, dim=1)


class RefDFlash2(nn.Module):
    """The reference drafter; `load_state_dict(checkpoint_names(state))` takes a checkpoint."""

    def __init__(self, config: Qwen3Config, *, v1: bool = False) -> None:
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.taps = list(draft_setting(config, "target_layer_ids"))
        self.layers = nn.ModuleList(RefLayer(config, i, not v1) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(self.taps) * H, H, bias=False)
        self.hidden_norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.block_size = int(draft_setting(config, "block_size", 16))
        self.mask_token_id = int(draft_setting(config, "mask_token_id"))
        self.candidate_selector = None if v1 else RefSelector(config)

    @staticmethod
    def checkpoint_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Checkpoint codebooks are plain tensors; here they are embeddings (`.weight`)."""
        return {(k + ".weight" if k.endswith("_codebook") else k): v for k, v in state.items()}

    def forward(self, ctx_taps: Tensor, noise: Tensor, positions: Tensor, cache: LayerCache | None) -> Tensor:
        """ctx_taps [B, C, T*H] (new context rows), noise [B, W, H] (embedded block), positions [B, C + W]."""
        ctx = self.hidden_norm(self.fc(ctx_taps))
        cos, sin = self.rotary_emb(noise, positions)
        x = noise
        for layer in self.layers:
            x = layer(x, ctx, cos, sin, cache)
        return self.norm(x)

    def logits(self, h: Tensor, lm_head: nn.Module) -> Tensor:
        out = lm_head(h) * float(draft_setting(self.config, "output_multiplier", 1.0))
        cap = draft_setting(self.config, "final_logit_softcapping")
        if cap is not None and float(cap) > 0:
            out = torch.tanh(out / float(cap)) * float(cap)
        return out


class RefDrafting:
    """The reference's drafting steps around one draft cache: each window runs the new context rows (taps of the
    tokens committed since the last window) with the block [anchor, mask, ...], then crops the cache to the
    committed length (the block's own keys are dropped)."""

    def __init__(self, model: RefDFlash2, embed_weight: Tensor, lm_head: nn.Module, scale: float = 1.0) -> None:
        self.model, self.embed_weight, self.lm_head, self.scale = model, embed_weight, lm_head, scale
        self.cache = LayerCache(len(model.layers))

    @torch.no_grad()
    def window(self, new_taps: Tensor, anchor: int, start: int, width: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """new_taps [C, T*H] of positions start-C..start-1; the block sits at start..start+width-1.
        Returns (hidden rows 1.. [width-1, H], logits [width-1, V], greedy selector tokens [width-1] or None)."""
        m = self.model
        C = new_taps.shape[0]
        ids = torch.full((1, width), m.mask_token_id, dtype=torch.long)
        ids[0, 0] = anchor
        noise = F.embedding(ids, self.embed_weight) * self.scale
        positions = torch.arange(start - C, start + width)[None]
        h = m(new_taps[None].to(noise.dtype), noise, positions, self.cache)[:, 1:]
        self.cache.crop(start)
        logits = m.logits(h, self.lm_head)
        toks = None
        if m.candidate_selector is not None:
            toks = m.candidate_selector.greedy(h, logits, torch.tensor([anchor]))[0]
        return h[0], logits[0], toks
