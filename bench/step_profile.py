"""Where a decode step's time goes: the engine's fixed-width step on the A3B shape, kernel by kernel.

    python bench/step_profile.py [--context 1024] [--widths 1,8] [--steps 20]
    python bench/step_profile.py --prefill 8192 [--chunk 8192]
    python bench/step_profile.py --quant q4_0 [--context 1024] [--widths 1]

Runs the graph-captured step (bench/context.py's `time_decode`) for the step time, then the same step eagerly
under torch.profiler (CUDA activity) and groups GPU kernel time by kernel name: per step, the kernel's share, its
launches per step and its mean time per launch. The sum of kernel times next to the graph step time shows what is
left for launch gaps. Each kernel is put next to the bytes it must read when that is known (weights of the dense
projections, active experts, the KV cache), so a reader sees which part is far from the copy bandwidth.
Writes `step_profile.json`. `--prefill N` profiles one prefill of N tokens instead (after three timed ones), kernel
time per prefill next to the time the bf16 matmul peak needs for its FLOPs; writes `prefill_profile.json`.
`--quant q4_0` (or q8_0) profiles the step of a target whose matrices and experts are ggml blocks
(bench/quant_target.py's build), next to the bytes a token reads in that format; writes `step_profile_<quant>.json`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import copy_bandwidth, machine, print_table, write_json  # noqa: E402


def profile_step(model, kv, width: int, steps: int, trace: str = "") -> list[dict[str, Any]]:
    """Kernel time per step, grouped by kernel name (eager step: the graph hides kernels from the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from bench.context import DEV, gen
    from runtime.gpu.static_step import StaticStep

    ctx = kv.length
    step = StaticStep(model, kv, width, graph=False)
    win = torch.randint(0, model.cfg.vocab_size, (1, width), device=DEV, generator=gen(ctx + width))
    for _ in range(2):
        step(win, kv)
        kv.rollback(ctx)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(win, kv)
            kv.rollback(ctx)
        torch.cuda.synchronize()
    if trace:       # the kernels' start and end times (chrome://tracing, Perfetto): how launches overlap under PDL
        prof.export_chrome_trace(trace)
    return kernel_groups(prof, steps)


def kernel_groups(prof, steps: int) -> list[dict[str, Any]]:
    """GPU kernel time of a profile grouped by kernel name, per step (or per prefill)."""
    groups: dict[str, dict[str, float]] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = ev.name if len(ev.name) < 70 else ev.name[:67] + "..."
        g = groups.setdefault(name, {"us": 0.0, "n": 0})
        g["us"] += ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
        g["n"] += 1
    rows = [dict(kernel=k, us_per_step=v["us"] / steps, launches_per_step=v["n"] / steps,
                 us_per_launch=v["us"] / max(1, v["n"])) for k, v in groups.items()]
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows


def profile_prefill(model, n: int, chunk: int, runs: int) -> tuple[float, list[dict[str, Any]]]:
    """(median tok/s of `runs` timed prefills of n tokens in chunks of `chunk`, kernel time per prefill)."""
    from torch.profiler import ProfilerActivity, profile

    from bench.common import median
    from bench.context import DEV, DT, time_prefill
    from runtime.kv import KVCache
    from runtime.speculative import prefill

    tok_s = median([time_prefill(model, n, "bf16", chunk) for _ in range(runs)])
    c = model.cfg
    kv = KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, n + 8, dtype=DT, device=DEV)
    ids = torch.randint(0, c.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    with torch.no_grad():
        prefill(model, kv, ids[:chunk], (), chunk)
        kv.reset()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            prefill(model, kv, ids, (), chunk)
            torch.cuda.synchronize()
    return tok_s, kernel_groups(prof, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--widths", default="1,8")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prefill", type=int, default=0, help="profile a prefill of this many tokens instead")
    ap.add_argument("--chunk", type=int, default=8192, help="the prefill's chunk")
    ap.add_argument("--quant", default="", help="profile a target in this block format (q4_0, q8_0) instead")
    ap.add_argument("--trace", default="", help="also write each width's profile as a chrome trace, this path with "
                    "the width before the suffix")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/step_profile.py needs a CUDA GPU.", file=sys.stderr)
        return 2
    from bench.context import build_a3b, make_kv, prefill_flops_per_token, time_decode, weight_bytes

    bw = copy_bandwidth()
    if args.quant:
        from bench.quant_target import A3B, MIXES, active_bytes, build_on_gpu, model_active_bytes

        model = build_on_gpu(A3B, args.quant)
        dense, expert, n_moe = 0, 0, model.cfg.num_hidden_layers
    else:
        model, _ = build_a3b()
        dense, expert, n_moe = weight_bytes(model)
    if args.prefill:
        from bench.common import matmul_peak

        peak = matmul_peak()
        n = args.prefill
        tok_s, rows = profile_prefill(model, n, args.chunk, 3)
        total = sum(r["us_per_step"] for r in rows)
        wall_us = n / tok_s * 1e6
        bound_us = n * prefill_flops_per_token(model, n) / peak * 1e6
        write_json("prefill_profile.json", {"machine": machine(), "prompt": n, "chunk": args.chunk, "tok_s": tok_s,
                                            "matmul_peak_TFLOPs": peak / 1e12, "wall_us": wall_us,
                                            "bound_us": bound_us, "kernel_sum_us": total, "kernels": rows})
        print_table(f"A3B prefill of {n} tokens, chunk {args.chunk}: {tok_s:,.0f} tok/s, {wall_us:,.0f} us wall, "
                    f"kernels {total:,.0f} us; the bf16 matmul peak ({peak / 1e12:.0f} TFLOP/s) needs {bound_us:,.0f} "
                    f"us", ["kernel", "us", "share %", "launches", "us/launch"],
                    [[r["kernel"], r["us_per_step"], 100 * r["us_per_step"] / total, r["launches_per_step"],
                      r["us_per_launch"]] for r in rows[:30]])
        return 0
    res: dict[str, Any] = {"machine": machine(), "context": args.context, "copy_GBs": bw / 1e9, "widths": {},
                           "quant": args.quant or "bf16"}
    if args.quant:      # the bytes one token reads in this format (without the KV cache: 0 positions)
        res["token_bytes_without_kv"] = active_bytes(A3B, args.quant, 0) if args.quant not in MIXES else \
            model_active_bytes(model, 0)
    for w in (int(x) for x in args.widths.split(",")):
        kv = make_kv(model, args.context, "bf16", capacity=args.context + 64)
        graph_ms = time_decode(model, kv, w, 50)["step_ms"]
        trace = str(Path(args.trace).with_suffix(f".w{w}{Path(args.trace).suffix}")) if args.trace else ""
        rows = profile_step(model, kv, w, args.steps, trace)
        total = sum(r["us_per_step"] for r in rows)
        launches = sum(r["launches_per_step"] for r in rows)
        res["widths"][w] = dict(graph_step_us=graph_ms * 1e3, kernel_sum_us=total, launches_per_step=launches,
                                dense_bytes=dense, expert_bytes=expert, moe_layers=n_moe, kernels=rows)
        need = (f"a token's {args.quant} bytes without the KV take {res['token_bytes_without_kv'] / bw * 1e6:,.0f} us"
                if args.quant else f"the dense weights alone take {dense / bw * 1e6:,.0f} us")
        print_table(f"A3B {res['quant']} step W={w} at context {args.context}: graph step {graph_ms * 1e3:,.0f} us, "
                    f"kernels {total:,.0f} us in {launches:.0f} launches (copy {bw / 1e9:,.0f} GB/s; {need})", ["kernel", "us/step", "share %", "launches", "us/launch"],
                    [[r["kernel"], r["us_per_step"], 100 * r["us_per_step"] / total, r["launches_per_step"],
                      r["us_per_launch"]] for r in rows[:18]])
        del kv
        torch.cuda.empty_cache()
    write_json(f"step_profile_{args.quant}.json" if args.quant else "step_profile.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
