"""CUDA graphs for the drafters' per-window work (greedy drafting and observing committed rows).

Why: a drafter's window is hundreds of small launches (MTP: one decoder layer per chained step; DFlash2: five
layers, the selector walk); on a GPU that is launch-bound unless replayed as one graph. Each graph works on static
buffers: the anchor and position go in through a small host-to-device copy, the context lengths are read on the
device (DFlash2 attends over its whole context capacity with a mask `position < pos`; MTP uses the row-invariant
Triton attention with each row's cache slot), and rows past the committed ones write only cache slots past the
committed length, which nothing reads before they are rewritten. Sampling, the prompt and windows that would run
past the capacity take the drafters' eager paths. Any failure to build a graph turns the graphs off (recorded in
`errors`), so the eager path always remains.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime import kernels
from runtime.drafter import Proposal
from runtime.models.dflash2 import lattice_walk
from runtime.models.qwen3_moe import SparseMoe
from runtime.static_step import project_qkv

_STREAM: torch.cuda.Stream | None = None


def capture_stream() -> torch.cuda.Stream:
    """One side stream for every warm-up and capture (cuBLAS keeps a workspace per stream: one, not one each)."""
    global _STREAM
    if _STREAM is None:
        _STREAM = torch.cuda.Stream()
    return _STREAM


def capture(fn) -> tuple[torch.cuda.CUDAGraph, object]:
    """Warm `fn` up twice on the capture stream, then capture it; returns (graph, fn's output tensors)."""
    s = capture_stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        out = fn()
    return g, out


def _cut(conf: list[float], min_p: float) -> int:
    if min_p > 0:
        for i, c in enumerate(conf):
            if c < min_p:
                return i
    return len(conf)


class _Graphs:
    def __init__(self, device: torch.device) -> None:
        self.dev = device
        self.scal = torch.zeros(3, dtype=torch.long, device=device)   # anchor, pos, start
        self.cuda = device.type == "cuda"   # elsewhere (tests) the same functions run eagerly, no graph
        # a ring of pinned host buffers, each reused only once its last copy is done (an event, not a stream sync:
        # the host may queue the next graph while the GPU still runs the previous one)
        self.ring = [torch.zeros(3, dtype=torch.long) for _ in range(4)]
        if self.cuda:
            self.ring = [h.pin_memory() for h in self.ring]
        self.events = [torch.cuda.Event() if self.cuda else None for _ in self.ring]
        self.used = [False] * len(self.ring)
        self.slot = 0
        self.graphs: dict[object, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.enabled = True
        self.errors: list[str] = []
        self.replays = 0

    def _set(self, a: int = 0, b: int = 0, c: int = 0) -> None:
        i = self.slot
        self.slot = (i + 1) % len(self.ring)
        host, ev = self.ring[i], self.events[i]
        if ev is not None and self.used[i]:
            ev.synchronize()                             # this pinned buffer may still feed its last copy
        host[0], host[1], host[2] = a, b, c
        self.scal.copy_(host, non_blocking=self.cuda)
        if ev is not None:
            ev.record()
            self.used[i] = True

    def _run(self, key: object, fn) -> object | None:
        if not self.enabled:
            return None
        if not self.cuda:
            return fn()
        if key not in self.graphs:
            try:
                self.graphs[key] = capture(fn)
            except Exception as e:  # fall back to the eager path for good
                self.errors.append(f"{type(e).__name__}: {str(e)[:300]}")
                self.enabled = False
                self.graphs.clear()
                torch.cuda.synchronize()
                return None
        g, out = self.graphs[key]
        g.replay()
        self.replays += 1
        return out


# --------------------------------------------------------------------------------------------------------- DFlash2
def _stack_linears(mods: list) -> Tensor | None:
    """One [sum(out), in] matrix whose row blocks become the modules' weights (views: same bytes, no copy kept),
    so one matmul serves them all; None (nothing changed) unless all are plain float `nn.Linear`s alike."""
    ws = [getattr(mod, "weight", None) for mod in mods]
    if not all(type(mod) is torch.nn.Linear and mod.bias is None for mod in mods) or any(w is None for w in ws):
        return None
    if len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1 or not ws[0].is_floating_point():
        return None
    if all(w._base is not None for w in ws) and len({w._base.data_ptr() for w in ws}) == 1:
        base = ws[0]._base                   # stacked before (a second graph set on the same model)
        if base.shape[0] == sum(w.shape[0] for w in ws) and ws[0].data_ptr() == base.data_ptr():
            return base
    stacked = torch.cat([w.detach() for w in ws], dim=0)
    o = 0
    for mod, w in zip(mods, ws, strict=True):
        mod.weight = torch.nn.Parameter(stacked[o:o + w.shape[0]], requires_grad=False)
        o += w.shape[0]
    return stacked


class DFlash2Graphs(_Graphs):
    """Greedy drafting (draft forward + lattice selector walk, all rows; the floor cut on the host) and observing up
    to `max_block` committed rows, for a `runtime.dflash2_loading.DFlash2Drafter`.

    Fast path (CUDA or the Triton interpreter, cache dtype = compute dtype, no sliding window): ~17 launches a layer
    instead of ~100: fused RMSNorm (+ the residual add), one launch per dynamic convolution, one matmul for q/k/v
    and one for gate/up (stacked weights), q/k norm + RoPE in one kernel that writes the block's K/V into the
    context cache slots pos..pos+W-1 (past the committed length: observe rewrites them before anything reads
    them), and the Triton attention over slots 0..pos+W-1 (each K/V row read once per query row, no mask tensor, no
    full-capacity pass). Observe: per layer one matmul + the same norm/RoPE/cache-write kernel. Otherwise the plain
    path (the model's modules over the whole capacity with a mask)."""

    def __init__(self, drafter) -> None:
        super().__init__(drafter.cache.k.device)
        self.d = drafter
        m = drafter.model
        self.obs_rows = drafter.max_block
        taps_w = m.fc.in_features
        self.obs_taps = torch.zeros(self.obs_rows, taps_w, dtype=m.dtype, device=self.dev)
        g = m.geom
        self.fast = (kernels.available(drafter.cache.k) and drafter.cache.k.dtype == m.dtype
                     and all(layer.window is None for layer in m.layers) and g.head_dim % 2 == 0)
        self.qkv: list[Tensor | None] = []
        self.gate_up: list[Tensor | None] = []
        if self.fast:
            for layer in m.layers:
                a = layer.self_attn
                self.qkv.append(_stack_linears([a.q_proj, a.k_proj, a.v_proj]))
                self.gate_up.append(_stack_linears([layer.mlp.gate_proj, layer.mlp.up_proj]))
        self.ar = torch.arange(self.obs_rows, device=self.dev)
        self.mask_ids = torch.full((self.obs_rows,), g.mask_token_id, dtype=torch.long, device=self.dev)

    def _run(self, key: object, fn) -> object | None:
        """A fast-path function that fails to run or capture turns the fast path off (recorded in `errors`) and the
        plain graphs take over; the eager paths remain behind those."""
        if self.fast and self.enabled and (not self.cuda or key not in self.graphs):
            try:
                if not self.cuda:
                    return fn()
                self.graphs[key] = capture(fn)
            except Exception as e:
                self.errors.append(f"fast path off: {type(e).__name__}: {str(e)[:300]}")
                self.fast = False
                self.graphs.clear()
                if self.cuda:
                    torch.cuda.synchronize()
        return super()._run(key, fn)

    # -- fast path ------------------------------------------------------------------------------------------------
    def _qkv(self, i: int, y: Tensor) -> Tensor:
        a = self.d.model.layers[i].self_attn
        w = self.qkv[i]
        if w is not None:
            return F.linear(y, w)
        return torch.cat([a.q_proj(y), a.k_proj(y), a.v_proj(y)], dim=-1)

    def _post(self, i: int, qkv: Tensor, pos: Tensor) -> Tensor:
        """q_norm + RoPE of q (returned [W, nh, hd]); k_norm + RoPE of k and v written to cache slots `pos`."""
        m, cache = self.d.model, self.d.cache
        a = m.layers[i].self_attn
        return kernels.qkv_post(qkv, a.q_norm.weight, a.k_norm.weight, m.rotary.inv_freq, 1.0, pos, cache.k[i],
                                cache.v[i], a.nh, a.nkv, a.hd, a.q_norm.eps)

    def _conv(self, conv, h: Tensor, dyn: Tensor, half: int) -> Tensor:
        return kernels.dyn_conv(h, dyn, half, conv.base_kernel[half], conv.kernel_size, conv.group_size)

    def _mlp(self, i: int, y: Tensor) -> Tensor:
        mlp = self.d.model.layers[i].mlp
        w = self.gate_up[i]
        if w is None:
            return mlp(y)
        gu = F.linear(y, w)
        inter = w.shape[0] // 2
        return mlp.down_proj(F.silu(gu[:, :inter]) * gu[:, inter:])

    def _draft_fast(self, width: int) -> tuple[Tensor, Tensor]:
        d, m = self.d, self.d.model
        g = m.geom
        embed, lm_head = d._shared
        anchor, pos = self.scal[0:1], self.scal[1:2]
        ar = self.ar[:width]
        ids = torch.where(ar == 0, anchor, self.mask_ids[:width])
        x = F.embedding(ids, embed.weight).to(m.dtype)
        if g.input_embedding_scale != 1.0:
            x = x * g.input_embedding_scale
        qpos = (pos + ar).to(torch.int32)                                    # the block's cache slots
        last = qpos if g.is_causal else (pos + (width - 1)).to(torch.int32).expand(width).contiguous()
        delta = None
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            x, y = kernels.rmsnorm(x, layer.input_layernorm.weight, layer.input_layernorm.eps, delta)
            ac, mc = layer.attention_conv, layer.mlp_conv
            if ac is not None:
                dyn = ac.kernel_projection(y)
                y = self._conv(ac, y, dyn, 0)
            q = self._post(i, self._qkv(i, y), qpos)
            o = kernels.attention(q, d.cache.k[i], d.cache.v[i], last, a.hd ** -0.5)
            y = a.o_proj(o.reshape(width, a.nh * a.hd))
            if ac is not None:
                y = self._conv(ac, y, dyn, 1)
            x, y = kernels.rmsnorm(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps, y)
            if mc is not None:
                dyn = mc.kernel_projection(y)
                y = self._conv(mc, y, dyn, 0)
            y = self._mlp(i, y)
            if mc is not None:
                y = self._conv(mc, y, dyn, 1)
            delta = y
        _, h = kernels.rmsnorm(x, m.norm.weight, m.norm.eps, delta)
        return self._select(h[1:], anchor)

    def _select(self, hs: Tensor, anchor: Tensor) -> tuple[Tensor, Tensor]:
        m = self.d.model
        logits = m.compute_logits(hs, self.d._shared[1])
        sel = m.candidate_selector
        if sel is None:
            p1 = torch.softmax(logits.float(), dim=-1)
            toks = torch.argmax(logits, dim=-1)
            return toks, p1.gather(-1, toks[:, None])[:, 0]
        return lattice_walk(sel, hs, logits, anchor, kernel=kernels.lattice_walk if self.fast else None)

    def _observe_fast(self) -> None:
        m = self.d.model
        c = m.fc(self.obs_taps)
        _, c = kernels.rmsnorm(c, m.hidden_norm.weight, m.hidden_norm.eps)
        pos = (self.scal[2:3] + self.ar).to(torch.int32)
        for i in range(len(m.layers)):
            self._post(i, self._qkv(i, c), pos)
        return None

    # -- plain path -----------------------------------------------------------------------------------------------
    def _draft(self, width: int) -> tuple[Tensor, Tensor]:
        if self.fast:
            return self._draft_fast(width)
        d, m, cache = self.d, self.d.model, self.d.cache
        embed, lm_head = d._shared
        C = cache.capacity
        anchor, pos = self.scal[0:1], self.scal[1:2]
        ar = torch.arange(width, device=self.dev)
        ids = torch.where(ar == 0, anchor, torch.full_like(ar, m.geom.mask_token_id))[None]
        q_pos = (pos + ar)[None]
        ck = torch.arange(C, device=self.dev)
        k_pos = torch.cat([ck, q_pos[0]])[None]
        k_valid = torch.cat([ck < pos, torch.ones(width, dtype=torch.bool, device=self.dev)])[None]
        ctx = [(cache.k[i, None], cache.v[i, None]) for i in range(len(m.layers))]
        hs = m._run_layers(m.block_input(ids, embed.weight), q_pos, ctx, k_pos, k_valid)[0, 1:]
        return self._select(hs, anchor)

    def propose(self, anchor: int, pos: int, n: int, min_p: float) -> Proposal | None:
        if not self.enabled or pos != self.d.cache.length or (self.fast and pos + n + 1 > self.d.cache.capacity):
            return None
        self._set(anchor, pos)
        out = self._run(("draft", n + 1), lambda: self._draft(n + 1))
        if out is None:
            return None
        toks, conf = out
        c = conf.tolist()
        m = _cut(c, min_p)
        return Proposal(tokens=toks[:m].clone(), q=None, confidence=conf[:m].clone())

    def _observe(self) -> None:
        if self.fast:
            return self._observe_fast()
        m, cache = self.d.model, self.d.cache
        R = self.obs_rows
        c = m.context_features(self.obs_taps[None])
        pos = (self.scal[2:3] + torch.arange(R, device=self.dev))[None]
        cos, sin = m.rotary(pos, c.dtype)
        for i, layer in enumerate(m.layers):
            k, v = layer.self_attn.kv(c, cos, sin)
            cache.k[i].index_copy_(1, pos[0], k[0].to(cache.k.dtype))
            cache.v[i].index_copy_(1, pos[0], v[0].to(cache.v.dtype))
        return None

    def observe(self, taps: Tensor, start: int) -> bool:
        cache = self.d.cache
        n = int(taps.shape[0])
        if not self.enabled or n == 0 or n > self.obs_rows or start > cache.length \
                or start + self.obs_rows > cache.capacity:
            return False
        self.obs_taps[:n].copy_(taps)
        self._set(0, 0, start)
        if self._run("observe", self._observe) is None and not self.enabled:
            return False
        cache.length = start + n
        return True


# ------------------------------------------------------------------------------------------------------------- MTP
class MTPGraphs(_Graphs):
    """Greedy chained drafting of n steps and observing up to `max_block` committed rows for an `MTPDrafter`
    (needs the Triton kernels: the cached attention reads each row's slot on the device)."""

    def __init__(self, drafter) -> None:
        super().__init__(drafter.kv.k.device)
        self.d = drafter
        H = drafter.model.cfg.hidden_size
        dt = drafter.model.lm_head.weight.dtype
        self.R = drafter.max_block
        self.g_in = torch.zeros(1, H, dtype=dt, device=self.dev)
        self.obs_tok = torch.zeros(self.R, dtype=torch.long, device=self.dev)
        self.obs_g = torch.zeros(self.R, H, dtype=dt, device=self.dev)
        self.enabled = kernels.available(drafter.kv.k)

    def _rows(self, tok: Tensor, g: Tensor, p: Tensor, slot: Tensor) -> Tensor:
        """MTP rows at positions p (cache slots `slot` = p - 1, -1 = padding) -> MTP hidden [W, H]."""
        model, mtp, kv = self.d.model, self.d.mtp, self.d.kv
        W = tok.shape[0]
        emb = model.model.embed_tokens(tok)[None]
        x = mtp.fc(torch.cat((mtp.pre_fc_norm_embedding(emb), mtp.pre_fc_norm_hidden(g[None].to(emb.dtype))), -1))
        cos, sin = model.rotary(p[None], x.dtype)
        layer = mtp.layers[0]
        a = layer.self_attn
        q, k, v = project_qkv(a, layer.input_layernorm(x), cos, sin)
        kc, vc = kv.k[0, 0], kv.v[0, 0]
        kernels.kv_write(k[0].transpose(0, 1), v, kc, vc, slot)
        o = kernels.attention(q[0].transpose(0, 1), kc, vc, slot, a.scale)
        x = x + a.o_proj(o.reshape(1, W, a.nh * a.hd))
        h = layer.post_attention_layernorm(x)
        mlp = layer.mlp
        if isinstance(mlp, SparseMoe):
            if mlp.gate_up is None:
                raise RuntimeError("the MTP layer's experts are not stacked; no graph.")
            w, idx = mlp.route(h[0])
            idx = torch.where((slot >= 0)[:, None], idx, mlp.n_exp)
            y = kernels.moe_grouped(h[0], idx, w, mlp.gate_up, mlp.down)[None]
        else:
            y = mlp(h)
        return mtp.norm(x + y)[0]

    def _chain(self, n: int) -> tuple[Tensor, Tensor]:
        lm_head = self.d.model.lm_head
        tok, g = self.scal[0:1], self.g_in
        p = self.scal[1:2]
        toks, confs = [], []
        for _ in range(n):
            h = self._rows(tok, g, p, (p - 1).to(torch.int32))
            lg = lm_head(h).float()
            t = torch.argmax(lg, dim=-1)
            confs.append(torch.softmax(lg, dim=-1).gather(-1, t[:, None])[:, 0])
            toks.append(t)
            tok, g, p = t, h, p + 1
        return torch.cat(toks), torch.cat(confs)

    def propose(self, anchor: int, pos: int, n: int, min_p: float) -> Proposal | None:
        d = self.d
        if not self.enabled or n <= 0 or d.last_g is None or d.kv.length != pos - 1 \
                or pos - 1 + n > d.kv.capacity:
            return None
        self._set(anchor, pos)
        self.g_in.copy_(d.last_g[None])
        out = self._run(("chain", n), lambda: self._chain(n))
        if out is None:
            return None
        toks, conf = out
        d.kv.length = pos            # the first step's inputs (anchor, g[pos-1]) are true: its entry stays
        c = conf.tolist()
        m = _cut(c, min_p)
        return Proposal(tokens=toks[:m].clone(), q=None, confidence=conf[:m].clone())

    def _observe(self) -> None:
        R = self.R
        slot = (self.scal[2:3] - 1 + torch.arange(R, device=self.dev)).to(torch.int32)
        self._rows(self.obs_tok, self.obs_g, slot.long() + 1, slot)

    def observe_rows(self, toks: Tensor, g_prev: Tensor, first: int) -> bool:
        """Entries for positions first.. (tokens x[p], hidden g[p-1]); False when the eager path must do it."""
        kv = self.d.kv
        n = int(toks.shape[0])
        if not self.enabled or n == 0 or n > self.R or kv.length != first - 1 or first - 1 + self.R > kv.capacity:
            return False
        self.obs_tok[:n].copy_(toks)
        self.obs_g[:n].copy_(g_prev)
        self._set(0, 0, first)
        if self._run("observe", self._observe) is None and not self.enabled:
            return False
        kv.length += n
        return True
