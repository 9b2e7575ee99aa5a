"""Triton kernels of the DFlash2 drafter: the dynamic convolution in one launch and the selector walk's chain in one
launch (docs/models.md, "DFlash2 drafter").
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.gpu.kernels import FMA, HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

# ------------------------------------------------------------------------------------ DFlash2 dynamic convolution
if HAVE_TRITON:

    @triton.jit
    def _dyn_conv_kernel(h_ptr, d_ptr, b_ptr, o_ptr, H, NG, stride_h, stride_d, stride_o,
                         K: tl.constexpr, G: tl.constexpr, BH: tl.constexpr):
        t = tl.program_id(0)
        c = tl.arange(0, BH)
        m = c < H
        dt = o_ptr.dtype.element_ty
        acc = tl.zeros((BH,), dtype=tl.float32)
        for o in tl.static_range(K):
            src = tl.maximum(t - o, 0)
            # masks from vector comparisons only (boolean in the interpreter)
            v = tl.load(h_ptr + src * stride_h + c, mask=c < tl.where(t >= o, H, 0), other=0.0).to(tl.float32)
            b = tl.load(b_ptr + o * H + c, mask=m, other=0.0).to(tl.float32)
            dy = tl.load(d_ptr + t * stride_d + o * NG + c // G, mask=m, other=0.0).to(tl.float32)
            acc = (acc + (b * v).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            acc = (acc + (dy * v).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        tl.store(o_ptr + t * stride_o + c, acc.to(dt), mask=m)


def dyn_conv(h: Tensor, dyn: Tensor, half: int, base: Tensor, kernel_size: int, group_size: int) -> Tensor:
    """DFlash2's grouped dynamic causal convolution over one window's rows in one launch (docs/models.md ("DFlash2 drafter", step 4)):
    h [W, H]; dyn [W, 2*K*H/G] = kernel_projection(h_in) (the `half` 0 for prepare, 1 for finish); base [K, H].
    out[t] = Σ_o base[o] * h[t-o] + dyn[t, half, o] * h[t-o], rounded in h's dtype after every product and add,
    in the order of `GroupedDynamicCausalConv.conv` (so the bits are the module's)."""
    W, H = h.shape
    ng = H // group_size
    h = h.contiguous()
    base = base.contiguous()
    d = dyn[:, half * kernel_size * ng:]
    out = torch.empty_like(h)
    _dyn_conv_kernel[(W,)](h, d, base, out, H, ng, h.stride(0), dyn.stride(0), out.stride(0), K=kernel_size,
                           G=group_size, BH=triton.next_power_of_2(H), **FMA)
    return out


# ------------------------------------------------------------------------------------------- DFlash2 selector walk
if HAVE_TRITON:

    @triton.jit
    def _lattice_walk_kernel(score_ptr, best_ptr, cand_ptr, tok_ptr, conf_ptr, R: tl.constexpr, K: tl.constexpr,
                             KP: tl.constexpr):
        i = tl.arange(0, KP)
        m = i < K
        j = tl.load(best_ptr)                    # row 0: every predecessor is the anchor; take column 0
        j = j * 0
        for r in tl.static_range(R):
            idx = tl.load(best_ptr + r * K + j)
            base = score_ptr + (r * K + j) * K
            row = tl.load(base + i, mask=m, other=float("-inf"))
            mx = tl.max(row, 0)
            s = tl.sum(tl.exp(row - mx), 0)
            pick = tl.load(base + idx)
            tl.store(conf_ptr + r, tl.exp(pick - mx) / s)
            tl.store(tok_ptr + r, tl.load(cand_ptr + r * K + idx))
            j = idx


def lattice_walk(score: Tensor, best: Tensor, cand: Tensor) -> tuple[Tensor, Tensor]:
    """The selector walk's chain in one launch: score [R, k(prev), k] fp32 lattice scores, best [R, k] = argmax over
    the last dim, cand [R, k] token ids -> (tokens [R] int64, confidence [R] fp32 = softmax of the walked row at
    the chosen candidate). Row 0 reads predecessor column 0 (all its predecessors are the anchor)."""
    R, k = best.shape
    tok = torch.empty(R, dtype=torch.long, device=best.device)
    conf = torch.empty(R, dtype=torch.float32, device=best.device)
    _lattice_walk_kernel[(1,)](score.contiguous(), best.contiguous(), cand.contiguous(), tok, conf, R=R, K=k,
                               KP=triton.next_power_of_2(k), num_warps=1, **FMA)
    return tok, conf
