"""One-row products of Q4_0 / Q8_0 weights with 8-bit activations and integer dot products (docs/models.md,
"Integer dot products").

The block GEMV kernels of runtime/gpu/moe_gemv.py turn every 4- or 8-bit code into a float and multiply it by a
float activation: about three instructions a weight, so they are bound by instruction issue, not by the bytes they
read. Here the activation row is first quantized to int8 in 32-value blocks (scale dx = max|x| / 127, codes
round(x / dx), as llama.cpp quantizes activations for its integer kernels), and a weight block's sum is an integer
dot product: four codes a `dp4a` instruction, so about one instruction a weight.

Packing. A thread holds code words i and i + 4 (16-bit) of a weight block and makes them one 32-bit word: for Q4_0
its low nibbles are the values (2i, 2i + 1, 2i + 8, 2i + 9) and its high nibbles those + 16; for Q8_0, words i and
i + 4 hold the values (2i, 2i + 1, 2i + 8, 2i + 9) and words i + 8 and i + 12 those + 16. `quantize_rows` writes the
activation codes in that order (word l of a block: the values 2l, 2l + 1, 2l + 8, 2l + 9; word 4 + l: those + 16),
so one activation word serves every row of the tile, as it is. Q4_0's codes are nibbles n with value n - 8: the
activations' share of the - 8 (-8 times the sum of a thread's eight activation codes) is stored with the codes and
starts the thread's integer sum, which is then exact: d_w * dx * sum((n - 8) * q).

The result differs from the float kernels by the activation rounding (a relative error of about 1/254 of a block's
largest value per activation); `bench/int8_gemv.py` measures both against float32 math and times them.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from runtime.gpu.kernels import FMA, HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

FORMATS = {"q8_0": (1, 17), "q4_0": (3, 9)}      # format -> (QT, 16-bit words a block)

if HAVE_TRITON:

    _ASM = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")      # the interpreter runs no PTX

    @triton.jit
    def _dp4a(a, b, c, SIGNED_A: tl.constexpr):
        """c + the dot product of a's four bytes (unsigned, or signed when SIGNED_A) and b's (signed)."""
        if _ASM:
            if SIGNED_A:
                return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                                 dtype=tl.int32, is_pure=True, pack=1)
            else:
                return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                                 dtype=tl.int32, is_pure=True, pack=1)
        else:
            acc = c
            for k in tl.static_range(4):
                ak = (a >> (8 * k)) & 255
                if SIGNED_A:
                    ak = (ak ^ 128) - 128
                bk = (((b >> (8 * k)) & 255) ^ 128) - 128
                acc += ak * bk
            return acc

    @triton.jit
    def _quantize_kernel(x_ptr, q_ptr, d_ptr, b_ptr, stride_x, NB: tl.constexpr, NBP: tl.constexpr):
        """Row r of x: int8 codes packed four to an int32 word in the order of the module docstring (8 words a
        block), the block scales dx (fp32) and, per block and thread l, -8 times the sum of words l and 4 + l's codes
        (int32)."""
        r = tl.program_id(0)
        blk = tl.arange(0, NBP)
        wi = tl.arange(0, 8)
        k = tl.arange(0, 4)
        v = (blk[:, None, None] * 32 + 16 * (wi // 4)[None, :, None] + 2 * (wi % 4)[None, :, None]
             + 8 * (k // 2)[None, None, :] + (k % 2)[None, None, :])
        bm = blk < NB
        x = tl.load(x_ptr + r.to(tl.int64) * stride_x + v, mask=bm[:, None, None], other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), 2), 1)
        d = amax / 127.0
        inv = tl.where(d > 0, 1.0 / d, 0.0)
        t = x * inv[:, None, None]
        q = tl.where(t >= 0, t + 0.5, t - 0.5).to(tl.int32)             # round half away from zero
        q = tl.minimum(tl.maximum(q, -127), 127)
        word = tl.sum((q & 255) << (8 * k)[None, None, :], 2)            # bit-disjoint bytes: the sum packs them
        tl.store(q_ptr + r.to(tl.int64) * (NB * 8) + blk[:, None] * 8 + wi[None, :], word, mask=bm[:, None])
        tl.store(d_ptr + r.to(tl.int64) * NB + blk, d, mask=bm)
        s = tl.sum(tl.reshape(tl.sum(q, 2), (NBP, 2, 4)), 1)             # codes of words l and 4 + l
        tl.store(b_ptr + r.to(tl.int64) * (NB * 4) + blk[:, None] * 4 + tl.arange(0, 4)[None, :], -8 * s,
                 mask=bm[:, None])

    @triton.jit
    def _pair(w, o):
        """Words o and o + 4 (16-bit, offsets o [NBC, 1, 4] of rows w [1, BN, 1]) as one int32: o's in bits 0-15."""
        lo = tl.load(w + o).to(tl.uint16, bitcast=True).to(tl.int32)
        hi = tl.load(w + o + 4).to(tl.uint16, bitcast=True).to(tl.int32)
        return lo | (hi << 16)

    @triton.jit
    def _rows_int(wr, xq, xd, xb, nblk, QT: tl.constexpr, WPB: tl.constexpr, BN: tl.constexpr,
                  NBC: tl.constexpr):
        """[BN] fp32 sums of the rows wr ([BN] pointers to 16-bit words) with one quantized activation row (codes
        xq, scales xd, Q4_0 offsets xb), NBC blocks a step; tile [NBC, BN, 4]: block, row, thread l of a block."""
        b = tl.arange(0, NBC)
        ll = tl.arange(0, 4)
        acc = tl.zeros((NBC, BN, 4), dtype=tl.float32)
        w = wr[None, :, None]
        for b0 in range(0, nblk, NBC):
            blk = b0 + b
            bo = (blk * WPB)[:, None, None]
            d = tl.load(w + bo + 0 * ll[None, None, :]).to(tl.float16, bitcast=True).to(tl.float32)
            a0 = tl.load(xq + (blk * 8)[:, None] + ll[None, :])[:, None, :]
            a1 = tl.load(xq + (blk * 8 + 4)[:, None] + ll[None, :])[:, None, :]
            dx = tl.load(xd + blk)[:, None, None]
            if QT == 3:                              # q4_0: d, then 8 words of four nibbles
                c = _pair(w, bo + 1 + ll[None, None, :])
                ob = tl.load(xb + (blk * 4)[:, None] + ll[None, :])[:, None, :]
                si = _dp4a(c & 0x0F0F0F0F, a0 + 0 * c, ob + 0 * c, False)
                si = _dp4a((c >> 4) & 0x0F0F0F0F, a1 + 0 * c, si, False)
            else:                                    # q8_0: d, then 16 words of two int8 codes
                c0 = _pair(w, bo + 1 + ll[None, None, :])
                c1 = _pair(w, bo + 9 + ll[None, None, :])
                si = _dp4a(c0, a0 + 0 * c0, 0 * c0, True)
                si = _dp4a(c1, a1 + 0 * c1, si, True)
            acc += (d * dx) * si.to(tl.float32)
        return tl.sum(tl.sum(acc, 2), 0)

    @triton.jit
    def _int_gemv_kernel(xq_ptr, xd_ptr, xb_ptr, e_ptr, wt_ptr, w_ptr, o_ptr, N, NBLK, stride_xb, stride_we,
                         stride_o, SWN: tl.constexpr, UP: tl.constexpr, WEIGHT: tl.constexpr, QT: tl.constexpr,
                         WPB: tl.constexpr, BN: tl.constexpr, NBC: tl.constexpr):
        """Program (p, nb): rows nb * BN.. of matrix e[p] times activation row p (stride_xb: blocks from one
        activation row to the next; 0: every program takes row 0). UP: rows n and N + n are gate and up, out
        SiLU(gate) * up; else out the rows' sums (times wt[p] when WEIGHT)."""
        p = tl.program_id(0)
        nb = tl.program_id(1)
        e = tl.load(e_ptr + p).to(tl.int64)
        xr = p.to(tl.int64) * stride_xb            # the activation row's first block
        xq = xq_ptr + xr * 8
        xd = xd_ptr + xr
        xb = xb_ptr + xr * 4
        n = nb * BN + tl.arange(0, BN)
        wa = w_ptr + e * stride_we + tl.minimum(n, N - 1).to(tl.int64) * SWN
        ra = _rows_int(wa, xq, xd, xb, NBLK, QT, WPB, BN, NBC)
        if UP:
            rb = _rows_int(wa + N * SWN, xq, xd, xb, NBLK, QT, WPB, BN, NBC)
            out = ra / (1.0 + tl.exp(-ra)) * rb
        else:
            out = ra
            if WEIGHT:
                out = out * tl.load(wt_ptr + p).to(tl.float32)
        tl.store(o_ptr + p.to(tl.int64) * stride_o + n, out.to(o_ptr.dtype.element_ty), mask=n < N)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Rows x [T, K] (K a multiple of 32) as 8-bit activations: (codes int32 [T, K / 8], scales fp32 [T, K / 32],
    Q4_0 offsets int32 [T, K / 8])."""
    T, K = x.shape
    if K % 32:
        raise ValueError(f"rows of {K} values are not whole 32-value blocks")
    nb = K // 32
    q = torch.empty(T, nb * 8, dtype=torch.int32, device=x.device)
    d = torch.empty(T, nb, dtype=torch.float32, device=x.device)
    b = torch.empty(T, nb * 4, dtype=torch.int32, device=x.device)
    _quantize_kernel[(T,)](x, q, d, b, x.stride(0), NB=nb, NBP=triton.next_power_of_2(nb), num_warps=4,
                           **FMA)
    return q, d, b


def quantize_reference(x: Tensor) -> tuple[Tensor, Tensor]:
    """What `quantize_rows` computes, in torch: (int8 codes [T, K] in value order, scales [T, K / 32])."""
    T, K = x.shape
    xb = x.float().reshape(T, K // 32, 32)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    t = xb * inv[..., None]
    q = torch.where(t >= 0, t + 0.5, t - 0.5).to(torch.int32).clamp(-127, 127)
    return q.reshape(T, K), d


def _chunk(nblk: int, kv: int) -> int:
    """Blocks a loop step: the largest power of two that divides the row's blocks and holds at most kv values."""
    c = 1
    while (c * 2) * 32 <= kv and nblk % (c * 2) == 0:
        c *= 2
    return c


def gemv(act: tuple[Tensor, Tensor, Tensor], w: Tensor, experts: Tensor, fmt: str, out: Tensor, *, up: bool,
         x_per_pair: bool, weights: Tensor | None = None, bn: int = 8, kv: int = 512, num_warps: int = 4) -> Tensor:
    """out[p] = the rows of matrix experts[p] of w (uint8 blocks [E, rows, bytes], or [rows, bytes] with experts
    zeros) times activation row p (x_per_pair) or row 0 of `act` (`quantize_rows`). up: w's rows are gate then up
    (2N), out SiLU(gate) * up [P, N]; else out [P, N] (times weights[p] when given)."""
    qt, wpb = FORMATS[fmt]
    w3 = w if w.dim() == 3 else w[None]
    words = w3.view(torch.int16)
    rows = words.shape[1] // 2 if up else words.shape[1]
    nblk = words.shape[2] // wpb
    P = experts.numel()
    grid = (P, triton.cdiv(rows, bn))
    nbc = _chunk(nblk, kv)
    xq, xd, xb = act
    _int_gemv_kernel[grid](xq, xd, xb, experts, weights if weights is not None else xd, words, out, rows, nblk,
                           nblk if x_per_pair else 0, words.stride(0), out.stride(0), SWN=words.stride(1), UP=up,
                           WEIGHT=weights is not None, QT=qt, WPB=wpb, BN=bn, NBC=nbc,
                           num_warps=max(1, min(num_warps, nbc * 4 // 32)), **FMA)   # warps never split the rows
    return out
