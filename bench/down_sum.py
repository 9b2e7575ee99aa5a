"""The one-row experts' down products, their top-k sum and the residual (runtime/gpu/moe_gemv.py `down_sum`), per tile
and grid, on the Qwen3-30B-A3B shape.

    python bench/down_sum.py [--max-seconds 200]

A token's 8 experts of 128 (down: 2048 x 768 BF16 each, 25.2 MB for the 8) with a different top-8 for each of 48
calls (one per layer, so the 50 MB L2 holds no previous call's weights, as in a step), captured as one CUDA graph of
the 48 calls and replayed; the median time per call is what the launch costs inside a graph-replayed step. The
candidates: the kernel's tiles (a program per BN output rows, its whole tile loaded in one go) at several BN and
warp counts. Next to each: GB/s of weights read and the share of the copy bandwidth measured in the same run, and
the largest difference from float32 math relative to the largest |value|. (A looping grid, PER_SM programs a
multiprocessor each walking row groups with the next tile prefetched, measured 11.7-27 us against 10.6 and was
dropped: bench/results/h200_session10/probe/, its code there as down_sum_loop.py.txt.)

Writes `down_sum.json` with the fastest candidate.
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

H, NI, E, TOPK, LAYERS = 2048, 768, 128, 8, 48


def candidates() -> dict[str, dict[str, int]]:
    from runtime.gpu import moe_gemv

    out: dict[str, dict[str, int]] = {"shipped": dict(moe_gemv.DOWN_SUM or {"BN": 2, "num_warps": 4})}
    for bn in (1, 2, 4):
        for warps in (2, 4, 8):
            out[f"bn{bn} w{warps}"] = {"BN": bn, "num_warps": warps}
    return out


def rows(bw: float, deadline: Deadline) -> list[dict[str, Any]]:
    from runtime.gpu import moe_gemv, moe_kernels

    gen = torch.Generator(device="cuda").manual_seed(1)
    dn = (torch.randn(E, H, NI, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    pos = torch.zeros(1, dtype=torch.int32, device="cuda")
    routes = [moe_kernels.route(torch.randn(1, E, device="cuda", generator=gen), pos, TOPK, True)
              for _ in range(LAYERS)]
    hs = [torch.randn(TOPK, NI, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]
    res = [torch.randn(1, H, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]
    r0 = routes[0]
    idx = r0.se.long()
    y = torch.einsum("pk,pnk->pn", hs[0].float(), dn[idx].float())          # sorted pair p's rows
    ref = res[0].float()[0] + (y * r0.w.reshape(-1)[r0.order.long()][:, None]).sum(0)
    nbytes = TOPK * H * NI * 2
    out: list[dict[str, Any]] = []
    for label, c in candidates().items():
        if deadline.left() < 5:
            break

        def call(r, h, x, c=c):
            return moe_gemv.down_sum(h, r.se, r.order, r.w.reshape(-1), dn, x, TOPK, c, True)
        try:
            got = call(routes[0], hs[0], res[0])
            us = graph_us([lambda r=r, h=h, x=x: call(r, h, x) for r, h, x in zip(routes, hs, res, strict=True)])
        except Exception as e:  # noqa: BLE001 - a candidate this build cannot run: a row of the table
            out.append({"method": label, "cfg": c, "error": f"{type(e).__name__}: {str(e)[:160]}"})
            continue
        out.append({"method": label, "cfg": c, "us": us, "GBs": nbytes / us / 1e3,
                    "frac_copy": nbytes / us / 1e-6 / bw,
                    "rel_err": (got.float()[0] - ref).abs().max().item() / ref.abs().max().item()})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-seconds", type=float, default=200.0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/down_sum.py needs a CUDA GPU; run it on one.", file=sys.stderr)
        return 2
    deadline = Deadline(args.max_seconds)
    bw = copy_bandwidth()
    res: dict[str, Any] = {"machine": machine(), "copy_bandwidth_Bps": bw, "rows": rows(bw, deadline)}
    ok = [r for r in res["rows"] if "us" in r and r["rel_err"] < 1e-2]
    res["best"] = min(ok, key=lambda r: r["us"])["method"] if ok else None
    print_table(f"One-row down + top-k sum + residual, A3B, graph of 48 calls (copy {bw / 1e9:,.0f} GB/s)",
                ["method", "us", "GB/s", "% copy", "rel err"],
                [[r["method"], f"{r['us']:.2f}", f"{r['GBs']:,.0f}", f"{100 * r['frac_copy']:.1f}",
                  f"{r['rel_err']:.2g}"] if "us" in r else [r["method"], r["error"], "", "", ""]
                 for r in res["rows"]])
    print("fastest:", res["best"])
    print("wrote", write_json("down_sum.json", res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
