"""The MoE half of a one-row decode step in one persistent launch (float experts, every expert resident): residual
add + RMSNorm + router product, then the top-k routing, the experts' gate/up rows and their down rows summed in
top-k order + the residual, where the shipped path takes four launches (`dense_kernels.norm_one_row`,
`moe_kernels.route`, `moe_gemv.up`, `moe_gemv.down_sum`).

The grid is as many programs as can be resident at once (`programs`), and the phases meet at two grid-wide
barriers (an atomic counter in global memory): after the router logits and after the gated activations. What a
launch boundary costs inside a CUDA graph (the previous kernel's tail, the next one's ramp) is paid twice instead of
four times, every program picks the top k itself from the 128 logits (no one-program routing kernel between two
products), and each program loads its first down tile (its experts are known once it has routed) before the second
barrier, so those bytes move while the slowest program still computes its gate/up rows. docs/models.md, "The
one-row MoE in one launch", has the measurements.

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

from runtime.gpu import pdl
from runtime.gpu.kernels import HAVE_TRITON

# programs per SM, warps, gate/up rows and down rows per work item (H200 / H100 measurements in docs/models.md)
TILE = {"PPS": 2, "num_warps": 8, "RU": 4, "RD": 2, "ST2": 3, "ST3": 2, "PRE3": 1}

if HAVE_TRITON:
    import triton
    import triton.language as tl

    # polls of a barrier before a program gives up (a wrong result, never a hung GPU)
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
            tl.debug_barrier()

    @triton.jit
    def _moe_row_kernel(x_ptr, d_ptr, nw_ptr, eps, pos_ptr, wr_ptr, lg_ptr, gu_ptr, dn_ptr, h_ptr, out_ptr, idx_ptr,
                        wt_ptr, bar_ptr, NPROG, stride_ge, stride_de,
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
            it = tl.where(real, it, E)                    # a padding row uses no expert
            tl.store(idx_ptr + kc, it, mask=kc < tl.where(p == 0, TOPK, 0))
            tl.store(wt_ptr + kc, wt, mask=kc < tl.where(p == 0, TOPK, 0))
        if FIRST <= 2 and LAST >= 2:
            NJ: tl.constexpr = (NI + RU - 1) // RU
            ru = tl.arange(0, RU)
            for t in tl.range(p, TOPK * NJ, NPROG, num_stages=ST2):
                k = t // NJ
                r = (t % NJ) * RU + ru
                e = tl.sum(tl.where(kc == k, it, 0), 0)
                ga = gu_ptr + tl.minimum(e, E - 1).to(tl.int64) * stride_ge + tl.minimum(r, NI - 1)[:, None] * H \
                    + kk[None, :]
                wm = (kk < tl.where(e < E, H, 0))[None, :]
                g = tl.sum(tl.load(ga, mask=wm, other=0.0).to(tl.float32) * hv[None, :], 1)
                u = tl.sum(tl.load(ga + NI * H, mask=wm, other=0.0).to(tl.float32) * hv[None, :], 1)
                tl.store(h_ptr + k * NI + r, (g * tl.sigmoid(g) * u).to(dt), mask=r < NI)
        # ---- phase 3: down rows n0..n0+RD of every pair, summed in top-k order, + the residual
        if LAST >= 3:
            if FIRST == 3:          # a launch of its own (the interpreter): the routing as phase 2 stored it
                kc = tl.arange(0, KP)
                it = tl.load(idx_ptr + kc, mask=kc < TOPK, other=E)
                wt = tl.load(wt_ptr + kc, mask=kc < TOPK, other=0.0)
            ii = tl.arange(0, IP)
            rd = tl.arange(0, RD)
            nv = tl.where(it < E, NI, 0)                                  # values to read of each pair's rows
            base = dn_ptr + tl.minimum(it, E - 1).to(tl.int64)[:, None, None] * stride_de + ii[None, None, :]
            dm = ii[None, None, :] < nv[:, None, None]
            NQ: tl.constexpr = (H + RD - 1) // RD
            if PRE3:        # this program's first tile before the barrier (its experts are known)
                tile = tl.load(base + (tl.minimum(p * RD + rd, H - 1) * NI)[None, :, None], mask=dm, other=0.0)
            if FIRST <= 2:
                _grid_sync(bar_ptr, NPROG, SYNC)
            hk = tl.load(h_ptr + kc[:, None] * NI + ii[None, :], mask=ii[None, :] < nv[:, None], other=0.0,
                         cache_modifier=".cg")                                                    # [KP, IP]
            q0 = p
            if PRE3:
                _down_rows(tile, hk, wt, kc, p * RD + rd, x_ptr, d_ptr, out_ptr, H, TOPK)
                q0 = p + NPROG
            for q in tl.range(q0, NQ, NPROG, num_stages=ST3):
                n = q * RD + rd
                tile = tl.load(base + (tl.minimum(n, H - 1) * NI)[None, :, None], mask=dm, other=0.0)
                _down_rows(tile, hk, wt, kc, n, x_ptr, d_ptr, out_ptr, H, TOPK)

    @triton.jit
    def _down_rows(tile, hk, wt, kc, n, x_ptr, d_ptr, out_ptr, H, TOPK: tl.constexpr):
        """Rows n of the output: each pair's down rows (tile [KP, RD, IP]) times its activations (hk [KP, IP]) and
        routing weight, summed in top-k order, rounded, plus the residual x + d (rounded as phase 1 rounds it)."""
        dt = out_ptr.dtype.element_ty
        y = tl.sum(tile.to(tl.float32) * hk.to(tl.float32)[:, None, :], 2) * wt[:, None]          # [KP, RD]
        acc = tl.zeros(n.shape, dtype=tl.float32)
        for j in tl.static_range(TOPK):
            acc += tl.sum(tl.where((kc == j)[:, None], y, 0.0), 0)
        xr = (tl.load(x_ptr + n, mask=n < H, other=0.0).to(tl.float32)
              + tl.load(d_ptr + n, mask=n < H, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        tl.store(out_ptr + n, (xr + acc.to(dt).to(tl.float32)).to(dt), mask=n < H)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _sm(index: int) -> tuple[int, int, int]:
    p = torch.cuda.get_device_properties(index)
    smem = getattr(p, "shared_memory_per_multiprocessor", 0) or 228 * 1024
    return p.multi_processor_count, getattr(p, "regs_per_multiprocessor", 65536) or 65536, smem


_GRID: dict[tuple, int] = {}


def _programs(device: torch.device, kernel, pps: int, warps: int) -> int:
    """The persistent grid: at most pps programs on each SM, and no more than the compiled kernel's registers and
    shared memory let be resident at once (the barriers need every program resident)."""
    sms, regs, smem = _sm(device.index if device.index is not None else torch.cuda.current_device())
    per_warp = -(-max(1, kernel.n_regs) * 32 // 256) * 256
    fit = min(regs // per_warp // warps, 64 // warps, smem // max(1, kernel.metadata.shared) if kernel.metadata.shared
              else 64)
    return sms * max(1, min(pps, fit))


# whether a one-row step takes this path (`applies`); off until measured faster in the step (docs/models.md)
ENABLED = False


def applies(x: Tensor, router_w: Tensor | None, mlp) -> bool:
    """Whether `moe_row` can run this MoE for this window: one row, on a CUDA device (or the interpreter), float
    experts stacked and every one resident (no slot table, offload or miss path), a float router of x's dtype."""
    return (ENABLED and HAVE_TRITON and x.shape[0] == 1 and (x.is_cuda or _interpreted())
            and router_w is not None and router_w.dtype == x.dtype and mlp.fmt is None
            and mlp.gate_up is not None and mlp.gate_up.dtype == x.dtype and mlp.slot is None
            and mlp.offload is None and mlp.miss_fn is None and mlp.gate_up.is_contiguous()
            and mlp.down.is_contiguous() and router_w.is_contiguous())


def barrier(owner, device: torch.device) -> Barrier:
    """The counter of `owner`'s call site (a layer's MoE), made on first use (the warm-up run before a capture)."""
    bars = owner.__dict__.setdefault("_moe_row_barriers", {})
    if device not in bars:
        bars[device] = Barrier(device)
    return bars[device]


class Barrier:
    """The grid barrier's counter for one call site (a layer): its own int64, never reset (only grows)."""

    def __init__(self, device: torch.device) -> None:
        self.count = torch.zeros(1, dtype=torch.int64, device=device)


def moe_row(x: Tensor, d: Tensor, norm_w: Tensor, eps: float, router_w: Tensor, pos: Tensor, gate_up: Tensor,
            down: Tensor, top_k: int, norm_topk: bool, bar: Barrier, tile: dict | None = None, split: bool = False
            ) -> tuple[Tensor, Tensor, Tensor]:
    """One row: (x + d + the routed experts of RMSNorm(x + d) * norm_w, expert ids [1, k], routing weights [1, k]).
    x, d [1, H]; router_w [E, H]; gate_up [E, 2I, H]; down [E, H, I], all contiguous, every expert resident.
    split: the three phases as three launches (what the interpreter runs; on a GPU, for the benchmark)."""
    cfg = dict(TILE, **(tile or {}))
    E, H = router_w.shape
    inter = gate_up.shape[1] // 2
    dev = x.device
    lg = torch.empty(E, dtype=torch.float32, device=dev)
    h = torch.empty(top_k, inter, dtype=x.dtype, device=dev)
    out = torch.empty_like(x)
    idx = torch.empty(1, top_k, dtype=torch.int32, device=dev)
    wt = torch.empty(1, top_k, dtype=torch.float32, device=dev)
    meta = dict(H=H, HP=triton.next_power_of_2(H), E=E, EP=triton.next_power_of_2(E), NI=inter,
                IP=triton.next_power_of_2(inter), TOPK=top_k, KP=max(2, triton.next_power_of_2(top_k)),
                NORM_TOPK=norm_topk, RU=cfg["RU"], RD=cfg["RD"], ST2=cfg["ST2"], ST3=cfg["ST3"],
                PRE3=bool(cfg["PRE3"]), num_warps=cfg["num_warps"])
    gpu = dev.type == "cuda" and not _interpreted()
    launch = pdl.launch(x) if gpu else {}
    key = (dev, tuple(sorted(meta.items())), tuple(sorted(launch.items())), cfg["PPS"])
    nprog = _GRID.get(key, 4)

    def run(first: int, last: int, sync: bool) -> None:
        _moe_row_kernel[(nprog,)](x, d, norm_w, float(eps), pos, router_w, lg, gate_up, down, h, out, idx, wt,
                                  bar.count, nprog, gate_up.stride(0), down.stride(0), FIRST=first, LAST=last,
                                  SYNC=sync, **meta, **launch)

    if not gpu or split:
        for ph in (1, 2, 3):
            run(ph, ph, False)
        return out, idx, wt
    if key not in _GRID:            # compile, then size the grid from the compiled kernel (never inside a capture)
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("moe_row's first call on a device must come before a CUDA graph capture.")
        k = _moe_row_kernel.warmup(x, d, norm_w, float(eps), pos, router_w, lg, gate_up, down, h, out, idx, wt,
                                   bar.count, nprog, gate_up.stride(0), down.stride(0), FIRST=1, LAST=3, SYNC=True,
                                   grid=(1,), **meta, **launch)
        nprog = _GRID[key] = _programs(dev, k, cfg["PPS"], cfg["num_warps"])
    run(1, 3, True)
    return out, idx, wt
