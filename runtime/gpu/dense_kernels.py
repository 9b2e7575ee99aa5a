"""Dense rows on the GPU: `rmsnorm` (+ residual add, a Triton kernel), `quant_linear` (x @ dequant(W)^T with W as
ggml blocks: one row through the matrix-vector kernels, dequantized in registers; more rows through one dequantized
matrix in a shared scratch and cuBLAS). BF16 projections stay on cuBLAS, which beat the GEMV kernel's looped
tiles at every decode width (bench/dense_gemv.py), except one-row products of the fused step, which take its
one-step tiles (`one_row`, `norm_one_row`: bench/gemv_one_row.py, docs/models.md "The one-row step").
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from runtime.gpu import moe_gemv, pdl
from runtime.gpu.kernels import HAVE_TRITON, pow2

if HAVE_TRITON:
    import triton
    import triton.language as tl

if HAVE_TRITON:

    @triton.jit
    def _rmsnorm_kernel(x_ptr, d_ptr, w_ptr, xo_ptr, y_ptr, H, eps, stride_x, stride_y,
                        HAS_D: tl.constexpr, BH: tl.constexpr, GDC: tl.constexpr = False):
        pdl.start(GDC)
        r = tl.program_id(0)
        c = tl.arange(0, BH)
        m = c < H
        x = tl.load(x_ptr + r * stride_x + c, mask=m, other=0.0)
        if HAS_D:
            x = (x.to(tl.float32) + tl.load(d_ptr + r * stride_x + c, mask=m, other=0.0).to(tl.float32)).to(
                x_ptr.dtype.element_ty)
            tl.store(xo_ptr + r * stride_x + c, x, mask=m)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / H + eps)
        w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
        y = (xf * rstd).to(y_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(y_ptr + r * stride_y + c, y.to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _step_inputs_kernel(t_ptr, ids_ptr, emb_ptr, pos_ptr, x_ptr, H, stride_e, EMB: tl.constexpr,
                            BH: tl.constexpr, GDC: tl.constexpr = False):
        """Row r of a window: its position (start + r, or -1 past the window's rows) and (EMB) its token's
        embedding."""
        pdl.start(GDC)
        r = tl.program_id(0)
        start = tl.load(t_ptr)
        rows = tl.load(t_ptr + 1)
        tl.store(pos_ptr + r, tl.where(r < rows, start + r, -1).to(pos_ptr.dtype.element_ty))
        if EMB:
            tok = tl.load(ids_ptr + r).to(tl.int64)
            c = tl.arange(0, BH)
            m = c < H
            tl.store(x_ptr + r * H + c, tl.load(emb_ptr + tok * stride_e + c, mask=m), mask=m)


GEMV_ROWS = 64   # rows per launch of the GEMV kernels (decode and verify windows are narrower)

_ONE_EXPERT: dict[tuple[torch.device, int], tuple[Tensor, Tensor, Tensor]] = {}


def _keep(cache: dict, key: tuple, value, device: torch.device):
    """Remember `value` under `key` unless a CUDA graph is being captured (a capture's allocations are its own)."""
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        cache[key] = value
    return value


def _one_expert(M: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(expert ids, output rows, weights) that route every row of an M-row input to one expert with weight 1: made
    once per width (a graph replays them; making them per call costs three launches a matrix)."""
    got = _ONE_EXPERT.get((device, M))
    if got is None:
        got = _keep(_ONE_EXPERT, (device, M), (torch.zeros(M, dtype=torch.int32, device=device),
                                               torch.arange(M, dtype=torch.int32, device=device),
                                               torch.ones(M, dtype=torch.float32, device=device)), device)
    return got


def gemv(x2: Tensor, w: Tensor, fmt: str, cfg: dict[str, int], norm: tuple[Tensor, float] | None = None) -> Tensor:
    """x2 [M, K] @ W^T through the matrix-vector kernels of runtime/gpu/moe_gemv.py, W (BF16 [N, K] or ggml blocks
    [N, row bytes]) taken as the single expert every row is routed to (weight 1): the weights are read once, by
    many programs, a row's bits do not depend on the other rows, and the result is written in x2's dtype (the
    fp32 sum rounded once, as a float32 result converted afterwards would be) in one launch. A dense weight is
    never written during a step, so a variant with EARLY loads it before its PDL wait (once the routing tables
    exist: made in this call, they are written right before the kernel). norm (weight, eps): one row, multiplied
    as RMSNorm(x2) * weight (`moe_gemv.down`)."""
    M, N = x2.shape[0], w.shape[0]
    early = (x2.device, M) in _ONE_EXPERT
    one, rows, ones = _one_expert(M, x2.device)
    y = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    moe_gemv.down(x2, one, one, rows, ones, w[None], y, fmt, 1, False, False, pow2(M), cfg, early=early, norm=norm)
    return y


# one-row BF16 projections of the fused decode step: the GEMV variant (runtime/gpu/moe_gemv.py GEMV_VARIANTS) per
# matrix, or None for cuBLAS. One-step tiles with the weights loaded before the PDL wait: H200, A3B, 48 copies in a
# graph (bench/gemv_one_row.py): q/k/v 6.9 us against cuBLAS's 8.0, o_proj 6.5 against 8.8, the router 1.5 against
# 4.9; the one-row step at 1k context 3.19 -> 2.93 ms (bench/step_ab.py, bench/results/h200_session8/). o_proj on
# the lean one-row kernel ("one_d4lean", moe_gemv `_one_dense_kernel`: the same sums, 86 registers a thread instead
# of 168, so all 512 programs are resident and load their weights during the attention): H100, A3B one-row step
# 3.10 -> 3.07 ms at 1k, 3.18 -> 3.11 at 4k, 3.65 -> 3.64 at 16k, the same bits (bench/step_ab.py --arms
# default,o-lean, bench/results/h100_session36/lean/). Since, its form that lets the router in at its start
# ("one_d4leantop": the router's programs scheduled and their weights loaded while o_proj runs), with the split
# attention's KV prefetch (attention_kernels.SPLIT_KV_PREFETCH): H100, 3.08 -> 3.05 ms at 1k, 3.13 -> 3.08 at 4k, 3.67
# -> 3.60 at 16k, 4.24 -> 4.17 at 32k, the same bits (bench/step_ab.py --capacity 40960 --arms
# kv-pf0,o-lean-top-pf64, bench/results/h100_session37/top_pf/)
ONE_ROW_DENSE: dict[str, str | None] = {"qkv": "one_d8", "o_proj": "one_d4leantop", "router": "one_d1"}
# windows of up to this many rows (per role; 1 where not named) take ONE_ROW_DENSE's variants too (a program loads
# its weight tile once and serves every row of the window); wider ones take cuBLAS. H200, A3B verify steps at 1k
# context (bench/step_ab.py arms wide-cublas / wide-router8-o2, bench/results/h200_session14/wide_router/): 4.17 ->
# 3.96 ms at 2 rows, 4.78 -> 4.66 at 3, 5.51 -> 5.41 at 4, 6.23 -> 6.15 at 5, 8 rows unchanged; the router at 16
# rows and q/k/v at 4 were slower, o_proj at 4 no faster than at 2
DENSE_GEMV_ROWS: dict[str, int] = {"router": 8, "o_proj": 2}


def dense_rows(role: str) -> int:
    """The widest window whose `role` product takes the one-step tiles (at least one row)."""
    return max(1, DENSE_GEMV_ROWS.get(role, 1))


def _one_row_variant(x: Tensor, w: Tensor | None, role: str) -> str | None:
    """The variant ONE_ROW_DENSE names for `role` when x has at most `dense_rows(role)` rows (at least one) and w is
    a float matrix of its dtype on the GPU (or in the interpreter: the tests), else None."""
    name = ONE_ROW_DENSE.get(role)
    if name is None or w is None or not 1 <= x.shape[0] <= dense_rows(role) or not HAVE_TRITON \
            or x.dtype != w.dtype or w.dim() != 2 or not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return None
    return name


def loads_early(x: Tensor, w: Tensor | None, role: str) -> bool:
    """Whether `one_row(x, w, role)` takes a variant that loads its weights before its PDL wait, so the kernel
    before it may let it be scheduled first (runtime/gpu/pdl.py, TRIGGER_FIRST)."""
    name = _one_row_variant(x, w, role)
    return name is not None and bool(moe_gemv.GEMV_VARIANTS.get(name, {}).get("EARLY")) and moe_gemv.EARLY_LOADS


def one_row(x: Tensor, w: Tensor | None, role: str) -> Tensor | None:
    """x [M, K] @ w^T (M <= dense_rows(role)) through the GEMV kernel when ONE_ROW_DENSE names a
    variant for `role` and w is a float matrix of x's dtype on the GPU; None otherwise (the caller takes its usual
    path). Chosen by the row count alone, so at a step's fixed width a row's bits never depend on the other rows
    (docs/models.md, "Kernels chosen by width")."""
    name = _one_row_variant(x, w, role)
    if name is None:
        return None
    if name not in moe_gemv.GEMV_VARIANTS:
        raise ValueError(f"ONE_ROW_DENSE[{role!r}] names {name!r}, which is not in GEMV_VARIANTS; use one of "
                         f"{', '.join(moe_gemv.GEMV_VARIANTS)} or None.")
    cfg = moe_gemv.GEMV_VARIANTS[name]
    if cfg.get("LEAN") and x.shape[0] == 1 and moe_gemv.one_step("bf16", x.shape[1],
                                                                   moe_gemv.chunk(x.shape[1], "bf16", cfg["KV"], True)):
        return moe_gemv.one_dense(x.contiguous(), w, cfg)
    return gemv(x.contiguous(), w, "bf16", cfg)


# one-row steps: fold the RMSNorm before the q/k/v and router products into those products' GEMV (every program
# normalizes the row; the router's program 0 stores the residual and the normalized row for the experts), so the
# norm needs no launch of its own; only where ONE_ROW_DENSE names a one-step variant for the product. H200, A3B
# one-row step (bench/step_ab.py): 2.93 -> 2.79 ms at 1k context, 3.98 -> 3.86 at 32k. Not for wider windows: a
# router product of 2-8 rows with every program normalizing every row was 0-1.5% slower than the norm's own launch
# (bench/results/h200_session14/norm_rows_rejected/)
FUSE_NORM = True


def norm_one_row(x: Tensor, delta: Tensor | None, norm_w: Tensor, eps: float, w: Tensor | None, role: str
                 ) -> tuple[Tensor, Tensor | None, Tensor] | None:
    """(x + delta, RMSNorm(x + delta) * norm_w, that @ w^T) for one row x [1, K] in one launch (`moe_gemv.norm_gemv`)
    when FUSE_NORM is on and `one_row` would take (w, role) through a one-step variant; None otherwise (the caller
    runs `rmsnorm`, then the product)."""
    name = _one_row_variant(x, w, role) if FUSE_NORM and x.shape[0] == 1 else None
    if name is None:
        return None
    cfg = moe_gemv.GEMV_VARIANTS.get(name)
    K = x.shape[1]
    if cfg is None or not (cfg.get("ONE") and moe_gemv.one_step("bf16", K, moe_gemv.chunk(K, "bf16", cfg["KV"], True))):
        return None
    early = (x.device, 1) in _ONE_EXPERT
    one, _, ones = _one_expert(1, x.device)
    return moe_gemv.norm_gemv(x.contiguous(), delta, norm_w, eps, w, one, ones, cfg, early)


# one-row steps of a block-format target: fold the RMSNorm before q/k/v into the q/k/v product on the looped block
# tiles (every program computes the row's 1 / rms and normalizes each activation as it loads it), on the variant
# the product takes alone (QUANT_ONE_ROW's for the role, else moe_gemv.DECODE_GEMV's) when it is looped
FUSE_NORM_QUANT = True


def quant_norm_one_row(x: Tensor, norm_w: Tensor, eps: float, mod, role: str) -> Tensor | None:
    """RMSNorm(x) * norm_w @ W^T for one row x [1, K] and a block-format projection `mod` (a QuantLinear) in one
    launch, when FUSE_NORM_QUANT is on and its variant allows (`moe_gemv.norm_fits`); None otherwise (the caller
    runs `rmsnorm`, then the product). The norm's arithmetic and roundings are `_rmsnorm_kernel`'s; its sum may be
    reduced in another order."""
    fmt = getattr(mod, "qtype", None)
    if not FUSE_NORM_QUANT or x.shape[0] != 1 or fmt is None or not hasattr(mod, "blocks") or not HAVE_TRITON \
            or not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return None
    name = QUANT_ONE_ROW.get((fmt, role))
    cfg = moe_gemv.GEMV_VARIANTS.get(name) if name is not None else moe_gemv.variant(fmt)
    if cfg is None or not moe_gemv.norm_fits(fmt, cfg):
        return None
    return gemv(x.contiguous(), mod.blocks, fmt, cfg, norm=(norm_w, eps))


def weight_of(mod: torch.nn.Module) -> Tensor | None:
    """The weight of a bias-free torch Linear (what `one_row` can take), else None (a block-format projection)."""
    if type(mod) is torch.nn.Linear and mod.bias is None:
        return mod.weight
    return None


# a quantized matrix of at most this many values is dequantized (into one shared scratch, `_dequant_scratch`) for a
# window of 2+ rows and multiplied by cuBLAS: the GEMV kernel passes over the weights once per row (8 rows cost 8x),
# and a tiled tl.dot kernel kept too few programs busy (45-130 us a matrix; bench/dense_gemv.py --quant measures the
# others). Larger matrices (a quantized vocabulary head) stay on the GEMV kernel: their scratch would cost more
# memory than the rows save. The budget counts the scratch (setup_wizard/budget.py `dequant_scratch_tensors`).
DEQUANT_MAX_VALUES = 32 << 20

_SCRATCH: dict[tuple[torch.device, torch.dtype], Tensor] = {}


def _dequant_scratch(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """At least n values of `dtype`, reused by every dequantized matrix (one at a time on one stream)."""
    buf = _SCRATCH.get((device, dtype))
    if buf is None or buf.numel() < n:
        buf = _keep(_SCRATCH, (device, dtype), torch.empty(n, dtype=dtype, device=device), device)
    return buf


def dequant_linear(x2: Tensor, blocks: Tensor, qtype: str) -> Tensor:
    """x2 [M, K] @ W^T with W dequantized into the shared scratch in x2's dtype, then one cuBLAS product."""
    from runtime.gpu import moe_kernels

    N, K = blocks.shape[0], x2.shape[1]
    w = _dequant_scratch(N * K, x2.dtype, x2.device)[:N * K].view(N, K)
    moe_kernels.dequantize(blocks, qtype, out=w)
    return torch.nn.functional.linear(x2, w)


# one-row products of a block-format matrix in the fused step: the GEMV variant per (format, role) where the role's
# shape favours another than moe_gemv.DECODE_GEMV's (`quant_one_row`; the row count and the role pick it, never the
# other rows). H200, A3B, 48 copies in a graph (bench/gemv_one_row.py --quant, bench/results/h200_session13/
# quant_tiles/): looped tiles with more blocks a step (moe_gemv "n*k*": more warps a program), o_proj (2048 x 4096)
# Q4_0 4.4 us against 5.8 on the one-step tiles before (8.0 on DECODE_GEMV's), Q8_0 5.7 against 7.0; Q4_0 q/k/v
# (5120 x 2048) 5.3 against 5.9 (Q8_0 q/k/v: no better than DECODE_GEMV's, 6.3)
QUANT_ONE_ROW: dict[tuple[str, str], str] = {("q4_0", "o_proj"): "n8j2k4np", ("q8_0", "o_proj"): "n4j2k2np",
                                             ("q4_0", "qkv"): "n8j2k2",
                                             # Q4_K (bench/results/h200_session17/kquant/gemv_k.log: q/k/v 9.00
                                             # -> 7.18 us, o_proj 9.62 -> 5.84; the Q4_K step 350 -> 366 tok/s,
                                             # qt_before.log / qt_after.log). Q6_K's faster tiles alone (q/k/v
                                             # 9.41 -> 8.12, o_proj 9.46 -> 7.10) did not make its step faster
                                             # (348 -> 341 tok/s with them and its experts' n8j2): not taken
                                             ("q4_k", "qkv"): "n8j2", ("q4_k", "o_proj"): "n8j2k4np",
                                             # the output head (151,936 x 2048): Q4_0 80.4 -> 68.1 us (bench/
                                             # gemv_one_row.py --quant q6_k,q4_0,q8_0 --lm-head, bench/results/
                                             # h200_session18/; Q8_0's and Q6_K's fastest is DECODE_GEMV's own)
                                             ("q4_0", "lm_head"): "n8j2np"}
# Triton 3.9 on (moe_gemv.r1_tables): the Q8_0 / Q4_0 one-row products on the row-by-row tiles, except Q4_0's o_proj,
# whose tile above stays faster there. One H100, each kernel as built by Triton 3.6 / 3.9 (bench/results/
# h200_session24/triton39/h100_j2/): Q4_0 q/k/v 6.91 / 12.63 us shipped, 6.67 / 7.17 on r4d8k2w4j2; Q4_0 o_proj
# 5.55 / 7.47 against 6.84 / 8.35; a Q4_0 head of 4,096 rows 6.50 / 7.75 against 7.12 / 6.63; Q8_0 q/k/v 8.17 /
# 11.39 against 8.96 / 8.53; Q8_0 o_proj 6.88 / 10.11 against 8.06 / 8.90
if moe_gemv.r1_tables():
    QUANT_ONE_ROW.update({("q4_0", "qkv"): "r4d8k2w4j2", ("q4_0", "lm_head"): "r4d8k2w4j2",
                          ("q8_0", "o_proj"): "r4d8k2w4j2"})


def quant_one_row(x: Tensor, mod, role: str) -> Tensor | None:
    """x [1, K] @ W^T for a block-format projection `mod` (a QuantLinear) through the variant QUANT_ONE_ROW names
    for its format and `role`; None when it names none (the caller takes the module's own path)."""
    name = QUANT_ONE_ROW.get((getattr(mod, "qtype", None), role)) if x.shape[0] == 1 else None
    if name is None or not hasattr(mod, "blocks"):
        return None
    if name not in moe_gemv.GEMV_VARIANTS:
        raise ValueError(f"QUANT_ONE_ROW[{(mod.qtype, role)!r}] names {name!r}, which is not in GEMV_VARIANTS; use one "
                         f"of {', '.join(moe_gemv.GEMV_VARIANTS)}.")
    if not HAVE_TRITON:
        return None
    return gemv(x.contiguous(), mod.blocks, mod.qtype, moe_gemv.GEMV_VARIANTS[name])


# how 2+ rows of a quantized matrix are multiplied: "dequant" (`dequant_linear` for matrices up to
# DEQUANT_MAX_VALUES, the GEMV kernel above) or "gemv" (the GEMV kernel, one pass per row: the runtime before,
# kept for bench/dense_gemv.py --quant-step). A 16-row tile kernel that dequantized each weight once for all rows
# (tl.dot per 16 values) was slower than both at 2+ rows, 37-106 us a matrix (bench/results/h200_session5/)
MULTI_ROW = "dequant"


def quant_linear(x: Tensor, blocks: Tensor, qtype: str, in_features: int) -> Tensor:
    """x [..., K] @ dequant(blocks [N, K/32 * block_bytes])^T -> [..., N] in x's dtype.

    One row (a decode step of width 1): the matrix-vector kernel (`gemv`), the weights read once in their blocks.
    More rows (verify windows, drafter blocks, prefill): the matrix dequantized into a scratch in x's dtype (values
    rounded once) and one cuBLAS product; a matrix above `DEQUANT_MAX_VALUES` stays on the GEMV kernel, `GEMV_ROWS`
    rows a launch. The path depends only on the row count, so at a step's fixed width a row's bits do not depend on
    the other rows."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features).contiguous()
    M = x2.shape[0]
    N = blocks.shape[0]
    cfg = moe_gemv.variant(qtype)
    if M == 1 and cfg is not None:
        return gemv(x2, blocks, qtype, cfg).reshape(*lead, N)
    if (MULTI_ROW != "gemv" and N * in_features <= DEQUANT_MAX_VALUES) or cfg is None:
        return dequant_linear(x2, blocks, qtype).reshape(*lead, N)
    parts = [gemv(x2[s:s + GEMV_ROWS], blocks, qtype, cfg) for s in range(0, M, GEMV_ROWS)]
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(*lead, N)


def rmsnorm(x: Tensor, w: Tensor, eps: float, delta: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(x + delta, RMSNorm(x + delta) * w) for x [M, H] (delta None: x unchanged). Row-invariant."""
    M, H = x.shape
    y = torch.empty_like(x)
    xo = torch.empty_like(x) if delta is not None else x
    _rmsnorm_kernel[(M,)](x, delta if delta is not None else x, w, xo, y, H, float(eps), x.stride(0), y.stride(0),
                          HAS_D=delta is not None, BH=triton.next_power_of_2(H), **pdl.launch(x))
    return xo, y


def step_inputs(t: Tensor, ids: Tensor, pos: Tensor, emb: Tensor | None) -> Tensor | None:
    """A step's inputs in one launch where torch takes six (docs/models.md, "The captured step, kernel by kernel"):
    pos[r] = t[0] + r for the window's t[1] rows and -1 past them, and with a float embedding table `emb` the
    embedding rows x [W, H] of ids [W] (a copy: the same bits; None: the positions alone, None returned)."""
    W = ids.shape[0]
    if emb is None:                   # no table to read: pos stands in for the pointers the kernel never reads
        _step_inputs_kernel[(W,)](t, ids, pos, pos, pos, 1, 0, EMB=False, BH=1, **pdl.launch(pos))
        return None
    x = torch.empty(W, emb.shape[1], dtype=emb.dtype, device=emb.device)
    _step_inputs_kernel[(W,)](t, ids, emb, pos, x, emb.shape[1], emb.stride(0), EMB=True,
                              BH=triton.next_power_of_2(emb.shape[1]), **pdl.launch(pos))
    return x
