"""The fixed-width decode step with and without this runtime's launch-level options, side by side in one run.

    python bench/step_ab.py [--contexts 1024,32768] [--widths 1,8] [--rounds 5] [--steps 30] [--quant q4_0]
                            [--prefill 8192 [--chunks 2048,8192] [--no-decode]]

Arms (each a set of module switches, set before its CUDA graph is captured, so a graph bakes its arm in; `ARMS`):
- before: the step as it was (BF16 experts of a one-row step on the tl.dot tiles, no PDL);
- moe1: BF16 experts of a one-row step through the matrix-vector kernel (moe_gemv.DECODE_GEMV_ONE_ROW);
- moe1+pdl: and programmatic dependent launch for the step's Triton kernels (runtime/gpu/pdl.py); moe1+pdl-attn:
  PDL except the split attention and its reduction (pdl.SKIP), the runtime before the one-step GEMV;
- one-dense, +norm, +sum, +reduce-pdl, default: the one-row step as it is now, one change at a time: the one-row
  q/k/v, o_proj and router products through the GEMV kernel's one-step tiles with their weights loaded before the
  PDL wait (dense_kernels.ONE_ROW_DENSE, moe_gemv "one_d*", EARLY), gate/up in one step (u1d32); the RMSNorms
  folded into the q/k/v and router products (dense_kernels.FUSE_NORM); the experts' down products, their top-k
  sum and the residual in one launch (moe_gemv.DOWN_SUM); PDL on the attention reduction; the routing kernel on
  2 warps (moe_kernels.ROUTE_WARPS_ONE_ROW); before a one-step o_proj, the split kernel on PDL and the reduction
  letting o_proj in before its own wait (pdl.TRIGGER_FIRST; arm split-apart: without): the runtime's default.
  default-late: the default with every load after the PDL wait.
Measured and dropped (bench/results/h200_session6/): a three-launch MoE half (norm + router + top-k in one
launch, down + top-k sum + residual in one: 10-25% slower, its code kept there as moe_one_row.py.txt); in
h200_session8/: the one-step tiles for the one-row experts' down products (4 or 2 gate/up rows, 16 or 8 down
rows) and other tiles of the dense products.
Every (arm, context, width) step is captured once; then rounds of `steps` replays go over all of them interleaved
(drift hits every arm alike) and the median round is quoted. On the A3B shape with honest routing (bench/common.py),
BF16, all experts resident, BF16 KV with the context's first positions random. Bound for a one-row step: copy
bandwidth (measured here) / (dense weights + top-k experts of every layer + the KV cache up to the context).
Checks: a step's logits with PDL are bit-identical to the same step without (PDL changes launches, never
arithmetic), and a wide step's are those of `before` (the one-row options leave it alone); the one-row kernels
change rounding only: the max |difference| and the top-1 agreement with `before` are reported. `--quant q4_0` (or
q8_0) also times a quantized build (bench/quant_target.py) in QUANT_ARMS; `--prefill` times prompts of those lengths
through the module forward and through the fused chunk (runtime/gpu/prefill_chunk.py), with and without PDL, and
with the MoE prefill tiles before (PREFILL_ARMS), and checks that both give the prompt's last row the same top-1 token. Writes `step_ab.json`.
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
from runtime.gpu import moe_split  # noqa: E402
from runtime.gpu.attention_kernels import Q8_PREFETCH as Q8_PREFETCH_SHIPPED  # noqa: E402
from runtime.gpu.attention_kernels import ROW_TILE_ONE as ROW_TILE_ONE_SHIPPED  # noqa: E402
from runtime.gpu.attention_kernels import ROW_TILE_ONE_Q8 as ROW_TILE_ONE_Q8_SHIPPED  # noqa: E402
from runtime.gpu.attention_kernels import SPLIT_KV_PREFETCH as KV_PF_SHIPPED  # noqa: E402
from runtime.gpu.attention_kernels import SPLIT_ONE_Q8_REGS as Q8_ONE_REGS_SHIPPED  # noqa: E402
from runtime.gpu.attention_kernels import SPLIT_TILE as _SPLIT_TILE  # noqa: E402
from runtime.gpu.attention_kernels import SPLIT_TILE_Q8 as _SPLIT_Q8  # noqa: E402

Q8_STAGES_SHIPPED = _SPLIT_Q8["num_stages"]

ONE_DENSE = {"qkv": "one_d8", "o_proj": "one_d4", "router": "one_d1"}
# o_proj on its lean kernel since h100_session36, letting the router in at its start since h100_session37
ONE_DENSE_NOW = {**ONE_DENSE, "o_proj": "one_d4leantop"}
SUM = {"BN": 2, "num_warps": 4}
OLD_SKIP = {"attention", "attention_reduce"}
# each arm: the switches it sets, every switch it does not name off ("moe1": DECODE_GEMV_ONE_ROW's BF16 variant;
# "dense": dense_kernels.ONE_ROW_DENSE; "norm": FUSE_NORM; "sum": moe_gemv.DOWN_SUM; "route_warps":
# moe_kernels.ROUTE_WARPS_ONE_ROW; "late": EARLY loads off; "pdl": pdl.ENABLED; "skip": pdl.SKIP; "rt1":
# attention_kernels.ROW_TILE_ONE, "rt1q8": ROW_TILE_ONE_Q8 (else "rt1"), off: ROW_TILE's 64 lines; "q8_one_regs":
# SPLIT_ONE_Q8_REGS, off: no cap; "exit": SPLIT_EXIT_EARLY; "kv_pf": SPLIT_KV_PREFETCH; "inputs":
# static_step.STEP_INPUTS) and whether it also runs wider steps ("wide": one-row options change nothing there)
ARMS: dict[str, dict[str, Any]] = {
    "before": {"wide": True},                    # no PDL, one-row experts on the tl.dot tiles
    "moe1": {"moe1": "n16d32", "wide": True},
    "moe1+pdl": {"moe1": "n16d32", "pdl": True, "wide": True},
    "moe1+pdl-attn": {"moe1": "n16d32", "pdl": True, "skip": OLD_SKIP, "wide": True},    # the runtime before
    # the one-row step as it is now, built up: dense projections through the one-step GEMV, then the norms folded
    # into them, then down + top-k sum in one launch, then PDL on the attention reduction, then the routing kernel
    # on 2 warps (the runtime's default); and the default without EARLY loads
    "one-dense": {"moe1": "u1d32", "dense": ONE_DENSE, "pdl": True, "skip": OLD_SKIP},
    "+norm": {"moe1": "u1d32", "dense": ONE_DENSE, "norm": True, "pdl": True, "skip": OLD_SKIP},
    "+sum": {"moe1": "u1d32", "dense": ONE_DENSE, "norm": True, "sum": SUM, "pdl": True, "skip": OLD_SKIP},
    "+reduce-pdl": {"moe1": "u1d32", "dense": ONE_DENSE, "norm": True, "sum": SUM, "pdl": True,
                    "skip": {"attention"}},
    "default": {"moe1": "u1d32", "dense": ONE_DENSE_NOW, "norm": True, "sum": SUM, "pdl": True,
                "skip": {"attention"}, "trig": {"attention_reduce:o_early"}, "route_warps": 2, "qnorm": True, "qship": True,
                "rt1": ROW_TILE_ONE_SHIPPED, "rt1q8": ROW_TILE_ONE_Q8_SHIPPED, "q8_one_regs": Q8_ONE_REGS_SHIPPED,
                "exit": True, "kv_pf": KV_PF_SHIPPED, "inputs": True},
    "default-late": {"moe1": "u1d32", "dense": ONE_DENSE_NOW, "norm": True, "sum": SUM, "pdl": True,
                     "skip": {"attention"}, "trig": {"attention_reduce:o_early"}, "route_warps": 2, "late": True,
                     "rt1": ROW_TILE_ONE_SHIPPED, "rt1q8": ROW_TILE_ONE_Q8_SHIPPED,
                     "q8_one_regs": Q8_ONE_REGS_SHIPPED, "exit": True},
}
# verify windows (2-8 rows): the default, then BF16 experts through the GEMV kernel (moe_gemv.DECODE_GEMV_NARROW)
# and the dense projections through the one-step tiles (dense_kernels.DENSE_GEMV_ROWS)
_DEFAULT = ARMS["default"]
ARMS.update({
    "wide-default": {**_DEFAULT, "wide": True},
    "wide-moe-u1d32": {**_DEFAULT, "wide": True, "narrow": (8, "u1d32")},
    "wide-moe-n16d32": {**_DEFAULT, "wide": True, "narrow": (8, "n16d32")},
    "wide-moe-n8j2m2": {**_DEFAULT, "wide": True, "narrow": (8, "n8j2m2")},
    "wide-dense": {**_DEFAULT, "wide": True, "dense_rows": {"qkv": 8, "o_proj": 8, "router": 8}},
    "wide-both": {**_DEFAULT, "wide": True, "narrow": (8, "u1d32"), "dense_rows": {"qkv": 8, "o_proj": 8, "router": 8}},
    # dense_kernels.DENSE_GEMV_ROWS per role ("dense_rows"; arms that do not name it take the shipped table):
    # every wider window on cuBLAS (the runtime before bench/results/h200_session14/), the router's and o_proj's
    # one-step tiles up to a few rows
    "wide-cublas": {**_DEFAULT, "wide": True, "dense_rows": {}},
    "wide-router8": {**_DEFAULT, "wide": True, "dense_rows": {"router": 8}},
    "wide-router16": {**_DEFAULT, "wide": True, "dense_rows": {"router": 16}},
    "wide-o4": {**_DEFAULT, "wide": True, "dense_rows": {"o_proj": 4}},
    "wide-router8-o4": {**_DEFAULT, "wide": True, "dense_rows": {"router": 8, "o_proj": 4}},
    "wide-router8-o2": {**_DEFAULT, "wide": True, "dense_rows": {"router": 8, "o_proj": 2}},
})
# the split attention's chunk layout (runtime/kv.py KV_TIERS: (C0, E0, C1, E1, C2)), at W = 1 and wider; arms
# without "tiers" / "reduce" take the shipped layout and reduction tile. tiers-before: the layout until
# bench/results/h200_session9/ (with "reduce": 16, the runtime before that)
from runtime.gpu.attention_kernels import REDUCE_TILE as REDUCE_SHIPPED  # noqa: E402
from runtime.gpu.dense_kernels import DENSE_GEMV_ROWS, QUANT_ONE_ROW  # noqa: E402
from runtime.gpu.moe_gemv import DECODE_GEMV, DECODE_GEMV_ONE_ROW  # noqa: E402
from runtime.gpu.moe_row import QTILE as _MOE_ROW_QTILE  # noqa: E402
from runtime.gpu.moe_row import TILE as _MOE_ROW_TILE  # noqa: E402
from runtime.kv import KV_TIERS as TIERS_SHIPPED  # noqa: E402
from runtime.kv import ONE_ROW_CHUNKS as ONE_ROW_CHUNKS_SHIPPED  # noqa: E402
from runtime.kv import ONE_ROW_CHUNKS_Q8 as ONE_ROW_CHUNKS_Q8_SHIPPED  # noqa: E402

SPLIT_TILE_SHIPPED = dict(_SPLIT_TILE)

QUANT_ONE_ROW_SHIPPED = dict(QUANT_ONE_ROW)
DENSE_ROWS_SHIPPED = dict(DENSE_GEMV_ROWS)
ONE_ROW_SHIPPED = dict(DECODE_GEMV_ONE_ROW)
DECODE_SHIPPED = dict(DECODE_GEMV)
MOE_ROW_SHIPPED = dict(_MOE_ROW_TILE)
MOE_ROW_Q_SHIPPED = dict(_MOE_ROW_QTILE)

for _name, _t in {"tiers-before": (128, 2048, 512, 16384, 1024), "tiers-128to16k": (128, 16384, 128, 16384, 1024),
                  "tiers-256": (128, 2048, 256, 16384, 1024), "tiers-64-256": (64, 2048, 256, 16384, 1024),
                  "tiers-128to4k-256to32k": (128, 4096, 256, 32768, 1024),
                  "tiers-128to4k-256to16k": (128, 4096, 256, 16384, 1024)}.items():
    ARMS[_name] = {**_DEFAULT, "wide": True, "tiers": _t}
    # with the reduction combining 16 or 64 chunks a step (attention_kernels.REDUCE_TILE)
    ARMS[_name + "+r16"] = {**_DEFAULT, "wide": True, "tiers": _t, "reduce": 16}
    ARMS[_name + "+r64"] = {**_DEFAULT, "wide": True, "tiers": _t, "reduce": 64}
# quantized builds (--quant): the one-row products of a block-format target through a one-step block tile
# (moe_gemv "qone*"), experts ("qone": DECODE_GEMV_ONE_ROW of the build's format) and dense projections ("qdense":
# dense_kernels.QUANT_ONE_ROW); "quant-best" (with --quant-from): the fastest tiles of bench/gemv_one_row.py --quant
for _v in ("qone4j1", "qone8j1", "qone8j2", "qone16j2"):
    ARMS[f"q-{_v}"] = {**_DEFAULT, "qone": _v, "qdense": {"qkv": _v, "o_proj": _v}}
# the quantized step before dense_kernels.QUANT_ONE_ROW (every one-row block product on DECODE_GEMV's tiles)
ARMS["q-looped"] = {**_DEFAULT, "qdense": {}}
# the quantized step with the RMSNorm before q/k/v in its own launch (dense_kernels.FUSE_NORM_QUANT off): the runtime
# before bench/results/h200_session13/
ARMS["q-norm-apart"] = {**_DEFAULT, "qnorm": False}
# the quantized step's output head on DECODE_GEMV's tiles (no `lm_head` entry in dense_kernels.QUANT_ONE_ROW): the
# runtime before bench/results/h200_session18/
ARMS["q-head-before"] = {**_DEFAULT, "qnohead": True}
# the quantized one-row tiles before bench/results/h200_session13/quant_tiles/: no one-row expert variant for block
# formats, Q4_0 experts on n8j2np, o_proj on the one-step tiles, q/k/v on DECODE_GEMV's
ARMS["q-tiles-before"] = {**_DEFAULT, "qship": False, "qdense": {"o_proj": "qone4j2"}, "qdecode": {"q4_0": "n8j2np"}}
# the routing kernel launched without PDL (the experts' kernel after it then starts once it is done): H200, A3B
# one-row step 2.63 -> 2.66 ms at 1k context (bench/results/h200_session16/route_one_row_rejected/)
ARMS["route-nopdl"] = {**_DEFAULT, "skip": {"attention", "route"}, "wide": True}
# PDL on the split attention kernel too (pdl.SKIP empty): H200, A3B one-row step, 2.63 -> 2.60 ms at 1k, 2.70 -> 2.75
# at 4k, 3.16 -> 3.20 at 16k, 3.61 -> 3.66 at 32k (bench/results/h200_session10/attn_pdl/); left off
ARMS["attn-pdl"] = {**_DEFAULT, "skip": set(), "trig": set(), "wide": True}
# a one-row window's split attention on 16 or 32 query-head lines a program instead of the 64 of wider windows
# (attention_kernels.ROW_TILE_ONE)
ARMS["rt1-16"] = {**_DEFAULT, "wide": True, "rt1": 16, "rt1q8": 16}
ARMS["rt1-32"] = {**_DEFAULT, "wide": True, "rt1": 32, "rt1q8": 32}
ARMS["rt1-64"] = {**_DEFAULT, "wide": True, "rt1": 64, "rt1q8": 64, "q8_one_regs": 0}   # q8_0's one-row tile before
# a q8_0 cache's windows of 2+ rows on tiles of 32 or 16 query-head lines (attention_kernels.ROW_TILE_Q8, "rtq8")
ARMS["q8-wide32"] = {**_DEFAULT, "wide": True, "rtq8": 32}
ARMS["q8-wide16"] = {**_DEFAULT, "wide": True, "rtq8": 16}
# the split kernel's programs with nothing to compute waiting for the kernel before and loading their queries before
# they end (attention_kernels.SPLIT_EXIT_EARLY off: the runtime before it; matters with --capacity above the context)
ARMS["split-exit-late"] = {**_DEFAULT, "wide": True, "exit": False}
# the step's positions and embedding rows through torch's six launches, as before static_step.STEP_INPUTS
ARMS["inputs-torch"] = {**_DEFAULT, "wide": True, "inputs": False}
# the split kernel's working programs asking the first N positions of their first chunk into L2 before their PDL
# wait (attention_kernels.SPLIT_KV_PREFETCH; "kv-pf0": none), o_proj on the lean kernel as in h100_session36
_LEAN = {**ONE_DENSE, "o_proj": "one_d4lean"}
for _n in (0, 64, 128, 256, 1024):
    ARMS[f"kv-pf{_n}"] = {**_DEFAULT, "wide": True, "dense": _LEAN, "kv_pf": _n}
# the one-row o_proj letting the router in at its start, before its loads (moe_gemv "one_d4leantop"), not after
# its sums, without the KV prefetch and with it (the default since bench/results/h100_session37/top_pf/)
ARMS["o-lean-top"] = {**_DEFAULT, "dense": ONE_DENSE_NOW, "kv_pf": 0}
ARMS["o-lean-top-pf64"] = {**_DEFAULT, "dense": ONE_DENSE_NOW, "kv_pf": 64}
# the default with the split kernel letting the reduction in before its wait too (so o_proj's programs, let in by
# the reduction, load their weights during the q/k/v post-processing), or with chunks of 64 positions up to 4k
# (twice the programs, each with half the K/V; other bits). H100 (bench/results/h100_session38/): trig-split no
# change; tiers-64to4k 3.06 -> 3.01 ms at 1k, 3.07 -> 3.18 at 4k, 3.60 -> 3.69 at 16k
ARMS["trig-split"] = {**_DEFAULT, "wide": True, "trig": {"attention_reduce:o_early", "attention:o_early"}}
ARMS["tiers-64to4k"] = {**_DEFAULT, "wide": True, "tiers": (64, 4096, 256, 32768, 1024)}
# the default with the split attention's working programs marking their SMs and o_proj's programs on a marked SM
# loading their weights after their wait (runtime/gpu/pdl.py MARK_SMS, moe_gemv "one_d4leanaware"). H100
# (bench/results/h100_session38/): 3.06 -> 3.01 ms at 1k, 3.07 -> 3.20 at 4k, 3.60 -> 3.66 at 16k
ARMS["o-aware"] = {**_DEFAULT, "dense": {**ONE_DENSE_NOW, "o_proj": "one_d4leanaware"}, "mark": True}
# o-aware marking only while at most N split programs work (pdl.MARK_MAX); four-tier chunk layouts with 64-position
# chunks up to 1k or 2k, then the shipped tiers (other bits); and both. H100 (bench/results/h100_session39/), ms at
# 1k / 2k / 4k / 16k, default 3.07 / 3.07 / 3.07 / 3.61: o-aware64 3.01 / 3.07 / 3.08 / 3.61, o-aware32 no gain,
# tiers4-64to1k 3.01 / 3.02 / 3.08 / 3.61, tiers4-64to2k 3.01 / 2.98 / 3.12 / 3.60, both 3.02 / 3.03 / 3.09 / 3.60
ARMS["o-aware32"] = {**ARMS["o-aware"], "mark_max": 32}
ARMS["o-aware64"] = {**ARMS["o-aware"], "mark_max": 64}
ARMS["tiers4-64to1k"] = {**_DEFAULT, "wide": True, "tiers": (64, 1024, 128, 4096, 256, 32768, 1024)}
ARMS["tiers4-64to2k"] = {**_DEFAULT, "wide": True, "tiers": (64, 2048, 128, 4096, 256, 32768, 1024)}
ARMS["tiers4-64to1k+o-aware64"] = {**ARMS["o-aware64"], "tiers": (64, 1024, 128, 4096, 256, 32768, 1024)}
# a one-row window's chunks from its row's length (runtime/kv.py ONE_ROW_CHUNKS = (T, CMIN, CMAX): about T chunks a
# row, of CMIN to CMAX positions; other bits than the tiers)
ARMS["one-row-tiers"] = {**_DEFAULT, "one_row_chunks": None}      # the runtime before: KV_TIERS for one row too
# (the layouts bench/results/h100_session41/one_row_chunks/ timed; "x": CMAX 4096, "k2": 2048, "mN": CMIN N)
for _name, _lay in {"ad16": (16, 64, 1024), "ad32": (32, 64, 1024), "ad64": (64, 64, 1024), "ad96": (96, 64, 1024),
                    "ad128": (128, 64, 1024), "ad64x": (64, 64, 4096), "ad128x": (128, 64, 4096),
                    "ad64k2": (64, 64, 2048), "ad64m32": (64, 32, 2048), "ad96m32": (96, 32, 2048),
                    "ad64m16": (64, 16, 2048), "ad128m16": (128, 16, 2048)}.items():
    ARMS[_name] = {**_DEFAULT, "one_row_chunks": _lay}
# the split kernel's tile over a BF16 cache (attention_kernels.SPLIT_TILE: BS positions a step, warps, pipeline
# stages; BS other than 64 gives other bits), for the one-row layout's longer chunks
ARMS["split-s4"] = {**_DEFAULT, "split_tile": {"num_stages": 4}}
ARMS["split-w8"] = {**_DEFAULT, "split_tile": {"num_warps": 8}}
ARMS["split-bs128w8"] = {**_DEFAULT, "split_tile": {"BS": 128, "num_warps": 8, "num_stages": 2}}
ARMS["split-bs32s4"] = {**_DEFAULT, "split_tile": {"BS": 32, "num_stages": 4}}
# the same over a q8_0 cache (ONE_ROW_CHUNKS_Q8; `--kv q8_0`): more chunks than the BF16 layout's, its dequantizing
# programs wanting more of them (three an SM under SPLIT_ONE_Q8_REGS)
for _t in (96, 128, 256):
    ARMS[f"q8ad{_t}"] = {**_DEFAULT, "one_row_chunks_q8": (_t, 64, 1024)}
ARMS["ad64m32+o-aware64"] = {**ARMS["o-aware64"], "one_row_chunks": (64, 32, 2048)}
# the one-row o_proj product on its one-step tile under a register cap of 128 (moe_gemv "one_d4r128": 4 programs an
# SM, so its 512 programs are resident at once and all load their weights before their wait; 168 registers uncapped)
ARMS["o-regs128"] = {**_DEFAULT, "dense": {**ONE_DENSE, "o_proj": "one_d4r128"}}
# the one-row o_proj product on the lean kernel (moe_gemv "one_d4lean", `_one_dense_kernel`: the same sums, 86
# registers a thread, five programs an SM, the router let in after its sums), no KV prefetch: the default from
# bench/results/h100_session36/lean/ to h100_session37; "o-tile": on the GEMV kernel's one-step tile as before
ARMS["o-lean"] = {**_DEFAULT, "dense": _LEAN, "kv_pf": 0}
ARMS["o-tile"] = {**_DEFAULT, "dense": ONE_DENSE}
# the one-row down products + top-k sum letting the next kernel in after their sums ("REL": pdl.release), where
# the kernel takes 128 registers a thread instead of 156 (four programs an SM instead of three). H100: slower, 3.10
# -> 3.21 ms at 1k, 3.67 -> 3.76 at 16k (the next layer's q/k/v, scheduled later, loads its weights later)
ARMS["sum-rel"] = {**_DEFAULT, "sum": {**SUM, "REL": 1}}
ARMS["o-lean+sum-rel"] = {**_DEFAULT, "dense": _LEAN, "kv_pf": 0, "sum": {**SUM, "REL": 1}}
# a q8_0 cache's one-row tile without its register cap (attention_kernels.SPLIT_ONE_Q8_REGS, "q8_one_regs")
ARMS["q8-one-nocap"] = {**_DEFAULT, "wide": True, "q8_one_regs": 0}
# the split attention kernel under a register cap ("split_regs": SPLIT_TILE(_Q8)'s maxnreg; more programs an SM)
ARMS["split-regs168"] = {**_DEFAULT, "wide": True, "split_regs": 168}
ARMS["split-regs128"] = {**_DEFAULT, "wide": True, "split_regs": 128}
# a q8_0 cache's tiles left to Triton's pipeliner ("q8_pipe": SPLIT_TILE_Q8's stages, Q8_PREFETCH off)
ARMS["q8-pipe3"] = {**_DEFAULT, "wide": True, "q8_pipe": 3}
ARMS["q8-pipe4"] = {**_DEFAULT, "wide": True, "q8_pipe": 4}
ARMS["q8-pipe4-regs168"] = {**_DEFAULT, "wide": True, "q8_pipe": 4, "split_regs": 168}
# the runtime before pdl.TRIGGER_FIRST (bench/results/h200_session15/): the split kernel without PDL, the reduction
# waiting first
ARMS["split-apart"] = {**_DEFAULT, "skip": {"attention", "attention:o_early"}, "trig": set(), "wide": True}
ARMS["q-split-apart"] = ARMS["split-apart"]
# parts that let the next kernel be scheduled before their own wait (pdl.TRIGGER_FIRST, "trig"): the reduction (so
# o_proj's programs load their weights while the split attention still runs; with PDL on the split too, or not),
# q/k/v post-processing and the split as well, the routing (gate/up scheduled during it), the down products + sum
# (the next layer's q/k/v loading early)
# (parts named as before runtime/gpu/pdl.py split them by o_early: each stands for both of its forms)
_TRIG = {
    "trig-reduce": ({"attention_reduce"}, set()),
    "trig-reduce-split-apart": ({"attention_reduce"}, {"attention"}),
    "trig-attn": ({"attention", "attention_reduce"}, set()),
    "trig-post-attn": ({"post", "attention", "attention_reduce"}, set()),
    "trig-route": ({"route"}, {"attention"}),
    "trig-down": ({"down_sum"}, {"attention"}),
    "trig-all": ({"post", "attention", "attention_reduce", "route", "down_sum"}, set()),
}


def _both(parts: set[str]) -> set[str]:
    return parts | {p + ":o_early" for p in parts if p.startswith("attention")}


for _name, (_trig, _skip) in _TRIG.items():
    ARMS[_name] = {**_DEFAULT, "skip": _both(_skip), "trig": _both(_trig), "wide": True}
QUANT_ARMS = ("before", "moe1+pdl-attn", "default")
QUANT_FORMATS = ("q8_0", "q5_0", "q4_0")
# verify windows of a quantized target (with --widths 4,8): the default, and the experts of every width on other
# looped tiles (moe_gemv.DECODE_GEMV of the block formats; Q4_0's is u4d8k2np since h200_session13)
ARMS["q-wide-default"] = {**_DEFAULT, "wide": True}
for _v in ("n8j2np", "u4d8k2np", "n4j2k2np", "n8j2k2np"):
    ARMS[f"q-wide-{_v}"] = {**_DEFAULT, "wide": True, "qdecode": dict.fromkeys(QUANT_FORMATS, _v)}

# Q8_0 / Q4_0 rows one at a time (moe_gemv `_rows32r`, the R1 variants, two words of a block a thread): the experts
# alone, then the dense one-row products and the output head too ("qhead")
_R1 = {"q4_0": "r4d8k2w4j2", "q8_0": "r4d8k2w4j2"}
# the MoE half of a one-row step (float experts) in one persistent launch (runtime/gpu/moe_row.py), and its tiles
ARMS["moe-row"] = {**_DEFAULT, "moe_row": {}}
ARMS["moe-row-pps1"] = {**_DEFAULT, "moe_row": {"PPS": 1}}
ARMS["moe-row-rd1"] = {**_DEFAULT, "moe_row": {"RD": 1}}
ARMS["moe-row-q-w8"] = {**_DEFAULT, "moe_row": {}, "moe_row_q": {"num_warps": 8, "PPS": 2, "RU": 2, "RD": 2}}
ARMS["q-r1-experts"] = {**_DEFAULT, "qdecode": _R1, "qone": "r4d8k2w4j2"}
ARMS["q-r1-all"] = {**_DEFAULT, "qdecode": _R1, "qone": "r4d8k2w4j2",
                    "qdense": {"qkv": "r4d8k2w4j2", "o_proj": "r4d8k4w4j2"}, "qhead": "r4d8k2w4j2"}
# the one-row experts split over the intermediate (runtime/gpu/moe_split.py, "ffn": a key of its TILES): gate/up
# and each slice's down share in one grid, then the partials' sum, in place of gate/up, then down + top-k sum
# (H100, bench/results/h100_session39/split/: ffn-s16p3 3.07 -> 3.33 ms at 1k, the partials' sum adding 11 us a layer)
for _t in moe_split.TILES:
    ARMS[f"ffn-{_t}"] = {**_DEFAULT, "ffn": _t}


def set_arm(arm: dict[str, Any], one_row: dict[str, str | None]) -> None:
    """The module switches of one arm (every switch it does not name off)."""
    from runtime import kv
    from runtime.gpu import attention_kernels, dense_kernels, moe_gemv, moe_kernels, moe_row, moe_split, pdl
    from runtime.gpu import static_step as static_step_mod

    kv.KV_TIERS = arm.get("tiers", TIERS_SHIPPED)
    kv.ONE_ROW_CHUNKS = arm.get("one_row_chunks", ONE_ROW_CHUNKS_SHIPPED)
    kv.ONE_ROW_CHUNKS_Q8 = arm.get("one_row_chunks_q8", ONE_ROW_CHUNKS_Q8_SHIPPED)
    attention_kernels.REDUCE_TILE = arm.get("reduce", REDUCE_SHIPPED)
    attention_kernels.ROW_TILE_ONE = arm.get("rt1", attention_kernels.ROW_TILE)
    attention_kernels.ROW_TILE_ONE_Q8 = arm.get("rt1q8", attention_kernels.ROW_TILE_ONE)
    attention_kernels.ROW_TILE_Q8 = arm.get("rtq8", attention_kernels.ROW_TILE)
    attention_kernels.Q8_PREFETCH = Q8_PREFETCH_SHIPPED and not arm.get("q8_pipe")
    attention_kernels.SPLIT_ONE_Q8_REGS = arm.get("q8_one_regs", 0)
    attention_kernels.SPLIT_EXIT_EARLY = bool(arm.get("exit"))
    static_step_mod.STEP_INPUTS = bool(arm.get("inputs"))
    attention_kernels.SPLIT_KV_PREFETCH = int(arm.get("kv_pf", 0))
    attention_kernels.SPLIT_TILE_Q8["num_stages"] = arm.get("q8_pipe", Q8_STAGES_SHIPPED)
    attention_kernels.SPLIT_TILE.clear()
    attention_kernels.SPLIT_TILE.update(SPLIT_TILE_SHIPPED, **arm.get("split_tile", {}))
    for tile in (attention_kernels.SPLIT_TILE, attention_kernels.SPLIT_TILE_Q8):
        tile.pop("maxnreg", None)
        if arm.get("split_regs"):
            tile["maxnreg"] = arm["split_regs"]
    pdl.ENABLED = bool(arm.get("pdl"))
    pdl.MARK_SMS = bool(arm.get("mark"))
    pdl.MARK_MAX = int(arm.get("mark_max", 0))
    if pdl.MARK_SMS and torch.cuda.is_available():
        pdl.sm_marks(torch.empty(0, device="cuda"))        # allocated (zeroed) before any graph is captured
    for role in dense_kernels.ONE_ROW_DENSE:
        dense_kernels.ONE_ROW_DENSE[role] = arm.get("dense", {}).get(role)
    moe_gemv.EARLY_LOADS = not arm.get("late")
    dense_kernels.FUSE_NORM = bool(arm.get("norm"))
    dense_kernels.FUSE_NORM_QUANT = bool(arm.get("qnorm"))
    moe_gemv.DOWN_SUM = arm.get("sum")
    moe_split.TILE = moe_split.TILES[arm["ffn"]] if arm.get("ffn") else None
    moe_row.ENABLED = arm.get("moe_row") is not None
    moe_row.TILE.update(MOE_ROW_SHIPPED, **(arm.get("moe_row") or {}))
    moe_row.QTILE.update(MOE_ROW_Q_SHIPPED, **(arm.get("moe_row_q") or {}))
    moe_kernels.ROUTE_WARPS_ONE_ROW = arm.get("route_warps", 4)
    pdl.SKIP.clear()
    # an arm without "trig" predates the o_early forms of the attention parts: each part it skips, in both forms
    pdl.SKIP.update(arm.get("skip", ()) if "trig" in arm else _both(set(arm.get("skip", ()))))
    pdl.TRIGGER_FIRST.clear()
    pdl.TRIGGER_FIRST.update(arm.get("trig", ()))
    dense_kernels.DENSE_GEMV_ROWS.clear()
    dense_kernels.DENSE_GEMV_ROWS.update(arm.get("dense_rows", DENSE_ROWS_SHIPPED))
    moe_gemv.DECODE_GEMV_NARROW.clear()
    if arm.get("narrow"):
        moe_gemv.DECODE_GEMV_NARROW["bf16"] = arm["narrow"]
    moe_gemv.DECODE_GEMV.update(DECODE_SHIPPED)
    moe_gemv.DECODE_GEMV.update(arm.get("qdecode", {}))
    moe_gemv.DECODE_GEMV_ONE_ROW.clear()
    if arm.get("qship"):
        moe_gemv.DECODE_GEMV_ONE_ROW.update({q: v for q, v in ONE_ROW_SHIPPED.items() if q in QUANT_FORMATS})
    dense_kernels.QUANT_ONE_ROW.clear()
    dense_kernels.QUANT_ONE_ROW.update(QUANT_ONE_ROW_SHIPPED)
    for q in QUANT_FORMATS:
        if arm.get("qone"):
            moe_gemv.DECODE_GEMV_ONE_ROW[q] = arm["qone"]
        if arm.get("qdense") is not None:
            for role in ("qkv", "o_proj"):
                dense_kernels.QUANT_ONE_ROW.pop((q, role), None)
            dense_kernels.QUANT_ONE_ROW.update({(q, role): v for role, v in arm["qdense"].items()})
        if arm.get("qnohead"):
            dense_kernels.QUANT_ONE_ROW.pop((q, "lm_head"), None)
        if arm.get("qhead") and q in ("q8_0", "q4_0"):
            dense_kernels.QUANT_ONE_ROW[(q, "lm_head")] = arm["qhead"]
    if arm.get("moe1") is True:
        moe_gemv.DECODE_GEMV_ONE_ROW.update(one_row)
    elif arm.get("moe1"):
        moe_gemv.DECODE_GEMV_ONE_ROW["bf16"] = arm["moe1"]


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


def interleaved_times(built: dict[tuple, Any], kvs: dict[int, Any], wins: dict[int, torch.Tensor], rounds: int,
                      steps: int) -> dict[tuple, list[float]]:
    """ms per step of each captured step keyed (arm, context, width), `rounds` rounds of `steps` replays over all of
    them, each round starting one step further along (drift hits every arm alike)."""
    times: dict[tuple, list[float]] = {k: [] for k in built}
    for r in range(rounds):
        order = list(built)
        order = order[r % len(order):] + order[:r % len(order)]
        for k in order:
            times[k].append(time_steps(built[k], kvs[k[1]], wins[k[2]], steps))
    return times


def run(model, arms: list[str], contexts: list[int], widths: list[int], rounds: int, steps: int, tag: str,
        one_row: dict[str, str | None], kv_dtype: str = "bf16", capacity: int = 0
        ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from bench.context import gen, make_kv
    from runtime.gpu.static_step import StaticStep

    vocab = model.cfg.vocab_size
    steps_by: dict[tuple[str, int, int], Any] = {}
    kvs = {c: make_kv(model, c, kv_dtype, capacity=max(capacity, c + 64)) for c in contexts}
    wins = {w: torch.randint(0, vocab, (1, w), device="cuda", generator=gen(w)) for w in widths}
    logits: dict[tuple[str, int, int], torch.Tensor] = {}
    errors: dict[str, list[str]] = {}
    for a in arms:
        set_arm(ARMS[a], one_row)
        for c in contexts:
            for w in widths:
                if w > 1 and not ARMS[a].get("wide"):
                    continue
                st = StaticStep(model, kvs[c], w, graph=True)
                for _ in range(2):                        # capture, then one replay
                    logits[(a, c, w)] = one_step(st, kvs[c], wins[w])
                errors[f"{a}/{c}/{w}"] = list(st.errors)
                steps_by[(a, c, w)] = st
    set_arm(ARMS["before"] if "before" in arms else ARMS[arms[0]], one_row)
    times = interleaved_times(steps_by, kvs, wins, rounds, steps)
    rows = []
    for (a, c, w), ts in times.items():
        ref = logits.get(("before", c, w), logits.get((arms[0], c, w)))     # else: against the first arm
        got = logits[(a, c, w)]
        row = {"build": tag, "arm": a, "context": c, "width": w, "step_ms": median(ts), "rounds_ms": ts,
               "graph": steps_by[(a, c, w)].use_graph, "errors": errors[f"{a}/{c}/{w}"]}
        if ref is not None:
            row["bit_equal_to_before"] = bool(torch.equal(got, ref))
            row["max_abs_diff"] = float((got - ref).abs().max())
            row["top1_agree"] = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
        rows.append(row)
    checks = []
    for a, base in (("moe1+pdl", "moe1"), ("moe1+pdl-attn", "moe1"), ("moe1", "before"),
                    ("default-late", "default")):       # EARLY loads move loads, never arithmetic
        for c in contexts:      # launch options never change bits; nor do one-row options a wide step
            for w in widths:
                if (a, c, w) in logits and (base, c, w) in logits and (base != "before" or w > 1):
                    ok = bool(torch.equal(logits[(a, c, w)], logits[(base, c, w)]))
                    checks.append({"build": tag, "check": f"{a} == {base} (context {c}, width {w})", "ok": ok})
        if tag != "bf16" and (a, contexts[0], 1) in logits and ("before", contexts[0], 1) in logits:
            ok = bool(torch.equal(logits[(a, contexts[0], 1)], logits[("before", contexts[0], 1)]))
            checks.append({"build": tag, "check": f"{a} == before (context {contexts[0]}, width 1)", "ok": ok})
    for st in steps_by.values():
        st.graphs.clear()
    del steps_by, kvs
    torch.cuda.empty_cache()
    return rows, checks


PREFILL_ARMS: dict[str, dict[str, Any]] = {      # the module forward or the fused chunk; PDL on the MoE kernels or not
    "module forward": {"pdl": True, "skip": {"attention", "attention_reduce"}, "fused": False},
    "fused chunk": {"pdl": True, "skip": {"attention", "attention_reduce"}, "fused": True},
    "fused chunk, no pdl": {"pdl": False, "fused": True},
    "fused chunk, 64-row MoE tiles": {"pdl": True, "skip": {"attention", "attention_reduce"}, "fused": True, "tiles": (   # before
        {"BM": 64, "BN": 64, "BK": 64, "GM": 8, "num_warps": 4, "num_stages": 3},
        {"BM": 64, "BN": 128, "BK": 64, "GM": 8, "num_warps": 8, "num_stages": 3})},
}


def prefill_ab(model, prompts: list[int], chunks: list[int], rounds: int, peak: float) -> list[dict[str, Any]]:
    """Prefill tok/s per arm, interleaved rounds, median (bench/context.py's timing of one prompt)."""
    from bench.context import prefill_flops_per_token, time_prefill
    from runtime.gpu import moe_kernels, pdl, prefill_chunk

    tiles = (moe_kernels.MOE_PRE_UP, moe_kernels.MOE_PRE_DOWN)

    times: dict[tuple[str, int, int], list[float]] = {}
    for _ in range(rounds):
        for n in prompts:
            for c in chunks:
                for name, arm in PREFILL_ARMS.items():
                    pdl.ENABLED = arm["pdl"]
                    prefill_chunk.ENABLED = arm["fused"]
                    moe_kernels.MOE_PRE_UP, moe_kernels.MOE_PRE_DOWN = arm.get("tiles", tiles)
                    pdl.SKIP.clear()
                    pdl.SKIP.update(arm.get("skip", ()))
                    times.setdefault((name, n, c), []).append(time_prefill(model, n, "bf16", c))
    prefill_chunk.ENABLED = True
    moe_kernels.MOE_PRE_UP, moe_kernels.MOE_PRE_DOWN = tiles
    rows = []
    for (name, n, c), ts in times.items():
        tok_s = median(ts)
        bound = peak / prefill_flops_per_token(model, n)
        rows.append({"arm": name, "prompt": n, "chunk": c, "tok_s": tok_s, "rounds_tok_s": ts, "bound_tok_s": bound,
                     "frac_of_bound": tok_s / bound})
    return rows


def prefill_check(model, n: int, chunk: int) -> dict[str, Any]:
    """The module forward and the fused chunk on one prompt: the last row's logits and the K/V they leave."""
    from bench.context import DT
    from runtime.gpu import prefill_chunk
    from runtime.kv import KVCache
    from runtime.speculative import prefill

    c = model.cfg
    ids = torch.randint(0, c.vocab_size, (n,), generator=torch.Generator().manual_seed(n + 1)).tolist()
    got = []
    for fused in (False, True):
        prefill_chunk.ENABLED = fused
        kv = KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, n + 8, dtype=DT, device="cuda")
        with torch.no_grad():
            logits = prefill(model, kv, ids, (), chunk).float()
        got.append((logits, kv))
    prefill_chunk.ENABLED = True
    (la, ka), (lb, kb) = got
    k_rel = float((ka.k[..., :n, :].float() - kb.k[..., :n, :].float()).norm() / ka.k[..., :n, :].float().norm())
    return {"prompt": n, "chunk": chunk, "top1_equal": bool(la.argmax() == lb.argmax()),
            "logits_max_abs_diff": float((la - lb).abs().max()), "logits_max_abs": float(la.abs().max()),
            "keys_rel_diff": k_rel, "fused_errors": list(prefill_chunk.ERRORS)}


def quant_best(path: str, fmt: str) -> str:
    """Register the arm 'quant-best-<fmt>': the default with the fastest one-row tiles of a gemv_one_row_quant.json
    for `fmt` (the experts' gate/up tile with the down tile of its own best, the dense tile fastest over q/k/v and
    o_proj together); returns its name."""
    import json

    from runtime.gpu import moe_gemv

    rows = [r for r in json.loads(Path(path).read_text())["rows"] if r.get("fmt") == fmt and "us" in r
            and r["rel_err"] < 1e-2]

    def fastest(matrix: str) -> dict[str, Any]:
        return min((r for r in rows if r["matrix"] == matrix), key=lambda r: r["us"])

    up, down = fastest("experts up"), fastest("experts down")
    merged = {**up["cfg"], "BN_DOWN": down["cfg"]["BN_DOWN"]}
    if up["cfg"].get("ONE") != down["cfg"].get("ONE") or up["cfg"]["J"] != down["cfg"]["J"]:
        merged = up["cfg"] if up["us"] * 2 > down["us"] else {**down["cfg"], "BN_UP": down["cfg"]["BN_UP"]}
    dense: dict[str, float] = {}
    for r in rows:
        if r["matrix"] in ("qkv", "o_proj"):
            dense[r["method"]] = dense.get(r["method"], 0.0) + r["us"]
    best_dense = min(dense, key=lambda m: dense[m], default=None)
    best_dense = None if best_dense == "shipped" else best_dense
    moe_gemv.GEMV_VARIANTS[f"_best_{fmt}"] = merged
    name = f"quant-best-{fmt}"
    ARMS[name] = {**_DEFAULT, "qone": f"_best_{fmt}", "qdense": {"qkv": best_dense, "o_proj": best_dense}
                  if best_dense else {}}
    print(f"{name}: experts {up['method']} / {down['method']} -> {merged}; dense {best_dense}")
    return name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,32768")
    ap.add_argument("--widths", default="1,8")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--quant", default="", help="also time a quantized build (q4_0, q8_0) in QUANT_ARMS")
    ap.add_argument("--prefill", default="", help="prompt lengths for the prefill A/B (PREFILL_ARMS), e.g. 8192")
    ap.add_argument("--chunks", default="2048,8192", help="prefill chunks for the prefill A/B")
    ap.add_argument("--no-decode", action="store_true", help="only the prefill A/B")
    ap.add_argument("--kv", default="bf16", choices=("bf16", "q8_0"), help="the KV cache's format (decode A/B)")
    ap.add_argument("--capacity", type=int, default=0, help="positions every cache holds (default: the context + "
                    "64); an engine's cache holds its configured context, and the split attention's grid covers it")
    ap.add_argument("--quant-arms", default="", help="arms for the quantized builds (default: QUANT_ARMS)")
    ap.add_argument("--quant-from", default="", help="a gemv_one_row_quant.json (bench/gemv_one_row.py --quant): "
                    "adds the arm 'quant-best' to the quantized builds")
    ap.add_argument("--sum-from", default="", help="a down_sum.json (bench/down_sum.py): adds the arm 'sum-best', "
                    "the default with its fastest down_sum tiles")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/step_ab.py needs a CUDA GPU.", file=sys.stderr)
        return 2
    from bench.context import build_a3b, kv_bytes_per_position, weight_bytes
    from runtime.gpu import moe_gemv, pdl

    one_row = dict(moe_gemv.DECODE_GEMV_ONE_ROW)
    if args.sum_from:
        import json

        got = json.loads(Path(args.sum_from).read_text())
        best = next(r["cfg"] for r in got["rows"] if r["method"] == got["best"])
        ARMS["sum-best"] = {**_DEFAULT, "sum": best}
        print(f"sum-best: {got['best']} {best}")
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
    if args.prefill:
        from bench.common import matmul_peak

        peak = matmul_peak()
        res["matmul_peak_TFLOPs"] = peak / 1e12
        res["prefill_check"] = [prefill_check(model, int(x), int(args.chunks.split(",")[0]))
                                for x in args.prefill.split(",")]
        for r in res["prefill_check"]:
            print(f"prefill {r['prompt']} (chunk {r['chunk']}): module vs fused: top-1 equal {r['top1_equal']}, "
                  f"max |logit diff| {r['logits_max_abs_diff']:.3g} of {r['logits_max_abs']:.3g}, keys "
                  f"{r['keys_rel_diff']:.2e} relative; errors {r['fused_errors']}", flush=True)
        res["prefill"] = prefill_ab(model, [int(x) for x in args.prefill.split(",")],
                                    [int(x) for x in args.chunks.split(",")], 3, peak)
        print_table(f"Prefill A/B (bf16 matmul peak {peak / 1e12:.0f} TFLOP/s; median of 3 interleaved rounds)",
                    ["arm", "prompt", "chunk", "tok/s", "% of bound", "rounds"],
                    [[r["arm"], r["prompt"], r["chunk"], r["tok_s"], r["frac_of_bound"] * 100,
                      " ".join(f"{t:,.0f}" for t in r["rounds_tok_s"])] for r in res["prefill"]])
        set_arm(ARMS["before"], one_row)
    if args.no_decode:
        write_json("step_ab.json", res)
        return 0
    res["kv_dtype"] = args.kv
    res["capacity"] = args.capacity
    rows, checks = run(model, arms, contexts, widths, args.rounds, args.steps, "bf16", one_row, args.kv, args.capacity)
    for r in rows:
        r["kv_dtype"] = args.kv
        if r["width"] == 1:
            b = dense + k * expert * n_moe + r["context"] * kv_bytes_per_position(model, args.kv)
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

        qarms = [a for a in args.quant_arms.split(",") if a] or list(QUANT_ARMS)
        if args.quant_from:
            qarms.append(quant_best(args.quant_from, q))
        qm = build_on_gpu(A3B_SHAPE, q)
        qrows, qchecks = run(qm, qarms, contexts, widths, args.rounds, args.steps, q, one_row, args.kv, args.capacity)
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
