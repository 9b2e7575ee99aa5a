"""The routed-expert layer alone on the Qwen3-30B-A3B shape (128 experts, top-8, hidden 2048, expert width 768).

    python bench/moe.py [--device cuda] [--check] [--formats bf16,q8_0,q4_0,q4_k] [--no-tune] [--max-seconds 170]
    python bench/moe.py --tune-decode [--max-seconds 110]

Decode windows (W = 1, 8, 16): the fused step's MoE (router top-k and grouping, gate/up, down, per-token sum) in a
CUDA graph, rotating through 16 routings so the experts come from HBM, for BF16 and block-quantized experts. Bound:
distinct experts in the window x bytes per expert / device copy bandwidth (read + write, measured in the same run).

Prefill chunks (512, 2048, 8192 rows) through SparseMoe.forward: the Triton grouped GEMM (BF16 and quantized),
torch._grouped_mm (BF16), and the per-expert loop (before). Bound: FLOPs per token (k x 3 matmuls of H x I) / the
dense bf16 matmul rate measured in the same run.

Routing: random hidden states (std 1) through a random router (std 0.02): each token's choice is its own, as with the
honest-routing A3B model (bench/common.py); every row reports the distinct experts per window it met. Quantized
experts are random blocks with small scales (bytes and shapes real, values meaningless).

--check: correctness only, for a first call on a new GPU: the kernels against plain torch on random data (BF16,
every block format, slot tables and the miss path, dequantization bit for bit against gguf-py, graph capture).
Writes bench/results/moe.json (or $OUT/moe.json).

--tune-decode: the decode kernels' variants (runtime/gpu/moe_gemv.py GEMV_VARIANTS, and "dot", the tl.dot tiles) for
BF16, Q8_0, Q4_0, Q4_K and Q6_K experts: built in parallel worker processes, checked against float32 math on the
dequantized weights (relative error, and a row alone has the bits it has inside a 16-row window), timed at W = 1, 8,
16 as above; a table with % of bound, then the DECODE_GEMV line to paste into the module. Writes
moe_tune_decode.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import (  # noqa: E402
    A3B_SHAPE,
    Deadline,
    copy_bandwidth,
    machine,
    matmul_peak,
    median,
    print_table,
    write_json,
)
from runtime.formats.registry import FORMATS  # noqa: E402
from runtime.gpu import kernels, moe_gemv, moe_kernels  # noqa: E402
from runtime.models.layers import SparseMoe  # noqa: E402
from runtime.models.target_config import Qwen3MoeConfig  # noqa: E402

A3B = A3B_SHAPE
E, K, H, NI = A3B["num_experts"], A3B["num_experts_per_tok"], A3B["hidden_size"], A3B["moe_intermediate_size"]
ROUTINGS = 16


# ---------------------------------------------------------------------------------------------------- weights
def random_blocks(n: int, rows: int, cols: int, fmt: str, dev: str, g: torch.Generator) -> torch.Tensor:
    """[n, rows, row_bytes] random ggml blocks of `fmt` with small finite scales."""
    if fmt in ("q5_k", "q3_k", "q2_k", "iq4_xs", "iq4_nl"):      # scales elsewhere in the block: quant_target's
        from bench.quant_target import random_blocks as blocks_of

        return blocks_of(n * rows, cols, fmt, g, dev).view(n, rows, -1)
    f = FORMATS[fmt]
    nb = cols // f.block_values
    b = torch.randint(0, 256, (n, rows, nb, f.block_bytes), dtype=torch.uint8, device=dev, generator=g)
    d = (torch.randn(n, rows, nb, 2, device=dev, generator=g) * 2e-4).half().view(torch.uint8)
    if fmt == "q6_k":
        b[..., 208:210] = d[..., 0:2]
    elif fmt == "q4_k":
        b[..., 0:4] = d
    else:
        b[..., 0:2] = d[..., 0:2]
    return b.view(n, rows, nb * f.block_bytes)


def experts_for(fmt: str, dev: str, g: torch.Generator, n: int | None = None, h: int | None = None,
                inter: int | None = None, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    n, h, inter = n or E, h or H, inter or NI
    if fmt == "bf16":
        gu = torch.empty(n, 2 * inter, h, dtype=dtype, device=dev).normal_(0, 0.02, generator=g)
        dn = torch.empty(n, h, inter, dtype=dtype, device=dev).normal_(0, 0.02, generator=g)
        return gu, dn
    return random_blocks(n, 2 * inter, h, fmt, dev, g), random_blocks(n, h, inter, fmt, dev, g)


def sparse_moe(gate_up: torch.Tensor, down: torch.Tensor, fmt: str, dev: str, g: torch.Generator) -> SparseMoe:
    """A3B's MoE block around the given stacked experts (the experts' modules stay on meta: no copy)."""
    cfg = Qwen3MoeConfig.from_dict(A3B)
    with torch.device("meta"):
        m = SparseMoe(cfg)
    m.gate.weight = torch.nn.Parameter(torch.empty(E, H, dtype=torch.bfloat16, device=dev).normal_(0, 0.02,
                                                                                                  generator=g),
                                       requires_grad=False)
    if fmt == "bf16":          # the per-expert loop (before) calls the expert modules: views of the stacked weights
        for e, ex in enumerate(m.experts):
            ex.gate_proj.weight = torch.nn.Parameter(gate_up[e, :NI], requires_grad=False)
            ex.up_proj.weight = torch.nn.Parameter(gate_up[e, NI:], requires_grad=False)
            ex.down_proj.weight = torch.nn.Parameter(down[e], requires_grad=False)
    else:
        m.fmt = fmt
    m.gate_up, m.down = gate_up, down
    return m.eval()


# ----------------------------------------------------------------------------------------------------- timing
def graph_ms(calls: list, reps: int = 20) -> float:
    """Median ms per call of `calls` replayed as one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        for c in calls:
            c()
    gr.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        gr.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / len(calls))
    del gr
    return median(ts)


def eager_ms(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return median(ts)


# ----------------------------------------------------------------------------------------------------- decode
def decode_rows(fmt: str, widths: list[int], bw: float, dev: str, g: torch.Generator,
                weights: tuple[torch.Tensor, torch.Tensor] | None = None, quiet: bool = False, reps: int = 20
                ) -> list[dict[str, Any]]:
    gu, dn = weights if weights is not None else experts_for(fmt, dev, g)
    per_expert = gu[0].numel() * gu.element_size() + dn[0].numel() * dn.element_size()
    out = []
    for W in widths:
        x = torch.randn(W, H, device=dev, generator=g).to(torch.bfloat16)
        pos = torch.arange(W, dtype=torch.int32, device=dev)
        logits = [torch.randn(W, E, device=dev, generator=g) for _ in range(ROUTINGS)]
        distinct = median([float(torch.unique(lg.topk(K, -1).indices).numel()) for lg in logits])

        def call(lg: torch.Tensor, x: torch.Tensor = x, pos: torch.Tensor = pos) -> None:
            r = moe_kernels.route(lg, pos, K, True)
            moe_kernels.moe_routed(x, x, r, gu, dn, fmt=None if fmt == "bf16" else fmt)

        ms = graph_ms([lambda lg=lg: call(lg) for lg in logits], reps)
        bound_ms = distinct * per_expert / bw * 1e3
        out.append({"format": fmt, "width": W, "ms": ms, "distinct_experts": distinct, "bytes_per_expert": per_expert,
                    "bound_ms": bound_ms, "frac_of_bound": bound_ms / ms, "GBs": distinct * per_expert / ms / 1e6,
                    "kernel": decode_kernel(fmt)})
        if not quiet:
            print(f"  decode {fmt} W={W}: {ms * 1e3:.0f} us (bound {bound_ms * 1e3:.0f} us, {distinct:.0f} experts, "
                  f"{decode_kernel(fmt)})", flush=True)
    return out


def decode_kernel(fmt: str) -> str:
    """Which decode-window kernel the module runs for `fmt`: a GEMV variant's name, or "dot" (the tl.dot tiles)."""
    return moe_gemv.DECODE_GEMV.get(fmt) or "dot"


TUNE_FORMATS = ("q4_0", "q8_0", "bf16", "q4_k", "q6_k")       # issue 15's formats first, in case time runs out
TUNE_WIDTHS = (1, 8, 16)


def _warm(job: tuple[str, str]) -> tuple[str, str, float, str]:
    """Build one (format, variant)'s decode kernels in a worker process (they land in Triton's on-disk cache, so
    the timing process only loads them): the argument types, strides and specialisations of the A3B runs (16
    experts instead of 128: the expert count is not specialised)."""
    fmt, var = job
    t0 = time.perf_counter()
    try:
        torch.cuda.set_device(0)
        g = torch.Generator(device="cuda").manual_seed(1)
        gu, dn = experts_for(fmt, "cuda", g, n=16)
        moe_gemv.DECODE_GEMV[fmt] = None if var == "dot" else var
        f = None if fmt == "bf16" else fmt
        for T in (1, 16):
            x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
            idx = torch.rand(T, 16, device="cuda", generator=g).topk(K, -1).indices
            w = torch.rand(T, K, device="cuda", generator=g)
            moe_kernels.moe_grouped(x, idx, w, gu, dn, fmt=f)
        if f is not None and var == "dot":
            moe_kernels.dequantize(gu[0, :64], f)
        torch.cuda.synchronize()
        return fmt, var, time.perf_counter() - t0, ""
    except Exception as e:  # noqa: BLE001 - reported in the table
        return fmt, var, time.perf_counter() - t0, f"{type(e).__name__}: {str(e)[:200]}"


def warm_kernels(jobs: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """Compile every (format, variant) in parallel processes; {job: error or ""}."""
    import multiprocessing as mp

    n = max(1, min(len(jobs), (os.cpu_count() or 2) - 1, 15))
    try:
        with mp.get_context("spawn").Pool(n) as pool:
            res = pool.map(_warm, jobs, chunksize=1)
    except Exception as e:  # noqa: BLE001 - no worker processes here: the timing process builds them as it goes
        print(f"parallel build failed ({type(e).__name__}: {e}); building in this process", flush=True)
        return {}
    return {(f, v): err for f, v, _, err in res}


def _reference(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, guf: torch.Tensor, dnf: torch.Tensor
               ) -> torch.Tensor:
    """The routed experts pair by pair in float32 from dequantized weights (gguf-py's values), the gated
    activations rounded to x's dtype as the kernels store them."""
    T, k = idx.shape
    out = torch.zeros(T, dnf.shape[1], device=x.device)
    inter = guf.shape[1] // 2
    for t in range(T):
        xt = x[t].float()
        for j in range(k):
            e = int(idx[t, j])
            gt = guf[e] @ xt
            a = torch.nn.functional.silu(gt[:inter]) * gt[inter:]
            out[t] += float(w[t, j]) * (dnf[e] @ a.to(x.dtype).float())
    return out


def _dequantized(t: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "bf16":
        return t.float()
    S, R, rb = t.shape
    return moe_kernels.dequantize(t.reshape(S * R, rb), fmt).view(S, R, -1)


def tune_decode_gemv(bw: float, dev: str, deadline: Deadline, formats: tuple[str, ...] = TUNE_FORMATS
                     ) -> dict[str, Any]:
    """Every decode variant (moe_gemv.GEMV_VARIANTS, and "dot": the tl.dot tiles) for every format: checked against
    float32 math on the dequantized weights (relative error; a row computed alone has the bits it has inside a
    16-row window), then timed at W = 1, 8, 16 like `decode_rows`. The best passing variant per format is the one
    with the highest geometric mean of its fraction of the bound over the widths."""
    variants = list(moe_gemv.GEMV_VARIANTS) + ["dot"]
    saved = dict(moe_gemv.DECODE_GEMV)
    saved_one = dict(moe_gemv.DECODE_GEMV_ONE_ROW)
    # the variant under test at every width: a one-row table entry would time W = 1 on its own variant, and the
    # row-alone check would compare two variants' bits
    moe_gemv.DECODE_GEMV_ONE_ROW.clear()
    t0 = time.perf_counter()
    # one-step variants are for float rows (on blocks they would hold whole rows of blocks in registers)
    # and the row-by-row (R1) variants read only moe_gemv.R1_FORMATS
    skip = {(f, v) for f in formats for v in variants
            if f != "bf16" and any(moe_gemv.GEMV_VARIANTS.get(v, {}).get(o) for o in ("ONE", "ONE_UP", "ONE_DOWN"))}
    skip |= {(f, v) for f in formats for v in variants
             if v in moe_gemv.GEMV_VARIANTS and moe_gemv.refuses(f, moe_gemv.GEMV_VARIANTS[v])}
    built = warm_kernels([(f, v) for f in formats for v in variants if (f, v) not in skip])
    res: dict[str, Any] = {"variants": moe_gemv.GEMV_VARIANTS, "build_seconds": time.perf_counter() - t0,
                           "rows": [], "best": {}}
    print(f"built {len(built)} (format, variant) kernel sets in {res['build_seconds']:.0f} s", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    for fmt in formats:
        if deadline.left() < 8:
            res["truncated"] = True
            break
        dt = torch.bfloat16 if dev.startswith("cuda") else torch.float16     # (the CPU interpreter: a dry run)
        gu, dn = experts_for(fmt, dev, g, dtype=dt)
        f = None if fmt == "bf16" else fmt
        T = 16
        x = torch.randn(T, H, device=dev, generator=g).to(dt)
        idx = torch.randn(T, E, device=dev, generator=g).topk(K, -1).indices
        w = torch.softmax(torch.randn(T, K, device=dev, generator=g), -1)
        used = torch.unique(idx)
        guf = torch.zeros(E, 2 * NI, H, device=dev)
        dnf = torch.zeros(E, H, NI, device=dev)
        guf[used] = _dequantized(gu[used], fmt)
        dnf[used] = _dequantized(dn[used], fmt)
        ref = _reference(x, idx, w, guf, dnf)
        del guf, dnf
        for var in variants:
            row: dict[str, Any] = {"format": fmt, "variant": var}
            res["rows"].append(row)
            if (fmt, var) in skip:
                row["error"] = "a one-step variant (float rows only)"
                continue
            if built.get((fmt, var)):
                row["error"] = built[(fmt, var)]
                continue
            if deadline.left() < 4:
                row["error"] = "out of time"
                continue
            moe_gemv.DECODE_GEMV[fmt] = None if var == "dot" else var
            try:
                out = moe_kernels.moe_grouped(x, idx, w, gu, dn, fmt=f)
                row["rel_err"] = _rel(out, ref)
                row["row_invariant"] = all(torch.equal(moe_kernels.moe_grouped(x[i:i + 1], idx[i:i + 1], w[i:i + 1],
                                                                               gu, dn, fmt=f)[0], out[i])
                                           for i in (0, 7, 15))
                row["ok"] = row["rel_err"] < 2e-2 and row["row_invariant"]
                for r in decode_rows(fmt, list(TUNE_WIDTHS), bw, dev, g, weights=(gu, dn), quiet=True, reps=10):
                    row[f"us_w{r['width']}"] = r["ms"] * 1e3
                    row[f"bound_us_w{r['width']}"] = r["bound_ms"] * 1e3
                    row[f"frac_w{r['width']}"] = r["frac_of_bound"]
                row["geo_frac"] = float(np.exp(np.mean(np.log([row[f"frac_w{W}"] for W in TUNE_WIDTHS]))))
            except Exception as e:  # noqa: BLE001 - a variant this build cannot run: a row of the table
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(f"  {fmt} {var}: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                               for k, v in row.items() if k not in ("format", "variant")), flush=True)
        good = [r for r in res["rows"] if r["format"] == fmt and r.get("ok") and "geo_frac" in r]
        if good:
            res["best"][fmt] = max(good, key=lambda r: r["geo_frac"])["variant"]
        del gu, dn
        torch.cuda.empty_cache()
    moe_gemv.DECODE_GEMV.clear()
    moe_gemv.DECODE_GEMV.update(saved)
    moe_gemv.DECODE_GEMV_ONE_ROW.update(saved_one)
    return res


def print_tuning(res: dict[str, Any], gpu: str | None, bw: float) -> None:
    """The variants' table, then DECODE_GEMV as the measurements would set it (a line to paste into
    runtime/gpu/moe_gemv.py)."""
    rows = []
    for r in res["rows"]:
        cells: list[Any] = [r["format"], r["variant"]]
        if "error" in r:
            rows.append(cells + [r["error"][:60]] + [None] * (2 * len(TUNE_WIDTHS) + 1))
            continue
        cells.append(f"{r['rel_err']:.1e}, {'invariant' if r['row_invariant'] else 'NOT row-invariant'}")
        for W in TUNE_WIDTHS:
            cells += [r[f"us_w{W}"], 100 * r[f"frac_w{W}"]]
        cells.append(100 * r["geo_frac"])
        rows.append(cells)
    cols = ["format", "variant", "check (rel err, rows)"]
    for W in TUNE_WIDTHS:
        cols += [f"W={W} us", f"W={W} %bound"]
    cols.append("geo-mean %")
    print_table(f"Decode MoE per variant (route + experts + sum, CUDA graph) on {gpu}, copy {bw / 1e9:,.0f} GB/s",
                cols, rows)
    best = res["best"]
    line: dict[str, str | None] = {}
    kept = []
    for f in moe_gemv.DECODE_GEMV:
        src = "q4_0" if f == "q5_0" else f                   # q5_0 (not timed) takes Q4_0's tiles
        if src in best:
            line[f] = None if best[src] == "dot" else best[src]
        else:                                                # not measured (or nothing passed): as the module has it
            line[f] = moe_gemv.DECODE_GEMV.get(f)
            kept.append(f)
    print("best per format (highest geometric mean of % of bound over W = 1, 8, 16; passing variants only"
          + (f"; kept as the module has them, not measured: {', '.join(kept)}" if kept else "") + "):")
    print("DECODE_GEMV = {" + ", ".join(f'"{k}": ' + ("None" if v is None else f'"{v}"') for k, v in line.items())
          + "}")
    res["paste"] = line


# ---------------------------------------------------------------------------------------------------- prefill
def prefill_rows(fmt: str, chunks: list[int], impls: list[str], peak: float, dev: str, g: torch.Generator,
                 deadline: Deadline) -> list[dict[str, Any]]:
    gu, dn = experts_for(fmt, dev, g)
    m = sparse_moe(gu, dn, fmt, dev, g)
    flops_tok = 2 * 3 * H * NI * K
    out = []
    for T in chunks:
        x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
        with torch.no_grad():
            idx = m.gate(x).topk(K, -1).indices
        distinct16 = median([float(torch.unique(idx[i:i + 16]).numel()) for i in range(0, min(T, 256), 16)])
        for impl in impls:
            if deadline.over():
                break
            if impl == "loop" and T > 2048 and deadline.left() < 60:
                continue
            kernels.ENABLED = impl != "loop"
            moe_kernels.PREFILL_IMPL = "grouped_mm" if impl == "grouped_mm" else "triton"
            try:
                with torch.no_grad():
                    ms = eager_ms(lambda x=x: m(x), reps=3 if impl == "loop" else 5)
            except Exception as e:  # noqa: BLE001 - a path this build cannot run: record why
                out.append({"format": fmt, "impl": impl, "rows": T, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                continue
            finally:
                kernels.ENABLED = True
                moe_kernels.PREFILL_IMPL = "triton"
            tok_s = T / (ms / 1e3)
            bound = peak / flops_tok
            out.append({"format": fmt, "impl": impl, "rows": T, "ms": ms, "tok_s": tok_s, "bound_tok_s": bound,
                        "frac_of_bound": tok_s / bound, "TFLOPs": tok_s * flops_tok / 1e12,
                        "distinct_experts_w16": distinct16})
            print(f"  prefill {fmt} {impl} T={T}: {ms:.2f} ms, {tok_s:,.0f} tok/s ({100 * tok_s / bound:.0f}% of "
                  f"bound)", flush=True)
    return out


def tune_prefill(peak: float, dev: str, g: torch.Generator, T: int = 8192) -> dict[str, Any]:
    """Prefill tiles (MOE_PRE_UP / MOE_PRE_DOWN) on BF16 experts; keeps the fastest."""
    ups = [{"BM": 64, "BN": 64, "BK": 64, "GM": 8, "num_warps": 4, "num_stages": 3},
           {"BM": 128, "BN": 64, "BK": 64, "GM": 8, "num_warps": 8, "num_stages": 3},
           {"BM": 64, "BN": 128, "BK": 64, "GM": 8, "num_warps": 8, "num_stages": 3},
           {"BM": 128, "BN": 128, "BK": 32, "GM": 8, "num_warps": 8, "num_stages": 4},
           {"BM": 128, "BN": 128, "BK": 64, "GM": 8, "num_warps": 8, "num_stages": 3},
           {"BM": 128, "BN": 128, "BK": 64, "GM": 8, "num_warps": 8, "num_stages": 4},
           {"BM": 128, "BN": 64, "BK": 64, "GM": 8, "num_warps": 4, "num_stages": 4},
           {"BM": 64, "BN": 128, "BK": 64, "GM": 8, "num_warps": 4, "num_stages": 4},
           {"BM": 128, "BN": 64, "BK": 128, "GM": 8, "num_warps": 8, "num_stages": 3}]
    downs = [{"BM": 64, "BN": 128, "BK": 64, "GM": 8, "num_warps": 8, "num_stages": 3},
             {"BM": 128, "BN": 128, "BK": 64, "GM": 8, "num_warps": 8, "num_stages": 3},
             {"BM": 64, "BN": 64, "BK": 64, "GM": 8, "num_warps": 4, "num_stages": 4},
             {"BM": 128, "BN": 256, "BK": 32, "GM": 8, "num_warps": 8, "num_stages": 3},
             {"BM": 128, "BN": 128, "BK": 64, "GM": 8, "num_warps": 8, "num_stages": 4},
             {"BM": 128, "BN": 256, "BK": 64, "GM": 8, "num_warps": 8, "num_stages": 3},
             {"BM": 128, "BN": 128, "BK": 32, "GM": 8, "num_warps": 8, "num_stages": 4},
             {"BM": 128, "BN": 64, "BK": 64, "GM": 8, "num_warps": 4, "num_stages": 4}]
    gu, dn = experts_for("bf16", dev, g)
    x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
    idx = torch.randn(T, E, device=dev, generator=g).topk(K, -1).indices
    w = torch.rand(T, K, device=dev, generator=g).to(torch.bfloat16)
    res: dict[str, Any] = {"rows": T, "up": [], "down": []}
    for part, cands in (("up", ups), ("down", downs)):
        best = None
        for c in cands:
            if part == "up":
                moe_kernels.MOE_PRE_UP = dict(c)
            else:
                moe_kernels.MOE_PRE_DOWN = dict(c)
            try:
                ms = eager_ms(lambda: moe_kernels.moe_grouped(x, idx, w, gu, dn))
            except Exception as e:  # noqa: BLE001 - a shape this Triton cannot build
                res[part].append({**c, "error": str(e)[:200]})
                continue
            res[part].append({**c, "ms": ms})
            if best is None or ms < best[0]:
                best = (ms, c)
        if best is not None:
            if part == "up":
                moe_kernels.MOE_PRE_UP = dict(best[1])
            else:
                moe_kernels.MOE_PRE_DOWN = dict(best[1])
            res[f"best_{part}"] = best[1]
    return res


# ------------------------------------------------------------------------------------------------------ check
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _ref(x, idx, w, gu, dn, fmt=None, slot=None) -> torch.Tensor:
    """Plain torch in float32 (dequantized weights: blocks.py / gguf-py)."""
    f = None if fmt in (None, "bf16") else fmt
    if f is None:
        gu, dn = gu.float(), dn.float()
    return moe_kernels.moe_torch(x.float(), idx, w.float(), gu, dn, fmt=f, slot=slot)


def _kquant_blocks(fmt: str, n: int, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    rng = np.random.default_rng(seed)
    f = FORMATS[fmt]
    nb = cols // f.block_values
    b = rng.integers(0, 256, size=(n * rows, nb, f.block_bytes), dtype=np.uint8)
    d = (rng.standard_normal((n * rows, nb, 2)) * 1e-4).astype(np.float16).view(np.uint8)
    if fmt == "q6_k":
        b[..., 208:210] = d[..., 0:2]
    elif fmt == "q4_k":
        b[..., 0:4] = d.reshape(n * rows, nb, 4)
    else:
        b[..., 0:2] = d[..., 0:2]
    raw = b.reshape(n * rows, -1)
    return torch.from_numpy(raw.copy()).view(n, rows, -1), raw


def run_check(dev: str) -> list[list[Any]]:
    """Every check as a table row; on a CPU under TRITON_INTERPRET=1 (a dry run of this code) in float16, without
    the CUDA graph and the full-width case."""
    from gguf.quants import dequantize as gguf_dequantize

    rows: list[list[Any]] = []
    info: list[list[Any]] = []      # reported, not pass/fail

    def record(name: str, ok: bool, detail: str) -> None:
        rows.append([name, "ok" if ok else "FAIL", detail])
        print(f"  {name}: {'ok' if ok else 'FAIL'} {detail}", flush=True)

    def guard(name: str, fn) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a failure is a row of the table
            record(name, False, f"{type(e).__name__}: {str(e)[:300]}")

    cuda = dev.startswith("cuda")
    dt = torch.bfloat16 if cuda else torch.float16
    g = torch.Generator(device=dev).manual_seed(0)
    Ec, Hc, Ic, k = 8, 256, 256, 4

    def case(T: int):
        x = torch.randn(T, Hc, device=dev, generator=g).to(dt)
        idx = torch.randn(T, Ec, device=dev, generator=g).topk(k, -1).indices
        w = torch.rand(T, k, device=dev, generator=g).to(dt)
        return x, idx, w

    gu = (torch.randn(Ec, 2 * Ic, Hc, device=dev, generator=g) * 0.05).to(dt)
    dn = (torch.randn(Ec, Hc, Ic, device=dev, generator=g) * 0.05).to(dt)

    def bf16_paths() -> None:
        for T in (1, 5, 16, 200):
            x, idx, w = case(T)
            out = moe_kernels.moe_grouped(x, idx, w, gu, dn)
            e = _rel(out, _ref(x, idx, w, gu, dn))
            inv = "n/a (prefill)" if T > moe_kernels.DECODE_ROWS else all(
                torch.equal(moe_kernels.moe_grouped(x[i:i + 1], idx[i:i + 1], w[i:i + 1], gu, dn)[0], out[i])
                for i in range(T))
            record(f"{str(dt)[6:]} T={T}", e < 2e-2 and inv is not False, f"rel err {e:.1e}, row-invariant {inv}")
        x, idx, w = case(300)
        r = moe_kernels.group(idx, w, Ec)
        gm = moe_kernels.combine(moe_kernels.experts_grouped_mm(x, r, gu, dn), r.idx, Ec, None, x.dtype)
        e = _rel(gm, _ref(x, idx, w, gu, dn))
        record("torch._grouped_mm T=300", e < 2e-2, f"rel err {e:.1e}")

    guard("bf16", bf16_paths)

    def quant_paths() -> None:
        for fg, fd in (("q8_0", "q8_0"), ("q5_0", "q5_0"), ("q4_0", "q4_0"), ("q4_k", "q4_k"), ("q4_k", "q6_k"),
                       ("q6_k", "q6_k")):
            gb, graw = _kquant_blocks(fg, Ec, 2 * Ic, Hc, 1)
            db, draw = _kquant_blocks(fd, Ec, Hc, Ic, 2)
            gb, db = gb.to(dev), db.to(dev)
            bit = all(torch.equal(moe_kernels.dequantize(t.reshape(-1, t.shape[-1]), f).cpu(),
                                  torch.from_numpy(gguf_dequantize(raw, FORMATS[f].ggml).copy()))
                      for t, raw, f in ((gb, graw, fg), (db, draw, fd)))
            record(f"dequantize {fg}/{fd} vs gguf-py", bit, "bit for bit" if bit else "differs")
            for T in (3, 16, 150):
                x, idx, w = case(T)
                out = moe_kernels.moe_grouped(x, idx, w, gb, db, fmt=(fg, fd))
                e = _rel(out, _ref(x, idx, w, gb, db, fmt=(fg, fd)))
                inv = "n/a (prefill)" if T > moe_kernels.DECODE_ROWS else torch.equal(
                    moe_kernels.moe_grouped(x[:1], idx[:1], w[:1], gb, db, fmt=(fg, fd))[0], out[0])
                record(f"{fg}/{fd} T={T}", e < 2e-2 and inv is not False, f"rel err {e:.1e}, row-invariant {inv}")

    guard("quantized", quant_paths)

    def slot_paths() -> None:
        res = [5, 0, 3, 6, 1]                      # slot -> expert; experts 2, 4, 7 missed
        missed = [2, 4, 7]
        slot = torch.full((Ec,), -1, dtype=torch.int32, device=dev)
        slot[res] = torch.arange(len(res), dtype=torch.int32, device=dev)
        stage = torch.full((Ec,), -1, dtype=torch.int32, device=dev)
        stage[missed] = torch.arange(len(missed), dtype=torch.int32, device=dev)
        for T in (4, 16, 120):
            x, idx, w = case(T)
            full = moe_kernels.moe_grouped(x, idx, w, gu, dn)
            part = moe_kernels.moe_grouped(x, idx, w, gu[res].contiguous(), dn[res].contiguous(), slot=slot)
            e = _rel(part, _ref(x, idx, w, gu[res].contiguous(), dn[res].contiguous(), slot=slot))
            gs, ds = gu[missed].contiguous(), dn[missed].contiguous()

            def miss_fn(xx, r, y, gs=gs, ds=ds):
                moe_kernels.experts(xx, r, gs, ds, slot=stage, y=y, zero_missing=False)

            filled = moe_kernels.moe_grouped(x, idx, w, gu[res].contiguous(), dn[res].contiguous(), slot=slot,
                                             miss_fn=miss_fn)
            same = torch.equal(filled, full)
            record(f"slots T={T}", e < 2e-2 and same, f"rel err {e:.1e}, miss path = all resident: {same}")
        # the fused step's MoE with a slot table and a miss path, captured in a CUDA graph
        W = 8
        x, _, _ = case(W)
        pos = torch.arange(W, dtype=torch.int32, device=dev)
        lg = torch.randn(W, Ec, device=dev, generator=g).to(dt)
        gs, ds = gu[missed].contiguous(), dn[missed].contiguous()
        gr_, dr_ = gu[res].contiguous(), dn[res].contiguous()

        def step() -> torch.Tensor:
            r = moe_kernels.route(lg, pos, k, True, slot=slot)
            return moe_kernels.moe_routed(x, x, r, gr_, dr_, slot=slot, miss_fn=lambda xx, r, y: moe_kernels.experts(
                xx, r, gs, ds, slot=stage, y=y, zero_missing=False))

        eager = step()
        r_all = moe_kernels.route(lg, pos, k, True)
        want = moe_kernels.moe_routed(x, x, r_all, gu, dn)
        rr = moe_kernels.route(lg, pos, k, True, slot=slot)
        grp = moe_kernels.group(rr.idx, rr.w, Ec, slot)
        same_route = all(torch.equal(a, b) for a, b in zip(rr[2:], grp[2:], strict=True))
        if not cuda:
            ok = torch.equal(eager, want) and same_route
            record("route + slots + miss path", ok, f"= all resident: {ok}, route = group: {same_route}")
            return
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            out = step()
        gr.replay()
        torch.cuda.synchronize()
        ok = torch.equal(out, eager) and torch.equal(eager, want) and same_route
        record("graph: route + slots + miss path", ok, f"graph = eager = all resident: {ok}, route = group: "
               f"{same_route}")
        # information for a miss path: the same kernels reading the missed experts from pinned host memory (UVA)
        try:
            hs, hd = gs.cpu().pin_memory(), ds.cpu().pin_memory()
            zc = moe_kernels.moe_routed(x, x, rr, gr_, dr_, slot=slot, miss_fn=lambda xx, r, y: moe_kernels.experts(
                xx, r, hs, hd, slot=stage, y=y, zero_missing=False))
            info.append(["miss path from pinned host memory", "info", f"= all resident: {torch.equal(zc, want)}"])
        except Exception as e:  # noqa: BLE001 - optional: only reported
            info.append(["miss path from pinned host memory", "info", f"unsupported: {type(e).__name__}: "
                         f"{str(e)[:200]}"])

    guard("slots", slot_paths)

    def a3b_shape() -> None:
        g2 = torch.Generator(device=dev).manual_seed(3)
        agu, adn = experts_for("bf16", dev, g2, n=16)
        x = torch.randn(2, H, device=dev, generator=g2).to(torch.bfloat16)
        idx = torch.randn(2, 16, device=dev, generator=g2).topk(K, -1).indices
        w = torch.rand(2, K, device=dev, generator=g2).to(torch.bfloat16)
        e = _rel(moe_kernels.moe_grouped(x, idx, w, agu, adn), _ref(x, idx, w, agu, adn))
        record("A3B widths (16 experts), bf16", e < 2e-2, f"rel err {e:.1e}")
        for f in ("q8_0", "q4_0", "q4_k", "q6_k"):       # the module's decode kernels (DECODE_GEMV) at full width
            qgu, qdn = experts_for(f, dev, g2, n=16)
            out = moe_kernels.moe_grouped(x, idx, w, qgu, qdn, fmt=f)
            e = _rel(out, _ref(x, idx, w, qgu, qdn, fmt=f))
            inv = torch.equal(moe_kernels.moe_grouped(x[1:], idx[1:], w[1:], qgu, qdn, fmt=f)[0], out[1])
            record(f"A3B widths (16 experts), {f} ({decode_kernel(f)})", e < 2e-2 and inv,
                   f"rel err {e:.1e}, row-invariant {inv}")

    if cuda:
        guard("a3b", a3b_shape)
    for r in info:
        print(f"  {r[0]}: {r[2]}", flush=True)
    return rows + info


# ------------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--check", action="store_true", help="correctness only (kernels vs torch), then exit")
    ap.add_argument("--formats", default="bf16,q8_0,q4_0,q4_k", help="decode formats (comma-separated)")
    ap.add_argument("--widths", default="1,8,16")
    ap.add_argument("--chunks", default="512,2048,8192")
    ap.add_argument("--no-tune", action="store_true", help="keep the module's prefill tile shapes")
    ap.add_argument("--tune-decode", action="store_true",
                    help="check and time every decode variant (moe_gemv.GEMV_VARIANTS) per format, then exit")
    ap.add_argument("--max-seconds", type=float, default=170)
    args = ap.parse_args(argv)
    formats = [f.strip().lower() for f in args.formats.split(",") if f.strip()]
    bad = [f for f in formats if f not in moe_kernels.QCODE]
    if bad:
        print(f"unknown format(s) {', '.join(bad)}; use some of {', '.join(moe_kernels.QCODE)}.", file=sys.stderr)
        return 2
    if not kernels.HAVE_TRITON:
        print("bench/moe.py needs Triton (pip install triton).", file=sys.stderr)
        return 2
    dev = args.device
    dry = args.check and dev == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    if not dry and (not dev.startswith("cuda") or not torch.cuda.is_available()):
        print("bench/moe.py needs a CUDA GPU (--device cuda); a CPU runs only `--check` under TRITON_INTERPRET=1.",
              file=sys.stderr)
        return 2
    if not dry:
        d = torch.device(dev)
        torch.cuda.set_device(d if d.index is not None else torch.device("cuda", 0))
    # the tuning run is one device call of at most two minutes
    deadline = Deadline(min(args.max_seconds, 110) if args.tune_decode else args.max_seconds)
    res: dict[str, Any] = {"machine": machine(), "args": vars(args),
                           "shape": {"experts": E, "top_k": K, "hidden": H, "expert_width": NI},
                           "routing": "random hidden states through a random router (independent per token)"}
    t0 = time.perf_counter()
    if args.check:
        rows = run_check(dev)
        res["check"] = [{"name": r[0], "result": r[1], "detail": r[2]} for r in rows]
        print_table(f"MoE kernels vs torch on {res['machine'].get('gpu')}", ["check", "result", "detail"], rows)
        write_json("moe_check.json", res)
        return 0 if all(r[1] in ("ok", "info") for r in rows) else 1

    if args.tune_decode:
        bw = copy_bandwidth()
        res["copy_bandwidth_GBs"] = bw / 1e9
        fmts = TUNE_FORMATS if args.formats == ap.get_default("formats") else \
            tuple(f for f in formats if f in moe_gemv.GEMV_FORMATS)
        res["tune_decode"] = tune_decode_gemv(bw, dev, deadline, fmts)
        print_tuning(res["tune_decode"], res["machine"].get("gpu"), bw)
        res["seconds"] = time.perf_counter() - t0
        path = write_json("moe_tune_decode.json", res)
        print(f"wrote {path} ({res['seconds']:.0f} s)")
        return 0 if res["tune_decode"]["best"] else 1

    g = torch.Generator(device=dev).manual_seed(0)
    bw = copy_bandwidth()
    peak = matmul_peak()
    res["copy_bandwidth_GBs"] = bw / 1e9
    res["bf16_matmul_TFLOPs"] = peak / 1e12
    print(f"copy {bw / 1e9:,.0f} GB/s, bf16 matmul {peak / 1e12:,.0f} TFLOP/s", flush=True)
    widths = [int(v) for v in args.widths.split(",")]
    chunks = [int(v) for v in args.chunks.split(",")]

    # order: what issue 14 and 15 ask first (BF16 decode, BF16 prefill), then the quantized rows as time allows
    res["decode"], res["prefill"], res["tuning"] = [], [], {}
    if "bf16" in formats:
        res["decode"].extend(decode_rows("bf16", widths, bw, dev, g))
        torch.cuda.empty_cache()
    if not args.no_tune and deadline.left() > 120:
        res["tuning"]["prefill"] = tune_prefill(peak, dev, g)
        torch.cuda.empty_cache()
    res["prefill_tiles"] = {"up": moe_kernels.MOE_PRE_UP, "down": moe_kernels.MOE_PRE_DOWN}
    res["prefill"].extend(prefill_rows("bf16", chunks, ["triton", "grouped_mm", "loop"], peak, dev, g, deadline))
    torch.cuda.empty_cache()
    for fmt in [f for f in formats if f != "bf16"]:
        if deadline.left() < 25:
            res["truncated"] = True
            break
        res["decode"].extend(decode_rows(fmt, widths, bw, dev, g))
        torch.cuda.empty_cache()
    res["decode_tiles"] = {"bf16": {"up": moe_kernels.MOE_UP, "down": moe_kernels.MOE_DOWN},
                           "quantized": {"up": moe_kernels.MOE_QUP, "down": moe_kernels.MOE_QDOWN},
                           "decode_gemv": dict(moe_gemv.DECODE_GEMV),
                           "gemv_variants": {f: moe_gemv.variant(f) for f in moe_gemv.DECODE_GEMV}}
    for fmt in [f for f in formats if f != "bf16"][:2]:
        if deadline.left() > 20:
            res["prefill"].extend(prefill_rows(fmt, chunks[-2:], ["triton"], peak, dev, g, deadline))
            torch.cuda.empty_cache()
    res["seconds"] = time.perf_counter() - t0

    print_table(f"MoE decode (route + experts + sum, CUDA graph) on {res['machine'].get('gpu')}, copy "
                f"{bw / 1e9:,.0f} GB/s",
                ["format", "kernel", "W", "us", "distinct experts", "bound us", "% of bound", "GB/s"],
                [[r["format"], r["kernel"], r["width"], r["ms"] * 1e3, r["distinct_experts"], r["bound_ms"] * 1e3,
                  100 * r["frac_of_bound"], r["GBs"]] for r in res["decode"]])
    print_table(f"MoE prefill (SparseMoe.forward), bf16 matmul peak {peak / 1e12:,.0f} TFLOP/s",
                ["format", "impl", "rows", "ms", "tok/s", "bound tok/s", "% of bound", "TFLOP/s"],
                [[r["format"], r["impl"], r["rows"], r.get("ms"), r.get("tok_s"), r.get("bound_tok_s"),
                  100 * r["frac_of_bound"] if "frac_of_bound" in r else r.get("error"), r.get("TFLOPs")]
                 for r in res["prefill"]])
    path = write_json("moe.json", res)
    print(f"wrote {path} ({res['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
