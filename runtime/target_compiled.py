"""The target's fixed-width CPU step compiled ahead of time by AOTInductor (docs/models.md, "Compiled CPU steps").

Why: on a CPU a small model's step is paid per op and per dispatch, not per byte (docs/models.md, "Numerics"): the
bundled pack's eager one-row step spends most of its 1.8 ms between ops. AOTInductor turns the step into one C++
function (element-wise ops fused, no interpreter between them) in a package that loads in milliseconds.

The lossless promise holds because every window of a run goes through the same package at the engine's one width
(runtime/gpu/static_step.py): a row's bits depend on its token, its position and the cache only, never on the rows
beside it or where it sits in the window. The step keeps that as the eager CPU step does: every product has the
window's fixed shape, the window's K/V are written into the cache first (in place: AOTInductor writes a mutated
input where it lies), then each row's attention over keys 0..its position by the C++ attention op
(runtime/cpu_ops.py: scores, softmax and values in a fixed order a row). Where the op is not built: every row's
scores against keys 0..N-1 (N: the window's end rounded up to CHUNK, at least two chunks), the keys past a row's
position masked, one softmax, and the values in CHUNK-position chunks summed in chunk order
(tests/runtime/test_target_compiled.py checks padding and window position bit for bit). Its bits are inductor's and
the op's, not the eager step's: an engine runs every window of a run through one of them.

Two packages per model and cache: "one" (a target decoding alone: one row, its k experts by the experts op or
else gathered, its attention over keys 0..start by the attention op or else in one product each way, since a
one-row engine's rows never share a window) and "wide" (2..WIDE_MAX rows, the width a dynamic size called at the
engine's one width: each row's own k experts by the experts op, or else every expert on every row weighted by the
routing, as `SparseMoe.dense` does). The weights and the cache are inputs: a package depends only on the shapes
(`shape_of`), holds no checkpoint bytes, and is kept in the store under compiled/ (runtime/paths.py).

The cache needs room past its capacity (`spare_slots`): a window's padding rows are written past its real rows, and
the chunks read may pass the last position. The engine allocates it on the CPU.
"""

from __future__ import annotations

import time
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime import aoti, cpu_ops
from runtime.models.qwen3_moe import TargetOutput

CHUNK = 128          # the attention's values are summed in chunks of this many positions, fixed by position
WIDE_MAX = 16        # the most rows the "wide" package takes (the drafters' largest window)
MODES = ("one", "wide")
# which modes take the C++ attention op where it is loaded (docs/models.md, "The attention op")
_OP_MODES = {"one": True, "wide": True}
# and which take the C++ routed-experts op (runtime/cpu_ops.py `moe_rows`)
_MOE_OP_MODES = {"one": True, "wide": True}
MIN_CONTEXT = 128    # shorter caches leave the exporter no range of at least two chunks
# the compiled code's version, in every package key: bumped whenever `_Step` changes, so that an old package is
# rebuilt rather than loaded (the load check would catch a different result, not a slower one)
FORMAT = 6
# the step's products (q/k/v, o_proj, the experts, the vocabulary head) read bf16 copies of the weights where they
# are bf16 values (a bf16 checkpoint's: exact) and the C++ ops are loaded (docs/models.md, "bf16 weights"); False:
# the fp32 weights
W16 = True
# model -> its bf16 copies (`_copies`), made once and shared by the engine's packages
_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def spare_slots(capacity: int) -> int:
    """Cache slots past `capacity` the compiled step needs: a window's rows up to WIDE_MAX written from its start,
    its keys read in whole chunks, and one chunk more (a chunk count equal to the cache's would be a fixed size
    to the exporter)."""
    end = -(-(capacity + WIDE_MAX) // CHUNK) * CHUNK
    return end + CHUNK - capacity


def may_fit(geo, weight_bytes: int = 4) -> str | None:
    """Why a target of this geometry (runtime/models/target_config.py `TargetGeometry`) cannot run the compiled
    step, or None when it may: float weights, every layer sparse, each layer's experts small enough to be packed
    for the CPU (`SparseMoe.pack_dense`, runtime/models/layers.py). Setup asks before loading a model for it."""
    from runtime.models.layers import DENSE_EXPERT_BYTES

    if geo.quant != "bf16":
        return "the target's weights are quantized (the compiled step takes float weights)"
    if len(geo.sparse_layers) != geo.layers:
        return "the target has dense MLP layers"
    if 3 * geo.experts * geo.hidden * geo.moe_intermediate * weight_bytes > DENSE_EXPERT_BYTES:
        return "the target's experts are too large to pack for the compiled step"
    return None


def mode_for(width: int) -> str | None:
    """Which package serves steps of `width` rows (None: none does)."""
    return "one" if width == 1 else "wide" if 2 <= width <= WIDE_MAX else None


def fits(model, kv) -> str | None:
    """Why the compiled step cannot serve this model and cache now, or None when it can: a float cache on the CPU
    with `spare_slots`, every layer a float layer with packed experts served in place (`cpu_plan.plannable`), no
    routing recorded (its ids stay inside the package), a float vocabulary head."""
    from runtime.models import cpu_plan

    if kv.k.device.type != "cpu":
        return "not on a CPU"
    if kv.quant is not None:
        return "the KV cache is quantized"
    if kv.capacity < MIN_CONTEXT:
        return f"the context is under {MIN_CONTEXT} tokens"
    if kv.k.shape[3] - kv.capacity < spare_slots(kv.capacity) or kv.batch != 1:
        return "the KV cache has no room past its end for the compiled step"
    layers = model.model.layers
    if not all(cpu_plan.plannable(la) for la in layers):
        return "a layer is not a float layer with packed experts"
    if any(la.mlp.recorder is not None for la in layers):
        return "routing is being recorded"
    dt = layers[0].input_layernorm.weight.dtype
    head = model.lm_head
    if not cache_fits(kv.k.dtype, dt) or type(head) is not torch.nn.Linear or head.weight.dtype != dt \
            or head.bias is not None:
        return "the weights, the cache and the vocabulary head differ in dtype"
    return None


def cache_fits(cache: torch.dtype, weights: torch.dtype) -> bool:
    """Whether a compiled CPU step takes a cache of this dtype with weights of that one: the weights' own, or bf16
    beside fp32 weights (`[memory] kv_dtype = "bf16"`: half the bytes a token reads at long contexts; the attention
    op reads its values as the floats they are, docs/models.md "The attention op")."""
    return cache == weights or (weights == torch.float32 and cache == torch.bfloat16)


def _matrices(model) -> tuple[list[Tensor], list[tuple[Tensor, ...]]]:
    """The products' float weights as the step multiplies by them: the head [H, V] (x @ head), and per layer q/k/v
    [H, q + 2 kv], o_proj [q, H], the experts' gate/up [H, E * 2I] and down [E * I, H]."""
    from runtime.models import cpu_plan

    layers = []
    for la in model.model.layers:
        L = cpu_plan.layer_plan(la)
        wqkv = cpu_plan.stacked_qkv(L)
        layers.append((wqkv, L.wo, la.mlp.dense_gu.t(), la.mlp.dense_down.t()))
    return [model.lm_head.weight.t()], layers


def _copies(model) -> dict[str, Any] | None:
    """The bf16 copies of the step's weights (`W16`), made once per model: None where they would not be the same
    values (a weight that is not a bf16 value), the widths do not fit the ops (multiples of 64 for the dense
    products, 16 for the experts) or the ops are not loaded."""
    if not (W16 and cpu_ops.registered()):
        return None
    if model in _COPIES:
        return _COPIES[model]
    cfg = model.cfg
    la = model.model.layers[0]
    fit = fits_w16(cfg.hidden_size, la.self_attn.nh * la.self_attn.hd, la.self_attn.nkv * la.self_attn.hd,
                   cfg.vocab_size, la.mlp.inter)
    got = None
    if fit and la.input_layernorm.weight.dtype == torch.float32:
        heads, layers = _matrices(model)
        exact = all(torch.equal(w.to(torch.bfloat16).float(), w) for ws in [heads, *layers] for w in ws)
        if exact:
            got = {"head": cpu_ops.blocks16(heads[0]),
                   "layers": [(cpu_ops.blocks16(q), cpu_ops.blocks16(o), g.to(torch.bfloat16).contiguous(),
                               d.to(torch.bfloat16).contiguous()) for q, o, g, d in layers]}
    _COPIES[model] = got
    return got


def fits_w16(hidden: int, q_width: int, kv_width: int, vocab: int, inter: int) -> bool:
    """Whether the bf16 products take a model of these widths (the dense products' outputs in blocks of 64, the
    experts' widths multiples of 16)."""
    return all(n % 64 == 0 for n in (q_width + 2 * kv_width, hidden, vocab)) and hidden % 16 == 0 and inter % 16 == 0


def copies_bytes_for(geo) -> int:
    """What `_copies` would hold for a target of this geometry (runtime/models/target_config.py `TargetGeometry`):
    2 bytes a weight of the head, q/k/v, o_proj and every expert; 0 where the widths do not fit. The budget counts
    it for a compiled CPU step (a checkpoint whose weights are not bf16 values gets none: the budget is then
    above, never below, what the runtime holds)."""
    H, q, kv = geo.hidden, geo.heads * geo.head_dim, geo.kv_heads * geo.head_dim
    if not fits_w16(H, q, kv, geo.vocab, geo.moe_intermediate):
        return 0
    per_layer = H * (q + 2 * kv) + q * H + geo.experts * 3 * H * geo.moe_intermediate
    return 2 * (geo.vocab * H + geo.layers * per_layer)


def copies_nbytes(model) -> int:
    """What the bf16 copies hold (0 where there are none): memory_report adds them to target_dense_weights."""
    got = _COPIES.get(model)
    if not got:
        return 0
    return sum(t.numel() * t.element_size() for t in [got["head"], *(t for ws in got["layers"] for t in ws)])


def shape_of(model, kv, mode: str, taps: tuple[int, ...]) -> dict[str, Any]:
    """What the compiled code holds as constants: shapes, epsilons, RoPE's scale, the mode and the tapped layers."""
    cfg = model.cfg
    la = model.model.layers[0]
    a, mlp = la.self_attn, la.mlp
    return dict(mode=mode, H=cfg.hidden_size, V=cfg.vocab_size, L=len(model.model.layers), nh=a.nh, nkv=a.nkv,
                hd=a.hd, E=mlp.n_exp, inter=mlp.inter, k=mlp.top_k, norm_topk=bool(mlp.norm_topk),
                eps=float(la.input_layernorm.eps), qk_eps=float(a.q_norm.eps), out_eps=float(model.model.norm.eps),
                rscale=float(model.rotary.scale), dtype=str(la.input_layernorm.weight.dtype), kv=str(kv.k.dtype),
                capacity=int(kv.capacity), slots=int(kv.k.shape[3]), taps=list(taps),
                attn="op" if cpu_ops.registered() and _OP_MODES.get(mode) else "torch",
                moe="op" if _MOE_OP_MODES.get(mode) and cpu_ops.experts_fit(cfg.hidden_size, mlp.inter) else "torch",
                w16=_copies(model) is not None and bool(_MOE_OP_MODES.get(mode)))


def weights(model, mode: str) -> tuple[list[Tensor], list[Tensor]]:
    """The step's weight inputs (views of the model's tensors; q, k and v stacked when the model keeps them
    apart): the shared ones (embedding, final norm, head, RoPE's frequencies) and each layer's 9, in
    `_Step.forward`'s order."""
    from runtime.models import cpu_plan

    m = model
    w16 = _copies(m) if _MOE_OP_MODES.get(mode) else None
    glob = [m.model.embed_tokens.weight, m.model.norm.weight, m.lm_head.weight.t() if w16 is None else w16["head"],
            m.rotary.inv_freq.float()]
    per: list[Tensor] = []
    for i, la in enumerate(m.model.layers):
        L = cpu_plan.layer_plan(la)
        mlp = la.mlp
        H, E, inter = m.cfg.hidden_size, mlp.n_exp, mlp.inter
        wqkv = cpu_plan.stacked_qkv(L)
        if mode == "one":      # per expert: gate+up [E, H, 2I], down [E, I, H]
            gu, dn = mlp.dense_gu.view(E, 2 * inter, H).transpose(1, 2), mlp.dense_down.view(H, E, inter).permute(1, 2, 0)
        else:                  # every expert at once: [H, E * 2I], [E * I, H]
            gu, dn = mlp.dense_gu.t(), mlp.dense_down.t()
        wo = L.wo
        if w16 is not None:    # bf16: q/k/v and o_proj in blocks of 64 columns, the experts [H, E * 2I], [E * I, H]
            wqkv, wo, gu, dn = w16["layers"][i]
        # q-norm's weight carries the attention scale (cpu_rows.qk_norm_weight: [nh + nkv, hd])
        per += [la.input_layernorm.weight, wqkv, L.qkn[0], L.qkn[L.nh], wo, la.post_attention_layernorm.weight,
                L.router, gu, dn]
    return glob, per


class _Step(torch.nn.Module):
    """The step as a module for torch.export (no parameters: every tensor is an input). ids and pos [W] (pos -1: a
    padding row), st and ch views of a buffer whose lengths are start + 2 and the chunk count (sizes the exporter
    keeps symbolic), the caches [nkv, slots, hd] per layer (the window's K/V written in place)."""

    def __init__(self, shape: dict[str, Any]) -> None:
        super().__init__()
        self.s = shape

    def forward(self, ids: Tensor, pos: Tensor, st: Tensor, ch: Tensor, kcs: list[Tensor], vcs: list[Tensor],
                glob: list[Tensor], per: list[Tensor]) -> tuple[Tensor, ...]:
        s = self.s
        eps, nh, nkv, hd, Hd = s["eps"], s["nh"], s["nkv"], s["hd"], s["H"]
        W, grp = ids.shape[0], nh // nkv
        start = st.shape[0] - 2
        N = ch.shape[0] * CHUNK
        emb, out_norm, head, inv = glob
        seen = torch.where(pos >= 0, pos, 0)                         # a padding row: position 0, never written
        f = seen[:, None].float() * inv[None, :]
        ang = torch.cat((f, f), -1)
        cos, sin = (ang.cos() * s["rscale"]).to(emb.dtype), (ang.sin() * s["rscale"]).to(emb.dtype)

        def rope(t: Tensor) -> Tensor:                               # t [W, heads, hd]
            h2 = hd // 2
            return t * cos[:, None] + torch.cat((-t[..., h2:], t[..., :h2]), -1) * sin[:, None]

        def mm(a: Tensor, w: Tensor) -> Tensor:                    # a @ w, from bf16 blocks with `w16`
            return torch.ops.strata.rows16(a.contiguous(), w) if s["w16"] else a @ w

        hide = torch.arange(N, device=ids.device)[None, :] > seen[:, None]        # [W, N]: keys past a row
        x = emb[ids]
        tapped = []
        for i, (kc, vc) in enumerate(zip(kcs, vcs, strict=True)):
            ln1, wqkv, qn, kn, wo, ln2, wr, gu, dn = per[9 * i:9 * i + 9]
            p = mm(F.rms_norm(x, (Hd,), ln1, eps), wqkv)
            q, k, v = p.split((nh * hd, nkv * hd, nkv * hd), -1)
            q = rope(F.rms_norm(q.reshape(W, nh, hd), (hd,), qn, s["qk_eps"]))
            kt = rope(F.rms_norm(k.reshape(W, nkv, hd), (hd,), kn, s["qk_eps"])).transpose(0, 1)
            kc[:, start:start + W].copy_(kt)                  # padding rows too: past the real rows, unread (a bf16
            vc[:, start:start + W].copy_(v.reshape(W, nkv, hd).transpose(0, 1))      # cache: rounded here)
            qg = q.reshape(W, nkv, grp, hd).permute(1, 0, 2, 3).reshape(nkv, W * grp, hd)
            if s["attn"] == "op":     # each row over keys 0..its position, by the C++ op (runtime/cpu_ops.py)
                o = torch.ops.strata.window_attention(qg.contiguous(), kc, vc, seen, grp)
            elif s["mode"] == "one":  # one row: keys 0..start, one product each way (a row's bits need no window)
                pr = torch.softmax(torch.bmm(qg, kc[:, :start + 1].to(qg.dtype).transpose(1, 2)), -1)
                o = torch.bmm(pr, vc[:, :start + 1].to(qg.dtype))
            else:
                sc = torch.bmm(qg, kc[:, :N].to(qg.dtype).transpose(1, 2)).view(nkv, W, grp, N)
                sc = sc.masked_fill(hide[None, :, None, :], float("-inf")).view(nkv, W * grp, N)
                pr = torch.softmax(sc, -1).view(nkv, W * grp, N // CHUNK, CHUNK).transpose(1, 2)
                o = torch.matmul(pr, vc[:, :N].to(qg.dtype).reshape(nkv, N // CHUNK, CHUNK, hd)).sum(1)    # chunks
            x = x + mm(o.view(nkv, W, grp, hd).permute(1, 0, 2, 3).reshape(W, nh * hd), wo)
            h = F.rms_norm(x, (Hd,), ln2, eps)
            lg = h @ wr
            if s["norm_topk"]:
                lw, idx = torch.topk(lg, s["k"], -1)
                w = torch.softmax(lw.float(), -1).to(h.dtype)
            else:
                w, idx = torch.topk(torch.softmax(lg.float(), -1), s["k"], -1)
                w = w.to(h.dtype)
            inter = s["inter"]
            if s["w16"]:                                             # each row's k experts, bf16, by the C++ op
                x = x + torch.ops.strata.moe_rows(h.contiguous(), gu, dn, idx, w.contiguous(), inter)
            elif s["moe"] == "op" and s["mode"] == "one":           # the row's k experts, by the C++ op
                x = x + cpu_ops.moe_rows_per_expert(h, gu, dn, idx, w, inter)
            elif s["moe"] == "op":                                   # each row's k experts, by the C++ op
                x = x + torch.ops.strata.moe_rows(h.contiguous(), gu, dn, idx, w.contiguous(), inter)
            elif s["mode"] == "one":                                 # the row's k experts, gathered
                g2 = torch.bmm(h.expand(s["k"], 1, Hd), gu[idx[0]])
                y = torch.bmm(F.silu(g2[..., :inter]) * g2[..., inter:], dn[idx[0]])      # [k, 1, H]
                x = x + (y * w[0][:, None, None]).sum(0)
            else:                                                    # every expert on every row, weighted
                g2 = (h @ gu).view(W, s["E"], 2, inter)
                wd = torch.zeros(W, s["E"], dtype=h.dtype, device=h.device).scatter(1, idx, w)
                act = F.silu(g2[:, :, 0]) * g2[:, :, 1] * wd[:, :, None]
                x = x + act.reshape(W, s["E"] * inter) @ dn
            if i in s["taps"]:
                tapped.append(x)
        hidden = F.rms_norm(x, (Hd,), out_norm, s["out_eps"])
        logits = mm(hidden, head).float()
        if not s["taps"]:
            return logits, hidden
        return logits, hidden, torch.cat(_in_order(tapped, s["taps"]), -1)


def _in_order(tapped: list[Tensor], taps: list[int]) -> list[Tensor]:
    """The tapped layers' outputs (gathered in layer order) in the order `taps` names them."""
    order = sorted(taps)
    return [tapped[order.index(t)] for t in taps]


def key(model, kv, mode: str, taps: tuple[int, ...]) -> str:
    return aoti.key("target-step", shape_of(model, kv, mode, taps), FORMAT)


def package_path(model, kv, mode: str, taps: tuple[int, ...], root: Path) -> Path:
    return root / f"target-step-{mode}-{key(model, kv, mode, taps)}.pt2"


class _Inputs:
    """The flat inputs of a step call, made once per engine (views of the model's weights and the cache)."""

    def __init__(self, model, kv, mode: str) -> None:
        self.kcs = [kv.k[i, 0] for i in range(kv.k.shape[0])]
        self.vcs = [kv.v[i, 0] for i in range(kv.v.shape[0])]
        glob, per = weights(model, mode)
        self.fixed = [*self.kcs, *self.vcs, *glob, *per]
        self.buf = torch.zeros(kv.k.shape[3] + 2, dtype=torch.int8)

    def args(self, ids: Tensor, pos: Tensor, start: int, width: int) -> list[Tensor]:
        chunks = max(2, -(-(start + width) // CHUNK))
        return [ids, pos, self.buf[:start + 2], self.buf[:chunks], *self.fixed]


def _example(model, kv, mode: str, width: int, start: int) -> list[Tensor]:
    pos = torch.arange(start, start + width)
    return _Inputs(model, kv, mode).args(torch.zeros(width, dtype=torch.long), pos, start, width)


def _structured(flat: list[Tensor], layers: int) -> tuple:
    """`_Step.forward`'s arguments from the flat list `_Inputs.args` makes."""
    ids, pos, st, ch = flat[:4]
    rest = flat[4:]
    kcs, vcs, glob, per = rest[:layers], rest[layers:2 * layers], rest[2 * layers:2 * layers + 4], rest[2 * layers + 4:]
    return ids, pos, st, ch, kcs, vcs, glob, per


def build(model, kv, mode: str, taps: tuple[int, ...], path: Path) -> float:
    """Compile the step for this model, cache and mode into `path` (checked against the eager module on a probe
    before it is renamed into place). Returns the seconds it took; raises on any failure."""
    from torch.export import Dim

    t0 = time.perf_counter()
    shape = shape_of(model, kv, mode, taps)
    slots, L = shape["slots"], shape["L"]
    width = 1 if mode == "one" else 4
    args = _structured(_example(model, kv, mode, width, min(130, kv.capacity - width)), L)
    # start + 2 for every window start 0..capacity-1 (the one-row step reads keys 0..start, so start >= 1 there:
    # a decode window follows at least one prompt token, and a length of 1 would be a fixed size to the exporter)
    S = Dim("start2", min=3 if mode == "one" else 2, max=shape["capacity"] + 1)
    C = Dim("chunks", min=2, max=slots // CHUNK - 1)
    if mode == "one":
        rows = None
    else:
        R = Dim("rows", min=2, max=WIDE_MAX)
        rows = {0: R}
    dyn = (rows, rows, {0: S}, {0: C}, [None] * L, [None] * L, [None] * 4, [None] * len(args[7]))
    ep = aoti.export(_Step(shape), args, dyn)
    aoti.write_package(ep, path, lambda runner: check(model, kv, mode, taps, runner))
    return time.perf_counter() - t0


def check(model, kv, mode: str, taps: tuple[int, ...], runner) -> None:
    """Raise unless the compiled step computes what the eager module (`_Step` run by torch) does on a probe of
    random tokens over random cache entries, in a scratch cache of the same shape (the engine's is left alone).
    The compiled step's bits are its own, so the tolerance is fp32 rounding's over a few layers."""
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(0)
    shape = shape_of(model, kv, mode, taps)
    scratch = SimpleNamespace(k=torch.randn(kv.k.shape, generator=gen).to(kv.k.dtype),
                              v=torch.randn(kv.v.shape, generator=gen).to(kv.v.dtype))
    width, start = (1, 150) if mode == "one" else (3, 200)
    start = min(start, kv.capacity - width)
    inputs = _Inputs(model, scratch, mode)
    ids = torch.randint(0, shape["V"], (width,), generator=gen)
    real = max(1, width - 1)                     # a wide probe carries a padding row
    pos = torch.where(torch.arange(width) < real, start + torch.arange(width), -1)
    flat = inputs.args(ids, pos, start, width)
    keep = [t[:, start:start + width].clone() for t in inputs.kcs + inputs.vcs]
    with torch.no_grad():
        want = _Step(shape)(*_structured(flat, shape["L"]))
        for t, kp in zip(inputs.kcs + inputs.vcs, keep, strict=True):
            t[:, start:start + width] = kp
        got = runner(*flat)
    names = ("logits", "hidden", "taps")
    for name, a, b in zip(names, want, got, strict=False):
        tol = 1e-3 * (1 + float(a.abs().max()))
        if a.shape != b.shape or not torch.allclose(a.float(), b.float(), atol=tol, rtol=1e-3):
            diff = float((a.float() - b.float()).abs().max()) if a.shape == b.shape else float("inf")
            raise RuntimeError(f"the compiled target step's {name} differ from the eager step's (max |difference| "
                               f"{diff:.2e}).")


def load(model, kv, mode: str, taps: tuple[int, ...], root: Path) -> tuple[Any, str]:
    """(the package's loader, "") or (None, why not)."""
    if not aoti.wanted():
        return None, "switched off (STRATA_COMPILE=0)"
    why = fits(model, kv)
    if why is not None:
        return None, why
    cpu_ops.ensure(root, build=False)      # before the key is made: a package with the op names it
    return aoti.open_package(package_path(model, kv, mode, taps, root),
                             lambda runner: check(model, kv, mode, taps, runner), "the target step")


def attach(model, kv, taps: tuple[int, ...], modes: tuple[str, ...], root: Path, build_missing: bool
           ) -> tuple[dict[str, Any], str]:
    """The loaders of `modes` from the store under `root` (built first where missing and `build_missing`), and
    why any mode is not there ("" when all are)."""
    got: dict[str, Any] = {}
    why_all = ""
    if aoti.wanted() and fits(model, kv) is None:
        # the attention op first (its own library, built once per machine): where it cannot be had, the packages
        # take the torch-op attention and say nothing of it (the op is a speed-up, not a requirement)
        cpu_ops.ensure(root, build=build_missing)
    for mode in modes:
        ld, why = load(model, kv, mode, taps, root)
        if ld is None and build_missing and aoti.wanted() and fits(model, kv) is None:
            try:
                build(model, kv, mode, taps, package_path(model, kv, mode, taps, root))
            except Exception as exc:       # a compiler missing or failing: the eager step, and the reason
                what = "one-row" if mode == "one" else "wide"
                why = f"compiling the {what} step failed ({type(exc).__name__}: {str(exc).strip()[:200]})"
            else:
                ld, why = load(model, kv, mode, taps, root)
        if ld is not None:
            got[mode] = ld
        elif not why_all:
            why_all = why
    return got, why_all


class CompiledTargetStep:
    """A loaded package as the engine's fixed-width step (`StaticStep`'s contract: `accepts`, `__call__(window,
    kv, taps)` -> TargetOutput)."""

    part = None                 # no split-attention scratch (engine.memory_report reads it)

    def __init__(self, model, kv, width: int, loader, mode: str, taps: tuple[int, ...]) -> None:
        self.model, self.kv, self.width, self.taps = model, kv, int(width), tuple(taps)
        self.boxed = loader.boxed_run
        self.inputs = _Inputs(model, kv, mode)
        self.ids = torch.zeros(self.width, dtype=torch.long)
        self.ar = torch.arange(self.width)
        self.errors: list[str] = []
        self.replays = 0
        self.counters = [la.mlp for la in model.model.layers]

    def accepts(self, n: int, taps: tuple[int, ...]) -> bool:
        return 1 <= n <= self.width and (not taps or tuple(taps) == self.taps)

    @torch.no_grad()
    def __call__(self, window: Tensor, kv, taps: tuple[int, ...] = ()) -> TargetOutput:
        if kv is not self.kv:
            raise ValueError("this compiled step was built for another KV cache.")
        T, start = int(window.shape[1]), kv.length
        if not self.accepts(T, tuple(taps)):
            raise ValueError(f"window of {T} rows (taps {tuple(taps)}) does not fit the compiled step "
                             f"({self.width} rows, taps {self.taps}).")
        if start + T > kv.capacity:
            raise ValueError(f"{start + T} positions exceed the KV cache capacity {kv.capacity}; raise the context.")
        if start < 1:
            raise ValueError("the compiled step runs decode windows, which follow at least one prompt token.")
        if T == self.width and window.dtype == torch.long and window.stride(-1) == 1:    # a full window: no padding
            ids, pos = window[0], self.ar + start
        else:
            self.ids[:T] = window[0]
            self.ids[T:] = 0
            ids, pos = self.ids, torch.where(self.ar < T, start + self.ar, -1)
        out = self.boxed(self.inputs.args(ids, pos, start, self.width))
        self.replays += 1
        for mlp in self.counters:
            if mlp.counter is not None:
                mlp.counter(mlp.layer_idx, T)
        kv.length = start + T
        if T == self.width:
            tap_t = out[2][None] if taps and len(out) > 2 else None
            return TargetOutput(logits=out[0][None], hidden=out[1][None], taps=tap_t)
        tap_t = out[2][None, :T] if taps and len(out) > 2 else None
        return TargetOutput(logits=out[0][None, :T], hidden=out[1][None, :T], taps=tap_t)
