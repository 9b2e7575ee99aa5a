"""Can the tensor memory accelerator (TMA) keep more of a one-row BF16 product's weights in flight than the shipped
register tiles? An experiment beside the step, not wired into it.

    python bench/tma_gemv.py [--max-seconds 200]
    TRITON_INTERPRET=1 python bench/tma_gemv.py --check      # the kernels' sums against float32 math, on a CPU

Why: the one-row step's products are latency-bound chains (docs/models.md, "The one-row step"): a program of the
shipped one-step tiles loads its few rows in one go, registers hold what is in flight, and 168 registers a thread
leave 1-2 programs a multiprocessor, so a 2048 x 4096 o_proj runs in several waves, each paying a round trip. A
TMA load (`desc.load` on a host-made tensor descriptor) is issued by one thread into shared memory, and Triton's
pipeliner keeps `num_stages` of them in flight: one wave of programs, each streaming its rows at depth. Timed as
bench/gemv_one_row.py times (48 distinct weights, one CUDA graph of 48 calls, PDL on, median us a call):
cuBLAS, the shipped variant, and TMA tiles of BM rows x BK columns, STAGES deep, one program per BM rows or a
persistent grid of one program per multiprocessor. Matrices of the A3B one-row step: q/k/v 5120 x 2048, o_proj
2048 x 4096, and the experts' gate/up (8 of 128 experts of 1536 x 2048, SiLU(gate) * up in the kernel).

Writes `tma_gemv.json`. On an H100 (bench/results/h100_session34/tma_rejected/) no TMA tile beat the shipped ones,
so nothing in the runtime uses them (docs/models.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import Deadline, machine, print_table, write_json  # noqa: E402
from bench.gemv_one_row import graph_us  # noqa: E402
from runtime.gpu import pdl  # noqa: E402
from runtime.gpu.kernels import HAVE_TRITON  # noqa: E402

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

H, NI, E, TOPK, LAYERS = 2048, 768, 128, 8, 48
DENSE = {"qkv": (5120, 2048), "o_proj": (2048, 4096)}

if HAVE_TRITON:

    @triton.jit
    def _dense_kernel(w_desc, x_ptr, y_ptr, N, K, BM: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                      GDC: tl.constexpr):
        """Program: BM rows, K walked BK columns a step, STAGES TMA loads in flight."""
        pdl.start(GDC)
        r0 = tl.program_id(0) * BM
        acc = tl.zeros([BM, BK], tl.float32)
        for k in tl.range(0, K, BK, num_stages=STAGES):
            w = w_desc.load([r0, k]).to(tl.float32)
            x = tl.load(x_ptr + k + tl.arange(0, BK)).to(tl.float32)
            acc += w * x[None, :]
        rows = r0 + tl.arange(0, BM)
        tl.store(y_ptr + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=rows < N)

    @triton.jit
    def _dense_persistent(w_desc, x_ptr, y_ptr, N, K, NPROG, BM: tl.constexpr, BK: tl.constexpr,
                          STAGES: tl.constexpr, GDC: tl.constexpr):
        """Program p: row tiles p, p + NPROG, ... as one flat loop of (tile, column step), so the pipeline runs on
        from one tile into the next."""
        pdl.start(GDC)
        pid = tl.program_id(0)
        nk = K // BK
        nt = tl.cdiv(N, BM)
        mine = (nt - pid + NPROG - 1) // NPROG
        acc = tl.zeros([BM, BK], tl.float32)
        for i in tl.range(0, mine * nk, num_stages=STAGES):
            t = pid + (i // nk) * NPROG
            k = (i % nk) * BK
            w = w_desc.load([t * BM, k]).to(tl.float32)
            x = tl.load(x_ptr + k + tl.arange(0, BK)).to(tl.float32)
            acc += w * x[None, :]
            if i % nk == nk - 1:
                rows = t * BM + tl.arange(0, BM)
                tl.store(y_ptr + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=rows < N)
                acc = tl.zeros([BM, BK], tl.float32)

    @triton.jit
    def _up_kernel(w_desc, x_ptr, se_ptr, o_ptr, NI, K, BM: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                   GDC: tl.constexpr):
        """Program: pair p // (NI / BM), BM gate rows and the same BM up rows of its expert; SiLU(g) * u."""
        pdl.start(GDC)
        nb = NI // BM
        p = tl.program_id(0)
        slot = p // nb
        rb = p % nb
        e = tl.load(se_ptr + slot)
        rg = e * 2 * NI + rb * BM
        ag = tl.zeros([BM, BK], tl.float32)
        au = tl.zeros([BM, BK], tl.float32)
        for k in tl.range(0, K, BK, num_stages=STAGES):
            x = tl.load(x_ptr + k + tl.arange(0, BK)).to(tl.float32)[None, :]
            ag += w_desc.load([rg, k]).to(tl.float32) * x
            au += w_desc.load([rg + NI, k]).to(tl.float32) * x
        g = tl.sum(ag, 1)
        u = tl.sum(au, 1)
        h = g / (1.0 + tl.exp(-g)) * u
        tl.store(o_ptr + slot * NI + rb * BM + tl.arange(0, BM), h.to(o_ptr.dtype.element_ty))


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 8


def dense_call(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, c: dict[str, int]):
    """A closure running y = x @ w^T through the TMA tile `c` (BM, BK, STAGES, warps, persistent)."""
    N, K = w.shape
    desc = TensorDescriptor.from_tensor(w, [c["BM"], c["BK"]])
    opts = pdl.launch(x)
    if c["persistent"]:
        nprog = min(_sms(), triton.cdiv(N, c["BM"]))

        def f():
            _dense_persistent[(nprog,)](desc, x, y, N, K, nprog, BM=c["BM"], BK=c["BK"], STAGES=c["STAGES"],
                                        num_warps=c["warps"], **opts)
    else:
        def f():
            _dense_kernel[(triton.cdiv(N, c["BM"]),)](desc, x, y, N, K, BM=c["BM"], BK=c["BK"], STAGES=c["STAGES"],
                                                      num_warps=c["warps"], **opts)
    return f


def up_call(gu: torch.Tensor, x: torch.Tensor, se: torch.Tensor, o: torch.Tensor, c: dict[str, int]):
    """A closure running the top-8 pairs' SiLU(x @ gate^T) * (x @ up^T) through the TMA tile `c`."""
    flat = gu.reshape(-1, gu.shape[-1])
    desc = TensorDescriptor.from_tensor(flat, [c["BM"], c["BK"]])
    opts = pdl.launch(x)
    grid = (se.numel() * (NI // c["BM"]),)

    def f():
        _up_kernel[grid](desc, x, se, o, NI, gu.shape[-1], BM=c["BM"], BK=c["BK"], STAGES=c["STAGES"],
                         num_warps=c["warps"], **opts)
    return f


def tiles(n_rows: int) -> list[dict[str, int]]:
    out = []
    for bm in (8, 16, 32):
        for bk in (128, 256):
            for stages in (3, 5):
                for warps in (4, 8):
                    if bm * bk // (32 * warps) < 4:    # fewer than 4 values a thread: not worth a compile
                        continue
                    out.append(dict(BM=bm, BK=bk, STAGES=stages, warps=warps, persistent=0))
    for bm, bk, stages in ((16, 256, 4), (32, 128, 6), (8, 256, 6)):
        out.append(dict(BM=bm, BK=bk, STAGES=stages, warps=4, persistent=1))
    return [c for c in out if n_rows % c["BM"] == 0]


def label(c: dict[str, int]) -> str:
    return f"tma bm{c['BM']} bk{c['BK']} s{c['STAGES']} w{c['warps']}{' persistent' if c['persistent'] else ''}"


def check(device: str = "cpu") -> int:
    """The TMA kernels' results against float32 math on small shapes (the interpreter on a CPU, or a GPU)."""
    gen = torch.Generator(device=device).manual_seed(0)
    bad = 0
    N, K = 64, 512
    w = (torch.randn(N, K, generator=gen, device=device) * 0.05).to(torch.bfloat16)
    x = torch.randn(K, generator=gen, device=device).to(torch.bfloat16)
    ref = w.float() @ x.float()
    for c in (dict(BM=16, BK=128, STAGES=2, warps=4, persistent=0), dict(BM=16, BK=128, STAGES=2, warps=4,
                                                                          persistent=1)):
        y = torch.empty(N, dtype=torch.bfloat16, device=device)
        dense_call(w, x, y, c)()
        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
        print(f"dense {label(c)}: rel err {err:.2g}")
        bad += err > 1e-2
    gu = (torch.randn(4, 2 * NI, 256, generator=gen, device=device) * 0.05).to(torch.bfloat16)
    xu = torch.randn(256, generator=gen, device=device).to(torch.bfloat16)
    se = torch.tensor([3, 0, 2], dtype=torch.int32, device=device)
    g = gu[se.long(), :NI].float() @ xu.float()
    u = gu[se.long(), NI:].float() @ xu.float()
    href = torch.nn.functional.silu(g) * u
    o = torch.empty(3, NI, dtype=torch.bfloat16, device=device)
    up_call(gu, xu, se, o, dict(BM=16, BK=128, STAGES=2, warps=4))()
    err = ((o.float() - href).abs().max() / href.abs().max()).item()
    print(f"experts gate/up: rel err {err:.2g}")
    bad += err > 1e-2
    return int(bad > 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-seconds", type=float, default=200.0)
    ap.add_argument("--check", action="store_true", help="correctness only (CPU under TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    if not HAVE_TRITON:
        print("bench/tma_gemv.py needs Triton.", file=sys.stderr)
        return 2
    if args.check:
        return check("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
    if not torch.cuda.is_available():
        print("bench/tma_gemv.py needs a CUDA GPU (or --check under TRITON_INTERPRET=1).", file=sys.stderr)
        return 2
    from bench.common import copy_bandwidth
    from bench.gemv_one_row import token_routes
    from runtime.gpu import dense_kernels, moe_gemv

    if check("cuda"):
        print("a TMA kernel gives wrong sums on this GPU; not timing.", file=sys.stderr)
        return 1
    deadline = Deadline(args.max_seconds)
    bw = copy_bandwidth()
    rows: list[dict[str, Any]] = []

    def timed(matrix: str, method: str, nbytes: int, calls: list, err: float) -> None:
        try:
            us = graph_us(calls)
        except Exception as e:  # noqa: BLE001 - a tile this build cannot run: a row of the table
            rows.append({"matrix": matrix, "method": method, "error": f"{type(e).__name__}: {e!s:.160}"})
            return
        rows.append({"matrix": matrix, "method": method, "us": us, "GBs": nbytes / us / 1e3,
                     "frac_copy": nbytes / us / 1e-6 / bw, "rel_err": err})
        print(f"  {matrix:8s} {method:36s} {us:7.2f} us  {100 * nbytes / us / 1e-6 / bw:5.1f}% copy  err {err:.2g}",
              flush=True)

    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (N, K) in DENSE.items():
        ws = [(torch.randn(N, K, device="cuda", generator=gen) * 0.02).to(torch.bfloat16) for _ in range(LAYERS)]
        x = torch.randn(1, K, device="cuda", generator=gen).to(torch.bfloat16)
        ref = (x.float() @ ws[0].float().T)[0]
        scale = ref.abs().max().item()
        nbytes = N * K * 2
        ys = [torch.empty(N, dtype=torch.bfloat16, device="cuda") for _ in ws]
        cands: list[tuple[str, Any]] = [
            ("cublas", lambda w, x=x: torch.nn.functional.linear(x, w)),
            (f"shipped {dense_kernels.ONE_ROW_DENSE[name]}",
             lambda w, x=x, v=moe_gemv.GEMV_VARIANTS[dense_kernels.ONE_ROW_DENSE[name]]: dense_kernels.gemv(
                 x, w, "bf16", v))]
        for meth, f in cands:
            err = ((f(ws[0])[0].float() - ref).abs().max() / scale).item()
            timed(name, meth, nbytes, [lambda w=w, f=f: f(w) for w in ws], err)
        for c in tiles(N):
            if deadline.left() < 10:
                break
            try:
                calls = [dense_call(w, x[0], y, c) for w, y in zip(ws, ys, strict=True)]
                calls[0]()
                err = ((ys[0].float() - ref).abs().max() / scale).item()
            except Exception as e:  # noqa: BLE001
                rows.append({"matrix": name, "method": label(c), "error": f"{type(e).__name__}: {e!s:.160}"})
                continue
            timed(name, label(c), nbytes, calls, err)
        del ws, ys
        torch.cuda.empty_cache()

    gu = (torch.randn(E, 2 * NI, H, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    x, routes, _ = token_routes(gen)
    idx = routes[0].se.long()
    g = x.float() @ gu[idx, :NI].float().transpose(1, 2)
    u = x.float() @ gu[idx, NI:].float().transpose(1, 2)
    href = (torch.nn.functional.silu(g) * u)[:, 0]
    nbytes = TOPK * 2 * NI * H * 2
    outs = [torch.empty(TOPK, NI, dtype=torch.bfloat16, device="cuda") for _ in routes]
    cur = moe_gemv.variant("bf16", 1) or moe_gemv.GEMV_VARIANTS["n16d32"]

    def shipped(r, o):
        moe_gemv.up(x, r.tok, r.se, r.se, gu, o, "bf16", E, NI, False, 1, cur)
    shipped(routes[0], outs[0])
    err = ((outs[0].float() - href).abs().max() / href.abs().max()).item()
    timed("gate/up", "shipped", nbytes, [lambda r=r, o=o: shipped(r, o) for r, o in zip(routes, outs, strict=True)],
          err)
    for c in tiles(NI):
        if deadline.left() < 10 or c["persistent"]:
            continue
        try:
            calls = [up_call(gu, x[0], r.se, o, c) for r, o in zip(routes, outs, strict=True)]
            calls[0]()
            err = ((outs[0].float() - href).abs().max() / href.abs().max()).item()
        except Exception as e:  # noqa: BLE001
            rows.append({"matrix": "gate/up", "method": label(c), "error": f"{type(e).__name__}: {e!s:.160}"})
            continue
        timed("gate/up", label(c), nbytes, calls, err)

    best = {}
    for m in dict.fromkeys(r["matrix"] for r in rows):
        ok = [r for r in rows if r["matrix"] == m and "us" in r and r["rel_err"] < 1e-2]
        if ok:
            best[m] = min(ok, key=lambda r: r["us"])["method"]
    print_table(f"One-row BF16 products, graph of 48 calls each (copy {bw / 1e9:,.0f} GB/s)",
                ["matrix", "method", "us", "GB/s", "% copy", "rel err"],
                [[r["matrix"], r["method"], f"{r['us']:.2f}", f"{r['GBs']:,.0f}", f"{100 * r['frac_copy']:.1f}",
                  f"{r['rel_err']:.2g}"] if "us" in r else [r["matrix"], r["method"], r["error"], "", "", ""]
                 for r in rows])
    print("fastest:", best)
    print("wrote", write_json("tma_gemv.json", {"machine": machine(), "copy_bandwidth_Bps": bw, "rows": rows,
                                                "best": best}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
