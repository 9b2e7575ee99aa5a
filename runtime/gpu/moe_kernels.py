"""Triton kernels for the routed experts (docs/models.md, "Numerics"): a window's (token, expert) pairs are sorted by
expert; the first pair of each expert (the "leader") reads that expert's weights once and multiplies every row
routed to it, the other programs exit at once. Gate/up matmul + SiLU gating in one kernel, down matmul (scaled by
the routing weight) in a second, the per-token sum of the top-k rows (+ the residual) in a third; `route` does the
router softmax, top-k and the grouping on the device. Row-invariant (fixed tiles, no split-K) and shape-static.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.gpu.kernels import HAVE_TRITON, pow2

if HAVE_TRITON:
    import triton
    import triton.language as tl

# tile shapes of the two expert kernels (block of outputs BN, reduction step BK, warps, pipeline stages); one choice
# for every window width keeps the kernels row-invariant. bench/gpu_checks.py times alternatives on the GPU.
MOE_UP = {"BN": 64, "BK": 64, "num_warps": 4, "num_stages": 3}
MOE_DOWN = {"BN": 64, "BK": 64, "num_warps": 4, "num_stages": 3}


if HAVE_TRITON:

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
    BM = pow2(T)
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
    BM = pow2(T)
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
