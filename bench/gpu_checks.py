"""GPU correctness of the Triton kernels (bf16, against plain torch) and their row invariance, plus the quantized
linear before/after (per-call torch dequantize vs dequantize-in-kernel).

    python bench/gpu_checks.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import machine, median, print_table, write_json  # noqa: E402
from runtime.formats.quant_linear import QuantLinear  # noqa: E402
from runtime.gpu import (
    attention_kernels,  # noqa: E402
    kernels,  # noqa: E402
    moe_kernels,  # noqa: E402
)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def time_ms(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return median(ts)


def check_moe(T: int, H: int, NI: int, E: int, k: int) -> dict[str, Any]:
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(T, H, device=dev).to(dt)
    gu = (torch.randn(E, 2 * NI, H, device=dev) * 0.02).to(dt)
    dn = (torch.randn(E, H, NI, device=dev) * 0.02).to(dt)
    idx = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(T)])
    w = torch.rand(T, k, device=dev).to(dt)
    out = moe_kernels.moe_grouped(x, idx, w, gu, dn)
    ref = torch.zeros(T, H, device=dev)
    for t in range(T):
        for j in range(k):
            e = int(idx[t, j])
            g, u = (x[t].float() @ gu[e].float().t()).chunk(2)
            ref[t] += float(w[t, j]) * ((F.silu(g) * u) @ dn[e].float().t())
    # row invariance at this width: each row's bits with the other rows replaced (a one-row launch may take other
    # kernels than a wider one, docs/models.md "Numerics": rows are compared within one width)
    inv = True
    for i in range(T):
        x2, idx2 = torch.randn(T, H, device=dev).to(dt), torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(T)])
        w2 = torch.rand(T, k, device=dev).to(dt)
        x2[i], idx2[i], w2[i] = x[i], idx[i], w[i]
        inv = inv and torch.equal(moe_kernels.moe_grouped(x2, idx2, w2, gu, dn)[i], out[i])
    return {"rel_err": rel(out, ref), "row_invariant": inv}


def check_attention(nh: int, nkv: int, hd: int, S: int, W: int) -> dict[str, Any]:
    dev, dt = "cuda", torch.bfloat16
    kc = torch.randn(nkv, S, hd, device=dev).to(dt)
    vc = torch.randn(nkv, S, hd, device=dev).to(dt)
    q = torch.randn(W, nh, hd, device=dev).to(dt)
    pos = torch.arange(S - W, S, device=dev, dtype=torch.int32)
    o = attention_kernels.attention(q, kc, vc, pos, hd ** -0.5)
    errs = []
    for r in range(W):
        p = int(pos[r])
        kk = kc[:, : p + 1].float().repeat_interleave(nh // nkv, 0)
        vv = vc[:, : p + 1].float().repeat_interleave(nh // nkv, 0)
        att = torch.softmax((q[r].float()[:, None] @ kk.transpose(1, 2))[:, 0] * hd ** -0.5, -1)
        errs.append(rel(o[r], (att[:, None] @ vv)[:, 0]))
    inv = all(torch.equal(attention_kernels.attention(q[r:r + 1], kc, vc, pos[r:r + 1], hd ** -0.5)[0], o[r]) for r in range(W))
    return {"rel_err": max(errs), "row_invariant": inv}


def check_quant(N: int, K: int, M: int) -> list[dict[str, Any]]:
    out = []
    for qt in ("q8_0", "q5_0", "q4_0"):
        w = torch.randn(N, K) * 0.02
        ql = QuantLinear.from_float(w, qt).cuda()
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        ref = x.float() @ ql.dequantized_weight().t()
        y = ql(x)
        err = rel(y, ref)
        kernels.ENABLED = False
        try:
            t_torch = time_ms(lambda: ql(x))     # noqa: B023
        finally:
            kernels.ENABLED = True
        t_kernel = time_ms(lambda: ql(x))         # noqa: B023
        out.append({"qtype": qt, "N": N, "K": K, "M": M, "rel_err": err, "torch_dequant_ms": t_torch,
                    "kernel_ms": t_kernel, "bytes": ql.weight_nbytes,
                    "kernel_GBs": ql.weight_nbytes / (t_kernel * 1e-3) / 1e9})
    return out


def graph_time_ms(fn, inner: int = 20, reps: int = 10) -> float:
    """Device time of one `fn()` replayed from a CUDA graph of `inner` calls (launch gaps excluded: eager timing on
    this machine measures the launches, not the kernels)."""
    from runtime.gpu.capture import capture

    g, _ = capture(lambda: [fn() for _ in range(inner)])
    for _ in range(3):
        g.replay()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / inner)
    return median(ts)


def tune_moe(T: int = 1, H: int = 2048, NI: int = 768, E: int = 128, k: int = 8) -> dict[str, Any]:
    """Time the expert kernels of the 30B-A3B shape (one decode token, 8 of 128 experts) for a few tile shapes inside
    a CUDA graph; keep the fastest (module-level `moe_kernels.MOE_UP` / `MOE_DOWN`, used by the decode benchmark in the
    same process). Weight sets rotate so the experts come from HBM, not L2."""
    dev, dt = "cuda", torch.bfloat16
    sets = 4
    gus = [(torch.randn(E, 2 * NI, H, device=dev) * 0.02).to(dt) for _ in range(sets)]
    dns = [(torch.randn(E, H, NI, device=dev) * 0.02).to(dt) for _ in range(sets)]
    x = torch.randn(T, H, device=dev).to(dt)
    pos = torch.zeros(T, dtype=torch.int32, device=dev)
    routes = [moe_kernels.route(torch.randn(T, E, device=dev).to(dt), pos, k, True) for _ in range(sets)]
    cands = [{"BN": 64, "BK": 64, "num_warps": 4, "num_stages": 3}, {"BN": 32, "BK": 128, "num_warps": 4, "num_stages": 3},
             {"BN": 32, "BK": 64, "num_warps": 4, "num_stages": 4}, {"BN": 16, "BK": 128, "num_warps": 4, "num_stages": 4},
             {"BN": 16, "BK": 256, "num_warps": 4, "num_stages": 3}, {"BN": 32, "BK": 256, "num_warps": 8, "num_stages": 3}]
    moved = k * 3 * H * NI * 2

    def call(i: list[int] = [0]) -> None:   # noqa: B006 (a call counter: rotates the weight sets)
        j = i[0] % sets
        i[0] += 1
        moe_kernels.moe_routed(x, x, routes[j], gus[j], dns[j])

    out: dict[str, Any] = {"bytes_per_call": moved, "up": [], "down": []}
    for part in ("up", "down"):
        best = None
        for c in cands:
            if part == "up":
                moe_kernels.MOE_UP = c
            else:
                moe_kernels.MOE_DOWN = c
            try:
                t = graph_time_ms(call)
            except Exception as e:  # a shape this Triton cannot build: skip it
                out[part].append({**c, "error": str(e)[:200]})
                continue
            out[part].append({**c, "ms": t, "GBs": moved / (t * 1e-3) / 1e9})
            if best is None or t < best[0]:
                best = (t, c)
        if best is not None:
            if part == "up":
                moe_kernels.MOE_UP = best[1]
            else:
                moe_kernels.MOE_DOWN = best[1]
        out[f"best_{part}"] = best[1] if best else None
    out["best_ms"] = graph_time_ms(call)
    out["best_GBs"] = moved / (out["best_ms"] * 1e-3) / 1e9
    return out


def main() -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_checks.py needs a CUDA GPU.")
    torch.manual_seed(0)
    res: dict[str, Any] = {"machine": machine()}
    res["moe"] = {"nano_T1": check_moe(1, 256, 64, 8, 2), "nano_T8": check_moe(8, 256, 64, 8, 2),
                  "a3b_T1": check_moe(1, 2048, 768, 128, 8), "a3b_T16": check_moe(16, 2048, 768, 128, 8)}
    res["attention"] = {"nano": check_attention(4, 2, 64, 300, 8), "a3b": check_attention(32, 4, 128, 1000, 16)}
    res["quant"] = check_quant(256, 768, 8) + check_quant(4096, 4096, 1)
    res["moe_tuning"] = tune_moe()
    t = res["moe_tuning"]
    print(f"MoE tiles: up {t['best_up']}, down {t['best_down']}: {t['best_ms']:.3f} ms per decode token-layer "
          f"({t['best_GBs']:.0f} GB/s of expert weights)", flush=True)
    for part in ("up", "down"):
        for c in t[part]:
            print(f"  {part} {c}", flush=True)
    rows = [[f"moe {k}", v["rel_err"], v["row_invariant"]] for k, v in res["moe"].items()]
    rows += [[f"attention {k}", v["rel_err"], v["row_invariant"]] for k, v in res["attention"].items()]
    rows += [[f"{q['qtype']} {q['N']}x{q['K']} M={q['M']}", q["rel_err"],
              f"torch {q['torch_dequant_ms']:.3f} ms -> kernel {q['kernel_ms']:.3f} ms ({q['kernel_GBs']:.0f} GB/s)"]
             for q in res["quant"]]
    print_table("Triton kernels on the GPU (bf16 vs fp32 torch reference)", ["check", "rel err", "row-invariant / time"],
                rows)
    write_json("gpu_checks.json", res)
    return res


if __name__ == "__main__":
    main()
