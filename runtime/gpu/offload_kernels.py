"""Kernels of the expert offload (docs/budget.md, "Expert cache"):

- `fetch`: copy whole experts from the host arena into device slots, with the (expert, slot) list on the device. The
  kernel reads page-locked host memory directly over PCIe (no host round trip, no host-side launch per expert), so
  the miss path is a fixed set of launches that a CUDA graph can hold. An entry whose `ok` flag is 0 copies nothing.
- `pairs` / `pair_sum`: the grouped expert kernels of runtime/gpu/moe_kernels.py split at their fp32 per-(token,
  choice) buffer `y`, so (token, expert) pairs can be computed in several passes (a window needing more experts than
  the staging slots hold) or partly elsewhere (the CPU), and still be summed in one pass in top-k order: every pair
  gets exactly the bits `moe_grouped` would give it, whatever pass or slot it went through.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.gpu import moe_kernels
from runtime.gpu.kernels import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

FETCH_CHUNK = 32768       # words (of the widest type that divides an expert's row) per program
FETCH_BLOCK = 1024        # words per load/store step


if HAVE_TRITON:

    @triton.jit
    def _fetch_kernel(src_ptr, dst_ptr, exp_ptr, slot_ptr, ok_ptr, n_words, src_stride, dst_stride,
                      CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        c = tl.program_id(1)
        lim = tl.load(ok_ptr + i).to(tl.int64) * n_words     # ok is 0 or 1: a skipped entry has no valid word
        e = tl.load(exp_ptr + i).to(tl.int64)
        s = tl.load(slot_ptr + i).to(tl.int64)
        base = c.to(tl.int64) * CHUNK
        for o in range(0, CHUNK, BLOCK):
            offs = base + o + tl.arange(0, BLOCK)
            m = offs < lim                     # masked-off lanes issue no reads (a skipped entry moves nothing)
            v = tl.load(src_ptr + e * src_stride + offs, mask=m)
            tl.store(dst_ptr + s * dst_stride + offs, v, mask=m)


def _words(t: Tensor) -> Tensor:
    """`t` [N, ...] (contiguous) as [N, words] of the widest integer type that divides one row."""
    n = t.shape[0]
    row = t[0].numel() * t.element_size()
    b = t.reshape(n, -1).view(torch.uint8)
    for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row % size == 0:
            return b.view(dt)
    return b


def fetch(src: Tensor, dst: Tensor, experts: Tensor, slots: Tensor, ok: Tensor) -> None:
    """dst[slots[i]] = src[experts[i]] for every i with ok[i] != 0 (src: host plane [E, ...], pinned; dst: device
    plane [P, ...]; experts/slots int [M]; ok int32 [M] of 0 or 1). Shape-static: the grid is M x chunks of one expert."""
    s, d = _words(src), _words(dst)
    n = s.shape[1]
    grid = (experts.numel(), triton.cdiv(n, FETCH_CHUNK))
    _fetch_kernel[grid](s, d, experts, slots, ok, n, s.stride(0), d.stride(0), CHUNK=FETCH_CHUNK, BLOCK=FETCH_BLOCK,
                        num_warps=4)


def pairs(x: Tensor, sidx: Tensor, w: Tensor, gate_up: Tensor, down: Tensor, y: Tensor) -> None:
    """y[t*k + j] = w[t, j] * expert(x[t]) for every pair whose slot sidx[t, j] < P (gate_up/down [P, ...]); other
    rows of y are left as they are. The same kernels, tiles and row block as `moe_kernels.moe_grouped`."""
    r = moe_kernels.group(sidx, w, gate_up.shape[0])
    moe_kernels.experts(x, r, gate_up, down, y=y, zero_missing=False)


def pair_sum(y: Tensor, real: Tensor, T: int, k: int, dtype: torch.dtype) -> Tensor:
    """out[t] = sum over j (in top-k order) of y[t*k + j] for the real pairs (real [T*k] bool), in `dtype`: the sum
    `moe_grouped` ends with."""
    flag = (~real).to(torch.int32).reshape(T, k).contiguous()     # 0 = real pair (< n_exp = 1), 1 = padded
    return moe_kernels.combine(y, flag, 1, None, dtype)
