"""DFlash2 block-diffusion drafter (docs/models.md, "DFlash2 drafter"): the single definition, for training and for inference.

Reference semantics: `DFlash2DraftModel` / `dflash_generate` in z-lab/dflash `dflash/model.py`. Parameter names are
the checkpoint's names (`fc.weight`, `layers.i.self_attn.q_proj.weight`, `candidate_selector.successor_codebook`,
...), so `load_state_dict` takes an HF checkpoint as is. The drafter has no embedding and no output head: the
target's `embed_tokens` and `lm_head` are passed in (never copied).

Training (autograd): `DFlash2Model.forward` runs a batch of windows, each with its own context of target taps
(earlier positions), returning logits and `hs`; `selector_scores` gives the selector's candidate scores for a loss.
Inference: `ContextCache` holds each layer's private context K/V; `DFlash2Model.draft_hidden` runs one window
against it; `select_walk` is the selector walk (greedy or sampled).

Choices the contract leaves open: the top-k candidates are sorted (the reference asks for unsorted; only ties
can differ); masks follow the reference's `_attention_mask` per layer (`DFlash2Geometry.layer_causal` and
`layer_window`: a sliding window is two-sided unless the layer is causal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.drafters.base import floor_keep
from runtime.drafters.dflash2.contract import DFlash2Geometry
from runtime.models.cpu_rows import ln_weight, rms_ln
from runtime.models.layers import MLP, apply_rope  # the target's SiLU MLP and RoPE, one definition
from runtime.sampling import SamplingParams, probs

# ----------------------------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in fp32, scale in the input dtype. Unlike the target's (transformers' exact
    `weight * x`, which type-promotes), the weight is cast to the activations' dtype first, so the output keeps
    the activations' dtype whatever dtype the norm tensor was loaded in."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dt = x.dtype
        if dt == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled():
            # inference on a CPU: one layer_norm (cpu_rows.rms_ln) instead of about nine ops; drafts need no bits
            return rms_ln(x, ln_weight(self, dt), self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(dt) * xf.to(dt)


class Rotary(nn.Module):
    """cos/sin for absolute positions (default RoPE, or linear scaling)."""

    def __init__(self, geom: DFlash2Geometry) -> None:
        super().__init__()
        hd = geom.head_dim
        # computed on the CPU even under a `torch.device("meta")` context (loading builds skeletons that way)
        inv = 1.0 / (geom.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device="cpu") / hd))
        if geom.rope_scaling is not None:
            inv = inv / geom.rope_scaling[1]
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class GroupedDynamicCausalConv(nn.Module):
    """docs/models.md ("DFlash2 drafter", step 4): causal convolution over the block rows with a base kernel plus a dynamic, per-row,
    per-group (G channels share one value) kernel predicted from the input. Row t reads rows t-o (o < K) of the
    same window only; rows before the window start read zeros."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * self.groups, bias=False)

    def conv(self, h: Tensor, dyn: Tensor, base: Tensor) -> Tensor:
        """h [B, W, H]; dyn [B, W, K, H/G]; base [K, H] -> [B, W, H]."""
        B, W, H = h.shape
        blocks = h.reshape(B, W, self.groups, self.group_size)
        if not torch.is_grad_enabled() and h.device.type == "cpu":
            # CPU inference: each tap's kernel (base + dynamic) made at once, then one product a tap, the shifted
            # ones added in place (1 + K ops, not about 5 K: a CPU pays per op); the same sum in another order (the
            # GPU's eager path keeps the loop, whose bits its one-launch kernel reproduces)
            w = base.to(h.dtype).view(1, 1, self.kernel_size, self.groups, self.group_size) + dyn[..., None]
            out = w[:, :, 0] * blocks
            for o in range(1, min(self.kernel_size, W)):
                out[:, o:].addcmul_(w[:, o:, o], blocks[:, :W - o])
            return out.reshape(B, W, H)
        out = torch.zeros_like(blocks)
        for o in range(min(self.kernel_size, W)):     # an offset past the window start reads only zeros
            vals = blocks if o == 0 else F.pad(blocks[:, : W - o], (0, 0, 0, 0, o, 0))
            out = out + base[o].to(h.dtype).view(1, 1, self.groups, self.group_size) * vals
            out = out + dyn[:, :, o, :, None] * vals
        return out.reshape(B, W, H)

    def prepare(self, h: Tensor) -> tuple[Tensor, Tensor]:
        dyn = self.kernel_projection(h).view(*h.shape[:-1], 2, self.kernel_size, self.groups)
        return self.conv(h, dyn[:, :, 0], self.base_kernel[0]), dyn[:, :, 1]

    def finish(self, h: Tensor, dyn1: Tensor) -> Tensor:
        return self.conv(h, dyn1, self.base_kernel[1])


class DraftAttention(nn.Module):
    def __init__(self, geom: DFlash2Geometry) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = geom.num_heads, geom.num_kv_heads, geom.head_dim
        H = geom.hidden_size
        self.q_proj = nn.Linear(H, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(H, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(H, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, H, bias=False)
        self.q_norm = RMSNorm(self.hd, geom.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, geom.rms_norm_eps)

    def kv(self, c: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """k = rope(k_norm(k_proj(c))), v = v_proj(c): c [B, T, H] -> [B, nkv, T, hd] each."""
        B, T, _ = c.shape
        k = self.k_norm(self.k_proj(c).view(B, T, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(c).view(B, T, self.nkv, self.hd).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, y: Tensor, cos: Tensor, sin: Tensor, ctx_k: Tensor, ctx_v: Tensor,
                mask: Tensor | None, block_slots: bool = False) -> Tensor:
        """Block rows y [B, W, H] attend to the context K/V [B or 1, nkv, C, hd] and to the block itself.
        `block_slots`: ctx_k/ctx_v (batch 1) end with W spare slots of the cache, where the block's K/V are written
        (no copy of the whole context each layer, as a concatenation makes)."""
        B, W, _ = y.shape
        q = apply_rope(self.q_norm(self.q_proj(y).view(B, W, self.nh, self.hd)).transpose(1, 2), cos, sin)
        kb, vb = self.kv(y, cos, sin)
        if block_slots and B == 1:
            ctx_k[:, :, -W:] = kb
            ctx_v[:, :, -W:] = vb
            keys, vals = ctx_k.to(q.dtype), ctx_v.to(q.dtype)
        else:
            keys = torch.cat([ctx_k.to(q.dtype).expand(B, -1, -1, -1), kb], dim=2)
            vals = torch.cat([ctx_v.to(q.dtype).expand(B, -1, -1, -1), vb], dim=2)
        o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=self.hd**-0.5,
                                           enable_gqa=self.nkv != self.nh)
        return self.o_proj(o.transpose(1, 2).reshape(B, W, self.nh * self.hd))


class DraftLayer(nn.Module):
    def __init__(self, geom: DFlash2Geometry, idx: int, v1: bool) -> None:
        super().__init__()
        H = geom.hidden_size
        self.window = geom.layer_window(idx)
        self.causal = geom.layer_causal(idx)
        self.input_layernorm = RMSNorm(H, geom.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, geom.rms_norm_eps)
        self.self_attn = DraftAttention(geom)
        self.mlp = MLP(H, geom.intermediate_size)
        self.attention_conv: GroupedDynamicCausalConv | None = None
        self.mlp_conv: GroupedDynamicCausalConv | None = None
        if not v1:
            self.attention_conv = GroupedDynamicCausalConv(H, geom.conv_kernel_size, geom.conv_group_size)
            self.mlp_conv = GroupedDynamicCausalConv(H, geom.conv_kernel_size, geom.conv_group_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx_k: Tensor, ctx_v: Tensor,
                mask: Tensor | None, block_slots: bool = False) -> Tensor:
        y = self.input_layernorm(x)
        d = None
        if self.attention_conv is not None:
            y, d = self.attention_conv.prepare(y)
        y = self.self_attn(y, cos, sin, ctx_k, ctx_v, mask, block_slots)
        if self.attention_conv is not None:
            y = self.attention_conv.finish(y, d)
        x = x + y
        y = self.post_attention_layernorm(x)
        if self.mlp_conv is not None:
            y, d = self.mlp_conv.prepare(y)
        y = self.mlp(y)
        if self.mlp_conv is not None:
            y = self.mlp_conv.finish(y, d)
        return x + y


class CandidateSelector(nn.Module):
    def __init__(self, geom: DFlash2Geometry) -> None:
        super().__init__()
        self.top_k = geom.selector_top_k
        self.hidden_projection = nn.Linear(geom.hidden_size, geom.selector_rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(geom.vocab_size, geom.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(geom.vocab_size, geom.selector_rank))

    def pair_scores(self, hp: Tensor, prev: Tensor, cand: Tensor) -> Tensor:
        """Σ_r pred[prev, r] * hp[..., r] * succ[cand, r]: hp [..., r], prev [...], cand [..., k] -> [..., k]."""
        a = self.predecessor_codebook[prev].to(hp.dtype) * hp
        return torch.einsum("...r,...kr->...k", a, self.successor_codebook[cand].to(hp.dtype))


# ----------------------------------------------------------------------------------------------------- the model


@dataclass
class DraftOutput:
    logits: Tensor | None   # [B, W-1, V]: rows 1.. of the window (positions P+1..), after multiplier and softcap
    hs: Tensor              # [B, W-1, H]: norm(x)[1:], the selector's input


def _visible(q_pos: Tensor, k_pos: Tensor, causal: bool, window: int | None) -> Tensor | None:
    """Bool [B, 1, W, S] mask by absolute positions (the reference's `_attention_mask`), None when all visible."""
    if not causal and window is None:
        return None
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]
    vis = torch.ones(torch.broadcast_shapes(qp.shape, kp.shape), dtype=torch.bool, device=q_pos.device)
    if causal:
        vis = vis & (kp <= qp)
    if window is not None:
        vis = vis & (qp - kp < window)
        if not causal:
            vis = vis & (kp - qp < window)
    return vis[:, None]


class DFlash2Model(nn.Module):
    """The drafter's own weights (81 tensors for L=5; v1: no convolution and no selector)."""

    def __init__(self, geom: DFlash2Geometry, *, v1: bool = False) -> None:
        super().__init__()
        self.geom, self.v1 = geom, v1
        H = geom.hidden_size
        self.fc = nn.Linear(geom.num_taps * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, geom.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(geom, i, v1) for i in range(geom.num_layers))
        self.norm = RMSNorm(H, geom.rms_norm_eps)
        self.candidate_selector = None if v1 else CandidateSelector(geom)
        self.rotary = Rotary(geom)

    # -- shared pieces ------------------------------------------------------------------------------------------
    def context_features(self, taps: Tensor) -> Tensor:
        """c = hidden_norm(fc(taps)): taps [..., T*H] (raw target layer outputs, concatenated) -> [..., H]."""
        return self.hidden_norm(self.fc(taps.to(self.dtype)))

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype if self.norm.weight.is_floating_point() else torch.float32

    def block_input(self, block_ids: Tensor, embed: nn.Module | Tensor) -> Tensor:
        """x = embed(ids) * input_embedding_scale; `embed` is the target's embedding module or weight."""
        w = embed if isinstance(embed, Tensor) else None
        e = F.embedding(block_ids, w) if w is not None else embed(block_ids)
        return e.to(self.dtype) * self.geom.input_embedding_scale

    def compute_logits(self, hs: Tensor, lm_head: nn.Module) -> Tensor:
        """lm_head(hs) * output_multiplier, then tanh(l / cap) * cap when a softcap is set."""
        w = getattr(lm_head, "weight", None)
        if isinstance(w, Tensor) and w.is_floating_point():
            hs = hs.to(w.dtype)
        logits = lm_head(hs).float() * self.geom.output_multiplier
        cap = self.geom.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _run_layers(self, x: Tensor, q_pos: Tensor, ctx: list[tuple[Tensor, Tensor]], k_pos: Tensor,
                    k_valid: Tensor | None, block_slots: bool = False) -> Tensor:
        cos, sin = self.rotary(q_pos, x.dtype)
        masks: dict[tuple[int | None, bool], Tensor | None] = {}
        for layer, (ck, cv) in zip(self.layers, ctx, strict=True):
            key = (layer.window, layer.causal)
            if key not in masks:
                m = _visible(q_pos, k_pos, layer.causal, layer.window)
                if k_valid is not None:
                    kv_m = k_valid[:, None, None, :]
                    m = kv_m if m is None else (m & kv_m)
                masks[key] = m
            x = layer(x, cos, sin, ck, cv, masks[key], block_slots)
        return self.norm(x)

    # -- training ----------------------------------------------------------------------------------------------
    def forward(self, ctx_taps: Tensor, ctx_positions: Tensor, block_ids: Tensor, block_positions: Tensor, *,
                embed: nn.Module | Tensor, lm_head: nn.Module | None, ctx_lengths: Tensor | None = None,
                ctx_mask: Tensor | None = None, ctx_index: Tensor | None = None) -> DraftOutput:
        """A batch of B windows under autograd.

        ctx_taps [B or 1, C, T*H]: raw target taps of context positions (one shared context may serve all
        windows: pass batch 1 and a per-window `ctx_lengths` or `ctx_mask`), or [S, C, T*H] with `ctx_index` [B]
        (window b uses context row ctx_index[b]: fc and the context K/V are computed once per sequence, not once
        per window). ctx_positions [B or 1 or S, C] or [C]: their absolute positions. block_ids [B, W]: the anchor then mask tokens (or anything, for training
        variants). block_positions [B, W] or [W]: absolute positions (P..P+W-1). ctx_lengths [B]: window b sees
        context rows 0..ctx_lengths[b]-1; ctx_mask [B, C] bool: True where a context row is visible (use one).
        lm_head None skips the logits (compute them later with `compute_logits`).
        """
        B, W = block_ids.shape
        C = ctx_taps.shape[1]
        dev = block_ids.device
        if ctx_positions.dim() == 1:
            ctx_positions = ctx_positions[None]
        if block_positions.dim() == 1:
            block_positions = block_positions[None].expand(B, W)
        valid = None
        if ctx_lengths is not None:
            valid = torch.arange(C, device=dev)[None, :] < ctx_lengths.to(dev)[:, None]
        if ctx_mask is not None:
            valid = ctx_mask.to(dev, torch.bool) if valid is None else valid & ctx_mask.to(dev, torch.bool)
        k_valid = None
        if valid is not None:
            k_valid = torch.cat([valid.expand(B, C), torch.ones(B, W, dtype=torch.bool, device=dev)], dim=1)
        c = self.context_features(ctx_taps)
        ccos, csin = self.rotary(ctx_positions, c.dtype)
        ctx = [layer.self_attn.kv(c, ccos, csin) for layer in self.layers]
        if ctx_index is not None:
            idx = ctx_index.to(dev)
            ctx = [(k[idx], v[idx]) for k, v in ctx]
            if ctx_positions.shape[0] > 1:
                ctx_positions = ctx_positions[idx]
        k_pos = torch.cat([ctx_positions.expand(B, C), block_positions], dim=1)
        x = self.block_input(block_ids, embed)
        h = self._run_layers(x, block_positions, ctx, k_pos, k_valid)
        hs = h[:, 1:]
        return DraftOutput(logits=None if lm_head is None else self.compute_logits(hs, lm_head), hs=hs)

    def selector_scores(self, hs: Tensor, logits: Tensor, prev_ids: Tensor,
                        candidates: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Teacher-forced selector scores for a loss: hs [B, R, H], logits [B, R, V], prev_ids [B, R] (the
        token before each row: the anchor for row 0, then the true tokens), candidates [B, R, k] (default: the
        top-k of `logits`). Returns (scores [B, R, k] = unary + pair term, candidates [B, R, k])."""
        sel = self._selector()
        if candidates is None:
            candidates = torch.topk(logits, sel.top_k, dim=-1).indices
        unary = logits.gather(-1, candidates)
        hp = sel.hidden_projection(hs)
        return unary + sel.pair_scores(hp, prev_ids, candidates).to(unary.dtype), candidates

    def _selector(self) -> CandidateSelector:
        if self.candidate_selector is None:
            raise ValueError("this drafter has the v1 layout (no candidate selector).")
        return self.candidate_selector

    # -- inference ---------------------------------------------------------------------------------------------
    def draft_hidden(self, anchor: int, pos: int, width: int, cache: ContextCache, embed: nn.Module | Tensor,
                     mask_token_id: int | None = None) -> Tensor:
        """One window [anchor, mask, ..., mask] at positions pos..pos+width-1 against the cached context:
        returns hs [width-1, H] (block K/V are never stored)."""
        dev = cache.k.device
        mask_id = self.geom.mask_token_id if mask_token_id is None else mask_token_id
        ids = torch.full((1, width), mask_id, dtype=torch.long, device=dev)
        ids[0, 0] = anchor
        q_pos = torch.arange(pos, pos + width, device=dev)[None]
        lo = 0
        windows = [layer.window for layer in self.layers]
        if all(w is not None for w in windows):
            lo = max(0, pos - max(windows) + 1)   # nothing older is visible to any row
        n = cache.length
        # the block's K/V go in the cache's spare slots past the context when it has them (never committed)
        slots = n + width <= cache.capacity and cache.k.dtype == self.dtype
        end = n + width if slots else n
        ctx = [(cache.k[i, None, :, lo:end], cache.v[i, None, :, lo:end]) for i in range(len(self.layers))]
        k_pos = torch.cat([torch.arange(lo, n, device=dev), q_pos[0]])[None]
        return self._run_layers(self.block_input(ids, embed), q_pos, ctx, k_pos, None, slots)[0, 1:]


class ContextCache:
    """Each draft layer's private K/V of the committed context positions 0..length-1 (static buffers)."""

    def __init__(self, model: DFlash2Model, capacity: int, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        g = model.geom
        shape = (g.num_layers, g.num_kv_heads, capacity, g.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity, self.length = capacity, 0

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate the draft context to {length}: it holds {self.length} positions.")
        self.length = length

    @torch.no_grad()
    def append(self, model: DFlash2Model, taps: Tensor, start: int) -> None:
        """Add committed positions start..start+n-1 from their taps [n, T*H] (re-observing a suffix replaces it)."""
        n = taps.shape[0]
        if start > self.length:
            raise ValueError(f"draft context gap: holds {self.length} positions, asked to add at {start}.")
        if start + n > self.capacity:
            raise ValueError(f"{start + n} positions exceed the drafter's context capacity {self.capacity}; "
                             "raise the context.")
        self.length = start
        if n == 0:
            return
        c = model.context_features(taps.to(self.k.device)[None])
        pos = torch.arange(start, start + n, device=self.k.device)[None]
        cos, sin = model.rotary(pos, c.dtype)
        for i, layer in enumerate(model.layers):
            k, v = layer.self_attn.kv(c, cos, sin)
            self.k[i, :, start:start + n] = k[0].to(self.k.dtype)
            self.v[i, :, start:start + n] = v[0].to(self.v.dtype)
        self.length = start + n


# ------------------------------------------------------------------------------------------------ selector walk


@dataclass
class Walk:
    tokens: Tensor            # [m] int64
    confidence: Tensor        # [m] float32: selector softmax at T=1 of the chosen candidate
    q: Tensor | None          # [m, V] float32 (sampling only): softmax(score / T) over the candidates, 0 elsewhere
    keep: Tensor | None = None   # `cut=False`: all rows returned, only the first `keep` (0-d, device) pass the floor


@torch.no_grad()
def select_walk(selector: CandidateSelector, hs: Tensor, logits: Tensor, anchor: int, *, min_p: float = 0.0,
                temperature: float = 0.0, generator: torch.Generator | None = None, cut: bool = True) -> Walk:
    """docs/models.md ("DFlash2 drafter", step 6) for one window: hs [R, H], logits [R, V]. Rows are walked in order with prev = anchor;
    greedy takes argmax(score), sampling draws from softmax(score / T) and keeps that row as q. The result stops
    before the first row whose confidence is below `min_p` (that row dropped).

    Sampling with a floor: whether a row is kept depends on the token drawn there, so a kept row's token is
    distributed as q restricted to the candidates that pass the floor, and that (renormalised) row is the q
    returned; accepting with min(1, p/q) against the unrestricted row would bias the output (`_floor_q`).

    The walk stays on the device (no host sync per row): all rows are walked, then cut once at the floor. Later
    rows never change earlier ones, so the kept rows are exactly those of a walk that stopped at the floor.
    `cut=False` leaves the cut to the caller: every row comes back with the floor's count `keep` on the device (no
    host read at all)."""
    R, V = logits.shape
    dev = logits.device
    unary, cand = torch.topk(logits.float(), selector.top_k, dim=-1)          # [R, k]
    hp = selector.hidden_projection(hs).float()                                # [R, r]
    succ = selector.successor_codebook[cand].float()                           # [R, k, r]
    pred = selector.predecessor_codebook
    prev = torch.full((), int(anchor), dtype=torch.long, device=dev)     # a fill, not a host-to-device copy
    toks: list[Tensor] = []
    scores: list[Tensor] = []
    for r in range(R):     # gathers by device index (index_select), never a 0-d tensor index (a host read)
        score = unary[r] + succ[r] @ (pred.index_select(0, prev.reshape(1))[0].float() * hp[r])
        if temperature > 0:
            idx = torch.multinomial(torch.softmax(score / temperature, dim=-1), 1, generator=generator)[0]
        else:
            idx = torch.argmax(score)
        prev = cand[r].index_select(0, idx.reshape(1))[0]
        toks.append(idx)
        scores.append(score)
    if R == 0:
        return Walk(tokens=torch.zeros(0, dtype=torch.long, device=dev), confidence=torch.zeros(0, device=dev),
                    q=torch.zeros(0, V, device=dev) if temperature > 0 else None)
    idx = torch.stack(toks)                                                    # [R] index into the candidates
    score = torch.stack(scores)                                                # [R, k]
    conf_all = torch.softmax(score, dim=-1)                                    # [R, k] T=1: the floor statistic
    conf = conf_all.gather(-1, idx[:, None])[:, 0]
    tokens = cand.gather(-1, idx[:, None])[:, 0]
    q = None
    if temperature > 0:
        qk = torch.softmax(score / temperature, -1)
        if min_p > 0:
            qk = _floor_q(qk, conf_all >= min_p)
        q = torch.zeros(R, V, dtype=torch.float32, device=dev).scatter(-1, cand, qk)
    return cut_walk(tokens, conf, q, min_p, cut)


def cut_walk(tokens: Tensor, conf: Tensor, q: Tensor | None, min_p: float, cut: bool) -> Walk:
    """Rows up to the floor: cut here (one host read), or all rows with the device count (`cut=False`)."""
    if not cut:
        return Walk(tokens=tokens, confidence=conf, q=q, keep=floor_keep(conf, min_p) if min_p > 0 else None)
    m = len(tokens)
    if min_p > 0:
        low = (conf < min_p).nonzero()
        if len(low):
            m = int(low[0, 0])
    return Walk(tokens=tokens[:m], confidence=conf[:m], q=None if q is None else q[:m])


def _floor_q(q: Tensor, passes: Tensor) -> Tensor:
    """q [R, n] restricted to the entries that pass the floor, renormalised per row: the distribution of a draw
    from q given that it is kept. A kept row always has mass (its own token passes); a row past the cut may have
    none and stays zero (it is dropped anyway)."""
    q = q * passes
    return q / q.sum(-1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)


@torch.no_grad()
def lattice_walk(selector: CandidateSelector, hs: Tensor, logits: Tensor, anchor: Tensor,
                 kernel=None) -> tuple[Tensor, Tensor]:
    """The greedy selector walk of `select_walk` (no floor cut) as a lattice, without a host read: anchor [1] int64
    on the device. Every row's score for every predecessor candidate is computed at once (row 0's predecessor is
    the anchor, row r's are the k candidates of row r-1), the best successor of each predecessor is taken, and the
    walk is then a chain of R-1 one-element gathers (or `kernel(score, best, cand)`, one launch:
    `runtime.gpu.dflash2_kernels.lattice_walk`). Returns (tokens [R], confidence [R]).

    Same picks as the sequential walk: each row's scores are the same sums (ties go to the first candidate in
    both, `argmax`); only the reduction order of the rank-r pair term can differ in the last bit."""
    cand, score = lattice_scores(selector, hs, logits, anchor)
    best = torch.argmax(score, dim=-1)                                         # [R, j]
    if logits.shape[0] and kernel is not None:
        return kernel(score, best, cand)
    idx, row = follow_lattice(best, score)
    conf = torch.softmax(row, dim=-1).gather(-1, idx[:, None])[:, 0]
    return cand.gather(-1, idx[:, None])[:, 0], conf


def lattice_scores(selector: CandidateSelector, hs: Tensor, logits: Tensor, anchor: Tensor) -> tuple[Tensor, Tensor]:
    """(cand [R, k], score [R, j, i]): row r's score for its candidate i after predecessor j, where row 0's
    predecessor is the anchor and row r's are the k candidates of row r-1 (the greedy and the sampled lattice)."""
    k = selector.top_k
    unary, cand = torch.topk(logits.float(), k, dim=-1)                        # [R, k]
    hp = selector.hidden_projection(hs).float()                                # [R, r]
    succ = selector.successor_codebook[cand].float()                           # [R, k(i), r]
    prev = torch.cat([anchor.reshape(1, 1).expand(1, k), cand[:-1]], dim=0)    # [R, k(j)]
    a = selector.predecessor_codebook[prev].float() * hp[:, None, :]           # [R, k(j), r]
    return cand, unary[:, None, :] + torch.matmul(a, succ.transpose(1, 2))     # [R, j, i]


def follow_lattice(best: Tensor, score: Tensor) -> tuple[Tensor, Tensor]:
    """(idx [R], row [R, k]): the chain through `best` [R, j] (row 0 after the anchor, then each row after the
    previous row's pick), as one-element device gathers, and the scores of each walked row."""
    R, k = score.shape[0], score.shape[2]
    cur = best[0, :1]
    idxs = [cur]
    for r in range(1, R):
        cur = best[r].index_select(0, cur)
        idxs.append(cur)
    idx = torch.cat(idxs)                                                      # [R]
    j = torch.cat([torch.zeros_like(idx[:1]), idx[:-1]])                       # each row's predecessor index
    return idx, score.gather(1, j[:, None, None].expand(R, 1, k))[:, 0]


@torch.no_grad()
def argmax_walk(logits: Tensor, *, min_p: float = 0.0, sampling: SamplingParams | None = None,
                generator: torch.Generator | None = None, cut: bool = True) -> Walk:
    """The v1 layout (no selector): argmax per row, or a draw from `runtime.sampling.probs` (the target's own
    temperature / top-k / top-p processing, as the reference does); the confidence is the T=1 softmax of the
    chosen token."""
    p1 = torch.softmax(logits.float(), dim=-1)
    if sampling is not None and not sampling.greedy:
        q = probs(logits, sampling)
        toks = torch.multinomial(q, 1, generator=generator)[:, 0]
        if min_p > 0:
            q = _floor_q(q, p1 >= min_p)       # a kept row's token is q restricted to the floor (see select_walk)
    else:
        q, toks = None, torch.argmax(logits, dim=-1)
    conf = p1.gather(-1, toks[:, None])[:, 0]
    return cut_walk(toks, conf, q, min_p, cut)
