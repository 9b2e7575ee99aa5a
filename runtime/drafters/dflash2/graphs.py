"""CUDA graphs for DFlash2 drafting and observing (runtime/gpu/capture.py says how graphs work here).

Greedy and sampled windows are graphs (a sampled draw is a Gumbel-max with uniforms filled before the replay); the
prompt and windows that would run past the capacity take the drafter's eager paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.drafters.base import Proposal, floor_keep
from runtime.drafters.dflash2.model import _floor_q, follow_lattice, lattice_scores, lattice_walk
from runtime.gpu import attention_kernels, dense_kernels, dflash2_kernels, kernels
from runtime.gpu.capture import GraphSet, QuantStack, capture, stack_linears, stack_quant_linears
from runtime.gpu.fallback import fell_back
from runtime.sampling import SamplingParams, gumbel_pick, probs, sampling_key


def _stack(mods: list) -> Tensor | QuantStack | None:
    w = stack_linears(mods)
    return w if w is not None else stack_quant_linears(mods)


class DFlash2Graphs(GraphSet):
    """Greedy drafting (draft forward + lattice selector walk + the floor cut, all on the device: one graph per block,
    no host read) and observing up to `max_block` committed rows, for a `runtime.drafters.dflash2.loading.DFlash2Drafter`.

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
                     and all(layer.window is None for layer in m.layers)
                     and len({layer.causal for layer in m.layers}) == 1 and g.head_dim % 2 == 0)
        # q/k/v and gate/up as one product each: float weights stacked for one matmul, block-format ones
        # (a quantized head) for one GEMV launch
        self.qkv: list[Tensor | QuantStack | None] = []
        self.gate_up: list[Tensor | QuantStack | None] = []
        self.o_proj: list[QuantStack | None] = []       # block-format o_proj / down_proj through the GEMV launch
        self.down: list[QuantStack | None] = []
        if self.fast:
            for layer in m.layers:
                a = layer.self_attn
                self.qkv.append(_stack([a.q_proj, a.k_proj, a.v_proj]))
                self.gate_up.append(_stack([layer.mlp.gate_proj, layer.mlp.up_proj]))
                self.o_proj.append(stack_quant_linears([a.o_proj]))
                self.down.append(stack_quant_linears([layer.mlp.down_proj]))
        # the split attention's partials, shared by every graph of this set (they run one at a time)
        self.part = (attention_kernels.split_scratch(self.obs_rows, g.num_heads, drafter.cache.capacity, g.head_dim,
                                                     self.dev) if self.fast else None)
        self.ar = torch.arange(self.obs_rows, device=self.dev)
        self.noise = torch.zeros(self.obs_rows, g.vocab_size, dtype=torch.float32, device=self.dev)
        self.mask_ids = torch.full((self.obs_rows,), g.mask_token_id, dtype=torch.long, device=self.dev)

    def _run(self, key: object, fn) -> object | None:
        """A fast-path function that fails to run or capture turns the fast path off (recorded in `errors`) and the
        plain graphs take over; the eager paths remain behind those."""
        if self.fast and self.enabled and (not self.cuda or key not in self.graphs):
            try:
                if not self.cuda:
                    return fn()
                self._touch(key)
                self.graphs[key] = capture(fn)
            except Exception as e:
                fell_back(self.errors, e, "the DFlash2 drafter's fast path", "its plain graphs",
                          prefix="fast path off: ")
                self.fast = False
                self.graphs.clear()
                self.settings.clear()
                if self.cuda:
                    torch.cuda.synchronize()
        return super()._run(key, fn)

    # -- fast path ------------------------------------------------------------------------------------------------
    def _qkv(self, i: int, y: Tensor) -> Tensor:
        a = self.d.model.layers[i].self_attn
        w = self.qkv[i]
        if isinstance(w, QuantStack):
            return w(y)
        if w is not None:
            return F.linear(y, w)
        return torch.cat([a.q_proj(y), a.k_proj(y), a.v_proj(y)], dim=-1)

    def _post(self, i: int, qkv: Tensor, pos: Tensor) -> Tensor:
        """q_norm + RoPE of q (returned [W, nh, hd]); k_norm + RoPE of k and v written to cache slots `pos`."""
        m, cache = self.d.model, self.d.cache
        a = m.layers[i].self_attn
        return attention_kernels.qkv_post(qkv, a.q_norm.weight, a.k_norm.weight, m.rotary.inv_freq, 1.0, pos, cache.k[i],
                                cache.v[i], a.nh, a.nkv, a.hd, a.q_norm.eps)

    def _conv(self, conv, h: Tensor, dyn: Tensor, half: int) -> Tensor:
        return dflash2_kernels.dyn_conv(h, dyn, half, conv.base_kernel[half], conv.kernel_size, conv.group_size)

    def _mlp(self, i: int, y: Tensor) -> Tensor:
        mlp = self.d.model.layers[i].mlp
        w = self.gate_up[i]
        if w is None:
            return mlp(y)
        gu = w(y) if isinstance(w, QuantStack) else F.linear(y, w)
        inter = gu.shape[-1] // 2
        return (self.down[i] or mlp.down_proj)(F.silu(gu[:, :inter]) * gu[:, inter:])

    def _draft_fast(self, width: int, sp: SamplingParams | None = None) -> tuple[Tensor, ...]:
        d, m = self.d, self.d.model
        g = m.geom
        embed, lm_head = d._shared
        anchor, pos = self.scal[0:1], self.scal[1:2]
        ar = self.ar[:width]
        ids = torch.where(ar == 0, anchor, self.mask_ids[:width])
        x = embed(ids).to(m.dtype)     # the target's module: a table of floats or of ggml blocks
        if g.input_embedding_scale != 1.0:
            x = x * g.input_embedding_scale
        qpos = (pos + ar).to(torch.int32)                                    # the block's cache slots
        causal = m.layers[0].causal                                          # one for all layers (see `fast`)
        last = qpos if causal else (pos + (width - 1)).to(torch.int32).expand(width).contiguous()
        delta = None
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            x, y = dense_kernels.rmsnorm(x, layer.input_layernorm.weight, layer.input_layernorm.eps, delta)
            ac, mc = layer.attention_conv, layer.mlp_conv
            if ac is not None:
                dyn = ac.kernel_projection(y)
                y = self._conv(ac, y, dyn, 0)
            q = self._post(i, self._qkv(i, y), qpos)
            o = attention_kernels.attention(q, d.cache.k[i], d.cache.v[i], last, a.hd ** -0.5, part=self.part)
            y = (self.o_proj[i] or a.o_proj)(o.reshape(width, a.nh * a.hd))
            if ac is not None:
                y = self._conv(ac, y, dyn, 1)
            x, y = dense_kernels.rmsnorm(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps, y)
            if mc is not None:
                dyn = mc.kernel_projection(y)
                y = self._conv(mc, y, dyn, 0)
            y = self._mlp(i, y)
            if mc is not None:
                y = self._conv(mc, y, dyn, 1)
            delta = y
        _, h = dense_kernels.rmsnorm(x, m.norm.weight, m.norm.eps, delta)
        return self._select(h[1:], anchor, sp)

    def _select(self, hs: Tensor, anchor: Tensor, sp: SamplingParams | None = None) -> tuple[Tensor, ...]:
        m = self.d.model
        logits = m.compute_logits(hs, self.d._shared[1])
        sel = m.candidate_selector
        if sp is not None:
            return self._select_sampled(hs, logits, anchor, sp)
        if sel is None:
            p1 = torch.softmax(logits.float(), dim=-1)
            toks = torch.argmax(logits, dim=-1)
            return toks, p1.gather(-1, toks[:, None])[:, 0]
        return lattice_walk(sel, hs, logits, anchor, kernel=dflash2_kernels.lattice_walk if self.fast else None)

    def _select_sampled(self, hs: Tensor, logits: Tensor, anchor: Tensor, sp: SamplingParams) -> tuple[Tensor, ...]:
        """The sampled walk of `select_walk` (or `argmax_walk`'s draws for the v1 layout) without a host read: each
        row's draw is a Gumbel-max over its candidates with uniforms filled before the replay, taken for every
        possible predecessor at once (the lattice); the chain then follows the drawn predecessors. Returns (tokens,
        confidence, q [R, V] restricted to the floor as `select_walk` does)."""
        sel = self.d.model.candidate_selector
        R, V = logits.shape
        floor = self.floor
        if sel is None:
            q = probs(logits, sp)
            toks = gumbel_pick(torch.log(q), self.noise[:R])
            p1 = torch.softmax(logits.float(), dim=-1)
            return toks, p1.gather(-1, toks[:, None])[:, 0], _floor_q(q, p1 >= floor)
        cand, score = lattice_scores(sel, hs, logits, anchor)
        g = -torch.log(-torch.log(self.noise[:R, :sel.top_k]))                     # Gumbel noise per row, candidate
        best = torch.argmax(score / sp.temperature + g[:, None, :], dim=-1)         # [R, j]: the draw after each j
        idx, row = follow_lattice(best, score)                                      # [R], [R, k] the walked rows
        conf_all = torch.softmax(row, dim=-1)
        conf = conf_all.gather(-1, idx[:, None])[:, 0]
        qk = _floor_q(torch.softmax(row / sp.temperature, dim=-1), conf_all >= floor)
        q = torch.zeros(R, V, dtype=torch.float32, device=logits.device).scatter(-1, cand, qk)
        return cand.gather(-1, idx[:, None])[:, 0], conf, q

    def _observe_fast(self) -> None:
        m = self.d.model
        c = m.fc(self.obs_taps)
        _, c = dense_kernels.rmsnorm(c, m.hidden_norm.weight, m.hidden_norm.eps)
        pos = (self.scal[2:3] + self.ar).to(torch.int32)
        for i in range(len(m.layers)):
            self._post(i, self._qkv(i, c), pos)
        return None

    # -- plain path -----------------------------------------------------------------------------------------------
    def _draft(self, width: int, sp: SamplingParams | None = None) -> tuple[Tensor, ...]:
        if self.fast:
            return self._draft_fast(width, sp)
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
        hs = m._run_layers(m.block_input(ids, embed), q_pos, ctx, k_pos, k_valid)[0, 1:]
        return self._select(hs, anchor, sp)

    def propose(self, anchor: int, pos: int, n: int, min_p: float, sampling: SamplingParams | None = None,
                generator: torch.Generator | None = None) -> Proposal | None:
        if not self.enabled or pos != self.d.cache.length or (self.fast and pos + n + 1 > self.d.cache.capacity):
            return None
        self._set(anchor, pos)
        return self._block(n, min_p, sampling, generator)

    def ahead(self, taps: Tensor, pos: int, acc: Tensor, anchor: Tensor, n: int, min_p: float,
              sampling: SamplingParams | None, generator: torch.Generator | None) -> Proposal | None:
        """Observe a verified window's rows and draft the next block before the host knows how many were accepted
        (docs/models.md, "Drafting ahead"): all W rows go into slots pos .. pos+W-1 and the block drafts at
        pos + acc + 1, writing its own K/V over the first row that was not accepted and past it; nothing reads a
        slot beyond the block's last."""
        cache = self.d.cache
        W = int(taps.shape[0])
        if not self.enabled or W > self.obs_rows or pos != cache.length or pos + self.obs_rows > cache.capacity \
                or (self.fast and pos + W + n + 1 > cache.capacity):
            return None
        self.obs_taps[:W].copy_(taps)
        self._set_ahead(anchor, pos + 1, acc, pos)       # the observation reads only the start (scal[2])
        if self._run("observe", self._observe) is None and not self.enabled:
            return None
        return self._block(n, min_p, sampling, generator)

    def _block(self, n: int, min_p: float, sampling: SamplingParams | None,
               generator: torch.Generator | None) -> Proposal | None:
        """One block of n + 1 rows from the scalars already set."""
        sk = sampling_key(sampling)
        sp = sampling if sk is not None else None
        self._set_floor(min_p)
        if sp is not None:
            self.noise[:n].uniform_(generator=generator)      # the draws' randomness, outside the graph
        out = self._run(("draft", n + 1, sk), lambda: self._draft_cut(n + 1, sp))
        if out is None:
            return None
        toks, conf, keep, q = out
        # all rows and the floor's count, on the device: the loop reads nothing before verifying. The graph's own
        # output buffers, not copies: valid until this graph set's next replay (`Proposal`)
        return Proposal(tokens=toks, q=q, confidence=conf, keep=keep)

    def _draft_cut(self, width: int, sp: SamplingParams | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """One block: draft forward, selector walk (greedy or sampled) and the floor cut, one launch sequence (one
        graph)."""
        out = self._draft(width, sp)
        toks, conf = out[0], out[1]
        return toks, conf, floor_keep(conf, self.floor), out[2] if len(out) > 2 else None

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
