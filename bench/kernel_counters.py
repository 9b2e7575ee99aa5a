"""Hardware counters of the one-row decode step's kernels (Nsight Compute): why each kernel takes the time it does.

    python bench/kernel_counters.py [--formats bf16,q4_0,q8_0] [--context 1024] [--layers 3] [--stream]

The step's time is known from `bench/step_ab.py` and its split by stage from `bench/step_ablate.py`; neither says
why a stage is slower than its bytes. This runs itself under `ncu` (`--clock-control none`, caches flushed before
each kernel: the weights come from DRAM, as in a step): for each format, the A3B-shaped random target
(`bench/quant_target.build_on_gpu`, honest routing) with `--layers` layers, the engine's one-row step (not captured:
ncu times each kernel alone, so launch gaps and PDL overlap are not in these figures) at `--context` positions of
a random cache, one step profiled after warm-up steps. Per kernel: duration, DRAM bytes read and the rate they
were read at (against the copy bandwidth measured first, outside ncu), achieved occupancy, registers per thread,
grid, global load instructions per DRAM byte, and the three largest warp stall reasons (cycles a warp spends
stalled per instruction issued, by reason: `long_scoreboard` waits for memory, `lg_throttle` for a full queue of
global loads, `wait` for a fixed-latency dependency, `barrier` at a CTA barrier).

`--stream`: also times, outside ncu, kernels that only read 8 experts' gate/up bytes of a Q4_0 layer (14 MB,
the one-row gate/up kernel's grid and bytes) with 16-bit loads in the Q4_0 word pattern against 16-byte vector
loads: what the load width alone costs.

Writes `kernel_counters.json` (and the raw ncu CSV next to it).
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import A3B_SHAPE, copy_bandwidth, machine, out_dir, print_table, write_json  # noqa: E402

SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "LaunchStats", "Occupancy", "WarpStateStats",
            "InstructionStats")
METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "smsp__inst_executed_op_global_ld.sum",
           "sm__warps_active.avg.pct_of_peak_sustained_active")
STALL = "smsp__average_warps_issue_stalled_"


def child(args) -> None:
    """Under ncu: build each format's target, warm the one-row step up, profile one step."""
    from bench.context import make_kv
    from bench.quant_target import build_on_gpu
    from runtime.gpu.static_step import StaticStep

    cfg = {**A3B_SHAPE, "num_hidden_layers": args.layers}
    for fmt in args.formats.split(","):
        model = build_on_gpu(cfg, fmt)
        kv = make_kv(model, args.context, "bf16", capacity=args.context + 64)
        step = StaticStep(model, kv, 1, graph=False)
        win = torch.tensor([[11]], device="cuda")
        for _ in range(3):
            step(win, kv)
            kv.rollback(args.context)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(f"fmt:{fmt}")
        torch.cuda.cudart().cudaProfilerStart()
        step(win, kv)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        torch.cuda.nvtx.range_pop()
        kv.rollback(args.context)
        del model, kv, step
        torch.cuda.empty_cache()


def parse(text: str, fmt: str) -> list[dict[str, Any]]:
    """ncu's raw CSV (a header, a units row, then one row per kernel) -> a record per kernel."""
    rows = list(csv.reader(io.StringIO("\n".join(ln for ln in text.splitlines() if ln.startswith('"')))))
    if len(rows) < 3:
        return []
    recs = []
    for r in rows[2:]:
        d = dict(zip(rows[0], r, strict=False))

        def num(key: str, d=d) -> float:
            try:
                return float(d.get(key, "").replace(",", ""))
            except ValueError:
                return float("nan")

        stalls = {k[len(STALL):-len("_per_issue_active.ratio")]: num(k)
                  for k in d if k.startswith(STALL) and k.endswith("_per_issue_active.ratio")}
        top = sorted(((v, k) for k, v in stalls.items() if v == v), reverse=True)[:3]
        recs.append({"format": fmt, "kernel": d.get("Kernel Name", ""),
                     "us": num("gpu__time_duration.sum") / 1e3, "dram_read_bytes": num("dram__bytes_read.sum"),
                     "dram_pct_peak": num("dram__throughput.avg.pct_of_peak_sustained_elapsed"),
                     "occupancy_pct": num("sm__warps_active.avg.pct_of_peak_sustained_active"),
                     "registers": num("launch__registers_per_thread"), "grid": num("launch__grid_size"),
                     "block": num("launch__block_size"),
                     "global_ld_instr": num("smsp__inst_executed_op_global_ld.sum"),
                     "stalls_top3": [[k, round(v, 2)] for v, k in top], "stalls": stalls})
    return recs


# ------------------------------------------------------------------------------------------------- stream kernels

def stream(bw: float) -> list[dict[str, Any]]:
    """Read a Q4_0 layer's 8-expert gate/up bytes (1536 programs of 8 weight rows, as the one-row gate/up kernel's
    u4d8k2np grid) with 16-bit loads in the Q4_0 word pattern, and with 16-byte loads of the same byte count; 48
    buffers in a graph so no call finds its bytes in L2."""
    import triton
    import triton.language as tl

    from bench.gemv_one_row import graph_us

    @triton.jit
    def u16_q4(w_ptr, o_ptr, ROWB: tl.constexpr, NBLK: tl.constexpr, BN: tl.constexpr, NBC: tl.constexpr):
        # a program: BN rows of NBLK 18-byte blocks (9 words: scale, 8 code words), NBC blocks a step
        pid = tl.program_id(0)
        rows = pid * BN + tl.arange(0, BN)
        acc = tl.zeros((NBC, BN, 8), dtype=tl.int32)
        dacc = tl.zeros((NBC, BN), dtype=tl.float32)
        for b0 in range(0, NBLK, NBC):
            blk = b0 + tl.arange(0, NBC)
            wo = blk[:, None, None] * 9 + 1 + tl.arange(0, 8)[None, None, :]
            p = w_ptr + rows[None, :, None].to(tl.int64) * (ROWB // 2) + wo
            acc += tl.load(p).to(tl.int32)
            dacc += tl.load(w_ptr + rows[None, :].to(tl.int64) * (ROWB // 2) + blk[:, None] * 9).to(
                tl.float16, bitcast=True).to(tl.float32)
        tl.store(o_ptr + pid, tl.sum(tl.sum(tl.sum(acc, 2), 1), 0).to(tl.float32) + tl.sum(tl.sum(dacc, 1), 0))

    @triton.jit
    def v16(w_ptr, o_ptr, ROWW: tl.constexpr, BN: tl.constexpr, STEPW: tl.constexpr):
        # the same bytes as int32 words, contiguous rows, STEPW words a step (16-byte vectors)
        pid = tl.program_id(0)
        rows = pid * BN + tl.arange(0, BN)
        acc = tl.zeros((BN, STEPW), dtype=tl.int32)
        for k0 in range(0, ROWW, STEPW):
            p = w_ptr + rows[:, None].to(tl.int64) * ROWW + k0 + tl.arange(0, STEPW)[None, :]
            acc += tl.load(p)
        tl.store(o_ptr + pid, tl.sum(tl.sum(acc, 1), 0).to(tl.float32))

    rows, rowb = 8 * 2 * 768, 2048 // 32 * 18            # 12,288 rows of 1,152 bytes: 14.2 MB
    bufs = [torch.randint(-30000, 30000, (rows * rowb // 2,), dtype=torch.int16, device="cuda") for _ in range(48)]
    out = torch.empty(rows, device="cuda")
    nbytes = rows * rowb
    arms = {
        "u16 Q4_0 words, 4+4 rows, 32 blocks a step, 8 warps": lambda b: u16_q4[(rows // 8,)](
            b, out, ROWB=rowb, NBLK=64, BN=8, NBC=32, num_warps=8),
        "u16 Q4_0 words, 4+4 rows, 64 blocks a step, 8 warps": lambda b: u16_q4[(rows // 8,)](
            b, out, ROWB=rowb, NBLK=64, BN=8, NBC=64, num_warps=8),
        "16-byte loads, 8 rows, 32 words a step, 4 warps": lambda b: v16[(rows // 8,)](
            b.view(torch.int32), out, ROWW=rowb // 4, BN=8, STEPW=32, num_warps=4),
        "16-byte loads, 8 rows, 32 words a step, 8 warps": lambda b: v16[(rows // 8,)](
            b.view(torch.int32), out, ROWW=rowb // 4, BN=8, STEPW=32, num_warps=8),
        "16-byte loads, 16 rows, 32 words a step, 8 warps": lambda b: v16[(rows // 16,)](
            b.view(torch.int32), out, ROWW=rowb // 4, BN=16, STEPW=32, num_warps=8),
    }
    res = []
    for name, fn in arms.items():
        try:
            for b in bufs[:2]:
                fn(b)
            us = graph_us([lambda b=b, fn=fn: fn(b) for b in bufs])
            res.append({"arm": name, "us": us, "GBs": nbytes / us / 1e3, "of_copy": nbytes / us / 1e3 / (bw / 1e9)})
        except Exception as ex:  # one arm's compile error must not lose the others
            res.append({"arm": name, "error": f"{type(ex).__name__}: {str(ex)[:300]}"})
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="bf16,q4_0,q8_0")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ncu", default=os.environ.get("NCU", "ncu"))
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return {}
    bw = copy_bandwidth()
    res: dict[str, Any] = {"machine": machine(), "args": vars(args), "copy_bandwidth_GBs": bw / 1e9}
    if args.stream:
        res["stream"] = stream(bw)
        print_table(f"Reading 14.2 MB of Q4_0 gate/up bytes (copy bandwidth {bw / 1e9:.0f} GB/s)",
                    ["arm", "us", "GB/s", "of copy"],
                    [[r["arm"], r.get("us"), r.get("GBs"), r.get("of_copy")] for r in res["stream"]])
    recs, res["ncu"] = [], {}
    for fmt in args.formats.split(","):
        log = out_dir() / f"kernel_counters_ncu_{fmt}.csv"
        cmd = [args.ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw",
               "--log-file", str(log), "--metrics", ",".join(METRICS)]
        for s in SECTIONS:
            cmd += ["--section", s]
        cmd += [sys.executable, str(Path(__file__).resolve()), "--child", "--formats", fmt, "--context",
                str(args.context), "--layers", str(args.layers)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        res["ncu"][fmt] = {"rc": p.returncode, "tail": p.stdout[-1500:] + p.stderr[-1500:]}
        got = parse(log.read_text() if log.exists() else "", fmt)
        if not got:
            print(f"ncu gave no kernel rows for {fmt}; its output:\n" + res["ncu"][fmt]["tail"])
        recs += got
    res["kernels"] = recs
    print_table(f"One-row step kernels, {args.layers} layers, context {args.context} (ncu, each kernel alone, "
                f"caches flushed; copy bandwidth {bw / 1e9:.0f} GB/s)",
                ["format", "kernel", "us", "MB read", "GB/s", "DRAM % peak", "occ %", "regs", "grid",
                 "ld instr / KB", "top stalls (cycles / issue)"],
                [[r["format"], r["kernel"][:40], r["us"], r["dram_read_bytes"] / 1e6,
                  r["dram_read_bytes"] / max(r["us"], 1e-9) / 1e3, r["dram_pct_peak"], r["occupancy_pct"],
                  r["registers"], r["grid"], r["global_ld_instr"] / max(r["dram_read_bytes"] / 1024, 1e-9),
                  " ".join(f"{k}:{v}" for k, v in r["stalls_top3"])] for r in recs])
    write_json("kernel_counters.json", res)
    return res


if __name__ == "__main__":
    main()
