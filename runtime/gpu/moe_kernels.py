"""Triton kernels for the routed experts (docs/models.md, "Numerics").

A window's (token, expert) pairs are sorted by expert; a program multiplies a tile of rows that all use one expert,
so each expert's weights are read once per tile. Gate/up matmul + SiLU gating in one kernel, the down matmul
(scaled by the routing weight) in a second, and the per-token sum of its top-k rows (+ the residual) in a third.

Two tilings share the kernels:
- decode/verify windows (T <= DECODE_ROWS): the first pair of each expert (the "leader") takes every row of that
  expert, BM = pow2(T) rows; fixed tiles, no split-K, fixed loop order: row-invariant and shape-static (a CUDA
  graph captures it). `route` does the router softmax, top-k and the grouping on the device. For the weight
  formats `moe_gemv.DECODE_GEMV` names (the block formats by default), runtime/gpu/moe_gemv.py's matrix-vector
  kernels take the same leader tiling with BN weight rows per program instead (bound by reading the weights).
- prefill chunks: a block table cuts each expert's rows into tiles of BM (a grouped GEMM, no host sync, no Python
  loop over experts); not row-invariant (it need not be), deterministic. `torch._grouped_mm` is the alternative for
  BF16 weights (PREFILL_IMPL), measured against these kernels in bench/moe.py.

Expert weights, stacked: gate_up [S, 2I, H] (gate rows, then up rows) and down [S, H, I] as floats, or as ggml
blocks (uint8 [S, 2I, row_bytes(H)] and [S, H, row_bytes(I)], docs/formats.md "Block formats"; Q8_0, Q5_0, Q4_0,
Q6_K, Q4_K, Q5_K, Q3_K, Q2_K, IQ4_XS, IQ4_NL) dequantized in registers, never copied as floats. S is the number of experts (E) or of slots: `slot`
[E] int32 maps an expert id to its index in the first dim, -1 when it is not resident. Pairs of a non-resident
expert are skipped: their rows of the [T*k, H] buffer `y` are zeros (or left for a miss path to fill, see
`moe_routed`), and the pairs are listed in `Routing.miss`. The per-token sum always runs over all k rows of y in
top-k order, so a miss path that writes the same rows gives the bits of the all-resident run.

K-quant layouts (as ggml's reference dequantizers and gguf-py's `gguf.quants` read them):
- Q6_K, 210 bytes per 256 values: ql[128], qh[64], scales[16] (int8), d (f16). Value v (h = v // 128, quarter
  q = v % 128 // 32, l = v % 32): 6-bit code = nibble (4 * (q // 2)) of ql[64h + 32 (q % 2) + l] | bits (2q..2q+1)
  of qh[32h + l] << 4, minus 32; value = (d * scales[v // 16]) * code.
- Q4_K, 144 bytes per 256 values: d (f16), dmin (f16), scales[12] (eight 6-bit scales and mins), qs[128]. Value v
  (sub-block j = v // 32): code = nibble (4 * (j % 2)) of qs[32 (j // 2) + v % 32]; value = (d * sc[j]) * code -
  dmin * m[j], with sc/m unpacked as ggml's get_scale_min_k4.
- Q5_K, 176 bytes per 256 values: Q4_K's d, dmin and scales[12], then qh[32], then qs[128] as Q4_K's. Value v
  (sub-block j = v // 32, l = v % 32): code = Q4_K's nibble | bit j of qh[l] << 4; value as Q4_K's.
- Q3_K, 110 bytes per 256 values: hmask[32], qs[64], scales[12], d (f16). Value v (sub-block s = v // 16, h = v //
  128, t = v % 128 // 32, l = v % 32): code = bits 2t..2t+1 of qs[32h + l] - 4 unless bit v // 32 of hmask[l] is
  set; scale = (nibble s // 8 of scales[s % 8] | bits 2 (s // 4).. of scales[8 + s % 4] << 4) - 32; value =
  (d * scale) * code.
- Q2_K, 84 bytes per 256 values: scales[16] (low nibble a scale, high a minimum), qs[64] as Q3_K's, d, dmin (f16):
  value = (d * (scales[s] & 15)) * code - dmin * (scales[s] >> 4).
- IQ4_XS, 136 bytes per 256 values: d (f16), scales_h (u16), scales_l[4], qs[128]. Value v (sub-block j = v // 32,
  l = v % 32): code = nibble (4 * (l // 16)) of qs[16j + l % 16]; scale = (nibble j % 2 of scales_l[j // 2] | bits
  2j.. of scales_h << 4) - 32; value = (d * scale) * kv[code], kv llama.cpp's 16 levels (runtime/formats/iquants.py).
- IQ4_NL, 18 bytes per 32 values: d (f16), qs[16]: value j = d * kv[nibble (4 * (j // 16)) of qs[j % 16]].
Every product there is exact in float32 (at most 24 significant bits), so the dequantized values are gguf-py's bit
for bit whatever order or fusion the compiler picks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.errors import QuantFormatError
from runtime.formats.registry import block_format, cols_from_row_bytes
from runtime.gpu import moe_gemv, moe_split, pdl
from runtime.gpu.kernels import FMA, HAVE_TRITON, pow2

if HAVE_TRITON:
    import triton
    import triton.language as tl

# tile shapes of the two expert kernels for decode windows (block of outputs BN, reduction step BK (quantized
# weights: a multiple of 16, dequantized 16 values at a time), warps, pipeline stages); one choice for every window width keeps the kernels
# row-invariant. bench/gpu_checks.py times alternatives on the GPU.
MOE_UP = {"BN": 64, "BK": 64, "num_warps": 4, "num_stages": 3}
MOE_DOWN = {"BN": 64, "BK": 64, "num_warps": 4, "num_stages": 3}
MOE_QUP = {"BN": 64, "BK": 64, "num_warps": 4, "num_stages": 3}     # quantized weights (bench/moe.py tunes them)
MOE_QDOWN = {"BN": 64, "BK": 64, "num_warps": 4, "num_stages": 3}
# prefill tiles (BM rows of one expert per program); bench/moe.py times alternatives. Float experts: 128 x 128
# tiles (H200, A3B, an 8k prompt through the fused chunk 46.2k -> 50.4k tok/s against 64-row tiles, bench/step_ab.py
# --prefill, bench/results/h200_session7/prefill_tiles/); block-format experts keep the 64-row tiles (measured there)
MOE_PRE_UP = {"BM": 128, "BN": 128, "BK": 64, "GM": 8, "num_warps": 8, "num_stages": 4}
MOE_PRE_DOWN = {"BM": 128, "BN": 128, "BK": 64, "GM": 8, "num_warps": 8, "num_stages": 3}
MOE_PRE_QUP = {"BM": 64, "BN": 64, "BK": 64, "GM": 8, "num_warps": 4, "num_stages": 3}
MOE_PRE_QDOWN = {"BM": 64, "BN": 128, "BK": 64, "GM": 8, "num_warps": 8, "num_stages": 3}
DECODE_ROWS = 64          # windows up to this many rows take the row-invariant decode tiling
PREFILL_ROWS = 8192       # larger inputs run in chunks of this many rows (bounds the [rows * k, H] scratch)
PREFILL_IMPL = "triton"   # "triton" or "grouped_mm" (torch._grouped_mm, BF16 weights, every expert resident)

# kernel branch per weight format (None / "bf16": floats in the tensor's own dtype)
QCODE = moe_gemv.QT


class Routing(NamedTuple):
    """One window's routing, grouped by expert (all device tensors; shapes depend only on T and k).

    idx [T, k] int32 expert ids (E: a padded row, no expert); w [T, k] routing weights; se [T*k] int32 the expert
    ids sorted (stable; padding last); order [T*k] int32 the pair id p = t*k + j at each sorted position; tok [T*k]
    int32 its token; miss [T*k] int32 the pairs whose expert has no slot, grouped by expert, then -1; n_miss [1]
    int32 how many entries of `miss` are real."""

    idx: Tensor
    w: Tensor
    se: Tensor
    order: Tensor
    tok: Tensor
    miss: Tensor
    n_miss: Tensor


# a miss path: fills y's rows of the pairs in r.miss[:r.n_miss] with w_p * expert(x_t), in y's dtype; device work
# only (no host sync) when it runs inside a captured step
MissFn = Callable[[Tensor, Routing, Tensor], None]


def _fmt_pair(fmt: str | tuple[str | None, str | None] | None) -> tuple[str, str]:
    a, b = fmt if isinstance(fmt, tuple) else (fmt, fmt)
    out = []
    for f in (a, b):
        name = "bf16" if f is None else block_format(f).name
        if name not in QCODE:
            raise QuantFormatError(f"the expert kernels do not read {name}; use one of {', '.join(QCODE)}.")
        out.append(name)
    return out[0], out[1]


def expert_dims(gate_up: Tensor, down: Tensor, fmt=None) -> tuple[int, int]:
    """(H, I) of stacked expert weights in format `fmt` (floats, or ggml blocks per row)."""
    fg, _ = _fmt_pair(fmt)
    two_i = gate_up.shape[1]
    if fg == "bf16":
        return gate_up.shape[2], two_i // 2
    return cols_from_row_bytes(gate_up.shape[2], fg), two_i // 2


if HAVE_TRITON:

    @triton.jit
    def _f16(p, m):
        """The little-endian float16 at byte pointers p ([N]), as float32."""
        lo = tl.load(p, mask=m, other=0).to(tl.uint16)
        hi = tl.load(p + 1, mask=m, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _iq4_level(q):
        """4-bit codes (int32) -> llama.cpp's IQ4 levels (runtime/formats/iquants.py KVALUES) as float32."""
        b = moe_gemv._iq4_byte(q)
        return ((b ^ 128) - 128).to(tl.float32)

    @triton.jit
    def _dq16(row, g, m, QT: tl.constexpr):
        """Values 16g..16g+15 of the ggml-block rows starting at byte pointers `row` ([N]; m masks rows) as float32
        [N, 16], the values gguf-py's dequantize gives."""
        j = tl.arange(0, 16)
        mm = m[:, None]
        if QT == 1:       # q8_0: d, 32 x int8
            blk = row + (g // 2) * 34
            d = _f16(blk, m)
            q = tl.load(blk[:, None] + 2 + (g % 2) * 16 + j[None, :], mask=mm, other=0).to(tl.int8, bitcast=True)
            w = d[:, None] * q.to(tl.float32)
        elif QT == 2:     # q5_0: d, qh (u32), 16 bytes of nibbles
            blk = row + (g // 2) * 22
            d = _f16(blk, m)
            qh = tl.load(blk + 2, mask=m, other=0).to(tl.int32)
            qh = qh | (tl.load(blk + 3, mask=m, other=0).to(tl.int32) << 8)
            qh = qh | (tl.load(blk + 4, mask=m, other=0).to(tl.int32) << 16)
            qh = qh | (tl.load(blk + 5, mask=m, other=0).to(tl.int32) << 24)
            half = g % 2
            qs = tl.load(blk[:, None] + 6 + j[None, :], mask=mm, other=0).to(tl.int32)
            hb = (qh[:, None] >> (j[None, :] + 16 * half)) & 1
            w = d[:, None] * ((((qs >> (4 * half)) & 15) | (hb << 4)) - 16).to(tl.float32)
        elif QT == 3:     # q4_0: d, 16 bytes of nibbles (q[j] low, q[j+16] high)
            blk = row + (g // 2) * 18
            d = _f16(blk, m)
            qs = tl.load(blk[:, None] + 2 + j[None, :], mask=mm, other=0).to(tl.int32)
            w = d[:, None] * (((qs >> ((g % 2) * 4)) & 15) - 8).to(tl.float32)
        elif QT == 4:     # q6_k (module docstring)
            blk = row + (g // 16) * 210
            s = g % 16
            h = s // 8
            qt = (s % 8) // 2
            sub = s % 2
            ql = tl.load(blk[:, None] + 64 * h + 32 * (qt % 2) + 16 * sub + j[None, :], mask=mm, other=0)
            qh = tl.load(blk[:, None] + 128 + 32 * h + 16 * sub + j[None, :], mask=mm, other=0)
            ql = ql.to(tl.int32)
            qh = qh.to(tl.int32)
            q = (((ql >> (4 * (qt // 2))) & 15) | (((qh >> (2 * qt)) & 3) << 4)) - 32
            sc = tl.load(blk + 192 + s, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            d = _f16(blk + 208, m)
            w = (d * sc)[:, None] * q.to(tl.float32)
        elif QT == 5 or QT == 6:     # q4_k, q5_k (module docstring)
            blk = row + (g // 16) * (144 if QT == 5 else 176)
            s = g % 16
            jj = s // 2
            d = _f16(blk, m)
            dmin = _f16(blk + 2, m)
            low = jj < 4
            b_j = tl.load(blk + 4 + jj, mask=m, other=0).to(tl.int32)
            b_j4 = tl.load(blk + 8 + jj, mask=m, other=0).to(tl.int32)
            b_jm4 = tl.load(blk + 4 + tl.where(low, jj, jj - 4), mask=m, other=0).to(tl.int32)
            sc = tl.where(low, b_j & 63, (b_j4 & 15) | ((b_jm4 >> 6) << 4))
            mn = tl.where(low, b_j4 & 63, (b_j4 >> 4) | ((b_j >> 6) << 4))
            qs = tl.load(blk[:, None] + (16 if QT == 5 else 48) + 32 * (jj // 2) + 16 * (s % 2) + j[None, :], mask=mm,
                         other=0)
            q = (qs.to(tl.int32) >> (4 * (jj % 2))) & 15
            if QT == 6:   # q5_k: bit jj of qh[l] above the nibble
                qh = tl.load(blk[:, None] + 16 + 16 * (s % 2) + j[None, :], mask=mm, other=0)
                q = q | (((qh.to(tl.int32) >> jj) & 1) << 4)
            w = (d * sc.to(tl.float32))[:, None] * q.to(tl.float32) - (dmin * mn.to(tl.float32))[:, None]
        elif QT == 9:     # iq4_xs (module docstring)
            blk = row + (g // 16) * 136
            s = g % 16
            jb = s // 2
            qs = tl.load(blk[:, None] + 8 + 16 * jb + j[None, :], mask=mm, other=0).to(tl.int32)
            lo = (tl.load(blk + 4 + jb // 2, mask=m, other=0).to(tl.int32) >> (4 * (jb % 2))) & 15
            hi = (tl.load(blk + 2 + jb // 4, mask=m, other=0).to(tl.int32) >> (2 * (jb % 4))) & 3
            d = _f16(blk, m)
            w = (d * ((lo | (hi << 4)) - 32).to(tl.float32))[:, None] * _iq4_level((qs >> (4 * (s % 2))) & 15)
        elif QT == 10:    # iq4_nl: d, 16 bytes of nibbles (as q4_0's), each a level of kv
            blk = row + (g // 2) * 18
            d = _f16(blk, m)
            qs = tl.load(blk[:, None] + 2 + j[None, :], mask=mm, other=0).to(tl.int32)
            w = d[:, None] * _iq4_level((qs >> ((g % 2) * 4)) & 15)
        else:             # q3_k (QT 7), q2_k (QT 8): 2-bit codes, 16 sub-blocks of 16 (module docstring)
            blk = row + (g // 16) * (110 if QT == 7 else 84)
            s = g % 16
            lq = 16 * (s % 2) + j                                      # byte l of the 32 a code row spans
            qs = tl.load(blk[:, None] + (32 if QT == 7 else 16) + 32 * (s // 8) + lq[None, :], mask=mm, other=0)
            q = (qs.to(tl.int32) >> (2 * ((s % 8) // 2))) & 3
            if QT == 7:
                hm = tl.load(blk[:, None] + lq[None, :], mask=mm, other=0).to(tl.int32)
                q = q - 4 * (1 - ((hm >> (s // 2)) & 1))
                lo = (tl.load(blk + 96 + s % 8, mask=m, other=0).to(tl.int32) >> (4 * (s // 8))) & 15
                hi = (tl.load(blk + 104 + s % 4, mask=m, other=0).to(tl.int32) >> (2 * (s // 4))) & 3
                d = _f16(blk + 108, m)
                w = (d * ((lo | (hi << 4)) - 32).to(tl.float32))[:, None] * q.to(tl.float32)
            else:
                sb = tl.load(blk + s, mask=m, other=0).to(tl.int32)
                d = _f16(blk + 80, m)
                dmin = _f16(blk + 82, m)
                w = (d * (sb & 15).to(tl.float32))[:, None] * q.to(tl.float32) - \
                    (dmin * (sb >> 4).to(tl.float32))[:, None]
        return w

    @triton.jit
    def _dq_q4k(row, sb, m, BN: tl.constexpr, QT: tl.constexpr = 5):
        """Super-block sb (256 values) of the Q4_K (QT 5) or Q5_K (QT 6) rows at byte pointers `row` ([BN]) as
        float32 [BN, 256]: each code byte loaded once for its two nibbles (Q5_K: each qh byte once for its eight
        bits) and each sub-block's scale and minimum once for its 32 values (the arithmetic of `_dq16`'s branch, so
        the same values)."""
        blk = row + sb * (144 if QT == 5 else 176)
        mm = m[:, None]
        d = _f16(blk, m)
        dmin = _f16(blk + 2, m)
        jj = tl.arange(0, 8)                                                # sub-blocks of 32
        low = jj[None, :] < 4
        # the 12 scale bytes b: j < 4: sc = b[j] & 63, mn = b[j + 4] & 63; j >= 4: sc = (b[j + 4] & 15) |
        # (b[j - 4] >> 6) << 4, mn = (b[j + 4] >> 4) | (b[j] >> 6) << 4
        b_j = tl.load(blk[:, None] + 4 + jj[None, :], mask=mm, other=0).to(tl.int32)
        b_j4 = tl.load(blk[:, None] + 8 + jj[None, :], mask=mm, other=0).to(tl.int32)
        b_jm4 = tl.load(blk[:, None] + 4 + jj[None, :] % 4, mask=mm, other=0).to(tl.int32)
        sc = tl.where(low, b_j & 63, (b_j4 & 15) | ((b_jm4 >> 6) << 4))
        mn = tl.where(low, b_j4 & 63, (b_j4 >> 4) | ((b_j >> 6) << 4))
        ds = tl.reshape(d[:, None] * sc.to(tl.float32), (BN, 4, 2))         # sub-block 2i + h at [i, h]
        dm = tl.reshape(dmin[:, None] * mn.to(tl.float32), (BN, 4, 2))
        i = tl.arange(0, 4)
        ll = tl.arange(0, 32)
        qs = tl.load(blk[:, None, None] + (16 if QT == 5 else 48) + 32 * i[None, :, None] + ll[None, None, :],
                     mask=m[:, None, None], other=0).to(tl.int32)          # [BN, 4, 32]: sub-blocks 2i and 2i + 1
        h = tl.arange(0, 2)
        q = (qs[:, :, None, :] >> (4 * h[None, None, :, None])) & 15       # [BN, 4, 2, 32]
        if QT == 6:                                                         # q5_k: bit 2i + h of qh[l]
            qh = tl.load(blk[:, None] + 16 + ll[None, :], mask=mm, other=0).to(tl.int32)      # [BN, 32]
            jb = 2 * i[:, None] + h[None, :]                                                  # [4, 2]
            q = q | (((qh[:, None, None, :] >> jb[None, :, :, None]) & 1) << 4)
        w = ds[:, :, :, None] * q.to(tl.float32) - dm[:, :, :, None]
        return tl.reshape(w, (BN, 256))

    @triton.jit
    def _dequant_kernel(b_ptr, o_ptr, R, stride_b, stride_o, QT: tl.constexpr, BN: tl.constexpr, G: tl.constexpr):
        """Program (row block, column block): BN rows x G groups of 16 values, each group as `_dq16` gives it; Q4_K
        and Q5_K by whole super-blocks (`_dq_q4k`) when G covers them."""
        pm = tl.program_id(0)
        r = pm * BN + tl.arange(0, BN)
        m = r < R
        row = b_ptr + r.to(tl.int64) * stride_b
        if (QT == 5 or QT == 6) and G % 16 == 0:
            out = o_ptr + r[:, None].to(tl.int64) * stride_o + tl.arange(0, 256)[None, :]
            for si in tl.static_range(G // 16):
                sb = tl.program_id(1) * (G // 16) + si
                tl.store(out + sb * 256, _dq_q4k(row, sb, m, BN, QT), mask=m[:, None])
        else:
            out = o_ptr + r[:, None].to(tl.int64) * stride_o + tl.arange(0, 16)[None, :]
            for gi in tl.static_range(G):
                g = tl.program_id(1) * G + gi
                tl.store(out + g * 16, _dq16(row, g, m, QT), mask=m[:, None])

    @triton.jit
    def _tile(pid, se_ptr, bs_ptr, bc_ptr, NP, E, NG, NN,
              TABLE: tl.constexpr, BM: tl.constexpr, GM: tl.constexpr):
        """Which rows a program takes: (output block nb, expert e (E: none), sorted positions r [BM], row mask).
        TABLE: a block table (bs: first sorted position, bc: rows, 0 = empty) and a grouped program order (GM
        row blocks x all column blocks, so a tile of rows and an expert's weights stay in L2); else the decode
        tiling: program (i, nb) runs when sorted position i is the first of its expert, over that expert's rows."""
        if TABLE:
            per = GM * NN
            first = (pid // per) * GM
            gsz = tl.minimum(NG - first, GM)
            b = first + (pid % per) % gsz
            nb = (pid % per) // gsz
            start = tl.load(bs_ptr + b)
            cnt = tl.load(bc_ptr + b)
            e = tl.load(se_ptr + start)
            e = tl.where(cnt > 0, e, E)
            r = start + tl.arange(0, BM)
            rm = tl.arange(0, BM) < cnt
        else:
            i = tl.program_id(0)
            nb = tl.program_id(1)
            e = tl.load(se_ptr + i)
            prev = tl.load(se_ptr + i - 1, mask=i > 0, other=-1)
            lead = (e < E) & (e != prev)
            e = tl.where(lead, e, E)
            r = i + tl.arange(0, BM)
            rin = r < tl.where(lead, NP, 0)      # masks come from vector comparisons only (boolean in the interpreter)
            rm = rin & (tl.load(se_ptr + r, mask=rin, other=-1) == e)
        return nb, e, r, rm

    @triton.jit
    def _slot_of(e, slot_ptr, E, HAS_SLOT: tl.constexpr):
        """The weights' index of expert e (-1: not resident, or no expert)."""
        if HAS_SLOT:
            s = tl.load(slot_ptr + tl.minimum(e, E - 1))
            s = tl.where(e < E, s, -1)
        else:
            s = tl.where(e < E, e, -1)
        return s

    @triton.jit
    def _moe_up_kernel(x_ptr, tok_ptr, se_ptr, bs_ptr, bc_ptr, slot_ptr, w_ptr, h_ptr, NP, E, NI, K, NG, NN,
                       stride_xm, stride_we, stride_wn, stride_hm,
                       TABLE: tl.constexpr, HAS_SLOT: tl.constexpr, QT: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr, GPI: tl.constexpr,
                       GDC: tl.constexpr = False):
        pdl.start(GDC)
        nb, e, r, rm = _tile(tl.program_id(0), se_ptr, bs_ptr, bc_ptr, NP, E, NG, NN, TABLE, BM, GM)
        s = _slot_of(e, slot_ptr, E, HAS_SLOT)
        run = s >= 0
        rr = rm & (tl.arange(0, BM) < tl.where(run, BM, 0))
        kend = tl.where(run, K, 0)            # programs with nothing to do run no iterations
        tok = tl.load(tok_ptr + r, mask=rr, other=0)
        n = nb * BN + tl.arange(0, BN)
        nm = n < NI
        wb = w_ptr + tl.maximum(s, 0).to(tl.int64) * stride_we
        xrow = x_ptr + tok.to(tl.int64) * stride_xm
        accg = tl.zeros((BM, BN), dtype=tl.float32)
        accu = tl.zeros((BM, BN), dtype=tl.float32)
        if QT == 0:
            for k0 in range(0, kend, BK):
                kk = k0 + tl.arange(0, BK)
                km = kk < K
                a = tl.load(xrow[:, None] + kk[None, :], mask=rr[:, None] & km[None, :], other=0.0)
                bg = tl.load(wb + kk[:, None] + n[None, :] * stride_wn, mask=nm[None, :] & km[:, None], other=0.0)
                bu = tl.load(wb + kk[:, None] + (n[None, :] + NI) * stride_wn, mask=nm[None, :] & km[:, None],
                             other=0.0)
                accg += tl.dot(a, bg)
                accu += tl.dot(a, bu)
        else:
            dt = x_ptr.dtype.element_ty
            rg = wb + n.to(tl.int64) * stride_wn
            ru = wb + (n + NI).to(tl.int64) * stride_wn
            j = tl.arange(0, 16)
            for g0 in range(0, kend // 16, GPI):       # GPI groups of 16 values per iteration
                for u in tl.static_range(GPI):
                    g = g0 + u
                    a = tl.load(xrow[:, None] + g * 16 + j[None, :], mask=rr[:, None], other=0.0)
                    wg = _dq16(rg, g, nm, QT).to(dt)
                    wu = _dq16(ru, g, nm, QT).to(dt)
                    accg += tl.dot(a, tl.trans(wg))
                    accu += tl.dot(a, tl.trans(wu))
        act = accg * tl.sigmoid(accg) * accu
        tl.store(h_ptr + r[:, None].to(tl.int64) * stride_hm + n[None, :], act.to(h_ptr.dtype.element_ty),
                 mask=rr[:, None] & nm[None, :])

    @triton.jit
    def _moe_down_kernel(h_ptr, se_ptr, bs_ptr, bc_ptr, slot_ptr, ord_ptr, wt_ptr, w_ptr, y_ptr, NP, E, N, K, NG, NN,
                         stride_hm, stride_we, stride_wn, stride_ym,
                         TABLE: tl.constexpr, HAS_SLOT: tl.constexpr, QT: tl.constexpr, ZBM: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr, GPI: tl.constexpr,
                         GDC: tl.constexpr = False):
        pdl.start(GDC)
        nb, e, r, rm = _tile(tl.program_id(0), se_ptr, bs_ptr, bc_ptr, NP, E, NG, NN, TABLE, BM, GM)
        s = _slot_of(e, slot_ptr, E, HAS_SLOT)
        run = s >= 0
        rr = rm & (tl.arange(0, BM) < tl.where(run, BM, 0))
        sm = rm & (tl.arange(0, BM) < tl.where(run, BM, ZBM))    # rows stored: run rows, + missed ones (zeros)
        kend = tl.where(run, K, 0)
        dst = tl.load(ord_ptr + r, mask=rm, other=0)
        wt = tl.load(wt_ptr + dst, mask=rm, other=0.0).to(tl.float32)
        n = nb * BN + tl.arange(0, BN)
        nm = n < N
        wb = w_ptr + tl.maximum(s, 0).to(tl.int64) * stride_we
        hrow = h_ptr + r.to(tl.int64) * stride_hm
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if QT == 0:
            for k0 in range(0, kend, BK):
                kk = k0 + tl.arange(0, BK)
                km = kk < K
                a = tl.load(hrow[:, None] + kk[None, :], mask=rr[:, None] & km[None, :], other=0.0)
                b = tl.load(wb + n[None, :] * stride_wn + kk[:, None], mask=nm[None, :] & km[:, None], other=0.0)
                acc += tl.dot(a, b)
        else:
            dt = h_ptr.dtype.element_ty
            rw = wb + n.to(tl.int64) * stride_wn
            j = tl.arange(0, 16)
            for g0 in range(0, kend // 16, GPI):
                for u in tl.static_range(GPI):
                    g = g0 + u
                    a = tl.load(hrow[:, None] + g * 16 + j[None, :], mask=rr[:, None], other=0.0)
                    acc += tl.dot(a, tl.trans(_dq16(rw, g, nm, QT).to(dt)))
        out = acc * wt[:, None]
        tl.store(y_ptr + dst[:, None].to(tl.int64) * stride_ym + n[None, :], out.to(y_ptr.dtype.element_ty),
                 mask=sm[:, None] & nm[None, :])

    @triton.jit
    def _moe_sum_kernel(y_ptr, idx_ptr, x_ptr, o_ptr, E, N, stride_ym, stride_x, stride_om, TOPK: tl.constexpr,
                        RES: tl.constexpr, BN: tl.constexpr, GDC: tl.constexpr = False):
        pdl.start(GDC)
        t = tl.program_id(0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nm = n < N
        acc = tl.zeros((BN,), dtype=tl.float32)
        for j in tl.static_range(TOPK):       # top-k order, every pair (a missed pair's row is zeros or the miss path's)
            ok = tl.load(idx_ptr + t * TOPK + j) < E
            acc += tl.load(y_ptr + (t * TOPK + j).to(tl.int64) * stride_ym + n, mask=n < tl.where(ok, N, 0),
                           other=0.0).to(tl.float32)
        dt = o_ptr.dtype.element_ty
        if RES:
            x = tl.load(x_ptr + t.to(tl.int64) * stride_x + n, mask=nm, other=0.0).to(tl.float32)
            tl.store(o_ptr + t.to(tl.int64) * stride_om + n, (x + acc.to(dt).to(tl.float32)).to(dt), mask=nm)
        else:
            tl.store(o_ptr + t.to(tl.int64) * stride_om + n, acc.to(dt), mask=nm)

    @triton.jit
    def _route_kernel(lg_ptr, pos_ptr, slot_ptr, idx_ptr, w_ptr, se_ptr, ord_ptr, tok_ptr, miss_ptr, nmiss_ptr,
                      W, stride_lg, E: tl.constexpr, EP: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr,
                      WP: tl.constexpr, NPP: tl.constexpr, NORM: tl.constexpr, HAS_SLOT: tl.constexpr,
                      GDC: tl.constexpr = False):
        pdl.start(GDC)
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
        NP = W * TOPK
        pr = tl.arange(0, NPP)
        pm = pr < NP
        tl.store(miss_ptr + pr, tl.full((NPP,), -1, tl.int32), mask=pm)
        tl.debug_barrier()
        e = tl.load(idx_ptr + pr, mask=pm, other=E + 1)
        before = (e[None, :] < e[:, None]) | ((e[None, :] == e[:, None]) & (pr[None, :] < pr[:, None]))
        rank = tl.sum(before.to(tl.int32), 1)
        tl.store(se_ptr + rank, e, mask=pm)
        tl.store(ord_ptr + rank, pr, mask=pm)
        tl.store(tok_ptr + rank, pr // TOPK, mask=pm)
        if HAS_SLOT:       # pairs without a slot, in sorted order: the miss list
            sl = tl.load(slot_ptr + tl.minimum(e, E - 1), mask=pm, other=0)
            miss = pm & (e < E) & (sl < 0)
            mrank = tl.sum((before & miss[None, :]).to(tl.int32), 1)
            tl.store(miss_ptr + mrank, pr, mask=miss)
            tl.store(nmiss_ptr, tl.sum(miss.to(tl.int32), 0))
        else:
            tl.store(nmiss_ptr, 0)


def _groups_per_step(k: int, bk: int) -> int:
    """Groups of 16 values a quantized loop step takes: the largest divisor of k/16 up to bk/16."""
    n = max(1, bk // 16)
    while (k // 16) % n:
        n -= 1
    return n


def scratch_bytes(rows: int, top_k: int, hidden: int, inter: int, n_exp: int, elem_bytes: int = 2) -> int:
    """Peak transient device bytes of one grouped MoE call on `rows` rows (the budget's MoE scratch): routing
    tables, the gated activations h [rows*k, I] and the per-pair rows y [rows*k, H] (float32 for decode windows, the
    activations' dtype for prefill chunks, which run at most PREFILL_ROWS rows at a time), plus the output (and the
    sorted copies torch._grouped_mm needs when PREFILL_IMPL selects it)."""
    r = min(rows, PREFILL_ROWS)
    npairs = r * top_k
    y_bytes = 4 if rows <= DECODE_ROWS else elem_bytes
    tables = npairs * 4 * 8 + (npairs + n_exp) * 8 * 6   # routing (int32) and the prefill block table's temporaries
    extra = npairs * (2 * hidden + 2 * inter) * elem_bytes if rows > DECODE_ROWS and PREFILL_IMPL == "grouped_mm" else 0
    return tables + npairs * inter * elem_bytes + npairs * hidden * y_bytes + r * hidden * elem_bytes + extra


# ------------------------------------------------------------------------------------------------------ routing

def _misses(se: Tensor, order: Tensor, slot: Tensor | None, n_exp: int) -> tuple[Tensor, Tensor]:
    NP = se.numel()
    dev = se.device
    if slot is None:
        return torch.full((NP,), -1, dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.int32, device=dev)
    miss = (se < n_exp) & (slot[se.clamp(max=n_exp - 1).long()] < 0)
    _, perm = torch.sort((~miss).to(torch.int8), stable=True)         # missed pairs first, in sorted order
    n = miss.sum().to(torch.int32).reshape(1)
    lst = torch.where(torch.arange(NP, device=dev) < n, order[perm], -1).to(torch.int32)
    return lst, n


def group(idx: Tensor, w: Tensor, n_exp: int, slot: Tensor | None = None) -> Routing:
    """Routing for ids idx [T, k] (an id >= n_exp: a padded row) and weights w [T, k], grouped by expert with device
    ops only (no host sync)."""
    T, k = idx.shape
    flat = idx.reshape(-1).to(torch.int32)
    se, order = torch.sort(flat, stable=True)
    se = se.contiguous()
    order = order.to(torch.int32).contiguous()
    tok = torch.div(order, k, rounding_mode="floor").contiguous()
    miss, n_miss = _misses(se, order, slot, n_exp)
    return Routing(flat.view(T, k), w.contiguous(), se, order, tok, miss, n_miss)


# warps of the routing kernel for a one-row window (4 for wider ones); chosen by the row count alone. H200, A3B
# one-row step (bench/step_ab.py): 2.69 ms at 1k context on 4 warps, 2.64 on 2, 2.65 on 1
ROUTE_WARPS_ONE_ROW = 2


def route(logits: Tensor, pos: Tensor, top_k: int, norm: bool, slot: Tensor | None = None) -> Routing:
    """Router logits [W, E] -> Routing in one launch (fp32 softmax, top-k (lowest id first on ties), optional
    renormalisation; rows with pos < 0 get expert E), with the miss list when `slot` [E] is given."""
    W, E = logits.shape
    dev = logits.device
    NP = W * top_k
    idx = torch.empty(W, top_k, dtype=torch.int32, device=dev)
    w = torch.empty(W, top_k, dtype=torch.float32, device=dev)
    se = torch.empty(NP, dtype=torch.int32, device=dev)
    order = torch.empty(NP, dtype=torch.int32, device=dev)
    tok = torch.empty(NP, dtype=torch.int32, device=dev)
    miss = torch.empty(NP, dtype=torch.int32, device=dev)
    n_miss = torch.empty(1, dtype=torch.int32, device=dev)
    _route_kernel[(1,)](logits, pos, slot if slot is not None else pos, idx, w, se, order, tok, miss, n_miss, W,
                        logits.stride(0), E=E, EP=triton.next_power_of_2(E), TOPK=top_k,
                        KP=triton.next_power_of_2(top_k), WP=max(2, triton.next_power_of_2(W)),
                        NPP=max(2, triton.next_power_of_2(NP)), NORM=norm, HAS_SLOT=slot is not None,
                        num_warps=ROUTE_WARPS_ONE_ROW if W == 1 else 4,
                        **pdl.launch(logits, "route"))
    return Routing(idx, w, se, order, tok, miss, n_miss)


def block_table(se: Tensor, n_exp: int, bm: int) -> tuple[Tensor, Tensor, int]:
    """Prefill tiles over sorted expert ids se [NP]: (first sorted position [G], rows [G] (0: empty), G), G a bound
    that depends only on NP and E (no host sync)."""
    NP = se.numel()
    dev = se.device
    bounds = torch.searchsorted(se, torch.arange(n_exp + 1, device=dev, dtype=se.dtype))   # first position per id
    counts = (bounds[1:] - bounds[:-1]).long()
    nblk = (counts + bm - 1) // bm
    cum = torch.cumsum(nblk, 0)
    G = (NP + bm - 1) // bm + min(n_exp, NP)
    b = torch.arange(G, device=dev)
    eb = torch.searchsorted(cum, b, right=True)
    ec = eb.clamp(max=n_exp - 1)
    j = b - (cum[ec] - nblk[ec])
    real = eb < n_exp
    bs = torch.where(real, bounds[ec].long() + j * bm, 0).to(torch.int32).contiguous()
    bc = torch.where(real, (counts[ec] - j * bm).clamp(0, bm), 0).to(torch.int32).contiguous()
    return bs, bc, G


# ------------------------------------------------------------------------------------------------------ experts

def experts(x: Tensor, r: Routing, gate_up: Tensor, down: Tensor, *, fmt=None, slot: Tensor | None = None,
            y: Tensor | None = None, zero_missing: bool = True) -> Tensor:
    """y [T*k, H]: row p = w_p * expert_e(x_t) for every pair whose expert has a slot; a missed pair's row is zeros
    (zero_missing) or left as it is; padded pairs' rows are not touched. Windows of up to DECODE_ROWS rows take the
    row-invariant tiling (y float32), larger ones the prefill tiles (y in x's dtype). Passing `y` (and a staging
    `slot` table / weights) fills only the rows of the pairs resident there, with the same bits as a resident run."""
    T, H = x.shape
    NP = r.se.numel()
    fg, fd = _fmt_pair(fmt)
    n_exp = slot.numel() if slot is not None else gate_up.shape[0]
    _, inter = expert_dims(gate_up, down, fmt)
    x = x.contiguous()
    tiles = T > DECODE_ROWS
    if y is None:
        y = torch.empty(NP, H, dtype=x.dtype if tiles else torch.float32, device=x.device)
    h = torch.empty(NP, inter, dtype=x.dtype, device=x.device)
    sl = slot if slot is not None else r.se
    wf = r.w.reshape(-1)
    launch = pdl.launch(x, "prefill" if tiles else "")
    if tiles:                     # prefill chunks
        up_cfg = MOE_PRE_UP if fg == "bf16" else MOE_PRE_QUP
        down_cfg = MOE_PRE_DOWN if fd == "bf16" else MOE_PRE_QDOWN
    else:
        up_cfg = MOE_UP if fg == "bf16" else MOE_QUP
        down_cfg = MOE_DOWN if fd == "bf16" else MOE_QDOWN
    tables: dict[int, tuple[Tensor, Tensor, int]] = {}
    for part, cfg in (("up", up_cfg), ("down", down_cfg)):
        gv = None if tiles else moe_gemv.variant(fg if part == "up" else fd, T)
        if gv is not None:        # decode window: the matrix-vector kernels (runtime/gpu/moe_gemv.py)
            if part == "up":
                moe_gemv.up(x, r.tok, r.se, sl, gate_up, h, fg, n_exp, inter, slot is not None, pow2(T), gv)
            else:
                # resident experts (no slot table) are never written during a step, and the routing was written
                # before the up kernel: an EARLY variant may read both before its PDL wait
                moe_gemv.down(h, r.se, sl, r.order, wf, down, y, fd, n_exp, slot is not None, zero_missing,
                              pow2(T), gv, early=slot is None)
            continue
        N = inter if part == "up" else H
        nn = triton.cdiv(N, cfg["BN"])
        if tiles:
            bm = cfg["BM"]
            if bm not in tables:
                tables[bm] = block_table(r.se, n_exp, bm)
            bs, bc, G = tables[bm]
            grid = (G * nn,)
            gm = cfg["GM"]
        else:
            bm, bs, bc, G, grid, gm = pow2(T), r.se, r.se, NP, (NP, nn), 1
        K = H if part == "up" else inter
        meta = {"TABLE": tiles, "HAS_SLOT": slot is not None, "BM": bm, "BN": cfg["BN"], "BK": cfg["BK"], "GM": gm,
                "GPI": _groups_per_step(K, cfg["BK"]), "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
        if part == "up":
            _moe_up_kernel[grid](x, r.tok, r.se, bs, bc, sl, gate_up, h, NP, n_exp, inter, H, G, nn, x.stride(0),
                                 gate_up.stride(0), gate_up.stride(1), h.stride(0), QT=QCODE[fg], **meta, **launch)
        else:
            _moe_down_kernel[grid](h, r.se, bs, bc, sl, r.order, wf, down, y, NP, n_exp, H, inter, G, nn, h.stride(0),
                                   down.stride(0), down.stride(1), y.stride(0), QT=QCODE[fd],
                                   ZBM=bm if zero_missing else 0, **meta, **launch)
    return y


def combine(y: Tensor, idx: Tensor, n_exp: int, residual: Tensor | None = None, dtype: torch.dtype | None = None
            ) -> Tensor:
    """out[t] = (residual[t] +) the sum of y's k rows of token t, in top-k order, in float32; pairs whose id in
    idx [T, k] (int32) is >= n_exp (padding) are skipped."""
    T, k = idx.shape
    H = y.shape[1]
    out = torch.empty(T, H, dtype=residual.dtype if residual is not None else dtype, device=y.device)
    BS = 256
    res = residual if residual is not None else out
    _moe_sum_kernel[(T, triton.cdiv(H, BS))](y, idx, res, out, n_exp, H, y.stride(0), res.stride(0), out.stride(0),
                                              TOPK=k, RES=residual is not None, BN=BS,
                                              **pdl.launch(y, "prefill" if T > DECODE_ROWS else ""))
    return out


def moe_routed(x: Tensor, residual: Tensor | None, r: Routing, gate_up: Tensor, down: Tensor, *, fmt=None,
               slot: Tensor | None = None, miss_fn: MissFn | None = None) -> Tensor:
    """(residual +) experts(x) with routing `r`: experts, then `miss_fn(x, r, y)` (fills the missed pairs' rows of
    y), then the per-token sum. Device work only: a CUDA graph captures it (with a graphable miss_fn)."""
    n_exp = slot.numel() if slot is not None else gate_up.shape[0]
    split = moe_split.TILE
    if split is not None and residual is not None and x.shape[0] == 1 and slot is None and miss_fn is None \
            and _fmt_pair(fmt) == ("bf16", "bf16") and moe_split.fits(gate_up, split):
        # one row of float experts: gate/up and each slice's down share in one grid, then the partials' sum
        return moe_split.ffn_row(x, r.se, r.order, r.w.reshape(-1), gate_up, down, residual, r.idx.shape[1], split)
    ds = moe_gemv.DOWN_SUM
    if ds is not None and residual is not None and x.shape[0] == 1 and slot is None and miss_fn is None \
            and _fmt_pair(fmt) == ("bf16", "bf16") and moe_gemv.variant("bf16", 1) is not None:
        # one row of float experts: gate/up through the GEMV kernel, then down + the top-k sum in one launch
        inter = gate_up.shape[1] // 2
        h = torch.empty(r.se.numel(), inter, dtype=x.dtype, device=x.device)
        moe_gemv.up(x.contiguous(), r.tok, r.se, r.se, gate_up, h, "bf16", n_exp, inter, False, 1,
                    moe_gemv.variant("bf16", 1))
        return moe_gemv.down_sum(h, r.se, r.order, r.w.reshape(-1), down, residual, r.idx.shape[1], ds, True)
    y = experts(x, r, gate_up, down, fmt=fmt, slot=slot)
    if miss_fn is not None:
        miss_fn(x, r, y)
    return combine(y, r.idx, n_exp, residual, x.dtype)


def moe_grouped(x: Tensor, idx: Tensor, w: Tensor, gate_up: Tensor, down: Tensor, *, fmt=None,
                slot: Tensor | None = None, miss_fn: MissFn | None = None) -> Tensor:
    """x [T, H]; idx [T, k] expert ids (an id >= E marks a padded row: it uses no expert and gets 0); w [T, k]
    routing weights; gate_up [S, 2I, H], down [S, H, I] (module docstring) -> [T, H]. Triton (CUDA, or the CPU
    interpreter in tests)."""
    T = x.shape[0]
    if T > PREFILL_ROWS:
        return torch.cat([moe_grouped(x[s:s + PREFILL_ROWS], idx[s:s + PREFILL_ROWS], w[s:s + PREFILL_ROWS], gate_up,
                                      down, fmt=fmt, slot=slot, miss_fn=miss_fn) for s in range(0, T, PREFILL_ROWS)])
    n_exp = slot.numel() if slot is not None else gate_up.shape[0]
    r = group(idx, w, n_exp, slot)
    if T > DECODE_ROWS and PREFILL_IMPL == "grouped_mm" and slot is None and fmt in (None, "bf16") \
            and miss_fn is None and hasattr(torch, "_grouped_mm"):
        try:
            return combine(experts_grouped_mm(x, r, gate_up, down), r.idx, n_exp, None, x.dtype)
        except RuntimeError:       # a shape or dtype this torch build's grouped matmul refuses: the Triton tiles
            pass
    return moe_routed(x, None, r, gate_up, down, fmt=fmt, slot=slot, miss_fn=miss_fn)


def experts_grouped_mm(x: Tensor, r: Routing, gate_up: Tensor, down: Tensor) -> Tensor:
    """y as `experts` computes it, through torch._grouped_mm (float weights, every expert resident)."""
    n_exp = gate_up.shape[0]
    inter = gate_up.shape[1] // 2
    bounds = torch.searchsorted(r.se, torch.arange(1, n_exp + 1, device=x.device, dtype=r.se.dtype))
    offs = bounds.to(torch.int32)
    xs = x.index_select(0, r.tok.long())
    gu = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)
    act = F.silu(gu[:, :inter]) * gu[:, inter:]
    ys = torch._grouped_mm(act, down.transpose(1, 2), offs=offs)
    ws = r.w.reshape(-1).index_select(0, r.order.long()).to(ys.dtype)
    y = torch.zeros(r.se.numel(), x.shape[1], dtype=x.dtype, device=x.device)
    y.index_copy_(0, r.order.long(), ys * ws[:, None])
    return y


# ------------------------------------------------------------------------------------------ dequantization

# `dequantize`'s programs: BN rows x G groups of 16 values each (a power of two; fewer where the row has fewer). H200,
# A3B q/k/v and o_proj, 48 in a graph (bench/dequant.py, bench/results/h200_session18/): Q4_K 25.7 -> 7.8 us (with
# whole super-blocks a program, `_dq_q4k`), Q6_K 24.0 -> 14.1, Q4_0 15.7 -> 14.1, Q8_0 16.6 -> 14.7 (q/k/v; the tile
# before: 32 rows x 1 group); a verify window of the A3B at 1k context: Q4_K_M 8 rows 11.8 -> 10.3 ms, 4 rows 8.14 ->
# 6.66; Q4_0 9.42 -> 9.22 and 6.32 -> 6.15 (the same logits)
DEQUANT_TILE = {"BN": 8, "G": 16, "num_warps": 2}


def dequantize(blocks: Tensor, fmt: str, out: Tensor | None = None, tile: dict[str, int] | None = None) -> Tensor:
    """ggml blocks [R, row_bytes] (uint8) -> float32 [R, cols] with the in-register dequantizer of the expert kernels
    (bit for bit gguf-py's values); into `out` ([R, cols], its dtype: the values rounded once) when given. `tile`:
    other than DEQUANT_TILE (the benchmarks' candidates; the values do not depend on it)."""
    name = block_format(fmt).name
    R, rb = blocks.shape
    cols = cols_from_row_bytes(rb, name)
    if out is None:
        out = torch.empty(R, cols, dtype=torch.float32, device=blocks.device)
    t = DEQUANT_TILE if tile is None else tile
    G = t["G"]
    while (cols // 16) % G:          # groups a program: a power of two that divides the row's
        G //= 2
    _dequant_kernel[(triton.cdiv(R, t["BN"]), cols // (16 * G))](blocks, out, R, blocks.stride(0), out.stride(0),
                                                                 QT=QCODE[name], BN=t["BN"], G=G,
                                                                 num_warps=t["num_warps"], **FMA)
    return out


def dequantize_ref(blocks: Tensor, fmt: str) -> Tensor:
    """The torch-side dequantizer of one weight matrix (the fallback's: one expert at a time) -> float32."""
    from runtime.formats.blocks import dequantize_torch  # every format of the table, on the blocks' device

    return dequantize_torch(blocks.contiguous(), block_format(fmt).name)


# -------------------------------------------------------------------------------------------- torch fallback

def experts_torch(x: Tensor, r: Routing, gate_up: Tensor, down: Tensor, *, fmt=None, slot: Tensor | None = None,
                  y: Tensor | None = None, zero_missing: bool = True) -> Tensor:
    """`experts` in plain torch (CPU, or no Triton): a loop over the window's experts, each dequantized on its own."""
    T, H = x.shape
    NP = r.se.numel()
    k = NP // T
    fg, fd = _fmt_pair(fmt)
    n_exp = slot.numel() if slot is not None else gate_up.shape[0]
    _, inter = expert_dims(gate_up, down, fmt)
    if y is None:
        y = torch.zeros(NP, H, dtype=torch.float32, device=x.device)
    se = r.se.tolist()
    order = r.order.long()
    wf = r.w.reshape(-1)
    slots = slot.tolist() if slot is not None else None
    a = 0
    while a < NP and se[a] < n_exp:
        e = se[a]
        b = a
        while b < NP and se[b] == e:
            b += 1
        pairs = order[a:b]
        s = slots[e] if slots is not None else e
        if s < 0:
            if zero_missing:
                y[pairs] = 0
        else:
            gu = gate_up[s] if fg == "bf16" else dequantize_ref(gate_up[s], fg)
            dn = down[s] if fd == "bf16" else dequantize_ref(down[s], fd)
            rows = x[pairs // k]
            hv = F.linear(rows, gu.to(x.dtype))
            act = F.silu(hv[:, :inter]) * hv[:, inter:]
            yv = F.linear(act, dn.to(x.dtype))
            y[pairs] = (yv.float() * wf[pairs].float()[:, None]).to(y.dtype)
        a = b
    return y


def combine_torch(y: Tensor, idx: Tensor, n_exp: int, residual: Tensor | None = None,
                  dtype: torch.dtype | None = None) -> Tensor:
    T, k = idx.shape
    ok = (idx < n_exp).reshape(T, k, 1)
    s = torch.where(ok, y.float().view(T, k, -1), 0.0)
    acc = s[:, 0]
    for j in range(1, k):          # top-k order, as the kernel sums
        acc = acc + s[:, j]
    if residual is None:
        return acc.to(dtype)
    return (residual.float() + acc.to(residual.dtype).float()).to(residual.dtype)


def moe_torch(x: Tensor, idx: Tensor, w: Tensor, gate_up: Tensor, down: Tensor, *, fmt=None,
              slot: Tensor | None = None, miss_fn: MissFn | None = None) -> Tensor:
    """`moe_grouped` in plain torch, same staging (experts, miss path, top-k-ordered sum)."""
    n_exp = slot.numel() if slot is not None else gate_up.shape[0]
    r = group(idx, w, n_exp, slot)
    y = experts_torch(x, r, gate_up, down, fmt=fmt, slot=slot)
    if miss_fn is not None:
        miss_fn(x, r, y)
    return combine_torch(y, r.idx, n_exp, None, x.dtype)
