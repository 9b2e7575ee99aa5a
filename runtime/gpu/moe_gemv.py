"""Decode-window expert kernels shaped like a matrix-vector product (docs/models.md, "Numerics").

A decode or verify window gives each expert only a few rows (one at W = 1, 1.6 on average at W = 16 on the
Qwen3-30B-A3B shape), so the expert kernels are bound by reading the weights once, and the tiles are chosen for
that: a program takes BN weight rows of one expert (for its leader pair, as in runtime/gpu/moe_kernels.py) and walks
the whole reduction, so W = 1 already has hundreds of programs per matrix; the window's rows of that expert go
through in groups of MB. Block-format weights are read as 16-bit words (every ggml block and field is 2-byte
aligned), and each 4/6/8-bit field becomes a float with a bit operation and one subtraction: the field, in place,
or-ed into the bits of 2^23, is the float 2^23 + field * 2^p (exact while p + width <= 23); subtracting
2^23 + bias * 2^p leaves (code - bias) * 2^p exactly, and the activation it multiplies is pre-scaled by 2^-p (exact),
so each product is the one of the code itself. The block's scale multiplies the block's partial sum,
d * sum(code * x), instead of each dequantized weight, sum((d * code) * x): the same dequantized values as gguf-py's
(every d * code is exact in fp32), summed in another order. Partial products stay in an fp32 accumulator shaped like
the loaded tile and are reduced once per row at the end.

Row invariance (BN, the loop step and MB are the same for every window width; a row's reduction order depends only
on its place in the tile), the slot table, missed experts' rows and graph capture are those of the tl.dot kernels of
`moe_kernels.experts`, which calls these for decode windows. `DECODE_GEMV` picks a variant of `GEMV_VARIANTS` per
weight format (None: the tl.dot kernels); `python bench/moe.py --tune-decode` measures them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.gpu.kernels import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

# BN_UP / BN_DOWN: weight rows per program (gate/up: BN gate rows and their BN up rows); KV: values of a row per loop
# step (whole blocks, a power of two of them that divides the row); MB: window rows of one expert per pass
GEMV_VARIANTS: dict[str, dict[str, int]] = {
    "n16k256": {"BN_UP": 16, "BN_DOWN": 16, "KV": 256, "MB": 1, "num_warps": 4, "num_stages": 1},
    "n16k512": {"BN_UP": 16, "BN_DOWN": 16, "KV": 512, "MB": 1, "num_warps": 4, "num_stages": 1},
    "n8k1024": {"BN_UP": 8, "BN_DOWN": 8, "KV": 1024, "MB": 1, "num_warps": 4, "num_stages": 1},
    "n32k256w8": {"BN_UP": 32, "BN_DOWN": 32, "KV": 256, "MB": 1, "num_warps": 8, "num_stages": 1},
    "n16k256s3": {"BN_UP": 16, "BN_DOWN": 16, "KV": 256, "MB": 1, "num_warps": 4, "num_stages": 3},
    "n16k256m2": {"BN_UP": 16, "BN_DOWN": 16, "KV": 256, "MB": 2, "num_warps": 4, "num_stages": 1},
}
# the variant per weight format for decode windows (None: the tl.dot kernels of moe_kernels); one choice serves
# every window width, which keeps a row's bits independent of the width
DECODE_GEMV: dict[str, str | None] = {"bf16": None, "q8_0": "n16k512", "q5_0": "n16k512", "q4_0": "n16k512",
                                      "q6_k": "n16k512", "q4_k": "n16k512"}

QT = {"bf16": 0, "q8_0": 1, "q5_0": 2, "q4_0": 3, "q6_k": 4, "q4_k": 5}
BLOCK_VALUES = {0: 1, 1: 32, 2: 32, 3: 32, 4: 256, 5: 256}


def variant(fmt: str) -> dict[str, int] | None:
    """The GEMV tiles for weight format `fmt` ("bf16" or a block format's name), or None for the tl.dot kernels."""
    name = DECODE_GEMV.get(fmt)
    if name is None:
        return None
    if name not in GEMV_VARIANTS:
        raise ValueError(f"DECODE_GEMV[{fmt!r}] names {name!r}, which is not in GEMV_VARIANTS; use one of "
                         f"{', '.join(GEMV_VARIANTS)} or None.")
    return GEMV_VARIANTS[name]


def chunk(k: int, fmt: str, kv: int) -> int:
    """Blocks (bf16: values) per loop step for rows of k values: the largest power of two of them that divides the
    row and holds at most kv values (bf16: at least 16 values, the tail masked)."""
    vals = BLOCK_VALUES[QT[fmt]]
    nblk = k // vals
    c = 1
    while (c * 2) * vals <= kv and nblk % (c * 2) == 0:
        c *= 2
    return max(16, c) if vals == 1 else c


if HAVE_TRITON:

    @triton.jit
    def _f16w(p, m):
        """The float16 at 16-bit word pointers p, as float32."""
        return tl.load(p, mask=m, other=0).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _byte(p, o, m):
        """Unsigned byte o (byte offsets) of the data at 16-bit word pointers p, as int32."""
        v = tl.load(p + o // 2, mask=m, other=0).to(tl.int32)
        return (v >> ((o % 2) * 8)) & 255

    @triton.jit
    def _words(w, hw, nm):
        """16-bit words hw ([A, B] word offsets) of the weight rows w ([BN] pointers), as int32 [BN, A, B]."""
        return tl.load(w[:, None, None] + hw[None, :, :], mask=nm[:, None, None], other=0).to(tl.int32)

    @triton.jit
    def _xs(xr, mm, xo):
        """Activations at offsets xo ([A, B]) of the rows xr ([MB] pointers), as float32 [MB, A, B]."""
        return tl.load(xr[:, None, None] + xo[None, :, :], mask=mm[:, None, None], other=0.0).to(tl.float32)

    @triton.jit
    def _nib(h, MASK: tl.constexpr, BIAS: tl.constexpr):
        """(field - BIAS) * 2^p as float32 for the field of h under MASK (at bit p; p + width <= 23)."""
        return ((h & MASK) | 0x4B000000).to(tl.float32, bitcast=True) - BIAS

    # ------------------------------------------------------------------------------------------- per format
    # each `_rows_*` walks the whole row (nblk blocks; 0: nothing) for one or two weight matrices (wa, wb: [BN]
    # pointers to the rows' first word) and the MB activation rows xr, returning the two [MB, BN] dot products

    @triton.jit
    def _rows_f(xr, mm, wa, wb, nm, nk, K, TWO: tl.constexpr, MB: tl.constexpr, BN: tl.constexpr,
                KC: tl.constexpr):
        """Float weights (bf16/fp16/fp32 rows)."""
        kk0 = tl.arange(0, KC)
        acca = tl.zeros((MB, BN, KC), dtype=tl.float32)
        accb = tl.zeros((MB, BN, KC), dtype=tl.float32)
        for k0 in range(0, nk, KC):
            kk = k0 + kk0
            km = kk < K
            xv = tl.load(xr[:, None] + kk[None, :], mask=mm[:, None] & km[None, :], other=0.0).to(tl.float32)
            wv = tl.load(wa[:, None] + kk[None, :], mask=nm[:, None] & km[None, :], other=0.0).to(tl.float32)
            acca += wv[None, :, :] * xv[:, None, :]
            if TWO:
                wv = tl.load(wb[:, None] + kk[None, :], mask=nm[:, None] & km[None, :], other=0.0).to(tl.float32)
                accb += wv[None, :, :] * xv[:, None, :]
        return tl.sum(acca, 2), tl.sum(accb, 2)

    @triton.jit
    def _q8_0_acc(acc, w, wo, do, nm, x0, x1):
        h = _words(w, wo, nm)
        d = _f16w(w[:, None] + do[None, :], nm[:, None])
        q0 = ((h & 0xFF) ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0       # low byte (signed)
        q1 = ((h & 0xFF00) ^ 0x4B008000).to(tl.float32, bitcast=True) - 8421376.0     # high byte * 256
        s = q0[None] * x0[:, None] + q1[None] * x1[:, None]
        return acc + d[None, :, :, None] * s

    @triton.jit
    def _rows_q8_0(xr, mm, wa, wb, nm, nblk, TWO: tl.constexpr, MB: tl.constexpr, BN: tl.constexpr,
                   NBC: tl.constexpr):
        """Q8_0: 17 words per block (d, 16 words of two int8 values)."""
        b = tl.arange(0, NBC)
        i = tl.arange(0, 16)
        acca = tl.zeros((MB, BN, NBC, 16), dtype=tl.float32)
        accb = tl.zeros((MB, BN, NBC, 16), dtype=tl.float32)
        for b0 in range(0, nblk, NBC):
            blk = b0 + b
            do = blk * 17
            wo = do[:, None] + 1 + i[None, :]
            xo = blk[:, None] * 32 + 2 * i[None, :]
            x0 = _xs(xr, mm, xo)
            x1 = _xs(xr, mm, xo + 1) * (1.0 / 256)
            acca = _q8_0_acc(acca, wa, wo, do, nm, x0, x1)
            if TWO:
                accb = _q8_0_acc(accb, wb, wo, do, nm, x0, x1)
        return tl.sum(tl.sum(acca, 3), 2), tl.sum(tl.sum(accb, 3), 2)

    @triton.jit
    def _q4_0_acc(acc, w, wo, do, nm, x0, x1, x2, x3):
        h = _words(w, wo, nm)
        d = _f16w(w[:, None] + do[None, :], nm[:, None])
        s = _nib(h, 0x000F, 8388616.0)[None] * x0[:, None]          # byte 2i, low nibble: value 2i
        s += _nib(h, 0x00F0, 8388736.0)[None] * x1[:, None]         # byte 2i, high: value 2i + 16 (* 16)
        s += _nib(h, 0x0F00, 8390656.0)[None] * x2[:, None]         # byte 2i + 1, low: value 2i + 1 (* 256)
        s += _nib(h, 0xF000, 8421376.0)[None] * x3[:, None]         # byte 2i + 1, high: value 2i + 17 (* 4096)
        return acc + d[None, :, :, None] * s

    @triton.jit
    def _q5_0_acc(acc, w, wo, do, nm, x0, x1, x2, x3):
        h = _words(w, wo, nm)
        mk = nm[:, None]
        d = _f16w(w[:, None] + do[None, :], mk)
        qh = (tl.load(w[:, None] + do[None, :] + 1, mask=mk, other=0).to(tl.int32) & 0xFFFF) | \
            (tl.load(w[:, None] + do[None, :] + 2, mask=mk, other=0).to(tl.int32) << 16)
        i = tl.arange(0, 8)
        hs = (qh[:, :, None] >> (2 * i)[None, None, :]) << 4        # qh bit 2i + t at bit 4 + t
        s = (((h & 0x0F) | (hs & 0x10) | 0x4B000000).to(tl.float32, bitcast=True) - 8388624.0)[None] * x0[:, None]
        s += ((((h >> 4) & 0x0F) | ((hs >> 16) & 0x10) | 0x4B000000).to(tl.float32, bitcast=True)
              - 8388624.0)[None] * x1[:, None]
        s += ((((h >> 8) & 0x0F) | ((hs >> 1) & 0x10) | 0x4B000000).to(tl.float32, bitcast=True)
              - 8388624.0)[None] * x2[:, None]
        s += ((((h >> 12) & 0x0F) | ((hs >> 17) & 0x10) | 0x4B000000).to(tl.float32, bitcast=True)
              - 8388624.0)[None] * x3[:, None]
        return acc + d[None, :, :, None] * s

    @triton.jit
    def _rows_q4(xr, mm, wa, wb, nm, nblk, Q5: tl.constexpr, TWO: tl.constexpr, MB: tl.constexpr,
                 BN: tl.constexpr, NBC: tl.constexpr):
        """Q4_0 (9 words per block: d, 8 words of four nibbles) and Q5_0 (11: d, qh (2 words), 8 words)."""
        b = tl.arange(0, NBC)
        i = tl.arange(0, 8)
        acca = tl.zeros((MB, BN, NBC, 8), dtype=tl.float32)
        accb = tl.zeros((MB, BN, NBC, 8), dtype=tl.float32)
        for b0 in range(0, nblk, NBC):
            blk = b0 + b
            xo = blk[:, None] * 32 + 2 * i[None, :]
            x0 = _xs(xr, mm, xo)
            x1 = _xs(xr, mm, xo + 16)
            x2 = _xs(xr, mm, xo + 1)
            x3 = _xs(xr, mm, xo + 17)
            if Q5:
                do = blk * 11
                wo = do[:, None] + 3 + i[None, :]
                acca = _q5_0_acc(acca, wa, wo, do, nm, x0, x1, x2, x3)
                if TWO:
                    accb = _q5_0_acc(accb, wb, wo, do, nm, x0, x1, x2, x3)
            else:
                do = blk * 9
                wo = do[:, None] + 1 + i[None, :]
                x1 = x1 * (1.0 / 16)
                x2 = x2 * (1.0 / 256)
                x3 = x3 * (1.0 / 4096)
                acca = _q4_0_acc(acca, wa, wo, do, nm, x0, x1, x2, x3)
                if TWO:
                    accb = _q4_0_acc(accb, wb, wo, do, nm, x0, x1, x2, x3)
        return tl.sum(tl.sum(acca, 3), 2), tl.sum(tl.sum(accb, 3), 2)

    @triton.jit
    def _q4_k_acc(acc, w, sb, g, wo, nm, x0, x1, x2, x3, xe, xo):
        h = _words(w, wo, nm)
        mk = nm[:, None]
        wp = w[:, None]
        base = (sb * 144)[None, :]                   # bytes
        d = _f16w(wp + (sb * 72)[None, :], mk)
        dmin = _f16w(wp + (sb * 72 + 1)[None, :], mk)
        # sub-blocks 2g (low nibbles) and 2g + 1 (high): 6-bit scale and min (ggml's get_scale_min_k4)
        je = (2 * g)[None, :]
        jo = je + 1
        a = _byte(wp, base + 4 + je, mk)
        bb = _byte(wp, base + 8 + je, mk)
        c = _byte(wp, base + tl.where(je < 4, 4 + je, je), mk)
        sce = tl.where(je < 4, a & 63, (bb & 15) | ((c >> 6) << 4))
        mne = tl.where(je < 4, bb & 63, (bb >> 4) | ((a >> 6) << 4))
        a = _byte(wp, base + 4 + jo, mk)
        bb = _byte(wp, base + 8 + jo, mk)
        c = _byte(wp, base + tl.where(jo < 4, 4 + jo, jo), mk)
        sco = tl.where(jo < 4, a & 63, (bb & 15) | ((c >> 6) << 4))
        mno = tl.where(jo < 4, bb & 63, (bb >> 4) | ((a >> 6) << 4))
        se = _nib(h, 0x000F, 8388608.0)[None] * x0[:, None] + _nib(h, 0x0F00, 8388608.0)[None] * x2[:, None]
        so = _nib(h, 0x00F0, 8388608.0)[None] * x1[:, None] + _nib(h, 0xF000, 8388608.0)[None] * x3[:, None]
        acc += (d * sce.to(tl.float32))[None, :, :, None] * se + (d * sco.to(tl.float32))[None, :, :, None] * so
        acc -= (dmin * mne.to(tl.float32))[None, :, :, None] * xe[:, None] + \
            (dmin * mno.to(tl.float32))[None, :, :, None] * xo[:, None]
        return acc

    @triton.jit
    def _rows_q4_k(xr, mm, wa, wb, nm, nblk, TWO: tl.constexpr, MB: tl.constexpr, BN: tl.constexpr,
                   NBC: tl.constexpr):
        """Q4_K: 72 words per super-block of 256 (d, dmin, 6 words of scales, 64 words of nibbles); tile
        [BN, NBC * 4, 16]: super-block, 32-byte group g of the nibbles, word i of the group."""
        bq = tl.arange(0, NBC * 4)
        i = tl.arange(0, 16)
        g = bq % 4
        acca = tl.zeros((MB, BN, NBC * 4, 16), dtype=tl.float32)
        accb = tl.zeros((MB, BN, NBC * 4, 16), dtype=tl.float32)
        for b0 in range(0, nblk, NBC):
            sb = b0 + bq // 4
            wo = (sb * 72 + 8 + 16 * g)[:, None] + i[None, :]
            xo = (sb * 256 + 64 * g)[:, None] + 2 * i[None, :]
            x0 = _xs(xr, mm, xo)                     # byte 2i, low nibble: sub-block 2g
            x1 = _xs(xr, mm, xo + 32)                # byte 2i, high nibble: sub-block 2g + 1
            x2 = _xs(xr, mm, xo + 1)
            x3 = _xs(xr, mm, xo + 33)
            xe = x0 + x2
            xo_ = x1 + x3
            x1 = x1 * (1.0 / 16)
            x2 = x2 * (1.0 / 256)
            x3 = x3 * (1.0 / 4096)
            acca = _q4_k_acc(acca, wa, sb, g, wo, nm, x0, x1, x2, x3, xe, xo_)
            if TWO:
                accb = _q4_k_acc(accb, wb, sb, g, wo, nm, x0, x1, x2, x3, xe, xo_)
        return tl.sum(tl.sum(acca, 3), 2), tl.sum(tl.sum(accb, 3), 2)

    @triton.jit
    def _q6_k_acc(acc, w, sb, r, lo, ho, nm, x0, x1, x2, x3):
        ql = _words(w, lo, nm)
        qh = _words(w, ho, nm)
        mk = nm[:, None]
        wp = w[:, None]
        qm = (r // 2) % 2
        q4 = qh << (4 - 2 * qm)[None, :, None]       # the 2 high bits of the code beside its nibble, over bits 4-5
        d = _f16w(wp + (sb * 105 + 104)[None, :], mk)
        si = (sb * 210 + 192 + r + 4 * (r // 4))[None, :]      # scale of the low-nibble values; + 4: high nibbles
        s0 = ((_byte(wp, si, mk) ^ 128) - 128).to(tl.float32)
        s1 = ((_byte(wp, si + 4, mk) ^ 128) - 128).to(tl.float32)
        c0 = (((ql & 0x000F) | (q4 & 0x00030) | 0x4B000000).to(tl.float32, bitcast=True) - 8388640.0)
        c1 = (((ql & 0x00F0) | (q4 & 0x00300) | 0x4B000000).to(tl.float32, bitcast=True) - 8389120.0)
        c2 = (((ql & 0x0F00) | (q4 & 0x03000) | 0x4B000000).to(tl.float32, bitcast=True) - 8396800.0)
        c3 = (((ql & 0xF000) | (q4 & 0x30000) | 0x4B000000).to(tl.float32, bitcast=True) - 8519680.0)
        sl = c0[None] * x0[:, None] + c2[None] * x2[:, None]
        sh = c1[None] * x1[:, None] + c3[None] * x3[:, None]
        return acc + (d * s0)[None, :, :, None] * sl + (d * s1)[None, :, :, None] * sh

    @triton.jit
    def _rows_q6_k(xr, mm, wa, wb, nm, nblk, TWO: tl.constexpr, MB: tl.constexpr, BN: tl.constexpr,
                   NBC: tl.constexpr):
        """Q6_K: 105 words per super-block of 256 (64 words of low nibbles, 32 of high bits, 8 of int8 scales, d);
        tile [BN, NBC * 8, 8]: super-block, group r = 4h + 2q + half of 8 words of the low nibbles, word i."""
        bq = tl.arange(0, NBC * 8)
        i = tl.arange(0, 8)
        r = bq % 8
        acca = tl.zeros((MB, BN, NBC * 8, 8), dtype=tl.float32)
        accb = tl.zeros((MB, BN, NBC * 8, 8), dtype=tl.float32)
        for b0 in range(0, nblk, NBC):
            sb = b0 + bq // 8
            lo = (sb * 105 + 8 * r)[:, None] + i[None, :]
            ho = (sb * 105 + 64 + 16 * (r // 4) + 8 * (r % 2))[:, None] + i[None, :]
            xo = (sb * 256 + 128 * (r // 4) + 32 * ((r // 2) % 2) + 16 * (r % 2))[:, None] + 2 * i[None, :]
            x0 = _xs(xr, mm, xo)                     # byte 2i of the word, low nibble
            x1 = _xs(xr, mm, xo + 64) * (1.0 / 16)   # byte 2i, high nibble: quarter q + 2
            x2 = _xs(xr, mm, xo + 1) * (1.0 / 256)
            x3 = _xs(xr, mm, xo + 65) * (1.0 / 4096)
            acca = _q6_k_acc(acca, wa, sb, r, lo, ho, nm, x0, x1, x2, x3)
            if TWO:
                accb = _q6_k_acc(accb, wb, sb, r, lo, ho, nm, x0, x1, x2, x3)
        return tl.sum(tl.sum(acca, 3), 2), tl.sum(tl.sum(accb, 3), 2)

    @triton.jit
    def _rows(xr, mm, wa, wb, nm, nblk, K, TWO: tl.constexpr, QT: tl.constexpr, MB: tl.constexpr,
              BN: tl.constexpr, NBC: tl.constexpr):
        if QT == 0:
            ra, rb = _rows_f(xr, mm, wa, wb, nm, nblk, K, TWO, MB, BN, NBC)
        elif QT == 1:
            ra, rb = _rows_q8_0(xr, mm, wa, wb, nm, nblk, TWO, MB, BN, NBC)
        elif QT == 2:
            ra, rb = _rows_q4(xr, mm, wa, wb, nm, nblk, True, TWO, MB, BN, NBC)
        elif QT == 3:
            ra, rb = _rows_q4(xr, mm, wa, wb, nm, nblk, False, TWO, MB, BN, NBC)
        elif QT == 4:
            ra, rb = _rows_q6_k(xr, mm, wa, wb, nm, nblk, TWO, MB, BN, NBC)
        else:
            ra, rb = _rows_q4_k(xr, mm, wa, wb, nm, nblk, TWO, MB, BN, NBC)
        return ra, rb

    # -------------------------------------------------------------------------------------------- the kernel

    @triton.jit
    def _gemv_kernel(x_ptr, tok_ptr, se_ptr, slot_ptr, ord_ptr, wt_ptr, w_ptr, o_ptr, NP, E, N, NBLK, K,
                     stride_xm, stride_we, stride_wn, stride_om,
                     UP: tl.constexpr, HAS_SLOT: tl.constexpr, QT: tl.constexpr, ZERO: tl.constexpr,
                     BM: tl.constexpr, MB: tl.constexpr, BN: tl.constexpr, NBC: tl.constexpr):
        """Program (i, nb): when sorted pair i is the first of its expert, weight rows nb*BN.. of that expert for
        all the expert's rows of the window. UP: x [T, H] -> h [pairs, I] (SiLU(gate) * up, sorted order); else
        h -> y [pairs, H] (times the routing weight, pair order; a missed expert's rows zero when ZERO)."""
        i = tl.program_id(0)
        nb = tl.program_id(1)
        e = tl.load(se_ptr + i)
        prev = tl.load(se_ptr + i - 1, mask=i > 0, other=-1)
        lead = (e < E) & (e != prev)
        rr = i + tl.arange(0, BM)             # an expert has at most T rows (BM = pow2(T)): a count only
        rin = rr < tl.where(lead, NP, 0)
        cnt = tl.sum((rin & (tl.load(se_ptr + rr, mask=rin, other=-1) == e)).to(tl.int32), 0)
        if HAS_SLOT:
            s = tl.load(slot_ptr + tl.minimum(e, E - 1))
            s = tl.where(e < E, s, -1)
        else:
            s = tl.where(e < E, e, -1)
        run = s >= 0
        nblk = tl.where(run, NBLK, 0)
        if ZERO:
            rows = cnt
        else:
            rows = tl.where(run, cnt, 0)
        n = nb * BN + tl.arange(0, BN)
        nm = n < N
        wa = w_ptr + tl.maximum(s, 0).to(tl.int64) * stride_we + n.to(tl.int64) * stride_wn
        wb = wa + N * stride_wn
        for m0 in range(0, rows, MB):
            mr = m0 + tl.arange(0, MB)
            mm = mr < rows
            r = i + mr
            if UP:
                tok = tl.load(tok_ptr + r, mask=mm, other=0)
                xr = x_ptr + tok.to(tl.int64) * stride_xm
            else:
                xr = x_ptr + r.to(tl.int64) * stride_xm
            ra, rb = _rows(xr, mm, wa, wb, nm, nblk, K, UP, QT, MB, BN, NBC)
            om = mm[:, None] & nm[None, :]
            if UP:
                act = ra * tl.sigmoid(ra) * rb
                tl.store(o_ptr + r[:, None].to(tl.int64) * stride_om + n[None, :], act.to(o_ptr.dtype.element_ty),
                         mask=om)
            else:
                dst = tl.load(ord_ptr + r, mask=mm, other=0)
                wt = tl.load(wt_ptr + dst, mask=mm, other=0.0).to(tl.float32)
                tl.store(o_ptr + dst[:, None].to(tl.int64) * stride_om + n[None, :],
                         (ra * wt[:, None]).to(o_ptr.dtype.element_ty), mask=om)


def _weights(w: Tensor, fmt: str) -> Tensor:
    """Block-format weights as 16-bit words (every row is a whole number of them)."""
    return w if fmt == "bf16" else w.view(torch.int16)


def up(x: Tensor, tok: Tensor, se: Tensor, sl: Tensor, gate_up: Tensor, h: Tensor, fmt: str, n_exp: int,
       inter: int, has_slot: bool, bm: int, cfg: dict[str, int]) -> None:
    """h[p] = SiLU(gate(x[tok[p]])) * up(x[tok[p]]) for the sorted pairs p of resident experts."""
    K = x.shape[1]
    NP = se.numel()
    w = _weights(gate_up, fmt)
    c = chunk(K, fmt, cfg["KV"])
    nblk = K // BLOCK_VALUES[QT[fmt]]
    grid = (NP, triton.cdiv(inter, cfg["BN_UP"]))
    _gemv_kernel[grid](x, tok, se, sl, se, x, w, h, NP, n_exp, inter, K if fmt == "bf16" else nblk, K,
                       x.stride(0), w.stride(0), w.stride(1), h.stride(0), UP=True, HAS_SLOT=has_slot, QT=QT[fmt],
                       ZERO=False, BM=bm, MB=cfg["MB"], BN=cfg["BN_UP"], NBC=c, num_warps=cfg["num_warps"],
                       num_stages=cfg["num_stages"])


def down(h: Tensor, se: Tensor, sl: Tensor, order: Tensor, wf: Tensor, down_w: Tensor, y: Tensor, fmt: str,
         n_exp: int, has_slot: bool, zero: bool, bm: int, cfg: dict[str, int]) -> None:
    """y[order[p]] = w * down(h[p]) for the sorted pairs p of resident experts (zeros for missed ones when zero)."""
    K = h.shape[1]
    N = y.shape[1]
    NP = se.numel()
    w = _weights(down_w, fmt)
    c = chunk(K, fmt, cfg["KV"])
    nblk = K // BLOCK_VALUES[QT[fmt]]
    grid = (NP, triton.cdiv(N, cfg["BN_DOWN"]))
    _gemv_kernel[grid](h, se, se, sl, order, wf, w, y, NP, n_exp, N, K if fmt == "bf16" else nblk, K,
                       h.stride(0), w.stride(0), w.stride(1), y.stride(0), UP=False, HAS_SLOT=has_slot, QT=QT[fmt],
                       ZERO=zero, BM=bm, MB=cfg["MB"], BN=cfg["BN_DOWN"], NBC=c, num_warps=cfg["num_warps"],
                       num_stages=cfg["num_stages"])
