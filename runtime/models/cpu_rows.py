"""A decoder layer's pieces for rows on a CPU in fewer ops than the module path: the CPU step
(runtime/gpu/static_step.py), the MTP head's CPU rows (runtime/drafters/mtp.py) and the DFlash2 drafter's norms.

Why: on a CPU a small model's step is paid per op (a few microseconds each), not per byte (docs/models.md,
"Numerics", CPU). Every function here computes each row from that row alone, with one fixed shape per window
width, so the CPU step's row invariance holds; the bits are not the module path's (within fp32 rounding of them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def derived(mod: nn.Module, name: str, sources: tuple[Tensor, ...], make: Callable[[], Tensor],
            extra: object = None) -> Tensor:
    """A tensor made from `sources` (module weights) once and kept on `mod` as an unregistered attribute (the
    state_dict and the weight count stay as they were); remade when a source is replaced or changed in place
    (a training step between evaluations) or `extra` changes."""
    key = (tuple((t.data_ptr(), t._version) for t in sources), extra)
    have = getattr(mod, name, None)
    if have is None or have[0] != key:
        with torch.no_grad():
            have = (key, make())
        object.__setattr__(mod, name, have)
    return have[1]


def rms_ln(x: Tensor, w2: Tensor | None, eps: float) -> Tensor:
    """RMSNorm of x over its last dimension as one layer_norm over [x, -x], whose mean is 0 and whose variance is
    the mean of x^2: on a CPU layer_norm is one kernel and RMSNorm about eight ops. w2: the weight then as many
    zeros ([2 * H], `ln_weight`), or None for no weight. The result is a view of the first half."""
    h = x.shape[-1]
    return F.layer_norm(torch.cat((x, -x), -1), (2 * h,), w2, None, eps)[..., :h]


def ln_weight(norm: nn.Module, dtype: torch.dtype | None = None) -> Tensor:
    """An RMSNorm's weight (in `dtype`, default its own) followed by as many zeros, for `rms_ln`."""
    w = norm.weight
    dt = dtype or w.dtype

    def make() -> Tensor:
        v = w.detach().to(dt)
        return torch.cat((v, torch.zeros_like(v)))

    return derived(norm, "_ln_weight", (w,), make, dt)


def norm(mod: nn.Module, x: Tensor) -> Tensor:
    """An RMSNorm module (`weight`, `eps`) applied to x through `rms_ln`."""
    return rms_ln(x, ln_weight(mod), mod.eps)


def linear(lin: nn.Module, x: Tensor, add: Tensor | None = None) -> Tensor:
    """lin(x) (+ add) as one BLAS call for a float nn.Linear without bias (its weight's transpose is the
    input-major matrix runtime/cpu_layout.py makes), else through the module."""
    w = getattr(lin, "weight", None)
    if type(lin) is not nn.Linear or lin.bias is not None or w.dtype != x.dtype:
        return lin(x) if add is None else add + lin(x)
    return torch.mm(x, w.t()) if add is None else torch.addmm(add, x, w.t())


_PERMS: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}


def rope_matrices(cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE at each row's position as a matrix: x * cos + rotate_half(x) * sin = x @ (diag(cos) + P * sin), P the
    rotate-half permutation. cos/sin [W, hd] -> [W, hd, hd] (one batched product a layer instead of five ops)."""
    hd = cos.shape[-1]
    key = (hd, cos.dtype, cos.device)
    perm = _PERMS.get(key)
    if perm is None:
        eye = torch.eye(hd, dtype=cos.dtype, device=cos.device)
        perm = _PERMS[key] = torch.cat((-eye[:, hd // 2:], eye[:, :hd // 2]), -1)   # rotate_half(x) = x @ perm
    r = perm * sin[:, None, :]
    r.diagonal(dim1=1, dim2=2).add_(cos)
    return r


def qk_norm_weight(a: nn.Module) -> Tensor:
    """The q-norm weight for each q head times the attention scale, then the k-norm weight for each k head [nh +
    nkv, hd]: one product after one norm over the rows' q and k heads, the scores then need no scaling."""
    return derived(a, "_qk_norm_scaled", (a.q_norm.weight, a.k_norm.weight),
                   lambda: torch.cat((a.q_norm.weight.detach().expand(a.nh, a.hd) * a.scale,
                                      a.k_norm.weight.detach().expand(a.nkv, a.hd))))


def qkv(a: nn.Module, h: Tensor, rot: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q (times the attention scale), k and v for the normed rows h [W, H] of attention module `a`, with RoPE as
    `rot` [W, hd, hd] (`rope_matrices`): -> q [W, nh, hd], k and v [W, nkv, hd]."""
    p = a.qkv(h) if a.has_qkv else torch.cat((a.q_proj(h), a.k_proj(h), a.v_proj(h)), -1)
    return split_qkv(p, a.nh, a.nkv, a.hd, a.q_norm.eps, qk_norm_weight(a), rot)


def split_qkv(p: Tensor, nh: int, nkv: int, hd: int, eps: float, qkn: Tensor, rot: Tensor
              ) -> tuple[Tensor, Tensor, Tensor]:
    """The rows' q/k/v projection p [W, (nh + 2 nkv) hd] -> q and k normed (weights `qkn`, `qk_norm_weight`) and
    rotated by `rot`, and v (`qkv`'s second half; runtime/models/cpu_plan.py calls it with its own tensors)."""
    W = p.shape[0]
    qk = rms_ln(p[:, :(nh + nkv) * hd].view(W, nh + nkv, hd), None, eps) * qkn
    qk = torch.bmm(qk, rot)
    return qk[:, :nh], qk[:, nh:], p[:, (nh + nkv) * hd:].view(W, nkv, hd)


def route(mlp: nn.Module, h: Tensor) -> tuple[Tensor, Tensor]:
    """`SparseMoe.route` for rows h [W, H] in fewer ops: with renormalisation, the softmax of the top-k logits
    (the same weights as the full softmax's top-k renormalised). -> weights [W, k] (h's dtype), expert ids."""
    return top_weights(linear(mlp.gate, h), mlp.top_k, mlp.norm_topk, h.dtype)


def top_weights(r: Tensor, top_k: int, norm_topk: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Router logits r [W, E] -> the top-k's weights (in `dtype`) and expert ids (`route`'s second half)."""
    if norm_topk:
        lw, idx = torch.topk(r, top_k, dim=-1)
        return torch.softmax(lw.float(), -1).to(dtype), idx
    w, idx = torch.topk(torch.softmax(r.float(), -1), top_k, dim=-1)
    return w.to(dtype), idx


def dense_experts(mlp: nn.Module, y: Tensor, w: Tensor, idx: Tensor, add: Tensor) -> Tensor:
    """add + `SparseMoe.dense` for rows y [W, H] routed (w, idx) with real expert ids: every expert of a small
    packed layer on every row in one product, each row's routing weights picking its experts, the residual added
    inside the down product (a padded row gets whatever its own routing gives; no real row reads it)."""
    T, E, inter = y.shape[0], mlp.n_exp, mlp.inter
    gu = torch.mm(y, mlp.dense_gu.t()).view(T, E, 2, inter)
    wd = torch.zeros(T, E, dtype=gu.dtype, device=y.device).scatter_(1, idx, w.to(gu.dtype))
    act = F.silu(gu[:, :, 0]) * gu[:, :, 1] * wd[:, :, None]
    return torch.addmm(add, act.view(T, E * inter), mlp.dense_down.t())


def routed_experts(mlp: nn.Module, y: Tensor, w: Tensor, idx: Tensor, add: Tensor) -> Tensor:
    """add + the routed experts of one row y [1, H] of a small packed layer (`SparseMoe.pack_dense`): each expert
    as one gate-and-up product (its rows are adjacent in the packed matrix), SiLU, and its down product with the
    routing weight and the running sum inside (addmm), in expert order. It reads k of the E experts where
    `dense_experts` reads them all, in about as many ops."""
    inter = mlp.inter
    return routed_rows(lambda e: (mlp.dense_gu[2 * inter * e:2 * inter * (e + 1)].t(),
                                  mlp.dense_down[:, inter * e:inter * (e + 1)].t()), inter, y, w, idx, add)


def routed_rows(expert: Callable[[int], tuple[Tensor, Tensor]], inter: int, y: Tensor, w: Tensor, idx: Tensor,
                add: Tensor) -> Tensor:
    """`routed_experts` with expert e's (gate+up [H, 2I], down [I, H]) matrices from `expert(e)`."""
    for e, we in sorted(zip(idx[0].tolist(), w[0].tolist(), strict=True)):
        gu_t, dn_t = expert(e)
        gu = torch.mm(y, gu_t)
        add = torch.addmm(add, F.silu(gu[:, :inter]) * gu[:, inter:], dn_t, alpha=we)
    return add
