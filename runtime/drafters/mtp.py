"""The MTP drafter: chained drafting over the target's own `mtp` head (docs/models.md, "MTP head"), and its CUDA
graphs for greedy windows (runtime/gpu/capture.py says how graphs work here)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from runtime import cpu_ops
from runtime.drafters import head8 as _head8
from runtime.drafters import mtp_compiled
from runtime.drafters.base import Proposal, floor_keep
from runtime.gpu import attention_kernels, dense_kernels, kernels, moe_kernels
from runtime.gpu.capture import GraphSet
from runtime.gpu.static_step import fusable, fused_layer
from runtime.kv import KVCache
from runtime.models import cpu_plan, cpu_rows
from runtime.models.layers import DENSE_ROWS, SparseMoe, cached_attention, project_qkv
from runtime.sampling import SamplingParams, gumbel_pick, probs, sampling_key

# CPU rows through the layer's `cpu_plan.LayerPlan` (its weights gathered once; False: through cpu_rows.py)
_PLAN = True

# CPU: the committed rows that a window's first step runs with it write their cache entries only; the last row
# alone goes on through attention, o_proj, the experts and the norm (False: every row goes through the layer)
LAST_ONLY = True


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
        p = model.model.norm.weight          # the model's dtype and device (lm_head may hold ggml blocks)
        self.kv = KVCache(1, cfg.num_key_value_heads, cfg.head_dim, capacity, dtype=kv_dtype or p.dtype,
                          device=p.device)
        self.logits_buf = torch.zeros(max_block, cfg.vocab_size, dtype=torch.float32, device=p.device)
        self.last_g: Tensor | None = None
        self.next_pos = 0
        # committed rows not yet in the cache (tokens, g[p-1], first position): the eager path runs them with the
        # next window's first step, one forward for both (a CPU pays a step per forward, whatever its rows)
        self.pending: tuple[Tensor, Tensor, int] | None = None
        self.graphs = None   # MTPGraphs (below), set by the engine on CUDA (greedy windows)
        self.ahead: tuple[int, Proposal] | None = None   # (position, proposal) drafted ahead (`draft_ahead`)
        # the eager chain stops at the floor on the host (a free read on a CPU), else runs on and cuts on the device
        self.host_cut = p.device.type == "cpu"
        # CPU: the chain's vocabulary head in 8 bits (runtime/drafters/head8.py); None: the target's own head
        self.head8 = _head8.int8_head(model.lm_head) if self.host_cut else None
        # the CPU rows' RoPE matrices, made max_block positions at a time: the chain asks for one position a step
        self.rope = cpu_plan.RopeTable(model.rotary, span=max_block)
        self.plan = cpu_plan.ModelPlan(self.mtp.layers)                   # the CPU rows' layer plan (`_rows_cpu`)
        # CPU: the chain's step compiled ahead of time (runtime/drafters/mtp_compiled.py), attached by the engine
        # when this machine has its package; None: the eager rows
        self.compiled: mtp_compiled.CompiledStep | None = None
        # the compiled step's int8 copies of fc, q/k/v, o_proj and the experts with their scales (mtp_compiled.dense8)
        self.dense8: tuple[Tensor, ...] | None = None

    def reset(self) -> None:
        self.kv.reset()
        self.last_g, self.next_pos, self.pending, self.ahead = None, 0, None, None

    def flush(self) -> None:
        """Write the pending committed rows into the cache (chunked like the target's prefill): for a reader that
        wants the cache complete now, not at the next window."""
        if self.pending is None:
            return
        toks, g_prev, first = self.pending
        self.pending = None
        for s in range(0, int(toks.shape[0]), self.chunk):
            self._step(toks[s:s + self.chunk], g_prev[s:s + self.chunk], first + s)

    def _step(self, tok: Tensor, g: Tensor, first_pos: int, last_only: bool = False) -> Tensor:
        """Run rows (tok [n], g [n, H]) at positions first_pos.. into the cache; returns MTP hidden [n, H] (on the
        CPU with `last_only` the last row's alone, [1, H]: `_rows_cpu` finishes only that row)."""
        n = tok.shape[0]
        if self.kv.length != first_pos - 1:
            raise RuntimeError(f"MTP cache holds {self.kv.length} entries, position {first_pos} needs {first_pos - 1}.")
        if first_pos - 1 + n > self.kv.capacity:
            raise ValueError(f"MTP cache capacity {self.kv.capacity} exceeded at position {first_pos + n - 1}.")
        if self.host_cut and self.kv.quant is None:
            h = self._rows_cpu(tok, g, first_pos, last_only)
        else:
            pos = torch.arange(first_pos, first_pos + n, device=tok.device)[None]
            emb = self.model.model.embed_tokens(tok)[None]
            h = self.mtp(emb, g[None].to(emb.dtype), pos, self.model.rotary, (self.kv.layer(0), self.kv.length))[0]
        self.kv.length += n
        return h

    def _compiled_fits(self, pend: tuple[Tensor, Tensor, int] | None, pos: int, n: int) -> bool:
        """Whether the compiled step serves this whole chain: attached, the cache holding what the first step's
        rows follow, those rows within the step's limit, and every slot the chain writes within the cache and the
        step's range (else the eager chain runs, and says what is wrong)."""
        if self.compiled is None or n < 1:
            return False
        rows = 1 + (0 if pend is None else int(pend[0].shape[0]))
        s0 = self.kv.length
        return s0 == (pos if pend is None else pend[2]) - 1 and rows <= mtp_compiled.MAX_ROWS and s0 >= 1 \
            and s0 + rows + n <= self.kv.capacity - mtp_compiled.MAX_ROWS

    def _propose_compiled(self, tok: Tensor, g: Tensor, pend: tuple[Tensor, Tensor, int] | None, n: int,
                          min_p: float, sampling: SamplingParams | None, generator: torch.Generator | None
                          ) -> Proposal:
        """`propose`'s CPU chain through the compiled step (runtime/drafters/mtp_compiled.py): the same steps, the
        pending committed rows with the first; each step's greedy token and top-1 probability come out of the step
        itself. A floor stops the chain on the host, as the eager chain does."""
        c = self.compiled
        if pend is not None:
            tok, g = torch.cat((pend[0], tok)), torch.cat((pend[1], g.to(pend[1].dtype)))
        greedy = sampling is None or sampling.greedy
        toks, qs, confs = [], [], []
        committed = self.kv.length
        for i in range(n):
            s0, r = self.kv.length, int(tok.shape[0])
            h, lg, t, conf = c(tok, g, s0)            # the rows' entries written at slots s0..
            self.kv.length = s0 + r
            if i == 0:
                committed = self.kv.length       # (anchor, g[pos-1]) are true: keep this entry
            if min_p > 0 and float(conf) < min_p:
                break
            if not greedy:
                q = probs(lg[0], sampling)
                t = torch.multinomial(q, 1, generator=generator)
                qs.append(q)
            toks.append(t)
            confs.append(conf)
            tok, g = t, h
        self.kv.rollback(committed)
        return Proposal(tokens=torch.cat(toks) if toks else torch.zeros(0, dtype=torch.long),
                        q=torch.stack(qs) if qs else None,
                        confidence=torch.cat(confs) if confs else torch.zeros(0))

    def use_compiled(self, root: Path, build: bool = False) -> str:
        """Attach the compiled CPU step from its package under `root`, building it first when `build` is set and
        this machine has none. Returns "" once attached, else why the eager rows serve."""
        self.compiled = None
        if not self.host_cut:
            return "not on a CPU"
        # the chain's own cache in bf16 beside fp32 weights: drafts need no particular bits (verification decides),
        # and at long contexts the cache is most of what a chained step reads (docs/models.md, "MTP head"); the
        # eager rows would convert it every step, so it goes back to fp32 where the compiled step does not load
        to16 = mtp_compiled.wanted() and mtp_compiled.BF16_CACHE and self.kv.quant is None \
            and self.kv.k.dtype == torch.float32 and self.kv.length == 0 and self.pending is None
        if to16:
            self._cache_dtype(torch.bfloat16)
        if build and mtp_compiled.wanted() and mtp_compiled.fits(self) is None:
            cpu_ops.ensure(root, build=True)      # the head op's library first (runtime/cpu_ops.py); optional
        step, why = mtp_compiled.load(self, root)
        if step is None and build and mtp_compiled.wanted() and mtp_compiled.fits(self) is None:
            try:
                mtp_compiled.build(self, mtp_compiled.package_path(self, root))
            except Exception as exc:         # no C++ compiler, an inductor error: eager, and the reason
                return f"building it failed ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]})" \
                    if str(exc).strip() else f"building it failed ({type(exc).__name__})"
            step, why = mtp_compiled.load(self, root)
        if step is None and to16:
            self._cache_dtype(torch.float32)
        self.compiled = step
        return why

    def _cache_dtype(self, dtype: torch.dtype) -> None:
        """The head's cache anew in `dtype` (empty: called before a generation)."""
        kv = self.kv
        if kv.k.dtype != dtype:
            self.kv = KVCache(1, kv.k.shape[2], kv.k.shape[4], kv.capacity, dtype=dtype, device=kv.k.device)
            self.reset()

    def _rows_cpu(self, tok: Tensor, g: Tensor, first: int, last_only: bool = False) -> Tensor:
        """`MTPHead.forward` for rows at consecutive positions first.. on the CPU, through the layer's plan
        (runtime/models/cpu_plan.py) or runtime/models/cpu_rows.py (norms as layer_norms, the two input norms as
        one, q/k/v with the scale in q and RoPE as one product, the residual adds inside the products, routing by
        the top-k's softmax), the cache written and read in place, a window's rows attending by batched products,
        and a small layer's experts all at once. Why: a CPU step is paid per op, and the chain runs one row at a
        time (docs/models.md, "MTP head"). Drafts need no bits. `last_only`: the rows before the last are committed
        rows, wanted for their cache entries alone (the head has one layer: its K/V come before attention), so
        only the last row attends and goes through o_proj, the experts (its k, not all) and the norm."""
        mtp, m = self.mtp, self.model
        eps = m.cfg.rms_norm_eps
        layer = mtp.layers[0]
        a = layer.self_attn
        nh, nkv, hd = a.nh, a.nkv, a.hd
        n = int(tok.shape[0])
        plans = self.plan.get() if _PLAN and n <= DENSE_ROWS else None
        emb = m.model.embed_tokens(tok)
        e_g = torch.stack((emb, g.to(emb.dtype)), 1)                               # [n, 2, H]
        w_e, w_g = mtp.pre_fc_norm_embedding.weight, mtp.pre_fc_norm_hidden.weight
        ins = cpu_rows.derived(mtp, "_in_norms", (w_e, w_g), lambda: torch.stack((w_e, w_g)))   # [2, H]
        x = cpu_rows.linear(mtp.fc, (cpu_rows.rms_ln(e_g, None, eps) * ins).view(n, -1))
        if n <= self.max_block:
            rot = self.rope.get(first, n, x.dtype, x.device)
        else:
            cos, sin = m.rotary(torch.arange(first, first + n, device=x.device)[None], x.dtype)
            rot = cpu_rows.rope_matrices(cos[0], sin[0])
        L = plans[0] if plans is not None else None
        if L is not None:
            q, k, v = cpu_plan.qkv(L, x, rot)                                      # q carries the scale
        else:
            q, k, v = cpu_rows.qkv(a, cpu_rows.norm(layer.input_layernorm, x), rot)
        s0 = self.kv.length
        kc, vc = self.kv.k[0, 0], self.kv.v[0, 0]                                  # [nkv, S, hd]
        kc[:, s0:s0 + n] = k.transpose(0, 1)
        vc[:, s0:s0 + n] = v.transpose(0, 1)
        keys, vals = kc[:, :s0 + n], vc[:, :s0 + n]
        if keys.dtype != x.dtype:
            keys, vals = keys.to(x.dtype), vals.to(x.dtype)
        grp = nh // nkv
        if last_only and n > 1:       # the committed rows' entries are written: the last row alone goes on
            q, x, n = q[-1:], x[-1:], 1
        q = q.reshape(n, nkv, grp, hd)
        if n <= self.max_block:
            # a window's rows: scores, weights and values by KV head, the rows' own keys masked causally (SDPA's
            # CPU kernel costs about twice that for one row, and builds a [rows x context] mask for a few)
            qg = q.transpose(0, 1).reshape(nkv, n * grp, hd)                         # lines (row, head in group)
            sc = torch.bmm(qg, keys.transpose(1, 2))                               # [nkv, n * grp, s0 + n]
            if n > 1:
                mask = torch.full((n, n), float("-inf"), device=sc.device).triu_(1)
                sc[..., s0:] += mask.repeat_interleave(grp, 0)
            o = torch.bmm(torch.softmax(sc, -1), vals).view(nkv, n, grp, hd).transpose(0, 1).reshape(n, -1)
        else:           # committed rows in prefill-sized chunks (the scale is in q)
            qh = q.reshape(n, nh, hd).transpose(0, 1)[None]
            o = cached_attention(qh, keys[None], vals[None], 1.0)[0].transpose(0, 1).reshape(n, nh * hd)
        mlp = layer.mlp
        if L is not None:
            x = torch.addmm(x, o, L.wo)
            y = cpu_rows.rms_ln(x, L.ln2, L.eps2)
            w, idx = cpu_plan.route(L, y)
            if mlp.recorder is not None:
                mlp.recorder(mlp.layer_idx, idx)
            x = cpu_plan.routed(L, y, w, idx, x) if n == 1 else cpu_rows.dense_experts(mlp, y, w, idx, x)
            if mlp.counter is not None:
                mlp.counter(mlp.layer_idx, n)
            return cpu_rows.norm(mtp.norm, x)
        x = cpu_rows.linear(a.o_proj, o, x)
        y = cpu_rows.norm(layer.post_attention_layernorm, x)
        if isinstance(mlp, SparseMoe) and mlp.dense_for(n) and mlp.offload is None and mlp.recorder is None:
            w, idx = cpu_rows.route(mlp, y)
            # a chained step's one row reads its k experts; a window's rows every expert at once
            x = (cpu_rows.routed_experts if n == 1 else cpu_rows.dense_experts)(mlp, y, w, idx, x)
            if mlp.counter is not None:
                mlp.counter(mlp.layer_idx, n)
        else:
            x = x + mlp(y)
        return cpu_rows.norm(mtp.norm, x)

    @torch.no_grad()
    def observe(self, tokens: Tensor, hidden: Tensor, taps: Tensor | None, start: int) -> None:
        n = int(tokens.shape[0])
        if n == 0:
            return
        if start != self.next_pos:
            raise RuntimeError(f"MTP drafter observed position {start}, expected {self.next_pos}.")
        self.ahead = None
        self.flush()
        # entries for positions p in [start, start+n): token x[p] with g[p-1]
        g_prev = hidden[:-1] if self.last_g is None else torch.cat((self.last_g[None], hidden[:-1]), 0)
        toks = tokens if self.last_g is not None else tokens[1:]
        first = start if self.last_g is not None else start + 1
        have = self.kv.length            # slots already true (the kept first step of the last window)
        skip = max(0, have - (first - 1))
        if skip:
            g_prev, toks, first = g_prev[skip:], toks[skip:], first + skip
        toks = toks.to(self.kv.k.device)
        if toks.shape[0] and (self.graphs is None or not self.graphs.observe_rows(toks, g_prev, first)):
            self.pending = (toks, g_prev, first)       # run with the next window's first step (`propose`)
        self.last_g = hidden[-1].detach()
        self.next_pos = start + n

    @torch.no_grad()
    def propose(self, anchor: int, pos: int, n: int, *, min_p: float = 0.0, sampling: SamplingParams | None = None,
                generator: torch.Generator | None = None) -> Proposal:
        if pos != self.next_pos or self.last_g is None:
            raise RuntimeError(f"MTP drafter asked to draft at position {pos}, it has observed up to {self.next_pos}.")
        n = min(n, self.max_block - 1)
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[0] == pos:     # drafted before the last window's read (`draft_ahead`)
            if ahead[1].tokens.shape[0] == n:
                return ahead[1]
            self.kv.length = pos - 1                  # another width: draft again (the kept entry is rewritten)
        if self.graphs is not None:
            self.flush()
            prop = self.graphs.propose(anchor, pos, n, min_p, sampling, generator)
            if prop is not None:
                return prop
        committed = self.kv.length
        dev = self.kv.k.device
        cpu = self.host_cut
        tok = torch.full((1,), int(anchor), dtype=torch.long, device=dev)   # a fill, not a host-to-device copy
        g = self.last_g[None]
        pend, self.pending = self.pending, None
        if pend is not None and (pend[2] + pend[0].shape[0] != pos or pend[0].shape[0] >= self.chunk):
            self.pending = pend
            self.flush()
            pend = None
        if cpu and self._compiled_fits(pend, pos, n):
            return self._propose_compiled(tok, g, pend, n, min_p, sampling, generator)
        toks, qs, confs = [], [], []
        per_step = not cpu or min_p > 0
        for i in range(n):
            if i == 0 and pend is not None:      # the pending committed rows and the first step: one forward
                h = self._step(torch.cat((pend[0], tok)), torch.cat((pend[1], g.to(pend[1].dtype))), pend[2],
                               last_only=LAST_ONLY)[-1:]
            else:
                h = self._step(tok, g, pos + i)
            if i == 0:
                committed = self.kv.length       # (anchor, g[pos-1]) are true: keep this entry
            lg = self.logits_buf[i]
            if self.head8 is not None:
                lg[None].copy_(_head8.logits(h, self.head8, cast=False))    # bf16 -> fp32 in the copy
            else:
                lg[None].copy_(self.model.lm_head(h))
            if per_step:
                c = torch.softmax(lg, -1).max()      # the floor statistic, independent of the token drawn
                if cpu and min_p > 0 and float(c) < min_p:
                    break
                confs.append(c)
            if sampling is None or sampling.greedy:
                t = lg.max(-1, keepdim=True)[1]      # argmax's index (the first of equals) in a cheaper CPU op
            else:
                q = probs(lg, sampling)
                t = torch.multinomial(q, 1, generator=generator)
                qs.append(q)
            toks.append(t)
            tok, g = t, h
        self.kv.rollback(committed)
        if per_step:
            conf = torch.stack(confs) if confs else torch.zeros(0, device=dev)
        else:           # no floor to stop at: the window's confidences in one op, not two a step
            conf = torch.softmax(self.logits_buf[:len(toks)], -1).amax(-1)
        return Proposal(
            tokens=torch.cat(toks) if toks else torch.zeros(0, dtype=torch.long, device=dev),
            q=torch.stack(qs) if qs else None,
            confidence=conf,
            keep=floor_keep(conf, min_p) if min_p > 0 and not cpu and toks else None,
        )

    def draft_ahead(self, window: Tensor, hidden: Tensor, taps: Tensor | None, pos: int, acc: Tensor,
                    anchor: Tensor, n: int, *, min_p: float = 0.0, sampling: SamplingParams | None = None,
                    generator: torch.Generator | None = None) -> bool:
        """Queue the window's observation and the next proposal before the loop's read (`MTPGraphs.ahead`); False
        when only the after-read path can (no graphs, rows held back, capacity)."""
        self.ahead = None
        if self.graphs is None or self.pending is not None or self.next_pos != pos or self.last_g is None:
            return False
        n = min(n, self.max_block - 1)
        prop = self.graphs.ahead(window, hidden, pos, acc, anchor, n, min_p,
                                 sampling if sampling is not None and not sampling.greedy else None, generator)
        if prop is None:
            return False
        self.ahead = (pos, prop)
        return True

    def settle(self, acc: int) -> None:
        """The host's side of a window observed ahead: acc + 1 rows committed, the next chain's first entry kept."""
        pos, prop = self.ahead
        nxt = pos + acc + 1
        self.kv.length = self.next_pos = nxt
        self.last_g = self.graphs.g_in[0]      # g[nxt - 1]: the chain's input, kept until the next window drafts
        self.ahead = (nxt, prop)

    def make_graphs(self) -> MTPGraphs:
        """The CUDA graph runner for greedy windows (the engine attaches it on CUDA)."""
        return MTPGraphs(self)

    def memory_report(self) -> dict[str, int]:
        from runtime.memory import weight_tensors

        w = sum(t.numel() * t.element_size() for _, t in weight_tensors(self.mtp))   # floats and ggml blocks
        mlp = self.mtp.layers[0].mlp
        if getattr(mlp, "fmt", None) is not None:        # experts as ggml block stacks (not registered tensors)
            w += sum(t.numel() * t.element_size() for t in (mlp.gate_up, mlp.down))
        for int8 in (self.head8, self.dense8):           # the CPU chain's 8-bit head and layer matrices
            if int8 is not None:
                w += sum(t.numel() * t.element_size() for t in int8)
        return {"drafter_weights": w, "drafter_kv": self.kv.nbytes,
                "logits": self.logits_buf.numel() * self.logits_buf.element_size()}


# the head's graphs run its layer through the fused decode kernels (False: the module path; the benchmarks' switch)
FUSED = True


class MTPGraphs(GraphSet):
    """Chained drafting of n steps (greedy, or sampled: a Gumbel-max draw from `probs` with uniforms filled before
    the replay) and observing up to `max_block` committed rows for an `MTPDrafter`, one graph each (needs the
    Triton kernels: the cached attention reads each row's slot on the device)."""

    def __init__(self, drafter) -> None:
        super().__init__(drafter.kv.k.device)
        self.d = drafter
        H = drafter.model.cfg.hidden_size
        dt = drafter.model.model.norm.weight.dtype
        self.R = drafter.max_block
        self.g_in = torch.zeros(1, H, dtype=dt, device=self.dev)
        self.obs_tok = torch.zeros(self.R, dtype=torch.long, device=self.dev)
        self.obs_g = torch.zeros(self.R, H, dtype=dt, device=self.dev)
        self.noise = torch.zeros(self.R, drafter.model.cfg.vocab_size, dtype=torch.float32, device=self.dev)
        self.enabled = kernels.available(drafter.kv.k)
        cfg = drafter.model.cfg
        # the split attention's partials, shared by every graph of this set (they run one at a time)
        self.part = (attention_kernels.split_scratch(self.R, cfg.num_attention_heads, drafter.kv.capacity,
                                                     cfg.head_dim, self.dev) if self.enabled else None)
        layer = drafter.mtp.layers[0]
        if self.enabled and FUSED:
            layer.self_attn.stack_qkv()
        # the head's layer through the target step's fused kernels (about 26 launches a chained step instead of about
        # 90: the chain is launch-bound, docs/models.md "MTP head"), where the layer allows it
        self.fused = self.enabled and FUSED and fusable(layer) and layer.mlp.offload is None

    def _rows(self, tok: Tensor, g: Tensor, p: Tensor, slot: Tensor) -> Tensor:
        """MTP rows at positions p (cache slots `slot` = p - 1, -1 = padding) -> MTP hidden [W, H]."""
        if self.fused:
            return self._rows_fused(tok, g, slot)
        model, mtp, kv = self.d.model, self.d.mtp, self.d.kv
        W = tok.shape[0]
        emb = model.model.embed_tokens(tok)[None]
        x = mtp.fc(torch.cat((mtp.pre_fc_norm_embedding(emb), mtp.pre_fc_norm_hidden(g[None].to(emb.dtype))), -1))
        cos, sin = model.rotary(p[None], x.dtype)
        layer = mtp.layers[0]
        a = layer.self_attn
        q, k, v = project_qkv(a, layer.input_layernorm(x), cos, sin)
        kc, vc = kv.k[0, 0], kv.v[0, 0]
        attention_kernels.kv_write(k[0].transpose(0, 1), v, kc, vc, slot)
        o = attention_kernels.attention(q[0].transpose(0, 1), kc, vc, slot, a.scale, part=self.part)
        x = x + a.o_proj(o.reshape(1, W, a.nh * a.hd))
        h = layer.post_attention_layernorm(x)
        mlp = layer.mlp
        if isinstance(mlp, SparseMoe):
            if mlp.gate_up is None:
                raise RuntimeError("the MTP layer's experts are not stacked; no graph.")
            w, idx = mlp.route(h[0])
            idx = torch.where((slot >= 0)[:, None], idx, mlp.n_exp)
            y = moe_kernels.moe_grouped(h[0], idx, w, mlp.gate_up, mlp.down, fmt=mlp.fmt, slot=mlp.slot,
                                        miss_fn=mlp.miss_fn)[None]
        else:
            y = mlp(h)
        return mtp.norm(x + y)[0]

    def _rows_fused(self, tok: Tensor, g: Tensor, slot: Tensor) -> Tensor:
        """`_rows` through the fused kernels: the norms as one Triton launch each, the layer as the target step's
        (`fused_layer`, RoPE at slot + 1)."""
        model, mtp = self.d.model, self.d.mtp
        eps = model.cfg.rms_norm_eps
        emb = model.model.embed_tokens(tok)                                    # [W, H]
        _, e = dense_kernels.rmsnorm(emb, mtp.pre_fc_norm_embedding.weight, eps)
        _, gh = dense_kernels.rmsnorm(g.to(emb.dtype).contiguous(), mtp.pre_fc_norm_hidden.weight, eps)
        x = mtp.fc(torch.cat((e, gh), -1))
        kv = self.d.kv
        x = fused_layer(mtp.layers[0], mtp.layers[0].mlp.layer_idx, x, slot,
                        (kv.k[0, 0], kv.v[0, 0], None, None), self.part, model.rotary.inv_freq,
                        model.rotary.scale, eps, rope_off=1)
        return dense_kernels.rmsnorm(x, mtp.norm.weight, eps)[1]

    def _chain(self, n: int, sp: SamplingParams | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        lm_head = self.d.model.lm_head
        tok, g = self.scal[0:1], self.g_in
        p = self.scal[1:2]
        toks, confs, qs = [], [], []
        for i in range(n):
            h = self._rows(tok, g, p, (p - 1).to(torch.int32))
            lg = lm_head(h).float()
            confs.append(torch.softmax(lg, dim=-1).amax(-1))     # top-1 probability: the floor's statistic
            if sp is None:
                t = torch.argmax(lg, dim=-1)
            else:
                q = probs(lg, sp)
                t = gumbel_pick(torch.log(q), self.noise[i:i + 1])
                qs.append(q)
            toks.append(t)
            tok, g, p = t, h, p + 1
        conf = torch.cat(confs)
        return torch.cat(toks), conf, floor_keep(conf, self.floor), torch.cat(qs) if qs else None

    def propose(self, anchor: int, pos: int, n: int, min_p: float, sampling: SamplingParams | None = None,
                generator: torch.Generator | None = None) -> Proposal | None:
        d = self.d
        if not self.enabled or n <= 0 or d.last_g is None or d.kv.length != pos - 1 \
                or pos - 1 + n > d.kv.capacity:
            return None
        self._set(anchor, pos)
        if d.last_g.data_ptr() != self.g_in.data_ptr():     # after a window drafted ahead it is g_in already
            self.g_in.copy_(d.last_g[None])
        prop = self._draft(n, min_p, sampling, generator)
        if prop is not None:
            d.kv.length = pos        # the first step's inputs (anchor, g[pos-1]) are true: its entry stays
        return prop

    def _draft(self, n: int, min_p: float, sampling: SamplingParams | None,
               generator: torch.Generator | None) -> Proposal | None:
        """The chain of n steps from the scalars and g_in already set."""
        sk = sampling_key(sampling)
        sp = sampling if sk is not None else None
        self._set_floor(min_p)
        if sp is not None:
            self.noise[:n].uniform_(generator=generator)      # the draws' randomness, outside the graph
        out = self._run(("chain", n, sk), lambda: self._chain(n, sp))
        if out is None:
            return None
        toks, conf, keep, q = out
        # all n rows and the floor's count, on the device: the loop reads nothing before verifying. The graph's own
        # output buffers, not copies: valid until this graph set's next replay (`Proposal`)
        return Proposal(tokens=toks, q=q, confidence=conf, keep=keep)

    def ahead(self, window: Tensor, hidden: Tensor, pos: int, acc: Tensor, anchor: Tensor, n: int, min_p: float,
              sampling: SamplingParams | None, generator: torch.Generator | None) -> Proposal | None:
        """Observe a verified window's rows and draft the next window, before the host knows how many rows were
        accepted (docs/models.md, "Drafting ahead"): entries for positions pos+1 .. pos+W-1 (tokens window[1:],
        hidden[:-1]) all go in, and the chain starts at pos + acc + 1 from anchor and hidden[acc], so its first
        step overwrites the first entry that was not accepted; later ones lie past every slot it reads."""
        kv = self.d.kv
        W = int(window.shape[0])
        if not self.enabled or n <= 0 or W - 1 > self.R or kv.length != pos or pos + self.R > kv.capacity \
                or pos + W - 1 + n > kv.capacity:
            return None
        self._set_ahead(anchor, pos + 1, acc, pos + 1)   # the observation reads only the start (scal[2])
        if W > 1:
            self.obs_tok[:W - 1].copy_(window[1:])
            self.obs_g[:W - 1].copy_(hidden[:W - 1])
            if self._run("observe", self._observe) is None and not self.enabled:
                return None
        self.g_in.copy_(hidden.index_select(0, acc.reshape(1)))
        return self._draft(n, min_p, sampling, generator)

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
