"""Can a weight matrix wait in L2 while a larger stream passes? A question about the one-row decode step.

    python bench/l2_prefetch.py [--layers 48] [--a-mb 21] [--b1-mb 50] [--b2-mb 25] [--idle-us 4]
                                [--setaside-mb 0,30]

The one-row A3B step leaves device memory nearly idle while its router and routing kernels run (about 4 us a layer,
docs/models.md "The one-row step"), and the next layer's q/k/v weights (21 MB) are known all along. They could be
prefetched into L2 then, if they survived the experts' gate/up (50 MB) and down (25 MB) rows that stream through L2
before q/k/v reads them; or prefetched later, beside the down rows alone. This script measures that with nothing of
the runtime: per "layer" a fresh A (q/k/v-sized), B1 (gate/up-sized) and B2 (down-sized) buffer; a kernel that keeps
one SM busy for the idle time, then B1, B2 and A streamed. Arms differ only in a prefetch of A into L2 (PTX
`prefetch.global.L2::evict_last`, or plain `prefetch.global.L2`: fire-and-forget, the kernel ends at once) and in
B's loads' eviction priority. The graph of all layers is timed by its replays (median); per layer:

- `base`: idle, B1, B2, A.                         `ef`: the same, B1 and B2 loaded evict_first.
- `pf-early`: A prefetched (evict_last) as the idle kernel starts, B evict_first; `pf-early-normal`: no priorities.
- `pf-mid`: A prefetched (evict_last) between B1 and B2, B evict_first; `pf-mid-normal`: no priorities.
- `no-a`: without A (what A costs: base - no-a).   `a-hot`: A read twice (the second read from L2).

`--setaside-mb`: each arm again with that much L2 set aside for persisting (evict_last) lines (cuCtxSetLimit,
CU_LIMIT_PERSISTING_L2_CACHE_SIZE: a setting of this process's context, not of the card). Writes l2_prefetch.json.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
try:
    import triton
    import triton.language as tl
except ImportError:      # a CPU-only machine: main() says what the script needs
    triton = None

from bench.common import copy_bandwidth, machine, print_table, write_json  # noqa: E402
from bench.gemv_one_row import graph_us  # noqa: E402

LINE = 128          # bytes a prefetch brings (one L2 line)
BLOCK = 4096        # bf16 values a streaming program reads (8 KB)


if triton is not None:
    @triton.jit
    def _stream(x_ptr, o_ptr, n, BLOCK: tl.constexpr, EVICT: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        if EVICT == 1:
            x = tl.load(x_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_first")
        elif EVICT == 2:
            x = tl.load(x_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_last")
        else:
            x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(o_ptr + pid, tl.sum(x.to(tl.float32), axis=0))


    @triton.jit
    def _idle_prefetch(p_ptr, n_lines, t_ptr, idle_ns, LINES: tl.constexpr, MODE: tl.constexpr):
        """Program 0 keeps its SM busy for idle_ns; the others (MODE 1: evict_last, 2: normal) prefetch LINES lines of
        p each and leave at once."""
        pid = tl.program_id(0)
        if pid == 0:
            t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
            t = t0
            while t - t0 < idle_ns:
                t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                              pack=1)
            tl.store(t_ptr, t - t0)
        elif MODE != 0:
            line = (pid - 1).to(tl.int64) * LINES + tl.arange(0, LINES)
            line = tl.minimum(line, n_lines - 1)
            addr = p_ptr + line * (128 // 2)
            if MODE == 1:
                tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [addr],
                                          dtype=tl.int32, is_pure=False, pack=1)
            else:
                tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [addr],
                                          dtype=tl.int32, is_pure=False, pack=1)


def set_persisting_l2(nbytes: int) -> bool:
    """This context's L2 set-aside for persisting lines (driver API); False where the call fails."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        rc = cuda.cuCtxSetLimit(ctypes.c_int(0x06), ctypes.c_size_t(nbytes))
        return rc == 0
    except OSError:
        return False


def run_arm(arm: str, A: list[torch.Tensor], B1: list[torch.Tensor], B2: list[torch.Tensor], idle_ns: int,
            reps: int) -> float:
    """Per layer: idle (+ prefetch of A when the arm says "early"), B1, (prefetch of A when "mid"), B2, A."""
    n_a, n_b1, n_b2 = A[0].numel(), B1[0].numel(), B2[0].numel()
    oa = torch.empty(triton.cdiv(n_a, BLOCK), device="cuda", dtype=torch.float32)
    ob = torch.empty(triton.cdiv(max(n_b1, n_b2), BLOCK), device="cuda", dtype=torch.float32)
    tt = torch.empty(1, device="cuda", dtype=torch.int64)
    n_lines = n_a * 2 // LINE
    lines = 64
    mode = 2 if arm.endswith("-normal") else 1
    where = "early" if arm.startswith("pf-early") else "mid" if arm.startswith("pf-mid") else ""
    pf_progs = 1 + triton.cdiv(n_lines, lines)
    b_evict = 1 if arm in ("ef", "pf-early", "pf-mid") else 0

    def body() -> None:
        for a, b1, b2 in zip(A, B1, B2, strict=True):
            if where == "early":
                _idle_prefetch[(pf_progs,)](a, n_lines, tt, idle_ns, LINES=lines, MODE=mode)
            else:
                _idle_prefetch[(1,)](a, n_lines, tt, idle_ns, LINES=lines, MODE=0)
            _stream[(triton.cdiv(n_b1, BLOCK),)](b1, ob, n_b1, BLOCK=BLOCK, EVICT=b_evict)
            if where == "mid":
                _idle_prefetch[(pf_progs,)](a, n_lines, tt, 0, LINES=lines, MODE=mode)
            _stream[(triton.cdiv(n_b2, BLOCK),)](b2, ob, n_b2, BLOCK=BLOCK, EVICT=b_evict)
            if arm != "no-a":
                _stream[(triton.cdiv(n_a, BLOCK),)](a, oa, n_a, BLOCK=BLOCK, EVICT=0)
            if arm == "a-hot":
                _stream[(triton.cdiv(n_a, BLOCK),)](a, oa, n_a, BLOCK=BLOCK, EVICT=0)

    return graph_us([body], reps) / len(A)          # one replay is every layer: us a layer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--a-mb", type=float, default=5120 * 2048 * 2 / 1e6)
    ap.add_argument("--b1-mb", type=float, default=8 * 2 * 768 * 2048 * 2 / 1e6, help="the experts' gate/up")
    ap.add_argument("--b2-mb", type=float, default=8 * 768 * 2048 * 2 / 1e6, help="the experts' down")
    ap.add_argument("--idle-us", type=float, default=4.0)
    ap.add_argument("--setaside-mb", default="0,30")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    if triton is None or not torch.cuda.is_available():
        print("bench/l2_prefetch.py: needs a CUDA device and Triton; run it on a GPU.")
        return 2
    bw = copy_bandwidth()
    p = torch.cuda.get_device_properties(0)
    l2 = getattr(p, "L2_cache_size", 0)
    n_a = int(args.a_mb * 1e6 / 2) // BLOCK * BLOCK
    n_b1 = int(args.b1_mb * 1e6 / 2) // BLOCK * BLOCK
    n_b2 = int(args.b2_mb * 1e6 / 2) // BLOCK * BLOCK
    A = [torch.randn(n_a, device="cuda", dtype=torch.bfloat16) for _ in range(args.layers)]
    B1 = [torch.randn(n_b1, device="cuda", dtype=torch.bfloat16) for _ in range(args.layers)]
    B2 = [torch.randn(n_b2, device="cuda", dtype=torch.bfloat16) for _ in range(args.layers)]
    res: dict[str, Any] = {"machine": machine(), "args": vars(args), "copy_bandwidth_GBs": bw / 1e9,
                           "l2_bytes": l2, "rows": []}
    rows = []
    arms = ["base", "ef", "pf-early", "pf-early-normal", "pf-mid", "pf-mid-normal", "no-a", "a-hot"]
    for sa in [float(s) for s in args.setaside_mb.split(",") if s]:
        ok = set_persisting_l2(int(sa * 1e6))
        got: dict[str, float] = {}
        for arm in arms:
            got[arm] = run_arm(arm, A, B1, B2, int(args.idle_us * 1e3), args.reps)
        a_cost = got["base"] - got["no-a"]
        for arm in arms:
            r = {"setaside_mb": sa, "setaside_ok": ok, "arm": arm, "us_per_layer": got[arm],
                 "vs_base_us": got[arm] - got["base"], "a_cost_us": a_cost}
            res["rows"].append(r)
            rows.append([f"{sa:g}{'' if ok else ' (refused)'}", arm, got[arm], got[arm] - got["base"]])
    set_persisting_l2(0)
    a_bytes_us = 2 * n_a / bw * 1e6
    b_bytes_us = 2 * (n_b1 + n_b2) / bw * 1e6
    print_table(f"L2 prefetch across a stream ({p.name}, L2 {l2 / 1e6:.0f} MB, copy {bw / 1e9:,.0f} GB/s; A "
                f"{2 * n_a / 1e6:.1f} MB = {a_bytes_us:.1f} us, B {2 * (n_b1 + n_b2) / 1e6:.1f} MB = {b_bytes_us:.1f} us at "
                f"the copy rate; idle {args.idle_us} us)",
                ["set-aside MB", "arm", "us / layer", "vs base"], rows)
    write_json("l2_prefetch.json", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
