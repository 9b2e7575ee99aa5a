"""The fixed-width decode step with and without this runtime's launch-level options, side by side in one run.

    python bench/step_ab.py [--contexts 1024,32768] [--widths 1,8] [--rounds 5] [--steps 30] [--quant q4_0]

Arms (each a set of module switches, set before its CUDA graph is captured, so a graph bakes its arm in):
- before: no PDL, BF16 experts of a one-row step on the tl.dot tiles, dense projections on cuBLAS (the runtime
  before PDL and the one-row choices);
- pdl: the step's Triton kernels launched with programmatic dependent launch (runtime/gpu/pdl.py);
- moe1: BF16 experts of a one-row step through the matrix-vector kernel (moe_gemv.DECODE_GEMV_ONE_ROW), no PDL;
- pdl+moe1: both;
- pdl+moe1+dense1: and the one-row BF16 projections (q/k/v, o_proj, router) through the matrix-vector kernel
  instead of cuBLAS (dense_kernels.GEMV_ONE_ROW).
Every (arm, context, width) step is captured once; then rounds of `steps` replays go over all of them interleaved
(drift hits every arm alike) and the median round is quoted. On the A3B shape with honest routing (bench/common.py),
BF16, all experts resident, BF16 KV with the context's first positions random. Bound for a one-row step: copy
bandwidth (measured here) / (dense weights + top-k experts of every layer + the KV cache up to the context).
Checks: a step's logits with PDL are bit-identical to the same step without (PDL changes launches, never
arithmetic); the one-row kernel choices change rounding only: the max |difference| and the top-1 agreement with
`before` are reported. `--quant q4_0` (or q8_0) also times a quantized build (bench/quant_target.py) with PDL off
and on. Writes `step_ab.json`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import copy_bandwidth, machine, median, print_table, write_json  # noqa: E402

ARMS: dict[str, dict[str, bool]] = {
    "before": {"pdl": False, "moe1": False, "dense1": False},
    "pdl": {"pdl": True, "moe1": False, "dense1": False},
    "moe1": {"pdl": False, "moe1": True, "dense1": False},
    "pdl+moe1": {"pdl": True, "moe1": True, "dense1": False},
    "pdl+moe1+dense1": {"pdl": True, "moe1": True, "dense1": True},
}


def set_arm(arm: dict[str, bool], one_row: dict[str, str | None]) -> None:
    """The module switches of one arm (the defaults restored for the parts it leaves off)."""
    from runtime.gpu import dense_kernels, moe_gemv, pdl

    pdl.ENABLED = arm["pdl"]
    moe_gemv.DECODE_GEMV_ONE_ROW.clear()
    if arm["moe1"]:
        moe_gemv.DECODE_GEMV_ONE_ROW.update(one_row)
    dense_kernels.GEMV_ONE_ROW = arm["dense1"]


def one_step(step, kv, win) -> torch.Tensor:
    """The logits of one step at the cache's length (rolled back after)."""
    ctx = kv.length
    out = step(win, kv)
    kv.rollback(ctx)
    return out.logits.float().clone()


def time_steps(step, kv, win, n: int) -> float:
    """Milliseconds per step over n replays (host side included: what the engine pays)."""
    ctx = kv.length
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        step(win, kv)
        kv.rollback(ctx)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def run(model, arms: list[str], contexts: list[int], widths: list[int], rounds: int, steps: int, tag: str,
        one_row: dict[str, str | None]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from bench.context import gen, make_kv
    from runtime.gpu.static_step import StaticStep

    vocab = model.cfg.vocab_size
    steps_by: dict[tuple[str, int, int], Any] = {}
    kvs = {c: make_kv(model, c, "bf16", capacity=c + 64) for c in contexts}
    wins = {w: torch.randint(0, vocab, (1, w), device="cuda", generator=gen(w)) for w in widths}
    logits: dict[tuple[str, int, int], torch.Tensor] = {}
    errors: dict[str, list[str]] = {}
    for a in arms:
        set_arm(ARMS[a], one_row)
        for c in contexts:
            for w in widths:
                st = StaticStep(model, kvs[c], w, graph=True)
                for _ in range(2):                        # capture, then one replay
                    logits[(a, c, w)] = one_step(st, kvs[c], wins[w])
                errors[f"{a}/{c}/{w}"] = list(st.errors)
                steps_by[(a, c, w)] = st
    set_arm(ARMS["before"] if "before" in arms else ARMS[arms[0]], one_row)
    times: dict[tuple[str, int, int], list[float]] = {k: [] for k in steps_by}
    for r in range(rounds):
        order = list(steps_by)
        order = order[r % len(order):] + order[:r % len(order)]
        for k in order:
            times[k].append(time_steps(steps_by[k], kvs[k[1]], wins[k[2]], steps))
    rows = []
    for (a, c, w), ts in times.items():
        ref = logits.get(("before", c, w))
        got = logits[(a, c, w)]
        row = {"build": tag, "arm": a, "context": c, "width": w, "step_ms": median(ts), "rounds_ms": ts,
               "graph": steps_by[(a, c, w)].use_graph, "errors": errors[f"{a}/{c}/{w}"]}
        if ref is not None:
            row["bit_equal_to_before"] = bool(torch.equal(got, ref))
            row["max_abs_diff"] = float((got - ref).abs().max())
            row["top1_agree"] = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
        rows.append(row)
    checks = []
    if "before" in arms and "pdl" in arms:
        for c in contexts:
            for w in widths:
                ok = bool(torch.equal(logits[("pdl", c, w)], logits[("before", c, w)]))
                checks.append({"build": tag, "check": f"pdl == before (context {c}, width {w})", "ok": ok})
    for st in steps_by.values():
        st.graphs.clear()
    del steps_by, kvs
    torch.cuda.empty_cache()
    return rows, checks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,32768")
    ap.add_argument("--widths", default="1,8")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--quant", default="", help="also time a quantized build (q4_0, q8_0) with PDL off and on")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/step_ab.py needs a CUDA GPU.", file=sys.stderr)
        return 2
    from bench.context import build_a3b, kv_bytes_per_position, weight_bytes
    from runtime.gpu import moe_gemv, pdl

    one_row = dict(moe_gemv.DECODE_GEMV_ONE_ROW)
    contexts = [int(x) for x in args.contexts.split(",") if x]
    widths = [int(x) for x in args.widths.split(",") if x]
    arms = [a for a in args.arms.split(",") if a]
    bw = copy_bandwidth()
    probe = torch.zeros(1, device="cuda")
    res: dict[str, Any] = {"machine": machine(), "copy_GBs": bw / 1e9, "pdl_available": pdl.launch(probe)["GDC"],
                           "pdl_probe_errors": list(pdl.PROBE_ERRORS), "one_row_variants": one_row, "rows": [],
                           "checks": []}
    print(f"copy {bw / 1e9:,.0f} GB/s; PDL available: {res['pdl_available']} {pdl.PROBE_ERRORS}")
    model, _ = build_a3b()
    dense, expert, n_moe = weight_bytes(model)
    k = model.cfg.num_experts_per_tok
    rows, checks = run(model, arms, contexts, widths, args.rounds, args.steps, "bf16", one_row)
    for r in rows:
        if r["width"] == 1:
            b = dense + k * expert * n_moe + r["context"] * kv_bytes_per_position(model, "bf16")
            r["bound_tok_s"] = bw / b
            r["tok_s"] = 1e3 / r["step_ms"]
            r["frac_of_bound"] = r["tok_s"] / r["bound_tok_s"]
    res["rows"] += rows
    res["checks"] += checks
    del model
    torch.cuda.empty_cache()
    for q in (x for x in args.quant.split(",") if x):
        from bench.common import A3B_SHAPE
        from bench.quant_target import build_on_gpu

        qm = build_on_gpu(A3B_SHAPE, q)
        qrows, qchecks = run(qm, ["before", "pdl"], contexts, [1], args.rounds, args.steps, q, one_row)
        for r in qrows:
            r["tok_s"] = 1e3 / r["step_ms"]
        res["rows"] += qrows
        res["checks"] += qchecks
        del qm
        torch.cuda.empty_cache()
    write_json("step_ab.json", res)
    table = []
    for r in res["rows"]:
        table.append([r["build"], r["arm"], r["context"], r["width"], r["step_ms"], 1e3 / r["step_ms"] * r["width"],
                      r.get("frac_of_bound", float("nan")) * 100 if "frac_of_bound" in r else None,
                      r.get("bit_equal_to_before"), r.get("top1_agree"), "; ".join(r["errors"])[:40]])
    print_table(f"Decode step A/B on {res['machine'].get('gpu')}, copy {bw / 1e9:,.0f} GB/s (median of "
                f"{args.rounds} rounds of {args.steps} steps)",
                ["build", "arm", "context", "W", "step ms", "rows/s", "% of bound", "bits = before", "top-1 = before",
                 "errors"], table)
    bad = [c for c in res["checks"] if not c["ok"]]
    for c in res["checks"]:
        print(("ok   " if c["ok"] else "FAIL ") + c["check"] + f" [{c['build']}]")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
