"""One fixed-width target step for decode and verify windows, captured once as a CUDA graph.

Why: on a GPU a small model's decode step is dominated by kernel launches (hundreds per step); a CUDA graph replays
them as one. A graph needs static shapes, so every window runs at one width `W` (a narrower window is padded with
rows at position -1, which write nothing and read nothing) and attention reads each row's own length from a device
tensor (runtime/gpu/attention_kernels.py: the context split into chunks fixed by position, a grid over the whole
capacity), so one graph serves every position and every window size up to W. A q8_0 cache (runtime/kv.py) is
written and read by the same kernels.

Why one width also for the one-token decode: in BF16 a 1-row and a k-row matmul can round differently and flip a
near-tie, which would break "greedy speculative output == target-only greedy output". At one width every row goes
through the same kernels with the same shapes, and the Triton kernels (attention, grouped MoE) are row-invariant by
construction, so a token's logits have the same bits whether it is verified alone or in a window. The engine
therefore runs target-only decoding at the same width as its drafted windows (runtime/engine.py, `step_width`).

Without Triton the same step runs eagerly through torch. On a GPU that is the fallback (full-capacity masked
attention, the MoE loop). On the CPU it is the engine's step, and it keeps the GPU's promise without kernels: every
matmul has the window's fixed shape (BLAS gives a row the same bits at any row of a fixed-shape product, but a
1-row and a k-row product differ: a 1-row decode and a verify row could round apart and flip a near-tie), a
row's attention depends on its query, its position and the cache only (`_attend_window`), and every
expert a real row uses runs on all W rows (its own fixed shape; only the routed rows are added in; a small model's
experts all run at once, `SparseMoe.dense`, each row weighting its own). So greedy speculative output equals
target-only output bit for bit on the CPU too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.gpu import attention_kernels, dense_kernels, kernels, moe_kernels, moe_row
from runtime.gpu.capture import HostScalars
from runtime.gpu.fallback import fell_back
from runtime.kv import KVCache, dequantize_q8_0, quantize_q8_0
from runtime.models import cpu_plan, cpu_rows
from runtime.models.layers import DENSE_ROWS, SparseMoe, project_qkv, qkv_rows
from runtime.models.qwen3_moe import TargetOutput


def _proj(x: Tensor, w: Tensor | None, role: str, usual, blocks=None) -> Tensor:
    """A projection of the fused step: one row through the GEMV kernel where dense_kernels.ONE_ROW_DENSE (a float
    matrix w) or QUANT_ONE_ROW (a block-format module `blocks`) says so, else the module's own path (`usual`:
    cuBLAS for BF16, the block kernels for a quantized matrix)."""
    y = dense_kernels.one_row(x, w, role)
    if y is None and blocks is not None:
        y = dense_kernels.quant_one_row(x, blocks, role)
    return usual(x) if y is None else y


def fusable(layer) -> bool:
    """Whether `fused_layer` can run this decoder layer: MoE with its experts stacked (or in an offload pool),
    q/k/v stacked, no attention bias."""
    mlp, a = layer.mlp, layer.self_attn
    return (isinstance(mlp, SparseMoe) and (mlp.gate_up is not None or mlp.offload is not None)
            and a.q_proj.bias is None and a.has_qkv)


def fused_layer(layer, i: int, x: Tensor, pos: Tensor, kv_args: tuple, part: Tensor | None, inv: Tensor,
                rscale: float, eps: float, rope_off: int = 0) -> Tensor:
    """One decoder layer of a decode/verify window through the fused kernels: x [W, H] -> [W, H]. Rows at pos < 0
    are padding. `kv_args`: the layer's cache (`LayerKV.kernel_args`); `rope_off`: RoPE at pos + rope_off (an MTP
    head's cache slot s holds position s + 1). The target's step and the MTP head's graphs run their layers here."""
    a = layer.self_attn
    kc, vc, ks, vs = kv_args
    fused = dense_kernels.norm_one_row(x, None, layer.input_layernorm.weight, eps, a.qkv_weight, "qkv")
    if fused is not None:
        qkv = fused[2]
    else:                           # block-format q/k/v: the norm folded into its product where the variant allows
        qkv = (dense_kernels.quant_norm_one_row(x, layer.input_layernorm.weight, eps, a.qkv_blocks, "qkv")
               if a.qkv_blocks is not None else None)
    if qkv is None:
        _, h = dense_kernels.rmsnorm(x, layer.input_layernorm.weight, eps)
        if a.qkv_weight is None and a.qkv_blocks is None:       # a K-quant mix: q and k stacked, v in its own format
            qkv = torch.cat((_proj(h, None, "qkv", a.qk_blocks, a.qk_blocks), _proj(h, None, "qkv", a.v_proj, a.v_proj)),
                            -1)
        else:
            qkv = _proj(h, a.qkv_weight, "qkv", a.qkv, a.qkv_blocks)
    q = attention_kernels.qkv_post(qkv, a.q_norm.weight, a.k_norm.weight, inv, rscale, pos, kc, vc, a.nh, a.nkv,
                                   a.hd, eps, ks=ks, vs=vs, rope_off=rope_off)
    wo = dense_kernels.weight_of(a.o_proj)
    o_early = dense_kernels.loads_early(q.reshape(q.shape[0], -1), wo, "o_proj")
    o = attention_kernels.attention(q, kc, vc, pos, a.scale, ks=ks, vs=vs, part=part, o_early=o_early)
    d = _proj(o.reshape(-1, a.nh * a.hd), wo, "o_proj", a.o_proj, a.o_proj)
    mlp = layer.mlp
    wr = dense_kernels.weight_of(mlp.gate)
    if moe_row.applies(x, wr, mlp):     # the MoE half of a one-row step in one persistent launch
        out, idx, _ = moe_row.moe_row(x, d, layer.post_attention_layernorm.weight, eps, wr, pos, mlp.gate_up,
                                      mlp.down, mlp.top_k, mlp.norm_topk, moe_row.barrier(mlp, x.device),
                                      fmt=mlp.fmt)
        if mlp.recorder is not None:
            mlp.recorder(i, idx)
        return out
    fused = dense_kernels.norm_one_row(x, d, layer.post_attention_layernorm.weight, eps, wr, "router")
    if fused is not None:
        x, h, lg = fused
    else:
        x, h = dense_kernels.rmsnorm(x, layer.post_attention_layernorm.weight, eps, delta=d)
        lg = _proj(h, dense_kernels.weight_of(mlp.gate), "router", mlp.gate, mlp.gate)
    r = moe_kernels.route(lg, pos, mlp.top_k, mlp.norm_topk, slot=mlp.slot)
    if mlp.recorder is not None:
        mlp.recorder(i, r.idx)
    if mlp.offload is not None:     # same bits as moe_routed: fp32 pair sum, rounded, then + residual
        return x + mlp.offload(i, h, r.idx, r.w)
    return moe_kernels.moe_routed(h, x, r, mlp.gate_up, mlp.down, fmt=mlp.fmt, slot=mlp.slot, miss_fn=mlp.miss_fn)


# CPU, a one-row step (a target decoding alone): the row's k experts called directly (`_one_row_experts`) instead
# of through the grouping loop of `StaticStep._moe_rows`; the same ops on the same shapes, so the same bits
CPU_ONE_ROW_DIRECT = True


def _one_row_experts(mlp: SparseMoe, h: Tensor, w: Tensor, idx: Tensor) -> Tensor:
    """The loop's result for one row h [1, H]: its experts in expert order, each as `MLP.forward` computes it (the
    expert's weights through F.linear), scaled by its routing weight and added to zeros as `index_add_` adds it.
    Why: a CPU step is paid per op, and the loop's sort, count, index and module calls cost about as much as the
    experts' arithmetic on a small model."""
    ids = idx[0].tolist()
    out = torch.zeros_like(h)
    for j in sorted(range(len(ids)), key=ids.__getitem__):
        out.add_((_expert(mlp.experts[ids[j]], h) * w[0:1, j:j + 1]).to(out.dtype))
    return out


def _expert(ex, h: Tensor) -> Tensor:
    """`MLP.forward` on h in the expert's dtype, through F.linear on its weights (no module calls: the same ops)."""
    x = h.to(ex.gate_proj.weight.dtype)
    return F.linear(F.silu(F.linear(x, ex.gate_proj.weight)) * F.linear(x, ex.up_proj.weight), ex.down_proj.weight)


# CPU: q- and k-norm as one RMSNorm and RoPE once over a window's q and k heads (`layers.qkv_rows`; same bits)
CPU_QK_MERGED = True


# CPU: the step through runtime/models/cpu_rows.py (norms as layer_norms, q/k/v with RoPE as one product and the
# scale in q, routing by the top-k's softmax, residual adds inside the products): each row from that row alone, in
# fewer ops, not the modules' bits (False: the module path's ops, `_forward_layers`)
CPU_FEWER_OPS = True


# CPU, a window of several rows: a row at a position >= CPU_SHARED_FROM reads the keys before its position rounded
# down to CPU_SHARED_CHUNK in one product with the window's other rows (`StaticStep._attend_bmm`)
CPU_SHARED_FROM = 2048
CPU_SHARED_CHUNK = 256

# CPU: the step through runtime/models/cpu_plan.py where every layer allows it (the same ops on the same tensors
# as CPU_FEWER_OPS's, so the same bits, with each layer's weights gathered once; False: through cpu_rows.py)
CPU_PLAN = True

# CPU: a row attends through two batched products and a softmax (scores, weights, values by KV head) rather than
# SDPA, whose CPU kernel costs about twice that for one query row (False: SDPA)
CPU_ROW_BMM = True

# CPU, a window of several rows: the rows attend together, the keys read once for all of them in one scores product,
# the values product in chunks of this many positions fixed by absolute position (`StaticStep._attend_window`);
# 0: each row alone (`_attend_bmm`)
CPU_WINDOW_CHUNK = 512
# the fused step's positions and embedding rows in one launch (`dense_kernels.step_inputs`) instead of torch's six
# (docs/models.md, "The captured step, kernel by kernel"); off: torch's ops (bench/step_ab.py arm inputs-torch)
STEP_INPUTS = True


class StaticStep:
    def __init__(self, model, kv: KVCache, width: int, *, graph: bool = True) -> None:
        if width < 1:
            raise ValueError(f"the static step width must be >= 1, got {width}.")
        self.model, self.kv, self.width = model, kv, int(width)
        dev = kv.k.device
        self.ids = torch.zeros(1, self.width, dtype=torch.long, device=dev)
        self.pos = torch.full((self.width,), -1, dtype=torch.int32, device=dev)
        # (start, rows) from the host through pinned buffers; the rows' positions are made on the device, inside
        # the graph: a window costs no host sync before its forward
        self.host = HostScalars(dev, 2)
        self.ar = torch.arange(self.width, dtype=torch.long, device=dev)
        p = next(model.parameters())
        moe = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoe)]
        # experts in an offload pool (runtime/experts.py): size it for this width before anything is captured
        caches = {id(c): c for m in moe if (c := getattr(m.offload, "__self__", None)) is not None}
        for c in caches.values():
            c.ensure_window(self.width)
        self.use_kernels = (kernels.available(kv.k) and kv.dtype == p.dtype
                            and all(m.gate_up is not None or m.offload is not None for m in moe))
        cfg = model.cfg
        # the split attention's partials, one buffer for every layer (runtime/kv.py `split_partials_bytes`)
        self.part = (attention_kernels.split_scratch(self.width, cfg.num_attention_heads, kv.capacity, cfg.head_dim,
                                                     dev) if self.use_kernels else None)
        # the fused layer (runtime/kernels.py: 11 launches a layer) needs every layer to be MoE, no attention bias
        self.fused = (self.use_kernels and not cfg.attention_bias and len(moe) == cfg.num_hidden_layers
                      and cfg.head_dim % 2 == 0)
        if self.fused:
            for layer in model.model.layers:
                layer.self_attn.stack_qkv()
            self.fused = all(layer.self_attn.has_qkv for layer in model.model.layers)
        self.use_graph = (bool(graph) and dev.type == "cuda" and self.use_kernels
                          and all(c.graphable for c in caches.values()))
        self.cpu = dev.type == "cpu"      # without kernels: the row-invariant torch paths (module docstring)
        self.window = (0, 0)              # (start, real rows) of the window being run, for those paths
        self.graphs: dict[tuple[int, ...], tuple[torch.cuda.CUDAGraph | None, tuple]] = {}
        self.replays = 0
        self.rope = cpu_plan.RopeTable(model.rotary)        # CPU_PLAN's RoPE matrices and layer plans
        self.plan = cpu_plan.ModelPlan(model.model.layers)
        self.errors: list[str] = []      # fallbacks taken (a kernel or a capture that failed), for the benchmarks

    # ----------------------------------------------------------------------------------------------- the forward
    def _attend(self, a, q: Tensor, k: Tensor, v: Tensor, i: int) -> Tensor:
        """q [W, nh, hd], k/v [W, nkv, hd] -> [W, nh, hd]: write the window's K/V, attend up to each row's position."""
        kc, vc, ks, vs = self.kv.layer(i).kernel_args()      # [nkv, S, hd] (q8_0: scales [nkv, S, hd/32])
        pos = self.pos
        if self.use_kernels:
            attention_kernels.kv_write(k, v, kc, vc, pos, ks, vs)
            return attention_kernels.attention(q, kc, vc, pos, a.scale, ks=ks, vs=vs, part=self.part)
        if self.cpu:
            return self._attend_rows(a, q, k, v, kc, vc, ks, vs)
        valid = pos >= 0
        idx = pos[valid].long()
        kn, vn = k[valid].transpose(0, 1), v[valid].transpose(0, 1)
        if ks is None:
            kc[:, idx] = kn.to(kc.dtype)
            vc[:, idx] = vn.to(vc.dtype)
        else:
            kc[:, idx], ks[:, idx] = quantize_q8_0(kn)
            vc[:, idx], vs[:, idx] = quantize_q8_0(vn)
            kc, vc = dequantize_q8_0(kc, ks, q.dtype), dequantize_q8_0(vc, vs, q.dtype)
        S = kc.shape[1]
        mask = torch.arange(S, device=pos.device)[None, :] <= pos.long()[:, None]
        mask[:, 0] |= ~valid                                     # padded rows: any finite result
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kc[None].to(q.dtype), vc[None].to(q.dtype),
                                           attn_mask=mask[None, None], scale=a.scale, enable_gqa=a.nkv != a.nh)
        return o[0].transpose(0, 1)

    def _attend_rows(self, a, q: Tensor, k: Tensor, v: Tensor, kc: Tensor, vc: Tensor, ks: Tensor | None = None,
                     vs: Tensor | None = None, scaled: bool = False) -> Tensor:
        """CPU: write the real rows' K/V (8-bit blocks for a q8_0 cache), then each real row attends alone to keys
        0..its position, so its result does not depend on the window it came in (padded rows give zeros).
        `scaled`: q carries the attention scale already (`cpu_rows.qkv`)."""
        start, n = self.window
        end = start + n
        W, nh, hd = q.shape
        wm = self._window_mask(kc.shape[1]) if W > 1 and CPU_WINDOW_CHUNK else None
        read = end if wm is None else wm[0]          # the window path reads its whole chunks
        kn, vn = k[:n].transpose(0, 1), v[:n].transpose(0, 1)
        if ks is None:
            kc[:, start:end] = kn.to(kc.dtype)
            vc[:, start:end] = vn.to(vc.dtype)
            keys, vals = kc[:, :read].to(q.dtype), vc[:, :read].to(q.dtype)
        else:
            kc[:, start:end], ks[:, start:end] = quantize_q8_0(kn)
            vc[:, start:end], vs[:, start:end] = quantize_q8_0(vn)
            keys = dequantize_q8_0(kc[:, :read], ks[:, :read], q.dtype)
            vals = dequantize_q8_0(vc[:, :read], vs[:, :read], q.dtype)
        if wm is not None:
            return self._attend_window(q if scaled else q * a.scale, keys, vals, a.nkv, wm)
        o = torch.empty_like(q)
        if n < W:
            o[n:].zero_()
        if CPU_ROW_BMM:
            self._attend_bmm(q if scaled else q * a.scale, keys, vals, o, a.nkv)
            return o
        for j in range(n):
            stop = start + j + 1
            oj = F.scaled_dot_product_attention(q[j:j + 1].transpose(0, 1)[None], keys[None, :, :stop],
                                                vals[None, :, :stop], scale=1.0 if scaled else a.scale,
                                                enable_gqa=a.nkv != a.nh)
            o[j] = oj[0, :, 0]
        return o

    def _window_mask(self, S: int) -> tuple[int, Tensor]:
        """For `_attend_window`: the keys a window reads, N (the window's end rounded up to CPU_WINDOW_CHUNK, at most
        the capacity S), and which of them each row may not see [W, N] (past its position; a padded row sees key 0
        only). N depends on the window's start and width, never on its real rows."""
        start, n = self.window
        W, C = self.width, CPU_WINDOW_CHUNK
        N = min(-(-(start + W) // C) * C, S)
        pos = torch.where(self.ar < n, start + self.ar, 0)
        return N, torch.arange(N, device=pos.device)[None, :] > pos[:, None]

    def _attend_window(self, q: Tensor, keys: Tensor, vals: Tensor, nkv: int, wm: tuple[int, Tensor]) -> Tensor:
        """A window's rows attending together: q [W, nh, hd] (scaled), keys/vals [nkv, >= N, hd] -> [W, nh, hd].
        One scores product for every row's query heads against keys 0..N-1 (N: `_window_mask`), each row's keys
        past its position masked, one softmax, then the values in fixed chunks of CPU_WINDOW_CHUNK positions
        (the last one shorter where the capacity ends), each a product of one shape, added in chunk order.
        Why it keeps a row's bits whatever the window: a score is one dot product over head_dim, which BLAS gives
        the same bits at any width of the product (observed; the tests check it); the softmax adds a row's exponentials lane by lane in position order (N >= 16 unless
        the whole cache is shorter, and then N is fixed), so the masked tail adds exact zeros; a values chunk has a
        fixed shape and a chunk past a row's position adds exact zeros; so
        a row's result depends on its query, its position and the cache only (docs/models.md, "Numerics", CPU;
        tests/runtime/test_static_step.py). It reads the keys once a window, not once a row, in a handful of ops
        where the rows alone took three a row."""
        W, nh, hd = q.shape
        grp, C = nh // nkv, CPU_WINDOW_CHUNK
        N, mask = wm                                   # `_window_mask`: made once a step, read by every layer
        qg = q.view(W, nkv, grp, hd).transpose(0, 1).reshape(nkv, W * grp, hd)
        s = torch.bmm(qg, keys[:, :N].transpose(1, 2))                          # [nkv, W * grp, N]
        s.view(nkv, W, grp, N).masked_fill_(mask[None, :, None, :], float("-inf"))
        p = torch.softmax(s, -1)
        o = torch.bmm(p[:, :, :C], vals[:, :min(C, N)])       # (the cache may hold spare slots past N)
        for c0 in range(C, N, C):
            o.baddbmm_(p[:, :, c0:c0 + C], vals[:, c0:min(c0 + C, N)])
        return o.view(nkv, W, grp, hd).transpose(0, 1).reshape(W, nh, hd)

    def _attend_bmm(self, q: Tensor, keys: Tensor, vals: Tensor, o: Tensor, nkv: int) -> None:
        """`_attend_rows` by batched products: q [W, nh, hd] (scaled), keys/vals [nkv, >= end, hd] -> o's real rows.
        A row attends alone to keys 0..its position p (its query heads grouped by KV head, scores, softmax,
        values). In a window of several rows, a row at p >= CPU_SHARED_FROM splits its keys at b = p rounded down
        to CPU_SHARED_CHUNK: keys 0..b-1 in one product for all W rows of the window (read once, not once a row),
        its own tail b..p alone with the shared part as one more key (score: its log-sum-exp; value: its output).
        Every shape depends on W and the row's own position only, so a row gets the same bits in
        any window of this width (docs/models.md, "Numerics", CPU)."""
        start, n = self.window
        W, nh, hd = q.shape
        grp = nh // nkv
        qg = q.reshape(W, nkv, grp, hd)                          # a row's query heads by KV head (GQA groups)
        og = o.view(W, nkv, grp, hd)
        shared: dict[int, tuple[Tensor, Tensor]] = {}
        for j in range(n):
            p = start + j
            b = p // CPU_SHARED_CHUNK * CPU_SHARED_CHUNK if W > 1 and p >= CPU_SHARED_FROM else 0
            if b == 0:
                s = torch.bmm(qg[j], keys[:, :p + 1].transpose(1, 2))                  # [nkv, group, p + 1]
                torch.bmm(torch.softmax(s, -1), vals[:, :p + 1], out=og[j])
                continue
            if b not in shared:          # keys 0..b-1 for every row of the window at once
                sb = torch.bmm(qg.transpose(0, 1).reshape(nkv, W * grp, hd), keys[:, :b].transpose(1, 2))
                # softmax and log-sum-exp from one exp pass (the two ops took two each, over W rows' scores)
                mx = sb.amax(-1, keepdim=True)
                e = sb.sub_(mx).exp_()
                tot = e.sum(-1, keepdim=True)
                shared[b] = (torch.bmm(e, vals[:, :b]).div_(tot).view(nkv, W, grp, hd),
                             mx.add_(tot.log_()).view(nkv, W, grp, 1))
            ob, lb = shared[b]
            # the row's own tail, with keys 0..b-1 as one more key: score lse_b, value o_b
            s = torch.cat((lb[:, j], torch.bmm(qg[j], keys[:, b:p + 1].transpose(1, 2))), -1)
            pr = torch.softmax(s, -1)
            torch.baddbmm(pr[:, :, :1] * ob[:, j], pr[:, :, 1:], vals[:, b:p + 1], out=og[j])

    def _moe_rows(self, mlp: SparseMoe, h: Tensor, i: int, fast: bool = False) -> Tensor:
        """CPU: every expert a real row routes to runs on all W rows (one fixed shape), and only the routed rows
        are added in, in expert order: a row's result does not depend on the other rows. h [W, H]. `fast`: the
        router through `cpu_rows.route`."""
        n = self.window[1]
        # the router at the fixed shape too, then the real rows
        w, idx = cpu_rows.route(mlp, h) if fast else mlp.route(h)
        if mlp.recorder is not None:
            mlp.recorder(i, torch.where((self.pos >= 0)[:, None], idx, mlp.n_exp))
        if mlp.offload is not None:         # an expert pool emulated on the CPU (tests): its own paths
            return mlp.offload(i, h, torch.where((self.pos >= 0)[:, None], idx, mlp.n_exp), w)
        if mlp.gate_up is not None and (mlp.quantized or mlp.slot is not None or mlp.miss_fn is not None):
            # experts held as blocks (no per-expert modules): the torch reference of the grouped kernels
            return moe_kernels.moe_torch(h, torch.where((self.pos >= 0)[:, None], idx, mlp.n_exp), w, mlp.gate_up,
                                         mlp.down, fmt=mlp.fmt, slot=mlp.slot, miss_fn=mlp.miss_fn)
        if mlp.dense_for(self.width):       # small experts: all at once (SparseMoe.dense), padded rows get 0
            return mlp.dense(h, torch.where((self.pos >= 0)[:, None], idx, mlp.n_exp), w)
        if self.width == 1 and n == 1 and CPU_ONE_ROW_DIRECT:
            return _one_row_experts(mlp, h, w, idx)
        w, idx = w[:n], idx[:n]
        out = torch.zeros_like(h)
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=mlp.n_exp).tolist()
        tok_all, slot_all = order // mlp.top_k, order % mlp.top_k
        off = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            tok, slot = tok_all[off:off + c], slot_all[off:off + c]
            off += c
            y = _expert(mlp.experts[e], h)[tok]
            out.index_add_(0, tok, (y * w[tok, slot, None]).to(out.dtype))
        return out

    def _forward_fused(self, taps: tuple[int, ...], x: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """The same step through the fused kernels (runtime/kernels.py): 11 launches a layer, the Triton ones
        with programmatic dependent launch (runtime/gpu/pdl.py); a one-row BF16 step 10, all Triton, its norms
        folded into the products (docs/models.md, "The one-row step")."""
        m = self.model
        cfg = m.cfg
        eps = cfg.rms_norm_eps
        pos = self.pos
        inv, rscale = m.rotary.inv_freq, m.rotary.scale
        wanted = {t: j for j, t in enumerate(taps)}
        tap_out: list[Tensor | None] = [None] * len(taps)
        for i, layer in enumerate(m.model.layers):
            x = fused_layer(layer, i, x, pos, self.kv.layer(i).kernel_args(), self.part, inv, rscale, eps)
            if i in wanted:
                tap_out[wanted[i]] = x
        _, hidden = dense_kernels.rmsnorm(x, m.model.norm.weight, eps)
        # a block-format head on the one-row tile QUANT_ONE_ROW names for it (none: the module's path)
        logits = _proj(hidden, dense_kernels.weight_of(m.lm_head), "lm_head", m.lm_head, m.lm_head).float()
        tap_t = torch.cat(tap_out, dim=-1) if taps else None  # type: ignore[arg-type]
        return logits, hidden, tap_t

    def _step(self, taps: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor | None]:
        """The captured function: positions from the device scalars (rows past the window at -1), then the forward
        (the fused one gets its embedding rows from the same launch)."""
        if self.fused and STEP_INPUTS:
            emb = self.model.model.embed_tokens       # a GGUF target's may be blocks (QuantEmbedding): torch's lookup
            x = dense_kernels.step_inputs(self.host.t, self.ids[0], self.pos,
                                          emb.weight if isinstance(emb, torch.nn.Embedding) else None)
            return self._forward_fused(taps, emb(self.ids)[0] if x is None else x)
        start, rows = self.host.t[0:1], self.host.t[1:2]
        self.pos.copy_(torch.where(self.ar < rows, start + self.ar, -1))
        return self._forward(taps)

    def _forward(self, taps: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor | None]:
        if self.fused:
            return self._forward_fused(taps, self.model.model.embed_tokens(self.ids)[0])
        if self.cpu and CPU_FEWER_OPS:
            plans = self.plan.get() if CPU_PLAN and self.width <= DENSE_ROWS else None
            if plans is not None:
                return self._forward_plan(plans, taps)
            return self._forward_cpu(taps)
        return self._forward_layers(taps)

    def _forward_plan(self, plans: list[cpu_plan.LayerPlan], taps: tuple[int, ...]
                      ) -> tuple[Tensor, Tensor, Tensor | None]:
        """`_forward_cpu` through each layer's `cpu_plan.LayerPlan`: the same ops on the same tensors (the same
        bits) without the per-op lookups around them; with a float cache a window's rows attend inline."""
        m = self.model
        W = self.width
        start, n = self.window
        x = m.model.embed_tokens(self.ids)[0]                    # [W, H]
        rot = self.rope.get(start, W, x.dtype, x.device)         # rows past the window: any rotation (unread)
        # a float cache in the compute dtype, no row reading keys in common with the others: attention inline
        kdt = self.kv.k.dtype
        inline = (CPU_ROW_BMM and self.kv.quant is None and kdt == x.dtype
                  and (W == 1 or start + n <= CPU_SHARED_FROM or CPU_WINDOW_CHUNK))
        wm = self._window_mask(self.kv.capacity) if inline and W > 1 and CPU_WINDOW_CHUNK else None
        wanted = {t: j for j, t in enumerate(taps)}
        tap_out: list[Tensor | None] = [None] * len(taps)
        for i, (layer, L) in enumerate(zip(m.model.layers, plans, strict=True)):
            q, k, v = cpu_plan.qkv(L, x, rot)
            kc, vc, ks, vs = self.kv.layer(i).kernel_args()
            if inline and W == 1:
                kc[:, start] = k[0]
                vc[:, start] = v[0]
                s = torch.bmm(q[0].view(L.nkv, L.nh // L.nkv, L.hd), kc[:, :start + 1].transpose(1, 2))
                o = torch.bmm(torch.softmax(s, -1), vc[:, :start + 1])
            elif wm is not None:
                kc[:, start:start + n] = k[:n].transpose(0, 1)
                vc[:, start:start + n] = v[:n].transpose(0, 1)
                o = self._attend_window(q, kc, vc, L.nkv, wm)
            elif inline:        # `_attend_bmm`'s rows with no shared part, without its bookkeeping
                kc[:, start:start + n] = k[:n].transpose(0, 1)
                vc[:, start:start + n] = v[:n].transpose(0, 1)
                qg = q.reshape(W, L.nkv, L.nh // L.nkv, L.hd)
                o = torch.empty(qg.shape, dtype=q.dtype, device=q.device)      # contiguous: viewed below
                if n < W:
                    o[n:].zero_()
                for j in range(n):
                    p = start + j + 1
                    s = torch.bmm(qg[j], kc[:, :p].transpose(1, 2))
                    torch.bmm(torch.softmax(s, -1), vc[:, :p], out=o[j])
            else:
                o = self._attend_rows(layer.self_attn, q, k, v, kc, vc, ks, vs, scaled=True)
            x = torch.addmm(x, o.view(W, L.nh * L.hd), L.wo)
            h = cpu_rows.rms_ln(x, L.ln2, L.eps2)
            mlp = L.mlp
            w, idx = cpu_plan.route(L, h)
            if mlp.recorder is not None:
                mlp.recorder(i, torch.where((self.pos >= 0)[:, None], idx, mlp.n_exp))
            if mlp.dense_for(W):
                x = cpu_rows.dense_experts(mlp, h, w, idx, x)
            elif W == 1:
                x = cpu_plan.routed(L, h, w, idx, x)
            else:       # fewer rows than E/k: each real row's k experts alone, as a one-row step runs them
                rows = [cpu_plan.routed(L, h[j:j + 1], w[j:j + 1], idx[j:j + 1], x[j:j + 1]) for j in range(n)]
                x = torch.cat((*rows, x[n:]))
            if i in wanted:
                tap_out[wanted[i]] = x
        hidden = cpu_rows.norm(m.model.norm, x).contiguous()
        logits = m.lm_head(hidden).float()
        tap_t = torch.cat(tap_out, dim=-1) if taps else None  # type: ignore[arg-type]
        return logits, hidden, tap_t

    def _forward_cpu(self, taps: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor | None]:
        """`_forward_layers` on the CPU through runtime/models/cpu_rows.py: about 36 ops a layer instead of 44 for
        one row, 41 instead of 46 for four (views not counted; a CPU step is paid per op); every row from that
        row alone, as the fixed-width step needs."""
        m = self.model
        x = m.model.embed_tokens(self.ids)[0]                    # [W, H]
        cos, sin = m.rotary(self.pos.clamp(min=0).long()[None], x.dtype)
        rot = cpu_rows.rope_matrices(cos[0], sin[0])             # once a step, one product a layer
        wanted = {t: j for j, t in enumerate(taps)}
        tap_out: list[Tensor | None] = [None] * len(taps)
        for i, layer in enumerate(m.model.layers):
            a = layer.self_attn
            q, k, v = cpu_rows.qkv(a, cpu_rows.norm(layer.input_layernorm, x), rot)
            kc, vc, ks, vs = self.kv.layer(i).kernel_args()
            o = self._attend_rows(a, q, k, v, kc, vc, ks, vs, scaled=True)
            x = cpu_rows.linear(a.o_proj, o.view(self.width, a.nh * a.hd), x)
            h = cpu_rows.norm(layer.post_attention_layernorm, x)
            mlp = layer.mlp
            packed = isinstance(mlp, SparseMoe) and mlp.dense_gu is not None and mlp.offload is None
            if packed and self.width <= DENSE_ROWS:
                # a small packed layer: every expert on every row of a window at once, or (fewer rows than E/k)
                # each real row's k experts alone, as a one-row step runs them
                w, idx = cpu_rows.route(mlp, h)
                if mlp.recorder is not None:
                    mlp.recorder(i, torch.where((self.pos >= 0)[:, None], idx, mlp.n_exp))
                if mlp.dense_for(self.width):
                    x = cpu_rows.dense_experts(mlp, h, w, idx, x)
                else:
                    n = self.window[1]
                    rows = [cpu_rows.routed_experts(mlp, h[j:j + 1], w[j:j + 1], idx[j:j + 1], x[j:j + 1])
                            for j in range(n)]
                    x = rows[0] if n == self.width == 1 else torch.cat((*rows, x[n:]))
            else:
                x = x + (self._moe_rows(mlp, h, i, fast=True) if isinstance(mlp, SparseMoe) else mlp(h))
            if i in wanted:
                tap_out[wanted[i]] = x
        hidden = cpu_rows.norm(m.model.norm, x).contiguous()
        # one product of the fixed shape (a row gets the same bits at any row of it): it reads the head's weights
        # once, W one-row products would read them W times
        logits = m.lm_head(hidden).float()
        tap_t = torch.cat(tap_out, dim=-1) if taps else None  # type: ignore[arg-type]
        return logits, hidden, tap_t

    def _forward_layers(self, taps: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor | None]:
        m = self.model
        W = self.width
        x = m.model.embed_tokens(self.ids)                       # [1, W, H]
        cos, sin = m.rotary(self.pos.clamp(min=0).long()[None], x.dtype)
        wanted = {t: j for j, t in enumerate(taps)}
        tap_out: list[Tensor | None] = [None] * len(taps)
        for i, layer in enumerate(m.model.layers):
            a = layer.self_attn
            if self.cpu and CPU_QK_MERGED and a.has_qkv:
                q, k, v = qkv_rows(a, layer.input_layernorm(x)[0], cos, sin)
            else:
                q, k, v = project_qkv(a, layer.input_layernorm(x), cos, sin)
                q, k = q[0].transpose(0, 1), k[0].transpose(0, 1)
            o = self._attend(a, q, k, v, i)
            x = x + a.o_proj(o.reshape(1, W, a.nh * a.hd))
            h = layer.post_attention_layernorm(x)
            mlp = layer.mlp
            if isinstance(mlp, SparseMoe) and self.use_kernels:
                w, idx = mlp.route(h[0])
                idx = torch.where((self.pos >= 0)[:, None], idx, mlp.n_exp)   # padded rows use no expert
                if mlp.recorder is not None:
                    mlp.recorder(i, idx)
                if mlp.offload is not None:
                    y = mlp.offload(i, h[0], idx, w)[None]
                else:
                    y = moe_kernels.moe_grouped(h[0], idx, w, mlp.gate_up, mlp.down, fmt=mlp.fmt, slot=mlp.slot,
                                                miss_fn=mlp.miss_fn)[None]
            elif isinstance(mlp, SparseMoe) and self.cpu:
                y = self._moe_rows(mlp, h[0], i)[None]
            else:
                y = mlp(h)
            x = x + y
            if i in wanted:
                tap_out[wanted[i]] = x
        hidden = m.model.norm(x)
        # on the CPU too one product of the fixed shape (a row gets the same bits at any row of it): it reads the
        # head's weights once, W one-row products would read them W times
        logits = m.lm_head(hidden).float()
        tap_t = torch.cat(tap_out, dim=-1)[0] if taps else None  # type: ignore[arg-type]
        return logits[0], hidden[0], tap_t

    def _capture(self, taps: tuple[int, ...]) -> tuple[torch.cuda.CUDAGraph, tuple]:
        from runtime.gpu.capture import capture

        self.host.set(0, 0)           # warm-up and capture write nothing to the cache (every row at -1)
        self.ids.zero_()
        return capture(lambda: self._step(taps))

    def _degrade(self, e: Exception) -> None:
        """Step down one level (fused -> unfused kernels -> plain torch, no graph), remember why and say so: a
        user would otherwise see only a step several times slower."""
        fell_back(self.errors, e, f"the {'fused' if self.fused else 'Triton'} decode step",
                  "the unfused kernels" if self.fused else "plain torch")
        torch.cuda.synchronize() if self.kv.k.is_cuda else None
        if self.fused:
            self.fused = False
        else:
            self.use_kernels = self.use_graph = False
        self.graphs.clear()

    # ------------------------------------------------------------------------------------------------ the API
    def accepts(self, n: int, taps: tuple[int, ...]) -> bool:
        return 1 <= n <= self.width

    @torch.no_grad()
    def __call__(self, window: Tensor, kv: KVCache, taps: tuple[int, ...] = ()) -> TargetOutput:
        """Same contract as `model(window, kv=kv, taps=taps)`: window [1, T] appended at kv.length."""
        if kv is not self.kv:
            raise ValueError("this static step was built for another KV cache.")
        T = int(window.shape[1])
        start = kv.length
        if not 1 <= T <= self.width:
            raise ValueError(f"window of {T} rows does not fit the static step width {self.width}.")
        if start + T > kv.capacity:
            raise ValueError(f"{start + T} positions exceed the KV cache capacity {kv.capacity}; raise the context.")
        key = tuple(taps)
        if self.use_graph and key not in self.graphs:
            try:
                self.graphs[key] = self._capture(key)
            except Exception as e:  # a kernel that does not build or a capture that fails: run eagerly instead
                self._degrade(e)
        self.host.set(start, T)
        self.window = (start, T)          # the same two numbers on the host, for the CPU's row-invariant paths
        self.ids[:, :T].copy_(window)
        if T < self.width:
            self.ids[:, T:].zero_()
        if self.use_graph and key in self.graphs:
            g, out = self.graphs[key]
            g.replay()
            self.replays += 1
        else:
            try:
                out = self._step(key)
            except Exception as e:
                if not self.use_kernels:
                    raise
                self._degrade(e)
                out = self._step(key)
        logits, hidden, tap_t = out
        if self.use_kernels or self.cpu:   # these paths bypass SparseMoe.forward: count the T real rows here
            for layer in self.model.model.layers:
                if isinstance(layer.mlp, SparseMoe) and layer.mlp.counter is not None:
                    layer.mlp.counter(layer.mlp.layer_idx, T)
        kv.length = start + T
        return TargetOutput(logits=logits[None, :T], hidden=hidden[None, :T].clone(),
                            taps=None if tap_t is None else tap_t[None, :T].clone())
