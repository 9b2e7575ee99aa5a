"""The MoE half of a one-row decode step in one persistent launch (float or Q8_0 / Q4_0 / IQ4_NL experts, every
expert resident): residual
add + RMSNorm + router product, then the top-k routing, the experts' gate/up rows and their down rows summed in
top-k order + the residual, where the shipped path takes four launches (`dense_kernels.norm_one_row`,
`moe_kernels.route`, `moe_gemv.up`, `moe_gemv.down_sum`).

The grid is as many programs as can be resident at once (`_programs`), and the phases meet at two grid-wide
barriers (an atomic counter in global memory): after the router logits and after the gated activations. What a
launch boundary costs inside a CUDA graph (the previous kernel's tail, the next one's ramp) is paid twice instead of
four times, every program picks the top k itself from the 128 logits (no one-program routing kernel between two
products), and each program loads its first down tile (its experts are known once it has routed) before the second
barrier, so those bytes move while the slowest program still computes its gate/up rows. docs/models.md, "The
one-row MoE in one launch", has the design and its timing on an H200: slower than the four launches at every tile, so `ENABLED` is off.

Arithmetic and roundings are the four kernels': x + d rounded to the compute dtype, the RMSNorm of
`_rmsnorm_kernel`, logits rounded to the compute dtype, fp32 softmax and top-k (lowest id first on ties), SiLU(gate)
* up rounded, each pair's down row times its routing weight in fp32, summed in top-k order, rounded, plus the
residual. Sums over a row may be reduced in another order than there.

The Triton interpreter runs a grid's programs one after another, so a barrier would wait forever: there the three
phases are three launches of the same kernel (`FIRST`/`LAST`), which is what the CPU tests check.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from runtime.gpu import kernels, moe_gemv, pdl
from runtime.gpu.kernels import HAVE_TRITON

# programs per SM (at most), warps, gate/up rows and down rows per work item, pipeline stages of the phase-2 and
# phase-3 loops, the first down tile before the barrier: chosen from the compiled kernel's registers, not yet timed
# (docs/models.md, "The one-row MoE in one launch"; bench/moe_row.py times the candidates)
TILE = {"PPS": 2, "num_warps": 8, "RU": 4, "RD": 2, "ST2": 3, "ST3": 2, "PRE3": 1}
# 32-value block experts: 4 warps (Triton 3.6: about 137 registers, so three programs an SM), 4 rows an item
QTILE = {"PPS": 4, "num_warps": 4, "RU": 4, "RD": 4, "ST2": 1, "ST3": 1, "PRE3": 0}
BLOCK_FORMATS = ("q8_0", "q4_0", "iq4_nl")      # the block formats `_qrow` reads

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from runtime.gpu.moe_gemv import _scale, _word1, _xq

    # polls of a barrier before a program gives up and sets the barrier's flag (`moe_row` then runs the variant as
    # three launches): a wrong result once, never a hung GPU
    SPIN_LIMIT = tl.constexpr(1 << 22)

    @triton.jit
    def _grid_sync(bar_ptr, NPROG, SYNC: tl.constexpr):
        """Every program of the grid arrives before any leaves. The counter only grows (one launch adds a multiple
        of NPROG at each barrier), so a program's target is the next multiple of NPROG above its own arrival."""
        if SYNC:
            tl.debug_barrier()        # the program's stores are done before its release
            old = tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu")
            target = (old // NPROG + 1) * NPROG
            cur = old + 1
            n = 0
            while (cur < target) & (n < SPIN_LIMIT):     # plain polls, then one acquire
                cur = tl.load(bar_ptr, volatile=True)
                n += 1
            tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
            tl.atomic_xchg(bar_ptr + 1, 1, mask=cur < target)      # gave up: the caller finds out (`moe_row`)
            tl.debug_barrier()

    @triton.jit
    def _barrier_probe(bar_ptr, out_ptr, NPROG, N: tl.constexpr, GDC: tl.constexpr = False):
        """N grid barriers and nothing else (bench/moe_row.py: what the barriers cost by themselves)."""
        pdl.start(GDC)
        for _ in tl.static_range(N):
            _grid_sync(bar_ptr, NPROG, True)
        tl.store(out_ptr + tl.program_id(0), 1.0)

    @triton.jit
    def _moe_row_kernel(x_ptr, d_ptr, nw_ptr, eps, pos_ptr, wr_ptr, lg_ptr, gu_ptr, dn_ptr, h_ptr, out_ptr, idx_ptr,
                        wt_ptr, bar_ptr, hn_ptr, mg, NPROG, stride_ge, stride_de,
                        QT: tl.constexpr, SWG: tl.constexpr, SWD: tl.constexpr, NBG: tl.constexpr,
                        NBD: tl.constexpr,
                        H: tl.constexpr, HP: tl.constexpr, E: tl.constexpr, EP: tl.constexpr, NI: tl.constexpr,
                        IP: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr, NORM_TOPK: tl.constexpr,
                        RU: tl.constexpr, RD: tl.constexpr, ST2: tl.constexpr, ST3: tl.constexpr,
                        PRE3: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
                        SYNC: tl.constexpr, GDC: tl.constexpr = False):
        p = tl.program_id(0)
        kk = tl.arange(0, HP)
        km = kk < H
        dt = out_ptr.dtype.element_ty
        # ---- phase 1: the router's rows p, p + NPROG, ... (weights never written in a step: loaded before the wait)
        if FIRST <= 1:
            wrow = tl.load(wr_ptr + tl.minimum(p, E - 1).to(tl.int64) * H + kk, mask=kk < tl.where(p < E, H, 0), other=0.0)
        pdl.start(GDC)
        x = tl.load(x_ptr + kk, mask=km, other=0.0)
        x = (x.to(tl.float32) + tl.load(d_ptr + kk, mask=km, other=0.0).to(tl.float32)).to(dt)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / H + eps)
        nw = tl.load(nw_ptr + kk, mask=km, other=0.0).to(tl.float32)
        hv = ((xf * rstd).to(dt).to(tl.float32) * nw).to(dt).to(tl.float32)         # RMSNorm(x + d) * w
        if FIRST <= 1:
            if QT > 0:              # the block products read the normalized row from memory
                tl.store(hn_ptr + kk, hv.to(dt), mask=kk < tl.where(p == 0, H, 0))
            lg = tl.sum(wrow.to(tl.float32) * hv, 0).to(dt).to(tl.float32)
            tl.store(lg_ptr + p, lg, mask=p < E)
            for e in range(p + NPROG, E, NPROG):
                wv = tl.load(wr_ptr + e * H + kk, mask=km, other=0.0)
                tl.store(lg_ptr + e, tl.sum(wv.to(tl.float32) * hv, 0).to(dt).to(tl.float32))
        if FIRST <= 1 and LAST >= 2:
            _grid_sync(bar_ptr, NPROG, SYNC)
        # ---- phase 2: every program routes (softmax, top k), then gate/up items (pair k, rows j0..j0+RU)
        if LAST >= 2:
            ce = tl.arange(0, EP)
            lgv = tl.load(lg_ptr + ce, mask=ce < E, other=float("-inf"), cache_modifier=".cg")
            pr = tl.exp(lgv - tl.max(lgv, 0))
            pr = pr / tl.sum(pr, 0)
            kc = tl.arange(0, KP)
            wt = tl.zeros((KP,), dtype=tl.float32)
            it = tl.zeros((KP,), dtype=tl.int32)
            for j in tl.static_range(TOPK):
                m = tl.max(pr, 0)
                a = tl.min(tl.where(pr == m, ce, EP), 0)
                wt = tl.where(kc == j, m, wt)
                it = tl.where(kc == j, a, it)
                pr = tl.where(ce == a, -1.0, pr)
            if NORM_TOPK:
                wt = wt / tl.sum(tl.where(kc < TOPK, wt, 0.0), 0)
            real = tl.load(pos_ptr) >= 0
            it = tl.where(real & (kc < TOPK), it, E)      # a padding row uses no expert, nor do lanes past k
            tl.store(idx_ptr + kc, it, mask=kc < tl.where(p == 0, TOPK, 0))
            tl.store(wt_ptr + kc, wt, mask=kc < tl.where(p == 0, TOPK, 0))
        if FIRST <= 2 and LAST >= 2:
            _up(gu_ptr, hv, hn_ptr, h_ptr, it, kc, kk, p, NPROG, stride_ge, mg, H, E, NI, TOPK, RU, ST2, QT, SWG, NBG)
        # ---- phase 3: down rows n0..n0+RD of every pair, summed in top-k order, + the residual
        if LAST >= 3:
            if FIRST == 3:          # a launch of its own (the interpreter): the routing as phase 2 stored it
                kc = tl.arange(0, KP)
                it = tl.load(idx_ptr + kc, mask=kc < TOPK, other=E)
                wt = tl.load(wt_ptr + kc, mask=kc < TOPK, other=0.0)
            rd = tl.arange(0, RD)
            NQ: tl.constexpr = (H + RD - 1) // RD
            if QT > 0:
                if FIRST <= 2:
                    _grid_sync(bar_ptr, NPROG, SYNC)
                for q in tl.range(p, NQ, NPROG, num_stages=ST3):
                    acc = tl.zeros((RD,), dtype=tl.float32)
                    for i in tl.static_range(RD):
                        # each group's terms weighted and summed over the pairs in top-k order, then one reduction
                        # a row (the pairs' sums are not rounded apart: no reduction a pair)
                        row = tl.minimum(q * RD + i, H - 1)
                        accg = tl.zeros((NBD * (8 if QT == 1 else 4),), dtype=tl.float32)
                        for j in tl.static_range(TOPK):
                            e = tl.sum(tl.where(kc == j, it, 0), 0)
                            wj = tl.where(e < E, tl.sum(tl.where(kc == j, wt, 0.0), 0), 0.0)
                            wb = dn_ptr + tl.minimum(e, E - 1).to(tl.int64) * stride_de
                            # a pair without an expert (a padding row) adds 0: its h row was never written
                            accg += tl.where(e < E, _qrow(wb + row * SWD, h_ptr + j * NI, NI // 32, mg, QT, NBD) * wj,
                                             0.0)
                        acc = tl.where(rd == i, tl.sum(accg, 0), acc)
                    _store_rows(acc, q * RD + rd, x_ptr, d_ptr, out_ptr, H)
            else:
                ii = tl.arange(0, IP)
                nv = tl.where(it < E, NI, 0)                              # values to read of each pair's rows
                base = dn_ptr + tl.minimum(it, E - 1).to(tl.int64)[:, None, None] * stride_de + ii[None, None, :]
                dm = ii[None, None, :] < nv[:, None, None]
                if PRE3:        # this program's first tile before the barrier (its experts are known)
                    tile = tl.load(base + (tl.minimum(p * RD + rd, H - 1) * NI)[None, :, None], mask=dm, other=0.0)
                if FIRST <= 2:
                    _grid_sync(bar_ptr, NPROG, SYNC)
                hk = tl.load(h_ptr + kc[:, None] * NI + ii[None, :], mask=ii[None, :] < nv[:, None], other=0.0,
                             cache_modifier=".cg")                                                # [KP, IP]
                q0 = p
                if PRE3:
                    _down_rows(tile, hk, wt, kc, p * RD + rd, x_ptr, d_ptr, out_ptr, H, TOPK)
                    q0 = p + NPROG
                for q in tl.range(q0, NQ, NPROG, num_stages=ST3):
                    n = q * RD + rd
                    tile = tl.load(base + (tl.minimum(n, H - 1) * NI)[None, :, None], mask=dm, other=0.0)
                    _down_rows(tile, hk, wt, kc, n, x_ptr, d_ptr, out_ptr, H, TOPK)

    @triton.jit
    def _up(gu_ptr, hv, hn_ptr, h_ptr, it, kc, kk, p, NPROG, stride_ge, mg, H: tl.constexpr, E: tl.constexpr,
            NI: tl.constexpr, TOPK: tl.constexpr, RU: tl.constexpr, ST2: tl.constexpr, QT: tl.constexpr,
            SWG: tl.constexpr, NBG: tl.constexpr):
        """Phase 2: items (pair k, rows j0..j0+RU) of SiLU(gate) * up. Float experts: the normalized row hv in
        registers; 32-value block experts: each row in one pass over its blocks, the row read from hn."""
        dt = h_ptr.dtype.element_ty
        NJ: tl.constexpr = (NI + RU - 1) // RU
        ru = tl.arange(0, RU)
        for t in tl.range(p, TOPK * NJ, NPROG, num_stages=ST2):
            k = t // NJ
            r = (t % NJ) * RU + ru
            e = tl.sum(tl.where(kc == k, it, 0), 0)
            if QT > 0:
                wb = gu_ptr + tl.minimum(e, E - 1).to(tl.int64) * stride_ge
                act = tl.zeros((RU,), dtype=tl.float32)
                for i in tl.static_range(RU):
                    row = tl.minimum((t % NJ) * RU + i, NI - 1)
                    g = tl.sum(_qrow(wb + row * SWG, hn_ptr, H // 32, mg, QT, NBG), 0)
                    u = tl.sum(_qrow(wb + (row + NI) * SWG, hn_ptr, H // 32, mg, QT, NBG), 0)
                    act = tl.where(ru == i, g * tl.sigmoid(g) * u, act)
            else:
                ga = gu_ptr + tl.minimum(e, E - 1).to(tl.int64) * stride_ge + tl.minimum(r, NI - 1)[:, None] * H \
                    + kk[None, :]
                wm = (kk < tl.where(e < E, H, 0))[None, :]
                g = tl.sum(tl.load(ga, mask=wm, other=0.0).to(tl.float32) * hv[None, :], 1)
                u = tl.sum(tl.load(ga + NI * H, mask=wm, other=0.0).to(tl.float32) * hv[None, :], 1)
                act = g * tl.sigmoid(g) * u
            tl.store(h_ptr + k * NI + r, act.to(dt), mask=r < tl.where(e < E, NI, 0))

    @triton.jit
    def _down_rows(tile, hk, wt, kc, n, x_ptr, d_ptr, out_ptr, H, TOPK: tl.constexpr):
        """Rows n of the output: each pair's down rows (tile [KP, RD, IP]) times its activations (hk [KP, IP]) and
        routing weight, summed in top-k order, rounded, plus the residual x + d (rounded as phase 1 rounds it)."""
        y = tl.sum(tile.to(tl.float32) * hk.to(tl.float32)[:, None, :], 2) * wt[:, None]          # [KP, RD]
        acc = tl.zeros(n.shape, dtype=tl.float32)
        for j in tl.static_range(TOPK):
            acc += tl.sum(tl.where((kc == j)[:, None], y, 0.0), 0)
        _store_rows(acc, n, x_ptr, d_ptr, out_ptr, H)

    @triton.jit
    def _store_rows(acc, n, x_ptr, d_ptr, out_ptr, H):
        """out[n] = x + d (rounded as phase 1 rounds it) + the experts' sum acc (rounded)."""
        dt = out_ptr.dtype.element_ty
        xr = (tl.load(x_ptr + n, mask=n < H, other=0.0).to(tl.float32)
              + tl.load(d_ptr + n, mask=n < H, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        tl.store(out_ptr + n, (xr + acc.to(dt).to(tl.float32)).to(dt), mask=n < H)

    @triton.jit
    def _qrow(w, xr, nblk, mg, QT: tl.constexpr, NB: tl.constexpr):
        """One Q8_0 / Q4_0 / IQ4_NL row (16-bit words at w) times the row at xr, in one pass over NB >= nblk blocks
        (a power of two; blocks past nblk read the last one and count 0): [NB x groups] partial sums, a group being
        two code words of a block (moe_gemv `_rows32r`'s groups, with its arithmetic)."""
        W: tl.constexpr = 16 if QT == 1 else 8           # code words a block
        BW: tl.constexpr = 17 if QT == 1 else 9          # words a block
        TPB: tl.constexpr = W // 2                       # groups a block
        g = tl.arange(0, NB * TPB)
        blk = g // TPB
        ok = blk < nblk
        blk = tl.minimum(blk, nblk - 1)
        q = g % TPB
        do = blk * BW
        wq = do + 1 + q
        xo = blk * 32 + 2 * q
        x0, x1, x2, x3 = _xq(xr, xo, xr, 1.0, QT, False)
        y0, y1, y2, y3 = _xq(xr, xo + 2 * TPB, xr, 1.0, QT, False)
        s = _word1(w, wq, mg, x0, x1, x2, x3, QT) + _word1(w, wq + TPB, mg, y0, y1, y2, y3, QT)
        return tl.where(ok, _scale(tl.load(w + do)) * s, 0.0)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _sm(index: int) -> tuple[int, int, int]:
    p = torch.cuda.get_device_properties(index)
    smem = getattr(p, "shared_memory_per_multiprocessor", 0) or 228 * 1024
    return p.multi_processor_count, getattr(p, "regs_per_multiprocessor", 65536) or 65536, smem


_GRID: dict[tuple, int] = {}       # the grid of each (device, compiled variant), checked once
FAILED: set[tuple] = set()          # variants whose barriers gave up on their first run (three launches instead)


def _programs(device: torch.device, kernel, pps: int, warps: int) -> int:
    """The persistent grid: at most pps programs on each SM, and no more than the compiled kernel's registers and
    shared memory let be resident at once (the barriers need every program resident)."""
    sms, regs, smem = _sm(device.index if device.index is not None else torch.cuda.current_device())
    if getattr(kernel, "n_regs", None) is None:      # Triton loads the binary (and learns its registers) lazily
        kernel._init_handles()
    per_warp = -(-max(1, kernel.n_regs) * 32 // 256) * 256          # registers are given a warp 256 at a time
    shared = kernel.metadata.shared
    fit = min(regs // per_warp // warps, 64 // warps, smem // shared if shared else 64)
    return sms * max(1, min(pps, fit))


# whether a one-row step takes this path (`applies`); off: an H200 timed every tile slower than the four launches
# (docs/models.md "The one-row MoE in one launch")
ENABLED = False


def applies(x: Tensor, router_w: Tensor | None, mlp) -> bool:
    """Whether `moe_row` can run this MoE for this window: one row, on a CUDA device (or the interpreter), experts
    stacked in x's dtype or one 32-value block format (Q8_0, Q4_0, IQ4_NL) and every one resident (no slot table,
    offload or miss path), a float router."""
    if not (ENABLED and kernels.available(x) and x.shape[0] == 1 and router_w is not None
            and router_w.is_floating_point() and router_w.is_contiguous() and mlp.gate_up is not None
            and mlp.slot is None and mlp.offload is None and mlp.miss_fn is None
            and mlp.gate_up.is_contiguous() and mlp.down.is_contiguous()):
        return False
    return mlp.gate_up.dtype == x.dtype if mlp.fmt is None else mlp.fmt in BLOCK_FORMATS


def barrier(owner, device: torch.device) -> Barrier:
    """The counter of `owner`'s call site (a layer's MoE), made on first use (the warm-up run before a capture)."""
    bars = owner.__dict__.setdefault("_moe_row_barriers", {})
    if device not in bars:
        bars[device] = Barrier(device)
    return bars[device]


class Barrier:
    """The grid barrier's counter for one call site (a layer): its own int64, never reset (only grows), and a flag
    a program sets when it stopped waiting (SPIN_LIMIT polls: the grid was not all resident)."""

    def __init__(self, device: torch.device) -> None:
        self.count = torch.zeros(2, dtype=torch.int64, device=device)

    def gave_up(self) -> bool:
        return bool(self.count[1].item())


def moe_row(x: Tensor, d: Tensor, norm_w: Tensor, eps: float, router_w: Tensor, pos: Tensor, gate_up: Tensor,
            down: Tensor, top_k: int, norm_topk: bool, bar: Barrier, tile: dict | None = None, split: bool = False,
            fmt: str | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """One row: (x + d + the routed experts of RMSNorm(x + d) * norm_w, expert ids [1, k], routing weights [1, k]).
    x, d [1, H]; router_w [E, H]; gate_up [E, 2I, H]; down [E, H, I] (fmt None: floats of x's dtype; else blocks
    of that format, gate_up [E, 2I, row bytes], down [E, H, row bytes]), all contiguous, every expert resident.
    split: the three phases as three launches (what the interpreter runs; on a GPU, for the benchmark)."""
    cfg = dict(TILE if fmt is None else QTILE, **(tile or {}))
    E, H = router_w.shape
    inter = gate_up.shape[1] // 2
    dev = x.device
    lg = torch.empty(E, dtype=torch.float32, device=dev)
    h = torch.empty(top_k, inter, dtype=x.dtype, device=dev)
    hn = torch.empty(H, dtype=x.dtype, device=dev) if fmt is not None else h
    out = torch.empty_like(x)
    idx = torch.empty(1, top_k, dtype=torch.int32, device=dev)
    wt = torch.empty(1, top_k, dtype=torch.float32, device=dev)
    qt = 0 if fmt is None else moe_gemv.QT[fmt]
    gu, dn = (gate_up, down) if fmt is None else (gate_up.view(torch.int16), down.view(torch.int16))
    meta = dict(QT=qt, SWG=gu.stride(1), SWD=dn.stride(1), NBG=triton.next_power_of_2(max(1, H // 32)),
                NBD=triton.next_power_of_2(max(1, inter // 32)), H=H, HP=triton.next_power_of_2(H), E=E,
                EP=triton.next_power_of_2(E), NI=inter, IP=triton.next_power_of_2(inter), TOPK=top_k,
                KP=max(2, triton.next_power_of_2(top_k)), NORM_TOPK=norm_topk, RU=cfg["RU"], RD=cfg["RD"],
                ST2=cfg["ST2"], ST3=cfg["ST3"], PRE3=bool(cfg["PRE3"]), num_warps=cfg["num_warps"])
    gpu = dev.type == "cuda" and not _interpreted()
    launch = pdl.launch(x) if gpu else {}
    key = (dev, tuple(sorted(meta.items())), tuple(sorted(launch.items())), cfg["PPS"])
    nprog = _GRID.get(key, 4)

    def args() -> tuple:
        return (x, d, norm_w, float(eps), pos, router_w, lg, gu, dn, h, out, idx, wt, bar.count, hn, moe_gemv.MAGIC,
                nprog, gu.stride(0), dn.stride(0))

    def phases() -> tuple[Tensor, Tensor, Tensor]:
        for ph in (1, 2, 3):
            _moe_row_kernel[(nprog,)](*args(), FIRST=ph, LAST=ph, SYNC=False, **meta, **launch)
        return out, idx, wt

    if not gpu or split or key in FAILED:
        return phases()
    if key not in _GRID:            # compile, size the grid from the compiled kernel, run once and check the barriers
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("moe_row's first call on a device must come before a CUDA graph capture.")
        k = _moe_row_kernel.warmup(*args(), FIRST=1, LAST=3, SYNC=True, grid=(1,), **meta, **launch)
        nprog = _programs(dev, k, cfg["PPS"], cfg["num_warps"])
        _moe_row_kernel[(nprog,)](*args(), FIRST=1, LAST=3, SYNC=True, **meta, **launch)
        if bar.gave_up():           # the grid was not all resident: this variant runs as three launches from now on
            FAILED.add(key)
            bar.count.zero_()
            return phases()
        _GRID[key] = nprog
        return out, idx, wt
    _moe_row_kernel[(nprog,)](*args(), FIRST=1, LAST=3, SYNC=True, **meta, **launch)
    return out, idx, wt
