"""Triton kernels for attention over the static KV cache: `kv_write`, `qkv_post` (q/k norm + RoPE + cache write)
and `attention` (each query row against the cache up to its own position, read from a device tensor; a program
per (row, kv head) serves the whole GQA group). Rows with position -1 are padding: nothing is written or read.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.gpu.kernels import HAVE_TRITON, pow2

if HAVE_TRITON:
    import triton
    import triton.language as tl

if HAVE_TRITON:

    @triton.jit
    def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, pos_ptr, stride_kw, stride_kh, stride_ch, stride_cs,
                         HD: tl.constexpr):
        row = tl.program_id(0)
        h = tl.program_id(1)
        pos = tl.load(pos_ptr + row)
        d = tl.arange(0, HD)
        m = d < tl.where(pos >= 0, HD, 0)     # masks from vector comparisons only (boolean in the interpreter)
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
        tl.store(q_ptr + row * stride_q + h * HD + d, out, mask=d < tl.where(is_q, HD, 0))
        cm = d < tl.where((h >= NH) & (pos >= 0), HD, 0)
        dst = hk.to(tl.int64) * stride_ch + tl.maximum(pos, 0).to(tl.int64) * stride_cs + d
        tl.store(kc_ptr + dst, out, mask=cm)
        v = tl.load(qkv_ptr + row * stride_qkv + (NH + NKV + hk) * HD + d, mask=cm, other=0.0)
        tl.store(vc_ptr + dst, v, mask=cm)


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
                           o.stride(0), o.stride(1), G=G, GP=pow2(G), HD=hd, BS=BS, num_warps=4, num_stages=2)
    return o


def qkv_post(qkv: Tensor, q_w: Tensor, k_w: Tensor, inv_freq: Tensor, rope_scale: float, pos: Tensor,
             kc: Tensor, vc: Tensor, nh: int, nkv: int, hd: int, eps: float) -> Tensor:
    """qkv [W, (nh+2nkv)*hd] -> q [W, nh, hd] (q_norm + RoPE); k (k_norm + RoPE) and v written to the cache."""
    W = qkv.shape[0]
    q = torch.empty(W, nh, hd, dtype=qkv.dtype, device=qkv.device)
    _qkv_post_kernel[(W, nh + nkv)](qkv, q_w, k_w, inv_freq, pos, q, kc, vc, float(eps), float(rope_scale),
                                    qkv.stride(0), q.stride(0), kc.stride(0), kc.stride(1), NH=nh, NKV=nkv, HD=hd)
    return q
