"""Dense projections of a decode step: BF16 on cuBLAS against the GEMV kernels (runtime/gpu/moe_gemv.py variants),
and block-format ones on the GEMV kernel against dequantize + cuBLAS (`--quant`).

    python bench/dense_gemv.py [--widths 1,8,16] [--variants n8j2,n16j2,...] [--quant] [--quant-step]
                               [--no-bf16]

Matrices of the Qwen3-30B-A3B shape (q/k/v stacked 5120 x 2048, o_proj 2048 x 4096, router 128 x 2048), 48 copies
of each (one per layer, so the 50 MB L2 holds no previous call's weights, as in a step), each method captured as
one CUDA graph of the 48 products and replayed: the median time per product is what the method costs inside a
graph-replayed step, launch gaps included. Next to it: GB/s of weights read and the share of the measured copy
bandwidth (read + write, bench/common.py), so 100% means reading the weights as fast as a copy moves bytes.
Checks (every variant): the largest difference from cuBLAS relative to the largest |value|, and row invariance
(a row of an M-row product has the bits of the same row computed alone by the same method: more than the fixed-width
step needs, which is only that a row's bits do not depend on the other rows at one width).

--quant: Q8_0/Q4_0 q/k/v and o_proj (a quantized target's dense projections), the GEMV kernel against dequantizing
into a scratch + cuBLAS (runtime/gpu/dense_kernels.py), per width, with the same checks against the dequantized
matrix. --quant-step: the A3B graph step (1k context) per target format
(bench/quant_target.py's random Q8_0/Q4_0 build) and width on each multi-row path, same run.

Writes `dense_gemv.json`. (On the H200, 2026-12-01: cuBLAS beat every looped BF16 variant at every width; the
one-step variants that now take one-row products are timed by bench/gemv_one_row.py.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import copy_bandwidth, machine, print_table, write_json  # noqa: E402

SHAPES = {"qkv": (5120, 2048), "o_proj": (2048, 4096), "router": (128, 2048)}
LAYERS = 48


def graph_time(fn) -> float:
    """Seconds of one `fn()` replayed from a CUDA graph (bench/gpu_checks.py `graph_time_ms`, median of 20)."""
    from bench.gpu_checks import graph_time_ms

    return graph_time_ms(fn, inner=1, reps=20) / 1e3


def run_matrices(widths: list[int], variants: list[str], bw: float) -> list[dict[str, Any]]:
    from runtime.gpu import dense_kernels, moe_gemv

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (N, K) in SHAPES.items():
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(LAYERS)]
        nbytes = N * K * 2
        for M in widths:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
            ref = torch.nn.functional.linear(x, ws[0]).float()
            scale = ref.abs().max().item()
            methods: dict[str, Any] = {"cublas": lambda w, x=x: torch.nn.functional.linear(x, w)}
            for v in variants:
                cfg = moe_gemv.GEMV_VARIANTS[v]
                methods[v] = lambda w, x=x, cfg=cfg: dense_kernels.gemv(x, w, "bf16", cfg)
            for meth, f in methods.items():
                t = graph_time(lambda f=f, ws=ws: [f(w) for w in ws]) / LAYERS
                y = f(ws[0]).float()
                err = (y - ref).abs().max().item() / scale
                inv = None
                if meth != "cublas" and M > 1:
                    inv = bool(torch.equal(f(ws[0])[0], dense_kernels.gemv(x[:1].contiguous(), ws[0], "bf16",
                                                                          moe_gemv.GEMV_VARIANTS[meth])[0]))
                rows.append(dict(matrix=name, N=N, K=K, M=M, method=meth, us=t * 1e6, GBs=nbytes / t / 1e9,
                                 frac_copy=nbytes / t / bw, rel_err=err, row_invariant=inv))
        del ws
        torch.cuda.empty_cache()
    return rows


def run_quant(widths: list[int], bw: float) -> list[dict[str, Any]]:
    """Q8_0/Q4_0 dense projections (a quantized target's q/k/v and o_proj): the GEMV kernel against the matrix
    dequantized into a scratch and one cuBLAS product, per width (the GEMV kernel takes a window's rows one pass at
    a time; runtime/gpu/dense_kernels.py `quant_linear` takes the GEMV for one row, the other for more).
    (A tiled tl.dot kernel, measured on 2026-12-01: 45-130 us a matrix at every width, now gone.)"""
    from runtime.formats.blocks import quantize
    from runtime.gpu import dense_kernels, moe_gemv

    rows = []
    gen = torch.Generator().manual_seed(1)
    for fmt in ("q8_0", "q4_0"):
        for name in ("qkv", "o_proj"):
            N, K = SHAPES[name]
            w = torch.randn(N, K, generator=gen) * 0.02
            b0 = torch.from_numpy(quantize(w.numpy(), fmt)).cuda()
            bs = [b0.clone() for _ in range(LAYERS)]
            wf = _dequant(b0, fmt, K)
            nbytes = b0.numel()
            for M in widths:
                x = torch.randn(M, K, dtype=torch.bfloat16).cuda()
                ref = x.float() @ wf.t()
                scale = ref.abs().max().item()
                cfg = moe_gemv.variant(fmt)
                methods = {"gemv": lambda b, x=x, cfg=cfg, fmt=fmt: dense_kernels.gemv(x, b, fmt, cfg),
                           "dequant+cublas": lambda b, x=x, fmt=fmt: dense_kernels.dequant_linear(x, b, fmt)}
                for meth, f in methods.items():
                    t = graph_time(lambda f=f, bs=bs: [f(b) for b in bs]) / LAYERS
                    err = (f(b0).float() - ref).abs().max().item() / scale
                    inv = None if M == 1 else bool(torch.equal(f(b0)[M - 1], _alone(meth, x[M - 1:], b0, fmt)[0]))
                    rows.append(dict(fmt=fmt, matrix=name, N=N, K=K, M=M, method=meth, us=t * 1e6,
                                     GBs=nbytes / t / 1e9, frac_copy=nbytes / t / bw, rel_err=err, row_invariant=inv))
            del bs
            torch.cuda.empty_cache()
    return rows


def _dequant(blocks: torch.Tensor, fmt: str, k: int) -> torch.Tensor:
    """The dequantized weight [N, K] in fp32 on the GPU (the reference product's matrix)."""
    from runtime.formats.blocks import dequantize_torch

    return dequantize_torch(blocks.cpu(), fmt).float().reshape(blocks.shape[0], k).cuda()


def _alone(meth: str, x1: torch.Tensor, b: torch.Tensor, fmt: str) -> torch.Tensor:
    from runtime.gpu import dense_kernels, moe_gemv

    x1 = x1.contiguous()
    if meth == "gemv":
        return dense_kernels.gemv(x1, b, fmt, moe_gemv.variant(fmt))
    return dense_kernels.dequant_linear(x1, b, fmt)


def run_quant_step(widths: list[int]) -> list[dict[str, Any]]:
    """The A3B shape's graph step at 1k context per target format and width: quantized dense projections of 2+ rows
    on each `dense_kernels.MULTI_ROW` path (the GEMV kernel a row at a time, the runtime before; the dequantized
    scratch + cuBLAS, the runtime now), same run. BF16 for reference."""
    import gc

    from bench.common import A3B_SHAPE
    from bench.context import make_kv, time_decode
    from bench.quant_target import build_on_gpu
    from runtime.gpu import dense_kernels

    default = dense_kernels.MULTI_ROW
    out = []
    for fmt in ("bf16", "q8_0", "q4_0"):
        model = build_on_gpu(A3B_SHAPE, fmt)
        for w in widths:
            for path in ("gemv", "dequant"):
                if (fmt == "bf16" or w == 1) and path != default:
                    continue
                dense_kernels.MULTI_ROW = path
                kv = make_kv(model, 1024, "bf16", capacity=1024 + 64)
                ms = time_decode(model, kv, w, 30)["step_ms"]
                out.append(dict(fmt=fmt, width=w, dense=path if fmt != "bf16" else "cublas", step_ms=ms))
                print(f"  {fmt} W={w} {out[-1]['dense']}: {ms:.3f} ms/step", flush=True)
                del kv
        dense_kernels.MULTI_ROW = default
        del model
        gc.collect()
        torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="1,8,16")
    ap.add_argument("--variants", default="n8j2,n16j2,n4j2,n8j2np,n8j2m2")
    ap.add_argument("--quant", action="store_true", help="also Q8_0/Q4_0 projections: GEMV vs dequant + cuBLAS")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false", help="skip the BF16 comparison")
    ap.add_argument("--quant-step", action="store_true",
                    help="also the A3B step per target format and width: GEMV vs dequant + cuBLAS dense projections")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/dense_gemv.py needs a CUDA GPU.", file=sys.stderr)
        return 2
    widths = [int(w) for w in args.widths.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    bw = copy_bandwidth()
    rows = run_matrices(widths, variants, bw) if args.bf16 else []
    print_table(f"BF16 dense projections, 48 distinct copies per graph (copy bandwidth {bw / 1e9:,.0f} GB/s)",
                ["matrix", "M", "method", "us", "GB/s", "% copy", "rel err", "row inv"],
                [[r["matrix"], r["M"], r["method"], r["us"], r["GBs"], 100 * r["frac_copy"], r["rel_err"],
                  r["row_invariant"]] for r in rows])
    # the variant with the least total time over the three matrices at the widths measured
    totals: dict[str, float] = {}
    for r in rows:
        totals[r["method"]] = totals.get(r["method"], 0.0) + r["us"]
    best = min((m for m in totals if m != "cublas"), key=totals.get, default=None)
    res: dict[str, Any] = {"machine": machine(), "copy_GBs": bw / 1e9, "layers": LAYERS, "rows": rows,
                           "total_us": totals, "best_variant": best}
    print("total us over matrices and widths: " + ", ".join(f"{k} {v:,.0f}" for k, v in totals.items()))
    if args.quant:
        res["quant"] = run_quant(widths, bw)
        print_table("Q8_0/Q4_0 dense projections: GEMV vs dequant + cuBLAS, 48 distinct copies per graph",
                    ["fmt", "matrix", "M", "method", "us", "GB/s", "% copy", "rel err", "row inv"],
                    [[r["fmt"], r["matrix"], r["M"], r["method"], r["us"], r["GBs"], 100 * r["frac_copy"],
                      r["rel_err"], r["row_invariant"]] for r in res["quant"]])
    if args.quant_step:
        res["quant_step"] = run_quant_step(widths)
        print_table("A3B graph step at 1k context, quantized dense projections of 2+ rows per path",
                    ["fmt", "width", "dense", "step ms"],
                    [[r["fmt"], r["width"], r["dense"], r["step_ms"]] for r in res["quant_step"]])
    write_json("dense_gemv.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
