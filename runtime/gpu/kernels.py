"""Triton kernels for the CUDA fast path (optional: everything here has a plain-torch equivalent elsewhere).

Three jobs, each one launch and each *row-invariant* (a row's result depends only on that row's inputs, never on
how many other rows share the launch or where the row sits in it: fixed tiles, no split-K, fixed loop order), so a
one-row decode and a k-row verify of the same token give the same bits in BF16:

- `moe_grouped`: the routed experts of a window grouped by expert. The (token, slot) pairs are sorted by expert; the
  first pair of each expert (the "leader") reads that expert's weights once and multiplies every row routed to it;
  the other programs exit at once. Gate/up matmul + SiLU gating in one kernel, down matmul (scaled by the routing
  weight) in a second, the per-token sum of the top-k rows in a third. Shape-static: graph-capturable.
- `attention` (+ `kv_write`): one query row against the static KV cache up to that row's own position, read from a
  device tensor (no host sync, no padding of the cache span); a program per (row, kv head) serves the whole GQA
  group, so K/V are read once per row. Rows with position -1 are padding: nothing is written or read.
- `quant_linear`: y = x @ dequant(W)^T with W as ggml Q8_0/Q5_0/Q4_0 blocks, dequantized in registers (no BF16 copy
  of the matrix anywhere in memory).

Tests run them on CPU under TRITON_INTERPRET=1 (float32/float16 there: the interpreter has no bfloat16).
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.formats.registry import FORMATS

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs: the callers use their torch paths
    HAVE_TRITON = False

# the dequantizer branch of `_qlinear_kernel` per format; block bytes come from the format table
QCODE = {"q8_0": 0, "q5_0": 1, "q4_0": 2}
ENABLED = True   # benchmarks switch the kernels off to measure the plain-torch path ("before")
# tile shapes of the two expert kernels (block of outputs BN, reduction step BK, warps, pipeline stages); one choice
# for every window width keeps the kernels row-invariant. bench/gpu_checks.py times alternatives on the GPU.
MOE_UP = {"BN": 64, "BK": 64, "num_warps": 4, "num_stages": 3}
MOE_DOWN = {"BN": 64, "BK": 64, "num_warps": 4, "num_stages": 3}


def available(t: Tensor) -> bool:
    """True when the Triton path can run on tensor `t` (CUDA with Triton, or the CPU interpreter in tests)."""
    import os

    return ENABLED and HAVE_TRITON and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


if HAVE_TRITON:

    # ------------------------------------------------------------------------------------------------ MoE
    @triton.jit
    def _moe_up_kernel(x_ptr, tok_ptr, se_ptr, w_ptr, h_ptr, NP, E: tl.constexpr, NI, K: tl.constexpr,
                       stride_xm, stride_we, stride_wn, stride_hm,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        i = tl.program_id(0)
        nb = tl.program_id(1)
        e = tl.load(se_ptr + i)
        prev = tl.load(se_ptr + i - 1, mask=i > 0, other=-1)
        lead = (e < E) & (e != prev)
        kend = lead.to(tl.int32) * K       # non-leaders run no iterations
        r = i + tl.arange(0, BM)
        rin = r < NP
        rmask = rin & (tl.load(se_ptr + r, mask=rin, other=-1) == e) & lead
        tok = tl.load(tok_ptr + r, mask=rmask, other=0)
        n = nb * BN + tl.arange(0, BN)
        nm = n < NI
        e64 = e.to(tl.int64)
        accg = tl.zeros((BM, BN), dtype=tl.float32)
        accu = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, kend, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < K
            a = tl.load(x_ptr + tok[:, None] * stride_xm + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
            wb = w_ptr + e64 * stride_we + kk[:, None]
            bg = tl.load(wb + n[None, :] * stride_wn, mask=nm[None, :] & km[:, None], other=0.0)
            bu = tl.load(wb + (n[None, :] + NI) * stride_wn, mask=nm[None, :] & km[:, None], other=0.0)
            accg += tl.dot(a, bg)
            accu += tl.dot(a, bu)
        act = accg * tl.sigmoid(accg) * accu
        tl.store(h_ptr + r[:, None] * stride_hm + n[None, :], act.to(h_ptr.dtype.element_ty),
                 mask=rmask[:, None] & nm[None, :])

    @triton.jit
    def _moe_down_kernel(h_ptr, se_ptr, ord_ptr, wt_ptr, d_ptr, y_ptr, NP, E: tl.constexpr, N, K: tl.constexpr,
                         stride_hm, stride_de, stride_dn, stride_ym,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        i = tl.program_id(0)
        nb = tl.program_id(1)
        e = tl.load(se_ptr + i)
        prev = tl.load(se_ptr + i - 1, mask=i > 0, other=-1)
        lead = (e < E) & (e != prev)
        kend = lead.to(tl.int32) * K
        r = i + tl.arange(0, BM)
        rin = r < NP
        rmask = rin & (tl.load(se_ptr + r, mask=rin, other=-1) == e) & lead
        dst = tl.load(ord_ptr + r, mask=rmask, other=0)
        wt = tl.load(wt_ptr + dst, mask=rmask, other=0.0).to(tl.float32)
        n = nb * BN + tl.arange(0, BN)
        nm = n < N
        e64 = e.to(tl.int64)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, kend, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < K
            a = tl.load(h_ptr + r[:, None] * stride_hm + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
            b = tl.load(d_ptr + e64 * stride_de + n[None, :] * stride_dn + kk[:, None],
                        mask=nm[None, :] & km[:, None], other=0.0)
            acc += tl.dot(a, b)
        tl.store(y_ptr + dst[:, None] * stride_ym + n[None, :], acc * wt[:, None], mask=rmask[:, None] & nm[None, :])

    @triton.jit
    def _moe_sum_kernel(y_ptr, idx_ptr, o_ptr, E, N, stride_ym, stride_om, TOPK: tl.constexpr, BN: tl.constexpr):
        t = tl.program_id(0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nm = n < N
        acc = tl.zeros((BN,), dtype=tl.float32)
        for j in tl.static_range(TOPK):
            ok = tl.load(idx_ptr + t * TOPK + j) < E
            acc += tl.load(y_ptr + (t * TOPK + j) * stride_ym + n, mask=nm & ok, other=0.0)
        tl.store(o_ptr + t * stride_om + n, acc.to(o_ptr.dtype.element_ty), mask=nm)

    # ------------------------------------------------------------------------------------------ attention
    @triton.jit
    def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, pos_ptr, stride_kw, stride_kh, stride_ch, stride_cs,
                         HD: tl.constexpr):
        row = tl.program_id(0)
        h = tl.program_id(1)
        pos = tl.load(pos_ptr + row)
        d = tl.arange(0, HD)
        m = (d < HD) & (pos >= 0)
        src = row * stride_kw + h * stride_kh + d
        dst = h * stride_ch + pos.to(tl.int64) * stride_cs + d
        tl.store(kc_ptr + dst, tl.load(k_ptr + src, mask=m), mask=m)
        tl.store(vc_ptr + dst, tl.load(v_ptr + src, mask=m), mask=m)

    @triton.jit
    def _attn_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, scale,
                     stride_qw, stride_qh, stride_ch, stride_cs, stride_ow, stride_oh,
                     G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr):
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        pos = tl.load(pos_ptr + row)
        g = tl.arange(0, GP)
        d = tl.arange(0, HD)
        gm = g < G
        heads = kvh * G + g
        q = tl.load(q_ptr + row * stride_qw + heads[:, None] * stride_qh + d[None, :], mask=gm[:, None], other=0.0)
        m_i = tl.full((GP,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((GP,), dtype=tl.float32)
        acc = tl.zeros((GP, HD), dtype=tl.float32)
        base = kvh.to(tl.int64) * stride_ch
        for s0 in range(0, pos + 1, BS):
            s = s0 + tl.arange(0, BS)
            sm = s <= pos
            off = base + s[:, None].to(tl.int64) * stride_cs + d[None, :]
            k = tl.load(k_ptr + off, mask=sm[:, None], other=0.0)
            v = tl.load(v_ptr + off, mask=sm[:, None], other=0.0)
            sc = tl.dot(q, tl.trans(k)) * scale
            sc = tl.where(sm[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)    # fully masked so far: keep zeros, no NaN
            alpha = tl.exp(m_i - m_use)
            p = tl.exp(sc - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        l_i = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_i[:, None]
        tl.store(o_ptr + row * stride_ow + heads[:, None] * stride_oh + d[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=gm[:, None])

    # ------------------------------------------------------------------------------------ quantized linear
    @triton.jit
    def _qlinear_kernel(x_ptr, b_ptr, o_ptr, M, N, NBLK: tl.constexpr, stride_xm, stride_bn, stride_om,
                        QT: tl.constexpr, BSZ: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        pm = tl.program_id(0)
        pn = tl.program_id(1)
        rm = pm * BM + tl.arange(0, BM)
        n = pn * BN + tl.arange(0, BN)
        mm = rm < M
        nm = n < N
        j = tl.arange(0, 16)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        rowp = b_ptr + n.to(tl.int64) * stride_bn
        for kb in range(0, NBLK):
            blk = rowp + kb * BSZ
            b0 = tl.load(blk, mask=nm, other=0).to(tl.uint16)
            b1 = tl.load(blk + 1, mask=nm, other=0).to(tl.uint16)
            dsc = (b0 | (b1 << 8)).to(tl.float16, bitcast=True).to(tl.float32)
            if QT == 0:
                lo = tl.load(blk[:, None] + 2 + j[None, :], mask=nm[:, None], other=0).to(tl.int8, bitcast=True)
                hi = tl.load(blk[:, None] + 18 + j[None, :], mask=nm[:, None], other=0).to(tl.int8, bitcast=True)
                qlo = lo.to(tl.float32)
                qhi = hi.to(tl.float32)
            elif QT == 2:
                qs = tl.load(blk[:, None] + 2 + j[None, :], mask=nm[:, None], other=0).to(tl.int32)
                qlo = ((qs & 15) - 8).to(tl.float32)
                qhi = ((qs >> 4) - 8).to(tl.float32)
            else:
                h0 = tl.load(blk + 2, mask=nm, other=0).to(tl.int32)
                h1 = tl.load(blk + 3, mask=nm, other=0).to(tl.int32)
                h2 = tl.load(blk + 4, mask=nm, other=0).to(tl.int32)
                h3 = tl.load(blk + 5, mask=nm, other=0).to(tl.int32)
                qh = h0 | (h1 << 8) | (h2 << 16) | (h3 << 24)
                qs = tl.load(blk[:, None] + 6 + j[None, :], mask=nm[:, None], other=0).to(tl.int32)
                blo = (qh[:, None] >> j[None, :]) & 1
                bhi = (qh[:, None] >> (j[None, :] + 16)) & 1
                qlo = (((qs & 15) | (blo << 4)) - 16).to(tl.float32)
                qhi = (((qs >> 4) | (bhi << 4)) - 16).to(tl.float32)
            xa = tl.load(x_ptr + rm[:, None] * stride_xm + kb * 32 + j[None, :], mask=mm[:, None], other=0.0)
            xb = tl.load(x_ptr + rm[:, None] * stride_xm + kb * 32 + 16 + j[None, :], mask=mm[:, None], other=0.0)
            wlo = (qlo * dsc[:, None]).to(xa.dtype)
            whi = (qhi * dsc[:, None]).to(xa.dtype)
            acc += tl.dot(xa, tl.trans(wlo))
            acc += tl.dot(xb, tl.trans(whi))
        tl.store(o_ptr + rm[:, None] * stride_om + n[None, :], acc.to(o_ptr.dtype.element_ty),
                 mask=mm[:, None] & nm[None, :])


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, (n - 1).bit_length()))


def moe_grouped(x: Tensor, idx: Tensor, w: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """x [T, H]; idx [T, k] expert ids (an id >= E marks a padded row: it uses no expert and gets 0); w [T, k]
    routing weights; gate_up [E, 2I, H] (gate rows then up rows, transformers' layout); down [E, H, I] -> [T, H]."""
    T, H = x.shape
    k = idx.shape[1]
    E, two_i, _ = gate_up.shape
    inter = two_i // 2
    NP = T * k
    flat = idx.reshape(-1)
    se, order = torch.sort(flat, stable=True)
    se = se.to(torch.int32).contiguous()
    order = order.to(torch.int32).contiguous()
    tok = torch.div(order, k, rounding_mode="floor").contiguous()
    x = x.contiguous()
    BM = _pow2(T)
    h = torch.empty(NP, inter, dtype=x.dtype, device=x.device)
    _moe_up_kernel[(NP, triton.cdiv(inter, MOE_UP["BN"]))](
        x, tok, se, gate_up, h, NP, E, inter, H, x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
        BM=BM, **MOE_UP)
    y = torch.empty(NP, H, dtype=torch.float32, device=x.device)
    wf = w.reshape(-1).contiguous()
    _moe_down_kernel[(NP, triton.cdiv(H, MOE_DOWN["BN"]))](
        h, se, order, wf, down, y, NP, E, H, inter, h.stride(0), down.stride(0), down.stride(1), y.stride(0),
        BM=BM, **MOE_DOWN)
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    BS = 256
    _moe_sum_kernel[(T, triton.cdiv(H, BS))](y, flat.to(torch.int32).contiguous(), out, E, H, y.stride(0),
                                               out.stride(0), TOPK=k, BN=BS)
    return out


def kv_write(k: Tensor, v: Tensor, kc: Tensor, vc: Tensor, pos: Tensor) -> None:
    """k, v [W, nkv, hd] -> cache kc, vc [nkv, S, hd] at rows `pos` [W] (rows with pos < 0 are skipped)."""
    W, nkv, hd = k.shape
    k, v = k.contiguous(), v.contiguous()
    _kv_write_kernel[(W, nkv)](k, v, kc, vc, pos, k.stride(0), k.stride(1), kc.stride(0), kc.stride(1), HD=hd)


def attention(q: Tensor, kc: Tensor, vc: Tensor, pos: Tensor, scale: float) -> Tensor:
    """q [W, nh, hd] against cache kc, vc [nkv, S, hd]; row r sees cache rows 0..pos[r] (pos < 0: zeros)."""
    W, nh, hd = q.shape
    nkv = kc.shape[0]
    G = nh // nkv
    q = q.contiguous()
    o = torch.empty_like(q)
    BS = 64 if hd <= 64 else 32
    _attn_kernel[(W, nkv)](q, kc, vc, pos, o, float(scale), q.stride(0), q.stride(1), kc.stride(0), kc.stride(1),
                           o.stride(0), o.stride(1), G=G, GP=_pow2(G), HD=hd, BS=BS, num_warps=4, num_stages=2)
    return o


def quant_linear(x: Tensor, blocks: Tensor, qtype: str, in_features: int) -> Tensor:
    """x [..., K] @ dequant(blocks [N, K/32 * block_bytes])^T -> [..., N] in x's dtype."""
    code, bsz = QCODE[qtype], FORMATS[qtype].block_bytes
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features).contiguous()
    M = x2.shape[0]
    N = blocks.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    BM = 16 if M <= 16 else 32
    BN = 64
    _qlinear_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
        x2, blocks, out, M, N, in_features // 32, x2.stride(0), blocks.stride(0), out.stride(0),
        QT=code, BSZ=bsz, BM=BM, BN=BN, num_warps=4, num_stages=2)
    return out.reshape(*lead, N)


# ------------------------------------------------------------------------------------------------ fused decode ops
# The fixed-width step (runtime/static_step.py) runs a layer as 11 launches: rmsnorm, QKV matmul, q/k norm + RoPE +
# cache write, attention, o matmul, add + rmsnorm, router matmul, route (softmax, top-k, grouping by expert), expert
# up, expert down, top-k sum + residual. Rounding follows the torch modules (BF16 products rounded where they are).

if HAVE_TRITON:

    @triton.jit
    def _rmsnorm_kernel(x_ptr, d_ptr, w_ptr, xo_ptr, y_ptr, H, eps, stride_x, stride_y,
                        HAS_D: tl.constexpr, BH: tl.constexpr):
        r = tl.program_id(0)
        c = tl.arange(0, BH)
        m = c < H
        x = tl.load(x_ptr + r * stride_x + c, mask=m, other=0.0)
        if HAS_D:
            x = (x.to(tl.float32) + tl.load(d_ptr + r * stride_x + c, mask=m, other=0.0).to(tl.float32)).to(
                x_ptr.dtype.element_ty)
            tl.store(xo_ptr + r * stride_x + c, x, mask=m)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / H + eps)
        w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
        y = (xf * rstd).to(y_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(y_ptr + r * stride_y + c, y.to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _qkv_post_kernel(qkv_ptr, qw_ptr, kw_ptr, inv_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr, eps, rscale,
                         stride_qkv, stride_q, stride_ch, stride_cs,
                         NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr):
        row = tl.program_id(0)
        h = tl.program_id(1)                     # 0..NH-1: q heads, NH..NH+NKV-1: k (and v) heads
        pos = tl.load(pos_ptr + row)
        d = tl.arange(0, HD)
        dp = (d + HD // 2) % HD
        f = tl.maximum(pos, 0).to(tl.float32) * tl.load(inv_ptr + d % (HD // 2))
        dt = q_ptr.dtype.element_ty
        cos = (tl.cos(f) * rscale).to(dt).to(tl.float32)
        sin = (tl.sin(f) * rscale).to(dt).to(tl.float32)
        is_q = h < NH
        hk = h - NH
        col = tl.where(is_q, h * HD, (NH + hk) * HD)
        base = qkv_ptr + row * stride_qkv + col
        x = tl.load(base + d).to(tl.float32)
        xp = tl.load(base + dp).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / HD + eps)
        wq = tl.load(qw_ptr + d).to(tl.float32)
        wqp = tl.load(qw_ptr + dp).to(tl.float32)
        wk = tl.load(kw_ptr + d).to(tl.float32)
        wkp = tl.load(kw_ptr + dp).to(tl.float32)
        w = tl.where(is_q, wq, wk)
        wp = tl.where(is_q, wqp, wkp)
        xn = ((x * rstd).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
        xpn = ((xp * rstd).to(dt).to(tl.float32) * wp).to(dt).to(tl.float32)
        rot = tl.where(d < HD // 2, -xpn, xpn)
        out = ((xn * cos).to(dt).to(tl.float32) + (rot * sin).to(dt).to(tl.float32)).to(dt)
        tl.store(q_ptr + row * stride_q + h * HD + d, out, mask=(d < HD) & is_q)
        cm = (d < HD) & (h >= NH) & (pos >= 0)
        dst = hk.to(tl.int64) * stride_ch + tl.maximum(pos, 0).to(tl.int64) * stride_cs + d
        tl.store(kc_ptr + dst, out, mask=cm)
        v = tl.load(qkv_ptr + row * stride_qkv + (NH + NKV + hk) * HD + d, mask=cm, other=0.0)
        tl.store(vc_ptr + dst, v, mask=cm)

    @triton.jit
    def _route_kernel(lg_ptr, pos_ptr, idx_ptr, w_ptr, se_ptr, ord_ptr, tok_ptr, W, stride_lg,
                      E: tl.constexpr, EP: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr,
                      WP: tl.constexpr, NPP: tl.constexpr, NORM: tl.constexpr):
        rows = tl.arange(0, WP)
        rm = rows < W
        cols = tl.arange(0, EP)
        cm = cols < E
        lg = tl.load(lg_ptr + rows[:, None] * stride_lg + cols[None, :], mask=rm[:, None] & cm[None, :],
                     other=float("-inf")).to(tl.float32)
        mx = tl.max(lg, 1)
        mx = tl.where(rm, mx, 0.0)
        p = tl.exp(lg - mx[:, None])
        s = tl.sum(p, 1)
        s = tl.where(rm, s, 1.0)
        p = p / s[:, None]
        valid = rm & (tl.load(pos_ptr + rows, mask=rm, other=-1) >= 0)
        kc = tl.arange(0, KP)
        wt = tl.zeros((WP, KP), dtype=tl.float32)
        it = tl.zeros((WP, KP), dtype=tl.int32)
        for j in tl.static_range(TOPK):
            m = tl.max(p, 1)
            a = tl.min(tl.where(p == m[:, None], cols[None, :], EP), 1)
            wt = tl.where(kc[None, :] == j, m[:, None], wt)
            it = tl.where(kc[None, :] == j, a[:, None], it)
            p = tl.where(cols[None, :] == a[:, None], -1.0, p)
        if NORM:
            wt = wt / tl.sum(tl.where(kc[None, :] < TOPK, wt, 0.0), 1)[:, None]
        it = tl.where(valid[:, None], it, E)      # padded rows use no expert
        km = rm[:, None] & (kc[None, :] < TOPK)
        tl.store(idx_ptr + rows[:, None] * TOPK + kc[None, :], it, mask=km)
        tl.store(w_ptr + rows[:, None] * TOPK + kc[None, :], wt, mask=km)
        tl.debug_barrier()
        NP = W * TOPK
        pr = tl.arange(0, NPP)
        pm = pr < NP
        e = tl.load(idx_ptr + pr, mask=pm, other=E + 1)
        before = (e[None, :] < e[:, None]) | ((e[None, :] == e[:, None]) & (pr[None, :] < pr[:, None]))
        rank = tl.sum(before.to(tl.int32), 1)
        tl.store(se_ptr + rank, e, mask=pm)
        tl.store(ord_ptr + rank, pr, mask=pm)
        tl.store(tok_ptr + rank, pr // TOPK, mask=pm)

    @triton.jit
    def _moe_sum_res_kernel(y_ptr, idx_ptr, x_ptr, o_ptr, E, N, stride_ym, stride_x, TOPK: tl.constexpr,
                            BN: tl.constexpr):
        t = tl.program_id(0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nm = n < N
        acc = tl.zeros((BN,), dtype=tl.float32)
        for j in tl.static_range(TOPK):
            ok = tl.load(idx_ptr + t * TOPK + j) < E
            acc += tl.load(y_ptr + (t * TOPK + j) * stride_ym + n, mask=nm & ok, other=0.0)
        dt = o_ptr.dtype.element_ty
        x = tl.load(x_ptr + t * stride_x + n, mask=nm, other=0.0).to(tl.float32)
        tl.store(o_ptr + t * stride_x + n, (x + acc.to(dt).to(tl.float32)).to(dt), mask=nm)


def rmsnorm(x: Tensor, w: Tensor, eps: float, delta: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(x + delta, RMSNorm(x + delta) * w) for x [M, H] (delta None: x unchanged). Row-invariant."""
    M, H = x.shape
    y = torch.empty_like(x)
    xo = torch.empty_like(x) if delta is not None else x
    _rmsnorm_kernel[(M,)](x, delta if delta is not None else x, w, xo, y, H, float(eps), x.stride(0), y.stride(0),
                          HAS_D=delta is not None, BH=triton.next_power_of_2(H))
    return xo, y


def qkv_post(qkv: Tensor, q_w: Tensor, k_w: Tensor, inv_freq: Tensor, rope_scale: float, pos: Tensor,
             kc: Tensor, vc: Tensor, nh: int, nkv: int, hd: int, eps: float) -> Tensor:
    """qkv [W, (nh+2nkv)*hd] -> q [W, nh, hd] (q_norm + RoPE); k (k_norm + RoPE) and v written to the cache."""
    W = qkv.shape[0]
    q = torch.empty(W, nh, hd, dtype=qkv.dtype, device=qkv.device)
    _qkv_post_kernel[(W, nh + nkv)](qkv, q_w, k_w, inv_freq, pos, q, kc, vc, float(eps), float(rope_scale),
                                    qkv.stride(0), q.stride(0), kc.stride(0), kc.stride(1), NH=nh, NKV=nkv, HD=hd)
    return q


def route(logits: Tensor, pos: Tensor, top_k: int, norm: bool) -> tuple[Tensor, ...]:
    """Router logits [W, E] -> (idx [W, k] (E for padded rows), w [W, k] fp32, sorted experts, order, tokens)."""
    W, E = logits.shape
    dev = logits.device
    NP = W * top_k
    idx = torch.empty(W, top_k, dtype=torch.int32, device=dev)
    w = torch.empty(W, top_k, dtype=torch.float32, device=dev)
    se = torch.empty(NP, dtype=torch.int32, device=dev)
    order = torch.empty(NP, dtype=torch.int32, device=dev)
    tok = torch.empty(NP, dtype=torch.int32, device=dev)
    _route_kernel[(1,)](logits, pos, idx, w, se, order, tok, W, logits.stride(0), E=E,
                        EP=triton.next_power_of_2(E), TOPK=top_k, KP=triton.next_power_of_2(top_k),
                        WP=max(2, triton.next_power_of_2(W)), NPP=max(2, triton.next_power_of_2(NP)), NORM=norm,
                        num_warps=4)
    return idx, w, se, order, tok


def moe_routed(x: Tensor, residual: Tensor, idx: Tensor, w: Tensor, se: Tensor, order: Tensor, tok: Tensor,
               gate_up: Tensor, down: Tensor) -> Tensor:
    """residual + experts(x) with the routing from `route` (grouped by expert, row-invariant)."""
    T, H = x.shape
    k = idx.shape[1]
    E, two_i, _ = gate_up.shape
    inter = two_i // 2
    NP = T * k
    BM = _pow2(T)
    h = torch.empty(NP, inter, dtype=x.dtype, device=x.device)
    _moe_up_kernel[(NP, triton.cdiv(inter, MOE_UP["BN"]))](
        x, tok, se, gate_up, h, NP, E, inter, H, x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
        BM=BM, **MOE_UP)
    y = torch.empty(NP, H, dtype=torch.float32, device=x.device)
    _moe_down_kernel[(NP, triton.cdiv(H, MOE_DOWN["BN"]))](
        h, se, order, w, down, y, NP, E, H, inter, h.stride(0), down.stride(0), down.stride(1), y.stride(0),
        BM=BM, **MOE_DOWN)
    out = torch.empty_like(residual)
    BS = 256
    _moe_sum_res_kernel[(T, triton.cdiv(H, BS))](y, idx, residual, out, E, H, y.stride(0), residual.stride(0),
                                                   TOPK=k, BN=BS)
    return out


# ------------------------------------------------------------------------------------ DFlash2 dynamic convolution
if HAVE_TRITON:

    @triton.jit
    def _dyn_conv_kernel(h_ptr, d_ptr, b_ptr, o_ptr, H, NG, stride_h, stride_d, stride_o,
                         K: tl.constexpr, G: tl.constexpr, BH: tl.constexpr):
        t = tl.program_id(0)
        c = tl.arange(0, BH)
        m = c < H
        dt = o_ptr.dtype.element_ty
        acc = tl.zeros((BH,), dtype=tl.float32)
        for o in tl.static_range(K):
            ok = t >= o
            src = tl.maximum(t - o, 0)
            v = tl.load(h_ptr + src * stride_h + c, mask=m & ok, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + o * H + c, mask=m, other=0.0).to(tl.float32)
            dy = tl.load(d_ptr + t * stride_d + o * NG + c // G, mask=m, other=0.0).to(tl.float32)
            acc = (acc + (b * v).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            acc = (acc + (dy * v).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        tl.store(o_ptr + t * stride_o + c, acc.to(dt), mask=m)


def dyn_conv(h: Tensor, dyn: Tensor, half: int, base: Tensor, kernel_size: int, group_size: int) -> Tensor:
    """DFlash2's grouped dynamic causal convolution over one window's rows in one launch (ARTIFACTS §2 step 4):
    h [W, H]; dyn [W, 2*K*H/G] = kernel_projection(h_in) (the `half` 0 for prepare, 1 for finish); base [K, H].
    out[t] = Σ_o base[o] * h[t-o] + dyn[t, half, o] * h[t-o], rounded in h's dtype after every product and add,
    in the order of `GroupedDynamicCausalConv.conv` (so the bits are the module's)."""
    W, H = h.shape
    ng = H // group_size
    h = h.contiguous()
    base = base.contiguous()
    d = dyn[:, half * kernel_size * ng:]
    out = torch.empty_like(h)
    _dyn_conv_kernel[(W,)](h, d, base, out, H, ng, h.stride(0), dyn.stride(0), out.stride(0), K=kernel_size,
                           G=group_size, BH=triton.next_power_of_2(H))
    return out


# ------------------------------------------------------------------------------------------- DFlash2 selector walk
if HAVE_TRITON:

    @triton.jit
    def _lattice_walk_kernel(score_ptr, best_ptr, cand_ptr, tok_ptr, conf_ptr, R: tl.constexpr, K: tl.constexpr,
                             KP: tl.constexpr):
        i = tl.arange(0, KP)
        m = i < K
        j = tl.load(best_ptr)                    # row 0: every predecessor is the anchor; take column 0
        j = j * 0
        for r in tl.static_range(R):
            idx = tl.load(best_ptr + r * K + j)
            base = score_ptr + (r * K + j) * K
            row = tl.load(base + i, mask=m, other=float("-inf"))
            mx = tl.max(row, 0)
            s = tl.sum(tl.exp(row - mx), 0)
            pick = tl.load(base + idx)
            tl.store(conf_ptr + r, tl.exp(pick - mx) / s)
            tl.store(tok_ptr + r, tl.load(cand_ptr + r * K + idx))
            j = idx


def lattice_walk(score: Tensor, best: Tensor, cand: Tensor) -> tuple[Tensor, Tensor]:
    """The selector walk's chain in one launch: score [R, k(prev), k] fp32 lattice scores, best [R, k] = argmax over
    the last dim, cand [R, k] token ids -> (tokens [R] int64, confidence [R] fp32 = softmax of the walked row at
    the chosen candidate). Row 0 reads predecessor column 0 (all its predecessors are the anchor)."""
    R, k = best.shape
    tok = torch.empty(R, dtype=torch.long, device=best.device)
    conf = torch.empty(R, dtype=torch.float32, device=best.device)
    _lattice_walk_kernel[(1,)](score.contiguous(), best.contiguous(), cand.contiguous(), tok, conf, R=R, K=k,
                               KP=triton.next_power_of_2(k), num_warps=1)
    return tok, conf
