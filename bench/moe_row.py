"""The one-row MoE half in one persistent launch (runtime/gpu/moe_row.py) against the four launches the step ships
(residual + RMSNorm + router product, routing, experts' gate/up, down + top-k sum + residual), on the A3B shape.

    python bench/moe_row.py [--max-seconds 240] [--layers 48] [--quant q4_0]

The Qwen3-30B-A3B MoE (128 experts of 768, top 8, hidden 2048, BF16): one set of experts (1.2 GB, so the 50 MB L2
holds no earlier call's experts; `--quant`: random Q8_0 / Q4_0 / IQ4_NL blocks as bench/quant_target.py makes them), and per call its own router (random, so each call routes its own row to its own 8
experts: honest routing) and residual delta. Calls form a chain as layers do: each call's input row is the previous
call's output. The chain is captured as one CUDA graph and replayed; the median time per call is what the MoE half
costs inside a graph-replayed one-row step. Next to it: the bytes at the copy bandwidth measured in the same run,
and the check against the shipped path (the same experts picked, the output's largest difference relative to its
largest |value|). Candidates: the shipped launches with the experts split over the intermediate
(runtime/gpu/moe_split.py, `ffn-<tile>` for each of its TILES, BF16 only); the persistent kernel's tiles
(`moe_row.TILE` keys), and "phases" (the same kernel as three launches, no grid barrier). Also an empty
persistent launch with and without two grid barriers (what the barriers cost by themselves).

Writes `moe_row_<quant>.json`.
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

H, NI, E, TOPK, EPS = 2048, 768, 128, 8, 1e-6

CANDIDATES: dict[str, dict[str, Any]] = {
    "persistent": {},
    "pps1": {"PPS": 1},
    "rd1": {"RD": 1},
    "rd4": {"RD": 4},
    "ru2": {"RU": 2},
    "ru8": {"RU": 8},
    "st2-1": {"ST2": 1},
    "st2-4": {"ST2": 4},
    "st3-1": {"ST3": 1},
    "no-pre3": {"PRE3": 0},
    "w4": {"num_warps": 4},
    "w16": {"num_warps": 16, "PPS": 1},
    "phases": {"split": True},
}
QCANDIDATES: dict[str, dict[str, Any]] = {
    "persistent": {},
    "ru2": {"RU": 2},
    "ru8": {"RU": 8},
    "rd2": {"RD": 2},
    "rd8": {"RD": 8},
    "pps2": {"PPS": 2},
    "w8": {"num_warps": 8, "PPS": 2},
    "w8-ru2-rd2": {"num_warps": 8, "PPS": 2, "RU": 2, "RD": 2},
    "w2": {"num_warps": 2, "PPS": 8},
    "phases": {"split": True},
}


def setup(layers: int, fmt: str | None):
    gen = torch.Generator(device="cuda").manual_seed(3)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * s).to(torch.bfloat16)
    if fmt is None:
        gate_up = rnd(E, 2 * NI, H, s=0.02)
        down = rnd(E, H, NI, s=0.02)
    else:
        from bench.quant_target import random_blocks

        gate_up = random_blocks(E * 2 * NI, H, fmt, gen, "cuda").reshape(E, 2 * NI, -1)
        down = random_blocks(E * H, NI, fmt, gen, "cuda", 0.02).reshape(E, H, -1)
    routers = [rnd(E, H, s=0.05) for _ in range(layers)]
    norms = [(torch.rand(H, device="cuda", generator=gen) + 0.5).to(torch.bfloat16) for _ in range(layers)]
    deltas = [rnd(1, H, s=0.5) for _ in range(layers)]
    x0 = rnd(1, H)
    return gate_up, down, routers, norms, deltas, x0


def shipped(x, d, nw, wr, pos, gate_up, down, fmt):
    from runtime.gpu import dense_kernels, moe_kernels

    fused = dense_kernels.norm_one_row(x, d, nw, EPS, wr, "router")
    if fused is None:
        raise RuntimeError("the router's one-row variant did not apply")
    xo, h, lg = fused
    r = moe_kernels.route(lg, pos, TOPK, True)
    return moe_kernels.moe_routed(h, xo, r, gate_up, down, fmt=fmt), r.idx


def barrier_cost(layers: int) -> dict[str, float]:
    """us per launch of an empty persistent kernel (the grid `moe_row` would use for BF16: 2 programs of 8 warps an
    SM) with 0 and with 2 grid barriers, `layers` launches in a graph: what the barriers cost by themselves."""
    from runtime.gpu import moe_row, pdl

    dev = torch.device("cuda")
    nprog = torch.cuda.get_device_properties(dev).multi_processor_count * 2
    out = torch.zeros(nprog, device=dev)
    res = {}
    for n in (0, 2):
        bars = [moe_row.Barrier(dev) for _ in range(layers)]
        calls = [lambda b=b, n=n: moe_row._barrier_probe[(nprog,)](b.count, out, nprog, N=n, num_warps=8,
                                                                  **pdl.launch(out))
                 for b in bars]
        for c in calls:
            c()
        torch.cuda.synchronize()
        res[f"{n}_barriers_us"] = graph_us([lambda calls=calls: [c() for c in calls]]) / layers
        res[f"{n}_barriers_gave_up"] = any(b.gave_up() for b in bars)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-seconds", type=float, default=240.0)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--only", default="", help="comma-separated candidate names (default: all)")
    ap.add_argument("--quant", default="bf16", choices=("bf16", "q8_0", "q4_0", "iq4_nl"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/moe_row.py needs a CUDA GPU; run it on one.", file=sys.stderr)
        return 2
    from runtime.gpu import moe_row

    deadline = Deadline(args.max_seconds)
    bw = copy_bandwidth()
    L = args.layers
    fmt = None if args.quant == "bf16" else args.quant
    gate_up, down, routers, norms, deltas, x0 = setup(L, fmt)
    pos = torch.zeros(1, dtype=torch.int32, device="cuda")
    # the routed experts and the router
    nbytes = TOPK * (2 * NI * gate_up[0, 0].nbytes + H * down[0, 0].nbytes) + E * H * 2
    rows: list[dict[str, Any]] = []

    def chain(step):
        xs = [x0]
        for i in range(L):
            xs.append(step(i, xs[-1]))
        return xs[-1]

    ref_out, ref_idx = shipped(x0, deltas[0], norms[0], routers[0], pos, gate_up, down, fmt)
    us = graph_us([lambda: chain(lambda i, x: shipped(x, deltas[i], norms[i], routers[i], pos, gate_up, down, fmt)[0])])
    rows.append({"method": "shipped (4 launches)", "us": us / L, "GBs": nbytes / (us / L) / 1e3,
                 "frac_copy": nbytes / (us / L * 1e-6) / bw, "same_experts": True, "rel_err": 0.0})
    print(f"shipped: {us / L:.2f} us a call", flush=True)
    only = [s for s in args.only.split(",") if s]
    # the four launches with the experts split over the intermediate (runtime/gpu/moe_split.py): gate/up and each
    # slice's down share in one grid, then the partials' sum, in place of gate/up then down + sum
    if fmt is None:
        from runtime.gpu import moe_split

        for name, tile in moe_split.TILES.items():
            label = f"ffn-{name}"
            if (only and label not in only) or deadline.left() < 10:
                continue
            moe_split.TILE = tile
            try:
                out, idx = shipped(x0, deltas[0], norms[0], routers[0], pos, gate_up, down, fmt)
                torch.cuda.synchronize()
                t = graph_us([lambda: chain(lambda i, x: shipped(x, deltas[i], norms[i], routers[i], pos, gate_up,
                                                                 down, fmt)[0])]) / L
            except Exception as e:  # noqa: BLE001 - a tile this build cannot run: a row of the table
                rows.append({"method": label, "cfg": tile, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                print(label, rows[-1]["error"], flush=True)
                continue
            finally:
                moe_split.TILE = None
            err = (out.float() - ref_out.float()).abs().max().item() / ref_out.float().abs().max().item()
            rows.append({"method": label, "cfg": tile, "us": t, "GBs": nbytes / t / 1e3,
                         "frac_copy": nbytes / (t * 1e-6) / bw, "same_experts": bool(torch.equal(idx, ref_idx)),
                         "rel_err": err, "gave_up": moe_split.gave_up()})
            print(f"{label}: {t:.2f} us a call, rel err {err:.2g}"
                  f"{', A TAIL PROGRAM GAVE UP' if moe_split.gave_up() else ''}", flush=True)
    for label, c in (CANDIDATES if fmt is None else QCANDIDATES).items():
        if (only and label not in only) or deadline.left() < 10:
            continue
        c = dict(c)
        split = bool(c.pop("split", False))
        bars = [moe_row.Barrier(torch.device("cuda")) for _ in range(L)]

        def step(i, x, c=c, split=split, bars=bars):
            return moe_row.moe_row(x, deltas[i], norms[i], EPS, routers[i], pos, gate_up, down, TOPK, True,
                                   bars[i], c, split=split, fmt=fmt)
        try:
            out, idx, _ = step(0, x0)
            torch.cuda.synchronize()
            t = graph_us([lambda step=step: chain(lambda i, x: step(i, x)[0])]) / L
        except Exception as e:  # noqa: BLE001 - a candidate this build cannot run: a row of the table
            rows.append({"method": label, "cfg": c, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            print(label, rows[-1]["error"], flush=True)
            continue
        same = bool(torch.equal(idx.sort().values, ref_idx.sort().values))
        err = (out.float() - ref_out.float()).abs().max().item() / ref_out.float().abs().max().item()
        key = [k for k in moe_row._GRID if k[0] == x0.device]
        gave_up = any(b.gave_up() for b in bars) or bool(moe_row.FAILED)
        rows.append({"method": label, "cfg": c, "us": t, "GBs": nbytes / t / 1e3, "frac_copy": nbytes / (t * 1e-6) / bw,
                     "same_experts": same, "rel_err": err, "grids": sorted({moe_row._GRID[k] for k in key}),
                     "barrier_gave_up": gave_up})
        print(f"{label}: {t:.2f} us a call, same experts {same}, rel err {err:.2g}"
              f"{', A BARRIER GAVE UP' if gave_up else ''}", flush=True)
    try:
        bar = barrier_cost(L)
        print(f"an empty persistent launch: {bar['0_barriers_us']:.2f} us, with two grid barriers "
              f"{bar['2_barriers_us']:.2f} us", flush=True)
    except Exception as e:  # noqa: BLE001 - the probe is extra: its failure is reported, not fatal
        bar = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    res = {"machine": machine(), "copy_bandwidth_Bps": bw, "layers": L, "quant": args.quant, "bytes_per_call": nbytes,
           "barrier_probe": bar,
           "rows": rows}
    print_table(f"One-row MoE half (router .. down + sum), A3B {args.quant}, graph of {L} chained calls "
                f"(copy {bw / 1e9:,.0f} GB/s; bytes {nbytes / 1e6:.1f} MB = {nbytes / bw * 1e6:.2f} us)",
                ["method", "us", "GB/s", "% copy", "same experts", "rel err"],
                [[r["method"], f"{r['us']:.2f}", f"{r['GBs']:,.0f}", f"{100 * r['frac_copy']:.1f}",
                  str(r["same_experts"]), f"{r['rel_err']:.2g}"] if "us" in r else [r["method"], r["error"], "", "",
                                                                                      "", ""]
                 for r in rows])
    print("wrote", write_json(f"moe_row_{args.quant}.json", res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
