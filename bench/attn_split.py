"""The decode step's split attention alone, on a BF16 and a q8_0 KV cache, against the bytes it must read.

    python bench/attn_split.py [--contexts 4096,32768,131072] [--widths 1,8] [--max-seconds 240]

The A3B shape's attention (32 query heads, 4 KV heads of 128) for a window of W rows at the end of a context of C
positions: `runtime/gpu/attention_kernels.attention` (the split kernel and its reduction), 16 calls on 16 distinct
caches captured as one CUDA graph (a layer's cache at 32k is 35-67 MB, so 16 of them keep the 50 MB L2 from holding
a previous call's), median of 20 replays. Bytes: the K and V rows of every position up to the window's last
(q8_0: 34 bytes a 32 values), read once for the window. Candidates: how the kernel reads a q8_0 cache
(`attention_kernels.Q8_PREFETCH`: a tile at a time, or the next tile's codes and scales loaded before this tile's
dequantization) and its launch settings (`SPLIT_TILE_Q8`: pipeline stages, warps, a register cap), a one-row
window's tile (`ROW_TILE_ONE(_Q8)`: query-head lines; `SPLIT_ONE_Q8_REGS`) and how codes become floats (`Q8_CVT`);
each candidate's output is compared with the shipped one's, bit for bit (`CANDIDATES`). Writes `attn_split.json`.
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
# label -> the settings it changes from what the runtime ships ("shipped"), for the caches in "kv" (both when not
# named) and one-row windows alone where "one_row": "pf" `attention_kernels.Q8_PREFETCH` (the next tile's codes and
# scales loaded before this tile's arithmetic), "stages" / "warps" / "regs" (a register cap) the cache's
# SPLIT_TILE(_Q8), "pps" `PROGRAMS_PER_SM` (the split grid's size), "cvt" `Q8_CVT` (how codes become floats):
# none of these changes a value's bits. "rt1": the query-head lines of a one-row window's tile (ROW_TILE_ONE or,
# q8_0, ROW_TILE_ONE_Q8; a smaller dot, which may round otherwise than a wider window's, docs/models.md), its
# register cap then "regs" or none (SPLIT_ONE_Q8_REGS)
CANDIDATES: dict[str, dict[str, Any]] = {
    "shipped": {},
    "a tile at a time, 3 stages": {"kv": "q8_0", "pf": 0, "stages": 3},
    "a tile at a time, 1 stage": {"kv": "q8_0", "pf": 0, "stages": 1},
    "prefetch, 3 stages": {"kv": "q8_0", "stages": 3}, "prefetch, 8 warps": {"kv": "q8_0", "warps": 8},
    "8 warps": {"kv": "bf16", "warps": 8}, "2 stages": {"kv": "bf16", "stages": 2},
    "4 stages": {"kv": "bf16", "stages": 4}, "pps 2": {"kv": "bf16", "pps": 2}, "pps 8": {"kv": "bf16", "pps": 8},
    "rt1 64": {"one_row": True, "rt1": 64}, "rt1 32": {"one_row": True, "rt1": 32},
    "rt1 16": {"one_row": True, "rt1": 16}, "rt1 16, 2 stages": {"one_row": True, "rt1": 16, "stages": 2},
    "rt1 16, regs 168": {"one_row": True, "rt1": 16, "regs": 168},
    "rt1 16, regs 128": {"one_row": True, "rt1": 16, "regs": 128},
    "regs 168": {"regs": 168}, "cvt 1": {"kv": "q8_0", "cvt": 1}, "cvt 2": {"kv": "q8_0", "cvt": 2},
    "rt1 16, regs 168, cvt 2": {"one_row": True, "rt1": 16, "regs": 168, "cvt": 2, "kv": "q8_0"},
    # a one-row q8_0 tile left to Triton's pipeliner: codes and scales copied to shared memory stages ahead
    "rt1 16, a tile at a time, 3 stages": {"kv": "q8_0", "one_row": True, "rt1": 16, "pf": 0, "stages": 3},
    "rt1 16, a tile at a time, 4 stages": {"kv": "q8_0", "one_row": True, "rt1": 16, "pf": 0, "stages": 4},
    "rt1 16, a tile at a time, 4 stages, regs 168": {"kv": "q8_0", "one_row": True, "rt1": 16, "pf": 0,
                                                     "stages": 4, "regs": 168},
}


def caches(ctx: int, q8: bool, gen: torch.Generator) -> list[tuple]:
    from runtime.kv import quantize_q8_0

    out = []
    S = ctx + 64
    for _ in range(COPIES):
        k = torch.randn(NKV, S, HD, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(NKV, S, HD, device="cuda", dtype=torch.bfloat16, generator=gen)
        if q8:
            (kq, ks), (vq, vs) = quantize_q8_0(k), quantize_q8_0(v)
            del k, v
            out.append((kq, vq, ks, vs))
        else:
            out.append((k, v, None, None))
    return out


def run(ctx: int, width: int, q8: bool, bw: float, deadline: Deadline) -> list[dict[str, Any]]:
    from runtime.gpu import attention_kernels as ak

    gen = torch.Generator(device="cuda").manual_seed(ctx + width)
    cs = caches(ctx, q8, gen)
    q = torch.randn(width, NH, HD, device="cuda", dtype=torch.bfloat16, generator=gen)
    pos = torch.arange(ctx - width, ctx, device="cuda", dtype=torch.int32)
    from runtime.kv import ONE_ROW_CHUNKS, ONE_ROW_CHUNKS_Q8, one_row_chunk, split_chunks

    lay = ONE_ROW_CHUNKS_Q8 if q8 else ONE_ROW_CHUNKS

    part = [ak.split_scratch(width, NH, ctx + 64, HD, "cuda") for _ in range(COPIES)]
    row_bytes = HD * 2 if not q8 else HD + HD // 32 * 2
    nbytes = ctx * NKV * row_bytes * 2
    saved = (ak.Q8_PREFETCH, dict(ak.SPLIT_TILE), dict(ak.SPLIT_TILE_Q8), ak.PROGRAMS_PER_SM, ak.ROW_TILE_ONE,
             ak.ROW_TILE_ONE_Q8, ak.Q8_CVT, ak.SPLIT_ONE_Q8_REGS)
    kind = "q8_0" if q8 else "bf16"
    rows, ref = [], None
    for label, cand in CANDIDATES.items():
        if deadline.left() < 10 or cand.get("kv", kind) != kind or (cand.get("one_row") and width != 1):
            continue
        try:
            tile = ak.SPLIT_TILE_Q8 if q8 else ak.SPLIT_TILE
            tile.update({k: cand[c] for c, k in (("stages", "num_stages"), ("warps", "num_warps"), ("regs", "maxnreg"))
                         if c in cand})
            ak.Q8_PREFETCH = bool(cand.get("pf", ak.Q8_PREFETCH))
            ak.PROGRAMS_PER_SM = cand.get("pps", ak.PROGRAMS_PER_SM)
            ak.Q8_CVT = cand.get("cvt", ak.Q8_CVT)
            if "rt1" in cand:
                ak.ROW_TILE_ONE = ak.ROW_TILE_ONE_Q8 = cand["rt1"]
                ak.SPLIT_ONE_Q8_REGS = cand.get("regs", 0)
            calls = [lambda c=c, p=p: ak.attention(q, c[0], c[1], pos, HD ** -0.5, ks=c[2], vs=c[3], part=p)
                     for c, p in zip(cs, part, strict=True)]
            out = calls[0]()
            same = None if ref is None else bool(torch.equal(out, ref))
            ref = out if ref is None else ref
            us = graph_us(calls)
        finally:
            ak.Q8_PREFETCH = saved[0]
            for t, old in ((ak.SPLIT_TILE, saved[1]), (ak.SPLIT_TILE_Q8, saved[2])):
                t.clear()
                t.update(old)
            ak.PROGRAMS_PER_SM, ak.ROW_TILE_ONE, ak.ROW_TILE_ONE_Q8, ak.Q8_CVT, ak.SPLIT_ONE_Q8_REGS = saved[3:]
        rows.append({"context": ctx, "width": width, "kv_dtype": kind, "candidate": label, "settings": cand, "us": us,
                     "bytes": nbytes, "gb_s": nbytes / us / 1e3, "frac_of_copy": nbytes / us / 1e-6 / bw,
                     "same_bits_as_shipped": same,
                     # a row's chunks: a one-row window splits by its length where runtime/kv.py sets a layout
                     "chunks": -(-ctx // one_row_chunk(ctx, lay)) if width == 1 and lay else split_chunks(ctx)})
    del cs, part
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--widths", default="1,8")
    ap.add_argument("--max-seconds", type=float, default=240)
    ap.add_argument("--bf16-only", action="store_true", help="the BF16 cache's candidates alone")
    a = ap.parse_args()
    deadline = Deadline(a.max_seconds)
    bw = copy_bandwidth()
    rows: list[dict[str, Any]] = []
    for ctx in (int(c) for c in a.contexts.split(",")):
        for w in (int(x) for x in a.widths.split(",")):
            for q8 in (False,) if a.bf16_only else (False, True):
                if deadline.left() > 10:
                    rows += run(ctx, w, q8, bw, deadline)
    print_table(f"split attention, A3B heads (copy {bw / 1e9:,.0f} GB/s)",
                ["context", "W", "kv", "candidate", "us", "GB/s", "% copy", "same bits"],
                [[r["context"], r["width"], r["kv_dtype"], r["candidate"], r["us"], r["gb_s"],
                  100 * r["frac_of_copy"], r["same_bits_as_shipped"]] for r in rows])
    write_json("attn_split.json", {"machine": machine(), "copy_bytes_s": bw, "args": vars(a), "rows": rows})


if __name__ == "__main__":
    main()
