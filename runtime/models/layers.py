"""The target's building blocks (RMSNorm, RoPE, attention, MLP, the sparse MoE block, the decoder layer), shared by
the target (runtime/models/qwen3_moe.py), its MTP head (runtime/models/mtp.py) and the DFlash2 drafter.

Semantics follow transformers' `Qwen3MoeForCausalLM` (docs/models.md, "Qwen3-MoE target").
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from runtime.kv import LayerKV
from runtime.models.cpu_rows import derived
from runtime.models.target_config import Qwen3MoeConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # normalised in fp32, rounded to x's dtype, then scaled (transformers' order); one fused op for the first
        # part (a CPU step is paid per op). In fp32 there is nothing to round, and the fused op scales by the
        # weight itself with the same bits as the product after it (docs/models.md, "Numerics")
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight=self.weight, eps=self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_inv_freq(cfg: Qwen3MoeConfig) -> tuple[Tensor, float]:
    """Inverse frequencies and cos/sin scale, as transformers' ROPE_INIT_FUNCTIONS compute them."""
    dim, base, rp = cfg.head_dim, cfg.rope_theta, cfg.rope_params
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if cfg.rope_type == "default":
        return inv, 1.0
    if cfg.rope_type == "linear":
        return inv / float(rp["factor"]), 1.0
    # yarn
    factor = rp.get("factor")
    orig = int(rp.get("original_max_position_embeddings") or cfg.max_position_embeddings)
    if factor is None:
        factor = cfg.max_position_embeddings / orig
    factor = float(factor)

    def mscale(s: float, m: float = 1.0) -> float:
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    att = rp.get("attention_factor")
    if att is None:
        ms, msa = rp.get("mscale"), rp.get("mscale_all_dim")
        att = float(mscale(factor, ms) / mscale(factor, msa)) if (ms and msa) else mscale(factor)
    beta_fast = rp.get("beta_fast") or 32
    beta_slow = rp.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extra = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, float(att)


class Rotary(nn.Module):
    """cos/sin for absolute positions (no persistent state: the buffer is recomputed from the config)."""

    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        super().__init__()
        inv, self.scale = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, heads, T, hd]; cos/sin [B or 1, T, hd]."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


def cached_attention(q: Tensor, keys: Tensor, vals: Tensor, scale: float) -> Tensor:
    """q [B, nh, T, hd] at the last T positions of keys/vals [B, nkv, S, hd]: row i sees keys 0..S-T+i.

    Why not a boolean mask: any explicit mask over the cache prefix rules out the flash kernel and, with GQA, sends
    SDPA to the math kernel, which materialises [T x S] scores per head (4.4 GB at 128k for a 512-row chunk). The
    lower-right causal bias is the same mask, but SDPA hands it to the flash (or mem-efficient) kernel without ever
    building it; where neither applies (CPU) it is materialised once, as before."""
    from torch.nn.attention.bias import causal_lower_right

    T, S = q.shape[-2], keys.shape[-2]
    gqa = keys.shape[1] != q.shape[1]
    if T == 1:
        return F.scaled_dot_product_attention(q, keys, vals, scale=scale, enable_gqa=gqa)
    if T == S:
        return F.scaled_dot_product_attention(q, keys, vals, is_causal=True, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, keys, vals, attn_mask=causal_lower_right(T, S), scale=scale,
                                          enable_gqa=gqa)


def project_qkv(a, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One window's q, k (q/k-norm, RoPE; [1, heads, W, hd]) and v ([W, nkv, hd]) for attention module `a`, on the
    normed input h [1, W, H]: the eager projection the fused kernel path falls back to (target and MTP layers)."""
    W = h.shape[1]
    if a.qkv_weight is not None:          # stacked (`stack_qkv`): one product, then the three parts
        nq, nk = a.nh * a.hd, a.nkv * a.hd
        qp, kp, vp = a.qkv(h).split((nq, nk, nk), -1)
    else:
        qp, kp, vp = a.q_proj(h), a.k_proj(h), a.v_proj(h)
    q = a.q_norm(qp.reshape(1, W, a.nh, a.hd)).transpose(1, 2)
    k = a.k_norm(kp.reshape(1, W, a.nkv, a.hd)).transpose(1, 2)
    v = vp.reshape(W, a.nkv, a.hd)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def qkv_rows(a, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`project_qkv` for rows h [W, H] (cos/sin [1, W, hd]) with the q- and k-norm as one RMSNorm over the rows' q
    and k heads and RoPE once over both: the same ops on each head vector, so the same bits, in half the ops (a
    CPU step is paid per op). -> q [W, nh, hd], k and v [W, nkv, hd]."""
    nh, nkv, hd = a.nh, a.nkv, a.hd
    W = h.shape[0]
    qn, kn = a.q_norm.weight, a.k_norm.weight       # q-norm's weight for each q head, then k-norm's for each k head
    heads_w = derived(a, "_qk_heads_weight", (qn, kn), lambda: torch.cat((qn.expand(nh, hd), kn.expand(nkv, hd))))
    qkv = a.qkv(h) if a.has_qkv else torch.cat((a.q_proj(h), a.k_proj(h), a.v_proj(h)), -1)
    qk = qkv[:, :(nh + nkv) * hd].view(W, nh + nkv, hd)
    # RMSNorm's order (normalised in fp32, rounded to the dtype, scaled; in fp32 the bits of the fused op)
    qk = heads_w * F.rms_norm(qk.float(), (hd,), eps=a.q_norm.eps).to(qk.dtype)
    qk = qk * cos[0, :, None] + _rotate_half(qk) * sin[0, :, None]
    return qk[:, :nh], qk[:, nh:], qkv[:, (nh + nkv) * hd:].view(W, nkv, hd)


class Attention(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h, b = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=b)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=b)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=b)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=b)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.scale = self.hd**-0.5
        self.qkv_weight: Tensor | None = None   # inference only (`stack_qkv`): q, k, v weights in one matrix
        self.qkv_blocks = None                  # the same for block-format q/k/v (a `QuantLinear` over their rows)
        self.qk_blocks = None                   # q and k alone, when v has another block format (a K-quant mix)

    def qkv(self, h: Tensor) -> Tensor:
        """q, k and v projections in one matmul (after `stack_qkv`; `has_qkv` says whether it stacked); a K-quant
        mix's q and k in one product and v in its own, joined."""
        if self.qkv_weight is not None:
            return F.linear(h, self.qkv_weight)
        if self.qkv_blocks is not None:
            return self.qkv_blocks(h)
        return torch.cat((self.qk_blocks(h), self.v_proj(h)), -1)

    @property
    def has_qkv(self) -> bool:
        return self.qkv_weight is not None or self.qkv_blocks is not None or self.qk_blocks is not None

    def stack_qkv(self, device: torch.device | None = None) -> None:
        """Hold q/k/v_proj weights as views of one [(nh + 2 nkv) * hd, H] matrix (one matmul per step; same
        bytes; parameter names unchanged), on `device` when given. Stacking before the weights reach the GPU keeps
        the GPU from ever holding the three separate copies (the caching allocator would keep their segments).
        Block-format q/k/v (a quantized GGUF target) stack their rows of blocks the same way (`qkv_blocks`); where v
        has another format than q and k (llama-quantize's Q4_K_M gives some layers a Q6_K v), q and k stack alone
        (`qk_blocks`) and v keeps its own matrix."""
        from runtime.formats.quant_linear import QuantLinear

        projs = [self.q_proj, self.k_proj, self.v_proj]
        if any(isinstance(p, QuantLinear) for p in projs):
            if not all(isinstance(p, QuantLinear) for p in projs) or any(p.bias is not None for p in projs) \
                    or self.q_proj.qtype != self.k_proj.qtype:
                return                      # nothing to stack: the three projections stay apart
            whole = self.v_proj.qtype == self.q_proj.qtype
            if not whole and device is not None:
                self.v_proj.blocks = self.v_proj.blocks.to(device)
            projs = projs if whole else projs[:2]
            held = self.qkv_blocks if whole else self.qk_blocks
            have = held.blocks if held is not None else None
            cat = have if have is not None else torch.cat([p.blocks for p in projs], 0)   # rows: independent blocks
            if device is not None:
                cat = cat.to(device)
            if cat is have:
                return
            o = 0
            for p in projs:
                p.blocks = cat[o:o + p.out_features]
                o += p.out_features
            # not registered as a submodule (like `qkv_weight`): state_dict and the weight count stay as they were
            object.__setattr__(self, "qkv_blocks" if whole else "qk_blocks",
                               QuantLinear.from_blocks(cat, projs[0].qtype, projs[0].in_features))
            return
        ws = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
        cat = self.qkv_weight if self.qkv_weight is not None else torch.cat([w.data for w in ws], 0)
        if device is not None:
            cat = cat.to(device)
        if cat is self.qkv_weight:
            return
        o = 0
        for w in ws:
            n = w.shape[0]
            w.data = cat[o:o + n]
            o += n
        self.qkv_weight = cat

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: tuple[LayerKV, int] | None = None) -> Tensor:
        """cache = (one layer of a KV cache, start): write rows at start.., attend over 0..start+T-1 (read back from
        the cache, so a quantized cache's rounding is seen here as in decode)."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.nh, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, scale=self.scale, enable_gqa=self.nkv != self.nh)
        else:
            lkv, start = cache
            lkv.write(k, v, start)
            keys, vals = lkv.read(start + T, q.dtype)
            o = cached_attention(q, keys, vals, self.scale)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.hd))


class MLP(nn.Module):
    """SiLU-gated MLP: the dense layers and each routed expert."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# CPU (`SparseMoe.pack_dense`): a layer whose experts together take at most this many bytes runs all of them at
# once on windows of at most DENSE_ROWS rows (`SparseMoe.dense_for`; a longer prefill chunk keeps the routed loop:
# there E/k times the arithmetic would cost more than the ops it saves)
DENSE_EXPERT_BYTES = 8 << 20
DENSE_ROWS = 64


class SparseMoe(nn.Module):
    """Router softmax (fp32) → top-k → optional renormalisation → weighted sum of SiLU experts.

    `runner`, when set (runtime/experts.py), computes one expert on a set of rows wherever that expert lives;
    otherwise the experts are called in place. With stacked weights (`gate_up`/`down`, floats or ggml blocks in
    format `fmt`, indexed through the expert->slot table `slot`, misses filled by `miss_fn`) the grouped kernels of
    runtime/gpu/moe_kernels.py run instead: decode windows, prefill chunks (CUDA), or their torch fallback.
    """

    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        super().__init__()
        self.top_k, self.n_exp, self.norm_topk = cfg.num_experts_per_tok, cfg.num_experts, cfg.norm_topk_prob
        self.inter = cfg.moe_intermediate_size
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.runner = None   # set by ExpertCache; callable(expert_idx, rows) -> Tensor
        self.counter = None  # set by ExpertCache; callable(layer_idx, n_rows): rows served by the stacked kernels
        # set by ExpertCache when the experts live in its slot pool: callable(layer_idx, x, idx, w) -> [T, H]
        self.offload = None
        self.recorder = None  # set while routing is recorded: callable(layer_idx, idx)
        self.layer_idx = -1
        # inference only (`stack_experts`): every expert's weights as views into two stacked tensors, transformers'
        # layout gate_up [E, 2I, H] (gate rows, then up rows) and down [E, H, I]; not registered (state_dict unchanged)
        self.gate_up: Tensor | None = None
        self.down: Tensor | None = None
        self.fmt: str | tuple[str, str] | None = None   # ggml block format of gate_up/down (None: floats)
        self.slot: Tensor | None = None     # int32 [E]: expert id -> index into gate_up/down's first dim, -1: none
        self.miss_fn = None                 # callable(x, routing, y): fills the rows of the pairs without a slot
        # CPU, small experts (`pack_dense`): every expert's gate/up rows as one [E * 2I, H] matrix and every down
        # projection as one [H, E * I] matrix, for `dense`
        self.dense_gu: Tensor | None = None
        self.dense_down: Tensor | None = None
        self.dense_rows = 1                 # the fewest rows `dense` serves (`dense_for`)

    def stack_experts(self) -> None:
        """Move the experts into stacked tensors (one layer's experts at a time: the peak grows by one layer) and
        make each expert's parameters views into them, so the grouped kernel (runtime/kernels.py) reads them."""
        if self.fmt is not None:   # block stacks are made stacked (`bind_blocks`)
            return
        w0 = self.experts[0].gate_proj.weight
        inter, hidden = w0.shape
        gu = torch.empty(self.n_exp, 2 * inter, hidden, dtype=w0.dtype, device=w0.device)
        dn = torch.empty(self.n_exp, hidden, inter, dtype=w0.dtype, device=w0.device)
        for e, ex in enumerate(self.experts):
            gu[e, :inter].copy_(ex.gate_proj.weight.data)
            gu[e, inter:].copy_(ex.up_proj.weight.data)
            dn[e].copy_(ex.down_proj.weight.data)
        self.bind_stacked(gu, dn)

    def bind_stacked(self, gate_up: Tensor, down: Tensor) -> None:
        """Make the experts' parameters views of `gate_up` [E, 2I, H] and `down` [E, H, I] (shared storage)."""
        inter = gate_up.shape[1] // 2
        for e, ex in enumerate(self.experts):
            ex.gate_proj.weight.data = gate_up[e, :inter]
            ex.up_proj.weight.data = gate_up[e, inter:]
            ex.down_proj.weight.data = down[e]
        self.gate_up, self.down = gate_up, down

    def bind_blocks(self, gate_up: Tensor, down: Tensor, fmt: str | tuple[str, str]) -> None:
        """Hold the experts as ggml blocks (docs/formats.md, "Block formats"): uint8 gate_up [S, 2I, row_bytes(H)]
        and down [S, H, row_bytes(I)] in `fmt` (one name, or gate_up's and down's), read by the grouped kernels;
        the per-expert modules go (no float copy of any expert is kept). S = E, or the slots of `slot`."""
        from runtime.errors import QuantFormatError
        from runtime.formats.registry import block_format, row_bytes

        fg, fd = (fmt, fmt) if isinstance(fmt, str) else fmt
        fg, fd = block_format(fg).name, block_format(fd).name
        hidden, inter = self.gate.in_features, self.inter
        want_gu = (gate_up.shape[0], 2 * inter, row_bytes(hidden, fg))
        want_dn = (gate_up.shape[0], hidden, row_bytes(inter, fd))
        if gate_up.dtype != torch.uint8 or down.dtype != torch.uint8 or tuple(gate_up.shape) != want_gu \
                or tuple(down.shape) != want_dn:
            raise QuantFormatError(f"expert blocks {tuple(gate_up.shape)} / {tuple(down.shape)} are not {fg} "
                                   f"{want_gu} / {fd} {want_dn} (uint8) for hidden {hidden}, expert width {inter}.")
        self.experts = nn.ModuleList()
        self.gate_up, self.down, self.fmt = gate_up, down, (fg, fd) if fg != fd else fg

    def pack_dense(self, limit: int = DENSE_EXPERT_BYTES, hot: bool = False) -> bool:
        """CPU: hold a small layer's float experts for `dense` (False, and nothing kept, when the layer's experts
        are blocks or exceed `limit` bytes). Why: on a CPU a small MoE step is paid in op dispatch (a routed
        expert is about eight small ops), not in arithmetic; two matmuls over every expert cost less there.
        `hot`: the layer runs steps back to back (a drafter's chain), its weights stay in cache, so `dense` serves
        single rows too; a target layer is read from memory once a step, and for few rows the loop reads fewer
        bytes (`dense_for`)."""
        if self.fmt is not None or not self.experts:
            return False
        w0 = self.experts[0].gate_proj.weight
        if w0.device.type != "cpu" or 3 * self.n_exp * w0.numel() * w0.element_size() > limit:
            return False
        self.dense_rows = 1 if hot else -(-self.n_exp // self.top_k)
        with torch.no_grad():
            self.dense_gu = torch.cat([torch.cat((ex.gate_proj.weight, ex.up_proj.weight), 0) for ex in self.experts])
            self.dense_down = torch.cat([ex.down_proj.weight for ex in self.experts], 1).contiguous()
        # the per-expert modules become views of the packed matrices (no extra bytes; a down view is strided)
        inter = self.inter
        for e, ex in enumerate(self.experts):
            ex.gate_proj.weight.data = self.dense_gu[2 * inter * e:2 * inter * e + inter]
            ex.up_proj.weight.data = self.dense_gu[2 * inter * e + inter:2 * inter * (e + 1)]
            ex.down_proj.weight.data = self.dense_down[:, inter * e:inter * (e + 1)]
        return True

    def dense_for(self, rows: int) -> bool:
        """Whether `dense` serves a window of `rows` rows: packed, and (a target layer) enough routed pairs that
        the loop would run most experts anyway (a 1-row decode of top-2 of 8 reads a quarter of the bytes there)."""
        return self.dense_gu is not None and self.dense_rows <= rows <= DENSE_ROWS

    def dense(self, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        """Every expert on every row of x [T, H] at once, each row's experts picked by its routing weights (zero for
        an expert the row did not choose; an id >= E marks a padded row: it gets 0). A row's result depends only on
        its own routing, and each product has one shape per T (what the CPU step's row invariance needs,
        runtime/gpu/static_step.py)."""
        T, E, inter = x.shape[0], self.n_exp, self.inter
        gu = F.linear(x, self.dense_gu).view(T, E, 2, inter)
        wd = torch.zeros(T, E + 1, dtype=gu.dtype, device=x.device).scatter_(1, idx.clamp(max=E), w.to(gu.dtype))
        act = F.silu(gu[:, :, 0]) * gu[:, :, 1] * wd[:, :E, None]
        return F.linear(act.reshape(T, E * inter), self.dense_down).to(x.dtype)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(x.dtype), idx

    @property
    def quantized(self) -> bool:
        return self.fmt not in (None, "bf16", ("bf16", "bf16"))

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, idx = self.route(x)
        if self.recorder is not None:
            self.recorder(self.layer_idx, idx)
        if self.offload is not None:
            return self.offload(self.layer_idx, x, idx, w).view(shape)
        if self.dense_for(x.shape[0]) and not torch.is_grad_enabled():
            if self.counter is not None:
                self.counter(self.layer_idx, x.shape[0])
            return self.dense(x, idx, w).view(shape)
        # block stacks (`bind_blocks`) are the experts' only copy: they take this path with autograd on too
        if self.gate_up is not None and (not torch.is_grad_enabled() or self.fmt is not None):
            from runtime.gpu import kernels, moe_kernels

            kw = {"fmt": self.fmt, "slot": self.slot, "miss_fn": self.miss_fn}
            T = x.shape[0]
            # experts grouped: each touched expert's weights read once (decode windows; prefill chunks on CUDA)
            if kernels.available(x) and (T <= moe_kernels.DECODE_ROWS or x.is_cuda):
                if self.counter is not None:
                    self.counter(self.layer_idx, T)
                return moe_kernels.moe_grouped(x, idx, w, self.gate_up, self.down, **kw).view(shape)
            if self.quantized or self.slot is not None or self.miss_fn is not None:
                return moe_kernels.moe_torch(x, idx, w, self.gate_up, self.down, **kw).view(shape)
        out = torch.zeros_like(x)
        # group (row, slot) pairs by expert with one sort and one host sync (the counts)
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.n_exp).tolist()
        tok_all, slot_all = order // self.top_k, order % self.top_k
        off = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            tok, slot = tok_all[off:off + c], slot_all[off:off + c]
            off += c
            rows = x[tok]
            y = self.runner(self.layer_idx, e, rows) if self.runner is not None else self.experts[e](rows)
            out.index_add_(0, tok, (y * w[tok, slot, None]).to(out.dtype))
        return out.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, sparse: bool) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = SparseMoe(cfg) if sparse else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: tuple[LayerKV, int] | None = None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))
