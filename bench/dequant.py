"""Dequantizing a block-format matrix into the shared scratch (a quantized target's verify windows: every dense
projection of 2+ rows is dequantized, then multiplied by cuBLAS; runtime/gpu/dense_kernels.py `dequant_linear`).

    python bench/dequant.py [--quants q4_0,q8_0,q4_k,q6_k] [--step q4_k_m,q4_0] [--widths 4,8] [--tile BN,G,WARPS]

1. Matrices of the Qwen3-30B-A3B shape (q/k/v 5120 x 2048, o_proj 2048 x 4096) in each format (bench/quant_target.py's
   random blocks), 48 copies each (one per layer, so the L2 holds no previous call's blocks), dequantized into one
   BF16 scratch by `moe_kernels.dequantize` with the shipped tile (`DEQUANT_TILE`) and with candidate tiles (BN rows x
   G groups of 16 values a program); each candidate's 48 calls captured as one CUDA graph and replayed: the median
   time per call, launch gaps included. Next to it the bytes moved (blocks read + BF16 written) as GB/s and as a
   share of the copy bandwidth measured in the same run, and whether the values are the shipped tile's bit for bit.
2. `--step`: the A3B graph step at 1k context (bench/quant_target.py's build of each target format, every expert
   resident) at each of `--widths`, one step captured with the shipped tile and one with `--tile` (default: the
   fastest candidate of part 1 summed over the formats), replayed alternately, 10 rounds of 20 steps; medians.

Writes `dequant.json`.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import copy_bandwidth, machine, median, print_table, write_json  # noqa: E402
from bench.gemv_one_row import graph_us  # noqa: E402

MATS = {"qkv": (5120, 2048), "o_proj": (2048, 4096)}
LAYERS = 48
# (BN rows, G groups of 16 values, warps) a program; (32, 1, 4) is the tile before bench/results/h200_session18/
# (`--step ... --tile 32,1,4` times the step against it)
CANDIDATES = [(32, 1, 4), (32, 4, 4), (32, 8, 4), (32, 16, 4), (16, 16, 4), (64, 8, 4), (64, 16, 8), (16, 8, 2),
              (8, 16, 2)]


def tile(t: tuple[int, int, int]) -> dict[str, int]:
    return {"BN": t[0], "G": t[1], "num_warps": t[2]}


def matrix_rows(quants: list[str], bw: float) -> list[dict[str, Any]]:
    from bench.quant_target import random_blocks
    from runtime.gpu import moe_kernels

    shipped = moe_kernels.DEQUANT_TILE
    rows = []
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    for fmt in quants:
        for name, (N, K) in MATS.items():
            ws = [random_blocks(N, K, fmt, gen) for _ in range(LAYERS)]
            out = torch.empty(N, K, dtype=torch.bfloat16, device="cuda")
            ref = moe_kernels.dequantize(ws[0], fmt, out=torch.empty_like(out), tile=shipped)
            moved = ws[0].numel() + out.numel() * 2
            for cand in [None] + CANDIDATES:
                t = shipped if cand is None else tile(cand)
                same = torch.equal(moe_kernels.dequantize(ws[0], fmt, out=torch.empty_like(out), tile=t), ref)
                us = graph_us([lambda w=w, t=t, f=fmt, o=out: moe_kernels.dequantize(w, f, out=o, tile=t) for w in ws])
                rows.append({"fmt": fmt, "matrix": name, "tile": "shipped" if cand is None else
                             f"{cand[0]}x{cand[1]}w{cand[2]}", "us": us, "gb_s": moved / us / 1e3,
                             "frac_copy_bw": moved / (us * 1e-6) / bw, "same_bits": same})
            del ws, out
            torch.cuda.empty_cache()
    return rows


def best_tile(rows: list[dict[str, Any]]) -> tuple[int, int, int]:
    """The candidate with the least time summed over every format and matrix (ties: the first)."""
    tot: dict[str, float] = {}
    for r in rows:
        if r["tile"] != "shipped":
            tot[r["tile"]] = tot.get(r["tile"], 0.0) + r["us"]
    name = min(tot, key=tot.get)
    bn, rest = name.split("x")
    g, w = rest.split("w")
    return int(bn), int(g), int(w)


def step_rows(fmts: list[str], widths: list[int], new: dict[str, int], rounds: int = 10,
              steps: int = 20) -> list[dict[str, Any]]:
    from bench.common import A3B_SHAPE
    from bench.context import gen, make_kv
    from bench.quant_target import build_on_gpu
    from runtime.gpu import moe_kernels
    from runtime.gpu.static_step import StaticStep

    shipped = dict(moe_kernels.DEQUANT_TILE)
    out = []
    for fmt in fmts:
        model = build_on_gpu(A3B_SHAPE, fmt)
        for w in widths:
            kv = make_kv(model, 1024, "bf16", capacity=1024 + 64)
            win = torch.randint(0, model.cfg.vocab_size, (1, w), device="cuda", generator=gen(1024 + w))
            arms = {}
            for arm, t in (("shipped", shipped), ("new", new)):
                moe_kernels.DEQUANT_TILE = t
                st = StaticStep(model, kv, w, graph=True)
                for _ in range(2):                 # capture (the tile is baked into the graph), warm
                    st(win, kv)
                    kv.rollback(1024)
                arms[arm] = st
            moe_kernels.DEQUANT_TILE = shipped
            logits = {}
            for arm, st in arms.items():
                logits[arm] = st(win, kv).logits.clone()
                kv.rollback(1024)
            times: dict[str, list[float]] = {a: [] for a in arms}
            for _ in range(rounds):
                for arm, st in arms.items():
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        st(win, kv)
                        kv.rollback(1024)
                    torch.cuda.synchronize()
                    times[arm].append((time.perf_counter() - t0) / steps * 1e3)
            for arm in arms:
                out.append({"fmt": fmt, "width": w, "arm": arm, "step_ms": median(times[arm]),
                            "same_logits": bool(torch.equal(logits[arm], logits["shipped"]))})
                print(f"  {fmt} W={w} {arm}: {out[-1]['step_ms']:.3f} ms", flush=True)
            del arms, kv
            gc.collect()
            torch.cuda.empty_cache()
        del model
        gc.collect()
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quants", default="q4_0,q8_0,q4_k,q6_k")
    ap.add_argument("--step", default="", help="target formats whose graph step to time (e.g. q4_k_m,q4_0)")
    ap.add_argument("--widths", default="4,8")
    ap.add_argument("--tile", default="", help="BN,G,WARPS for the step's new arm (default: part 1's fastest)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/dequant.py needs a CUDA GPU.", file=sys.stderr)
        return 2
    from runtime.gpu import moe_kernels

    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; shipped tile {moe_kernels.DEQUANT_TILE}", flush=True)
    quants = [q for q in args.quants.split(",") if q]
    rows = matrix_rows(quants, bw) if quants else []
    if rows:
        print_table("dequantize into a BF16 scratch, us a matrix (48 in a graph)",
                    ["format", "matrix", "tile", "us", "GB/s", "% copy bw", "same bits"],
                    [[r["fmt"], r["matrix"], r["tile"], r["us"], r["gb_s"], 100 * r["frac_copy_bw"],
                      r["same_bits"]] for r in rows])
    res: dict[str, Any] = {"machine": machine(), "copy_bw_gb_s": bw / 1e9, "shipped": moe_kernels.DEQUANT_TILE,
                           "matrices": rows}
    if args.step:
        t = tuple(int(v) for v in args.tile.split(",")) if args.tile else best_tile(rows)
        res["step_tile"] = tile(t)
        res["steps"] = step_rows([f for f in args.step.split(",") if f], [int(w) for w in args.widths.split(",")],
                                 tile(t))
        print_table(f"A3B graph step at 1k context, ms (new tile {tile(t)})", ["target", "width", "arm", "ms",
                                                                               "same logits"],
                    [[r["fmt"], r["width"], r["arm"], r["step_ms"], r["same_logits"]] for r in res["steps"]])
    write_json("dequant.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
