"""A one-row window's attention (a target decoding alone) in three launches, two or one, checked and timed.

    python bench/attn_one.py [--contexts 1024,4096,16384,32768,131072] [--checks 40] [--max-seconds 240]

The A3B shape's attention (32 query heads, 4 KV heads of 128) for one row at the end of a context of C positions,
from its raw q/k/v projection: "three" is `qkv_post` (q/k norm, RoPE, the cache write) then
`attention_kernels.attention` (the split kernel and its reduction), "fuse1" and "fuse2" are
`attention_kernels.attention_one` with the reduction apart, the chunks combined in the split kernel, or combined
there up to COMBINE_UPTO chunks (`ONE_ROW_FUSE` 1, 2, 3). 16 calls on 16 distinct caches captured as one CUDA graph (a previous call's cache is not in L2),
median of 20 replays, BF16 and q8_0 caches, PDL as the runtime launches it (the calls are back to back).

The check, before any timing: the cache slot the row writes holds NaN before each call (so a read of it before the
write, or a combination of partials not yet written, shows), at `--checks` positions spread over the context; each
fused form must write the cache slot with the same bits as `qkv_post` and give the same output up to the order of
its sums (max |difference| and relative error reported; the run fails above 1e-2 relative). Writes
`attn_one.json`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import Deadline, copy_bandwidth, machine, print_table, write_json  # noqa: E402
from bench.gemv_one_row import graph_us  # noqa: E402

NH, NKV, HD, COPIES = 32, 4, 128, 16
ARMS = {"three": 0, "fuse1": 1, "fuse2": 2, "fuse3": 3}


def layer(ctx: int, q8: bool, gen: torch.Generator) -> dict[str, Any]:
    """One layer's cache of capacity ctx + 64 (q8_0: codes and scales) and its norm weights."""
    from runtime.kv import quantize_q8_0

    S = ctx + 64
    k = torch.randn(NKV, S, HD, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(NKV, S, HD, device="cuda", dtype=torch.bfloat16, generator=gen)
    if q8:
        (kc, ks), (vc, vs) = quantize_q8_0(k), quantize_q8_0(v)
    else:
        kc, vc, ks, vs = k, v, None, None
    return {"kc": kc, "vc": vc, "ks": ks, "vs": vs,
            "qw": (1 + 0.1 * torch.randn(HD, device="cuda", generator=gen)).to(torch.bfloat16),
            "kw": (1 + 0.1 * torch.randn(HD, device="cuda", generator=gen)).to(torch.bfloat16)}


def call(arm: str, L: dict[str, Any], qkv: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor,
         part: torch.Tensor) -> torch.Tensor:
    from runtime.gpu import attention_kernels as ak

    if ARMS[arm] == 0:
        q = ak.qkv_post(qkv, L["qw"], L["kw"], inv, 1.0, pos, L["kc"], L["vc"], NH, NKV, HD, 1e-6, ks=L["ks"],
                        vs=L["vs"])
        return ak.attention(q, L["kc"], L["vc"], pos, HD ** -0.5, ks=L["ks"], vs=L["vs"], part=part)
    return ak.attention_one(qkv, L["qw"], L["kw"], inv, 1.0, pos, L["kc"], L["vc"], NH, NKV, HD, 1e-6, HD ** -0.5,
                            ks=L["ks"], vs=L["vs"], part=part, mode=ARMS[arm])


def poisoned(L: dict[str, Any], p: int) -> dict[str, Any]:
    """A copy of the layer whose slot p holds NaN (a q8_0 cache: NaN scales)."""
    M = dict(L)
    for key in ("kc", "vc", "ks", "vs"):
        if L[key] is not None:
            M[key] = L[key].clone()
    if L["ks"] is None:
        M["kc"][:, p] = float("nan")
        M["vc"][:, p] = float("nan")
    else:
        M["ks"][:, p] = float("nan")
        M["vs"][:, p] = float("nan")
    return M


def check(ctx: int, q8: bool, n: int, gen: torch.Generator) -> list[dict[str, Any]]:
    from runtime.gpu import attention_kernels as ak
    from runtime.kv import SPLIT_COUNTERS

    L = layer(ctx, q8, gen)
    inv = 1.0 / (1e6 ** (torch.arange(0, HD, 2, device="cuda", dtype=torch.float32) / HD))
    part = ak.split_scratch(1, NH, ctx + 64, HD, "cuda")
    worst = {a: [0.0, 0.0, True] for a in ARMS if a != "three"}
    for p in torch.linspace(0, ctx - 1, n).round().int().tolist():
        pos = torch.tensor([p], device="cuda", dtype=torch.int32)
        qkv = torch.randn(1, (NH + 2 * NKV) * HD, device="cuda", dtype=torch.bfloat16, generator=gen)
        R = poisoned(L, p)
        ref = call("three", R, qkv, pos, inv, part).float()
        for arm in worst:
            M = poisoned(L, p)
            o = call(arm, M, qkv, pos, inv, part).float()
            same_cache = all(torch.equal(M[k], R[k]) for k in ("kc", "vc") if M[k] is not None) and (
                not q8 or (torch.equal(M["ks"], R["ks"]) and torch.equal(M["vs"], R["vs"])))
            diff = float((o - ref).abs().max())
            rel = float((o - ref).norm() / ref.norm())
            w = worst[arm]
            w[0], w[1], w[2] = max(w[0], diff), max(w[1], rel), w[2] and same_cache and bool(torch.isfinite(o).all())
    assert int(part[-SPLIT_COUNTERS:].view(torch.int32).abs().sum()) == 0, "counters not back at zero"
    return [{"context": ctx, "kv_dtype": "q8_0" if q8 else "bf16", "arm": a, "positions": n, "max_abs_diff": w[0],
             "max_rel_err": w[1], "cache_bits_equal_and_finite": w[2], "ok": w[2] and w[1] < 1e-2}
            for a, w in worst.items()]


def timing(ctx: int, q8: bool, bw: float, gen: torch.Generator) -> list[dict[str, Any]]:
    from runtime.gpu import attention_kernels as ak
    from runtime.kv import split_chunks

    layers = [layer(ctx, q8, gen) for _ in range(COPIES)]
    inv = 1.0 / (1e6 ** (torch.arange(0, HD, 2, device="cuda", dtype=torch.float32) / HD))
    qkv = torch.randn(1, (NH + 2 * NKV) * HD, device="cuda", dtype=torch.bfloat16, generator=gen)
    pos = torch.tensor([ctx - 1], device="cuda", dtype=torch.int32)
    part = ak.split_scratch(1, NH, ctx + 64, HD, "cuda")
    row_bytes = HD * 2 if not q8 else HD + HD // 32 * 2
    nbytes = ctx * NKV * row_bytes * 2
    rows = []
    for arm in ARMS:
        calls = [lambda L=L, a=arm: call(a, L, qkv, pos, inv, part) for L in layers]
        us = graph_us(calls)
        rows.append({"context": ctx, "kv_dtype": "q8_0" if q8 else "bf16", "arm": arm, "us": us, "bytes": nbytes,
                     "frac_of_copy": nbytes / us / 1e-6 / bw, "chunks": split_chunks(ctx + 64)})
    del layers
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="1024,4096,16384,32768,131072")
    ap.add_argument("--checks", type=int, default=40)
    ap.add_argument("--max-seconds", type=float, default=240)
    a = ap.parse_args()
    deadline = Deadline(a.max_seconds)
    bw = copy_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(0)
    checks: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    contexts = [int(c) for c in a.contexts.split(",")]
    for ctx in contexts:
        for q8 in (False, True):
            checks += check(ctx, q8, a.checks, gen)
    for ctx in contexts:
        for q8 in (False, True):
            if deadline.left() > 10:
                rows += timing(ctx, q8, bw, gen)
    print_table("one-row attention from q/k/v: the fused forms against qkv_post + attention (NaN in the written slot)",
                ["context", "kv", "arm", "positions", "max |diff|", "max rel err", "cache same", "ok"],
                [[c["context"], c["kv_dtype"], c["arm"], c["positions"], c["max_abs_diff"], c["max_rel_err"],
                  c["cache_bits_equal_and_finite"], c["ok"]] for c in checks])
    print_table(f"one-row attention, A3B heads, 16 layers in a graph (copy {bw / 1e9:,.0f} GB/s)",
                ["context", "kv", "arm", "us a layer", "% copy (KV read)"],
                [[r["context"], r["kv_dtype"], r["arm"], r["us"], 100 * r["frac_of_copy"]] for r in rows])
    write_json("attn_one.json", {"machine": machine(), "copy_bytes_s": bw, "args": vars(a), "checks": checks,
                                 "rows": rows})
    if not all(c["ok"] for c in checks):
        sys.exit("a fused one-row attention differs from qkv_post + attention (table above).")


if __name__ == "__main__":
    main()
