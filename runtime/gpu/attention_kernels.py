"""Triton kernels for attention over the static KV cache: `kv_write`, `qkv_post` (q/k norm + RoPE + cache write),
`attention` (each query row against the cache up to its own position, read from a device tensor) and `dequant_q8`
(a quantized cache's prefix into the compute dtype, for the prefill). Rows with position -1 are padding: nothing is
written or read. Every kernel takes the cache in the compute dtype or as q8_0 (runtime/kv.py: int8 values and a
float16 scale per 32; `ks`/`vs` are the scales).

`attention` splits the context (flash-decoding): a program per (block of window rows, KV head, chunk of positions;
runtime/kv.py `KV_TIERS`: short chunks early in the context, longer ones later; a one-row window over a BF16 cache
splits by its row's length instead, `ONE_ROW_CHUNKS`, over a q8_0 one `ONE_ROW_CHUNKS_Q8` when set) leaves each
row's chunk output
(unnormalised), max and sum; a second kernel combines a row's chunks in a fixed order. The rows of a block share
each K/V tile they read, so a verify window of W rows reads the cache once, not W times. Chunk boundaries are
absolute positions and every tile size is a constant of the model (the row block too, `row_block`: one for one-row
windows, one for wider ones, today the same), and a row never
mixes with another row's lines, so a row's bits depend only on that row's query, its position and the cache, never
on the window width, the other rows or the cache capacity (docs/models.md, "Numerics"). The grid is fixed by the
capacity (programs walk every n-th chunk; those past a row's last chunk do
nothing), so one CUDA graph serves every position.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from runtime import kv as kv_layout
from runtime.gpu import pdl
from runtime.gpu.kernels import FMA, HAVE_TRITON, pow2
from runtime.kv import (
    Q8_BLOCK,
    one_row_chunks,
    one_row_layout,
    partial_chunks,
    split_chunks,
    tiers4,
    uniform_tiers,
)

REDUCE_TILE = 64        # chunks combined per step of the reduction (a constant: it fixes the summation order)
# positions per inner step (it fixes the order of the online softmax: a constant per head_dim) and launch settings
SPLIT_TILE = {"BS": 64, "num_warps": 4, "num_stages": 3}
ROW_TILE = 64           # query-head lines per split program (rows x GQA group): the K/V tile is shared by them
# the same for windows of 2+ rows over a q8_0 cache (one value for every such width, so a row keeps its bits at 2..16
# rows). H200, 8 rows (`python bench/step_ab.py --kv q8_0 --widths 8 --arms wide-default,q8-wide32,q8-wide16`,
# bench/results/h200_session37/next2/): 11.8 / 14.3 / 20.8 ms at 32k on 64 / 32 / 16 lines, 19.4 / 30.0 / 56.5 at 131k
ROW_TILE_Q8 = 64
# the same for a one-row window (a target decoding alone: its step is one row wide), where 56 of a 64-line tile's
# lines are padding on the A3B. A one-row tile other than ROW_TILE may give other bits than the same row in a wider
# window, as the dense products of a one-row step already do. With a BF16 cache 16 and 32 lines were within noise
# of 64 (H100, `python bench/step_ab.py --contexts 1024,4096,16384,32768 --widths 1 --arms default,rt1-16,rt1-32`,
# bench/results/h100_session21/); `--kv q8_0` times them on an 8-bit cache
ROW_TILE_ONE = 64
# a one-row window over a q8_0 cache: 16 lines (8 of them the A3B's GQA group). H100, `python bench/attn_split.py
# --widths 1` (the kernel alone, the same bits as 64 lines): 12.1 -> 10.8 us at 4k, 44.6 -> 39.4 at 32k, 136 -> 125
# at 131k; `python bench/step_ab.py --kv q8_0 --widths 1 --arms default,rt1-16`: the step 3.20 -> 3.16 ms at 1k,
# 4.74 -> 4.55 at 32k, 9.18 -> 8.69 at 131k (bench/results/h100_session35/first/)
ROW_TILE_ONE_Q8 = 16
# and that tile under a register cap (threads' registers a program; 0: none), so three programs fit an SM instead of
# two (253 registers a thread uncapped; at 168 it spills 5 values). H100, the one-row A3B step (`python
# bench/step_ab.py --kv q8_0 --widths 1 --arms default,split-regs168`, before this cap was the default): 3.16 -> 3.18
# ms at 1k, 4.55 -> 4.43 at 32k, 8.68 -> 7.89 at 131k (bench/results/h100_session35/second/). Not for wider windows'
# 64-line tiles, which spill more under it: 8 rows 21.4 -> 24.4 ms at 131k
SPLIT_ONE_Q8_REGS = 168
# a q8_0 cache: the split kernel loads the next tile's codes and scales before this tile's dequantization and dots
# (the same values as a tile at a time; False: a tile at a time, the benchmarks' switch), in one pipeline stage
# (docs/models.md, "KV cache": H200, A3B heads, bench/attn_split.py)
Q8_PREFETCH = True
SPLIT_TILE_Q8 = {"BS": 64, "num_warps": 4, "num_stages": 1}
# how the split kernel turns a q8_0 cache's int8 codes into floats (the same values, exactly): 0 the conversion
# unit's int-to-float (a quarter of the issue rate), 1 the code added to 2^23 + 128 in a float's bits, less 2^23 +
# 128 (integer and float adds), 2 the same bits built by byte permutes (`prmt`, four codes an instruction group; a
# GPU only, the interpreter takes 1) (docs/models.md, "KV cache")
Q8_CVT = 0
PROGRAMS_PER_SM = 4     # the split grid: about this many programs per SM in all (no effect on the bits)
# the split kernel's programs with no chunk at the current positions end before their PDL wait and before loading
# their queries (the grid covers the cache's capacity: at 1k positions of a 40k cache, 36 of 528 programs work).
# The same bits; False: every program waits and loads first (the benchmarks' switch). H100, A3B one-row step on a
# 32k cache (bench/step_ab.py --capacity 32768, arm split-exit-late): 3.13 -> 3.11 ms at 1k, within noise
# (bench/results/h100_session36/timeline/)
SPLIT_EXIT_EARLY = True
# the split kernel's working programs ask the memory system to bring the first SPLIT_KV_PREFETCH positions of
# their first chunk (K and V; a q8_0 cache's codes and scales) into L2 before their PDL wait
# (`cp.async.bulk.prefetch.L2`, sm_90+: a hint that reads, writes nothing and holds no register), so those reads
# start while the q/k/v post-processing still runs and before the o_proj product's early weight loads; 0: off.
# Needs SPLIT_EXIT_EARLY (where a program knows it works before its wait). The same bits either way. H100, A3B
# one-row step on 40,960-position caches, two runs (bench/step_ab.py --arms kv-pf0,kv-pf64,...;
# bench/results/h100_session37/kv_pf/ and top_pf/): 3.07-3.08 -> 3.06-3.07 ms at 1k, 3.12-3.13 -> 3.07-3.08 at 4k,
# 3.67 -> 3.63 at 16k, 4.25 -> 4.20 at 32k; 128 and 256 positions no better
SPLIT_KV_PREFETCH = 64
# `qkv_post` on more than POST_ROWS_FROM rows (prefill chunks; decode and verify windows are narrower and keep the
# one-row programs) takes POST_ROWS rows a program: H200, A3B, an 8192-row chunk 179 us a layer, 357 in one-row programs
POST_ROWS_FROM = 64
POST_ROWS = 16


@functools.cache
def _sm_count(device: str) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.startswith("cuda") else 4


def row_block(group: int, rows: int = 2, q8: bool = False) -> int:
    """Window rows per program of the split kernel: ROW_TILE query-head lines in all (rows x the padded GQA
    group; over a q8_0 cache ROW_TILE_Q8; ROW_TILE_ONE, or ROW_TILE_ONE_Q8, for a window of one row), at least one row. A
    function of the model, the cache's format and the window's row count only (a step's fixed width), never of the
    other rows, so at one width a row's tile (and its bits) is the same whatever the other rows hold."""
    one, wide = (ROW_TILE_ONE_Q8, ROW_TILE_Q8) if q8 else (ROW_TILE_ONE, ROW_TILE)
    return max(1, (one if rows == 1 else wide) // group)


def split_programs(rows: int, kv_heads: int, chunks: int, device: torch.device) -> int:
    """Programs per (row block, KV head) of the split kernel, each walking chunks j, j + n, j + 2n, ...: enough for
    about PROGRAMS_PER_SM per SM when every chunk is busy (a full wave, no tail), few enough that programs with
    nothing to do (positions short of the capacity) cost little. Which program computes a chunk never changes its bits."""
    return max(1, min(chunks, -(-_sm_count(str(device)) * PROGRAMS_PER_SM // (rows * kv_heads))))


if HAVE_TRITON:
    import triton
    import triton.language as tl

if HAVE_TRITON:

    @triton.jit
    def _q8_quant(x):
        """x [NB, QB] fp32 -> (int8 [NB, QB], float16 [NB]): GGUF Q8_0 (runtime/kv.py `quantize_q8_0`)."""
        amax = tl.max(tl.abs(x), 1)
        d = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
        inv = tl.where(d == 0.0, 0.0, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), tl.where(d == 0.0, 1.0, d)))
        v = x * inv[:, None]
        a = tl.abs(v)
        f = tl.floor(a)
        r = f + tl.floor(2.0 * (a - f))
        q = tl.where(v < 0, -r, r)
        return q.to(tl.int8), d.to(tl.float16)

    @triton.jit
    def _raw_kv(ptr, sptr, base, sbase, s, sm, stride_cs, stride_ss, NB: tl.constexpr, QB: tl.constexpr):
        """Cache rows `s` [BS] of one q8_0 head as stored: int8 codes [BS, NB, QB] and float16 scales [BS, NB]."""
        b = tl.arange(0, NB)
        e = tl.arange(0, QB)
        off = base + s[:, None, None].to(tl.int64) * stride_cs + (b[None, :, None] * QB + e[None, None, :])
        xq = tl.load(ptr + off, mask=sm[:, None, None], other=0)
        sc = tl.load(sptr + sbase + s[:, None].to(tl.int64) * stride_ss + b[None, :], mask=sm[:, None], other=0.0)
        return xq, sc

    _ASM = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")      # the interpreter runs no PTX

    @triton.jit
    def _i8f(xq, CVT: tl.constexpr):
        """int8 codes as float32, exactly (`Q8_CVT`)."""
        if CVT == 2 and _ASM:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t, a, b, c, d; xor.b32 t, $4, 0x80808080; prmt.b32 a, t, 0x4B000000, 0x7650; "
                "prmt.b32 b, t, 0x4B000000, 0x7651; prmt.b32 c, t, 0x4B000000, 0x7652; "
                "prmt.b32 d, t, 0x4B000000, 0x7653; sub.f32 $0, a, 0f4B000080; sub.f32 $1, b, 0f4B000080; "
                "sub.f32 $2, c, 0f4B000080; sub.f32 $3, d, 0f4B000080; }",
                "=f,=f,=f,=f,r", [xq], dtype=tl.float32, is_pure=True, pack=4)
        elif CVT >= 1:
            return (xq.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
        else:
            return xq.to(tl.float32)

    @triton.jit
    def _deq(xq, sc, dt: tl.constexpr, BS: tl.constexpr, HD: tl.constexpr, CVT: tl.constexpr = 0):
        """`_raw_kv`'s codes times their scales in fp32, rounded once to `dt`, as [BS, HD] (`_load_kv`'s values)."""
        return tl.reshape((_i8f(xq, CVT) * sc.to(tl.float32)[:, :, None]).to(dt), (BS, HD))

    @triton.jit
    def _load_kv(ptr, sptr, base, sbase, s, sm, stride_cs, stride_ss, dt: tl.constexpr,
                 HD: tl.constexpr, BS: tl.constexpr, Q8: tl.constexpr, NB: tl.constexpr, QB: tl.constexpr):
        """Cache rows `s` [BS] (masked by `sm`) of one head as [BS, HD] in `dt`; q8_0 rows dequantized (`q * d` in
        fp32, rounded once)."""
        if Q8:
            xq, sc = _raw_kv(ptr, sptr, base, sbase, s, sm, stride_cs, stride_ss, NB, QB)
            return _deq(xq, sc, dt, BS, HD)
        else:
            d = tl.arange(0, HD)
            off = base + s[:, None].to(tl.int64) * stride_cs + d[None, :]
            return tl.load(ptr + off, mask=sm[:, None], other=0.0)

    @triton.jit
    def _store_row(x, ptr, sptr, dst, sdst, ok, HD: tl.constexpr, Q8: tl.constexpr, NB: tl.constexpr,
                   QB: tl.constexpr):
        """One head vector x [HD] (fp32 values of the compute dtype) into the cache at `dst` (scales at `sdst`),
        when `ok` (masks compare against a limit instead of `& ok`: the interpreter mistypes a scalar `&`)."""
        if Q8:
            e2 = tl.arange(0, NB)[:, None] * QB + tl.arange(0, QB)[None, :]
            q, d = _q8_quant(tl.reshape(x, (NB, QB)))
            tl.store(ptr + dst + e2, q, mask=e2 < tl.where(ok, HD, 0))
            b = tl.arange(0, NB)
            tl.store(sptr + sdst + b, d, mask=b < tl.where(ok, NB, 0))
        else:
            e = tl.arange(0, HD)
            tl.store(ptr + dst + e, x.to(ptr.dtype.element_ty), mask=e < tl.where(ok, HD, 0))

    @triton.jit
    def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, pos_ptr, stride_kw, stride_kh,
                         stride_ch, stride_cs, stride_sh, stride_ss,
                         HD: tl.constexpr, Q8: tl.constexpr, NB: tl.constexpr, QB: tl.constexpr,
                         GDC: tl.constexpr = False):
        pdl.start(GDC)
        row = tl.program_id(0)
        h = tl.program_id(1)
        pos = tl.load(pos_ptr + row)
        d = tl.arange(0, HD)
        ok = pos >= 0
        src = row * stride_kw + h * stride_kh + d
        dst = h.to(tl.int64) * stride_ch + tl.maximum(pos, 0).to(tl.int64) * stride_cs
        sdst = h.to(tl.int64) * stride_sh + tl.maximum(pos, 0).to(tl.int64) * stride_ss
        k = tl.load(k_ptr + src, mask=d < tl.where(ok, HD, 0), other=0.0).to(tl.float32)
        v = tl.load(v_ptr + src, mask=d < tl.where(ok, HD, 0), other=0.0).to(tl.float32)
        _store_row(k, kc_ptr, ks_ptr, dst, sdst, ok, HD, Q8, NB, QB)
        _store_row(v, vc_ptr, vs_ptr, dst, sdst, ok, HD, Q8, NB, QB)

    @triton.jit
    def _l2_prefetch(p, nbytes, PIECES: tl.constexpr):
        """Ask for the nbytes (a multiple of 16, 16-byte aligned) at pointer p in L2: lane 0 of warps 0..PIECES-1
        each one bulk prefetch of a 16-byte multiple piece. One thread a warp: the other lanes hold copies of the
        one-element operands, and a bulk prefetch a lane would ask for the same bytes 32 times."""
        if _ASM:
            piece = ((nbytes + PIECES * 16 - 1) // (PIECES * 16) * 16).to(tl.int32)
            one = tl.full((1,), 0, tl.int32)
            tl.inline_asm_elementwise(
                "{ .reg .pred p, q; .reg .u32 t, w; .reg .s32 o, n; .reg .u64 a; "
                "mov.u32 t, %tid.x; shr.u32 w, t, 5; and.b32 t, t, 31; mul.lo.s32 o, w, $3; "
                "sub.s32 n, $2, o; min.s32 n, n, $3; setp.gt.s32 p, n, 0; setp.eq.u32 q, t, 0; and.pred p, p, q; "
                "setp.lt.u32 q, w, $4; and.pred p, p, q; cvt.u64.u32 a, o; add.u64 a, a, $1; "
                "@p cp.async.bulk.prefetch.L2.global [a], n; mov.u32 $0, 0; }",
                "=r,l,r,r,r", [p.to(tl.pointer_type(tl.int8)) + one, one + nbytes.to(tl.int32), one + piece,
                               one + PIECES], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _n_chunks(n, C0: tl.constexpr, E0: tl.constexpr, C1: tl.constexpr, E1: tl.constexpr, C2: tl.constexpr,
                  E2: tl.constexpr, C3: tl.constexpr):
        """Chunks covering positions 0..n-1 (0 for n <= 0): runtime/kv.py `split_chunks`."""
        n = tl.maximum(n, 0)
        a = (n + C0 - 1) // C0
        b = E0 // C0 + (tl.maximum(n - E0, 0) + C1 - 1) // C1
        c = E0 // C0 + (E1 - E0) // C1 + (tl.maximum(n - E1, 0) + C2 - 1) // C2
        e = E0 // C0 + (E1 - E0) // C1 + (E2 - E1) // C2 + (tl.maximum(n - E2, 0) + C3 - 1) // C3
        return tl.where(n <= E0, a, tl.where(n <= E1, b, tl.where(n <= E2, c, e)))

    @triton.jit
    def _row_chunk(n, T: tl.constexpr, CMIN: tl.constexpr, ND: tl.constexpr):
        """A one-row window's chunk for a row of n positions: the least CMIN * 2^k (k <= ND) with T * it >= n
        (runtime/kv.py `one_row_chunk`)."""
        c = n * 0 + CMIN
        for _ in tl.static_range(ND):
            c = tl.where(c * T < n, c * 2, c)
        return c

    @triton.jit
    def _chunk_lo(c, C0: tl.constexpr, E0: tl.constexpr, C1: tl.constexpr, E1: tl.constexpr, C2: tl.constexpr,
                  E2: tl.constexpr, C3: tl.constexpr):
        """(first position, length) of chunk c."""
        n0 = E0 // C0
        n1 = (E1 - E0) // C1
        n2 = (E2 - E1) // C2
        lo = tl.where(c < n0, c * C0, tl.where(c < n0 + n1, E0 + (c - n0) * C1, tl.where(
            c < n0 + n1 + n2, E1 + (c - n0 - n1) * C2, E2 + (c - n0 - n1 - n2) * C3)))
        size = tl.where(c < n0, C0, tl.where(c < n0 + n1, C1, tl.where(c < n0 + n1 + n2, C2, C3)))
        return lo, size

    @triton.jit
    def _attn_split_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, pos_ptr, acc_ptr, ml_ptr, scale,
                           stride_qw, stride_qh, stride_ch, stride_cs, stride_sh, stride_ss, NC, W,
                           G: tl.constexpr, GP: tl.constexpr, RB: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr,
                           C0: tl.constexpr, E0: tl.constexpr, C1: tl.constexpr, E1: tl.constexpr, C2: tl.constexpr,
                           E2: tl.constexpr, C3: tl.constexpr, Q8: tl.constexpr, NB: tl.constexpr, QB: tl.constexpr,
                           Q8_PF: tl.constexpr = 0, AT: tl.constexpr = 0, AMIN: tl.constexpr = 0,
                           AND: tl.constexpr = 0, CVT: tl.constexpr = 0, EXIT: tl.constexpr = False, PF: tl.constexpr = 0,
                           mark_ptr=None, MARK: tl.constexpr = False, MARK_MAX: tl.constexpr = 0,
                           GDC: tl.constexpr = False):
        """Program (block of RB rows, kv head, first): chunks first, first + step, ... of positions 0..max pos
        of the block's rows; for each, every row's GQA group's unnormalised output, running max and sum, over
        blocks of BS positions in order. A K/V block is read once for all the rows (a verify window reads the
        cache once, not once per row). A row past its own end in a block sees only masked scores: its update is
        the identity (alpha = exp(0) = 1, p = 0), so its bits are those it has alone. EXIT: a program with no
        chunk to compute ends before its PDL wait (the positions are the step's input, written before any kernel
        of the step runs), so the programs of a grid sized for the whole cache cost little at short contexts.
        PF (with EXIT): the first PF positions of the program's first chunk asked into L2 before the wait. MARK
        (with EXIT and GDC): the program marks its SM in pdl's table (runtime/gpu/pdl.py MARK_SMS) before the wait;
        with MARK_MAX > 0 only while at most MARK_MAX programs of the grid work (a short context). AT > 0 (a
        one-row window, RB holding that one row): chunks of `_row_chunk(n, AT, AMIN, AND)` positions from 0, n the
        row's length (runtime/kv.py ONE_ROW_CHUNKS), instead of the tiers."""
        if not EXIT:
            pdl.start(GDC)
        rb = tl.program_id(0)
        kvh = tl.program_id(1)
        first = tl.program_id(2)
        step = tl.num_programs(2)
        nh = tl.num_programs(1) * G
        i = tl.arange(0, RB * GP)
        r = rb * RB + i // GP                          # the tile's lines: RB rows x GP heads
        g = i % GP
        lm = (r < W) & (g < G)
        pos_r = tl.load(pos_ptr + r, mask=r < W, other=-1)
        if AT > 0:
            csz = _row_chunk(tl.max(pos_r, 0) + 1, AT, AMIN, AND)
            nv_r = (tl.maximum(pos_r + 1, 0) + csz - 1) // csz
        else:
            nv_r = _n_chunks(pos_r + 1, C0, E0, C1, E1, C2, E2, C3)   # chunks holding positions 0..pos; 0: padding
        n_valid = tl.max(nv_r, 0)
        if EXIT:
            if first >= n_valid:
                return
            if PF > 0:
                if AT > 0:
                    lo0 = first * csz
                    size0 = csz
                else:
                    lo0, size0 = _chunk_lo(first, C0, E0, C1, E1, C2, E2, C3)
                n_pf = tl.minimum(tl.minimum(lo0 + size0, tl.max(pos_r, 0) + 1) - lo0, PF).to(tl.int64)
                kv0 = kvh.to(tl.int64) * stride_ch + lo0.to(tl.int64) * stride_cs
                eb = k_ptr.dtype.element_ty.primitive_bitwidth // 8
                _l2_prefetch(k_ptr + kv0, n_pf * stride_cs * eb, 4)
                _l2_prefetch(v_ptr + kv0, n_pf * stride_cs * eb, 4)
                if Q8:
                    # 8 bytes a row: from an even position, whole 16-byte pieces
                    sc0 = kvh.to(tl.int64) * stride_sh + (lo0 // 2 * 2).to(tl.int64) * stride_ss
                    n_sc = n_pf * stride_ss * 2 // 16 * 16
                    _l2_prefetch(ks_ptr + sc0, n_sc, 4)
                    _l2_prefetch(vs_ptr + sc0, n_sc, 4)
            if MARK and GDC:
                working = tl.minimum(n_valid, step) * tl.num_programs(1) * tl.num_programs(0)
                tl.store(mark_ptr + pdl.sm_id(GDC), 1, mask=(MARK_MAX == 0) | (working <= MARK_MAX))
            pdl.start(GDC)
        d = tl.arange(0, HD)
        heads = kvh * G + g
        dt = q_ptr.dtype.element_ty
        q = tl.load(q_ptr + r[:, None] * stride_qw + heads[:, None] * stride_qh + d[None, :], mask=lm[:, None],
                    other=0.0)
        base = kvh.to(tl.int64) * stride_ch
        sbase = kvh.to(tl.int64) * stride_sh
        slot0 = (r * nh + heads).to(tl.int64) * NC
        for c in range(first, n_valid, step):
            if AT > 0:
                lo = c * csz
                size = csz
            else:
                lo, size = _chunk_lo(c, C0, E0, C1, E1, C2, E2, C3)
            hi_r = tl.minimum(lo + size, pos_r + 1)    # each line's end in this chunk
            hi = tl.max(hi_r, 0)
            m_i = tl.full((RB * GP,), float("-inf"), dtype=tl.float32)
            l_i = tl.zeros((RB * GP,), dtype=tl.float32)
            acc = tl.zeros((RB * GP, HD), dtype=tl.float32)
            if Q8 and Q8_PF:                       # the chunk's first tile, raw
                s = lo + tl.arange(0, BS)
                kq, ksc = _raw_kv(k_ptr, ks_ptr, base, sbase, s, s < hi, stride_cs, stride_ss, NB, QB)
                vq, vsc = _raw_kv(v_ptr, vs_ptr, base, sbase, s, s < hi, stride_cs, stride_ss, NB, QB)
            for s0 in range(lo, hi, BS):
                s = s0 + tl.arange(0, BS)
                sm = s < hi
                if Q8 and Q8_PF:                   # the next tile's raw words before this tile's arithmetic
                    sn = s + BS
                    kq_, ksc_ = _raw_kv(k_ptr, ks_ptr, base, sbase, sn, sn < hi, stride_cs, stride_ss, NB, QB)
                    vq_, vsc_ = _raw_kv(v_ptr, vs_ptr, base, sbase, sn, sn < hi, stride_cs, stride_ss, NB, QB)
                    k = _deq(kq, ksc, dt, BS, HD, CVT)
                    v = _deq(vq, vsc, dt, BS, HD, CVT)
                    kq, ksc, vq, vsc = kq_, ksc_, vq_, vsc_
                else:
                    k = _load_kv(k_ptr, ks_ptr, base, sbase, s, sm, stride_cs, stride_ss, dt, HD, BS, Q8, NB, QB)
                    v = _load_kv(v_ptr, vs_ptr, base, sbase, s, sm, stride_cs, stride_ss, dt, HD, BS, Q8, NB, QB)
                sc = tl.dot(q, tl.trans(k)) * scale
                sc = tl.where(s[None, :] < hi_r[:, None], sc, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(sc, 1))
                # -inf only on lines with nothing in this chunk (never stored): keep them finite, not NaN
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m_i - m_use)
                p = tl.exp(sc - m_use[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(dt), v)
                m_i = m_new
            slot = slot0 + c
            keep = lm & (c < nv_r)
            tl.store(acc_ptr + slot[:, None] * HD + d[None, :], acc, mask=keep[:, None])
            tl.store(ml_ptr + slot * 2, m_i, mask=keep)
            tl.store(ml_ptr + slot * 2 + 1, l_i, mask=keep)

    @triton.jit
    def _attn_reduce_kernel(acc_ptr, ml_ptr, pos_ptr, o_ptr, NC, stride_ow, stride_oh,
                            HD: tl.constexpr, DB: tl.constexpr, C0: tl.constexpr, E0: tl.constexpr, C1: tl.constexpr,
                            E1: tl.constexpr, C2: tl.constexpr, E2: tl.constexpr, C3: tl.constexpr,
                            NCB: tl.constexpr, AT: tl.constexpr = 0, AMIN: tl.constexpr = 0,
                            AND: tl.constexpr = 0, GDC: tl.constexpr = False):
        """Program (row, head, column block): the row's chunk partials combined for DB output columns. Lane j of
        an NCB-wide tile takes chunks j, j + NCB, ... in order, then the lanes are summed: a fixed order for a
        given position (each column's arithmetic is the same whichever program does it)."""
        pdl.start(GDC)
        row = tl.program_id(0)
        h = tl.program_id(1)
        nh = tl.num_programs(1)
        pos = tl.load(pos_ptr + row)
        if AT > 0:                                     # the split's one-row layout (AT: its chunks a row)
            csz = _row_chunk(pos + 1, AT, AMIN, AND)
            n_valid = (tl.maximum(pos + 1, 0) + csz - 1) // csz
        else:
            n_valid = _n_chunks(pos + 1, C0, E0, C1, E1, C2, E2, C3)
        slot0 = (row * nh + h).to(tl.int64) * NC
        j = tl.arange(0, NCB)
        d = tl.program_id(2) * DB + tl.arange(0, DB)
        mv = tl.full((NCB,), float("-inf"), dtype=tl.float32)
        for c0 in range(0, n_valid, NCB):
            c = c0 + j
            mv = tl.maximum(mv, tl.load(ml_ptr + (slot0 + c) * 2, mask=c < n_valid, other=float("-inf")))
        m_all = tl.max(mv, 0)
        lv = tl.zeros((NCB,), dtype=tl.float32)
        ov = tl.zeros((NCB, DB), dtype=tl.float32)
        for c0 in range(0, n_valid, NCB):
            c = c0 + j
            cm = c < n_valid
            m = tl.load(ml_ptr + (slot0 + c) * 2, mask=cm, other=float("-inf"))
            ll = tl.load(ml_ptr + (slot0 + c) * 2 + 1, mask=cm, other=0.0)
            w = tl.where(cm, tl.exp(m - m_all), 0.0)
            a = tl.load(acc_ptr + (slot0 + c)[:, None] * HD + d[None, :], mask=cm[:, None], other=0.0)
            lv += w * ll
            ov += w[:, None] * a
        den = tl.sum(lv, 0)
        o = tl.sum(ov, 0) / tl.where(den > 0, den, 1.0)
        tl.store(o_ptr + row * stride_ow + h * stride_oh + d, o.to(o_ptr.dtype.element_ty))

    @triton.jit
    def _norm_rope(x, xp, rstd, w, wp, cos, sin, first_half, dt: tl.constexpr):
        """q/k-norm then RoPE of a head vector x (xp: x rotated by HD/2), rounded to `dt` where the module forward
        rounds (runtime/models/layers.py); rstd, w, wp, cos, sin broadcast against x."""
        xn = ((x * rstd).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
        xpn = ((xp * rstd).to(dt).to(tl.float32) * wp).to(dt).to(tl.float32)
        rot = tl.where(first_half, -xpn, xpn)
        return ((xn * cos).to(dt).to(tl.float32) + (rot * sin).to(dt).to(tl.float32)).to(dt)

    @triton.jit
    def _qkv_post_kernel(qkv_ptr, qw_ptr, kw_ptr, inv_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, eps,
                         rscale, stride_qkv, stride_q, stride_ch, stride_cs, stride_sh, stride_ss,
                         NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, Q8: tl.constexpr,
                         NB: tl.constexpr, QB: tl.constexpr, ROPE_OFF: tl.constexpr = 0,
                         GDC: tl.constexpr = False):
        """Row `row`, head h: q/k-norm and RoPE at position pos + ROPE_OFF; k and v written at cache slot pos."""
        pdl.start(GDC)
        row = tl.program_id(0)
        h = tl.program_id(1)                     # 0..NH-1: q heads, NH..NH+NKV-1: k (and v) heads
        pos = tl.load(pos_ptr + row)
        d = tl.arange(0, HD)
        dp = (d + HD // 2) % HD
        if ROPE_OFF == 0:
            f = tl.maximum(pos, 0).to(tl.float32) * tl.load(inv_ptr + d % (HD // 2))
        else:
            f = (tl.maximum(pos, 0) + ROPE_OFF).to(tl.float32) * tl.load(inv_ptr + d % (HD // 2))
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
        out = _norm_rope(x, xp, rstd, w, wp, cos, sin, d < HD // 2, dt)
        tl.store(q_ptr + row * stride_q + h * HD + d, out, mask=d < tl.where(is_q, HD, 0))
        ok = (h >= NH) & (pos >= 0)
        dst = hk.to(tl.int64) * stride_ch + tl.maximum(pos, 0).to(tl.int64) * stride_cs
        sdst = hk.to(tl.int64) * stride_sh + tl.maximum(pos, 0).to(tl.int64) * stride_ss
        _store_row(out.to(tl.float32), kc_ptr, ks_ptr, dst, sdst, ok, HD, Q8, NB, QB)
        v = tl.load(qkv_ptr + row * stride_qkv + (NH + NKV + hk) * HD + d, mask=d < tl.where(ok, HD, 0), other=0.0)
        _store_row(v.to(tl.float32), vc_ptr, vs_ptr, dst, sdst, ok, HD, Q8, NB, QB)

    @triton.jit
    def _qkv_post_rows_kernel(qkv_ptr, qw_ptr, kw_ptr, inv_ptr, pos_ptr, q_ptr, kc_ptr, vc_ptr, W, eps, rscale,
                              stride_qkv, stride_q, stride_ch, stride_cs, NH: tl.constexpr, NKV: tl.constexpr,
                              HD: tl.constexpr, R: tl.constexpr):
        """`_qkv_post_kernel` for R rows a program (prefill chunks, a cache in the compute dtype): the same
        roundings, each row's on its own; R rows' loads in flight at once instead of one row's."""
        rows = tl.program_id(0) * R + tl.arange(0, R)
        h = tl.program_id(1)
        rm = rows < W
        pos = tl.load(pos_ptr + rows, mask=rm, other=-1)
        d = tl.arange(0, HD)
        dp = (d + HD // 2) % HD
        f = tl.maximum(pos, 0).to(tl.float32)[:, None] * tl.load(inv_ptr + d % (HD // 2))[None, :]
        dt = q_ptr.dtype.element_ty
        cos = (tl.cos(f) * rscale).to(dt).to(tl.float32)
        sin = (tl.sin(f) * rscale).to(dt).to(tl.float32)
        is_q = h < NH
        hk = h - NH
        col = tl.where(is_q, h * HD, (NH + hk) * HD)
        r64 = rows.to(tl.int64)[:, None]
        base = qkv_ptr + r64 * stride_qkv + col
        x = tl.load(base + d[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
        xp = tl.load(base + dp[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / HD + eps)
        w = tl.where(is_q, tl.load(qw_ptr + d), tl.load(kw_ptr + d)).to(tl.float32)
        wp = tl.where(is_q, tl.load(qw_ptr + dp), tl.load(kw_ptr + dp)).to(tl.float32)
        out = _norm_rope(x, xp, rstd[:, None], w[None, :], wp[None, :], cos, sin, d[None, :] < HD // 2, dt)
        qm = rm[:, None] & (d[None, :] < tl.where(is_q, HD, 0))
        tl.store(q_ptr + r64 * stride_q + h * HD + d[None, :], out, mask=qm)
        km = (rm & (pos >= 0))[:, None] & (d[None, :] < tl.where(is_q, 0, HD))
        dst = hk.to(tl.int64) * stride_ch + tl.maximum(pos, 0).to(tl.int64)[:, None] * stride_cs + d[None, :]
        tl.store(kc_ptr + dst, out.to(kc_ptr.dtype.element_ty), mask=km)
        v = tl.load(qkv_ptr + r64 * stride_qkv + (NH + NKV + hk) * HD + d[None, :], mask=km, other=0.0)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=km)

    @triton.jit
    def _dequant_kernel(q_ptr, s_ptr, o_ptr, end, stride_qh, stride_qs, stride_sh, stride_ss, stride_oh, stride_os,
                        NB: tl.constexpr, QB: tl.constexpr, BS: tl.constexpr):
        h = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1) * BS + tl.arange(0, BS)
        sm = s < end
        b = tl.arange(0, NB)
        e = tl.arange(0, QB)
        col = b[None, :, None] * QB + e[None, None, :]
        s64 = s[:, None, None].to(tl.int64)
        xq = tl.load(q_ptr + h * stride_qh + s64 * stride_qs + col, mask=sm[:, None, None], other=0)
        sc = tl.load(s_ptr + h * stride_sh + s[:, None].to(tl.int64) * stride_ss + b[None, :], mask=sm[:, None],
                     other=0.0)
        x = xq.to(tl.float32) * sc.to(tl.float32)[:, :, None]
        tl.store(o_ptr + h * stride_oh + s64 * stride_os + col, x.to(o_ptr.dtype.element_ty), mask=sm[:, None, None])


def _q8(kc: Tensor, ks: Tensor | None) -> tuple[bool, int, int, Tensor, int, int]:
    """(is q8_0, NB, QB, scale tensor (a dummy when none), scale head stride, scale position stride)."""
    hd = kc.shape[-1]
    if ks is None:
        return False, 1, 1, kc, 0, 0
    return True, hd // Q8_BLOCK, Q8_BLOCK, ks, ks.stride(0), ks.stride(1)


def kv_write(k: Tensor, v: Tensor, kc: Tensor, vc: Tensor, pos: Tensor, ks: Tensor | None = None,
             vs: Tensor | None = None) -> None:
    """k, v [W, nkv, hd] -> cache kc, vc [nkv, S, hd] at rows `pos` [W] (rows with pos < 0 are skipped); with
    scales ks, vs [nkv, S, hd/32] the cache is q8_0."""
    W, nkv, hd = k.shape
    k, v = k.contiguous(), v.contiguous()
    q8, nb, qb, ksx, ssh, sss = _q8(kc, ks)
    _kv_write_kernel[(W, nkv)](k, v, kc, vc, ksx, vs if q8 else vc, pos, k.stride(0), k.stride(1), kc.stride(0),
                               kc.stride(1), ssh, sss, HD=hd, Q8=q8, NB=nb, QB=qb, **pdl.launch(k))


def split_scratch(rows: int, heads: int, capacity: int, head_dim: int, device: torch.device | str) -> Tensor:
    """The fp32 partials of one `attention` call (runtime/kv.py `split_partials_bytes`), to allocate once."""
    n = rows * heads * partial_chunks(rows, capacity)
    return torch.empty(n * (head_dim + 2), dtype=torch.float32, device=device)


def _kv_prefetch(kc: Tensor, ks: Tensor | None) -> int:
    """SPLIT_KV_PREFETCH where the split kernel can take it: a GPU of compute capability 9.0+, programs that exit
    before their wait, each head's rows contiguous from a 16-byte aligned start, a cache row a 16-byte multiple."""
    if not (SPLIT_KV_PREFETCH and SPLIT_EXIT_EARLY and kc.is_cuda) or torch.cuda.get_device_capability(kc.device)[0] < 9:
        return 0
    for t in [kc] if ks is None else [kc, ks]:
        if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1] or (t.stride(0) * t.element_size()) % 16 \
                or t.data_ptr() % 16:
            return 0
    if kc.stride(-2) * kc.element_size() % 16:
        return 0
    return int(SPLIT_KV_PREFETCH)


def _marks(q: Tensor, o_early: bool) -> dict:
    """The split kernel's SM marks (pdl.MARK_SMS) before an o_proj that loads early, on a CUDA device."""
    if pdl.MARK_SMS and o_early and SPLIT_EXIT_EARLY and q.is_cuda:
        return {"mark_ptr": pdl.sm_marks(q), "MARK": True, "MARK_MAX": int(pdl.MARK_MAX)}
    return {}


def attention(q: Tensor, kc: Tensor, vc: Tensor, pos: Tensor, scale: float, *, ks: Tensor | None = None,
              vs: Tensor | None = None, part: Tensor | None = None, chunk: int | None = None,
              tiers: tuple[int, ...] | None = None, o_early: bool = False) -> Tensor:
    """q [W, nh, hd] against cache kc, vc [nkv, S, hd] (q8_0 with scales ks, vs); row r sees cache rows
    0..pos[r] (pos < 0: zeros). `part`: preallocated partials (`split_scratch`), else allocated here. `chunk` (one
    chunk size everywhere) or `tiers` other than KV_TIERS are for checks only (chunk >= S is no split). `o_early`:
    the kernel after this call loads its weights before its PDL wait (a one-step o_proj product), so the two
    kernels launch as the PDL parts "attention:o_early" and "attention_reduce:o_early" (runtime/gpu/pdl.py)."""
    W, nh, hd = q.shape
    nkv, S = kc.shape[0], kc.shape[1]
    G = nh // nkv
    q = q.contiguous()
    q8, nb, qb, ksx, ssh, sss = _q8(kc, ks)
    # a one-row window takes the layout of its row's length (runtime/kv.py ONE_ROW_CHUNKS; over a q8_0 cache
    # ONE_ROW_CHUNKS_Q8, by default none: the tiers) unless a check names a layout
    lay = kv_layout.ONE_ROW_CHUNKS_Q8 if q8 else kv_layout.ONE_ROW_CHUNKS
    one = W == 1 and chunk is None and tiers is None and lay is not None
    tiers = tiers4(uniform_tiers(chunk) if chunk is not None else tiers)
    c0, e0, c1, e1, c2, e2, c3 = tiers
    ad = {}
    if one:
        at, amin, amax = one_row_layout(lay)
        ad = {"AT": at, "AMIN": amin, "AND": (amax // amin).bit_length() - 1}
    nc = one_row_chunks(S, lay) if one else split_chunks(S, tiers)
    n_acc = W * nh * nc * hd
    need = n_acc + W * nh * nc * 2
    if part is None:
        part = torch.empty(need, dtype=torch.float32, device=q.device)
    elif part.numel() < need:
        raise ValueError(f"attention partials hold {part.numel()} floats, {need} needed.")
    acc, ml = part[:n_acc], part[n_acc:need]
    t = SPLIT_TILE_Q8 if q8 else SPLIT_TILE
    BS = t["BS"] if hd <= 128 else min(t["BS"], 32)
    gp = pow2(G)
    rb = row_block(gp, W, q8)
    # a register cap: the tile's "maxnreg" (benchmarks), else SPLIT_ONE_Q8_REGS for a one-row q8_0 window
    cap = t.get("maxnreg") or (SPLIT_ONE_Q8_REGS if q8 and W == 1 else 0)
    regs = {"maxnreg": cap} if cap else {}
    blocks = -(-W // rb)
    _attn_split_kernel[(blocks, nkv, split_programs(blocks, nkv, nc, q.device))](
        q, kc, vc, ksx, vs if q8 else vc, pos, acc, ml, float(scale), q.stride(0), q.stride(1), kc.stride(0),
        kc.stride(1), ssh, sss, nc, W, G=G, GP=gp, RB=rb, HD=hd, BS=BS, C0=c0, E0=e0, C1=c1, E1=e1, C2=c2, E2=e2,
        C3=c3, Q8=q8, NB=nb, QB=qb, **ad, Q8_PF=Q8_PREFETCH if q8 else 0, CVT=Q8_CVT if q8 else 0, EXIT=SPLIT_EXIT_EARLY,
        PF=_kv_prefetch(kc, ks), **_marks(q, o_early), num_warps=t["num_warps"],
        num_stages=t["num_stages"], **regs, **pdl.launch(q, "attention:o_early" if o_early else "attention"))
    o = torch.empty_like(q)
    db = 32 if hd % 32 == 0 else hd
    _attn_reduce_kernel[(W, nh, hd // db)](acc, ml, pos, o, nc, o.stride(0), o.stride(1), HD=hd, DB=db, C0=c0, E0=e0,
                                           C1=c1, E1=e1, C2=c2, E2=e2, C3=c3, NCB=REDUCE_TILE, **ad, num_warps=2,
                                           **pdl.launch(q, "attention_reduce:o_early" if o_early else
                                                        "attention_reduce"))
    return o


def qkv_post(qkv: Tensor, q_w: Tensor, k_w: Tensor, inv_freq: Tensor, rope_scale: float, pos: Tensor,
             kc: Tensor, vc: Tensor, nh: int, nkv: int, hd: int, eps: float, ks: Tensor | None = None,
             vs: Tensor | None = None, rope_off: int = 0) -> Tensor:
    """qkv [W, (nh+2nkv)*hd] -> q [W, nh, hd] (q_norm + RoPE); k (k_norm + RoPE) and v written to the cache
    (q8_0 with scales ks, vs) at slots pos. RoPE at position pos + rope_off (an MTP head's slot s holds position
    s + 1)."""
    W = qkv.shape[0]
    q = torch.empty(W, nh, hd, dtype=qkv.dtype, device=qkv.device)
    q8, nb, qb, ksx, ssh, sss = _q8(kc, ks)
    if W > POST_ROWS_FROM and not q8 and not rope_off:     # a prefill chunk: R rows a program
        R = POST_ROWS
        _qkv_post_rows_kernel[(triton.cdiv(W, R), nh + nkv)](
            qkv, q_w, k_w, inv_freq, pos, q, kc, vc, W, float(eps), float(rope_scale), qkv.stride(0), q.stride(0),
            kc.stride(0), kc.stride(1), NH=nh, NKV=nkv, HD=hd, R=R, **FMA)
        return q
    _qkv_post_kernel[(W, nh + nkv)](qkv, q_w, k_w, inv_freq, pos, q, kc, vc, ksx, vs if q8 else vc, float(eps),
                                    float(rope_scale), qkv.stride(0), q.stride(0), kc.stride(0), kc.stride(1),
                                    ssh, sss, NH=nh, NKV=nkv, HD=hd, Q8=q8, NB=nb, QB=qb, ROPE_OFF=int(rope_off),
                                    **pdl.launch(qkv, "post"))
    return q


def dequant_q8(qc: Tensor, sc: Tensor, out: Tensor) -> Tensor:
    """A q8_0 cache's first out.shape[1] rows: qc [nkv, S, hd] int8, sc [nkv, S, hd/32] -> out [nkv, n, hd]."""
    nkv, n, hd = out.shape
    BS = 64
    _dequant_kernel[(nkv, triton.cdiv(n, BS))](qc, sc, out, n, qc.stride(0), qc.stride(1), sc.stride(0), sc.stride(1),
                                               out.stride(0), out.stride(1), NB=hd // Q8_BLOCK, QB=Q8_BLOCK, BS=BS,
                                               **FMA)
    return out
