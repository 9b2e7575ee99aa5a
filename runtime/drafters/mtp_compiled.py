"""The MTP head's CPU step compiled ahead of time by AOTInductor, for the chain's drafts (docs/models.md, "MTP
head", "Compiled, on a CPU").

Why: on a CPU the head's step is paid per op and per dispatch, not per byte (docs/models.md, "Numerics"), and the
chain runs block - 1 of them a window. AOTInductor turns the step into one C++ function (element-wise ops fused,
no interpreter or dispatcher between them) in a package file that loads in milliseconds; torch.compile's runtime
guards and wrappers would cost about a fifth of the step again. A draft needs no particular bits (the target's
verify decides every token), so the drafter may take inductor's rounding where the target step may not.

The step: rows (tokens [r], g [r, H]) at cache slots start.. (positions start + 1..), their K and V computed and
written into the cache in place (the cache goes in whole; the start comes as the length of a buffer view), the
last row alone attending over slots 0..its own, then o_proj, its routed experts, the norm, the
vocabulary product, and the greedy token with its probability (the floor's statistic). The committed rows that a
window's first step carries come first (their entries are all the chain needs of them), so one call serves them
and the first draft, as the eager chain's `last_only` forward does.
The weights are inputs, not constants: the package depends only on the shapes, and the checkpoint's tensors are
not copied into it. The row count and the start are dynamic sizes.

The package is built once per machine and shape (`build`, `strata-setup` does it before calibrating) and kept in
the store under compiled/ (`package_path`: the key names torch's version, the CPU's model and feature flags and
every shape and constant the code holds); `load` finds it or says why not, and the drafter stays eager without one.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime import aoti, cpu_ops, target_compiled
from runtime.drafters import head8

# the most rows one step takes: the pending committed rows of a window (at most the block) and the anchor
MAX_ROWS = 64
# False: the step's routed experts as torch ops even where the C++ experts op is loaded (runtime/cpu_ops.py)
MOE_OP = True
# False: the step's fc, q/k/v and o_proj as float products even where the C++ int8 product is loaded
DENSE8 = True
# False: the step's attention as torch ops even where the C++ attention op is loaded
ATTN_OP = True
# the chain's own KV cache in bf16 beside fp32 weights where the compiled step serves (`MTPDrafter.use_compiled`);
# False: the cache in the weights' dtype
BF16_CACHE = True


def wanted() -> bool:
    """Whether CPU MTP drafters use (and setup builds) the compiled step (runtime/aoti.py's switch)."""
    return aoti.wanted()


def fits(drafter) -> str | None:
    """Why the compiled step cannot serve this drafter, or None when it can: float weights in the cache's dtype (or a
    bf16 cache beside fp32 weights), packed experts served in place (`cpu_plan.plannable`), a float cache on the
    CPU, no routing recorder."""
    from runtime.models import cpu_plan

    layer = drafter.mtp.layers[0]
    kv = drafter.kv
    if kv.k.device.type != "cpu":
        return "not on a CPU"
    if kv.quant is not None:
        return "the drafter's KV cache is quantized"
    if kv.capacity < 2 * MAX_ROWS:
        return f"the context is under {2 * MAX_ROWS} tokens"
    if not cpu_plan.plannable(layer) or layer.mlp.recorder is not None or layer.mlp.counter is not None:
        return "the head's layer is not a float layer with packed experts"
    dt = layer.input_layernorm.weight.dtype
    if not target_compiled.cache_fits(kv.k.dtype, dt) or not isinstance(drafter.mtp.fc, torch.nn.Linear) \
            or drafter.mtp.fc.weight.dtype != dt:
        return "the head's weights and cache differ in dtype"
    head = drafter.model.lm_head
    if drafter.head8 is None and (not isinstance(head, torch.nn.Linear) or head.weight.dtype != dt):
        return "the vocabulary head is not a float matrix"
    return None


def dense8(drafter) -> bool:
    """Whether the step's fc, q/k/v and o_proj go through the C++ int8 product (runtime/cpu_ops.py) from int8
    copies of their rows: with the int8 head's op, an fp32 step and widths the op takes (multiples of 64). Why: a
    chained step rereads its layer's matrices (1.3 MB in fp32 on the bundled pack, past a core's L2 with the rest
    of the step); a quarter of the bytes cut the step by about a third there (docs/models.md, "MTP head")."""
    a = drafter.mtp.layers[0].self_attn
    H = drafter.model.cfg.hidden_size
    return DENSE8 and head_op(drafter) and _dtype(drafter) == torch.float32 and (a.nh * a.hd) % 64 == 0 \
        and H % 64 == 0


def _dtype(drafter) -> torch.dtype:
    """The step's activations' dtype: its weights' (the cache may be bf16 beside fp32 weights)."""
    return drafter.mtp.layers[0].input_layernorm.weight.dtype


def experts8(drafter) -> bool:
    """Whether the step's routed experts go through the C++ int8 experts op (runtime/cpu_ops.py `moe_rows8`) from
    int8 copies of their rows: with `dense8`, the experts op's switch, and widths that op takes (multiples of 32)."""
    mlp = drafter.mtp.layers[0].mlp
    return dense8(drafter) and MOE_OP and mlp.inter % 32 == 0


def _int8_weights(drafter, fc: Tensor, wqkv: Tensor, wo: Tensor, gu: Tensor, dn: Tensor) -> tuple[Tensor, ...]:
    """(fc, its scales, q/k/v, scales, o_proj, scales) as the int8 product takes them ([out, in] rows, fp32
    scales), then with `experts8` (gate/up [E * 2I, H], scales, down [E * H, I], scales), quantized once per drafter
    and kept on it (`MTPDrafter.dense8`)."""
    if drafter.dense8 is None:
        out: list[Tensor] = []
        rows = [w.t() for w in (fc, wqkv, wo)]          # x @ w: the rows are w's columns
        if experts8(drafter):                            # gu [E, H, 2I], dn [E, I, H]: each expert's output rows
            rows += [gu.transpose(1, 2).reshape(-1, gu.shape[1]), dn.transpose(1, 2).reshape(-1, dn.shape[1])]
        for w in rows:
            q, s = head8.quantize(w)
            out += [q, s.float()]
        drafter.dense8 = tuple(out)
    return drafter.dense8


def weights(drafter) -> tuple[Tensor, ...]:
    """The step's weight inputs, in `_Step.forward`'s order (views of the drafter's tensors, no copies; the int8
    copies of `dense8`, made once)."""
    from runtime.models import cpu_plan

    m, mtp = drafter.model, drafter.mtp
    layer = mtp.layers[0]
    L = cpu_plan.layer_plan(layer)
    mlp = layer.mlp
    H, E, inter = m.cfg.hidden_size, mlp.n_exp, mlp.inter
    wqkv = cpu_plan.stacked_qkv(L)
    head = drafter.head8 if drafter.head8 is not None else (m.lm_head.weight.t(), torch.ones(0))
    # q-norm's weight carries the attention scale, as the eager rows' (cpu_rows.qk_norm_weight: [nh + nkv, hd])
    qkn = L.qkn[0], L.qkn[L.nh]
    fc, wo = mtp.fc.weight.t(), L.wo
    gu, dn = mlp.dense_gu.view(E, 2 * inter, H).transpose(1, 2), mlp.dense_down.view(H, E, inter).permute(1, 2, 0)
    fc_s = qkv_s = wo_s = gu_s = dn_s = torch.ones(0)
    if dense8(drafter):
        q8 = _int8_weights(drafter, fc, wqkv, wo, gu, dn)
        fc, fc_s, wqkv, qkv_s, wo, wo_s = q8[:6]
        if experts8(drafter):
            gu, gu_s, dn, dn_s = q8[6:]
    return (m.model.embed_tokens.weight, mtp.pre_fc_norm_embedding.weight, mtp.pre_fc_norm_hidden.weight,
            fc, fc_s, layer.input_layernorm.weight, wqkv, qkv_s, qkn[0], qkn[1], wo, wo_s,
            layer.post_attention_layernorm.weight, L.router, gu, gu_s, dn, dn_s,
            mtp.norm.weight, m.rotary.inv_freq.float(), head[0], head[1])


def shape_of(drafter) -> dict[str, Any]:
    """What the compiled code holds as constants: shapes, norms' epsilons, RoPE's scale, the head's kind."""
    cfg = drafter.model.cfg
    layer = drafter.mtp.layers[0]
    a, mlp = layer.self_attn, layer.mlp
    return dict(H=cfg.hidden_size, V=cfg.vocab_size, nh=a.nh, nkv=a.nkv, hd=a.hd, E=mlp.n_exp, inter=mlp.inter,
                k=mlp.top_k, norm_topk=bool(mlp.norm_topk), eps=float(cfg.rms_norm_eps),
                qk_eps=float(a.q_norm.eps), rscale=float(drafter.model.rotary.scale),
                head8=drafter.head8 is not None, dtype=str(layer.input_layernorm.weight.dtype),
                kv=str(drafter.kv.k.dtype),
                capacity=int(drafter.kv.capacity), head_op=head_op(drafter),
                moe_op=MOE_OP and cpu_ops.experts_fit(cfg.hidden_size, mlp.inter), dense8=dense8(drafter),
                experts8=experts8(drafter), attn_op=attn_op(drafter))


def attn_op(drafter) -> bool:
    """Whether the step's attention goes through the C++ attention op (runtime/cpu_ops.py `window_attention`, its
    one row over slots 0..its own): where the ops are loaded, for fp32 weights with an fp32 or bf16 cache and a head
    size the op takes."""
    return ATTN_OP and cpu_ops.registered() and drafter.kv.k.dtype in (torch.float32, torch.bfloat16) and \
        _dtype(drafter) == torch.float32 and drafter.mtp.layers[0].self_attn.hd in (64, 128, 256)


def head_op(drafter) -> bool:
    """Whether the package's int8 head goes through the C++ op (runtime/cpu_ops.py: integer dot products from an
    int16 input) rather than torch's weight-only int8 kernel: where the ops are loaded and the head's width fits
    the op (a multiple of 64)."""
    return drafter.head8 is not None and head8.op_fits(drafter.model.cfg.hidden_size)


class _Step(torch.nn.Module):
    """The step as a module for torch.export (no parameters: every tensor is an input)."""

    def __init__(self, shape: dict[str, Any]) -> None:
        super().__init__()
        self.s = shape

    def forward(self, tok: Tensor, g: Tensor, st: Tensor, kc: Tensor, vc: Tensor, emb_w: Tensor, ne: Tensor,
                ng: Tensor, fc: Tensor, fc_s: Tensor, ln1: Tensor, wqkv: Tensor, qkv_s: Tensor, qn: Tensor,
                kn: Tensor, wo: Tensor, wo_s: Tensor, ln2: Tensor, wr: Tensor, gu: Tensor, gu_s: Tensor, dn: Tensor,
                dn_s: Tensor, norm: Tensor, inv: Tensor, head: Tensor, head_scale: Tensor
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        s = self.s
        eps, nh, nkv, hd = s["eps"], s["nh"], s["nkv"], s["hd"]
        r, Hd = g.shape
        start = st.shape[0] - 2               # the first row's cache slot (a length the exporter keeps symbolic)

        def lin(x: Tensor, w: Tensor, sc: Tensor) -> Tensor:    # x @ w, from int8 rows w [out, in] with `dense8`
            return torch.ops.strata.int8_head(x.contiguous(), w, sc) if s["dense8"] else x @ w

        e = F.rms_norm(emb_w[tok], (Hd,), ne, eps)
        x = lin(torch.cat((e, F.rms_norm(g, (Hd,), ng, eps)), -1), fc, fc_s)            # [r, H]
        pos = torch.arange(r, device=x.device) + (start + 1)
        f = pos[:, None].float() * inv[None, :]
        ang = torch.cat((f, f), -1)
        cos, sin = (ang.cos() * s["rscale"]).to(x.dtype), (ang.sin() * s["rscale"]).to(x.dtype)

        def rope(t: Tensor, c: Tensor, sn: Tensor) -> Tensor:            # t [rows, heads, hd], c/sn [rows, hd]
            h2 = hd // 2
            return t * c[:, None] + torch.cat((-t[..., h2:], t[..., :h2]), -1) * sn[:, None]

        p = lin(F.rms_norm(x, (Hd,), ln1, eps), wqkv, qkv_s)
        q, k, v = p.split((nh * hd, nkv * hd, nkv * hd), -1)
        # the rows' entries into the cache, in place (AOTInductor writes a mutated input where it lies)
        kc[:, start:start + r].copy_(rope(F.rms_norm(k.reshape(r, nkv, hd), (hd,), kn, s["qk_eps"]), cos, sin)
                                     .transpose(0, 1))
        vc[:, start:start + r].copy_(v.reshape(r, nkv, hd).transpose(0, 1))
        # the last row alone goes on: the rows before it are committed rows, wanted for their entries
        ql = rope(F.rms_norm(q[-1:].reshape(1, nh, hd), (hd,), qn, s["qk_eps"]), cos[-1:], sin[-1:])
        qg = ql.reshape(nkv, nh // nkv, hd)
        if s["attn_op"]:      # over slots 0..its own, by the C++ attention op (runtime/cpu_ops.py)
            o = torch.ops.strata.window_attention(qg.contiguous(), kc, vc, pos[-1:] - 1, nh // nkv)
        else:
            pr = torch.softmax(torch.bmm(qg, kc[:, :start + r].to(qg.dtype).transpose(1, 2)), -1)   # [nkv, grp, n]
            o = torch.bmm(pr, vc[:, :start + r].to(qg.dtype))
        x = x[-1:] + lin(o.reshape(1, nh * hd), wo, wo_s)
        h = F.rms_norm(x, (Hd,), ln2, eps)
        lg = h @ wr
        if s["norm_topk"]:
            lw, idx = torch.topk(lg, s["k"], -1)
            w = torch.softmax(lw, -1)
        else:
            w, idx = torch.topk(torch.softmax(lg, -1), s["k"], -1)
        if s["experts8"]:     # the row's k experts from int8 rows (runtime/cpu_ops.py)
            y = torch.ops.strata.moe_rows8(h.contiguous(), gu, gu_s, dn, dn_s, idx, w.contiguous(), s["inter"])
            hn = F.rms_norm(x + y, (Hd,), norm, eps)
        elif s["moe_op"]:     # the row's k experts by the C++ op (runtime/cpu_ops.py), from the packed layout
            hn = F.rms_norm(x + cpu_ops.moe_rows_per_expert(h, gu, dn, idx, w, s["inter"]), (Hd,), norm, eps)
        else:
            gu_ = torch.bmm(h.expand(s["k"], 1, Hd), gu[idx[0]])                          # [k, 1, 2I]
            gt, up = gu_.split(s["inter"], -1)
            y = torch.bmm(F.silu(gt) * up, dn[idx[0]])                                    # [k, 1, H]
            hn = F.rms_norm(x + (y * w[0][:, None, None]).sum(0), (Hd,), norm, eps)
        if s["head8"] and s["head_op"]:     # the token and its probability in the op, the logits in cache
            logits, tok, conf = torch.ops.strata.int8_head_top(hn.float(), head, head_scale)
            return hn, logits, tok, conf
        if s["head8"]:
            logits = torch._weight_int8pack_mm(hn.to(torch.bfloat16), head, head_scale).float()
        else:
            logits = (hn @ head).float()
        top, tok = logits.max(-1)                               # the greedy draft (the first of equals)
        conf = 1.0 / torch.exp(logits - top[:, None]).sum(-1)   # its probability at temperature 1: the floor's
        return hn, logits, tok, conf


def key(drafter) -> str:
    """The package's name (runtime/aoti.py `key`: torch, this CPU, `shape_of`)."""
    return aoti.key("mtp-step", shape_of(drafter), 8)


def package_path(drafter, root: Path) -> Path:
    return root / f"mtp-step-{key(drafter)}.pt2"


def _example(drafter, rows: int = 2, start: int = 8) -> tuple[Tensor, ...]:
    kv = drafter.kv
    H = drafter.model.cfg.hidden_size
    dt = _dtype(drafter)
    return (torch.zeros(rows, dtype=torch.long), torch.zeros(rows, H, dtype=dt), torch.zeros(start + 2,
            dtype=torch.int8), kv.k[0, 0], kv.v[0, 0], *weights(drafter))


def build(drafter, path: Path) -> float:
    """Compile the step for this drafter's shape into `path` (written under a temporary name, checked against the
    eager module on a probe, then renamed). Returns the seconds it took; raises on any failure."""
    from torch.export import Dim

    t0 = time.perf_counter()
    shape = shape_of(drafter)
    args = _example(drafter)
    R = Dim("rows", min=1, max=MAX_ROWS)
    S = Dim("start2", min=3, max=shape["capacity"] - MAX_ROWS + 2)
    dyn = ({0: R}, {0: R}, {0: S}) + (None,) * (len(args) - 3)
    ep = aoti.export(_Step(shape), args, dyn)
    aoti.write_package(ep, path, lambda runner: check(drafter, runner))
    return time.perf_counter() - t0


def check(drafter, runner) -> None:
    """Raise unless the compiled step agrees with the eager one (`_Step` run by torch) on a probe of random rows:
    a package from another torch or a miscompile must not serve drafts silently wrong (they would only cost
    acceptance, never output, but a user should hear of it)."""
    gen = torch.Generator().manual_seed(0)
    V, H = drafter.model.cfg.vocab_size, drafter.model.cfg.hidden_size
    kv = drafter.kv
    start = min(40, kv.capacity - MAX_ROWS)
    kc, vc = kv.k[0, 0], kv.v[0, 0]
    end = start + 3                            # the probe's rows write slots start..start + 2
    keep = kc[:, :end].clone(), vc[:, :end].clone()
    try:
        kc[:, :start] = torch.randn(kc[:, :start].shape, generator=gen).to(kc.dtype)
        vc[:, :start] = torch.randn(vc[:, :start].shape, generator=gen).to(vc.dtype)
        for rows in (1, 3):
            args = list(_example(drafter, rows, start))
            args[0] = torch.randint(0, V, (rows,), generator=gen)
            args[1] = torch.randn(rows, H, generator=gen).to(_dtype(drafter))
            with torch.no_grad():
                want = _Step(shape_of(drafter))(*args)
                want_kv = kc[:, start:start + rows].clone(), vc[:, start:start + rows].clone()
                kc[:, start:end], vc[:, start:end] = 0, 0
                got = runner(*args)
            got_kv = kc[:, start:start + rows], vc[:, start:start + rows]
            for name, a, b in zip(("hidden", "logits", "token", "confidence", "k", "v"), [*want, *want_kv],
                                  [*got, *got_kv], strict=True):
                if name == "token":         # a near tie may go either way: the logits' check covers it
                    continue
                tol = 1e-3 * (1 + float(a.abs().max()))
                if a.shape != b.shape or not torch.allclose(a.float(), b.float(), atol=tol, rtol=1e-3):
                    raise RuntimeError(f"the compiled MTP step's {name} differ from the eager step's "
                                       f"(max |difference| {float((a.float() - b.float()).abs().max()):.2e}).")
    finally:
        kc[:, :end], vc[:, :end] = keep


class CompiledStep:
    """A loaded package for one drafter: `__call__(tok, g, start)` -> (h [1, H], logits [1, V] fp32, the greedy
    token [1], its probability [1]); the rows' K and V are written into the drafter's cache at slots start.."""

    def __init__(self, drafter, loader, path: Path) -> None:
        # the loader called with the flat inputs (runtime/aoti.py `loader`)
        self.boxed, self.path = loader.boxed_run, path
        self.w = weights(drafter)
        self.kc, self.vc = drafter.kv.k[0, 0], drafter.kv.v[0, 0]
        self.dtype = _dtype(drafter)
        self.buf = torch.zeros(drafter.kv.capacity + 2, dtype=torch.int8)   # its views' lengths carry the start

    def __call__(self, tok: Tensor, g: Tensor, start: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        g = g if g.dtype == self.dtype else g.to(self.dtype)
        h, lg, t, conf = self.boxed([tok, g, self.buf[:start + 2], self.kc, self.vc, *self.w])
        return h, lg, t, conf


def load(drafter, root: Path) -> tuple[CompiledStep | None, str]:
    """(the drafter's compiled step from the package under `root`, "") or (None, why not)."""
    if not wanted():
        return None, "switched off (STRATA_COMPILE=0)"
    why = fits(drafter)
    if why is not None:
        return None, why
    cpu_ops.ensure(root, build=False)           # before the key is made: a package with the head op names it
    loader, why = aoti.open_package(package_path(drafter, root), lambda runner: check(drafter, runner), "the step")
    if loader is None:
        return None, why
    return CompiledStep(drafter, loader, package_path(drafter, root)), ""
