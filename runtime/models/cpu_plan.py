"""A decoder layer's CPU rows with its weights gathered once: the same ops on the same tensors as
runtime/models/cpu_rows.py (so the same bits), without the per-op Python around them.

Why: on a CPU a small model's step is paid per call (docs/models.md, "Numerics", CPU). The functions of cpu_rows.py
find their weights through modules, check their caches and slice the packed experts on every call; for the bundled
pack that bookkeeping cost nearly half the one-row step (2.28 -> 1.74 ms without it, docs/models.md). A `LayerPlan`
holds every tensor a layer's rows read (views and the few made ones, no copy of a weight), made once and remade
when a weight is replaced or changed in place (`ModelPlan`). Used by the CPU step
(runtime/gpu/static_step.py) and the MTP head's CPU rows (runtime/drafters/mtp.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from runtime.models import cpu_rows

# bumped whenever any module registers a parameter (a weight replaced by a new Parameter): `ModelPlan` then makes
# its plans again; a weight changed in place or re-pointed (`.data =`) shows in the tensors it holds
_EPOCH = [0]


def _registered(module: nn.Module, name: str, param: object) -> None:
    _EPOCH[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_registered)


class LayerPlan(NamedTuple):
    """What a planned layer's rows read: norms as `cpu_rows.rms_ln` weights ([2H], weight then zeros), every
    product's matrix input-major (the transpose of the module's weight, a view), and each expert's gate+up and down
    matrices as views of the packed ones (`SparseMoe.pack_dense`)."""
    ln1: Tensor
    eps1: float
    qkv: tuple[Tensor, ...]          # one stacked [H, (nh + 2 nkv) hd] matrix, or q's, k's and v's
    qkn: Tensor                       # q-norm weight times the attention scale per q head, then k-norm's [nh+nkv, hd]
    qk_eps: float
    nh: int
    nkv: int
    hd: int
    wo: Tensor
    ln2: Tensor
    eps2: float
    mlp: nn.Module                    # the SparseMoe (its recorder and counter are read at run time)
    router: Tensor
    top_k: int
    norm_topk: bool
    experts: tuple[tuple[Tensor, Tensor], ...]   # per expert (gate+up [H, 2I], down [I, H])
    inter: int
    sources: tuple[Tensor, ...]      # the weights it was made from (`ModelPlan` checks them)


def _plain(lin: nn.Module, dtype: torch.dtype) -> bool:
    return type(lin) is nn.Linear and lin.bias is None and lin.weight.dtype == dtype


def plannable(layer: nn.Module) -> bool:
    """Whether `layer_plan` serves this decoder layer: float products without bias in the model's dtype, and a
    SparseMoe whose experts are packed for the CPU and served in place (no offload pool)."""
    from runtime.models.layers import SparseMoe

    a, mlp = layer.self_attn, layer.mlp
    dt = layer.input_layernorm.weight.dtype
    if not isinstance(mlp, SparseMoe) or mlp.dense_gu is None or mlp.offload is not None:
        return False
    if mlp.dense_gu.dtype != dt or not _plain(a.o_proj, dt) or not _plain(mlp.gate, dt):
        return False
    if a.qkv_weight is not None:
        return a.qkv_weight.dtype == dt
    return getattr(a, "qkv_blocks", None) is None and all(_plain(p, dt) for p in (a.q_proj, a.k_proj, a.v_proj))


def layer_plan(layer: nn.Module) -> LayerPlan:
    """The layer's plan (kept on the layer, remade when any weight it reads changes); the layer must be
    `plannable`."""
    a, mlp = layer.self_attn, layer.mlp
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    lins = (a.qkv_weight,) if a.qkv_weight is not None else (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)
    sources = (n1.weight, *lins, a.q_norm.weight, a.k_norm.weight, a.o_proj.weight, n2.weight, mlp.gate.weight,
               mlp.dense_gu, mlp.dense_down)

    def make() -> LayerPlan:
        inter = mlp.inter
        experts = tuple((mlp.dense_gu[2 * inter * e:2 * inter * (e + 1)].t(),
                         mlp.dense_down[:, inter * e:inter * (e + 1)].t()) for e in range(mlp.n_exp))
        return LayerPlan(ln1=cpu_rows.ln_weight(n1), eps1=n1.eps,
                         qkv=tuple(w.t() for w in lins), qkn=cpu_rows.qk_norm_weight(a), qk_eps=a.q_norm.eps,
                         nh=a.nh, nkv=a.nkv, hd=a.hd, wo=a.o_proj.weight.t(), ln2=cpu_rows.ln_weight(n2),
                         eps2=n2.eps, mlp=mlp, router=mlp.gate.weight.t(), top_k=mlp.top_k,
                         norm_topk=mlp.norm_topk, experts=experts, inter=inter, sources=sources)

    return cpu_rows.derived(layer, "_cpu_plan", sources, make)


def stacked_qkv(L: LayerPlan) -> Tensor:
    """q/k/v as one [H, (nh + 2 nkv) hd] matrix (a copy only where the layer keeps them apart): what the compiled
    steps take."""
    return L.qkv[0] if len(L.qkv) == 1 else torch.cat(L.qkv, 1)


def qkv(L: LayerPlan, x: Tensor, rot: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`cpu_rows.qkv` of the input-normed rows of x [W, H]: q (times the scale) [W, nh, hd], k and v [W, nkv, hd]."""
    h = cpu_rows.rms_ln(x, L.ln1, L.eps1)
    p = torch.mm(h, L.qkv[0]) if len(L.qkv) == 1 else torch.cat([torch.mm(h, w) for w in L.qkv], -1)
    return cpu_rows.split_qkv(p, L.nh, L.nkv, L.hd, L.qk_eps, L.qkn, rot)


def route(L: LayerPlan, h: Tensor) -> tuple[Tensor, Tensor]:
    """`cpu_rows.route`: routing weights [W, k] in h's dtype and expert ids."""
    return cpu_rows.top_weights(torch.mm(h, L.router), L.top_k, L.norm_topk, h.dtype)


def routed(L: LayerPlan, y: Tensor, w: Tensor, idx: Tensor, add: Tensor) -> Tensor:
    """`cpu_rows.routed_experts`: add + one row y [1, H]'s k experts, in expert order."""
    return cpu_rows.routed_rows(L.experts.__getitem__, L.inter, y, w, idx, add)


class ModelPlan:
    """The plans of a stack of decoder layers, checked each step at the cost of a few reads per weight (its
    version and address) instead of a lookup through the modules: made again when any weight changed, was
    re-pointed or replaced, or a layer's experts moved to an offload pool. `get()` is None when a layer is not
    `plannable` (the caller takes the cpu_rows.py path; asked again next step, as packing may come later)."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self.layers = layers
        self.plans: list[LayerPlan] | None = None
        self.key: list[tuple[int, int]] = []
        self.epoch = -1

    def _key(self) -> list[tuple[int, int]]:
        return [(t.data_ptr(), t._version) for L in self.plans or () for t in L.sources]

    def get(self) -> list[LayerPlan] | None:
        if self.epoch == _EPOCH[0] and self.plans is not None and self._key() == self.key \
                and all(L.mlp.offload is None for L in self.plans):
            return self.plans
        self.epoch = _EPOCH[0]
        ok = all(plannable(la) for la in self.layers)
        self.plans = [layer_plan(la) for la in self.layers] if ok else None
        self.key = self._key()
        return self.plans


class RopeTable:
    """RoPE matrices (`cpu_rows.rope_matrices`) for a run of positions, made `span` positions at a time and sliced:
    a decode asks for one or a few new positions a step, each the same bits as made alone (cos/sin are elementwise
    in the position)."""

    def __init__(self, rotary: nn.Module, span: int = 64) -> None:
        self.rotary, self.span = rotary, span
        self.first, self.table = 0, None

    def get(self, first: int, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        t = self.table
        if t is None or t.dtype != dtype or not self.first <= first <= first + n <= self.first + t.shape[0]:
            pos = torch.arange(first, first + max(n, self.span), device=device)[None]
            cos, sin = self.rotary(pos, dtype)
            t = self.table = cpu_rows.rope_matrices(cos[0], sin[0])
            self.first = first
        o = first - self.first
        return t[o:o + n]
