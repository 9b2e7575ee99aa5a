"""Decode-window expert kernels shaped like a matrix-vector product (docs/models.md, "Numerics").

A decode or verify window gives each expert only a few rows (one at W = 1, 1.6 on average at W = 16 on the
Qwen3-30B-A3B shape), so the expert kernels are bound by reading the weights once, and the tiles are chosen for
that: a program takes BN weight rows of one expert (for its leader pair, as in runtime/gpu/moe_kernels.py) and walks
the whole reduction, so W = 1 already has hundreds of programs per matrix; the window's rows of that expert go
through in groups of MB. Block-format weights are read as 16-bit words (every ggml block and field is 2-byte
aligned), and each 4/6/8-bit field becomes a float with a bit operation and one subtraction: the field, in place,
or-ed into the bits of 2^23, is the float 2^23 + field * 2^p (exact while p + width <= 23); subtracting
2^23 + bias * 2^p leaves (code - bias) * 2^p exactly, and the activation it multiplies is pre-scaled by 2^-p (exact),
so each product is the one of the code itself. The block's scale multiplies the block's partial sum,
d * sum(code * x), instead of each dequantized weight, sum((d * code) * x): the same dequantized values as gguf-py's
(every d * code is exact in fp32), summed in another order. Partial products stay in an fp32 accumulator shaped like
the loaded tile and are reduced once per row at the end.

What makes it fast is where values live, which Triton decides from the tiles (checked in the kernels' SASS): a
thread holds all BN rows of its word positions (so an activation it loads serves BN rows, and the rows are constant
offsets from one address: the row stride is a compile-time constant), warps never split the rows, scales and
activations are loaded straight into the code tile's layout (no shared-memory shuffle), and the next step's words
are loaded before this step's arithmetic (PF). On a GPU two inline PTX instructions keep the compiler from moving
the magic-number or past the loop's back edge (it would then carry the words as packed 16-bit pairs). That layout is
Triton 3.6's choice: the tile's dimensions other than the words tie in contiguity, and Triton 3.9 breaks the tie the
other way, spreading the rows over threads (shared memory, barriers and shuffles in the loop; 16-82% slower kernels).
The R1 tiles (`_rows32r`, Q8_0 / Q4_0 / IQ4_NL; `_rowskr`, Q4_K) leave no such choice: every tensor of a pass is
one-dimensional and each row its own tensor; they take over from Triton 3.9 on (`R1_FROM`), and the Q4_K experts'
gate/up of one-row windows take theirs on every Triton (`DECODE_GEMV_ONE_ROW`).

Row invariance (BN, the loop step and MB are the same for every window width; a row's reduction order depends only
on its place in the tile), the slot table, missed experts' rows and graph capture are those of the tl.dot kernels of
`moe_kernels.experts`, which calls these for decode windows. `DECODE_GEMV` picks a variant of `GEMV_VARIANTS` per
weight format (None: the tl.dot kernels); `python bench/moe.py --tune-decode` measures them.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from runtime.gpu import pdl
from runtime.gpu.kernels import HAVE_TRITON, triton_version

if HAVE_TRITON:
    import triton
    import triton.language as tl

# BN_UP / BN_DOWN: weight rows per program (gate/up: BN gate rows and their BN up rows); KV: values of a row per loop
# step (whole blocks, a power of two of them that divides the row); MB: window rows of one expert per pass (1, 2);
# PF: prefetch the next step's words; J: code words of a 32-value block per thread (1, 2; Q8_0 up to 4), whose sum
# takes the block's scale once; num_warps: at most (fewer when a step has too few blocks to keep warps off the rows)
GEMV_VARIANTS: dict[str, dict[str, int]] = {
    "n8j2": {"BN_UP": 8, "BN_DOWN": 8, "KV": 512, "MB": 1, "PF": 1, "J": 2, "num_warps": 4, "num_stages": 1},
    "n16j2": {"BN_UP": 16, "BN_DOWN": 16, "KV": 256, "MB": 1, "PF": 1, "J": 2, "num_warps": 4, "num_stages": 1},
    "n8j1": {"BN_UP": 8, "BN_DOWN": 8, "KV": 512, "MB": 1, "PF": 1, "J": 1, "num_warps": 4, "num_stages": 1},
    "n4j2": {"BN_UP": 4, "BN_DOWN": 8, "KV": 512, "MB": 1, "PF": 1, "J": 2, "num_warps": 4, "num_stages": 1},
    "n8j2np": {"BN_UP": 8, "BN_DOWN": 8, "KV": 512, "MB": 1, "PF": 0, "J": 2, "num_warps": 4, "num_stages": 1},
    "n8j2m2": {"BN_UP": 8, "BN_DOWN": 8, "KV": 256, "MB": 2, "PF": 1, "J": 2, "num_warps": 4, "num_stages": 1},
    "n16d32": {"BN_UP": 16, "BN_DOWN": 32, "KV": 256, "MB": 1, "PF": 1, "J": 2, "num_warps": 4, "num_stages": 1},
    # rows in one step (KV covers the row: a program loads its whole tile at once; 32-value block formats too, as a
    # power of two of blocks at or above the row's, the tail's scales zero; K-quants take KV-value steps); EARLY:
    # before the PDL wait where the caller allows it (`down`)
    "one4x16": {"ONE": 1, "BN_UP": 4, "BN_DOWN": 16, "KV": 4096, "MB": 1, "PF": 0, "J": 1, "num_warps": 4, "num_stages": 1,
                "EARLY": 1},
    "one2x8": {"ONE": 1, "BN_UP": 2, "BN_DOWN": 8, "KV": 4096, "MB": 1, "PF": 0, "J": 1, "num_warps": 4, "num_stages": 1,
               "EARLY": 1},
    "u1d32": {"ONE_UP": 1, "BN_UP": 1, "BN_DOWN": 32, "KV": 4096, "MB": 1, "PF": 1, "J": 2, "num_warps": 4,
              "num_stages": 1},      # gate/up in one step, down as n16d32
    "u2d32": {"ONE_UP": 1, "BN_UP": 2, "BN_DOWN": 32, "KV": 4096, "MB": 1, "PF": 1, "J": 2, "num_warps": 4,
              "num_stages": 1},
    "one_d1": {"ONE": 1, "BN_UP": 1, "BN_DOWN": 1, "KV": 4096, "MB": 1, "PF": 0, "J": 1, "num_warps": 4, "num_stages": 1,
               "EARLY": 1},
    "one_d4": {"ONE": 1, "BN_UP": 4, "BN_DOWN": 4, "KV": 4096, "MB": 1, "PF": 0, "J": 1, "num_warps": 4, "num_stages": 1,
               "EARLY": 1},
    "one_d8": {"ONE": 1, "BN_UP": 8, "BN_DOWN": 8, "KV": 4096, "MB": 1, "PF": 0, "J": 1, "num_warps": 4, "num_stages": 1,
               "EARLY": 1},
    # one_d4 on `_one_dense_kernel` ("LEAN": one float row of a dense matrix, none of the expert machinery, the next
    # kernel let in after the sums): 86 registers a thread against 168 (Triton 3.6, sm_90), so all of the A3B
    # o_proj's 512 programs can be resident at once
    "one_d4lean": {"ONE": 1, "BN_UP": 4, "BN_DOWN": 4, "KV": 4096, "MB": 1, "PF": 0, "J": 1, "num_warps": 4,
                   "num_stages": 1, "EARLY": 1, "LEAN": 1},
    # the same, the next kernel (the router) let in at the program's start, before its loads ("TOP"), so its
    # programs are scheduled and waiting when o_proj ends: still 86 registers (sm_90, Triton 3.6); the router adds
    # 2.2 us a layer instead of 2.7 on an H100 (bench/step_timeline.py; dense_kernels.ONE_ROW_DENSE)
    "one_d4leantop": {"ONE": 1, "BN_UP": 4, "BN_DOWN": 4, "KV": 4096, "MB": 1, "PF": 0, "J": 1, "num_warps": 4,
                      "num_stages": 1, "EARLY": 1, "LEAN": 1, "TOP": 1},
    # the same, a program on an SM the split attention marked loading after its wait (runtime/gpu/pdl.py MARK_SMS)
    "one_d4leanaware": {"ONE": 1, "BN_UP": 4, "BN_DOWN": 4, "KV": 4096, "MB": 1, "PF": 0, "J": 1, "num_warps": 4,
                        "num_stages": 1, "EARLY": 1, "LEAN": 1, "TOP": 1, "AWARE": 1},
    # one_d4 under a register cap ("maxnreg": registers a thread): four programs an SM instead of three, so the
    # A3B's o_proj (512 programs) is resident in one wave. It spills 28 values a thread: the one-row step 3.11 ->
    # 3.26 ms at 1k on an H100 (bench/step_ab.py arm o-regs128, bench/results/h100_session36/timeline/); not used
    "one_d4r128": {"ONE": 1, "BN_UP": 4, "BN_DOWN": 4, "KV": 4096, "MB": 1, "PF": 0, "J": 1, "num_warps": 4,
                   "num_stages": 1, "EARLY": 1, "maxnreg": 128},
}
# one-step tiles for block-format rows: BN rows of gate/up and of down a program, J words of a block a thread
for _bn in (2, 4, 8, 16):
    for _j in (1, 2):
        GEMV_VARIANTS[f"qone{_bn}j{_j}"] = {"ONE": 1, "BN_UP": _bn, "BN_DOWN": _bn, "KV": 4096, "MB": 1, "PF": 0,
                                           "J": _j, "num_warps": 4, "num_stages": 1, "EARLY": 1}
# looped block tiles with more blocks a step (k2: 1024 values, k4: 2048), so a program gets more warps (`_warps`
# gives it no more than a step's blocks keep off the rows: 512 values of Q4_0 make 2). H200, A3B top-8, 48 calls in
# a graph (bench/gemv_one_row.py --quant, bench/results/h200_session13/quant_tiles/): Q4_0 gate/up 10.1 -> 9.4 us
# with 4 rows a program (u4d8k2np; its down products as before, 5.2), Q8_0 down 8.3 -> 7.8 with 4 (n4j2k2np;
# gate/up 13.4 either way). Q4_0 takes u4d8k2np at every width (bench/step_ab.py --widths 4,8 --quant q4_0, arm
# q-wide-u4d8k2np: steps of 4 and 8 rows 6.54 -> 6.43 and 9.75 -> 9.49 ms at 1k context; one row 2.17 either way),
# Q8_0 n4j2k2np for one-row windows
for _bn, _kv in ((4, 1024), (8, 1024), (16, 1024), (4, 2048), (8, 2048)):
    for _pf in (0, 1):
        GEMV_VARIANTS[f"n{_bn}j2k{_kv // 512}{'' if _pf else 'np'}"] = {
            "BN_UP": _bn, "BN_DOWN": _bn, "KV": _kv, "MB": 1, "PF": _pf, "J": 2, "num_warps": 8, "num_stages": 1}
GEMV_VARIANTS["u4d8k2np"] = {**GEMV_VARIANTS["n4j2k2np"], "BN_DOWN": 8}
R1_FORMATS = ("q8_0", "q4_0", "iq4_nl", "q4_k")  # the formats `_rows32r` and `_rowskr` read
# R1: Q8_0 / Q4_0 / IQ4_NL rows one at a time over one-dimensional tiles (`_rows32r`; Q4_K: `_rowskr`), the same on
# every Triton; rN dM: N rows a program for gate/up, M for down; kK: K x 512 values a pass; wW: warps (at most a
# pass's groups / 32); jJ: J code words of a block a thread (R1 = J; Q4_K: J / 2 of each of two nibble groups,
# J = 2, 4 or 8; 4 and 8: Q4_K only)
for _u, _d, _kv, _w, _jr in ((2, 4, 1024, 4, 1), (4, 8, 1024, 4, 2), (4, 8, 2048, 4, 2), (4, 8, 1024, 4, 4),
                             (8, 8, 2048, 4, 4), (4, 8, 2048, 8, 2), (4, 8, 2048, 4, 8), (8, 8, 2048, 4, 8),
                             (4, 8, 4096, 4, 8), (2, 4, 2048, 4, 8)):
    GEMV_VARIANTS[f"r{_u}d{_d}k{_kv // 512}w{_w}" + (f"j{_jr}" if _jr > 1 else "")] = {
        "R1": _jr, "BN_UP": _u, "BN_DOWN": _d, "KV": _kv, "MB": 1, "PF": 0, "J": 1, "num_warps": _w, "num_stages": 1}
# Q4_K experts: gate/up on the row-by-row tile of eight words a thread (as r4d8k4w4j8), the down products on the
# looped tile of 16 (rk8u4d16) or 8 rows (rk8u4d8); keys ending in _UP / _DOWN override the shared ones for that
# kernel (`_side`)
GEMV_VARIANTS["rk8u4d16"] = {**GEMV_VARIANTS["n16j2k2np"], "BN_UP": 4, "R1_UP": 8, "KV_UP": 2048, "num_warps_UP": 4}
GEMV_VARIANTS["rk8u4d8"] = {**GEMV_VARIANTS["n8j2np"], "BN_UP": 4, "R1_UP": 8, "KV_UP": 2048, "num_warps_UP": 4}
# the variant per weight format for decode windows (None: the tl.dot kernels of moe_kernels)
DECODE_GEMV: dict[str, str | None] = {
    "bf16": None, "q8_0": "n8j2np", "q5_0": "n8j2", "q4_0": "u4d8k2np", "q6_k": "n8j2np", "q4_k": "n8j2np",
    "q5_k": "n8j2np",                                     # Q4_K's tile; the only one timed for Q5_K
    "q3_k": "n8j2k2np", "q2_k": "n16j2k2np",              # their own code (`_rows23`); timed below
    "iq4_xs": "n8j2np",                                   # its own code (`_rowsiq`), Q4_K's tile size
    "iq4_nl": "u4d8k2np"}                                 # Q4_0's blocks, its levels looked up (`_dot32`)
# the formats the GEMV kernels read (`_rows`); a table naming a variant for another is refused by `variant`
GEMV_FORMATS = ("bf16", "q8_0", "q5_0", "q4_0", "q6_k", "q4_k", "q5_k", "q3_k", "q2_k", "iq4_xs", "iq4_nl")
# for windows of one row (a target decoding alone: its fixed step is one row wide), where it differs: BF16 experts
# through the matrix-vector kernel, gate/up rows in one step, 32 down rows a program (bench/step_ab.py, H200 A3B
# one-row step at 1k context: n16d32 3.18 ms against 3.79 on the tl.dot tiles; the tl.dot tiles stay faster at W = 8
# and 16; u1d32 with the down products in `down_sum`, bench/results/h200_session8/). The choice depends only on the
# window's row count, and a run keeps one step width, so a row's bits never depend on the other rows
# (runtime/gpu/static_step.py; calibration checks each width's own reference)
# H100, A3B target alone (`bench/quant_target.py --part speed`, each format's tile in DECODE_GEMV in turn, so the
# dense one-row products took it too; bench/results/h100_session23/tiles/): Q3_K 318 -> 345 tok/s with 4
# super-blocks a step (n8j2k2np), Q2_K 313 -> 360 with 16 rows a program (n16j2k2np), both in DECODE_GEMV since
# they gain through the dense products as well (in this table alone: 313, 324); IQ4_XS fastest on n8j2np (347);
# IQ4_NL 365 on u4d8k2np everywhere, 378 on n4j2k2np everywhere, 392 with its experts' one-row windows on n4j2k2np
# (this table) and the rest on u4d8k2np. The experts alone at W = 1, 8, 16 (`bench/moe.py --tune-decode`,
# bench/results/h100_session23/tune/) pick the same tiles
# Q4_K experts of one-row windows: gate/up on the row-by-row tile (`_rowskr`, eight words a thread), down on 16 rows
# a program (rk8u4d16). H100, A3B target alone (`bench/quant_target.py --part speed --quants q4_k,q4_k_m --q4k-tiles
# experts=...`, three runs over two device calls, bench/results/h100_session34/q4k_r1/): Q4_K 362 -> 375-376 tok/s,
# Q4_K_M 345-347 -> 355; gate/up alone 14.75 -> 12.65 us (48 calls in a graph, `bench/gemv_one_row.py --quant
# q4_k`); gate/up R1 with the old down tile 370-371, the 16-row down tile alone 351 (slower)
DECODE_GEMV_ONE_ROW: dict[str, str | None] = {"bf16": "u1d32", "q8_0": "n4j2k2np", "iq4_nl": "n4j2k2np",
                                              "q4_k": "rk8u4d16"}
# for verify windows of 2 up to n rows, where it differs from DECODE_GEMV: format -> (n, variant). Same rule as the
# one-row table: chosen by the step's row count alone
DECODE_GEMV_NARROW: dict[str, tuple[int, str]] = {}
# From Triton 3.9 on, Q8_0, Q4_0 and IQ4_NL take the row-by-row tiles (R1, `_rows32r`): Triton 3.9 lays the
# [blocks, rows, words] tiles out with the rows spread over threads, and their loops move the activations through
# shared memory, with barriers and shuffles (docs/models.md, "What the counters and the machine code say"). The same
# kernels built by Triton 3.6 and 3.9, timed on one H100 (48 calls in a graph, bench/results/h200_session24/
# triton39/h100_j2/): Q4_0 gate/up 10.75 us (3.6) / 16.75 (3.9) shipped, 11.53 / 12.29 on r4d8k2w4j2; Q4_0 experts'
# down 6.15 / 7.14 against 6.30 / 6.34; Q8_0 gate/up 15.74 / 26.74 against 17.16 / 17.01; Q8_0 down 8.71 / 12.23
# against 9.91 / 9.25; IQ4_NL gate/up 13.62 / 17.41 against 15.01 / 14.44, down 8.27 / 9.34 against 8.54 / 8.65,
# its q/k/v (the dense products take DECODE_GEMV's tile) 7.80 / 12.33 against 8.26 / 8.21. On Triton 3.6 the step
# keeps the tables above (Q4_0 one-row step at 1k context 2.27 ms either way, Q8_0 2.73 against 2.95 with R1
# experts: bench/step_ab.py arms q-r1-*); the step under 3.9 is not measured here (the device has Triton 3.6). The
# Triton interpreter keeps the 3.6 tables too: it runs every operation of a tile as an array operation, and an R1
# pass is many small ones, so the tests run the step on the tables above and the R1 tiles by name
R1_FROM = (3, 9)
R1_DECODE = {"q4_0": "r4d8k2w4j2", "q8_0": "r4d8k2w4j2", "iq4_nl": "r4d8k2w4j2"}


def r1_tables() -> bool:
    """Whether this Triton takes the R1 tables (`R1_FROM`; never in the interpreter)."""
    return triton_version() >= R1_FROM and os.environ.get("TRITON_INTERPRET") != "1"


if r1_tables():
    DECODE_GEMV.update(R1_DECODE)
    DECODE_GEMV_ONE_ROW.update(R1_DECODE)

# variants with EARLY load their weights before the PDL wait where the caller allows it (False: never; the
# benchmarks' switch)
EARLY_LOADS = True

MAGIC = 0x4B000000      # the bits of the float 2^23
QT = {"bf16": 0, "q8_0": 1, "q5_0": 2, "q4_0": 3, "q6_k": 4, "q4_k": 5, "q5_k": 6, "q3_k": 7, "q2_k": 8, "iq4_xs": 9,
      "iq4_nl": 10}
BLOCK_VALUES = {0: 1, 1: 32, 2: 32, 3: 32, 4: 256, 5: 256, 6: 256, 7: 256, 8: 256, 9: 256, 10: 32}
BLOCK32 = (1, 2, 3, 10)      # the 32-value block formats (`_rows32`, one-step tiles, the folded RMSNorm)


def variant(fmt: str, rows: int | None = None) -> dict[str, int] | None:
    """The GEMV tiles for weight format `fmt` ("bf16" or a block format's name) on windows of `rows` rows (None:
    any width), or None for the tl.dot kernels."""
    if rows == 1 and fmt in DECODE_GEMV_ONE_ROW:
        table, name = "DECODE_GEMV_ONE_ROW", DECODE_GEMV_ONE_ROW[fmt]
    elif rows is not None and rows > 1 and fmt in DECODE_GEMV_NARROW and rows <= DECODE_GEMV_NARROW[fmt][0]:
        table, name = "DECODE_GEMV_NARROW", DECODE_GEMV_NARROW[fmt][1]
    else:
        table, name = "DECODE_GEMV", DECODE_GEMV.get(fmt)
    if name is None:
        return None
    if fmt not in GEMV_FORMATS:
        raise ValueError(f"{table}[{fmt!r}] names {name!r}, but the GEMV kernels do not read {fmt}; use None (the "
                         f"tl.dot kernels).")
    if name not in GEMV_VARIANTS:
        raise ValueError(f"{table}[{fmt!r}] names {name!r}, which is not in GEMV_VARIANTS; use one of "
                         f"{', '.join(GEMV_VARIANTS)} or None.")
    why = refuses(fmt, GEMV_VARIANTS[name])
    if why:
        raise ValueError(f"{table}[{fmt!r}] names {name!r}, {why}.")
    return GEMV_VARIANTS[name]


def refuses(fmt: str, cfg: dict[str, int]) -> str | None:
    """Why the row-by-row tiles of variant cfg cannot read format fmt (None: they can, or it has none)."""
    r1 = max(cfg.get(k, 0) for k in ("R1", "R1_UP", "R1_DOWN"))
    if r1 and fmt not in R1_FORMATS:
        return f"a row-by-row tile, which reads {', '.join(R1_FORMATS)} only"
    if r1 > 2 and fmt != "q4_k":
        return f"a row-by-row tile of {r1} words a thread, which reads q4_k only"
    if fmt == "q4_k" and r1 not in (0, 2, 4, 8):
        return f"a row-by-row Q4_K tile of {r1} word{'s' if r1 != 1 else ''} a thread (it takes 2, 4 or 8)"
    return None


def cover(k: int) -> int:
    """Values of a one-step tile for float rows of k values: the power of two at or above k (at least 16)."""
    return max(16, 1 << (k - 1).bit_length())


def chunk(k: int, fmt: str, kv: int, one: bool = False) -> int:
    """Blocks (bf16: values) per loop step for rows of k values: the largest power of two of them that divides the
    row and holds at most kv values (bf16: at least 16 values, the tail masked). one (a variant's ONE): float rows
    whose power-of-two cover fits kv go through in one step, the tail masked; so do 32-value block rows whose
    power-of-two cover of blocks fits kv (the tail's blocks get a zero scale)."""
    vals = BLOCK_VALUES[QT[fmt]]
    if one and vals == 1 and cover(k) <= kv:
        return cover(k)
    nblk = k // vals
    if one and vals == 32 and (1 << (nblk - 1).bit_length()) * vals <= kv:
        return 1 << (nblk - 1).bit_length()
    c = 1
    while (c * 2) * vals <= kv and nblk % (c * 2) == 0:
        c *= 2
    return max(16, c) if vals == 1 else c


if HAVE_TRITON:

    _ASM = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")      # the interpreter runs no PTX

    # Tiles are [A, BN, B] (or [A, BN, J, L]): A and B index the words of a loop step along the row (B: consecutive
    # words), BN the weight rows. Triton orders a tile's threads by contiguity (B), then by the lower dimension (A),
    # so the BN rows of a position land in one thread's registers and each activation it loads serves all of them.

    @triton.jit
    def _or(v, mg, X: tl.constexpr = 0):
        """(v ^ X) | mg, opaque to the compiler on a GPU: otherwise it moves the or past the loop's back edge and
        carries prefetched words as packed 16-bit pairs, which cost two instructions per word to unpack."""
        if _ASM:
            return tl.inline_asm_elementwise(f"lop3.b32 $0, $1, {X}, $2, 0xBE;", "=r,r,r", [v, mg], dtype=tl.int32,
                                             is_pure=True, pack=1)
        else:
            return (v ^ X) | mg

    @triton.jit
    def _scale(v):
        """float16 scales (16-bit words) as float32, converted where loaded (opaque on a GPU, as `_or`)."""
        if _ASM:
            return tl.inline_asm_elementwise("cvt.f32.f16 $0, $1;", "=f,h", [v.to(tl.float16, bitcast=True)],
                                             dtype=tl.float32, is_pure=True, pack=1)
        else:
            return v.to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _words(w, wo, mg):
        """16-bit words at offsets wo ([A, B]) of the weight rows w ([BN] pointers), or-ed with mg: int32
        [A, BN, B]. The word sits in bits 0-15, mg's bits above (the bits of 2^23, or any constant there): a field
        of the word under MASK as 2^23 + field * 2^p is then one and with MASK | 0xFFFF0000 (`_code`), and no
        compiler can narrow the loop-carried words back to 16 bits."""
        return _or(tl.load(w[None, :, None] + wo[:, None, :]).to(tl.uint16, bitcast=True).to(tl.int32), mg)

    @triton.jit
    def _word(w, o, mg):
        """One 16-bit word per (position, row): offsets o [A] of the rows w [BN], or-ed with mg: int32 [A, BN]."""
        return _or(tl.load(w[None, :] + o[:, None]).to(tl.uint16, bitcast=True).to(tl.int32), mg)

    @triton.jit
    def _rep(w, o, B: tl.constexpr, mg):
        """The 16-bit word at offsets o [A] of the rows w [BN], repeated along B, or-ed with mg: int32 [A, BN, B].
        Loaded as [B, A, BN] and permuted, so it gets the layout of a code tile without a shared-memory shuffle."""
        p = w[None, None, :] + o[None, :, None] + (0 * tl.arange(0, B))[:, None, None]
        return _or(tl.permute(tl.load(p), (1, 2, 0)).to(tl.uint16, bitcast=True).to(tl.int32), mg)

    @triton.jit
    def _half(v):
        """float16 bits (int32, zero-extended) as float32."""
        return v.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _xs(xr, xo):
        """Activations at offsets xo ([A, B]) of the row at pointer xr (always a valid row), raw. Loaded as [B, A]
        and permuted, for the layout of a code tile's positions (see `_rep`)."""
        return tl.permute(tl.load(xr + tl.permute(xo, (1, 0))), (1, 0))

    @triton.jit
    def _code(h, MASK: tl.constexpr, BIAS: tl.constexpr):
        """(field - BIAS / 2^p) * 2^p as float32 for the field under MASK (at bit p, p + width <= 23) of a word
        or-ed with 2^23's bits (`_words`)."""
        return (h & (MASK - 65536)).to(tl.float32, bitcast=True) - BIAS

    # ------------------------------------------------------------------------------------------------ float rows

    @triton.jit
    def _ldf(p, kk, K, KMASK: tl.constexpr):
        if KMASK:
            return tl.load(p, mask=kk < K, other=0.0).to(tl.float32)
        else:
            return tl.load(p).to(tl.float32)

    @triton.jit
    def _rows_f(xr0, xr1, wa, wb, nm, nk, K, TWO: tl.constexpr, MB: tl.constexpr, BN: tl.constexpr,
                KC: tl.constexpr, KMASK: tl.constexpr):
        """Float weights (bf16/fp16/fp32 rows), KC values per step (KMASK: the tail masked); tile [BN, KC]."""
        kk0 = tl.arange(0, KC)
        acca0 = tl.zeros((BN, KC), dtype=tl.float32)
        accb0 = tl.zeros((BN, KC), dtype=tl.float32)
        acca1 = tl.zeros((BN, KC), dtype=tl.float32)
        accb1 = tl.zeros((BN, KC), dtype=tl.float32)
        for k0 in range(0, nk, KC):
            kk = k0 + kk0
            x0 = _ldf(xr0 + kk, kk, K, KMASK)
            wv = _ldf(wa[:, None] + kk[None, :], kk[None, :], K, KMASK)
            acca0 += wv * x0[None, :]
            if MB == 2:
                x1 = _ldf(xr1 + kk, kk, K, KMASK)
                acca1 += wv * x1[None, :]
            if TWO:
                wv = _ldf(wb[:, None] + kk[None, :], kk[None, :], K, KMASK)
                accb0 += wv * x0[None, :]
                if MB == 2:
                    accb1 += wv * x1[None, :]
        return tl.sum(acca0, 1), tl.sum(accb0, 1), tl.sum(acca1, 1), tl.sum(accb1, 1)

    @triton.jit
    def _tile_f(w, kk, nk):
        """Float weight rows w ([BN] pointers), values kk ([KC]) below nk: [BN, KC] as stored (masked to 0)."""
        return tl.load(w[:, None] + kk[None, :], mask=(kk < nk)[None, :], other=0.0)

    @triton.jit
    def _dot_f(wv, xr, kk, nk):
        """[BN] fp32 sums of a weight tile (`_tile_f`) times the activations at xr."""
        x = tl.load(xr + kk, mask=kk < nk, other=0.0).to(tl.float32)
        return tl.sum(wv.to(tl.float32) * x[None, :], 1)

    @triton.jit
    def _norm_row(x_ptr, d_ptr, nw_ptr, xo_ptr, ho_ptr, kk, K, eps, HAS_D: tl.constexpr, store):
        """RMSNorm(x (+ d)) * nw of one row as fp32 [KC] (values past K: 0), rounded as
        runtime/gpu/dense_kernels.py's `_rmsnorm_kernel` rounds it; when HAS_D and `store`, x + d goes to xo and the
        normalized row to ho."""
        m = kk < K
        x = tl.load(x_ptr + kk, mask=m, other=0.0)
        if HAS_D:
            x = (x.to(tl.float32) + tl.load(d_ptr + kk, mask=m, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / K + eps)
        w = tl.load(nw_ptr + kk, mask=m, other=0.0).to(tl.float32)
        h = ((xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * w).to(x_ptr.dtype.element_ty)
        if HAS_D:
            ms = kk < tl.where(store, K, 0)
            tl.store(xo_ptr + kk, x, mask=ms)
            tl.store(ho_ptr + kk, h, mask=ms)
        return h.to(tl.float32)

    # ------------------------------------------------------------------------------------ Q8_0, Q4_0, Q5_0 rows
    # 32-value blocks; tile [NBC, BN, J, L]: block, row, and the block's code words i = j * L + l (16 for q8_0, 8
    # else). Threads run along l and the blocks, so a thread holds J words of each block of its rows: their sum
    # takes the block's scale once.

    @triton.jit
    def _words4(w, wo, mg, X: tl.constexpr = 0):
        """16-bit words at offsets wo ([A, J, L]) of the rows w ([BN]), xor-ed with X and or-ed with mg: int32
        [A, BN, J, L]."""
        v = tl.load(w[None, :, None, None] + wo[:, None, :, :]).to(tl.uint16, bitcast=True).to(tl.int32)
        return _or(v, mg, X)

    @triton.jit
    def _rep_scale(w, o, L: tl.constexpr):
        """The float16 scale at word offsets o [A] of the rows w [BN], repeated along L, as float32 [A, BN, L]
        (loaded as [L, A, BN] and permuted, see `_rep`)."""
        p = w[None, None, :] + o[None, :, None] + (0 * tl.arange(0, L))[:, None, None]
        return _scale(tl.permute(tl.load(p), (1, 2, 0)))

    @triton.jit
    def _xs3(xr, xo):
        """Activations at offsets xo ([A, J, L]) of the row at xr, raw; loaded as [L, A, J] (see `_xs`)."""
        return tl.permute(tl.load(xr + tl.permute(xo, (2, 0, 1))), (1, 2, 0))

    @triton.jit
    def _ld32(w, blk, mg, QT: tl.constexpr, J: tl.constexpr):
        """Words of blocks blk [NBC] of the rows w: codes or-ed with mg [NBC, BN, J, L] (Q8_0's with their sign bits
        flipped, c ^ 128), the scale d as float32 [NBC, BN, L] and q5_0's two qh words (repeated along l)."""
        L: tl.constexpr = (16 if QT == 1 else 8) // J
        i = (tl.arange(0, J) * L)[:, None] + tl.arange(0, L)[None, :]
        if QT == 1:                                  # q8_0: 17 words (d, 16 words of two int8 codes)
            do = blk * 17
            h = _words4(w, do[:, None, None] + 1 + i[None, :, :], mg, 0x8080)
            d = _rep_scale(w, do, L)
            return h, d, h, h
        elif QT == 2:                                # q5_0: 11 words (d, qh as two words, 8 words of nibbles)
            do = blk * 11
            h = _words4(w, do[:, None, None] + 3 + i[None, :, :], mg)
            return h, _rep_scale(w, do, L), _rep(w, do + 1, L, mg), _rep(w, do + 2, L, mg)
        else:                                        # q4_0, iq4_nl: 9 words (d, 8 words of four nibbles)
            do = blk * 9
            h = _words4(w, do[:, None, None] + 1 + i[None, :, :], mg)
            d = _rep_scale(w, do, L)
            return h, d, h, h

    @triton.jit
    def _xn3(xr, xo, nw, rstd, NORM: tl.constexpr):
        """`_xs3` as float32; NORM: the values of RMSNorm(x) * nw instead (rstd: the row's 1 / rms), rounded where
        runtime/gpu/dense_kernels.py's `_rmsnorm_kernel` rounds."""
        x = _xs3(xr, xo)
        if NORM:
            return _normed(x, _xs3(nw, xo), rstd, xr.dtype.element_ty)
        else:
            return x.to(tl.float32)

    @triton.jit
    def _normed(x, w, rstd, dt: tl.constexpr):
        """RMSNorm(x) * w for activations x of the row whose 1 / rms is rstd, rounded to dt where
        runtime/gpu/dense_kernels.py's `_rmsnorm_kernel` rounds, as float32."""
        return ((x.to(tl.float32) * rstd).to(dt).to(tl.float32) * w.to(tl.float32)).to(dt).to(tl.float32)

    @triton.jit
    def _x32(xr, blk, nw, rstd, QT: tl.constexpr, J: tl.constexpr, NORM: tl.constexpr):
        """The activations of each word's codes of blocks blk, as float32 pre-scaled by 2^-p for a code kept at
        bit p of its word: q8_0 (2i, 2i + 1 * 256), else the nibbles (2i, 2i + 16, 2i + 1, 2i + 17) of its two
        bytes (* 1, 16, 256, 4096; q5_0's codes are built unshifted; iq4_nl's levels are bytes: * 1, 256, 1,
        256). NORM: of the normalized row (`_xn3`)."""
        L: tl.constexpr = (16 if QT == 1 else 8) // J
        i = (tl.arange(0, J) * L)[:, None] + tl.arange(0, L)[None, :]
        xo = blk[:, None, None] * 32 + 2 * i[None, :, :]
        if QT == 1:
            x0 = _xn3(xr, xo, nw, rstd, NORM)
            return x0, _xn3(xr, xo + 1, nw, rstd, NORM) * (1.0 / 256), x0, x0
        elif QT == 2:
            return (_xn3(xr, xo, nw, rstd, NORM), _xn3(xr, xo + 16, nw, rstd, NORM), _xn3(xr, xo + 1, nw, rstd, NORM),
                    _xn3(xr, xo + 17, nw, rstd, NORM))
        elif QT == 10:                               # iq4_nl: the levels of 2i + 16, 2i + 17 are high bytes
            return (_xn3(xr, xo, nw, rstd, NORM), _xn3(xr, xo + 16, nw, rstd, NORM) * (1.0 / 256),
                    _xn3(xr, xo + 1, nw, rstd, NORM), _xn3(xr, xo + 17, nw, rstd, NORM) * (1.0 / 256))
        else:
            return (_xn3(xr, xo, nw, rstd, NORM), _xn3(xr, xo + 16, nw, rstd, NORM) * (1.0 / 16),
                    _xn3(xr, xo + 1, nw, rstd, NORM) * (1.0 / 256), _xn3(xr, xo + 17, nw, rstd, NORM) * (1.0 / 4096))

    @triton.jit
    def _dot32(acc, h, d, qa, qb, x0, x1, x2, x3, QT: tl.constexpr, J: tl.constexpr):
        """acc + d * sum(code * x) over each thread's words of a block (d: the block's float16 scale)."""
        if QT == 1:
            s = _q8_dot(h, x0[:, None], x1[:, None])
        elif QT == 2:
            L: tl.constexpr = 8 // J
            qh = (qa & 0xFFFF) | (qb << 16)
            i = (tl.arange(0, J) * L)[:, None] + tl.arange(0, L)[None, :]
            hs = (qh[:, :, None, :] >> (2 * i)[None, None, :, :]) << 4      # qh bit 2i + t at bit 4 + t
            q0 = ((h & -65521) | (hs & 0x10)).to(tl.float32, bitcast=True) - 8388624.0
            q1 = (((h >> 4) & 0x0F) | ((hs >> 16) & 0x10) | (h & -65536)).to(tl.float32, bitcast=True) - 8388624.0
            q2 = (((h >> 8) & 0x0F) | ((hs >> 1) & 0x10) | (h & -65536)).to(tl.float32, bitcast=True) - 8388624.0
            q3 = (((h >> 12) & 0x0F) | ((hs >> 17) & 0x10) | (h & -65536)).to(tl.float32, bitcast=True) - 8388624.0
            s = q0 * x0[:, None] + q1 * x1[:, None] + q2 * x2[:, None] + q3 * x3[:, None]
        elif QT == 10:   # iq4_nl: Q4_0's nibbles, each an index into the 16 int8 levels (h's top half: 2^23's bits)
            s = _levels_dot(h, h & -65536, x0[:, None], x1[:, None], x2[:, None], x3[:, None])
        else:
            s = _q4_dot(h, x0[:, None], x1[:, None], x2[:, None], x3[:, None])
        return acc + d * tl.sum(s, 2)

    @triton.jit
    def _q8_dot(h, x0, x1):
        """sum(code * x) over the two int8 codes of 16-bit words h: an int8 code c is the byte c ^ 128 (flipped
        when loaded) = c + 128 over 2^23's bits; x1 (the high byte's) pre-scaled by 2^-8."""
        return _code(h, 0x00FF, 8388736.0) * x0 + _code(h, 0xFF00, 8421376.0) * x1

    @triton.jit
    def _q4_dot(h, x0, x1, x2, x3):
        """sum(code * x) over the four Q4_0 nibbles of 16-bit words h or-ed with 2^23's bits: byte 2i's low nibble
        (value 2i) and high (2i + 16, x1 pre-scaled by 2^-4), byte 2i + 1's low (2i + 1, x2 by 2^-8) and high
        (2i + 17, x3 by 2^-12)."""
        return (_code(h, 0x000F, 8388616.0) * x0 + _code(h, 0x00F0, 8388736.0) * x1
                + _code(h, 0x0F00, 8390656.0) * x2 + _code(h, 0xF000, 8421376.0) * x3)

    @triton.jit
    def _rows32(xr0, xr1, wa, wb, nm, nblk, mg, nw, rstd, QT: tl.constexpr, TWO: tl.constexpr, MB: tl.constexpr,
                BN: tl.constexpr, NBC: tl.constexpr, PF: tl.constexpr, J: tl.constexpr, NORM: tl.constexpr):
        """Q8_0 / Q5_0 / Q4_0 / IQ4_NL rows. PF: the next step's words are loaded before this step's arithmetic. NORM (one
        row, MB 1): the activations are RMSNorm(row) * nw, made as they are loaded."""
        b = tl.arange(0, NBC)
        L: tl.constexpr = (16 if QT == 1 else 8) // J
        acca0 = tl.zeros((NBC, BN, L), dtype=tl.float32)
        accb0 = tl.zeros((NBC, BN, L), dtype=tl.float32)
        acca1 = tl.zeros((NBC, BN, L), dtype=tl.float32)
        accb1 = tl.zeros((NBC, BN, L), dtype=tl.float32)
        if PF:
            ha, da, qaa, qba = _ld32(wa, b, mg, QT, J)
            if TWO:
                hb, db, qab, qbb = _ld32(wb, b, mg, QT, J)
        for b0 in range(0, nblk, NBC):
            blk = b0 + b
            if PF:                                   # the next step's words (the first again after the last)
                nxt = tl.where(b0 + NBC < nblk, b0 + NBC, 0) + b
                ha_, da_, qaa_, qba_ = _ld32(wa, nxt, mg, QT, J)
                if TWO:
                    hb_, db_, qab_, qbb_ = _ld32(wb, nxt, mg, QT, J)
            else:
                ha, da, qaa, qba = _ld32(wa, blk, mg, QT, J)
                if TWO:
                    hb, db, qab, qbb = _ld32(wb, blk, mg, QT, J)
            f0, f1, f2, f3 = _x32(xr0, blk, nw, rstd, QT, J, NORM)
            acca0 = _dot32(acca0, ha, da, qaa, qba, f0, f1, f2, f3, QT, J)
            if TWO:
                accb0 = _dot32(accb0, hb, db, qab, qbb, f0, f1, f2, f3, QT, J)
            if MB == 2:
                g0, g1, g2, g3 = _x32(xr1, blk, nw, rstd, QT, J, False)
                acca1 = _dot32(acca1, ha, da, qaa, qba, g0, g1, g2, g3, QT, J)
                if TWO:
                    accb1 = _dot32(accb1, hb, db, qab, qbb, g0, g1, g2, g3, QT, J)
            if PF:
                ha, da, qaa, qba = ha_, da_, qaa_, qba_
                if TWO:
                    hb, db, qab, qbb = hb_, db_, qab_, qbb_
        return (tl.sum(tl.sum(acca0, 2), 0), tl.sum(tl.sum(accb0, 2), 0), tl.sum(tl.sum(acca1, 2), 0),
                tl.sum(tl.sum(accb1, 2), 0))

    @triton.jit
    def _tile32(w, b, bc, nk, mg, QT: tl.constexpr, J: tl.constexpr):
        """A one-step tile of 32-value block rows: blocks bc (b clamped to the row's), the scale of each block
        b >= nk zero, so the tail adds nothing."""
        h, d, qa, qb = _ld32(w, bc, mg, QT, J)
        return h, tl.where((b < nk)[:, None, None], d, 0.0), qa, qb

    @triton.jit
    def _dot_one32(h, d, qa, qb, xr, bc, nk, QT: tl.constexpr, J: tl.constexpr):
        """[BN] fp32 sums of a one-step block tile (`_tile32`) times the activations at xr: `_rows32`'s arithmetic
        for a single step. nk == 0 (a missed expert's rows, whose activations may be anything): zeros."""
        f0, f1, f2, f3 = _x32(xr, bc, xr, 1.0, QT, J, False)
        acc = _dot32(tl.zeros(d.shape, dtype=tl.float32), h, d, qa, qb, f0, f1, f2, f3, QT, J)
        return tl.where(nk > 0, tl.sum(tl.sum(acc, 2), 0), 0.0)

    # --------------------------------------------------------------------------- 32-value block rows one by one
    # R1 variants: every tensor of a pass is one-dimensional over the pass's groups (a group: JR code words of one
    # block, which one thread takes), and the BN rows are separate tensors of that one layout, so no Triton has a
    # thread layout to choose between rows and blocks (module docstring: Triton 3.6 and 3.9 break that choice
    # differently for the [blocks, rows, words] tiles above). Each group's product takes its block's scale, summed
    # over the passes group by group and over the groups at the end.

    @triton.jit
    def _xn1(xr, xo, nw, rstd, NORM: tl.constexpr):
        """Activations at offsets xo of the row at xr as float32 (NORM: of RMSNorm(row) * nw, rounded as `_xn3`)."""
        x = tl.load(xr + xo)
        if NORM:
            return _normed(x, tl.load(nw + xo), rstd, xr.dtype.element_ty)
        else:
            return x.to(tl.float32)

    @triton.jit
    def _xq(xr, xo, nw, rstd, QT: tl.constexpr, NORM: tl.constexpr):
        """The activations of code words whose first value is at xo, pre-scaled as `_x32` does."""
        x0 = _xn1(xr, xo, nw, rstd, NORM)
        if QT == 1:
            return x0, _xn1(xr, xo + 1, nw, rstd, NORM) * (1.0 / 256), x0, x0
        elif QT == 10:                               # iq4_nl: the levels of values 2i + 16, 2i + 17 are high bytes
            return (x0, _xn1(xr, xo + 16, nw, rstd, NORM) * (1.0 / 256), _xn1(xr, xo + 1, nw, rstd, NORM),
                    _xn1(xr, xo + 17, nw, rstd, NORM) * (1.0 / 256))
        else:
            return (x0, _xn1(xr, xo + 16, nw, rstd, NORM) * (1.0 / 16), _xn1(xr, xo + 1, nw, rstd, NORM) * (1.0 / 256),
                    _xn1(xr, xo + 17, nw, rstd, NORM) * (1.0 / 4096))

    @triton.jit
    def _word1(w, wo, mg, x0, x1, x2, x3, QT: tl.constexpr):
        """sum(code * x) of the code words at offsets wo of one Q8_0 / Q4_0 / IQ4_NL row."""
        v = tl.load(w + wo).to(tl.uint16, bitcast=True).to(tl.int32)
        if QT == 1:
            return _q8_dot(_or(v, mg, 0x8080), x0, x1)
        h = _or(v, mg)
        if QT == 10:                                 # Q4_0's nibbles, each an index into the 16 levels
            return _levels_dot(h, h & -65536, x0, x1, x2, x3)
        else:
            return _q4_dot(h, x0, x1, x2, x3)

    @triton.jit
    def _row1(w, wq, do, mg, x0, x1, x2, x3, y0, y1, y2, y3, QT: tl.constexpr, JR: tl.constexpr,
              TPB: tl.constexpr):
        """d * sum(code * x) over each thread's JR code words (at wq, and wq + TPB with y) of one block: [groups]."""
        s = _word1(w, wq, mg, x0, x1, x2, x3, QT)
        if JR == 2:
            s += _word1(w, wq + TPB, mg, y0, y1, y2, y3, QT)
        return _scale(tl.load(w + do)) * s

    @triton.jit
    def _pick(v, idx, r: tl.constexpr, acc):
        return tl.where(idx == r, tl.sum(acc, 0), v)

    @triton.jit
    def _sums8(a0, a1, a2, a3, a4, a5, a6, a7, BN: tl.constexpr):
        """[BN] of the accumulators' sums, row r from a_r."""
        idx = tl.arange(0, BN)
        v = _pick(tl.zeros((BN,), dtype=tl.float32), idx, 0, a0)
        if BN > 1:
            v = _pick(v, idx, 1, a1)
        if BN > 2:
            v = _pick(_pick(v, idx, 2, a2), idx, 3, a3)
        if BN > 4:
            v = _pick(_pick(_pick(_pick(v, idx, 4, a4), idx, 5, a5), idx, 6, a6), idx, 7, a7)
        return v

    @triton.jit
    def _row_offsets(rlim, SWN: tl.constexpr, EVEN: tl.constexpr):
        """Word offsets of rows 1..7 from row 0: r * SWN, clamped to row rlim (a program's rows past N read its last
        row, never stored) unless EVEN (every row exists: constants, folded into the loads' addresses)."""
        if EVEN:
            return SWN, 2 * SWN, 3 * SWN, 4 * SWN, 5 * SWN, 6 * SWN, 7 * SWN
        else:
            return (tl.minimum(1, rlim) * SWN, tl.minimum(2, rlim) * SWN, tl.minimum(3, rlim) * SWN,
                    tl.minimum(4, rlim) * SWN, tl.minimum(5, rlim) * SWN, tl.minimum(6, rlim) * SWN,
                    tl.minimum(7, rlim) * SWN)

    @triton.jit
    def _rows32r(xr, wa, wb, rlim, SWN: tl.constexpr, nblk, mg, nw, rstd, QT: tl.constexpr, TWO: tl.constexpr,
                 BN: tl.constexpr, NBC: tl.constexpr, NORM: tl.constexpr, JR: tl.constexpr):
        """[BN] sums of rows wa + min(r, rlim) * SWN (r < BN <= 8) of Q8_0 / Q4_0 / IQ4_NL words times the row at xr,
        and (TWO) of the rows at wb the same way; the activations of a pass are loaded once for both. A group (one
        thread's share of a pass) is JR code words of one block, words q and q + W / JR, which share its scale."""
        W: tl.constexpr = 16 if QT == 1 else 8           # code words a block
        BW: tl.constexpr = 17 if QT == 1 else 9          # words a block
        TPB: tl.constexpr = W // JR                      # groups a block
        g = tl.arange(0, NBC * TPB)
        z = tl.zeros((NBC * TPB,), dtype=tl.float32)
        a0, a1, a2, a3, a4, a5, a6, a7 = z, z, z, z, z, z, z, z
        u0, u1, u2, u3, u4, u5, u6, u7 = z, z, z, z, z, z, z, z
        o1, o2, o3, o4, o5, o6, o7 = _row_offsets(rlim, SWN, False)
        for b0 in range(0, nblk, NBC):
            blk = b0 + g // TPB
            q = g % TPB
            do = blk * BW
            wq = do + 1 + q
            xo = blk * 32 + 2 * q
            x0, x1, x2, x3 = _xq(xr, xo, nw, rstd, QT, NORM)
            y0, y1, y2, y3 = x0, x1, x2, x3
            if JR == 2:
                y0, y1, y2, y3 = _xq(xr, xo + 2 * TPB, nw, rstd, QT, NORM)
            a0 += _row1(wa, wq, do, mg, x0, x1, x2, x3, y0, y1, y2, y3, QT, JR, TPB)
            if TWO:
                u0 += _row1(wb, wq, do, mg, x0, x1, x2, x3, y0, y1, y2, y3, QT, JR, TPB)
            if BN > 1:
                a1 += _row1(wa + o1, wq, do, mg, x0, x1, x2, x3, y0, y1, y2, y3, QT, JR, TPB)
                if TWO:
                    u1 += _row1(wb + o1, wq, do, mg, x0, x1, x2, x3, y0, y1, y2, y3, QT, JR, TPB)
            if BN > 2:
                a2 += _row1(wa + o2, wq, do, mg, x0, x1, x2, x3, y0, y1, y2, y3, QT, JR, TPB)
                a3 += _row1(wa + o3, wq, do, mg, x0, x1, x2, x3, y0, y1, y2, y3, QT, JR, TPB)
                if TWO:
                    u2 += _row1(wb + o2, wq, do, mg, x0, x1, x2, x3, y0, y1, y2, y3, QT, JR, TPB)
                    u3 += _row1(wb + o3, wq, do, mg, x0, x1, x2, x3, y0, y1, y2, y3, QT, JR, TPB)
            if BN > 4:
                a4 += _row1(wa + o4, wq, do, mg, x0, x1, x2, x3, y0, y1, y2, y3, QT, JR, TPB)
                a5 += _row1(wa + o5, wq, do, mg, x0, x1, x2, x3, y0, y1, y2, y3, QT, JR, TPB)
                a6 += _row1(wa + o6, wq, do, mg, x0, x1, x2, x3, y0, y1, y2, y3, QT, JR, TPB)
                a7 += _row1(wa + o7, wq, do, mg, x0, x1, x2, x3, y0, y1, y2, y3, QT, JR, TPB)
                if TWO:
                    u4 += _row1(wb + o4, wq, do, mg, x0, x1, x2, x3, y0, y1, y2, y3, QT, JR, TPB)
                    u5 += _row1(wb + o5, wq, do, mg, x0, x1, x2, x3, y0, y1, y2, y3, QT, JR, TPB)
                    u6 += _row1(wb + o6, wq, do, mg, x0, x1, x2, x3, y0, y1, y2, y3, QT, JR, TPB)
                    u7 += _row1(wb + o7, wq, do, mg, x0, x1, x2, x3, y0, y1, y2, y3, QT, JR, TPB)
        return _sums8(a0, a1, a2, a3, a4, a5, a6, a7, BN), _sums8(u0, u1, u2, u3, u4, u5, u6, u7, BN)

    # Q4_K rows one by one (R1, `_rowskr`). A super-block's nibbles are four 32-byte groups j; a code word of group j
    # (bytes 2i, 2i + 1) holds values 2i, 2i + 1 of sub-block 2j in its low nibbles and of 2j + 1 in its high ones.
    # A thread takes R1 / 2 words of group q and as many of group q + 2 (q = 0, 1): sub-blocks 2q, 2q + 1, 2q + 4,
    # 2q + 5, whose six-bit scales and minimums come from scale words 2 + q, 4 + q, 6 + q with no select (ggml's
    # get_scale_min_k4: the low form for sub-blocks 0-3, the high form for 4-7). Per row it sums code * x for each
    # sub-block, then applies d * scale to each sum and subtracts dmin * min times the sum of the sub-block's
    # activations (the same for every row, summed once a pass).

    @triton.jit
    def _kacc(w, wo, mg, x0, x1, x2, x3, ev, od):
        """(ev, od) plus the sub-block 2j / 2j + 1 sums of code * x of the Q4_K code word at wo, x pre-scaled
        (`_xkr`)."""
        h = _or(tl.load(w + wo).to(tl.uint16, bitcast=True).to(tl.int32), mg)
        ev = ev + _code(h, 0x000F, 8388608.0) * x0
        od = od + _code(h, 0x00F0, 8388608.0) * x1
        ev = ev + _code(h, 0x0F00, 8388608.0) * x2
        od = od + _code(h, 0xF000, 8388608.0) * x3
        return ev, od

    @triton.jit
    def _xkr(xr, xo):
        """Activations of a code word whose first value is at xo (sub-block 2j's values xo, xo + 1; 2j + 1's
        xo + 32, xo + 33), pre-scaled to the nibbles' places, and the raw pair sums of each sub-block."""
        a = tl.load(xr + xo).to(tl.float32)
        b = tl.load(xr + xo + 32).to(tl.float32)
        c = tl.load(xr + xo + 1).to(tl.float32)
        e = tl.load(xr + xo + 33).to(tl.float32)
        return a, b * (1.0 / 16), c * (1.0 / 256), e * (1.0 / 4096), a + c, b + e

    @triton.jit
    def _six(v):
        """Six-bit (or smaller) non-negative ints as float32: or-ed into 2^23's bits, less 2^23 (exact)."""
        return (v | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def _krow(w, base, q, lo, hi, mg, xl, xh, sx, W2: tl.constexpr, STEP: tl.constexpr):
        """One Q4_K row's part of each thread: its W2 words of group q at lo, lo + STEP, ... (activations xl: a
        tuple of each word's four) and of group q + 2 at hi (xh), each sub-block's sum times d * scale, less
        dmin * min * (its activations' sum, sx: sub-blocks 2q, 2q + 1, 2q + 4, 2q + 5)."""
        z = tl.zeros(sx[0].shape, dtype=tl.float32)
        ev, od, eh, oh = z, z, z, z
        for k in tl.static_range(W2):
            ev, od = _kacc(w, lo + k * STEP, mg, xl[4 * k], xl[4 * k + 1], xl[4 * k + 2], xl[4 * k + 3], ev, od)
            eh, oh = _kacc(w, hi + k * STEP, mg, xh[4 * k], xh[4 * k + 1], xh[4 * k + 2], xh[4 * k + 3], eh, oh)
        s0 = tl.load(w + base + 2 + q).to(tl.uint16, bitcast=True).to(tl.int32)
        s1 = tl.load(w + base + 4 + q).to(tl.uint16, bitcast=True).to(tl.int32)
        s2 = tl.load(w + base + 6 + q).to(tl.uint16, bitcast=True).to(tl.int32)
        d = _scale(tl.load(w + base))
        dmin = _scale(tl.load(w + base + 1))
        sc = (_six(s0 & 63) * ev + _six((s0 >> 8) & 63) * od
              + _six((s2 & 15) | ((s0 >> 2) & 0x30)) * eh + _six(((s2 >> 8) & 15) | ((s0 >> 10) & 0x30)) * oh)
        mn = (_six(s1 & 63) * sx[0] + _six((s1 >> 8) & 63) * sx[1]
              + _six(((s2 >> 4) & 15) | ((s1 >> 2) & 0x30)) * sx[2]
              + _six(((s2 >> 12) & 15) | ((s1 >> 10) & 0x30)) * sx[3])
        return d * sc - dmin * mn

    @triton.jit
    def _xk4(xr, xo, STEP: tl.constexpr, W2: tl.constexpr):
        """The pre-scaled activations of a thread's W2 words of one group (a flat tuple, four a word) and the
        group's two sub-blocks' activation sums over them."""
        a0, a1, a2, a3, se, so = _xkr(xr, xo)
        xs = (a0, a1, a2, a3)
        for k in tl.static_range(1, W2):
            b0, b1, b2, b3, be, bo = _xkr(xr, xo + 2 * k * STEP)
            xs = xs + (b0, b1, b2, b3)
            se += be
            so += bo
        return xs, se, so

    @triton.jit
    def _rowskr(xr, wa, wb, rlim, SWN: tl.constexpr, nblk, mg, TWO: tl.constexpr, BN: tl.constexpr,
                NBC: tl.constexpr, JR: tl.constexpr, EVEN: tl.constexpr):
        """[BN] sums of Q4_K rows wa + min(r, rlim) * SWN (r < BN <= 8) times the row at xr, and (TWO) of the rows
        at wb; NBC super-blocks a pass, JR (2, 4 or 8) words a thread (`_krow`). EVEN (every row of the program
        exists): the rows are constant offsets, folded into each load's address."""
        W2: tl.constexpr = JR // 2                       # words of each of the thread's two groups
        HALF: tl.constexpr = 16 // W2                    # threads a group pair q takes
        STEP: tl.constexpr = HALF                        # words between a thread's words of one group
        g = tl.arange(0, NBC * 2 * HALF)
        z = tl.zeros((NBC * 2 * HALF,), dtype=tl.float32)
        a0, a1, a2, a3, a4, a5, a6, a7 = z, z, z, z, z, z, z, z
        u0, u1, u2, u3, u4, u5, u6, u7 = z, z, z, z, z, z, z, z
        o1, o2, o3, o4, o5, o6, o7 = _row_offsets(rlim, SWN, EVEN)
        t = g % (2 * HALF)
        q = t // HALF                                    # group pair: groups q and q + 2
        i = t % HALF                                     # first word in each group
        for b0 in range(0, nblk, NBC):
            sb = b0 + g // (2 * HALF)
            base = sb * 72
            lo = base + 8 + 16 * q + i
            hi = lo + 32
            xo = sb * 256 + 64 * q + 2 * i
            xl, se0, so0 = _xk4(xr, xo, STEP, W2)
            xh, se2, so2 = _xk4(xr, xo + 128, STEP, W2)
            sx = (se0, so0, se2, so2)
            a0 += _krow(wa, base, q, lo, hi, mg, xl, xh, sx, W2, STEP)
            if TWO:
                u0 += _krow(wb, base, q, lo, hi, mg, xl, xh, sx, W2, STEP)
            if BN > 1:
                a1 += _krow(wa + o1, base, q, lo, hi, mg, xl, xh, sx, W2, STEP)
                if TWO:
                    u1 += _krow(wb + o1, base, q, lo, hi, mg, xl, xh, sx, W2, STEP)
            if BN > 2:
                a2 += _krow(wa + o2, base, q, lo, hi, mg, xl, xh, sx, W2, STEP)
                a3 += _krow(wa + o3, base, q, lo, hi, mg, xl, xh, sx, W2, STEP)
                if TWO:
                    u2 += _krow(wb + o2, base, q, lo, hi, mg, xl, xh, sx, W2, STEP)
                    u3 += _krow(wb + o3, base, q, lo, hi, mg, xl, xh, sx, W2, STEP)
            if BN > 4:
                a4 += _krow(wa + o4, base, q, lo, hi, mg, xl, xh, sx, W2, STEP)
                a5 += _krow(wa + o5, base, q, lo, hi, mg, xl, xh, sx, W2, STEP)
                a6 += _krow(wa + o6, base, q, lo, hi, mg, xl, xh, sx, W2, STEP)
                a7 += _krow(wa + o7, base, q, lo, hi, mg, xl, xh, sx, W2, STEP)
                if TWO:
                    u4 += _krow(wb + o4, base, q, lo, hi, mg, xl, xh, sx, W2, STEP)
                    u5 += _krow(wb + o5, base, q, lo, hi, mg, xl, xh, sx, W2, STEP)
                    u6 += _krow(wb + o6, base, q, lo, hi, mg, xl, xh, sx, W2, STEP)
                    u7 += _krow(wb + o7, base, q, lo, hi, mg, xl, xh, sx, W2, STEP)
        return _sums8(a0, a1, a2, a3, a4, a5, a6, a7, BN), _sums8(u0, u1, u2, u3, u4, u5, u6, u7, BN)

    # ------------------------------------------------------------------------------------------- K-quant rows
    # Q4_K, tile [NBC * 4, BN, 16]: super-block, 32-byte group g of the nibbles (sub-blocks 2g, 2g + 1), word i.
    # Q5_K: Q4_K's tile; word i of qh (bytes 2i, 2i + 1) holds the fifth bits of a group's codes at bits 2g, 2g + 1
    # (byte 2i) and 8 + 2g, 9 + 2g (byte 2i + 1).
    # Q6_K, tile [NBC * 8, BN, 8]: super-block, group r = 4h + 2q + half of the low nibbles (module docstring of
    # moe_kernels), word i.

    @triton.jit
    def _ldk(w, sb, r, mg, QT: tl.constexpr):
        """Raw words of one step of K-quant rows: codes (two tensors for q6_k and q5_k), and the per-group scale
        words."""
        if QT == 5 or QT == 6:                       # q4_k: 72 words (d, dmin, 6 of scales, 64 of nibbles)
            i = tl.arange(0, 16)                     # q5_k: 88 (d, dmin, 6 of scales, 16 of qh, 64 of nibbles)
            base = sb * (72 if QT == 5 else 88)
            h = _words(w, (base + (8 if QT == 5 else 24) + 16 * r)[:, None] + i[None, :], mg)
            hb = h
            if QT == 6:
                hb = _words(w, (base + 8 + 0 * r)[:, None] + i[None, :], mg)
            # scale words of sub-blocks 2r, 2r + 1: W[r], W[r + 2], W[r - 2] (r >= 2), scales starting at word 2
            sa = _word(w, base + 2 + r, mg)
            sbw = _word(w, base + 4 + r, mg)
            sc = _word(w, base + tl.where(r >= 2, r, r + 2), mg)
            return h, hb, _word(w, base, mg), _word(w, base + 1, mg), sa, sbw, sc
        else:                                        # q6_k: 105 words (64 low nibbles, 32 high bits, 8 scales, d)
            i = tl.arange(0, 8)
            base = sb * 105
            ql = _words(w, (base + 8 * r)[:, None] + i[None, :], mg)
            qh = _words(w, (base + 64 + 16 * (r // 4) + 8 * (r % 2))[:, None] + i[None, :], mg)
            si = r + 4 * (r // 4)                    # int8 scale of the low-nibble codes; + 4: the high ones
            s0 = _word(w, base + 96 + si // 2, mg)
            s1 = _word(w, base + 98 + si // 2, mg)
            d = _word(w, base + 104, mg)
            return ql, qh, d, d, s0, s1, s0

    @triton.jit
    def _xk(xr, sb, r, QT: tl.constexpr):
        """Raw activations of each word's four codes (byte 2i / 2i + 1, low / high nibble)."""
        if QT == 5 or QT == 6:
            xo = (sb * 256 + 64 * r)[:, None] + 2 * tl.arange(0, 16)[None, :]
            return _xs(xr, xo), _xs(xr, xo + 32), _xs(xr, xo + 1), _xs(xr, xo + 33)
        else:
            xo = (sb * 256 + 128 * (r // 4) + 32 * ((r // 2) % 2) + 16 * (r % 2))[:, None] + \
                2 * tl.arange(0, 8)[None, :]
            return _xs(xr, xo), _xs(xr, xo + 64), _xs(xr, xo + 1), _xs(xr, xo + 65)

    @triton.jit
    def _dotk(acc, ha, hb, wd, wm, s0, s1, s2, r, x0, x1, x2, x3, QT: tl.constexpr):
        f0 = x0.to(tl.float32)
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        f3 = x3.to(tl.float32)
        if QT == 5 or QT == 6:
            d = _half(wd)
            dmin = _half(wm)
            hi = (r >= 2)[:, None]
            # ggml's get_scale_min_k4 for sub-blocks 2r (low bytes) and 2r + 1 (high bytes)
            sce = tl.where(hi, (s1 & 15) | ((s2 >> 6) & 3) << 4, s0 & 63)
            sco = tl.where(hi, ((s1 >> 8) & 15) | ((s2 >> 14) & 3) << 4, (s0 >> 8) & 63)
            mne = tl.where(hi, ((s1 >> 4) & 15) | ((s0 >> 6) & 3) << 4, s1 & 63)
            mno = tl.where(hi, ((s1 >> 12) & 15) | ((s0 >> 14) & 3) << 4, (s1 >> 8) & 63)
            if QT == 5:
                q0 = _code(ha, 0x000F, 8388608.0)
                q1 = _code(ha, 0x00F0, 8388608.0)
                q2 = _code(ha, 0x0F00, 8388608.0)
                q3 = _code(ha, 0xF000, 8388608.0)
            else:        # q5_k: each code's fifth bit (qh word hb, group r's bits) right above its nibble
                t = hb >> (2 * r)[:, None, None]
                q0 = ((ha & (0x000F - 65536)) | ((t & 1) << 4)).to(tl.float32, bitcast=True) - 8388608.0
                q1 = ((ha & (0x00F0 - 65536)) | ((t & 2) << 7)).to(tl.float32, bitcast=True) - 8388608.0
                q2 = ((ha & (0x0F00 - 65536)) | ((t & 0x100) << 4)).to(tl.float32, bitcast=True) - 8388608.0
                q3 = ((ha & (0xF000 - 65536)) | ((t & 0x200) << 7)).to(tl.float32, bitcast=True) - 8388608.0
            se = q0 * f0[:, None, :] + q2 * (f2 * (1.0 / 256))[:, None, :]
            so = q1 * (f1 * (1.0 / 16))[:, None, :] + q3 * (f3 * (1.0 / 4096))[:, None, :]
            acc += (d * sce.to(tl.float32))[:, :, None] * se + (d * sco.to(tl.float32))[:, :, None] * so
            return acc - ((dmin * mne.to(tl.float32))[:, :, None] * (f0 + f2)[:, None, :] +
                          (dmin * mno.to(tl.float32))[:, :, None] * (f1 + f3)[:, None, :])
        else:
            d = _half(wd)
            si = r + 4 * (r // 4)
            sh = ((si % 2) * 8)[:, None]
            sc0 = (((s0 >> sh) & 255) ^ 128) - 128      # int8
            sc1 = (((s1 >> sh) & 255) ^ 128) - 128
            qm = (r // 2) % 2
            q4 = hb << (4 - 2 * qm)[:, None, None]      # the code's 2 high bits right above its nibble
            c0 = ((ha & (0x000F - 65536)) | (q4 & 0x00030)).to(tl.float32, bitcast=True) - 8388640.0
            c1 = ((ha & (0x00F0 - 65536)) | (q4 & 0x00300)).to(tl.float32, bitcast=True) - 8389120.0
            c2 = ((ha & (0x0F00 - 65536)) | (q4 & 0x03000)).to(tl.float32, bitcast=True) - 8396800.0
            c3 = ((ha & (0xF000 - 65536)) | (q4 & 0x30000)).to(tl.float32, bitcast=True) - 8519680.0
            sl = c0 * f0[:, None, :] + c2 * (f2 * (1.0 / 256))[:, None, :]
            sh_ = c1 * (f1 * (1.0 / 16))[:, None, :] + c3 * (f3 * (1.0 / 4096))[:, None, :]
            return acc + (d * sc0.to(tl.float32))[:, :, None] * sl + (d * sc1.to(tl.float32))[:, :, None] * sh_

    @triton.jit
    def _rowsk(xr0, xr1, wa, wb, nm, nblk, mg, QT: tl.constexpr, TWO: tl.constexpr, MB: tl.constexpr,
               BN: tl.constexpr, NBC: tl.constexpr, PF: tl.constexpr):
        """Q4_K / Q5_K / Q6_K rows, NBC super-blocks per step."""
        G: tl.constexpr = 8 if QT == 4 else 4
        WB: tl.constexpr = 8 if QT == 4 else 16
        bq = tl.arange(0, NBC * G)
        r = bq % G
        acca0 = tl.zeros((NBC * G, BN, WB), dtype=tl.float32)
        accb0 = tl.zeros((NBC * G, BN, WB), dtype=tl.float32)
        acca1 = tl.zeros((NBC * G, BN, WB), dtype=tl.float32)
        accb1 = tl.zeros((NBC * G, BN, WB), dtype=tl.float32)
        if PF:
            sb = bq // G
            ha, hb, wd, wm, s0, s1, s2 = _ldk(wa, sb, r, mg, QT)
            if TWO:
                ga, gb, vd, vm, t0, t1, t2 = _ldk(wb, sb, r, mg, QT)
        for b0 in range(0, nblk, NBC):
            sb = b0 + bq // G
            if PF:
                sbn = tl.where(b0 + NBC < nblk, b0 + NBC, 0) + bq // G
                ha_, hb_, wd_, wm_, s0_, s1_, s2_ = _ldk(wa, sbn, r, mg, QT)
                if TWO:
                    ga_, gb_, vd_, vm_, t0_, t1_, t2_ = _ldk(wb, sbn, r, mg, QT)
            else:
                ha, hb, wd, wm, s0, s1, s2 = _ldk(wa, sb, r, mg, QT)
                if TWO:
                    ga, gb, vd, vm, t0, t1, t2 = _ldk(wb, sb, r, mg, QT)
            x0, x1, x2, x3 = _xk(xr0, sb, r, QT)
            if MB == 2:
                y0, y1, y2, y3 = _xk(xr1, sb, r, QT)
            acca0 = _dotk(acca0, ha, hb, wd, wm, s0, s1, s2, r, x0, x1, x2, x3, QT)
            if TWO:
                accb0 = _dotk(accb0, ga, gb, vd, vm, t0, t1, t2, r, x0, x1, x2, x3, QT)
            if MB == 2:
                acca1 = _dotk(acca1, ha, hb, wd, wm, s0, s1, s2, r, y0, y1, y2, y3, QT)
                if TWO:
                    accb1 = _dotk(accb1, ga, gb, vd, vm, t0, t1, t2, r, y0, y1, y2, y3, QT)
            if PF:
                ha, hb, wd, wm, s0, s1, s2 = ha_, hb_, wd_, wm_, s0_, s1_, s2_
                if TWO:
                    ga, gb, vd, vm, t0, t1, t2 = ga_, gb_, vd_, vm_, t0_, t1_, t2_
        return (tl.sum(tl.sum(acca0, 2), 0), tl.sum(tl.sum(accb0, 2), 0), tl.sum(tl.sum(acca1, 2), 0),
                tl.sum(tl.sum(accb1, 2), 0))

    # Q2_K / Q3_K, tile [NBC * 4, BN, 8]: super-block, group r = 2n + hh (half n of the 256 values; hh: bytes
    # 16hh .. 16hh + 15 of the half's 32 bytes of 2-bit codes), word i. Word 8hh + i of half n holds at bits 2j
    # (its byte 2i) and 8 + 2j (byte 2i + 1) the codes of values 128n + 32j + 16hh + 2i and + 1, all four pairs of
    # sub-block 8n + 2j + hh (ggml's dequantize_row_q2_K / q3_K). Q3_K: the third bit of the byte-2i code is bit
    # 4n + j of hmask word 8hh + i (byte 2i + 1: bit 8 + 4n + j), set for codes 0..3 and clear for -4..-1.

    @triton.jit
    def _ld23(w, sb, r, mg, QT: tl.constexpr):
        """Raw words of one step of Q2_K / Q3_K rows: codes (or-ed with mg), Q3_K's hmask words, d, dmin (Q2_K),
        and the scale words two to an int32 (low word first)."""
        i = tl.arange(0, 8)
        n = r // 2
        hh = r % 2
        if QT == 8:                                  # q2_k: 42 words (8 of scales, 32 of codes, d, dmin)
            base = sb * 42
            h = _words(w, (base + 8 + 16 * n + 8 * hh)[:, None] + i[None, :], mg)
            so = base + 4 * n                        # sub-block 8n + 2j + hh's scale: byte hh of word 4n + j
            s01 = _word(w, so, 0) | (_word(w, so + 1, 0) << 16)
            s23 = _word(w, so + 2, 0) | (_word(w, so + 3, 0) << 16)
            return h, h, _word(w, base + 40, 0), _word(w, base + 41, 0), s01, s23, s23
        else:                                        # q3_k: 55 words (16 of hmask, 32 of codes, 6 of scales, d)
            base = sb * 55
            h = _words(w, (base + 16 + 16 * n + 8 * hh)[:, None] + i[None, :], mg)
            hm = _words(w, (base + 8 * hh)[:, None] + i[None, :], 0)
            s01 = _word(w, base + 48, 0) | (_word(w, base + 49, 0) << 16)
            s23 = _word(w, base + 50, 0) | (_word(w, base + 51, 0) << 16)
            s45 = _word(w, base + 52, 0) | (_word(w, base + 53, 0) << 16)
            d = _word(w, base + 54, 0)
            return h, hm, d, d, s01, s23, s45

    @triton.jit
    def _dot23j(acc, h, hm, d, wm, s01, s23, s45, n, hh, xr, xo, QT: tl.constexpr, j: tl.constexpr):
        """`_dot23` for shift j: the two codes of each word at bits 2j and 8 + 2j."""
        PL: tl.constexpr = 1 << (2 * j)
        PH: tl.constexpr = 1 << (8 + 2 * j)
        fl = _xs(xr, xo + 32 * j).to(tl.float32)
        fh = _xs(xr, xo + 32 * j + 1).to(tl.float32)
        if j < 2:
            sw = s01 >> (16 * j)
        else:
            sw = s23 >> (16 * (j - 2))
        sv = (sw >> (8 * hh)) & 0xFF                 # the sub-block's scale byte
        if QT == 8:
            cl = _code(h, 3 * PL, 8388608.0)
            ch = _code(h, 3 * PH, 8388608.0)
            sm = cl * (fl * (1.0 / PL))[:, None, :] + ch * (fh * (1.0 / PH))[:, None, :]
            return acc + (d * (sv & 15).to(tl.float32))[:, :, None] * sm - \
                (_half(wm) * (sv >> 4).to(tl.float32))[:, :, None] * (fl + fh)[:, None, :]
        else:
            # the 6-bit scale: low nibble n of byte 2j + hh, bits 4n + 2 (j // 2) of byte 8 + 2 (j % 2) + hh
            hv = ((s45 >> (16 * (j % 2))) >> (8 * hh)) & 0xFF
            sc = ((sv >> (4 * n)) & 15) | (((hv >> (4 * n + 2 * (j // 2))) & 3) << 4)
            t = hm >> (4 * n + j)[:, :, None]        # the third bits: byte 2i's at bit 0, byte 2i + 1's at bit 8
            ul = (h & (3 * PL - 65536)) | ((t & 1) * (4 * PL))
            uh = (h & (3 * PH - 65536)) | (((t >> 8) & 1) * (4 * PH))
            cl = ul.to(tl.float32, bitcast=True) - (8388608.0 + 4.0 * PL)
            ch = uh.to(tl.float32, bitcast=True) - (8388608.0 + 4.0 * PH)
            sm = cl * (fl * (1.0 / PL))[:, None, :] + ch * (fh * (1.0 / PH))[:, None, :]
            return acc + (d * (sc - 32).to(tl.float32))[:, :, None] * sm

    @triton.jit
    def _dot23(acc, h, hm, wd, wm, s01, s23, s45, r, xr, sb, QT: tl.constexpr):
        """acc + the products of one step's words with the row at xr: per shift j, the two codes of each word times
        their activations (pre-scaled by 2^-p for a code at bit p), their sum times the sub-block's scale (Q2_K:
        minus its min times the raw activations)."""
        n = (r // 2)[:, None]
        hh = (r % 2)[:, None]
        d = _half(wd)
        xo = (sb * 256 + 128 * (r // 2) + 16 * (r % 2))[:, None] + 2 * tl.arange(0, 8)[None, :]
        acc = _dot23j(acc, h, hm, d, wm, s01, s23, s45, n, hh, xr, xo, QT, 0)
        acc = _dot23j(acc, h, hm, d, wm, s01, s23, s45, n, hh, xr, xo, QT, 1)
        acc = _dot23j(acc, h, hm, d, wm, s01, s23, s45, n, hh, xr, xo, QT, 2)
        return _dot23j(acc, h, hm, d, wm, s01, s23, s45, n, hh, xr, xo, QT, 3)

    @triton.jit
    def _rows23(xr0, xr1, wa, wb, nm, nblk, mg, QT: tl.constexpr, TWO: tl.constexpr, MB: tl.constexpr,
                BN: tl.constexpr, NBC: tl.constexpr, PF: tl.constexpr):
        """Q2_K / Q3_K rows, NBC super-blocks per step."""
        bq = tl.arange(0, NBC * 4)
        r = bq % 4
        acca0 = tl.zeros((NBC * 4, BN, 8), dtype=tl.float32)
        accb0 = tl.zeros((NBC * 4, BN, 8), dtype=tl.float32)
        acca1 = tl.zeros((NBC * 4, BN, 8), dtype=tl.float32)
        accb1 = tl.zeros((NBC * 4, BN, 8), dtype=tl.float32)
        if PF:
            sb = bq // 4
            ha, hb, wd, wm, s0, s1, s2 = _ld23(wa, sb, r, mg, QT)
            if TWO:
                ga, gb, vd, vm, t0, t1, t2 = _ld23(wb, sb, r, mg, QT)
        for b0 in range(0, nblk, NBC):
            sb = b0 + bq // 4
            if PF:
                sbn = tl.where(b0 + NBC < nblk, b0 + NBC, 0) + bq // 4
                ha_, hb_, wd_, wm_, s0_, s1_, s2_ = _ld23(wa, sbn, r, mg, QT)
                if TWO:
                    ga_, gb_, vd_, vm_, t0_, t1_, t2_ = _ld23(wb, sbn, r, mg, QT)
            else:
                ha, hb, wd, wm, s0, s1, s2 = _ld23(wa, sb, r, mg, QT)
                if TWO:
                    ga, gb, vd, vm, t0, t1, t2 = _ld23(wb, sb, r, mg, QT)
            acca0 = _dot23(acca0, ha, hb, wd, wm, s0, s1, s2, r, xr0, sb, QT)
            if TWO:
                accb0 = _dot23(accb0, ga, gb, vd, vm, t0, t1, t2, r, xr0, sb, QT)
            if MB == 2:
                acca1 = _dot23(acca1, ha, hb, wd, wm, s0, s1, s2, r, xr1, sb, QT)
                if TWO:
                    accb1 = _dot23(accb1, ga, gb, vd, vm, t0, t1, t2, r, xr1, sb, QT)
            if PF:
                ha, hb, wd, wm, s0, s1, s2 = ha_, hb_, wd_, wm_, s0_, s1_, s2_
                if TWO:
                    ga, gb, vd, vm, t0, t1, t2 = ga_, gb_, vd_, vm_, t0_, t1_, t2_
        return (tl.sum(tl.sum(acca0, 2), 0), tl.sum(tl.sum(accb0, 2), 0), tl.sum(tl.sum(acca1, 2), 0),
                tl.sum(tl.sum(accb1, 2), 0))

    # IQ4_XS, tile [NBC * 8, BN, 8]: super-block, sub-block r (32 values: bytes 16r .. 16r + 15 of qs), word i.
    # The nibbles of bytes 2i, 2i + 1 are the codes of values 2i, 2i + 16, 2i + 1, 2i + 17 (Q4_0's order), each an
    # index into llama.cpp's 16 levels (runtime/formats/iquants.py KVALUES), packed four to an int32 below.

    @triton.jit
    def _iq4_byte(q):
        """4-bit codes (int32) -> their levels as unsigned bytes (level & 255): the 16 int8 levels packed four to an
        int32 (little-endian), one picked by the code's top two bits, its byte by the low two (also the tl.dot
        kernels' `moe_kernels._iq4_level`)."""
        w = tl.where(q < 8, tl.where(q < 4, -1079142271, -152379953), tl.where(q < 12, 639175937, 1901675829))
        return (w >> (8 * (q % 4))) & 255

    @triton.jit
    def _levels4(v):
        """The four codes of 16-bit words v (code k: bits 4k .. 4k + 3) -> their int8 levels, byte k of an int32.
        On a GPU three byte permutes: levels 0-7 and 8-15 each picked by the code's low three bits, then one of the
        two by its fourth."""
        if _ASM:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 s, m, lo, hi, t0, t1, t2, t3; mov.b32 t0, 0xBFAD9881; mov.b32 t1, 0xF6EADDCF; "
                "mov.b32 t2, 0x26190D01; mov.b32 t3, 0x71594535; and.b32 s, $1, 0x7777; prmt.b32 lo, t0, t1, s; "
                "prmt.b32 hi, t2, t3, s; and.b32 m, $1, 0x8888; shr.b32 m, m, 1; or.b32 m, m, 0x3210; "
                "prmt.b32 $0, lo, hi, m; }", "=r,r", [v], dtype=tl.int32, is_pure=True, pack=1)
        else:
            return (_iq4_byte(v & 15) | (_iq4_byte((v >> 4) & 15) << 8) | (_iq4_byte((v >> 8) & 15) << 16)
                    | (_iq4_byte((v >> 12) & 15) << 24))

    @triton.jit
    def _levels_dot(h, top, x0, x1, x2, x3):
        """sum(level * x) over the four codes of 16-bit words h (IQ4's nibble order: values 2i, 2i + 16, 2i + 1,
        2i + 17): their levels plus 128, unsigned bytes two to a half-word or-ed with 2^23's bits `top`, each read as
        Q8_0's codes are; x1 and x3 (the high bytes) pre-scaled by 2^-8."""
        u = _levels4(h) ^ -2139062144                # 0x80808080: each byte level + 128
        lo = (u & 0xFFFF) | top                      # codes 0, 1
        hi = ((u >> 16) & 0xFFFF) | top              # codes 2, 3
        return (_code(lo, 0x00FF, 8388736.0) * x0 + _code(lo, 0xFF00, 8421376.0) * x1
                + _code(hi, 0x00FF, 8388736.0) * x2 + _code(hi, 0xFF00, 8421376.0) * x3)

    @triton.jit
    def _ldiq(w, sb, r, mg):
        """Raw words of one step of IQ4_XS rows (68 words: d, scales_h, 2 of scales_l, 64 of codes): codes, d,
        scales_h and the scales_l word of each sub-block."""
        base = sb * 68
        h = _words(w, (base + 4 + 8 * r)[:, None] + tl.arange(0, 8)[None, :], 0)
        return h, _word(w, base, 0), _word(w, base + 1, 0), _word(w, base + 2 + r // 4, 0)

    @triton.jit
    def _dotiq(acc, h, wd, sh, sl, r, xr, sb, mg):
        """acc + d * (scale - 32) * sum(level * x) over each sub-block's codes: the levels (+ 128, unsigned bytes)
        or-ed two at a time into 2^23's bits and subtracted (`_code`), their activations pre-scaled by 2^-8 for
        the high byte."""
        xo = (sb * 256 + 32 * r)[:, None] + 2 * tl.arange(0, 8)[None, :]
        sm = _levels_dot(h, mg, _xs(xr, xo).to(tl.float32)[:, None, :],
                         (_xs(xr, xo + 16).to(tl.float32) * (1.0 / 256))[:, None, :],
                         _xs(xr, xo + 1).to(tl.float32)[:, None, :],
                         (_xs(xr, xo + 17).to(tl.float32) * (1.0 / 256))[:, None, :])
        rr = r[:, None]
        sc = ((sl >> (4 * (rr // 2 % 2 * 2 + rr % 2))) & 15) | (((sh >> (2 * rr)) & 3) << 4)
        return acc + (_half(wd) * (sc - 32).to(tl.float32))[:, :, None] * sm

    @triton.jit
    def _rowsiq(xr0, xr1, wa, wb, nm, nblk, mg, TWO: tl.constexpr, MB: tl.constexpr, BN: tl.constexpr,
                NBC: tl.constexpr, PF: tl.constexpr):
        """IQ4_XS rows, NBC super-blocks per step."""
        bq = tl.arange(0, NBC * 8)
        r = bq % 8
        acca0 = tl.zeros((NBC * 8, BN, 8), dtype=tl.float32)
        accb0 = tl.zeros((NBC * 8, BN, 8), dtype=tl.float32)
        acca1 = tl.zeros((NBC * 8, BN, 8), dtype=tl.float32)
        accb1 = tl.zeros((NBC * 8, BN, 8), dtype=tl.float32)
        if PF:
            sb = bq // 8
            ha, wd, sh, sl = _ldiq(wa, sb, r, mg)
            if TWO:
                ga, vd, th, tl_ = _ldiq(wb, sb, r, mg)
        for b0 in range(0, nblk, NBC):
            sb = b0 + bq // 8
            if PF:
                sbn = tl.where(b0 + NBC < nblk, b0 + NBC, 0) + bq // 8
                ha_, wd_, sh_, sl_ = _ldiq(wa, sbn, r, mg)
                if TWO:
                    ga_, vd_, th_, tl__ = _ldiq(wb, sbn, r, mg)
            else:
                ha, wd, sh, sl = _ldiq(wa, sb, r, mg)
                if TWO:
                    ga, vd, th, tl_ = _ldiq(wb, sb, r, mg)
            acca0 = _dotiq(acca0, ha, wd, sh, sl, r, xr0, sb, mg)
            if TWO:
                accb0 = _dotiq(accb0, ga, vd, th, tl_, r, xr0, sb, mg)
            if MB == 2:
                acca1 = _dotiq(acca1, ha, wd, sh, sl, r, xr1, sb, mg)
                if TWO:
                    accb1 = _dotiq(accb1, ga, vd, th, tl_, r, xr1, sb, mg)
            if PF:
                ha, wd, sh, sl = ha_, wd_, sh_, sl_
                if TWO:
                    ga, vd, th, tl_ = ga_, vd_, th_, tl__
        return (tl.sum(tl.sum(acca0, 2), 0), tl.sum(tl.sum(accb0, 2), 0), tl.sum(tl.sum(acca1, 2), 0),
                tl.sum(tl.sum(accb1, 2), 0))

    @triton.jit
    def _rows(xr0, xr1, wa, wb, nm, nblk, K, mg, nw, rstd, TWO: tl.constexpr, QT: tl.constexpr, MB: tl.constexpr,
              BN: tl.constexpr, NBC: tl.constexpr, PF: tl.constexpr, KMASK: tl.constexpr, J: tl.constexpr,
              NORM: tl.constexpr):
        if QT == 0:
            ra0, rb0, ra1, rb1 = _rows_f(xr0, xr1, wa, wb, nm, nblk, K, TWO, MB, BN, NBC, KMASK)
        elif QT <= 3 or QT == 10:
            ra0, rb0, ra1, rb1 = _rows32(xr0, xr1, wa, wb, nm, nblk, mg, nw, rstd, QT, TWO, MB, BN, NBC, PF, J, NORM)
        elif QT == 7 or QT == 8:
            ra0, rb0, ra1, rb1 = _rows23(xr0, xr1, wa, wb, nm, nblk, mg, QT, TWO, MB, BN, NBC, PF)
        elif QT == 9:
            ra0, rb0, ra1, rb1 = _rowsiq(xr0, xr1, wa, wb, nm, nblk, mg, TWO, MB, BN, NBC, PF)
        else:
            ra0, rb0, ra1, rb1 = _rowsk(xr0, xr1, wa, wb, nm, nblk, mg, QT, TWO, MB, BN, NBC, PF)
        return ra0, rb0, ra1, rb1

    @triton.jit
    def _out(o_ptr, p, ok, ra, rb, ord_ptr, wt_ptr, n, stride_om, UP: tl.constexpr):
        """Store one window row's results: UP: SiLU(gate) * up at sorted position p; else times the routing weight
        at the pair's own row. ok: [BN] mask."""
        if UP:
            act = ra * tl.sigmoid(ra) * rb
            tl.store(o_ptr + p.to(tl.int64) * stride_om + n, act.to(o_ptr.dtype.element_ty), mask=ok)
        else:
            dst = tl.load(ord_ptr + p)
            wt = tl.load(wt_ptr + dst).to(tl.float32)
            tl.store(o_ptr + dst.to(tl.int64) * stride_om + n, (ra * wt).to(o_ptr.dtype.element_ty), mask=ok)

    # -------------------------------------------------------------------------------------------- the kernel

    @triton.jit
    def _one_dense_kernel(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, SWN: tl.constexpr, BN: tl.constexpr,
                          KC: tl.constexpr, EVEN: tl.constexpr, EARLY: tl.constexpr, TOP: tl.constexpr = False,
                          mark_ptr=None, AWARE: tl.constexpr = False, GDC: tl.constexpr = False):
        """One float row x [K] times BN whole rows of a dense float matrix a program (a `LEAN` one-step variant):
        the tile `_tile_f` loads (EARLY: before the PDL wait), the sums `_dot_f` computes, the store `_out` makes
        of a single expert's weight-1 rows, with none of the expert tables, masks and row loop of `_gemv_kernel`;
        with EARLY the next kernel is let in after the sums (`pdl.release`), not between the tile's loads and the
        sums: 86 registers a thread instead of 168, five programs an SM instead of three. TOP (with EARLY): the next
        kernel let in at the start instead, before the loads. AWARE (with TOP): a program on an SM the split
        attention marked (runtime/gpu/pdl.py MARK_SMS) loads after its wait, and clears the mark."""
        if EARLY and TOP:
            pdl.let_in(GDC)
        if not EARLY:
            pdl.start(GDC)
        nb = tl.program_id(0)
        n = nb * BN + tl.arange(0, BN)
        rw = n if EVEN else tl.minimum(n, N - 1)       # rows past N read row N - 1 and are never stored
        kk = tl.arange(0, KC)
        wp = w_ptr + (rw * SWN)[:, None] + kk[None, :]
        busy = False
        if AWARE and EARLY and TOP and GDC:
            sm = pdl.sm_id(GDC)
            busy = tl.load(mark_ptr + sm, volatile=True) != 0
            if busy:
                pdl.wait_only(GDC)
        if KC == K:
            wv = tl.load(wp)
        else:
            wv = tl.load(wp, mask=(kk < K)[None, :], other=0.0)
        if AWARE and EARLY and TOP and GDC:
            if not busy:
                pdl.wait_only(GDC)
            tl.store(mark_ptr + sm, 0, mask=busy)
        elif EARLY and TOP:
            pdl.wait_only(GDC)
        elif EARLY:
            pdl.wait(GDC)
        ra = _dot_f(wv, x_ptr, kk, K)
        if EARLY and not TOP:
            pdl.release(GDC)
        tl.store(y_ptr + n, ra.to(y_ptr.dtype.element_ty), mask=n < N)

    @triton.jit
    def _down_sum_kernel(h_ptr, se_ptr, ord_ptr, wt_ptr, w_ptr, res_ptr, o_ptr, E, N, K, stride_h, stride_we,
                         SWN: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr, BN: tl.constexpr,
                         KC: tl.constexpr, EARLY: tl.constexpr, REL: tl.constexpr = False,
                         GDC: tl.constexpr = False):
        """One token: program nb takes rows nb*BN.. of the down matrix of each of its top-k pairs (sorted order, as
        the up kernel wrote h), scales each pair's rows by its routing weight in fp32 and sums them in top-k order
        as `_moe_sum_kernel` does, then adds the residual. EARLY: the weights (resident, routing written before the
        up kernel) are loaded before the PDL wait."""
        if not EARLY:
            pdl.start(GDC)
        nb = tl.program_id(0)
        p = tl.arange(0, KP)
        e = tl.load(se_ptr + p, mask=p < TOPK, other=E)
        kn = tl.where(e < E, K, 0)                       # values to read of each pair's rows (0: none)
        n = nb * BN + tl.arange(0, BN)
        kk = tl.arange(0, KC)
        wp = (w_ptr + tl.where(e < E, e, 0).to(tl.int64)[:, None, None] * stride_we
              + (tl.minimum(n, N - 1) * SWN)[None, :, None] + kk[None, None, :])
        tile = tl.load(wp, mask=kk[None, None, :] < kn[:, None, None], other=0.0)        # [KP, BN, KC]
        dst = tl.load(ord_ptr + p, mask=p < TOPK, other=KP)
        wt = tl.load(wt_ptr + dst, mask=p < TOPK, other=0.0).to(tl.float32)
        if EARLY and REL:
            pdl.wait(GDC)
        elif EARLY:
            pdl.start(GDC)
        hv = tl.load(h_ptr + p[:, None].to(tl.int64) * stride_h + kk[None, :], mask=kk[None, :] < kn[:, None],
                     other=0.0).to(tl.float32)                                          # [KP, KC]
        y = tl.sum(tile.to(tl.float32) * hv[:, None, :], 2) * wt[:, None]               # [KP, BN] per pair
        acc = tl.zeros((BN,), dtype=tl.float32)
        for j in tl.static_range(TOPK):                  # top-k order: the pair whose slot is j (exact: one term)
            acc += tl.sum(tl.where((dst == j)[:, None], y, 0.0), 0)
        # REL: the next kernel let in after the sums (`pdl.release`; 128 registers a thread instead of 156). Measured
        # slower (H100, A3B one-row step 3.10 -> 3.21 ms at 1k: the next q/k/v loads its weights later), so off
        if EARLY and REL:
            pdl.release(GDC)
        dt = o_ptr.dtype.element_ty
        x = tl.load(res_ptr + n, mask=n < N, other=0.0).to(tl.float32)
        tl.store(o_ptr + n, (x + acc.to(dt).to(tl.float32)).to(dt), mask=n < N)

    @triton.jit(do_not_specialize=["NP", "E"])      # one build for every window width and expert count
    def _gemv_kernel(x_ptr, tok_ptr, se_ptr, slot_ptr, ord_ptr, wt_ptr, w_ptr, o_ptr, NP, E, N, NBLK, K, mg,
                     stride_xm, stride_we, stride_om, d_ptr, nw_ptr, xo_ptr, ho_ptr, eps,
                     SWN: tl.constexpr, EVEN: tl.constexpr,
                     UP: tl.constexpr, HAS_SLOT: tl.constexpr, QT: tl.constexpr, ZERO: tl.constexpr,
                     BM: tl.constexpr, MB: tl.constexpr, BN: tl.constexpr, NBC: tl.constexpr, PF: tl.constexpr,
                     KMASK: tl.constexpr, J: tl.constexpr, ONE: tl.constexpr = False, EARLY: tl.constexpr = False,
                     R1: tl.constexpr = 0,
                     NORM: tl.constexpr = False, HAS_D: tl.constexpr = False, KN: tl.constexpr = 1,
                     GDC: tl.constexpr = False):
        """Program (i, nb): when sorted pair i is the first of its expert, weight rows nb*BN.. of that expert for
        all the expert's rows of the window, MB at a time. UP: x [T, H] -> h [pairs, I] (SiLU(gate) * up, sorted
        order); else h -> y [pairs, H] (times the routing weight, pair order; a missed expert's rows are zeros when
        ZERO). mg: 0x4B000000, the bits of 2^23. ONE (float rows that fit one step, NBC >= K): the program's weight
        tile is loaded once, in one go, and serves every row of the window. EARLY: that load comes before the PDL
        wait, so it overlaps the previous kernel's tail; only for weights no kernel of the step writes and an
        expert list written before the previous kernel (`down`, docs/models.md "Launches"). NORM (ONE, one dense
        row, `norm_gemv`): the row is RMSNorm(x (+ d)) * nw, computed by every program, and program 0 stores x + d
        at xo and the normalized row at ho (HAS_D), so the norm needs no launch of its own. NORM on the looped
        tiles (one row of 32-value block weights, `down`'s `norm`): every program computes the row's 1 / rms over
        its KN >= K values first, and each activation it loads becomes RMSNorm(x) * nw as it is loaded."""
        if not EARLY:
            pdl.start(GDC)
        i = tl.program_id(0)
        nb = tl.program_id(1)
        e = tl.load(se_ptr + i)
        prev = tl.load(se_ptr + i - 1, mask=i > 0, other=-1)
        lead = (e < E) & (e != prev)
        rr = i + tl.arange(0, BM)             # an expert has at most T rows (BM = pow2(T)): only counted
        rin = rr < tl.where(lead, NP, 0)
        cnt = tl.sum((rin & (tl.load(se_ptr + rr, mask=rin, other=-1) == e)).to(tl.int32), 0)
        if HAS_SLOT:
            s = tl.load(slot_ptr + tl.minimum(e, E - 1))
            s = tl.where(e < E, s, -1)
        else:
            s = tl.where(e < E, e, -1)
        run = s >= 0
        nblk = tl.where(run, NBLK, 0)
        if ZERO:
            rows = cnt
        else:
            rows = tl.where(run, cnt, 0)
        n = nb * BN + tl.arange(0, BN)
        nm = n < N
        # the row stride SWN is a constant, so a thread's rows are constant offsets from one address; rows past N
        # (N not a multiple of BN) read row N - 1 and are never stored: the weight loads need no mask
        rw = tl.arange(0, BN) if EVEN else tl.minimum(n, N - 1) - nb * BN
        wa = w_ptr + tl.maximum(s, 0).to(tl.int64) * stride_we + (nb * BN * SWN).to(tl.int64) + rw * SWN
        wb = wa + N * SWN
        if ONE and QT > 0:
            # 32-value blocks in one step: NBC blocks (a power of two at or above the row's), the tail's blocks
            # read as the row's last one with a zero scale
            b = tl.arange(0, NBC)
            nk = tl.where(rows > 0, nblk, 0)
            bc = tl.minimum(b, tl.maximum(nk, 1) - 1)
            ha, da, qaa, qba = _tile32(wa, b, bc, nk, mg, QT, J)
            if UP:
                hb, db, qab, qbb = _tile32(wb, b, bc, nk, mg, QT, J)
            if EARLY:
                pdl.start(GDC)
            for m in range(0, rows):
                p = i + m
                if UP:
                    xr = x_ptr + tl.load(tok_ptr + p).to(tl.int64) * stride_xm
                    _out(o_ptr, p, nm, _dot_one32(ha, da, qaa, qba, xr, bc, nk, QT, J),
                         _dot_one32(hb, db, qab, qbb, xr, bc, nk, QT, J), ord_ptr, wt_ptr, n, stride_om, UP)
                else:
                    xr = x_ptr + p.to(tl.int64) * stride_xm
                    ra = _dot_one32(ha, da, qaa, qba, xr, bc, nk, QT, J)
                    _out(o_ptr, p, nm, ra, ra, ord_ptr, wt_ptr, n, stride_om, UP)
        elif ONE:
            kk = tl.arange(0, NBC)
            nk = tl.where(rows > 0, nblk, 0)  # nothing to read for a pair that is not its expert's first
            ta = _tile_f(wa, kk, nk)
            if UP:
                tb = _tile_f(wb, kk, nk)
            if EARLY:
                pdl.start(GDC)
            if NORM:
                hv = _norm_row(x_ptr, d_ptr, nw_ptr, xo_ptr, ho_ptr, kk, K, eps, HAS_D, (nb == 0) & (rows > 0))
                ra = tl.sum(ta.to(tl.float32) * hv[None, :], 1)
                _out(o_ptr, i, n < tl.where(rows > 0, N, 0), ra, ra, ord_ptr, wt_ptr, n, stride_om, UP)
            else:
                for m in range(0, rows):
                    p = i + m
                    if UP:
                        xr = x_ptr + tl.load(tok_ptr + p).to(tl.int64) * stride_xm
                        _out(o_ptr, p, nm, _dot_f(ta, xr, kk, nk), _dot_f(tb, xr, kk, nk), ord_ptr, wt_ptr, n,
                             stride_om, UP)
                    else:
                        xr = x_ptr + p.to(tl.int64) * stride_xm
                        ra = _dot_f(ta, xr, kk, nk)
                        _out(o_ptr, p, nm, ra, ra, ord_ptr, wt_ptr, n, stride_om, UP)
        else:
            rstd = 1.0
            if NORM:                          # a block-format row product of RMSNorm(x) * nw (`down`'s `norm`)
                kn = tl.arange(0, KN)
                xv = tl.load(x_ptr + kn, mask=kn < K, other=0.0).to(tl.float32)
                rstd = 1.0 / tl.sqrt(tl.sum(xv * xv, 0) / K + eps)
            for m0 in range(0, rows, MB):
                p0 = i + m0
                p1 = tl.where(m0 + 1 < rows, p0 + 1, p0)      # MB = 2: a second row, or the first again (not stored)
                if UP:
                    xr0 = x_ptr + tl.load(tok_ptr + p0).to(tl.int64) * stride_xm
                    xr1 = x_ptr + tl.load(tok_ptr + p1).to(tl.int64) * stride_xm
                else:
                    xr0 = x_ptr + p0.to(tl.int64) * stride_xm
                    xr1 = x_ptr + p1.to(tl.int64) * stride_xm
                if R1 and (QT == 1 or QT == 3 or QT == 10):      # one row at a time (`_rows32r`)
                    tl.static_assert(MB == 1)
                    w0 = w_ptr + tl.maximum(s, 0).to(tl.int64) * stride_we + (nb * BN * SWN).to(tl.int64)
                    ra0, rb0 = _rows32r(xr0, w0, w0 + N * SWN, N - 1 - nb * BN, SWN, nblk, mg, nw_ptr, rstd, QT, UP,
                                        BN, NBC, NORM, R1)
                    ra1 = ra0
                    rb1 = rb0
                elif R1 and QT == 5:                             # Q4_K rows one at a time (`_rowskr`)
                    tl.static_assert(MB == 1)
                    w0 = w_ptr + tl.maximum(s, 0).to(tl.int64) * stride_we + (nb * BN * SWN).to(tl.int64)
                    ra0, rb0 = _rowskr(xr0, w0, w0 + N * SWN, N - 1 - nb * BN, SWN, nblk, mg, UP, BN, NBC, R1, EVEN)
                    ra1 = ra0
                    rb1 = rb0
                else:
                    ra0, rb0, ra1, rb1 = _rows(xr0, xr1, wa, wb, nm, nblk, K, mg, nw_ptr, rstd, UP, QT, MB, BN, NBC,
                                               PF, KMASK, J, NORM)
                _out(o_ptr, p0, nm, ra0, rb0, ord_ptr, wt_ptr, n, stride_om, UP)
                if MB == 2:
                    _out(o_ptr, p1, n < tl.where(m0 + 1 < rows, N, 0), ra1, rb1, ord_ptr, wt_ptr, n, stride_om, UP)


def one_step(fmt: str, k: int, c: int) -> bool:
    """Whether rows of k values of format fmt go through in one step of c values (float rows) or c blocks (32-value
    block formats), as a ONE variant takes them (`chunk(..., one=True)`)."""
    q = QT[fmt]
    return (q == 0 and c >= k) or (q in BLOCK32 and c * 32 >= k)


def _one(fmt: str, k: int, c: int, one: bool) -> bool:
    """The kernel's ONE: float rows whenever one step covers them (any variant); block rows only for a ONE variant
    (its tile is a power of two of blocks, the tail masked)."""
    return one_step(fmt, k, c) and (one or QT[fmt] == 0)


# one-row windows of float experts: the down products of the token's top-k pairs and their sum (+ the residual) in
# one launch (`down_sum`): tiles {"BN": down rows a program, "num_warps": ...}, or None (the down kernel, then
# moe_kernels.combine). H200, A3B one-row step (bench/step_ab.py): 2.79 -> 2.72 ms at 1k context with BN 2 on 4
# warps (BN 1: 2.74; BN 2 or 4 on 8 warps: 2.85, 2.94)
DOWN_SUM: dict[str, int] | None = {"BN": 2, "num_warps": 4}


def _words_per_thread(fmt: str, cfg: dict[str, int]) -> int:
    """J: code words of one block a thread holds (32-value formats; K-quants 1)."""
    q = QT[fmt]
    return max(1, min(cfg.get("J", 1), (16 if q == 1 else 8) // 2)) if q in BLOCK32 else 1


def _warps(fmt: str, nbc: int, cfg_warps: int, j: int = 1, r1: int = 0) -> int:
    """Warps of a program: no more than the step's word groups need, so warps never split the rows (a thread's
    rows stay constant offsets from one address). r1 (`_rows32r`, its JR): no more than a pass's groups / 32."""
    q = QT[fmt]
    if r1 and q in (1, 3, 10):
        return max(1, min(cfg_warps, nbc * (16 if q == 1 else 8) // (32 * r1)))
    if r1 and q == 5:
        return max(1, min(cfg_warps, nbc * 64 // (32 * r1)))     # `_rowskr`: 64 / r1 threads a super-block
    if q == 0:
        return cfg_warps
    lanes = (16 if q in (1, 5, 6) else 8) // (j if q in BLOCK32 else 1)     # threads along a group's words
    groups = nbc * (4 if q in (5, 6, 7, 8) else 8 if q in (4, 9) else 1)
    return max(1, min(cfg_warps, groups // (32 // lanes)))


def _side(cfg: dict[str, int], side: str) -> dict[str, int]:
    """The variant as the gate/up (side "UP") or down ("DOWN") kernel takes it: R1, KV, J and num_warps given as
    R1_UP, KV_DOWN, ... override the shared ones, so one table entry can pair two tile kinds."""
    over = {k[: -len(side) - 1]: v for k, v in cfg.items() if k.endswith("_" + side) and not k.startswith("BN_")
            and not k.startswith("ONE_")}
    return {**cfg, **over} if over else cfg


def _r1(fmt: str, cfg: dict[str, int]) -> int:
    """The variant's R1 for one kernel (`_side`), refused where the format has no such tile (`refuses`): a tile of
    more words than a format's blocks hold would read past them."""
    r1 = int(cfg.get("R1", 0))
    why = refuses(fmt, {"R1": r1}) if r1 else None
    if why and (r1 > 2 or fmt == "q4_k"):
        raise ValueError(f"{fmt} weights cannot take {why}.")
    return r1


def _weights(w: Tensor, fmt: str) -> Tensor:
    """Block-format weights as 16-bit words (every row is a whole number of them)."""
    return w if fmt == "bf16" else w.view(torch.int16)


def up(x: Tensor, tok: Tensor, se: Tensor, sl: Tensor, gate_up: Tensor, h: Tensor, fmt: str, n_exp: int,
       inter: int, has_slot: bool, bm: int, cfg: dict[str, int]) -> None:
    """h[p] = SiLU(gate(x[tok[p]])) * up(x[tok[p]]) for the sorted pairs p of resident experts."""
    K = x.shape[1]
    NP = se.numel()
    w = _weights(gate_up, fmt)
    cfg = _side(cfg, "UP")
    one = bool(cfg.get("ONE_UP", cfg.get("ONE")))
    c = chunk(K, fmt, cfg["KV"], one)
    j = _words_per_thread(fmt, cfg)
    r1 = _r1(fmt, cfg)
    nblk = K // BLOCK_VALUES[QT[fmt]]
    grid = (NP, triton.cdiv(inter, cfg["BN_UP"]))
    _gemv_kernel[grid](x, tok, se, sl, se, x, w, h, NP, n_exp, inter, K if fmt == "bf16" else nblk, K, MAGIC,
                       x.stride(0), w.stride(0), h.stride(0), x, x, x, x, 0.0, SWN=w.stride(1), EVEN=inter % cfg["BN_UP"] == 0, UP=True, HAS_SLOT=has_slot, QT=QT[fmt],
                       ZERO=False, BM=bm, MB=cfg["MB"], BN=cfg["BN_UP"], NBC=c, PF=cfg["PF"], KMASK=K % c != 0, J=j, num_warps=_warps(fmt, c, cfg["num_warps"], j, r1),
                       num_stages=cfg["num_stages"], ONE=_one(fmt, K, c, one), R1=r1, **_regs(cfg), **pdl.launch(w))


def down(h: Tensor, se: Tensor, sl: Tensor, order: Tensor, wf: Tensor, down_w: Tensor, y: Tensor, fmt: str,
         n_exp: int, has_slot: bool, zero: bool, bm: int, cfg: dict[str, int], early: bool = False,
         norm: tuple[Tensor, float] | None = None) -> None:
    """y[order[p]] = w * down(h[p]) for the sorted pairs p of resident experts (zeros for missed ones when zero).
    early: the caller vouches that no kernel of the step writes `down_w`, and that se, sl, order and wf were written
    before the kernel launched right before this one, so a variant with EARLY may read them (and the weights) before
    its PDL wait. norm (norm weight, eps): h is one row and the product is of RMSNorm(h) * weight, normalized inside
    the kernel (32-value block formats on the looped tiles, MB 1: `norm_fits`)."""
    K = h.shape[1]
    N = y.shape[1]
    NP = se.numel()
    w = _weights(down_w, fmt)
    cfg = _side(cfg, "DOWN")
    one = bool(cfg.get("ONE_DOWN", cfg.get("ONE")))
    c = chunk(K, fmt, cfg["KV"], one)
    j = _words_per_thread(fmt, cfg)
    r1 = _r1(fmt, cfg)
    nblk = K // BLOCK_VALUES[QT[fmt]]
    grid = (NP, triton.cdiv(N, cfg["BN_DOWN"]))
    if norm is not None and not (norm_fits(fmt, cfg) and NP == 1 and h.shape[0] == 1):
        raise ValueError(f"a normalized row product needs one row of 32-value blocks on looped tiles; got {fmt}, "
                         f"{h.shape[0]} rows, {cfg}.")
    nw, eps = norm if norm is not None else (h, 0.0)
    _gemv_kernel[grid](h, se, se, sl, order, wf, w, y, NP, n_exp, N, K if fmt == "bf16" else nblk, K, MAGIC,
                       h.stride(0), w.stride(0), y.stride(0), h, nw, h, h, float(eps), SWN=w.stride(1), EVEN=N % cfg["BN_DOWN"] == 0, UP=False, HAS_SLOT=has_slot, QT=QT[fmt],
                       ZERO=zero, BM=bm, MB=cfg["MB"], BN=cfg["BN_DOWN"], NBC=c, PF=cfg["PF"], KMASK=K % c != 0, J=j, num_warps=_warps(fmt, c, cfg["num_warps"], j, r1),
                       num_stages=cfg["num_stages"], ONE=_one(fmt, K, c, one),
                       EARLY=bool(cfg.get("EARLY")) and early and EARLY_LOADS and _one(fmt, K, c, one),
                       NORM=norm is not None, KN=cover(K) if norm is not None else 1, R1=r1,
                       **_regs(cfg), **pdl.launch(w))


def _regs(cfg: dict[str, int]) -> dict[str, int]:
    """The launch's register cap where the variant names one ("maxnreg"), else nothing."""
    return {"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}


def one_dense(x: Tensor, w: Tensor, cfg: dict[str, int]) -> Tensor:
    """x [1, K] @ w^T for a dense float matrix w [N, K] through `_one_dense_kernel` (a LEAN one-step variant: BN_DOWN
    rows a program, the row in one step). The same sums as the variant's tile in `down` (one expert, weight 1).
    Dense weights are never written during a step, so EARLY needs no routing tables."""
    N, K = w.shape
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    bn = cfg["BN_DOWN"]
    _one_dense_kernel[(triton.cdiv(N, bn),)](x, w, y, N, K=K, SWN=w.stride(0), BN=bn, KC=cover(K), EVEN=N % bn == 0,
                                             EARLY=bool(cfg.get("EARLY")) and EARLY_LOADS, TOP=bool(cfg.get("TOP")),
                                             **({"mark_ptr": pdl.sm_marks(w), "AWARE": True}
                                                if cfg.get("AWARE") and w.is_cuda else {}),
                                             num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **_regs(cfg),
                                             **pdl.launch(w))
    return y


def norm_fits(fmt: str, cfg: dict[str, int]) -> bool:
    """Whether `down` can normalize its row inside the kernel with variant cfg: 32-value block weights on the
    looped tiles (not ONE), one window row a pass."""
    return QT.get(fmt) in BLOCK32 and not cfg.get("ONE") and not cfg.get("ONE_DOWN") and cfg["MB"] == 1


def norm_gemv(x: Tensor, delta: Tensor | None, norm_w: Tensor, eps: float, w: Tensor, one: Tensor, ones: Tensor,
              cfg: dict[str, int], early: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(x + delta, RMSNorm(x + delta) * norm_w, that row @ w^T) for one float row x [1, K] and a dense float matrix
    w [N, K], in one launch of a one-step variant (delta None: x as it is, and the normalized row is not stored).
    one / ones: the single-expert tables of runtime/gpu/dense_kernels.py `gemv` (constant: `early` allows EARLY)."""
    K = x.shape[1]
    N = w.shape[0]
    c = chunk(K, "bf16", cfg["KV"], True)
    if not one_step("bf16", K, c):
        raise ValueError(f"norm_gemv needs a one-step variant whose KV covers rows of {K} values; got {cfg}.")
    xo = torch.empty_like(x) if delta is not None else x
    ho = torch.empty_like(x) if delta is not None else x
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    grid = (1, triton.cdiv(N, cfg["BN_DOWN"]))
    d = delta if delta is not None else x
    _gemv_kernel[grid](x, one, one, one, one, ones, w[None], y, 1, 1, N, K, K, MAGIC,
                       x.stride(0), w.numel(), y.stride(0), d, norm_w, xo, ho, float(eps), SWN=w.stride(0),
                       EVEN=N % cfg["BN_DOWN"] == 0, UP=False, HAS_SLOT=False, QT=0, ZERO=False, BM=1, MB=1,
                       BN=cfg["BN_DOWN"], NBC=c, PF=0, KMASK=K % c != 0, J=1, num_warps=cfg["num_warps"],
                       num_stages=cfg["num_stages"], ONE=True, EARLY=bool(cfg.get("EARLY")) and early and EARLY_LOADS,
                       NORM=True, HAS_D=delta is not None, **_regs(cfg), **pdl.launch(w))
    return xo, (ho if delta is not None else None), y


def down_sum(h: Tensor, se: Tensor, order: Tensor, wf: Tensor, down_w: Tensor, residual: Tensor, top_k: int,
             cfg: dict[str, int], early: bool) -> Tensor:
    """residual [1, H] + sum over the token's top-k pairs of w * down(h[p]) in one launch (float experts, all
    resident, one row; `DOWN_SUM`). early: as for `down`."""
    n_exp, N, K = down_w.shape
    out = torch.empty_like(residual)
    kc = cover(K)
    _down_sum_kernel[(triton.cdiv(N, cfg["BN"]),)](h, se, order, wf, down_w, residual, out, n_exp, N, K, h.stride(0),
                                                   down_w.stride(0), SWN=down_w.stride(1), TOPK=top_k,
                                                   KP=max(2, 1 << (top_k - 1).bit_length()), BN=cfg["BN"], KC=kc,
                                                   EARLY=early and EARLY_LOADS, REL=bool(cfg.get("REL")),
                                                   num_warps=cfg["num_warps"],
                                                   **pdl.launch(down_w, "down_sum"))
    return out
