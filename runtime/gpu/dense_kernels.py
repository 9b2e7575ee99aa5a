"""Triton kernels for dense rows: `rmsnorm` (+ residual add) and `quant_linear` (x @ dequant(W)^T with W as ggml
Q8_0/Q5_0/Q4_0 blocks, dequantized in registers: no float copy of the matrix anywhere in memory).
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.formats.registry import FORMATS
from runtime.gpu import moe_gemv
from runtime.gpu.kernels import HAVE_TRITON, pow2

if HAVE_TRITON:
    import triton
    import triton.language as tl

# the dequantizer branch of `_qlinear_kernel` per format; block bytes come from the format table
QCODE = {"q8_0": 0, "q5_0": 1, "q4_0": 2}


if HAVE_TRITON:

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


GEMV_ROWS = 64   # up to this many rows (decode and verify windows) a quantized matrix goes through the GEMV kernels


def quant_linear(x: Tensor, blocks: Tensor, qtype: str, in_features: int) -> Tensor:
    """x [..., K] @ dequant(blocks [N, K/32 * block_bytes])^T -> [..., N] in x's dtype.

    Decode and verify windows (few rows) use the matrix-vector kernels of runtime/gpu/moe_gemv.py, the matrix taken
    as the single expert every row is routed to (weight 1): the weights are read once, by many programs, and a row's
    bits do not depend on the other rows. Longer inputs (prefill) use the tiled kernel below."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features).contiguous()
    M = x2.shape[0]
    N = blocks.shape[0]
    cfg = moe_gemv.variant(qtype) if M <= GEMV_ROWS else None
    if cfg is not None:
        one = torch.zeros(M, dtype=torch.int32, device=x.device)          # every row -> expert 0
        rows = torch.arange(M, dtype=torch.int32, device=x.device)        # output row of each pair
        y = torch.empty(M, N, dtype=torch.float32, device=x.device)
        moe_gemv.down(x2, one, one, rows, torch.ones(M, dtype=torch.float32, device=x.device), blocks[None], y,
                      qtype, 1, False, False, pow2(M), cfg)
        return y.to(x.dtype).reshape(*lead, N)
    code, bsz = QCODE[qtype], FORMATS[qtype].block_bytes
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    BM = 16 if M <= 16 else 32
    BN = 64
    _qlinear_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
        x2, blocks, out, M, N, in_features // 32, x2.stride(0), blocks.stride(0), out.stride(0),
        QT=code, BSZ=bsz, BM=BM, BN=BN, num_warps=4, num_stages=2)
    return out.reshape(*lead, N)


def rmsnorm(x: Tensor, w: Tensor, eps: float, delta: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(x + delta, RMSNorm(x + delta) * w) for x [M, H] (delta None: x unchanged). Row-invariant."""
    M, H = x.shape
    y = torch.empty_like(x)
    xo = torch.empty_like(x) if delta is not None else x
    _rmsnorm_kernel[(M,)](x, delta if delta is not None else x, w, xo, y, H, float(eps), x.stride(0), y.stride(0),
                          HAS_D=delta is not None, BH=triton.next_power_of_2(H))
    return xo, y
