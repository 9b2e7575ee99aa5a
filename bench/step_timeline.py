"""Where the graphed decode step's time goes, kernel by kernel, with the kernels overlapping as they do in the step.

    python bench/step_timeline.py [--contexts 1024,16384] [--width 1] [--kv bf16] [--steps 20] [--capacity 32768]
                                  [--arm NAME]

`bench/step_profile.py` runs the step eagerly, where each kernel runs alone; `bench/step_ablate.py` removes one
stage at a time. This one profiles replays of the engine's CUDA graph itself (torch.profiler records each kernel a
graph launches, with programmatic dependent launch overlapping them as in the step) and lines the kernels up layer
by layer: for each kernel of a layer, when it started against the end of the kernel before it (negative: scheduled
early by PDL, its programs waiting), how long it ran, and what it added to the step (its end minus the previous
kernel's end: the step's time is the sum of these). Medians over the middle layers and the profiled steps. The
profiler's own cost shows as the profiled step's length against the step timed without it. The cache holds the
context + 64 positions unless `--capacity` names more (an engine's holds its configured context). Writes
`step_timeline.json`; `--trace PATH` also keeps the chrome trace of the last context; `--arm` profiles one of
`bench/step_ab.py`'s arms instead of the step as shipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import copy_bandwidth, machine, print_table, write_json  # noqa: E402


def kernel_events(trace_path: str) -> list[dict[str, Any]]:
    """The trace's GPU kernels in start order: name, start and end (us), grid, registers."""
    ev = json.loads(Path(trace_path).read_text())
    out = []
    for e in ev.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            a = e.get("args", {})
            out.append({"name": e["name"], "start": float(e["ts"]), "end": float(e["ts"]) + float(e["dur"]),
                        "grid": a.get("grid"), "regs": a.get("registers per thread")})
    out.sort(key=lambda k: k["start"])
    return out


def layer_period(names: list[str], layers: int) -> tuple[int, int]:
    """(first kernel of the first layer, kernels per layer): the shortest period whose pattern repeats `layers`
    times in one step's kernel names."""
    for p in range(3, len(names) // max(1, layers) + 1):
        for s in range(0, len(names) - p * layers + 1):
            if all(names[s + j] == names[s + j % p] for j in range(p * layers)):
                return s, p
    raise SystemExit(f"no kernel pattern repeats {layers} times in a step of {len(names)} kernels")


def timeline(kernels: list[dict[str, Any]], steps: int, layers: int) -> dict[str, Any]:
    """Per kernel of a layer: medians of its lead (start - previous end), duration and what it adds to the step."""
    per = len(kernels) // steps
    if per * steps != len(kernels):
        raise SystemExit(f"{len(kernels)} kernels in {steps} profiled steps: not a whole number a step")
    first = [k["name"] for k in kernels[:per]]
    s, p = layer_period(first, layers)
    rows: list[dict[str, Any]] = []
    cols: dict[int, dict[str, list[float]]] = {j: {"lead": [], "dur": [], "adds": []} for j in range(p)}
    walls = []
    for t in range(steps):
        ks = kernels[t * per:(t + 1) * per]
        walls.append(ks[-1]["end"] - ks[0]["start"])
        for li in range(2, layers - 2):           # the middle layers: no prologue or head in the neighbourhood
            for j in range(p):
                i = s + li * p + j
                prev_end = ks[i - 1]["end"]
                cols[j]["lead"].append(ks[i]["start"] - prev_end)
                cols[j]["dur"].append(ks[i]["end"] - ks[i]["start"])
                cols[j]["adds"].append(ks[i]["end"] - prev_end)
    for j in range(p):
        k = kernels[s + 2 * p + j]
        rows.append({"position": j, "kernel": k["name"][:60], "grid": k["grid"], "regs": k["regs"],
                     **{m: statistics.median(v) for m, v in cols[j].items()}})
    outside = [k for i, k in enumerate(kernels[:per]) if not s <= i < s + p * layers]
    return {"kernels_per_step": per, "kernels_per_layer": p, "first_layer_at": s, "rows": rows,
            "layer_adds_us": sum(r["adds"] for r in rows), "profiled_step_us": statistics.median(walls),
            "outside_layers": [{"kernel": k["name"][:60], "dur": k["end"] - k["start"]} for k in outside]}


def run_context(model, ctx: int, width: int, kv_kind: str, steps: int, trace: str, capacity: int = 0
                ) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from bench.context import DEV, gen, make_kv
    from runtime.gpu.static_step import StaticStep

    kv = make_kv(model, ctx, kv_kind, capacity=max(capacity, ctx + 64))
    step = StaticStep(model, kv, width, graph=True)
    win = torch.randint(0, model.cfg.vocab_size, (1, width), device=DEV, generator=gen(ctx + width))
    for _ in range(3):                              # capture, warm
        step(win, kv)
        kv.rollback(ctx)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(steps):
            step(win, kv)
            kv.rollback(ctx)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / steps)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(win, kv)
            kv.rollback(ctx)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = trace or str(Path(d) / "trace.json")
        prof.export_chrome_trace(path)
        ks = kernel_events(path)
    res = timeline(ks, steps, model.cfg.num_hidden_layers)
    res.update(context=ctx, capacity=kv.capacity, width=width, kv=kv_kind, step_us=statistics.median(times),
               graph=step.use_graph, fused=step.fused, errors=list(step.errors))
    del step, kv
    torch.cuda.empty_cache()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,16384")
    ap.add_argument("--width", type=int, default=1)
    ap.add_argument("--kv", default="bf16", choices=("bf16", "q8_0"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--capacity", type=int, default=0, help="positions the cache holds (default: the context + 64)")
    ap.add_argument("--trace", default="", help="keep the last context's chrome trace at this path")
    ap.add_argument("--arm", default="", help="one of bench/step_ab.py's arms (default: the step as shipped)")
    args = ap.parse_args()
    from bench.step_ab import ARMS, set_arm

    if args.arm and args.arm not in ARMS:
        print(f"unknown arm {args.arm!r}: choose one of bench/step_ab.py's ARMS.", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench/step_timeline.py needs a CUDA GPU.", file=sys.stderr)
        return 2
    from bench.context import build_a3b
    from runtime.gpu import moe_gemv

    if args.arm:
        set_arm(ARMS[args.arm], dict(moe_gemv.DECODE_GEMV_ONE_ROW))

    bw = copy_bandwidth()
    model, _ = build_a3b()
    out: dict[str, Any] = {"machine": machine(), "copy_GBs": bw / 1e9, "arm": args.arm or "shipped", "contexts": []}
    with torch.no_grad():
        for ctx in (int(x) for x in args.contexts.split(",")):
            r = run_context(model, ctx, args.width, args.kv, args.steps, args.trace, args.capacity)
            out["contexts"].append(r)
            L = model.cfg.num_hidden_layers
            print_table(f"A3B {args.kv} step W={args.width} at context {ctx} of {r['capacity']:,}"
                        f"{' (arm ' + args.arm + ')' if args.arm else ''}: "
                        f"{r['step_us']:,.0f} us timed, "
                        f"{r['profiled_step_us']:,.0f} us profiled; {r['kernels_per_step']} kernels, "
                        f"{r['kernels_per_layer']} a layer adding {r['layer_adds_us']:.1f} us "
                        f"(x{L} = {r['layer_adds_us'] * L:,.0f} us); copy {bw / 1e9:,.0f} GB/s",
                        ["#", "kernel", "grid", "regs", "lead us", "runs us", "adds us"],
                        [[x["position"], x["kernel"], str(x["grid"]), x["regs"], x["lead"], x["dur"], x["adds"]]
                         for x in r["rows"]])
            rest = sum(k["dur"] for k in r["outside_layers"])
            print(f"  outside the layers: {len(r['outside_layers'])} kernels, {rest:.1f} us of kernel time")
    write_json("step_timeline.json", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
