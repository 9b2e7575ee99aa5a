"""One-row expert MLP split over its intermediate dimension (float experts, every expert resident): a program takes
RS intermediate rows of one of the token's top-k pairs, computes their gate and up products, SiLU(gate) * up, and
at once their share of the down product, down[:, rows] @ h[rows], an fp32 partial of the whole output row; a second
kernel sums the partials in a fixed order and adds the residual (docs/models.md, "The expert MLP split over its
intermediate").

Why: the shipped one-row path (`moe_gemv.up`, then `moe_gemv.down_sum`) needs every gated activation of a pair
before any down row can be summed, so the down kernel waits for the whole gate/up grid, and that boundary costs
more than the down bytes themselves on an H200 (docs/models.md, the step's timeline). The down product is a sum over
the intermediate, so each slice's share can be computed as soon as that slice's activations exist: the gate/up
and down bytes stream through one grid with no wait between them, and the only new dependency is the small sum of
partials (TOPK * I / RS rows of H fp32 values, read from L2).

Arithmetic: gate and up rows summed in fp32, SiLU(gate) * up rounded to the compute dtype (as the up kernel stores
h), each slice's down share in fp32 times the pair's routing weight, the partials summed in a fixed order (top-k
slot, then slice, as one tile reduction), rounded to the compute dtype and added to the residual, as `down_sum`
rounds. Only a one-row step takes this path and a run keeps one step width, so a row's bits never depend on other
rows (docs/models.md, "Why greedy output stays lossless").
"""

from __future__ import annotations

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
# summing program; num_warps / sum_warps: the two kernels' warps
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
}
# the tile the one-row step takes (runtime/gpu/moe_kernels.py `moe_routed`), or None: the shipped two launches.
# Off until timed in the step (bench/step_ab.py arms split-*)
TILE: dict[str, int] | None = None

if HAVE_TRITON:

    @triton.jit
    def _part_kernel(x_ptr, se_ptr, ord_ptr, wt_ptr, gu_ptr, dw_ptr, p_ptr, E, NS, stride_ge, stride_de,
                     H: tl.constexpr, NI: tl.constexpr, SG: tl.constexpr, SD: tl.constexpr, RS: tl.constexpr,
                     KC: tl.constexpr, BO: tl.constexpr, ST: tl.constexpr, ACC: tl.constexpr = False,
                     GDC: tl.constexpr = False):
        """Program q: slice s = q % NS (intermediate rows s*RS..) of sorted pair q // NS; writes the fp32 row
        wt * down[e][:, slice] @ h[slice] at partial row (top-k slot) * NS + s. The routing is the previous
        kernel's output, so the program waits before anything."""
        pdl.start(GDC)
        q = tl.program_id(0)
        p = q // NS
        s = q - p * NS
        e = tl.load(se_ptr + p)
        dst = tl.load(ord_ptr + p)
        wt = tl.load(wt_ptr + dst).to(tl.float32)
        ok = e < E                                   # a padding pair (never in a one-row step) adds zeros
        eb = tl.where(ok, e, 0).to(tl.int64)
        r = s * RS + tl.arange(0, RS)
        if NI % RS == 0:
            rr = r                                   # contiguous: the down loads are vectors of RS values
        else:
            rr = tl.minimum(r, NI - 1)               # rows past NI read row NI - 1; their activation is 0
        kk = tl.arange(0, KC)
        gp = gu_ptr + eb * stride_ge + (rr * SG)[:, None] + kk[None, :]
        if ACC:                                      # products summed lane by lane, one reduction at the end
            tg = tl.zeros((RS, KC), dtype=tl.float32)
            tu = tl.zeros((RS, KC), dtype=tl.float32)
            for k0 in tl.range(0, H, KC, num_stages=ST):
                xv = tl.load(x_ptr + k0 + kk).to(tl.float32)[None, :]
                tg += tl.load(gp + k0).to(tl.float32) * xv
                tu += tl.load(gp + NI * SG + k0).to(tl.float32) * xv
            ag = tl.sum(tg, 1)
            au = tl.sum(tu, 1)
        else:                                        # one reduction a loop step
            ag = tl.zeros((RS,), dtype=tl.float32)
            au = tl.zeros((RS,), dtype=tl.float32)
            for k0 in tl.range(0, H, KC, num_stages=ST):
                xv = tl.load(x_ptr + k0 + kk).to(tl.float32)[None, :]
                ag += tl.sum(tl.load(gp + k0).to(tl.float32) * xv, 1)
                au += tl.sum(tl.load(gp + NI * SG + k0).to(tl.float32) * xv, 1)
        h = (ag * tl.sigmoid(ag) * au).to(x_ptr.dtype.element_ty).to(tl.float32)
        h = tl.where((r < NI) & ok, h, 0.0)
        nn = tl.arange(0, BO)
        dp = dw_ptr + eb * stride_de + (nn * SD)[:, None] + rr[None, :]
        op = p_ptr + (dst * NS + s).to(tl.int64) * H + nn
        for n0 in tl.range(0, H, BO, num_stages=ST):
            wd = tl.load(dp + n0 * SD).to(tl.float32)
            tl.store(op + n0, tl.sum(wd * h[None, :], 1) * wt)

    @triton.jit
    def _sum_kernel(p_ptr, res_ptr, o_ptr, R, H: tl.constexpr, RP: tl.constexpr, RB: tl.constexpr,
                    GDC: tl.constexpr = False):
        """Output values nb*RB..: the residual plus the sum of the R partial rows (one tile reduction, a fixed
        order), rounded to the output dtype first, as `down_sum` rounds."""
        pdl.start(GDC)
        n = tl.program_id(0) * RB + tl.arange(0, RB)
        j = tl.arange(0, RP)
        t = tl.load(p_ptr + (j * H)[:, None] + n[None, :], mask=(j < R)[:, None], other=0.0)
        acc = tl.sum(t, 0)
        dt = o_ptr.dtype.element_ty
        x = tl.load(res_ptr + n).to(tl.float32)
        tl.store(o_ptr + n, (x + acc.to(dt).to(tl.float32)).to(dt))


def fits(gate_up: Tensor, tile: dict[str, int]) -> bool:
    """Whether the tile's loop steps divide the experts' rows (H values of gate/up, H down rows, H outputs)."""
    H = gate_up.shape[2]
    return all(H % tile[k] == 0 for k in ("KC", "BO", "RB"))


def ffn_row(x: Tensor, se: Tensor, order: Tensor, wf: Tensor, gate_up: Tensor, down: Tensor, residual: Tensor,
            top_k: int, tile: dict[str, int]) -> Tensor:
    """residual [1, H] + the sum over the token's top-k pairs of w * down(SiLU(gate) * up) for one row x [1, H]
    (normalized), float experts gate_up [E, 2I, H], down [E, H, I], every expert resident; se / order / wf: the
    sorted routing of runtime/gpu/moe_kernels.py `group`. Two launches (module docstring)."""
    E, two_i, H = gate_up.shape
    inter = two_i // 2
    if not fits(gate_up, tile) or gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError(f"the split expert MLP needs contiguous rows whose {H} values its tile {tile} divides.")
    ns = triton.cdiv(inter, tile["RS"])
    rows = top_k * ns
    part = torch.empty(rows, H, dtype=torch.float32, device=x.device)
    _part_kernel[(rows,)](x.contiguous(), se, order, wf, gate_up, down, part, E, ns, gate_up.stride(0),
                          down.stride(0), H=H, NI=inter, SG=gate_up.stride(1), SD=down.stride(1), RS=tile["RS"],
                          KC=tile["KC"], BO=tile["BO"], ST=tile["ST"], ACC=bool(tile.get("ACC")),
                          num_warps=tile["num_warps"],
                          **pdl.launch(down))
    out = torch.empty_like(residual)
    _sum_kernel[(H // tile["RB"],)](part, residual, out, rows, H=H, RP=triton.next_power_of_2(rows), RB=tile["RB"],
                                    num_warps=tile["sum_warps"], **pdl.launch(down))
    return out
