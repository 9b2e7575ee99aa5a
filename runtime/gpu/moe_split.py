"""One-row expert MLP split over its intermediate dimension (float experts, every expert resident): a program takes
RS intermediate rows of one of the token's top-k pairs, computes their gate and up products, SiLU(gate) * up, and
at once their share of the down product, down[:, rows] @ h[rows], an fp32 partial of the whole output row; a second
kernel sums the partials in a fixed order and adds the residual (docs/models.md, "The expert MLP split over its
intermediate").

Why: the shipped one-row path (`moe_gemv.up`, then `moe_gemv.down_sum`) needs every gated activation of a pair
before any down row can be summed, so the down kernel waits for the whole gate/up grid, and that boundary costs
more than the down bytes themselves on an H200 (docs/models.md, the step's timeline). The down product is a sum over
the intermediate, so each slice's share can be computed as soon as that slice's activations exist: the gate/up
and down bytes stream through one grid with no wait between them, and the only new dependency is the sum of the
partials (TOPK * I / RS rows of H fp32 values). Measured on an H100 the first grid keeps its promise, and with the
partials stored by column blocks the sum takes 5-7 us a layer, but the new boundary costs what the old one did:
the best tile ties the shipped launches in the step, so `TILE` is off until an H200 says otherwise
(docs/models.md has the figures).

Arithmetic: gate and up rows summed in fp32, SiLU(gate) * up rounded to the compute dtype (as the up kernel stores
h), each slice's down share in fp32 times the pair's routing weight, the partials summed in a fixed order (top-k
slot, then slice, as one tile reduction), rounded to the compute dtype and added to the residual, as `down_sum`
rounds. Only a one-row step takes this path and a run keeps one step width, so a row's bits never depend on other
rows (docs/models.md, "Why greedy output stays lossless").
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import Tensor

from runtime.gpu import pdl
from runtime.gpu.kernels import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

# RS: intermediate rows a program (its down share reads RS contiguous values of each of the H down rows: 16 BF16
# values are one 32-byte sector); KC: values of a gate/up row a loop step; BO: down rows a loop step; ST: loop
# pipeline stages; ACC: gate/up products kept lane by lane and reduced once (else once a step); RB: output values a
# summing program; RC: partial rows a summing pass (default all); TAIL: the last TAIL programs to finish sum the
# partials (no second launch; a GPU only); EVL: weights marked to leave L2 first, partials to stay; PP: sorted pairs
# a program (their shares summed in it: PP times fewer partials); CB: partials stored by column blocks of RB
# values (a summing program's reads contiguous); num_warps / sum_warps: the two kernels' warps. H100, the MoE half
# alone (bench/moe_row.py, bench/results/h100_session39/ and h100_session40/): shipped 34.4-34.7 us; s16p3ecr8w8
# 34.4, s16p3ecr4w8 35.3, s16p3ect128 35.4, s16p3cr8w8 36.2, s16p3r4w8 37.5, s16p3 and s32w8p3 38.6, PP tiles 38.8,
# the rest 40.9-53.7; in the step none beats the shipped launches there (docs/models.md)
TILES: dict[str, dict[str, int]] = {
    "s16": {"RS": 16, "KC": 256, "BO": 128, "ST": 1, "RB": 16, "num_warps": 4, "sum_warps": 4},
    "s16p2": {"RS": 16, "KC": 256, "BO": 128, "ST": 2, "RB": 16, "num_warps": 4, "sum_warps": 4},
    "s16p3": {"RS": 16, "KC": 256, "BO": 256, "ST": 3, "RB": 16, "num_warps": 4, "sum_warps": 4},
    "s16w8p2": {"RS": 16, "KC": 512, "BO": 256, "ST": 2, "RB": 16, "num_warps": 8, "sum_warps": 4},
    "s8p2": {"RS": 8, "KC": 512, "BO": 256, "ST": 2, "RB": 16, "num_warps": 4, "sum_warps": 4},
    "s8p3": {"RS": 8, "KC": 512, "BO": 512, "ST": 3, "RB": 16, "num_warps": 4, "sum_warps": 4},
    "s32p2": {"RS": 32, "KC": 128, "BO": 128, "ST": 2, "RB": 16, "num_warps": 4, "sum_warps": 4},
    "s32w8p3": {"RS": 32, "KC": 256, "BO": 128, "ST": 3, "RB": 16, "num_warps": 8, "sum_warps": 4},
    "s16p2a": {"RS": 16, "KC": 256, "BO": 128, "ST": 2, "ACC": 1, "RB": 16, "num_warps": 4, "sum_warps": 4},
    "s8p2a": {"RS": 8, "KC": 512, "BO": 256, "ST": 2, "ACC": 1, "RB": 16, "num_warps": 4, "sum_warps": 4},
    "s16p2t": {"RS": 16, "KC": 256, "BO": 128, "ST": 2, "TAIL": 128, "RB": 16, "num_warps": 4, "sum_warps": 4},
    "s8p2t": {"RS": 8, "KC": 512, "BO": 256, "ST": 2, "TAIL": 128, "RB": 16, "num_warps": 4, "sum_warps": 4},
    "s16p3e": {"RS": 16, "KC": 256, "BO": 256, "ST": 3, "EVL": 1, "RB": 16, "num_warps": 4, "sum_warps": 4},
    "s16p3w8": {"RS": 16, "KC": 256, "BO": 256, "ST": 3, "RB": 16, "num_warps": 4, "sum_warps": 8},
    "s16p3r8": {"RS": 16, "KC": 256, "BO": 256, "ST": 3, "RB": 8, "num_warps": 4, "sum_warps": 4},
    "s16p3ew8": {"RS": 16, "KC": 256, "BO": 256, "ST": 3, "EVL": 1, "RB": 16, "num_warps": 4, "sum_warps": 8},
    "s32w8p3e": {"RS": 32, "KC": 256, "BO": 128, "ST": 3, "EVL": 1, "RB": 16, "num_warps": 8, "sum_warps": 8},
    # the sum with every load of a thread in flight at once (4 or 8 values a thread: 1-2 vector loads; with 16
    # columns on 4 warps ptxas keeps 3 of 16 in flight, sm_90, Triton 3.6)
    "s16p3r4w8": {"RS": 16, "KC": 256, "BO": 256, "ST": 3, "RB": 4, "num_warps": 4, "sum_warps": 8},
    "s16p3r8w8": {"RS": 16, "KC": 256, "BO": 256, "ST": 3, "RB": 8, "num_warps": 4, "sum_warps": 8},
    "s16p3er4w8": {"RS": 16, "KC": 256, "BO": 256, "ST": 3, "EVL": 1, "RB": 4, "num_warps": 4, "sum_warps": 8},
    "s32w8p3r4w8": {"RS": 32, "KC": 256, "BO": 128, "ST": 3, "RB": 4, "num_warps": 8, "sum_warps": 8},
    # PP pairs a program: their down shares summed inside the program, PP times fewer partial rows to sum
    "s16p3g2r4w8": {"RS": 16, "KC": 256, "BO": 128, "ST": 3, "PP": 2, "RB": 4, "num_warps": 4, "sum_warps": 8},
    "s16p3g2w8r4w8": {"RS": 16, "KC": 256, "BO": 128, "ST": 3, "PP": 2, "RB": 4, "num_warps": 8, "sum_warps": 8},
    "s8p3g4r4w8": {"RS": 8, "KC": 256, "BO": 128, "ST": 3, "PP": 4, "RB": 4, "num_warps": 8, "sum_warps": 8},
    # CB: the partials by column blocks, so a summing program reads one contiguous block (whole sectors)
    "s16p3cr4w8": {"RS": 16, "KC": 256, "BO": 256, "ST": 3, "CB": 1, "RB": 4, "num_warps": 4, "sum_warps": 8},
    "s16p3cr8w8": {"RS": 16, "KC": 256, "BO": 256, "ST": 3, "CB": 1, "RB": 8, "num_warps": 4, "sum_warps": 8},
    "s16p3ecr4w8": {"RS": 16, "KC": 256, "BO": 256, "ST": 3, "EVL": 1, "CB": 1, "RB": 4, "num_warps": 4,
                    "sum_warps": 8},
    "s16p3ecr8w8": {"RS": 16, "KC": 256, "BO": 256, "ST": 3, "EVL": 1, "CB": 1, "RB": 8, "num_warps": 4,
                    "sum_warps": 8},
    "s32w8p3cr4w8": {"RS": 32, "KC": 256, "BO": 128, "ST": 3, "CB": 1, "RB": 4, "num_warps": 8, "sum_warps": 8},
    "s16p3g2cr4w8": {"RS": 16, "KC": 256, "BO": 128, "ST": 3, "PP": 2, "CB": 1, "RB": 4, "num_warps": 4,
                     "sum_warps": 8},
    # the sum in the last programs of the partials' launch (TAIL) from column blocks: one launch a MoE half
    "s16p3ect128": {"RS": 16, "KC": 256, "BO": 256, "ST": 3, "EVL": 1, "CB": 1, "TAIL": 128, "RB": 16, "RC": 128,
                    "num_warps": 4, "sum_warps": 4},
    "s16p3ect256": {"RS": 16, "KC": 256, "BO": 256, "ST": 3, "EVL": 1, "CB": 1, "TAIL": 256, "RB": 8, "RC": 128,
                    "num_warps": 4, "sum_warps": 4},
}
# the tile the one-row step takes (runtime/gpu/moe_kernels.py `moe_routed`), or None: the shipped two launches.
# Off until timed in the step (bench/step_ab.py arms ffn-*); STRATA_MOE_SPLIT=<a key of TILES> turns it on for a
# run (the benchmarks' switch)
TILE: dict[str, int] | None = TILES.get(os.environ.get("STRATA_MOE_SPLIT", ""))
if os.environ.get("STRATA_MOE_SPLIT") and TILE is None:
    warnings.warn(f"STRATA_MOE_SPLIT={os.environ['STRATA_MOE_SPLIT']!r} names no tile of the split experts; the "
                  f"split stays off (tiles: {', '.join(TILES)}).", stacklevel=1)

if HAVE_TRITON:
    # polls of the arrival counter before a TAIL program gives up and sets the counter's flag (`gave_up`)
    SPIN_LIMIT = tl.constexpr(1 << 22)

    @triton.jit
    def _part_kernel(x_ptr, se_ptr, ord_ptr, wt_ptr, gu_ptr, dw_ptr, p_ptr, res_ptr, o_ptr, ctr_ptr, E, NS, NP, R,
                     stride_ge, stride_de,
                     H: tl.constexpr, NI: tl.constexpr, SG: tl.constexpr, SD: tl.constexpr, RS: tl.constexpr,
                     KC: tl.constexpr, BO: tl.constexpr, ST: tl.constexpr, ACC: tl.constexpr = False,
                     TAIL: tl.constexpr = 0, RC: tl.constexpr = 64, EVL: tl.constexpr = False,
                     PP: tl.constexpr = 1, RB: tl.constexpr = 16, CB: tl.constexpr = False,
                     GDC: tl.constexpr = False):
        """Program q: slice s = q % NS (intermediate rows s*RS..) of sorted pair q // NS (of PP pairs from
        PP * (q // NS) when PP > 1); writes the fp32 row wt * down[e][:, slice] @ h[slice] (summed over the PP
        pairs) at partial row (top-k slot) * NS + s (group * NS + s). The routing is the previous
        kernel's output, so the program waits before anything. EVL: the weights (read once a step) marked to
        leave L2 first and the partials to stay, so the sum reads them from L2. TAIL > 0 (a GPU only): the last
        TAIL programs to finish sum the R partial rows, H / TAIL output values each, once every program has
        stored its row (an arrival counter), so no second launch is needed. CB: the partials stored by column
        blocks (`_prow`)."""
        pdl.start(GDC)
        q = tl.program_id(0)
        if PP == 1:
            _part_one(q, x_ptr, se_ptr, ord_ptr, wt_ptr, gu_ptr, dw_ptr, p_ptr, E, NS, R, stride_ge, stride_de, H,
                      NI, SG, SD, RS, KC, BO, ST, ACC, EVL, RB, CB)
        else:
            _part_group(q, x_ptr, se_ptr, ord_ptr, wt_ptr, gu_ptr, dw_ptr, p_ptr, E, NS, NP, R, stride_ge,
                        stride_de, H, NI, SG, SD, RS, KC, BO, ST, PP, EVL, RB, CB)
        if TAIL > 0:
            # the counter only grows (each launch adds NPROG), so a program's launch ends at the next multiple of
            # NPROG above its own arrival; the last TAIL arrivals wait for it. Every program is resident by then
            # (later arrivals run or wait, and waiting programs hold at most TAIL slots), so the wait ends
            tl.debug_barrier()                       # this program's stores are done before its arrival
            nprog = tl.num_programs(0)
            old = tl.atomic_add(ctr_ptr, 1, sem="acq_rel", scope="gpu")
            slot = old % nprog
            if slot >= nprog - TAIL:
                target = (old // nprog + 1) * nprog
                cur = old + 1
                polls = 0
                while (cur < target) & (polls < SPIN_LIMIT):
                    cur = tl.load(ctr_ptr, volatile=True)
                    polls += 1
                tl.atomic_add(ctr_ptr, 0, sem="acquire", scope="gpu")
                tl.atomic_xchg(ctr_ptr + 1, 1, mask=cur < target)         # gave up: `gave_up` tells
                tl.debug_barrier()                   # every thread's loads after the acquire
                cols = (slot - (nprog - TAIL)) * (H // TAIL) + tl.arange(0, H // TAIL)
                _sum_from(p_ptr, res_ptr, o_ptr, R, cols, H, RC, RB, CB, True)

    @triton.jit
    def _part_one(q, x_ptr, se_ptr, ord_ptr, wt_ptr, gu_ptr, dw_ptr, p_ptr, E, NS, R, stride_ge, stride_de,
                  H: tl.constexpr, NI: tl.constexpr, SG: tl.constexpr, SD: tl.constexpr, RS: tl.constexpr,
                  KC: tl.constexpr, BO: tl.constexpr, ST: tl.constexpr, ACC: tl.constexpr, EVL: tl.constexpr,
                  RB: tl.constexpr, CB: tl.constexpr):
        """One pair's slice (`_part_kernel`, PP 1): partial row (top-k slot) * NS + s."""
        p = q // NS
        s = q - p * NS
        e = tl.load(se_ptr + p)
        dst = tl.load(ord_ptr + p)
        wt = tl.load(wt_ptr + dst).to(tl.float32)
        ok = e < E                                   # a padding pair (never in a one-row step) adds zeros
        eb = tl.where(ok, e, 0).to(tl.int64)
        r, rr = _slice_rows(s, NI, RS)
        kk = tl.arange(0, KC)
        gp = gu_ptr + eb * stride_ge + (rr * SG)[:, None] + kk[None, :]
        if ACC:                                      # products summed lane by lane, one reduction at the end
            tg = tl.zeros((RS, KC), dtype=tl.float32)
            tu = tl.zeros((RS, KC), dtype=tl.float32)
            for k0 in tl.range(0, H, KC, num_stages=ST):
                xv = tl.load(x_ptr + k0 + kk).to(tl.float32)[None, :]
                tg += _wload(gp + k0, EVL).to(tl.float32) * xv
                tu += _wload(gp + NI * SG + k0, EVL).to(tl.float32) * xv
            ag = tl.sum(tg, 1)
            au = tl.sum(tu, 1)
        else:                                        # one reduction a loop step
            ag = tl.zeros((RS,), dtype=tl.float32)
            au = tl.zeros((RS,), dtype=tl.float32)
            for k0 in tl.range(0, H, KC, num_stages=ST):
                xv = tl.load(x_ptr + k0 + kk).to(tl.float32)[None, :]
                ag += tl.sum(_wload(gp + k0, EVL).to(tl.float32) * xv, 1)
                au += tl.sum(_wload(gp + NI * SG + k0, EVL).to(tl.float32) * xv, 1)
        h = (ag * tl.sigmoid(ag) * au).to(x_ptr.dtype.element_ty).to(tl.float32)
        h = tl.where((r < NI) & ok, h, 0.0)
        nn = tl.arange(0, BO)
        dp = dw_ptr + eb * stride_de + (nn * SD)[:, None] + rr[None, :]
        for n0 in tl.range(0, H, BO, num_stages=ST):
            wd = _wload(dp + n0 * SD, EVL).to(tl.float32)
            _pstore(_prow(p_ptr, dst * NS + s, n0 + nn, R, H, RB, CB), tl.sum(wd * h[None, :], 1) * wt, EVL)

    @triton.jit
    def _part_group(q, x_ptr, se_ptr, ord_ptr, wt_ptr, gu_ptr, dw_ptr, p_ptr, E, NS, NP, R, stride_ge, stride_de,
                    H: tl.constexpr, NI: tl.constexpr, SG: tl.constexpr, SD: tl.constexpr, RS: tl.constexpr,
                    KC: tl.constexpr, BO: tl.constexpr, ST: tl.constexpr, PP: tl.constexpr, EVL: tl.constexpr,
                    RB: tl.constexpr, CB: tl.constexpr):
        """The slice of PP sorted pairs at once (`_part_kernel`, PP > 1): their gate/up rows as one [PP, RS, KC]
        tile a step, their down shares summed over the pairs inside the tile reduction, one partial row
        (group * NS + s) for the PP pairs: PP times fewer partials to sum."""
        g = q // NS
        s = q - g * NS
        pi = g * PP + tl.arange(0, PP)               # sorted pairs; past the last one: padding
        e = tl.load(se_ptr + pi, mask=pi < NP, other=E)
        dst = tl.load(ord_ptr + pi, mask=pi < NP, other=0)
        wt = tl.load(wt_ptr + dst, mask=pi < NP, other=0.0).to(tl.float32)
        ok = e < E
        eb = tl.where(ok, e, 0).to(tl.int64)
        r, rr = _slice_rows(s, NI, RS)
        kk = tl.arange(0, KC)
        gp = gu_ptr + (eb * stride_ge)[:, None, None] + (rr * SG)[None, :, None] + kk[None, None, :]
        ag = tl.zeros((PP, RS), dtype=tl.float32)
        au = tl.zeros((PP, RS), dtype=tl.float32)
        for k0 in tl.range(0, H, KC, num_stages=ST):
            xv = tl.load(x_ptr + k0 + kk).to(tl.float32)[None, None, :]
            ag += tl.sum(_wload(gp + k0, EVL).to(tl.float32) * xv, 2)
            au += tl.sum(_wload(gp + NI * SG + k0, EVL).to(tl.float32) * xv, 2)
        h = (ag * tl.sigmoid(ag) * au).to(x_ptr.dtype.element_ty).to(tl.float32)
        h = tl.where((r < NI)[None, :] & ok[:, None], h, 0.0) * wt[:, None]      # [PP, RS], weighted
        nn = tl.arange(0, BO)
        dp = dw_ptr + (eb * stride_de)[:, None, None] + (nn * SD)[None, :, None] + rr[None, None, :]
        for n0 in tl.range(0, H, BO, num_stages=ST):
            wd = _wload(dp + n0 * SD, EVL).to(tl.float32)
            _pstore(_prow(p_ptr, g * NS + s, n0 + nn, R, H, RB, CB), tl.sum(tl.sum(wd * h[:, None, :], 2), 0), EVL)

    @triton.jit
    def _slice_rows(s, NI: tl.constexpr, RS: tl.constexpr):
        """(rows s*RS.. of the intermediate, the rows to read): the same where RS divides NI (contiguous, so the
        down loads are vectors of RS values), else rows past NI read row NI - 1 (their activation is 0)."""
        r = s * RS + tl.arange(0, RS)
        if NI % RS == 0:
            return r, r
        return r, tl.minimum(r, NI - 1)

    @triton.jit
    def _prow(p_ptr, row, n, R, H: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr):
        """Where partial row `row`'s values n lie: rows of H values one after another, or with CB by column
        blocks ([H / RB, R, RB]: the R rows' RB values a summing program reads lie together, so its loads are
        whole sectors, not RB values of each of R rows H values apart)."""
        if CB:
            return p_ptr + (n // RB).to(tl.int64) * R * RB + row * RB + n % RB
        return p_ptr + row.to(tl.int64) * H + n

    @triton.jit
    def _pstore(ptr, y, EVL: tl.constexpr):
        """A partial row's store; EVL: its lines marked to stay in L2 for the sum."""
        if EVL:
            tl.store(ptr, y, eviction_policy="evict_last")
        else:
            tl.store(ptr, y)

    @triton.jit
    def _wload(ptr, EVL: tl.constexpr):
        """A weight tile's load; EVL: its lines marked to leave L2 first."""
        if EVL:
            return tl.load(ptr, eviction_policy="evict_first")
        return tl.load(ptr)

    @triton.jit
    def _sum_cols(pc, rstride, res_ptr, o_ptr, R, n, RC: tl.constexpr, CG: tl.constexpr):
        """Output values n: the residual plus the sum of the R partial rows (RC rows a tile reduction, the tiles
        in order: a fixed order), rounded to the output dtype first, as `down_sum` rounds. pc: the values of
        partial row 0, rows rstride values apart. CG: loads bypass L1 (rows other programs of this launch
        stored)."""
        j = tl.arange(0, RC)
        acc = tl.zeros(n.shape, dtype=tl.float32)
        for j0 in range(0, R, RC):
            rows = j0 + j
            ptr = pc[None, :] + (rows * rstride)[:, None]
            if CG:
                t = tl.load(ptr, mask=(rows < R)[:, None], other=0.0, cache_modifier=".cg")
            else:
                t = tl.load(ptr, mask=(rows < R)[:, None], other=0.0)
            acc += tl.sum(t, 0)
        dt = o_ptr.dtype.element_ty
        x = tl.load(res_ptr + n).to(tl.float32)
        tl.store(o_ptr + n, (x + acc.to(dt).to(tl.float32)).to(dt))

    @triton.jit
    def _sum_kernel(p_ptr, res_ptr, o_ptr, R, H: tl.constexpr, RC: tl.constexpr, RB: tl.constexpr,
                    CB: tl.constexpr = False, GDC: tl.constexpr = False):
        """Output values nb*RB.. (`_sum_cols`), after the partials' launch; CB: from their column block."""
        pdl.start(GDC)
        _sum_from(p_ptr, res_ptr, o_ptr, R, tl.program_id(0) * RB + tl.arange(0, RB), H, RC, RB, CB, False)

    @triton.jit
    def _sum_from(p_ptr, res_ptr, o_ptr, R, n, H: tl.constexpr, RC: tl.constexpr, RB: tl.constexpr,
                  CB: tl.constexpr, CG: tl.constexpr):
        """`_sum_cols` of output values n from the partials laid out as `_prow` stores them."""
        if CB:
            _sum_cols(p_ptr + (n // RB).to(tl.int64) * R * RB + n % RB, RB, res_ptr, o_ptr, R, n, RC, CG)
        else:
            _sum_cols(p_ptr + n, H, res_ptr, o_ptr, R, n, RC, CG)


def fits(gate_up: Tensor, tile: dict[str, int]) -> bool:
    """Whether the tile's loop steps divide the experts' rows (H values of gate/up, H down rows, H outputs)."""
    H = gate_up.shape[2]
    return all(H % tile[k] == 0 for k in ("KC", "BO", "RB"))


def ffn_row(x: Tensor, se: Tensor, order: Tensor, wf: Tensor, gate_up: Tensor, down: Tensor, residual: Tensor,
            top_k: int, tile: dict[str, int]) -> Tensor:
    """residual [1, H] + the sum over the token's top-k pairs of w * down(SiLU(gate) * up) for one row x [1, H]
    (normalized), float experts gate_up [E, 2I, H], down [E, H, I], every expert resident; se / order / wf: the
    sorted routing of runtime/gpu/moe_kernels.py `group`. Two launches, or one with the tile's TAIL on a GPU
    (module docstring)."""
    E, two_i, H = gate_up.shape
    inter = two_i // 2
    if not fits(gate_up, tile) or gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError(f"the split expert MLP needs contiguous rows whose {H} values its tile {tile} divides.")
    ns = triton.cdiv(inter, tile["RS"])
    pp = tile.get("PP", 1)
    rows = triton.cdiv(se.numel(), pp) * ns
    rc = min(tile.get("RC", rows), rows)
    rc = triton.next_power_of_2(rc)
    # the interpreter runs programs one after another, where a waiting program would wait forever
    tail = tile.get("TAIL", 0) if x.is_cuda else 0
    if tail and (H % tail or tail > rows):
        raise ValueError(f"the split expert MLP's TAIL {tail} must divide the row's {H} values and be at most its "
                         f"{rows} programs.")
    cb = bool(tile.get("CB"))
    part = torch.empty(rows, H, dtype=torch.float32, device=x.device)
    out = torch.empty_like(residual)
    ctr = _counter(x.device, rows) if tail else part
    _part_kernel[(rows,)](x.contiguous(), se, order, wf, gate_up, down, part, residual, out, ctr, E, ns,
                          se.numel(), rows, gate_up.stride(0), down.stride(0), H=H, NI=inter, SG=gate_up.stride(1),
                          SD=down.stride(1), RS=tile["RS"], KC=tile["KC"], BO=tile["BO"], ST=tile["ST"],
                          ACC=bool(tile.get("ACC")), TAIL=tail, RC=rc, EVL=bool(tile.get("EVL")), PP=pp,
                          RB=tile["RB"], CB=cb, num_warps=tile["num_warps"], **pdl.launch(down))
    if not tail:
        _sum_kernel[(H // tile["RB"],)](part, residual, out, rows, H=H, RC=rc, RB=tile["RB"], CB=cb,
                                        num_warps=tile["sum_warps"], **pdl.launch(down))
    return out


_COUNTERS: dict[tuple[str, int], Tensor] = {}


def _counter(device: torch.device, nprog: int) -> Tensor:
    """The arrival counter of TAIL launches of nprog programs on a device: an int64 that only grows, and a flag a
    program sets when it stopped waiting. One per grid size: launches of one size never overlap (each waits for the
    routing of its own layer, after the previous layer's experts), and each adds nprog."""
    key = (str(device), nprog)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(2, dtype=torch.int64, device=device)
    return _COUNTERS[key]


def gave_up() -> bool:
    """Whether a TAIL program ever stopped waiting (SPIN_LIMIT polls): its outputs were then wrong (the
    benchmarks check)."""
    return any(bool(c[1].item()) for c in _COUNTERS.values())
