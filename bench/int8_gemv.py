"""The one-row Q4_0 / Q8_0 products of the A3B decode step through the float kernels the step ships
(runtime/gpu/moe_gemv.py) and through 8-bit activations with integer dot products (runtime/gpu/int8_gemv.py).

    python bench/int8_gemv.py [--quant q4_0,q8_0] [--max-seconds 150]

Matrices of the Qwen3-30B-A3B shape in bench/quant_target.py's random blocks: the experts' gate/up (8 of 128 experts
of 1536 x 2048, a different top-8 for each of 48 calls) and down (8 of 2048 x 768, one h row a pair), q/k/v stacked
5120 x 2048 and o_proj 2048 x 4096 (48 copies each, so the L2 holds no previous call's weights). Each candidate is
one CUDA graph of its 48 calls, replayed; the median time per call is what it costs inside a step. The int8 rows
count the activation quantization as its own row (`quantize`): a step would quantize the normed hidden row once for
q/k/v and once for the experts' gate/up, o_proj's input and each pair's h row once. Next to each: GB/s of weights
read, the share of the measured copy bandwidth, and two errors relative to the largest |value|: against float32
math on the raw activations (what the float kernels compute) and, for the int8 rows, against float64 math on the
quantized activations (what they should compute exactly, up to fp32 rounding and the GPU's approximate division
in the scale). A "floor" row is an int8 launch of the same grid reading one block a row: the fixed cost of a launch
of that shape inside a graph (scheduling, the first loads' latency, stores), which no tile choice removes. Writes
`int8_gemv.json`.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import Deadline, copy_bandwidth, machine, print_table, write_json  # noqa: E402
from bench.gemv_one_row import DENSE, LAYERS, NI, TOPK, E, H, graph_us, quant_experts  # noqa: E402

# (BN rows a program, values a loop step, warps at most)
CANDIDATES = ((8, 512, 4), (16, 512, 4), (4, 2048, 8), (8, 2048, 8), (16, 2048, 8))
# the launch whose fixed cost the "floor" rows time: grid, loads of one block a row, stores
FLOOR = {"bn": 8, "kv": 2048, "num_warps": 8}
FLOOR_LABEL = "bn8 kv2048 w8"


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


def _exact(qx: torch.Tensor, dx: torch.Tensor, wv: torch.Tensor) -> torch.Tensor:
    """float64 sums of the quantized activations (codes [P, K], scales [P, K / 32]) with the rows wv [P, N, K]."""
    a = (qx.double().reshape(qx.shape[0], -1, 32) * dx.double()[..., None]).reshape(qx.shape[0], -1)
    return torch.einsum("pk,pnk->pn", a, wv)


def rows_for(fmt: str, bw: float, deadline: Deadline, rows: list[dict[str, Any]]) -> None:
    """Appends to `rows` as it goes, so what was measured survives a failure further on."""
    from bench.quant_target import random_blocks
    from runtime.formats.blocks import dequantize_torch
    from runtime.gpu import dense_kernels, int8_gemv, moe_gemv

    gen = torch.Generator(device="cuda").manual_seed(3)

    def add(matrix: str, method: str, nbytes: int, calls: list, y=None, ref_raw=None, ref_exact=None, cfg=None):
        if deadline.left() < 5:
            return
        try:
            us = graph_us(calls)
        except Exception as e:  # noqa: BLE001 - a candidate this build cannot run: a row of the table
            rows.append({"fmt": fmt, "matrix": matrix, "method": method, "error": f"{type(e).__name__}: {e!s:.160}"})
            return
        r = {"fmt": fmt, "matrix": matrix, "method": method, "cfg": cfg, "us": us, "GBs": nbytes / us / 1e3,
             "frac_copy": nbytes / us / 1e-6 / bw}
        if y is not None:
            r["rel_err_raw"] = _rel(y, ref_raw)
            if ref_exact is not None:
                r["rel_err_exact"] = _rel(y, ref_exact)
        rows.append(r)

    shipped = moe_gemv.variant(fmt)
    # dense matrices: the shipped one-row path against int8 candidates
    for name, (N, K) in DENSE.items():
        if name == "router":
            continue
        ws = [random_blocks(N, K, fmt, gen) for _ in range(LAYERS)]
        x = torch.randn(1, K, device="cuda", generator=gen).to(torch.bfloat16)
        wv = dequantize_torch(ws[0], fmt).double()
        ref_raw = x.double() @ wv.T
        one = dense_kernels.QUANT_ONE_ROW.get((fmt, name))
        cfg = moe_gemv.GEMV_VARIANTS[one] if one else shipped
        y = dense_kernels.gemv(x, ws[0], fmt, cfg)
        add(name, f"float ({one or 'shipped'})", ws[0].numel(),
            [lambda w=w, x=x, cfg=cfg: dense_kernels.gemv(x, w, fmt, cfg) for w in ws], y, ref_raw)
        act = int8_gemv.quantize_rows(x)
        add(name, "int8: quantize", 0, [lambda x=x: int8_gemv.quantize_rows(x) for _ in ws])
        qx, dx = int8_gemv.quantize_reference(x)
        ref_exact = _exact(qx, dx, wv[None])
        zero = torch.zeros(1, dtype=torch.int32, device="cuda")
        for bn, kv, warps in CANDIDATES:
            out = [torch.empty(1, N, dtype=torch.bfloat16, device="cuda") for _ in ws]
            kw = {"up": False, "x_per_pair": False, "bn": bn, "kv": kv, "num_warps": warps}
            int8_gemv.gemv(act, ws[0], zero, fmt, out[0], **kw)
            add(name, f"int8 bn{bn} kv{kv} w{warps}", ws[0].numel(),
                [lambda w=w, o=o, kw=kw, a=act, z=zero: int8_gemv.gemv(a, w, z, fmt, o, **kw)
                 for w, o in zip(ws, out, strict=True)],
                out[0], ref_raw, ref_exact, {"bn": bn, "kv": kv, "warps": warps})
        # the fixed cost of such a launch: the same grid and stores, one block a row
        first = [w[:, :2 * int8_gemv.FORMATS[fmt][1]] for w in ws]
        out = [torch.empty(1, N, dtype=torch.bfloat16, device="cuda") for _ in ws]
        add(name, f"floor: int8 {FLOOR_LABEL}, one block a row", 0,
            [lambda w=w, o=o, a=act, z=zero: int8_gemv.gemv(a, w, z, fmt, o, up=False, x_per_pair=False, **FLOOR)
             for w, o in zip(first, out, strict=True)])
        del ws, first
    # experts: one token's top-8 of 128, a different routing per call
    gu, dn, x, routes, hs, guf, dnf = quant_experts(fmt, gen)
    r0 = routes[0]
    g_raw = guf @ x.double()[0]
    h_raw = torch.nn.functional.silu(g_raw[:, :NI]) * g_raw[:, NI:]
    wts = [r.w.reshape(-1)[r.order.long()].float().contiguous() for r in routes]      # sorted pair order
    y_raw = torch.einsum("pk,pnk->pn", hs[0].double(), dnf) * wts[0].double()[:, None]
    up_bytes, down_bytes = TOPK * gu[0].numel(), TOPK * dn[0].numel()

    hb = [torch.empty(TOPK, NI, dtype=torch.bfloat16, device="cuda") for _ in routes]
    moe_gemv.up(x, r0.tok, r0.se, r0.se, gu, hb[0], fmt, E, NI, False, 1, shipped)
    add("experts up", "float (shipped)", up_bytes,
        [lambda r=r, o=o: moe_gemv.up(x, r.tok, r.se, r.se, gu, o, fmt, E, NI, False, 1, shipped)
         for r, o in zip(routes, hb, strict=True)], hb[0], h_raw)
    yb = [torch.empty(TOPK, H, dtype=torch.float32, device="cuda") for _ in routes]
    moe_gemv.down(hs[0], r0.se, r0.se, r0.order, r0.w.reshape(-1), dn, yb[0], fmt, E, False, True, 1, shipped)
    y_pair = torch.empty_like(yb[0]).copy_(yb[0][r0.order.long()])      # pair order -> sorted order
    add("experts down", "float (shipped)", down_bytes,
        [lambda r=r, o=o, h=h: moe_gemv.down(h, r.se, r.se, r.order, r.w.reshape(-1), dn, o, fmt, E, False, True, 1,
                                             shipped) for r, o, h in zip(routes, yb, hs, strict=True)],
        y_pair, y_raw)

    act = int8_gemv.quantize_rows(x)
    acts_h = [int8_gemv.quantize_rows(h) for h in hs]
    add("experts down", "int8: quantize 8 h rows", 0, [lambda h=h: int8_gemv.quantize_rows(h) for h in hs])
    qx, dx = int8_gemv.quantize_reference(x)
    up_exact = _exact(qx.expand(TOPK, -1), dx.expand(TOPK, -1), guf)
    up_exact = torch.nn.functional.silu(up_exact[:, :NI]) * up_exact[:, NI:]
    qh, dh = int8_gemv.quantize_reference(hs[0])
    down_exact = _exact(qh, dh, dnf) * wts[0].double()[:, None]
    for bn, kv, warps in CANDIDATES:
        ho = [torch.empty(TOPK, NI, dtype=torch.bfloat16, device="cuda") for _ in routes]
        kw = {"up": True, "x_per_pair": False, "bn": bn, "kv": kv, "num_warps": warps}
        int8_gemv.gemv(act, gu, r0.se, fmt, ho[0], **kw)
        add("experts up", f"int8 bn{bn} kv{kv} w{warps}", up_bytes,
            [lambda r=r, o=o, kw=kw: int8_gemv.gemv(act, gu, r.se, fmt, o, **kw) for r, o in zip(routes, ho, strict=True)],
            ho[0], h_raw, up_exact, {"bn": bn, "kv": kv, "warps": warps})
        yo = [torch.empty(TOPK, H, dtype=torch.float32, device="cuda") for _ in routes]
        kw = {"up": False, "x_per_pair": True, "bn": bn, "kv": kv, "num_warps": warps}
        int8_gemv.gemv(acts_h[0], dn, r0.se, fmt, yo[0], weights=wts[0], **kw)
        add("experts down", f"int8 bn{bn} kv{kv} w{warps}", down_bytes,
            [lambda r=r, o=o, a=a, wt=wt, kw=kw: int8_gemv.gemv(a, dn, r.se, fmt, o, weights=wt, **kw)
             for r, o, a, wt in zip(routes, yo, acts_h, wts, strict=True)],
            yo[0], y_raw, down_exact, {"bn": bn, "kv": kv, "warps": warps})
    add("experts up", "int8: quantize", 0, [lambda: int8_gemv.quantize_rows(x) for _ in routes])
    wpb2 = 2 * int8_gemv.FORMATS[fmt][1]
    gu1, dn1 = gu[:, :, :wpb2], dn[:, :, :wpb2]
    add("experts up", f"floor: int8 {FLOOR_LABEL}, one block a row", 0,
        [lambda r=r, o=o: int8_gemv.gemv(act, gu1, r.se, fmt, o, up=True, x_per_pair=False, **FLOOR)
         for r, o in zip(routes, hb, strict=True)])
    add("experts down", f"floor: int8 {FLOOR_LABEL}, one block a row", 0,
        [lambda r=r, o=o, a=a, wt=wt: int8_gemv.gemv(a, dn1, r.se, fmt, o, up=False, x_per_pair=True, weights=wt,
                                                     **FLOOR) for r, o, a, wt in zip(routes, yb, acts_h, wts, strict=True)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quant", default="q4_0,q8_0")
    ap.add_argument("--max-seconds", type=float, default=150.0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/int8_gemv.py needs a CUDA GPU; run it on one.", file=sys.stderr)
        return 2
    deadline = Deadline(args.max_seconds)
    bw = copy_bandwidth()
    rows: list[dict[str, Any]] = []
    for q in [q for q in args.quant.split(",") if q]:
        try:
            rows_for(q, bw, deadline, rows)
        except Exception:  # noqa: BLE001 - keep what was measured, say what failed
            traceback.print_exc()
            rows.append({"fmt": q, "matrix": "-", "method": "-", "error": traceback.format_exc(limit=2)[-300:]})
    write_json("int8_gemv.json", {"machine": machine(), "copy_bandwidth_Bps": bw, "rows": rows})
    print_table(f"One-row block products, float vs int8 activations, graph of 48 calls each (copy {bw / 1e9:,.0f} GB/s)",
                ["format", "matrix", "method", "us", "GB/s", "% copy", "err raw", "err exact"],
                [[r["fmt"], r["matrix"], r["method"], f"{r['us']:.2f}", f"{r['GBs']:,.0f}",
                  f"{100 * r['frac_copy']:.1f}", f"{r.get('rel_err_raw', float('nan')):.2g}",
                  f"{r.get('rel_err_exact', float('nan')):.2g}"] if "us" in r
                 else [r["fmt"], r["matrix"], r["method"], r["error"], "", "", "", ""] for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
