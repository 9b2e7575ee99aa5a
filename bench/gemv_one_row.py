"""The one-row BF16 products of the A3B decode step, each through cuBLAS (dense) or the current tiles and through
the GEMV kernel's one-step tiles (runtime/gpu/moe_gemv.py: a program's whole weight tile loaded in one go), with
and without EARLY (that load issued before the PDL wait).

    python bench/gemv_one_row.py [--max-seconds 240] [--quant q4_0,q8_0 [--lm-head]]

Matrices of the Qwen3-30B-A3B shape: q/k/v stacked 5120 x 2048, o_proj 2048 x 4096, router 128 x 2048 (48 copies
of each, one per layer, so the 50 MB L2 holds no previous call's weights, as in a step), and the experts' gate/up
(8 of 128 experts of 1536 x 2048) and down (8 of 2048 x 768) for one token, a different top-8 for each of 48 calls.
Each candidate is captured as one CUDA graph of its 48 calls and replayed; the median time per call is what it
costs inside a graph-replayed step, launch gaps included. Between two calls of one graph nothing else runs, so
EARLY here overlaps a call's weight load with the previous call of the same kind: an upper bound on what it buys
in a step (bench/step_ab.py measures the step). Next to each: GB/s of weights read and the share of the measured
copy bandwidth. Checks: the largest difference from float32 math relative to the largest |value|.

`--quant q4_0,q8_0`: the same products of a target in those block formats (bench/quant_target.py's random blocks),
the shipped variant against other looped tiles (more blocks a step) and a one-step block tile (`QUANT_CANDIDATES`).

Writes `gemv_one_row.json` (`gemv_one_row_quant.json` with --quant), with the fastest candidate per matrix.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import Deadline, copy_bandwidth, machine, median, print_table, write_json  # noqa: E402

DENSE = {"qkv": (5120, 2048), "o_proj": (2048, 4096), "router": (128, 2048)}
H, NI, E, TOPK, LAYERS = 2048, 768, 128, 8, 48


def cfg(bn_up: int, bn_down: int, warps: int, early: bool, kv: int = 4096) -> dict[str, int]:
    return {"ONE": 1, "BN_UP": bn_up, "BN_DOWN": bn_down, "KV": kv, "MB": 1, "PF": 0, "J": 1, "num_warps": warps,
            "num_stages": 1, "EARLY": int(early)}


def graph_us(calls: list, reps: int = 20) -> float:
    """Median microseconds per call of `calls` replayed as one CUDA graph (`reps` replays)."""
    from runtime.gpu.capture import capture

    g, _ = capture(lambda: [c() for c in calls])
    for _ in range(3):
        g.replay()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / len(calls))
    return median(ts)


def dense_rows(bw: float, deadline: Deadline) -> list[dict[str, Any]]:
    from runtime.gpu import dense_kernels

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (N, K) in DENSE.items():
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(LAYERS)]
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref = x.float() @ ws[0].float().T
        scale = ref.abs().max().item()
        nbytes = N * K * 2
        cands: dict[str, Any] = {"cublas": None}
        for bn in ((1, 2, 4) if N < 1024 else (1, 2, 4, 8)):
            for warps in ((4,) if N < 1024 else (4, 8)):
                for early in (False, True):
                    cands[f"bn{bn} w{warps}{' early' if early else ''}"] = cfg(1, bn, warps, early)
        for label, c in cands.items():
            if deadline.left() < 5:
                break
            if c is None:
                def f(w, x=x):
                    return torch.nn.functional.linear(x, w)
            else:
                def f(w, x=x, c=c):
                    return dense_kernels.gemv(x, w, "bf16", c)
            try:
                y = f(ws[0]).float()
                us = graph_us([lambda w=w, f=f: f(w) for w in ws])
            except Exception as e:  # noqa: BLE001 - a candidate this build cannot run: a row of the table
                rows.append({"matrix": name, "method": label, "error": f"{type(e).__name__}: {str(e)[:160]}"})
                continue
            rows.append({"matrix": name, "N": N, "K": K, "method": label, "cfg": c, "us": us,
                         "GBs": nbytes / us / 1e3, "frac_copy": nbytes / us / 1e-6 / bw,
                         "rel_err": (y - ref).abs().max().item() / scale})
        del ws
        torch.cuda.empty_cache()
    return rows


def token_routes(gen: torch.Generator) -> tuple[torch.Tensor, list, list[torch.Tensor]]:
    """One token's activation row, 48 routings of it (one per layer: a different top-8 each) and the h rows the
    down products take."""
    from runtime.gpu import moe_kernels

    x = torch.randn(1, H, device="cuda", generator=gen).to(torch.bfloat16)
    pos = torch.zeros(1, dtype=torch.int32, device="cuda")
    routes = [moe_kernels.route(torch.randn(1, E, device="cuda", generator=gen), pos, TOPK, True)
              for _ in range(LAYERS)]
    hs = [torch.randn(TOPK, NI, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]
    return x, routes, hs


def expert_rows(bw: float, deadline: Deadline) -> list[dict[str, Any]]:
    from runtime.gpu import moe_gemv

    gen = torch.Generator(device="cuda").manual_seed(1)
    gu = (torch.randn(E, 2 * NI, H, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    dn = (torch.randn(E, H, NI, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    x, routes, hs = token_routes(gen)
    r0 = routes[0]
    idx = r0.se.long()
    g_ref = x.float() @ gu[idx, :NI].float().transpose(1, 2)          # [8, 1, NI], sorted pair order
    u_ref = x.float() @ gu[idx, NI:].float().transpose(1, 2)
    h_ref = (torch.nn.functional.silu(g_ref) * u_ref)[:, 0]
    y_ref = torch.einsum("pk,pnk->pn", hs[0].float(), dn[idx].float())   # sorted pair p's rows
    y_ref = y_ref * r0.w.reshape(-1)[r0.order.long()][:, None]
    y_ref = torch.zeros_like(y_ref).index_copy_(0, r0.order.long(), y_ref)
    current = moe_gemv.variant("bf16", 1) or moe_gemv.GEMV_VARIANTS["n16d32"]
    ups: dict[str, Any] = {"current": current}
    downs: dict[str, Any] = {"current": current}
    for bn in (1, 2, 4, 8):
        for warps in (4, 8):
            ups[f"bn{bn} w{warps}"] = cfg(bn, 16, warps, False)
    for bn in (8, 16, 32):
        for warps in (4, 8):
            for early in (False, True):
                downs[f"bn{bn} w{warps}{' early' if early else ''}"] = cfg(1, bn, warps, early)
    setup = ExpertSetup(x, routes, hs, gu, dn, h_ref, y_ref)
    return time_experts(setup, "bf16", (("up", ups, TOPK * 2 * NI * H * 2), ("down", downs, TOPK * H * NI * 2)), bw,
                        deadline)


class ExpertSetup:
    """One token's experts for the timing: its activation row, 48 routings (one per layer), the h rows the down
    products take, the stacked weights, and the float32 references of the first routing (sorted pair order for
    h, each pair's own row for y)."""

    def __init__(self, x, routes, hs, gu, dn, h_ref, y_ref) -> None:
        self.x, self.routes, self.hs, self.gu, self.dn, self.h_ref, self.y_ref = x, routes, hs, gu, dn, h_ref, y_ref


def time_experts(st: ExpertSetup, fmt: str, parts, bw: float, deadline: Deadline) -> list[dict[str, Any]]:
    """Each (part, candidates, bytes) of `parts` ("up": gate/up, "down"), each candidate as one graph of the 48
    calls: us per call, GB/s, share of the copy bandwidth, the largest error relative to the reference."""
    from runtime.gpu import moe_gemv

    rows: list[dict[str, Any]] = []
    for part, cands, nbytes in parts:
        for label, c in cands.items():
            if deadline.left() < 5:
                break
            try:
                if part == "up":
                    outs = [torch.empty(TOPK, NI, dtype=torch.bfloat16, device="cuda") for _ in st.routes]

                    def call(r, o, c=c):
                        moe_gemv.up(st.x, r.tok, r.se, r.se, st.gu, o, fmt, E, NI, False, 1, c)
                    pairs = list(zip(st.routes, outs, strict=True))
                    call(*pairs[0])
                    err = (outs[0].float() - st.h_ref).abs().max().item() / st.h_ref.abs().max().item()
                else:
                    outs = [torch.empty(TOPK, H, dtype=torch.float32, device="cuda") for _ in st.routes]

                    def call(r, o, h, c=c):
                        moe_gemv.down(h, r.se, r.se, r.order, r.w.reshape(-1), st.dn, o, fmt, E, False, True, 1, c,
                                      early=True)
                    pairs = list(zip(st.routes, outs, st.hs, strict=True))
                    call(*pairs[0])
                    err = (outs[0] - st.y_ref).abs().max().item() / st.y_ref.abs().max().item()
                us = graph_us([lambda p=p, call=call: call(*p) for p in pairs])
            except Exception as e:  # noqa: BLE001 - a candidate this build cannot run: a row of the table
                rows.append({"fmt": fmt, "matrix": f"experts {part}", "method": label,
                             "error": f"{type(e).__name__}: {e!s:.160}"})
                continue
            rows.append({"fmt": fmt, "matrix": f"experts {part}", "method": label, "cfg": c, "us": us,
                         "GBs": nbytes / us / 1e3, "frac_copy": nbytes / us / 1e-6 / bw, "rel_err": err})
    return rows


# bench/results/h200_session10/quant_tiles/ timed the one-step tiles (qone*: none faster for q/k/v or the experts);
# these are the looped tiles with more blocks a step, so more warps a program (moe_gemv "n*k*")
QUANT_CANDIDATES = ("n8j2np", "n8j2", "n4j2k2np", "n8j2k2np", "n16j2k2np", "n8j2k2", "n4j2k4np", "n8j2k4np", "n8j2k4",
                    "qone4j2")
# the row-by-row tiles (moe_gemv `_rows32r`, `_rowskr`), for the formats they read (moe_gemv.R1_FORMATS; Q4_K: j2,
# j4, j8)
R1_CANDIDATES = ("r2d4k2w4", "r4d8k2w4j2", "r4d8k4w4j2", "r4d8k4w8j2", "r4d8k2w4j4", "r8d8k4w4j4", "r4d8k4w4j8",
                 "r8d8k4w4j8", "r4d8k8w4j8", "r2d4k4w4j8")


def quant_experts(fmt: str, gen: torch.Generator):
    """Stacked `fmt` experts of the A3B shape (bench/quant_target.py's random blocks: gate/up [E, 2 NI, bytes], down
    [E, H, bytes]), one token's routings (`token_routes`) and float64 values of the first routing's experts in sorted
    pair order: (gu, dn, x, routes, hs, gate/up values, down values)."""
    from bench.quant_target import random_blocks
    from runtime.formats.blocks import dequantize_torch

    gu = random_blocks(E * 2 * NI, H, fmt, gen).reshape(E, 2 * NI, -1)
    dn = random_blocks(E * H, NI, fmt, gen).reshape(E, H, -1)
    x, routes, hs = token_routes(gen)
    idx = routes[0].se.long().tolist()
    guf = torch.stack([dequantize_torch(gu[e].contiguous(), fmt) for e in idx]).double()
    dnf = torch.stack([dequantize_torch(dn[e].contiguous(), fmt) for e in idx]).double()
    return gu, dn, x, routes, hs, guf, dnf


def quant_rows(fmt: str, bw: float, deadline: Deadline, lm_head: bool = False) -> list[dict[str, Any]]:
    """The one-row products of a target whose matrices and experts are `fmt` blocks (bench/quant_target.py's random
    blocks): the shipped variant against the candidates (`QUANT_CANDIDATES`),
    against float32 math on the dequantized values."""
    from bench.quant_target import random_blocks
    from runtime.formats.blocks import dequantize_torch
    from runtime.gpu import dense_kernels, moe_gemv

    gen = torch.Generator(device="cuda").manual_seed(2)
    cands = {"shipped": moe_gemv.variant(fmt)} | {v: moe_gemv.GEMV_VARIANTS[v] for v in QUANT_CANDIDATES}
    cands |= {v: moe_gemv.GEMV_VARIANTS[v] for v in R1_CANDIDATES
              if not moe_gemv.refuses(fmt, moe_gemv.GEMV_VARIANTS[v])}
    rows: list[dict[str, Any]] = []
    mats = [("lm_head", (151936, H))] if lm_head else [("qkv", DENSE["qkv"]), ("o_proj", DENSE["o_proj"])]
    for name, (N, K) in mats:
        # 48 copies (one per layer); the head is one matrix a step, far past the L2: 4 copies
        ws = [random_blocks(N, K, fmt, gen) for _ in range(4 if name == "lm_head" else LAYERS)]
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref = x.float() @ dequantize_torch(ws[0], fmt).float().T
        for label, c in cands.items():
            if deadline.left() < 5:
                break
            try:
                y = dense_kernels.gemv(x, ws[0], fmt, c).float()
                us = graph_us([lambda w=w, c=c, x=x: dense_kernels.gemv(x, w, fmt, c) for w in ws])
            except Exception as e:  # noqa: BLE001 - a candidate this build cannot run: a row of the table
                rows.append({"fmt": fmt, "matrix": name, "method": label, "error": f"{type(e).__name__}: {e!s:.160}"})
                continue
            nbytes = ws[0].numel()
            rows.append({"fmt": fmt, "matrix": name, "method": label, "cfg": c, "us": us, "GBs": nbytes / us / 1e3,
                         "frac_copy": nbytes / us / 1e-6 / bw,
                         "rel_err": (y - ref).abs().max().item() / ref.abs().max().item()})
        del ws
    if lm_head:
        return rows
    gu, dn, x, routes, hs, guf, dnf = quant_experts(fmt, gen)
    r0 = routes[0]
    guf, dnf = guf.float(), dnf.float()
    h_ref = (torch.nn.functional.silu(guf[:, :NI] @ x.float()[0]) * (guf[:, NI:] @ x.float()[0]))
    y_ref = torch.einsum("pk,pnk->pn", hs[0].float(), dnf) * r0.w.reshape(-1)[r0.order.long()][:, None]
    y_ref = torch.zeros_like(y_ref).index_copy_(0, r0.order.long(), y_ref)
    setup = ExpertSetup(x, routes, hs, gu, dn, h_ref, y_ref)
    return rows + time_experts(setup, fmt, (("up", cands, TOPK * gu[0].numel()), ("down", cands, TOPK * dn[0].numel())),
                               bw, deadline)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-seconds", type=float, default=240.0)
    ap.add_argument("--quant", default="", help="block formats (q4_0,q8_0): time their one-row products instead")
    ap.add_argument("--lm-head", action="store_true", help="with --quant: the A3B's output head (151,936 x 2048) "
                    "instead of q/k/v, o_proj and the experts")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gemv_one_row.py needs a CUDA GPU; run it on one.", file=sys.stderr)
        return 2
    deadline = Deadline(args.max_seconds)
    bw = copy_bandwidth()
    from runtime.gpu import pdl

    res: dict[str, Any] = {"machine": machine(), "copy_bandwidth_Bps": bw, "pdl": pdl.launch(torch.zeros(1,
                           device="cuda")).get("GDC", False)}
    quants = [q for q in args.quant.split(",") if q]
    if quants:
        rows = [r for q in quants for r in quant_rows(q, bw, deadline, args.lm_head)]
    else:
        rows = expert_rows(bw, deadline) + dense_rows(bw, deadline)
    for r in rows:
        r.setdefault("fmt", "bf16")
    res["rows"] = rows
    best: dict[str, str] = {}
    for key in dict.fromkeys((r["fmt"], r["matrix"]) for r in rows):
        ok = [r for r in rows if (r["fmt"], r["matrix"]) == key and "us" in r and r["rel_err"] < 1e-2]
        if ok:
            best[" ".join(key)] = min(ok, key=lambda r: r["us"])["method"]
    res["best"] = best
    print_table(f"One-row products, graph of 48 calls each (copy {bw / 1e9:,.0f} GB/s, PDL {res['pdl']})",
                ["format", "matrix", "method", "us", "GB/s", "% copy", "rel err"],
                [[r["fmt"], r["matrix"], r["method"], f"{r['us']:.2f}", f"{r['GBs']:,.0f}",
                  f"{100 * r['frac_copy']:.1f}", f"{r['rel_err']:.2g}"] if "us" in r
                 else [r["fmt"], r["matrix"], r["method"], r["error"], "", "", ""] for r in rows])
    print("fastest:", best)
    print("wrote", write_json("gemv_one_row_quant.json" if quants else "gemv_one_row.json", res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
