"""Run the Triton kernels under TRITON_INTERPRET=1 (CPU) against plain torch; exits 0 when all agree.

Run by tests/runtime/test_static_step.py in a subprocess (the interpreter must be chosen before triton loads);
`kernels_check.py attention` runs only the attention and KV-cache checks.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.runtime import interpreter as _interp  # noqa: E402

# The interpreter holds loaded scalars as 1-element arrays and then cannot use them as loop bounds (int() of a
# 1-d array); compiled Triton has no such limit. Index them by their single element instead.
_orig_patch = _interp._patch_lang_tensor


def _patch_tensor(tensor, scope):
    _orig_patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))


_interp._patch_lang_tensor = _patch_tensor

# The interpreter's tl.dot is NumPy's float32 matmul, i.e. the BLAS of the machine, and OpenBLAS on some CPUs (seen
# on an AMD EPYC with AVX-512, NumPy 2.4) gives a row other bits at line 32 of a 64-line tile than at line 0: the
# kernels' row invariance could not be checked there. Accumulate in float64 and round once: a row's product then
# depends on that row alone (a float64 rounding difference moves the float32 result with odds of about 1e-9).
_orig_dot = _interp.InterpreterBuilder.create_dot


def _row_invariant_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    if a.data.dtype in (np.float32, np.float16) and b.data.dtype == a.data.dtype and d.data.dtype == np.float32:
        prod = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(np.float32)
        return _interp.TensorHandle(prod + d.data, d.dtype.scalar)
    return _orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)


_interp.InterpreterBuilder.create_dot = _row_invariant_dot

# The interpreter patches triton.language for a kernel's launch (GridExecutor) and again on every call of a nested
# @triton.jit helper, each time scanning the language modules (inspect.getmembers): over a third of a K-quant
# check's time. Within one launch a helper whose module was patched already skips it (a helper from another module,
# such as triton.language.standard's, which reaches the builtins through triton.language.core, is patched once).
_orig_patch_lang = getattr(_interp, "_patch_lang", None)
_patched_modules: set[int] | None = None         # the modules patched in the running launch (None: no launch)


def _patch_lang_once(fn):
    global _patched_modules
    if _patched_modules is not None and id(fn.__globals__) in _patched_modules:
        return _interp._LangPatchScope()         # a helper's call: nothing to patch, nothing to restore
    scope = _orig_patch_lang(fn)
    if _patched_modules is not None:             # a helper's first call in this launch
        _patched_modules.add(id(fn.__globals__))
        return scope
    _patched_modules = {id(fn.__globals__)}      # a launch
    restore = scope.restore

    def _restore():
        global _patched_modules
        _patched_modules = None
        restore()
    scope.restore = _restore
    return scope


if _orig_patch_lang is not None and hasattr(_interp, "_LangPatchScope"):    # another Triton: left as it is
    _interp._patch_lang = _patch_lang_once

from runtime.formats.quant_linear import QuantLinear  # noqa: E402
from runtime.gpu import attention_kernels, dense_kernels, dflash2_kernels, kernels, moe_kernels  # noqa: E402
from runtime.kv import dequantize_q8_0, quantize_q8_0  # noqa: E402

KQ = ("q4_k", "q6_k", "q5_k", "q3_k", "q2_k")    # the K-quants (rows of 256 values)
SB = (*KQ, "iq4_xs")                             # every format of 256-value super-blocks


@contextlib.contextmanager
def plain():
    """The references' forwards in plain torch (runtime/gpu/kernels.py's switch off): a reference that ran the
    kernels under test would check them against themselves, and the interpreter takes minutes where torch takes
    milliseconds."""
    saved = kernels.ENABLED
    kernels.ENABLED = False
    try:
        yield
    finally:
        kernels.ENABLED = saved


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def check_moe(dt: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    T, H, NI, E, k = 5, 64, 32, 6, 2
    x = torch.randn(T, H, generator=g).to(dt)
    gu = (torch.randn(E, 2 * NI, H, generator=g) * 0.1).to(dt)
    dn = (torch.randn(E, H, NI, generator=g) * 0.1).to(dt)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    idx[2, 0] = idx[1, 0]          # several rows share an expert
    idx[3] = E                     # a padded row: no expert
    w = torch.rand(T, k, generator=g).to(dt)
    out = moe_kernels.moe_grouped(x, idx, w, gu, dn)
    ref = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            e = int(idx[t, j])
            if e >= E:
                continue
            gt, up = (x[t].float() @ gu[e].float().t()).chunk(2)
            ref[t] += float(w[t, j]) * ((F.silu(gt) * up) @ dn[e].float().t())
    assert rel(out, ref) < 3e-3, rel(out, ref)
    assert float(out[3].abs().max()) == 0.0
    # row invariance at a fixed width: row 0's bits do not depend on the other rows of its window
    x2, w2 = x.clone(), w.clone()
    x2[1:] = torch.randn(T - 1, H, generator=g).to(dt)
    w2[1:] = torch.rand(T - 1, k, generator=g).to(dt)
    idx2 = torch.stack([idx[0]] + [torch.randperm(E, generator=g)[:k] for _ in range(T - 1)])
    assert torch.equal(moe_kernels.moe_grouped(x2, idx2, w2, gu, dn)[0], out[0])
    # a one-row window takes the one-row kernels (moe_gemv.DECODE_GEMV_ONE_ROW): the same product
    one = moe_kernels.moe_grouped(x[:1], idx[:1], w[:1], gu, dn)
    assert rel(one, ref[:1]) < 3e-3, rel(one, ref[:1])
    # and without them the tl.dot tiles give a row alone the bits it has inside the window
    from runtime.gpu import moe_gemv

    saved = dict(moe_gemv.DECODE_GEMV_ONE_ROW)
    moe_gemv.DECODE_GEMV_ONE_ROW.clear()
    try:
        assert torch.equal(moe_kernels.moe_grouped(x[:1], idx[:1], w[:1], gu, dn)[0], out[0])
    finally:
        moe_gemv.DECODE_GEMV_ONE_ROW.update(saved)


def ref_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """fp32 softmax attention of each row r over cache rows 0..pos[r] (GQA heads repeated); zeros for pos < 0."""
    W, nh, hd = q.shape
    out = torch.zeros(W, nh, hd)
    for r in range(W):
        p = int(pos[r])
        if p < 0:
            continue
        kk = keys[:, : p + 1].float().repeat_interleave(nh // keys.shape[0], 0)
        vv = vals[:, : p + 1].float().repeat_interleave(nh // keys.shape[0], 0)
        att = torch.softmax((q[r].float()[:, None] @ kk.transpose(1, 2))[:, 0] * hd ** -0.5, -1)
        out[r] = (att[:, None] @ vv)[:, 0]
    return out


def cache(nkv: int, S: int, hd: int, dt: torch.dtype, q8: bool, g: torch.Generator):
    """A random cache: (kc, vc, ks, vs, K and V as attention sees them)."""
    k, v = torch.randn(nkv, S, hd, generator=g).to(dt), torch.randn(nkv, S, hd, generator=g).to(dt)
    if not q8:
        return k, v, None, None, k, v
    (kq, ks), (vq, vs) = quantize_q8_0(k), quantize_q8_0(v)
    return kq, vq, ks, vs, dequantize_q8_0(kq, ks, dt), dequantize_q8_0(vq, vs, dt)


def ref_moe(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, gu: torch.Tensor, dn: torch.Tensor,
            keep=lambda e: True) -> torch.Tensor:
    """The routed experts pair by pair in float32 (gu [E, 2I, H], dn [E, H, I] float); experts not kept add 0."""
    T, k = idx.shape
    E = gu.shape[0]
    ref = torch.zeros(T, dn.shape[1])
    for t in range(T):
        for j in range(k):
            e = int(idx[t, j])
            if e >= E or not keep(e):
                continue
            gt, up = (x[t].float() @ gu[e].float().t()).chunk(2)
            ref[t] += float(w[t, j]) * ((F.silu(gt) * up) @ dn[e].float().t())
    return ref


def expert_blocks(fmt: str, E: int, rows: int, cols: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked ggml blocks [E, rows, row_bytes] in `fmt` and gguf-py's float32 values of them [E, rows, cols]:
    real quantization for the formats Strata writes, random bytes with small scales for the K-quants."""
    from gguf.quants import dequantize as gguf_dequantize

    from runtime.formats.blocks import quantize
    from runtime.formats.registry import FORMATS

    f = FORMATS[fmt]
    if f.writable:
        raw = quantize((torch.randn(E * rows, cols, generator=g) * 0.1).numpy(), fmt)
    else:
        nb = cols // f.block_values
        b = torch.randint(0, 256, (E * rows, nb, f.block_bytes), generator=g, dtype=torch.uint8).numpy()
        d = (torch.randn(E * rows, nb, 2, generator=g).numpy() * 1e-4).astype(np.float16).view(np.uint8)
        at = {"q6_k": 208, "q3_k": 108, "q2_k": 80}.get(fmt, 0)     # d (and dmin after it: q4_k, q5_k, q2_k)
        n = 2 if fmt in ("q6_k", "q3_k", "iq4_xs", "iq4_nl") else 4
        b[..., at:at + n] = d.reshape(E * rows, nb, 4)[..., :n]
        raw = b.reshape(E * rows, -1)
    vals = gguf_dequantize(raw, f.ggml).reshape(E, rows, cols)
    return torch.from_numpy(np.ascontiguousarray(raw)).view(E, rows, -1), torch.from_numpy(vals.copy())


def moe_case(T: int, H: int, NI: int, E: int, k: int, seed: int, dt: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dt)
    gu = (torch.randn(E, 2 * NI, H, generator=g) * 0.1).to(dt)
    dn = (torch.randn(E, H, NI, generator=g) * 0.1).to(dt)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g).to(dt)
    return g, x, gu, dn, idx, w


def check_moe_slots(dt: torch.dtype) -> None:
    """Expert->slot table: resident experts through their slots, missed pairs listed and zero; a miss path that
    runs the missed experts from staging slots gives the all-resident bits (decode and prefill tilings)."""
    for T in (5, 70):
        g, x, gu, dn, idx, w = moe_case(T, 64, 32, 6, 2, 7, dt)
        if T == 5:
            idx[3] = 6                                   # a padded row
        full = moe_kernels.moe_grouped(x, idx, w, gu, dn)
        res = [3, 0, 2, 5]                               # slot -> expert: 4 slots, experts 1 and 4 missed
        slot = torch.full((6,), -1, dtype=torch.int32)
        slot[res] = torch.arange(4, dtype=torch.int32)
        gs, ds = gu[res].contiguous(), dn[res].contiguous()
        part = moe_kernels.moe_grouped(x, idx, w, gs, ds, slot=slot)
        ref = ref_moe(x, idx, w, gu, dn, keep=lambda e: e in (0, 2, 3, 5))
        assert rel(part, ref) < 3e-3, rel(part, ref)
        r = moe_kernels.group(idx, w, 6, slot)
        n = int(r.n_miss[0])
        got = r.miss[:n].tolist()
        want = [p for e in (1, 4) for p in range(T * 2) if int(idx.view(-1)[p]) == e]
        assert got == want and bool((r.miss[n:] == -1).all()), (got, want)
        # the miss path: experts 1 and 4 copied into two staging slots, the same kernels fill their rows
        stage = torch.full((6,), -1, dtype=torch.int32)
        stage[1], stage[4] = 0, 1
        gst, dst = gu[[1, 4]].contiguous(), dn[[1, 4]].contiguous()
        calls = []

        def miss_fn(xx, rr, y, gst=gst, dst=dst, stage=stage, calls=calls):
            calls.append(int(rr.n_miss[0]))
            moe_kernels.experts(xx, rr, gst, dst, slot=stage, y=y, zero_missing=False)

        filled = moe_kernels.moe_grouped(x, idx, w, gs, ds, slot=slot, miss_fn=miss_fn)
        assert calls == [n] and torch.equal(filled, full), (filled.float() - full.float()).abs().max()
        # the torch fallback stages the same way
        tfull = moe_kernels.moe_torch(x, idx, w, gu, dn)
        tpart = moe_kernels.moe_torch(x, idx, w, gs, ds, slot=slot)
        assert rel(tpart, ref) < 3e-3 and rel(tfull, ref_moe(x, idx, w, gu, dn)) < 3e-3


def check_route(dt: torch.dtype) -> None:
    """The one-launch router (softmax, top-k, grouping, miss list) against torch, with and without a slot table."""
    g = torch.Generator().manual_seed(11)
    W, E, k = 6, 8, 3
    logits = torch.randn(W, E, generator=g).to(dt)
    pos = torch.tensor([4, 5, 6, 7, -1, -1], dtype=torch.int32)
    slot = torch.tensor([0, 1, -1, 2, -1, 3, 4, -1], dtype=torch.int32)
    for sl in (None, slot):
        r = moe_kernels.route(logits, pos, k, True, slot=sl)
        p = torch.softmax(logits.float(), -1)
        wv, iv = torch.topk(p, k, -1)
        wv = wv / wv.sum(-1, keepdim=True)
        assert torch.equal(r.idx[:4].long(), iv[:4]) and bool((r.idx[4:] == E).all())
        assert torch.allclose(r.w[:4], wv[:4], atol=1e-3)
        ref = moe_kernels.group(r.idx, r.w, E, sl)
        for a, b in zip(r[2:], ref[2:], strict=True):
            assert torch.equal(a, b), (a, b)


@contextlib.contextmanager
def window_tiles():
    """One-row windows on the tiles of wider ones (moe_gemv.DECODE_GEMV_ONE_ROW emptied): the engine keeps one step
    width, so only within a width must a row's bits not depend on the other rows; across widths they may differ."""
    from runtime.gpu import moe_gemv

    saved = dict(moe_gemv.DECODE_GEMV_ONE_ROW)
    moe_gemv.DECODE_GEMV_ONE_ROW.clear()
    try:
        yield
    finally:
        moe_gemv.DECODE_GEMV_ONE_ROW.update(saved)


def check_moe_quant(dt: torch.dtype, only: tuple[str, ...] = ()) -> None:
    """Experts as ggml blocks, dequantized in the kernels: every format, decode and prefill tilings, with a slot
    table, against float32 math on gguf-py's values."""
    E, k = 4, 2
    # (gate_up's format, down's format, H, I): K-quants need rows of 256 values; Q4_K_M files mix Q4_K and Q6_K,
    # Q5_K_M files Q5_K and Q6_K; Q3_K, Q2_K and the IQ4 formats (no GEMV tiles: the tl.dot kernels at every width)
    for fg, fd, H, NI in (("q8_0", "q8_0", 64, 32), ("q5_0", "q5_0", 64, 32), ("q4_0", "q4_0", 64, 32),
                          ("q4_k", "q8_0", 256, 32), ("q8_0", "q6_k", 32, 256), ("q5_k", "q6_k", 256, 256),
                          ("q3_k", "q2_k", 256, 256), ("iq4_xs", "iq4_nl", 256, 64)):
        if only and fg not in only:
            continue
        fmt = (fg, fd)
        g = torch.Generator().manual_seed(3)
        gub, guf = expert_blocks(fg, E, 2 * NI, H, g)
        dnb, dnf = expert_blocks(fd, E, H, NI, g)
        w_rows = 2 if fg in SB or fd in SB else 3      # super-block rows take the interpreter seconds a pair
        for T in ((w_rows, 66) if fg in ("q4_0", "q4_k", "q5_k", "q3_k") else (w_rows,)):
            x = torch.randn(T, H, generator=g).to(dt)
            idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
            idx[0] = torch.tensor([1, 0])    # the slot table below: row 0 on a missed expert (1) and a resident one (0)
            w = torch.rand(T, k, generator=g).to(dt)
            ref = ref_moe(x, idx, w, guf, dnf)
            out = moe_kernels.moe_grouped(x, idx, w, gub, dnb, fmt=fmt)
            tol = 3e-3 if dt == torch.float32 else 1e-2
            assert rel(out, ref) < tol, (fmt, T, rel(out, ref))
            tor = moe_kernels.moe_torch(x, idx, w, gub, dnb, fmt=fmt)
            assert rel(tor, ref) < tol, (fmt, T, rel(tor, ref))
            if T == w_rows:
                with window_tiles():       # the window's own tiles for a row alone too: then its bits are the same
                    one = moe_kernels.moe_grouped(x[:1], idx[:1], w[:1], gub, dnb, fmt=fmt)
                assert torch.equal(one[0], out[0])             # row-invariant
                slot = torch.tensor([1, -1, 0, -1], dtype=torch.int32)
                part = moe_kernels.moe_grouped(x, idx, w, gub[[2, 0]].contiguous(), dnb[[2, 0]].contiguous(),
                                               fmt=fmt, slot=slot)
                pref = ref_moe(x, idx, w, guf, dnf, keep=lambda e: e in (0, 2))
                assert rel(part, pref) < tol, (fmt, rel(part, pref))


def check_moe_row(dt: torch.dtype) -> None:
    """runtime/gpu/moe_row.py (the one-row MoE half in one launch; here its three phases as three launches) against
    the four launches it replaces and against float32 math: the same experts, weights and output to rounding."""
    from runtime.gpu import dense_kernels, moe_gemv, moe_kernels, moe_row

    g = torch.Generator().manual_seed(11)
    E, H, NI, K = 9, 84, 36, 3          # 9 experts over 4 programs (several router rows a program); tails
    gu = (torch.randn(E, 2 * NI, H, generator=g) * 0.1).to(dt)
    dn = (torch.randn(E, H, NI, generator=g) * 0.1).to(dt)
    wr = (torch.randn(E, H, generator=g) * 0.3).to(dt)
    nw = (torch.rand(H, generator=g) + 0.5).to(dt)
    bar = moe_row.Barrier(torch.device("cpu"))
    for seed, p in ((0, 3), (1, 7), (2, -1)):
        x = torch.randn(1, H, generator=torch.Generator().manual_seed(seed)).to(dt)
        d = (torch.randn(1, H, generator=g) * 0.5).to(dt)
        pos = torch.tensor([p], dtype=torch.int32)
        xo, hn, lg = dense_kernels.norm_one_row(x, d, nw, 1e-6, wr, "router")
        r = moe_kernels.route(lg, pos, K, True)
        ship = moe_kernels.moe_routed(hn, xo, r, gu, dn)
        xs = x.float() + d.float()
        hf = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.float()
        ref = xs.clone()
        pr = (hf @ wr.float().T).softmax(-1)
        w, i = pr.topk(K, -1)
        w = w / w.sum(-1, keepdim=True)
        if p >= 0:
            for j in range(K):
                gg, uu = (gu[i[0, j]].float() @ hf[0]).split(NI)
                ref[0] += w[0, j] * (dn[i[0, j]].float() @ (F.silu(gg) * uu))
        for tile in ({"RU": 4, "RD": 2}, {"RU": 8, "RD": 8, "PRE3": 0, "ST2": 1, "ST3": 1}, {"RU": 1, "RD": 1}):
            out, idx, wt = moe_row.moe_row(x, d, nw, 1e-6, wr, pos, gu, dn, K, True, bar, tile)
            assert out.dtype == dt and out.shape == (1, H)
            assert torch.equal(idx, r.idx), (tile, idx, r.idx)
            if p >= 0:
                assert torch.allclose(wt, r.w, rtol=1e-5, atol=1e-6), (tile, wt, r.w)
                assert rel(out, ship) < 2e-3 and rel(out, ref) < 3e-3, (tile, dt, rel(out, ship), rel(out, ref))
            else:                       # a padding row: no expert, the output is x + d as rounded
                assert torch.equal(idx, torch.full((1, K), E, dtype=torch.int32)) and torch.equal(out, ship), tile
    del moe_gemv
    # 32-value block experts (down rows of 3 blocks: a pass's power-of-two cover has a tail); the interpreter is
    # slow, so one dtype
    if dt != torch.float32:
        return
    E, H, NI, K = 4, 32, 96, 2
    wr = (torch.randn(E, H, generator=g) * 0.3).to(dt)
    nw = (torch.rand(H, generator=g) + 0.5).to(dt)
    for fmt in moe_row.BLOCK_FORMATS:
        gub, guf = expert_blocks(fmt, E, 2 * NI, H, g)
        dnb, dnf = expert_blocks(fmt, E, H, NI, g)
        x = torch.randn(1, H, generator=g).to(dt)
        d = (torch.randn(1, H, generator=g) * 0.5).to(dt)
        pos = torch.tensor([4], dtype=torch.int32)
        xo, hn, lg = dense_kernels.norm_one_row(x, d, nw, 1e-6, wr, "router")
        r = moe_kernels.route(lg, pos, K, True)
        ship = moe_kernels.moe_routed(hn, xo, r, gub, dnb, fmt=fmt)
        ref = xo.float() + ref_moe(hn, r.idx.long(), r.w, guf, dnf)
        for tile in ({"RU": 1, "RD": 8},) if fmt == "q8_0" else ({},):
            out, idx, wt = moe_row.moe_row(x, d, nw, 1e-6, wr, pos, gub, dnb, K, True, bar, tile, fmt=fmt)
            assert torch.equal(idx, r.idx), (fmt, tile)
            assert rel(out, ship) < 2e-3 and rel(out, ref) < 3e-3, (fmt, tile, dt, rel(out, ship), rel(out, ref))
    # a padding row of block experts: no expert, x + d exactly, whatever the unwritten activations hold
    torch.empty(1 << 16).fill_(float("nan"))           # freed memory the next allocations may reuse
    out, idx, _ = moe_row.moe_row(x, d, nw, 1e-6, wr, torch.tensor([-1], dtype=torch.int32), gub, dnb, K, True, bar,
                                  fmt=fmt)
    assert torch.equal(idx, torch.full((1, K), E, dtype=torch.int32)) and torch.equal(out, (x + d).to(dt)), out


def check_fused_step_moe_row() -> None:
    """The fused one-row step with its MoE half in one launch (moe_row.ENABLED) against the plain forward."""
    from runtime.gpu import moe_row

    calls = []
    orig = moe_row.moe_row

    def spy(*a, **k):
        calls.append(1)
        return orig(*a, **k)
    moe_row.ENABLED, moe_row.moe_row = True, spy
    try:
        check_fused_step(None, width=1)
    finally:
        moe_row.ENABLED, moe_row.moe_row = False, orig
    assert calls, "the one-row step did not take moe_row"


# the partials row by row; by column blocks (CB) that a down step of 8 rows fills half at a time, summed in
# passes of 8 rows; by column blocks from 2 pairs a program
SPLIT_TEST_TILES = ({"RS": 16, "KC": 16, "BO": 16, "ST": 1, "RB": 8, "num_warps": 4, "sum_warps": 4},
                    {"RS": 4, "KC": 32, "BO": 8, "ST": 2, "ACC": 1, "CB": 1, "RB": 16, "RC": 8, "num_warps": 2,
                     "sum_warps": 1},
                    {"RS": 8, "KC": 32, "BO": 16, "ST": 2, "PP": 2, "CB": 1, "RB": 4, "num_warps": 4,
                     "sum_warps": 8})


def check_moe_split(dt: torch.dtype) -> None:
    """runtime/gpu/moe_split.py (the one-row expert MLP split over its intermediate) against the shipped two launches
    (gate/up, then down + top-k sum + residual) and float32 math: intermediates that the slice tiles (36 rows of 16:
    a tail; of 4: none), 2 pairs a program over 3 pairs (the last group's second pair padding), a padding row (no
    expert: the residual as it is), tiles that do not divide the row refused."""
    from runtime.gpu import moe_gemv, moe_split

    g = torch.Generator().manual_seed(12)
    E, H, NI, K = 6, 64, 36, 3
    gu = (torch.randn(E, 2 * NI, H, generator=g) * 0.1).to(dt)
    dn = (torch.randn(E, H, NI, generator=g) * 0.1).to(dt)
    saved = dict(moe_gemv.DECODE_GEMV_ONE_ROW)
    moe_gemv.DECODE_GEMV_ONE_ROW["bf16"] = "u1d32"
    try:
        for seed in range(3):
            gs = torch.Generator().manual_seed(seed)
            x = torch.randn(1, H, generator=gs).to(dt)
            res = torch.randn(1, H, generator=gs).to(dt)
            idx = torch.randperm(E, generator=gs)[:K][None].to(torch.int32)
            if seed == 2:
                idx[0, 1] = E                    # a padding pair adds nothing
            w = torch.rand(1, K, generator=gs)
            r = moe_kernels.group(idx, w, E, None)
            ship = moe_kernels.moe_routed(x, res, r, gu, dn)
            ref = res.float() + ref_moe(x, idx.long(), w, gu.float(), dn.float())
            for tile in SPLIT_TEST_TILES:
                out = moe_split.ffn_row(x, r.se, r.order, r.w.reshape(-1), gu, dn, res, K, tile)
                assert out.dtype == dt and out.shape == (1, H)
                assert rel(out, ship) < 2e-3 and rel(out, ref) < 3e-3, (tile, dt, rel(out, ship), rel(out, ref))
                moe_split.TILE = tile            # the one-row path takes it
                try:
                    assert torch.equal(moe_kernels.moe_routed(x, res, r, gu, dn), out), tile
                finally:
                    moe_split.TILE = None
        pad = moe_kernels.group(torch.full((1, K), E, dtype=torch.int32), torch.ones(1, K), E, None)
        out = moe_split.ffn_row(x, pad.se, pad.order, pad.w.reshape(-1), gu, dn, res, K, SPLIT_TEST_TILES[0])
        assert torch.equal(out, res), "a row of padding pairs must come out as its residual"
        try:
            moe_split.ffn_row(x, r.se, r.order, r.w.reshape(-1), gu, dn, res, K, {**SPLIT_TEST_TILES[0], "KC": 48})
            raise AssertionError("a gate/up step of 48 values over rows of 64 was not refused")
        except ValueError as err:
            assert "divides" in str(err), err
    finally:
        moe_gemv.DECODE_GEMV_ONE_ROW.clear()
        moe_gemv.DECODE_GEMV_ONE_ROW.update(saved)


def check_fused_step_moe_split() -> None:
    """The fused one-row step with its experts split over the intermediate (moe_split.TILE) against the plain
    forward."""
    from runtime.gpu import moe_split

    calls = []
    orig = moe_split.ffn_row

    def spy(*a, **k):
        calls.append(1)
        return orig(*a, **k)
    moe_split.TILE, moe_split.ffn_row = SPLIT_TEST_TILES[0], spy
    try:
        check_fused_step(None, width=1)
    finally:
        moe_split.TILE, moe_split.ffn_row = None, orig
    assert calls, "the one-row step did not take moe_split"


def check_moe_gemv(half: int | None = None) -> None:
    """The decode-window GEMV kernels (runtime/gpu/moe_gemv.py): every variant on Q4_0 or Q8_0, and a test-only
    variant with odd tiles (rows past N, a step shorter than a row, two window rows per pass) on every format,
    against float32 math on gguf-py's values; a row alone has the bits it has in the window (rows sharing an expert
    too); a slot table leaves missed pairs zero, and a miss path through the same kernels gives the all-resident
    bits. half 0 or 1: every other case (two processes, so the two CI cores share the work)."""
    from runtime.gpu import moe_gemv

    saved = dict(moe_gemv.DECODE_GEMV)
    saved_one = dict(moe_gemv.DECODE_GEMV_ONE_ROW)
    moe_gemv.DECODE_GEMV_ONE_ROW.clear()     # one variant at every width here: a row alone == the row in a window
    moe_gemv.GEMV_VARIANTS["_odd"] = {"BN_UP": 64, "BN_DOWN": 64, "KV": 64, "MB": 2, "PF": 1, "J": 2, "num_warps": 4,
                                      "num_stages": 1}
    # 32-value block rows in one step: down rows of 3 blocks (a 4-block tile, the tail's scale zero), gate/up rows
    # past N (96 rows in tiles of 64)
    one = {"ONE": 1, "KV": 4096, "MB": 1, "PF": 0, "num_stages": 1, "EARLY": 1}
    moe_gemv.GEMV_VARIANTS["_one_blk"] = {**one, "BN_UP": 64, "BN_DOWN": 8, "J": 2, "num_warps": 4}
    moe_gemv.GEMV_VARIANTS["_one_blk1"] = {**one, "BN_UP": 4, "BN_DOWN": 16, "J": 1, "num_warps": 2}
    try:
        E, k, T4 = 5, 2, 4
        # the pairs decode uses, every other variant once (the format alternates), the odd one on every format
        cases = [(v, f) for f, v in saved.items() if v is not None and f in ("q4_0", "q8_0", "q5_0")]
        rest = [v for v in moe_gemv.GEMV_VARIANTS if not v.startswith("_") and v not in {c[0] for c in cases}
                and not any(moe_gemv.GEMV_VARIANTS[v].get(o) for o in ("ONE", "ONE_UP", "ONE_DOWN"))]  # below
        # tuning candidates no table ships (bench arms) only with STRATA_CHECK_OFF_PATHS=1: a candidate joins the
        # default run once a table names it (CI's two cores have no time for the interpreter on all of them)
        if not os.environ.get("STRATA_CHECK_OFF_PATHS"):
            rest = [v for v in rest if v in saved.values()]
        for i, v in enumerate(rest):       # Q4_0 or Q8_0, or Q4_K for the tiles only it has
            fmt = next((f for f in (("q4_0", "q8_0")[i % 2], "q4_k") if not moe_gemv.refuses(f, moe_gemv.GEMV_VARIANTS[v])),
                       None)
            if fmt:
                cases.append((v, fmt))
        # the odd tiles on one format of each row code (float, 32-value blocks, K-quant super-blocks) by default;
        # on the others (whose shipped tiles run below, the same row code) only with STRATA_CHECK_OFF_PATHS=1: each
        # takes the interpreter up to half a minute, and CI has two cores
        every = bool(os.environ.get("STRATA_CHECK_OFF_PATHS"))
        cases += [("_odd", f) for f in ("bf16", "q4_0", "q4_k") + (("q8_0", "q5_0", "q6_k", "q5_k") if every else ())]
        cases += [("n8j2np", "q5_k")]        # Q5_K's shipped tile (DECODE_GEMV), its qh words read on every row
        if every:
            cases += [("_odd", "q3_k"), ("_odd", "q2_k")]      # their own code (`_rows23`), then their shipped tiles
        # Q2_K gate/up and Q3_K down on their shipped tiles in one case (check_moe_quant has them the other way round):
        # the format code of each in both roles
        cases += [(None, ("q2_k", "q3_k"))]
        cases += [("_odd", "iq4_xs")] if every else [(saved["iq4_xs"], "iq4_xs")]   # the table lookup (`_rowsiq`)
        cases += [("_odd", "iq4_nl"), ("u4d8k2np", "iq4_nl")]     # Q4_0's blocks, levels looked up (`_dot32`)
        cases += [("_one_blk", "q4_0"), ("_one_blk1", "q8_0")]
        for n, (var, fmt) in enumerate(cases):
            if half is not None and n % 2 != half:
                continue
            # a variant no table ships (a tuning candidate) runs at a smaller shape, without the slot checks: the
            # interpreter runs every program in turn, and CI has two cores; var None: the formats' shipped variants
            shipped = var is None or var.startswith("_") or var in saved.values()
            fg, fd = (fmt, fmt) if isinstance(fmt, str) else fmt
            sb = fg in SB
            H, NI = (256, 256) if sb else (40, 24) if fmt == "bf16" else (64, 96 if shipped else 32)
            g = torch.Generator().manual_seed(20 + n)
            if fmt == "bf16":             # rows of 40 and 24 values: steps of 16 with a masked tail
                gub, dnb = (torch.randn(E, 2 * NI, H, generator=g) * 0.1), (torch.randn(E, H, NI, generator=g) * 0.1)
                guf, dnf = gub, dnb
            else:
                gub, guf = expert_blocks(fg, E, 2 * NI, H, g)
                dnb, dnf = expert_blocks(fd, E, H, NI, g)
            T = 3 if sb else T4           # super-block rows take the interpreter seconds a pair: three rows do
            x = torch.randn(T, H, generator=g)
            idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
            idx[2, 1] = idx[0, 0] if idx[2, 0] != idx[0, 0] else idx[0, 1]     # rows 0 and 2 share an expert
            w = torch.rand(T, k, generator=g)
            f = None if fmt == "bf16" else fmt
            moe_gemv.DECODE_GEMV.update({fg: var or saved[fg], fd: var or saved[fd]})
            out = moe_kernels.moe_grouped(x, idx, w, gub, dnb, fmt=f)
            assert rel(out, ref_moe(x, idx, w, guf, dnf)) < 3e-3, (var, fmt, rel(out, ref_moe(x, idx, w, guf, dnf)))
            for i in ((2,) if sb else (0, 2)):
                one = moe_kernels.moe_grouped(x[i:i + 1], idx[i:i + 1], w[i:i + 1], gub, dnb, fmt=f)
                assert torch.equal(one[0], out[i]), (var, fmt, i)
            if sb or not shipped or (var not in ("_odd", "_one_blk") and fmt == "q8_0"):
                continue
            res = [2, 0, 4]                              # slot -> expert; experts 1 and 3 missed
            slot = torch.full((E,), -1, dtype=torch.int32)
            slot[res] = torch.arange(3, dtype=torch.int32)
            gs, ds = gub[res].contiguous(), dnb[res].contiguous()
            part = moe_kernels.moe_grouped(x, idx, w, gs, ds, fmt=f, slot=slot)
            assert rel(part, ref_moe(x, idx, w, guf, dnf, keep=lambda e: e in (2, 0, 4))) < 3e-3, (
                var, fmt, rel(part, ref_moe(x, idx, w, guf, dnf, keep=lambda e: e in (2, 0, 4))), idx.tolist())
            stage = torch.full((E,), -1, dtype=torch.int32)
            stage[1], stage[3] = 0, 1
            gst, dst = gub[[1, 3]].contiguous(), dnb[[1, 3]].contiguous()

            def miss_fn(xx, rr, y, gst=gst, dst=dst, stage=stage, f=f):
                moe_kernels.experts(xx, rr, gst, dst, fmt=f, slot=stage, y=y, zero_missing=False)

            filled = moe_kernels.moe_grouped(x, idx, w, gs, ds, fmt=f, slot=slot, miss_fn=miss_fn)
            assert torch.equal(filled, out), (var, fmt)
    finally:
        for v in ("_odd", "_one_blk", "_one_blk1"):
            del moe_gemv.GEMV_VARIANTS[v]
        moe_gemv.DECODE_GEMV.clear()
        moe_gemv.DECODE_GEMV.update(saved)
        moe_gemv.DECODE_GEMV_ONE_ROW.update(saved_one)


def check_dequant() -> None:
    """The kernels' in-register dequantizer equals gguf-py bit for bit (every format, random blocks)."""
    for fmt in ("q8_0", "q5_0", "q4_0", "q6_k", "q4_k", "q5_k", "q3_k", "q2_k", "iq4_xs", "iq4_nl"):
        g = torch.Generator().manual_seed(5)
        blocks, vals = expert_blocks(fmt, 1, 40, 512, g)
        # the shipped tile (16 groups: Q4_K and Q5_K by whole super-blocks), one group a program (through `_dq16`, the
        # tile before), and 64 groups, more than a 512-value row has (the kernel takes 32)
        for tile in (None, {"BN": 32, "G": 1, "num_warps": 4}, {"BN": 64, "G": 64, "num_warps": 8}):
            got = moe_kernels.dequantize(blocks[0], fmt, tile=tile)
            assert torch.equal(got.view(torch.int32), vals[0].view(torch.int32)), (fmt, tile)


def check_moe_prefill(dt: torch.dtype) -> None:
    """The prefill tiling (tiles of BM rows of one expert) against the pair loop; torch._grouped_mm's path too."""
    g, x, gu, dn, idx, w = moe_case(150, 64, 32, 6, 2, 9, dt)
    ref = ref_moe(x, idx, w, gu, dn)
    out = moe_kernels.moe_grouped(x, idx, w, gu, dn)
    tol = 3e-3 if dt == torch.float32 else 1e-2
    assert rel(out, ref) < tol, rel(out, ref)
    if hasattr(torch, "_grouped_mm"):
        r = moe_kernels.group(idx, w, 6)
        gm = moe_kernels.combine(moe_kernels.experts_grouped_mm(x, r, gu, dn), r.idx, 6, None, dt)
        assert rel(gm, ref) < tol, rel(gm, ref)


def check_fused_step_quant() -> None:
    """The fused fixed-width step with Q8_0 experts against the plain forward (whose MoE is the torch fallback)."""
    import tempfile

    from runtime.formats.blocks import quantize
    from runtime.loading import load_target
    from tests.runtime.tiny import make_tiny_target

    with tempfile.TemporaryDirectory() as d:
        model = load_target(make_tiny_target(d, seed=5, scale=2.0, moe_inter=32))
    for layer in model.model.layers:
        mlp = layer.mlp
        mlp.stack_experts()
        E, two_i, H = mlp.gate_up.shape
        gu = quantize(mlp.gate_up.reshape(-1, H).numpy(), "q8_0")
        dn = quantize(mlp.down.reshape(E * H, -1).numpy(), "q8_0")
        mlp.bind_blocks(torch.from_numpy(gu).view(E, two_i, -1), torch.from_numpy(dn).view(E, H, -1), "q8_0")
    _fused_step_matches_forward(model, "q8_0")


def _fused_step_matches_forward(model, label: str) -> None:
    """The fused width-4 step (no graph) against the plain forward, on a 6-token prompt then windows of 1 and 3;
    then the one-row step (its own kernels: dense_kernels.QUANT_ONE_ROW for a block-format o_proj) on one more."""
    from runtime.gpu import dense_kernels
    from runtime.gpu.static_step import StaticStep
    from runtime.kv import KVCache

    c = model.cfg
    kv_a, kv_b = (KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 40) for _ in range(2))
    prompt = torch.tensor([[5, 9, 11, 2, 7, 30]])
    seen: list[str] = []
    one_row = dense_kernels.quant_one_row

    def spy(x, mod, role):
        y = one_row(x, mod, role)
        if y is not None:
            seen.append(role)
        return y
    with torch.no_grad():
        with plain():
            model(prompt, kv=kv_a)
            model(prompt, kv=kv_b)
        dense_kernels.quant_one_row = spy
        try:
            for width, wins in ((4, ([[12]], [[3, 4, 5]])), (1, ([[8]],))):
                step = StaticStep(model, kv_b, width=width, graph=False)
                assert step.fused
                for win in wins:
                    wt = torch.tensor(win)
                    with plain():
                        ref = model(wt, kv=kv_a, taps=(1,))
                    got = step(wt, kv_b, (1,))
                    err = (got.logits - ref.logits).abs().max()
                    assert torch.allclose(got.logits, ref.logits, atol=2e-4, rtol=0), (label, width, err)
                    assert step.fused and not step.errors, (label, width, step.errors)    # no fallback
        finally:
            dense_kernels.quant_one_row = one_row
    fmt = getattr(model.model.layers[0].self_attn.o_proj, "qtype", None)
    assert ("o_proj" in seen) == ((fmt, "o_proj") in dense_kernels.QUANT_ONE_ROW), (label, seen)


def check_fused_step_gguf() -> None:
    """A quantized GGUF target as runtime/loading_gguf.py builds it (q/k/v stacked as one block matrix, o_proj,
    lm_head and token_embd as blocks, the experts as block stacks) through the fused step, against the plain
    forward (the torch fallbacks), for Q8_0 and Q4_0."""
    import tempfile

    from runtime.formats.quant_linear import QuantEmbedding
    from runtime.loading_gguf import load_target_gguf
    from setup_wizard.convert_target import convert_target
    from tests.setup_wizard.target_gguf_helpers import make_bpe_target

    for q in ("q8_0", "q4_0"):
        with tempfile.TemporaryDirectory() as d:
            src = make_bpe_target(d, seed=2, mtp=False)
            model = load_target_gguf(convert_target(src, q, Path(d) / "out" / "model.gguf").path)
        assert isinstance(model.model.embed_tokens, QuantEmbedding)
        _fused_step_matches_forward(model, q)
        assert model.model.layers[0].self_attn.qkv_blocks is not None      # the step used the stacked blocks


def check_attention(dt: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    for q8 in (False, True):
        nh, nkv, hd, S, W = 4, 2, 32 if q8 else 16, 80, 4
        kc, vc, ks, vs, _, _ = cache(nkv, S, hd, dt, q8, g)
        kn = torch.randn(W, nkv, hd, generator=g).to(dt)
        vn = torch.randn(W, nkv, hd, generator=g).to(dt)
        pos = torch.tensor([70, 71, 72, -1], dtype=torch.int32)
        before = kc.clone()
        attention_kernels.kv_write(kn, vn, kc, vc, pos, ks, vs)
        if q8:
            assert torch.equal(kc[:, 71], quantize_q8_0(kn[1])[0]) and torch.equal(ks[:, 72], quantize_q8_0(kn[2])[1])
            assert torch.equal(vc[:, 72], quantize_q8_0(vn[2])[0]) and torch.equal(vs[:, 70], quantize_q8_0(vn[0])[1])
            keys, vals = dequantize_q8_0(kc, ks, dt), dequantize_q8_0(vc, vs, dt)
        else:
            assert torch.equal(kc[:, 71], kn[1]) and torch.equal(vc[:, 72], vn[2])
            keys, vals = kc, vc
        assert torch.equal(kc[:, 73:], before[:, 73:]) and torch.equal(kc[:, :70], before[:, :70])  # pos -1: nothing
        q = torch.randn(W, nh, hd, generator=g).to(dt)
        o = attention_kernels.attention(q, kc, vc, pos, hd ** -0.5, ks=ks, vs=vs)
        ref = ref_attention(q, keys, vals, pos)
        for r in range(3):
            assert rel(o[r], ref[r]) < 3e-3, (q8, r, rel(o[r], ref[r]))
        assert float(o[3].abs().max()) == 0.0


def check_split_attention(dt: torch.dtype) -> None:
    """The split attention over several context chunks: equal to the reference and to the unsplit attention (one
    chunk) up to rounding; and a row's bits do not depend on the window width, the row's place in the window, the
    other rows, or the cache capacity (docs/models.md, "Numerics"). Two layouts fixed by position (the real
    KV_TIERS would only make the interpreter slower): chunks of 128 with the default row block (a window in one
    program), and four tiers of 16, 32, 64 and 128 positions with row blocks of 4 rows (a window over 2 and 4
    programs)."""
    _check_split_attention(dt, 128, None)
    saved = attention_kernels.ROW_TILE, attention_kernels.ROW_TILE_Q8
    attention_kernels.ROW_TILE = attention_kernels.ROW_TILE_Q8 = 8
    try:
        # four tiers: 16 on [0, 32), 32 on [32, 64), 64 on [64, 192), 128 beyond
        _check_split_attention(dt, 128, (16, 32, 32, 64, 64, 192, 128))
    finally:
        attention_kernels.ROW_TILE, attention_kernels.ROW_TILE_Q8 = saved


def _check_split_attention(dt: torch.dtype, C: int, tiers: tuple[int, ...] | None) -> None:
    g = torch.Generator().manual_seed(4)
    nh, nkv, hd = 4, 2, 64
    S = 3 * C + 40
    lay = {"chunk": C} if tiers is None else {"tiers": tiers}
    for q8 in (False, True):
        kc, vc, ks, vs, keys, vals = cache(nkv, S, hd, dt, q8, g)
        pos = torch.tensor([S - 1, 2 * C - 1, C, C - 1, 5, 2 * C + 17, 0, -1], dtype=torch.int32)
        W = pos.shape[0]
        q = torch.randn(W, nh, hd, generator=g).to(dt)

        def att(qq, pp, k=kc, v=vc, a=ks, b=vs, **kw):
            return attention_kernels.attention(qq, k, v, pp, hd ** -0.5, ks=a, vs=b, **(kw or lay))

        o = att(q, pos)
        ref = ref_attention(q, keys, vals, pos)
        tol = 1e-5 if dt == torch.float32 else 3e-3
        for r in range(W - 1):
            assert rel(o[r], ref[r]) < tol, (q8, r, rel(o[r], ref[r]))
        assert float(o[-1].abs().max()) == 0.0
        unsplit = att(q, pos, chunk=4 * C)
        assert rel(o[:-1], unsplit[:-1]) < tol, rel(o[:-1], unsplit[:-1])
        if tiers is None:
            assert torch.equal(o[3], unsplit[3]) and torch.equal(o[4], unsplit[4])    # one chunk: the same walk
        for r in (0, 3, 7):          # alone (W = 1): the last position, a chunk's last, padding
            assert torch.equal(att(q[r:r + 1], pos[r:r + 1])[0], o[r]), (q8, r)
        perm = torch.tensor([5, 2, 7, 0, 6, 1, 4, 3])                            # other places, other neighbours
        assert torch.equal(att(q[perm], pos[perm]), o[perm])
        wide = torch.cat([q, q[:3].flip(0), torch.randn(5, nh, hd, generator=g).to(dt)])   # W = 16
        wpos = torch.cat([pos, pos[:3].flip(0), torch.tensor([S - 2, 3, 300, -1, C + 1], dtype=torch.int32)])
        ow = att(wide, wpos)
        assert torch.equal(ow[:W], o) and torch.equal(ow[W:W + 3], o[:3].flip(0))
        # a larger cache holding the same rows: same bits (the chunk is a constant, not chosen from the capacity)
        extra = cache(nkv, 2 * C, hd, dt, q8, g)
        big = [torch.cat([a, b], 1) if a is not None else None for a, b in zip((kc, vc, ks, vs), extra[:4],
                                                                                strict=True)]
        assert torch.equal(att(q, pos, *big), o)
        # programs with no chunk waiting and loading their queries before they end (SPLIT_EXIT_EARLY off): the same
        # bits on the larger cache (more programs than chunks at these positions); one layout and dtype, as the
        # interpreter is slow
        if tiers is None and dt == torch.float32:        # 6 programs a head, 4 chunks at these positions
            attention_kernels.SPLIT_EXIT_EARLY = not attention_kernels.SPLIT_EXIT_EARLY
            try:
                assert torch.equal(att(q, pos, *big), o)
            finally:
                attention_kernels.SPLIT_EXIT_EARLY = not attention_kernels.SPLIT_EXIT_EARLY
        if q8:                       # the q8_0 tile loaded a step ahead or a tile at a time: the same bits
            attention_kernels.Q8_PREFETCH = not attention_kernels.Q8_PREFETCH
            try:
                assert torch.equal(att(q, pos), o)
            finally:
                attention_kernels.Q8_PREFETCH = not attention_kernels.Q8_PREFETCH
            saved_cvt = attention_kernels.Q8_CVT     # codes made floats through 2^23's bits: the same values
            attention_kernels.Q8_CVT = 1
            try:
                assert torch.equal(att(q, pos), o)
            finally:
                attention_kernels.Q8_CVT = saved_cvt


def check_kv_q8(dt: torch.dtype) -> None:
    """q8_0 writes: the torch quantizer is GGUF's Q8_0 bit for bit; qkv_post writes the quantization of the K/V it
    would write in the compute dtype; the prefill's dequantization kernel equals the torch one bit for bit."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-6, 3, 64)[:, None]
    x[3] = 0.0
    x[4, :32] = 0.5                                                          # ties round away from zero
    qv, sc = quantize_q8_0(x)
    blocks = np.concatenate([sc.numpy().view(np.uint8).reshape(64, 3, 2),
                             qv.numpy().view(np.uint8).reshape(64, 3, 32)], -1).reshape(64, -1)
    assert np.array_equal(blocks, quantize(x.numpy(), GGMLQuantizationType.Q8_0))
    nh, nkv, hd, S, W = 4, 2, 64, 24, 3
    qkv = torch.randn(W, (nh + 2 * nkv) * hd, generator=g).to(dt)
    qw, kw = (1 + 0.1 * torch.randn(hd, generator=g)).to(dt), (1 + 0.1 * torch.randn(hd, generator=g)).to(dt)
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    pos = torch.tensor([7, -1, 20], dtype=torch.int32)
    kc, vc = torch.zeros(nkv, S, hd, dtype=dt), torch.zeros(nkv, S, hd, dtype=dt)
    q_ref = attention_kernels.qkv_post(qkv, qw, kw, inv, 1.0, pos, kc, vc, nh, nkv, hd, 1e-6)
    kq, vq = torch.zeros(nkv, S, hd, dtype=torch.int8), torch.zeros(nkv, S, hd, dtype=torch.int8)
    ks, vs = torch.zeros(nkv, S, hd // 32, dtype=torch.float16), torch.zeros(nkv, S, hd // 32, dtype=torch.float16)
    q = attention_kernels.qkv_post(qkv, qw, kw, inv, 1.0, pos, kq, vq, nh, nkv, hd, 1e-6, ks=ks, vs=vs)
    assert torch.equal(q, q_ref)
    for cq, cs, cf in ((kq, ks, kc), (vq, vs, vc)):
        want_q, want_s = quantize_q8_0(cf)
        assert torch.equal(cq, want_q) and torch.equal(cs, want_s)
        assert int(cs[:, [7, 20]].ne(0).sum()) > 0 and int(cs.ne(0).sum(1).ne(0).sum()) > 0
        assert torch.equal(cs[:, [i for i in range(S) if i not in (7, 20)]], torch.zeros(nkv, S - 2, hd // 32,
                                                                                           dtype=torch.float16))
        out = torch.empty(nkv, 21, hd, dtype=dt)
        attention_kernels.dequant_q8(cq, cs, out)
        assert torch.equal(out, dequantize_q8_0(cq[:, :21], cs[:, :21], dt))


def check_dense_step_q8() -> None:
    """The fixed-width step with a q8_0 cache (Triton kv_write + split attention; dense MLP layers, so no MoE
    kernel) equals the plain forward over the same q8_0 cache, and greedy decoding through it is unchanged by the
    window width."""
    import tempfile

    from runtime.gpu.static_step import StaticStep
    from runtime.kv import KVCache
    from runtime.loading import load_target
    from tests.runtime.tiny import make_tiny_target

    with tempfile.TemporaryDirectory() as d:
        model = load_target(make_tiny_target(d, seed=6, scale=2.0, head_dim=32, mlp_only_layers=(0, 1, 2),
                                             mtp=False))
    c = model.cfg

    def kv(cap: int = 40) -> KVCache:
        return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, cap, quant="q8_0")

    kv_a, kv_b = kv(), kv()
    prompt = torch.tensor([[5, 9, 11, 2, 7, 30]])
    with torch.no_grad():
        with plain():
            model(prompt, kv=kv_a)
            model(prompt, kv=kv_b)
        step = StaticStep(model, kv_b, width=4, graph=False)
        assert step.use_kernels and not step.fused
        for win in ([[12]], [[3, 4, 5]], [[40, 41, 42, 43]]):
            w = torch.tensor(win)
            with plain():
                ref = model(w, kv=kv_a, taps=(1,))
            got = step(w, kv_b, (1,))
            assert torch.allclose(got.logits, ref.logits, atol=2e-4, rtol=0), (got.logits - ref.logits).abs().max()
            kv_a.rollback(kv_a.length - 1)
            kv_b.rollback(kv_b.length - 1)
        assert step.use_kernels and not step.errors, step.errors     # the kernels ran, no fallback
        assert torch.equal(kv_a.k[:, :, :, :kv_a.length], kv_b.k[:, :, :, :kv_b.length]) or \
            (kv_a.k[:, :, :, :kv_a.length].int() - kv_b.k[:, :, :, :kv_b.length].int()).abs().max() <= 1
    from runtime.speculative import generate_ids

    outs = []
    for width in (1, 4):
        cache_ = kv(64)
        outs.append(generate_ids(model, cache_, [5, 6, 7, 8, 9, 10, 3], max_new_tokens=12, stop_ids=set(),
                                 step=StaticStep(model, cache_, width=width, graph=False)).token_ids)
    assert outs[0] == outs[1], outs


def check_gemv_one_step(dt: torch.dtype) -> None:
    """The one-step float tiles of the GEMV kernel (moe_gemv "one*" variants: a program's whole weight tile in one
    load, EARLY where allowed): experts with rows of 40 and 24 values (tails masked), two rows sharing an expert
    (the tile serves both), a missed expert's rows zero under a slot table, a row alone == the row in the window;
    dense rows through `gemv` and `one_row`."""
    from runtime.gpu import moe_gemv

    saved = dict(moe_gemv.DECODE_GEMV)
    saved_one = dict(moe_gemv.DECODE_GEMV_ONE_ROW)
    moe_gemv.DECODE_GEMV_ONE_ROW.clear()
    try:
        E, k, T, H, NI = 5, 2, 4, 40, 24
        g = torch.Generator().manual_seed(41)
        gu, dn = (torch.randn(E, 2 * NI, H, generator=g) * 0.1).to(dt), (torch.randn(E, H, NI, generator=g) * 0.1).to(dt)
        x = torch.randn(T, H, generator=g).to(dt)
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        idx[2, 1] = idx[0, 0] if idx[2, 0] != idx[0, 0] else idx[0, 1]
        w = torch.rand(T, k, generator=g)
        for var in ("one4x16", "one2x8", "one_d1"):
            assert moe_gemv.chunk(H, "bf16", moe_gemv.GEMV_VARIANTS[var]["KV"], True) == 64
            moe_gemv.DECODE_GEMV["bf16"] = var
            out = moe_kernels.moe_grouped(x, idx, w, gu, dn)
            assert rel(out, ref_moe(x, idx, w, gu.float(), dn.float())) < 3e-3, (var, dt)
            for i in (0, 2):
                one = moe_kernels.moe_grouped(x[i:i + 1], idx[i:i + 1], w[i:i + 1], gu, dn)
                assert torch.equal(one[0], out[i]), (var, i)
            slot = torch.full((E,), -1, dtype=torch.int32)
            res = [2, 0, 4]
            slot[res] = torch.arange(3, dtype=torch.int32)
            part = moe_kernels.moe_grouped(x, idx, w, gu[res].contiguous(), dn[res].contiguous(), slot=slot)
            ref = ref_moe(x, idx, w, gu.float(), dn.float(), keep=lambda e: e in (2, 0, 4))
            assert rel(part, ref) < 3e-3, (var, dt)
        # one row: down + the top-k sum + the residual in one launch (moe_gemv.DOWN_SUM) against the two kernels
        moe_gemv.DECODE_GEMV_ONE_ROW["bf16"] = "u1d32"
        res = torch.randn(1, H, generator=g).to(dt)
        for i in (0, 2):
            r = moe_kernels.group(idx[i:i + 1].to(torch.int32), w[i:i + 1].float(), E, None)
            apart = moe_kernels.moe_routed(x[i:i + 1], res, r, gu, dn)
            for ds in ({"BN": 2, "num_warps": 4}, {"BN": 8, "num_warps": 2}):
                moe_gemv.DOWN_SUM = ds
                try:
                    both = moe_kernels.moe_routed(x[i:i + 1], res, r, gu, dn)
                finally:
                    moe_gemv.DOWN_SUM = None
                assert both.dtype == dt and rel(both, apart) < 2e-3, (ds, rel(both, apart))
                ref = res.float() + ref_moe(x[i:i + 1], idx[i:i + 1], w[i:i + 1], gu.float(), dn.float())
                assert rel(both, ref) < 3e-3, (ds, rel(both, ref))
        wd = (torch.randn(40, 96, generator=g) * 0.1).to(dt)
        xd = torch.randn(3, 96, generator=g).to(dt)
        for var in ("one_d1", "one_d4", "one_d8"):
            out = dense_kernels.gemv(xd, wd, "bf16", moe_gemv.GEMV_VARIANTS[var])
            assert out.dtype == dt and rel(out, xd.float() @ wd.float().t()) < 3e-3, (var, dt)
            again = dense_kernels.gemv(xd[1:2].contiguous(), wd, "bf16", moe_gemv.GEMV_VARIANTS[var])
            assert torch.equal(out[1], again[0]), var
        # the lean one-row kernel (`one_dense`): the sums of the one-step tile it copies, bit for bit; rows not a
        # multiple of BN (38) and a row that is not a power of two (96 values of a 128-value tile)
        # (and its form that lets the next kernel in at its start)
        for rows in (40, 38):
            x1, w1 = xd[1:2].contiguous(), wd[:rows].contiguous()
            tile = dense_kernels.gemv(x1, w1, "bf16", moe_gemv.GEMV_VARIANTS["one_d4"])
            for var in ("one_d4lean", "one_d4leantop"):
                lean = moe_gemv.one_dense(x1, w1, moe_gemv.GEMV_VARIANTS[var])
                assert lean.dtype == dt and torch.equal(lean, tile), (rows, dt, var)
        # `one_row` takes windows of up to DENSE_GEMV_ROWS[role] rows (the caller's cuBLAS path beyond)
        rows = dict(dense_kernels.DENSE_GEMV_ROWS)
        try:
            dense_kernels.DENSE_GEMV_ROWS.clear()
            assert dense_kernels.one_row(xd, wd, "qkv") is None and dense_kernels.one_row(xd, wd, "router") is None
            dense_kernels.DENSE_GEMV_ROWS.update(qkv=4, router=2)
            got = dense_kernels.one_row(xd, wd, "qkv")
            assert torch.equal(got, dense_kernels.gemv(xd, wd, "bf16", moe_gemv.GEMV_VARIANTS[
                dense_kernels.ONE_ROW_DENSE["qkv"]]))
            assert dense_kernels.one_row(xd, wd, "router") is None                           # 3 rows > 2
            alone = dense_kernels.gemv(xd[1:2].contiguous(), wd, "bf16",
                                       moe_gemv.GEMV_VARIANTS[dense_kernels.ONE_ROW_DENSE["router"]])
            assert torch.equal(dense_kernels.one_row(xd[:2], wd, "router")[1], alone[0])     # row 1 as alone
            assert dense_kernels.norm_one_row(xd, None, wd[0], 1e-6, wd, "qkv") is None     # one row only
        finally:
            dense_kernels.DENSE_GEMV_ROWS.clear()
            dense_kernels.DENSE_GEMV_ROWS.update(rows)
        # the RMSNorm folded into a one-row product: the residual as rmsnorm writes it, the normalized row and the
        # product within rounding of rmsnorm + gemv (the norm's sum may be reduced in another order)
        nw = (1 + 0.1 * torch.randn(96, generator=g)).to(dt)
        xr, dr = xd[:1].contiguous(), (0.5 * torch.randn(1, 96, generator=g)).to(dt)
        one, _, ones = dense_kernels._one_expert(1, xr.device)
        for var in ("one_d1", "one_d8"):
            cfg = moe_gemv.GEMV_VARIANTS[var]
            for delta in (None, dr):
                xo, ho, y = moe_gemv.norm_gemv(xr, delta, nw, 1e-6, wd, one, ones, cfg, True)
                xs, hs = dense_kernels.rmsnorm(xr, nw, 1e-6, delta)
                ys = dense_kernels.gemv(hs, wd, "bf16", cfg)
                assert torch.equal(xo, xs) and (ho is None) == (delta is None), var
                if ho is not None:
                    assert rel(ho, hs) < 2e-3, (var, rel(ho, hs))
                assert rel(y, ys) < 3e-3 and rel(y, hs.float() @ wd.float().t()) < 3e-3, (var, rel(y, ys))
    finally:
        moe_gemv.DECODE_GEMV.clear()
        moe_gemv.DECODE_GEMV.update(saved)
        moe_gemv.DECODE_GEMV_ONE_ROW.clear()
        moe_gemv.DECODE_GEMV_ONE_ROW.update(saved_one)


def check_quant_norm_gemv(dt: torch.dtype) -> None:
    """The RMSNorm folded into a one-row block-format product (`dense_kernels.quant_norm_one_row`: the looped block
    tiles normalize each activation as they load it) against rmsnorm + the same product and float math, for each
    32-value block format and rows of 3, 8 and 64 blocks, on DECODE_GEMV's variant and on a role's own looped one
    (Q8_0 / Q4_0 / IQ4_NL: a row-by-row R1 one too); not taken for two rows or a role whose variant is one-step. R1
    tiles on 36 rows, the last program's rows past N."""
    from runtime.gpu import moe_gemv

    g = torch.Generator().manual_seed(43)
    for K in (96, 256, 2048):        # 2048: two 1024-value steps of the k2 tiles
        w = torch.randn(40, K, generator=g) * 0.1
        x = (3 * torch.randn(1, K, generator=g)).to(dt)
        nw = (1 + 0.1 * torch.randn(K, generator=g)).to(dt)
        for qt in ("q8_0", "q5_0", "q4_0", "iq4_nl"):
            if qt == "iq4_nl":           # read from llama.cpp files only: random blocks (`expert_blocks`)
                ql = QuantLinear.from_blocks(expert_blocks(qt, 1, 40, K, g)[0][0], qt, K)
            else:
                ql = QuantLinear.from_float(w, qt)
            got = dense_kernels.quant_norm_one_row(x, nw, 1e-6, ql, "qkv")
            _, h = dense_kernels.rmsnorm(x, nw, 1e-6)
            want = dense_kernels.gemv(h, ql.blocks, qt, moe_gemv.variant(qt))
            assert got is not None and got.dtype == dt and got.shape == (1, 40), (qt, K)
            assert rel(got, want) < (1e-6 if dt == torch.float32 else 2e-3), (qt, K, rel(got, want))
            ref = h.float() @ ql.dequantized_weight().float().t()
            assert rel(got, ref) < 3e-3, (qt, K, rel(got, ref))
            assert dense_kernels.quant_norm_one_row(torch.cat([x, x]), nw, 1e-6, ql, "qkv") is None
            names = ("qone4j2", "n8j2k2") + (("r4d8k2w4j2",) if qt in moe_gemv.R1_FORMATS else ())
            for name in names:       # the role's own variant: a one-step one is never normalized
                dense_kernels.QUANT_ONE_ROW[(qt, "_check")] = name
                try:
                    got = dense_kernels.quant_norm_one_row(x, nw, 1e-6, ql, "_check")
                finally:
                    del dense_kernels.QUANT_ONE_ROW[(qt, "_check")]
                assert (got is None) == (name == "qone4j2"), name
                if got is not None:
                    assert rel(got, ref) < 3e-3, (qt, K, name, rel(got, ref))
            if qt in moe_gemv.R1_FORMATS:    # R1 tiles (`_rows32r`): 36 rows in programs of 8, the last reads past N
                q36 = QuantLinear.from_blocks(ql.blocks[:36].contiguous(), qt, K)
                for name in ("r4d8k2w4j2", "r2d4k2w4"):
                    got = dense_kernels.gemv(h, q36.blocks, qt, moe_gemv.GEMV_VARIANTS[name])
                    ref36 = h.float() @ q36.dequantized_weight().float().t()
                    assert got.shape == (1, 36) and rel(got, ref36) < 3e-3, (qt, K, name, rel(got, ref36))


def check_r1_q4k() -> None:
    """Q4_K rows one at a time (moe_gemv `_rowskr`, the R1 variants): dense rows whose last program reads past N (36
    rows in programs of 4 and 8; four and eight code words a thread) and a window's experts, against float32
    math on gguf-py's values; a row alone has the bits it has in the window."""
    from runtime.gpu import moe_gemv

    g = torch.Generator().manual_seed(61)
    blk, wf = expert_blocks("q4_k", 1, 36, 512, g)
    x = torch.randn(1, 512, generator=g)
    ref = x @ wf[0].float().t()
    for name in ("r4d8k2w4j4", "r8d8k4w4j8"):
        got = dense_kernels.gemv(x, blk[0], "q4_k", moe_gemv.GEMV_VARIANTS[name])
        assert got.shape == (1, 36) and rel(got, ref) < 3e-5, (name, rel(got, ref))
    # the interpreter runs every program of every (row, expert) pair in turn, and a row of 256-value super-blocks
    # takes it seconds: the window has two rows of one expert each (the same one), the row alone one pair, the
    # shipped one-row variant a row of two experts (its down products summed)
    E, H, NI = 4, 256, 256
    gub, guf = expert_blocks("q4_k", E, 2 * NI, H, g)
    dnb, dnf = expert_blocks("q4_k", E, H, NI, g)
    xs = torch.randn(2, H, generator=g)
    idx = torch.tensor([[2], [2]])                          # both rows on expert 2
    w = torch.rand(2, 1, generator=g)
    saved, saved_one = dict(moe_gemv.DECODE_GEMV), dict(moe_gemv.DECODE_GEMV_ONE_ROW)
    try:
        moe_gemv.DECODE_GEMV["q4_k"] = "r8d8k4w4j8"
        moe_gemv.DECODE_GEMV_ONE_ROW.pop("q4_k", None)
        out = moe_kernels.moe_grouped(xs, idx, w, gub, dnb, fmt="q4_k")
        assert rel(out, ref_moe(xs, idx, w, guf, dnf)) < 3e-5, rel(out, ref_moe(xs, idx, w, guf, dnf))
        one = moe_kernels.moe_grouped(xs[1:2], idx[1:2], w[1:2], gub, dnb, fmt="q4_k")
        assert torch.equal(one[0], out[1])
        moe_gemv.DECODE_GEMV_ONE_ROW.update(saved_one)        # the shipped one-row variant (R1 gate/up, looped down)
        assert moe_gemv.variant("q4_k", 1).get("R1_UP") == 8
        idx1, w1 = torch.tensor([[0, 2]]), torch.rand(1, 2, generator=g)
        one = moe_kernels.moe_grouped(xs[:1], idx1, w1, gub, dnb, fmt="q4_k")
        ref1 = ref_moe(xs[:1], idx1, w1, guf, dnf)
        assert rel(one, ref1) < 3e-5, rel(one, ref1)
    finally:
        moe_gemv.DECODE_GEMV.update(saved)
        moe_gemv.DECODE_GEMV_ONE_ROW.clear()
        moe_gemv.DECODE_GEMV_ONE_ROW.update(saved_one)


def check_quant(dt: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    for qt in ("q8_0", "q5_0", "q4_0"):
        w = torch.randn(40, 96, generator=g)
        ql = QuantLinear.from_float(w, qt)
        x = torch.randn(3, 96, generator=g).to(dt)
        ref = x.float() @ ql.dequantized_weight().t()
        out = dense_kernels.quant_linear(x, ql.blocks, qt, 96)
        assert rel(out, ref) < 3e-3, (qt, rel(out, ref))
    # float weights through the same GEMV kernel (the BF16 variants bench/dense_gemv.py times): the product,
    # the output in x's dtype, and a row's bits alone or in a window
    from runtime.gpu import moe_gemv

    w = (torch.randn(40, 96, generator=g) * 0.1).to(dt)
    x = torch.randn(5, 96, generator=g).to(dt)
    for name in ("n8j2", "n16j2"):
        out = dense_kernels.gemv(x, w, "bf16", moe_gemv.GEMV_VARIANTS[name])
        assert out.dtype == dt and rel(out, x.float() @ w.float().t()) < 3e-3, (name, dt)
        assert torch.equal(out[2], dense_kernels.gemv(x[2:3].contiguous(), w, "bf16", moe_gemv.GEMV_VARIANTS[name])[0])


def check_fused_step(quant: str | None = None, width: int = 4) -> None:
    """The fused fixed-width step (every Triton kernel of a layer) against the plain forward, fp32 (with a q8_0
    cache: both read the same 8-bit cache). Width 1 takes the experts' one-row GEMV variant
    (moe_gemv.DECODE_GEMV_ONE_ROW)."""
    import tempfile

    from runtime.gpu.static_step import StaticStep
    from runtime.kv import KVCache
    from runtime.loading import load_target
    from tests.runtime.tiny import make_tiny_target

    with tempfile.TemporaryDirectory() as d:
        model = load_target(make_tiny_target(d, seed=5, scale=2.0, head_dim=32 if quant else 16))
    for layer in model.model.layers:
        layer.mlp.stack_experts()
    c = model.cfg

    def kv() -> KVCache:
        return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 40, quant=quant)

    kv_a, kv_b = kv(), kv()
    prompt = torch.tensor([[5, 9, 11, 2, 7, 30]])
    with torch.no_grad():
        with plain():
            model(prompt, kv=kv_a)
            model(prompt, kv=kv_b)
        step = StaticStep(model, kv_b, width=width, graph=False)
        assert step.fused
        wins = ([[12]], [[3, 4, 5]], [[40, 41, 42, 43]]) if width == 4 else ([[12]], [[3]], [[40]])
        for win in wins:
            w = torch.tensor(win)
            with plain():
                ref = model(w, kv=kv_a, taps=(1,))
            got = step(w, kv_b, (1,))
            assert torch.allclose(got.logits, ref.logits, atol=2e-4, rtol=0), (got.logits - ref.logits).abs().max()
            assert torch.allclose(got.taps, ref.taps, atol=2e-4, rtol=0)
            # still the fused kernels: a step that fell back would match the plain forward and check nothing
            assert step.fused and not step.errors, step.errors
            kv_a.rollback(kv_a.length - 1)
            kv_b.rollback(kv_b.length - 1)
        ka, kb = kv_a.committed()[0], kv_b.committed()[0]
        assert torch.allclose(ka, kb, atol=1e-5 if quant is None else 0.05), (ka - kb).abs().max()


def check_step_inputs() -> None:
    """`dense_kernels.step_inputs`: the window's positions (start + r for its rows, -1 past them, int32) and its
    tokens' embedding rows, the same bits as torch's ops, for a full, a narrower and an empty window (without a
    float table: the positions alone)."""
    from runtime.gpu import dense_kernels

    g = torch.Generator().manual_seed(0)
    emb = torch.randn(50, 24, generator=g).to(torch.bfloat16)
    ids = torch.tensor([7, 0, 49, 3, 12], dtype=torch.long)
    ar = torch.arange(5)
    for start, rows in ((0, 5), (37, 3), (9, 0)):
        t = torch.tensor([start, rows], dtype=torch.long)
        pos = torch.full((5,), 123, dtype=torch.int32)
        x = dense_kernels.step_inputs(t, ids, pos, emb)
        assert torch.equal(pos, torch.where(ar < rows, start + ar, -1).to(torch.int32)), (start, rows, pos)
        assert x is not None and x.dtype == emb.dtype and torch.equal(x, emb[ids]), (start, rows)
        pos.fill_(123)
        assert dense_kernels.step_inputs(t, ids, pos, None) is None             # a block-format table: positions
        assert torch.equal(pos, torch.where(ar < rows, start + ar, -1).to(torch.int32)), (start, rows, pos)


def check_prefill_chunk(quant: str | None = None) -> None:
    """The fused prefill chunk (runtime/gpu/prefill_chunk.py) against the module forward, fp32: two chunks (the
    second attends to the first through the cache), its taps, hidden rows, logits and the K/V it leaves."""
    import tempfile

    from runtime.gpu import prefill_chunk
    from runtime.kv import KVCache
    from runtime.loading import load_target
    from tests.runtime.tiny import make_tiny_target

    with tempfile.TemporaryDirectory() as d:
        model = load_target(make_tiny_target(d, seed=7, scale=2.0, head_dim=32 if quant else 16))
    for layer in model.model.layers:
        layer.mlp.stack_experts()
        layer.self_attn.stack_qkv()
    c = model.cfg
    kv_a, kv_b = (KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 96, quant=quant)
                  for _ in range(2))
    taps = (0, c.num_hidden_layers - 1)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n in (70, 9):        # 70 rows: the many-row q/k-norm + RoPE kernel (a BF16 cache), then one-row programs
            ids = torch.randint(0, c.vocab_size, (1, n), generator=g)
            with plain():
                ref = model(ids, kv=kv_a, taps=taps)
            got = prefill_chunk.forward(model, kv_b, ids, taps, 0)
            for name in ("logits", "hidden", "taps"):
                a, b = getattr(got, name), getattr(ref, name)
                assert a.shape == b.shape, (name, a.shape, b.shape)
                # q8_0: an ulp apart before quantizing can flip one int8 code (seen: 1 of 4,480 in a layer), which
                # moves later rows by ~6e-4
                assert torch.allclose(a, b, atol=2e-4 if quant is None else 2e-3, rtol=0), (quant, name,
                                                                                          (a - b).abs().max())
        assert kv_a.length == kv_b.length == 79
        ka, kb = kv_a.committed()[0], kv_b.committed()[0]
        assert torch.allclose(ka, kb, atol=1e-5 if quant is None else 0.05), (ka - kb).abs().max()


def check_qkv_post_rows(dt: torch.dtype) -> None:
    """qkv_post on more rows than POST_ROWS_FROM (R rows a program) against the one-row programs: q and the cache
    rows it writes, padded rows (position -1) writing nothing."""
    nh, nkv, hd, W, S = 4, 2, 32, attention_kernels.POST_ROWS_FROM + 7, 128
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(W, (nh + 2 * nkv) * hd, generator=g).to(dt)
    qw, kw = (1 + 0.1 * torch.randn(hd, generator=g)).to(dt), (1 + 0.1 * torch.randn(hd, generator=g)).to(dt)
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    pos = torch.arange(30, 30 + W, dtype=torch.int32)
    pos[-3:] = -1
    outs = []
    for rows_from in (W, attention_kernels.POST_ROWS_FROM):      # W: one-row programs; then the R-row kernel
        attention_kernels.POST_ROWS_FROM = rows_from
        kc, vc = torch.zeros(nkv, S, hd, dtype=dt), torch.zeros(nkv, S, hd, dtype=dt)
        q = attention_kernels.qkv_post(qkv, qw, kw, inv, 1.0, pos, kc, vc, nh, nkv, hd, 1e-6)
        outs.append((q, kc, vc))
    attention_kernels.POST_ROWS_FROM = rows_from
    (qa, ka, va), (qb, kb, vb) = outs
    tol = 1e-6 if dt == torch.float32 else 1e-3
    assert torch.allclose(qa[:-3].float(), qb[:-3].float(), atol=tol, rtol=0), (qa - qb).abs().max()
    assert torch.allclose(ka.float(), kb.float(), atol=tol, rtol=0) and torch.equal(va, vb)
    assert float(kb[:, :30].abs().max()) == 0 and float(kb[:, 30 + W - 3:].abs().max()) == 0   # nothing stray


def check_qkv_post_rope_off(dt: torch.dtype) -> None:
    """qkv_post with rope_off = 1 (an MTP head's cache: slot s holds position s + 1): q and k are those of position
    pos + 1, written at slot pos; padded rows write nothing."""
    nh, nkv, hd, W, S = 4, 2, 32, 5, 64
    g = torch.Generator().manual_seed(12)
    qkv = torch.randn(W, (nh + 2 * nkv) * hd, generator=g).to(dt)
    qw, kw = (1 + 0.1 * torch.randn(hd, generator=g)).to(dt), (1 + 0.1 * torch.randn(hd, generator=g)).to(dt)
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    pos = torch.tensor([0, 7, 8, 30, -1], dtype=torch.int32)
    ka, va, kb, vb = (torch.zeros(nkv, S, hd, dtype=dt) for _ in range(4))
    qa = attention_kernels.qkv_post(qkv, qw, kw, inv, 1.0, pos, ka, va, nh, nkv, hd, 1e-6, rope_off=1)
    qb = attention_kernels.qkv_post(qkv, qw, kw, inv, 1.0, torch.where(pos >= 0, pos + 1, -1), kb, vb, nh, nkv, hd,
                                    1e-6)
    assert torch.equal(qa[:4], qb[:4])
    assert torch.equal(ka[:, :S - 1], kb[:, 1:]) and torch.equal(va[:, :S - 1], vb[:, 1:])
    assert float(ka.abs().sum(-1).gt(0).sum()) == nkv * 4         # four real rows written, the padded one not


def check_mtp_graphs() -> None:
    """The MTP graph path (chained drafting, padded observe rows, Triton cached attention) equals the eager path;
    the head's layer runs through the target step's fused kernels (`MTPGraphs.fused`)."""
    import tempfile

    from runtime.drafters.mtp import MTPGraphs
    from runtime.engine import Engine
    from tests.runtime.tiny import make_tiny_target

    with tempfile.TemporaryDirectory() as d:
        eng = Engine.build(make_tiny_target(d, seed=7, scale=2.0), "mtp", device="cpu", context=64, block=4)
    eng.model.mtp.layers[0].mlp.stack_experts()
    ids = [5, 6, 7, 8, 9, 10, 3]
    for min_p in (0.3,):
        ref = eng.generate(ids, max_new_tokens=10, spec_min_p=min_p, stop_ids=set())
        eng.drafter.graphs = MTPGraphs(eng.drafter)
        assert eng.drafter.graphs.fused
        got = eng.generate(ids, max_new_tokens=10, spec_min_p=min_p, stop_ids=set())
        assert eng.drafter.graphs.enabled and not eng.drafter.graphs.errors, eng.drafter.graphs.errors
        assert got.token_ids == ref.token_ids
        assert (got.stats["accepted"], got.stats["windows"]) == (ref.stats["accepted"], ref.stats["windows"]), \
            (got.stats["accepted"], ref.stats["accepted"])
        # the graph path drafted ahead (before each window's read) where the next window was a full block
        assert got.stats["drafted_ahead"] > 0 and ref.stats["drafted_ahead"] == 0, got.stats["drafted_ahead"]
        eng.drafter.graphs = None
    # sampled chains through the graph: a draw from q at every step (q = the eager path's at the first step)
    from runtime.sampling import SamplingParams

    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=3)
    eng.drafter.graphs = MTPGraphs(eng.drafter)
    out = eng.generate(ids, max_new_tokens=10, sampling=sp, stop_ids=set())
    assert len(out.token_ids) == 10 and eng.drafter.graphs.enabled and not eng.drafter.graphs.errors
    d, d_pos = eng.drafter, eng.drafter.next_pos
    anchor = out.token_ids[-1]
    gen = torch.Generator().manual_seed(1)
    d.kv.length = d_pos - 1                   # the state a window starts from (the last window kept an entry)
    fast = d.propose(anchor, d_pos, 3, min_p=0.0, sampling=sp, generator=gen)
    assert d.graphs.replays == 0 and fast.keep is not None   # the graph path (eager on the CPU) made it
    graphs, d.graphs = d.graphs, None
    d.kv.length = d_pos - 1                   # both paths keep the first step's entry: draft from the same state
    d.head8 = None                            # the eager chain through the target's head, as the graphs run it
    eager = d.propose(anchor, d_pos, 3, min_p=0.0, sampling=sp, generator=gen)
    d.graphs = graphs
    assert fast.q.shape == eager.q.shape == (3, eng.model.cfg.vocab_size)
    assert torch.allclose(fast.q.sum(-1), torch.ones(3), atol=1e-5)
    assert bool((fast.q.gather(-1, fast.tokens[:, None]) > 0).all())
    assert torch.allclose(fast.q[0], eager.q[0], atol=1e-5)
    d.graphs = None


def check_dyn_conv(dt: torch.dtype) -> None:
    """The one-launch dynamic convolution equals GroupedDynamicCausalConv's prepare/finish bit for bit (its loop,
    as on a GPU: on a CPU without autograd the module takes its taps at once, in another order)."""
    from runtime.drafters.dflash2.model import GroupedDynamicCausalConv

    g = torch.Generator().manual_seed(3)
    conv = GroupedDynamicCausalConv(64, 2, 16)
    with torch.no_grad():
        conv.base_kernel.copy_(torch.randn(2, 2, 64, generator=g))
        conv.kernel_projection.weight.copy_(torch.randn(conv.kernel_projection.weight.shape, generator=g) * 0.2)
    conv = conv.to(dt)
    h, h2 = torch.randn(2, 7, 64, generator=g).to(dt).unbind(0)
    with torch.enable_grad():
        ref0, d1 = conv.prepare(h[None])
        ref1 = conv.finish(h2[None], d1)
    ref0, d1, ref1 = ref0.detach(), d1.detach(), ref1.detach()
    with torch.no_grad():
        dyn = conv.kernel_projection(h)
        got0 = dflash2_kernels.dyn_conv(h, dyn, 0, conv.base_kernel[0], 2, 16)
        got1 = dflash2_kernels.dyn_conv(h2, dyn, 1, conv.base_kernel[1], 2, 16)
    assert torch.equal(got0, ref0[0]), (got0 - ref0[0]).abs().max()
    assert torch.equal(got1, ref1[0]), (got1 - ref1[0]).abs().max()


def check_dflash2_graphs() -> None:
    """The DFlash2 fast graph path (fused kernels, block K/V in the cache slots, lattice walk) drafts, observes
    and decodes as the eager path does (fp32: same tokens, same accepted counts, same draft context)."""
    import tempfile

    from runtime.drafters.dflash2.graphs import DFlash2Graphs
    from runtime.engine import Engine
    from tests.runtime.drafters.dflash2.helpers import drafter_config, write_hf_drafter
    from tests.runtime.tiny import make_tiny_target

    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        target = make_tiny_target(root, vocab=64, hidden=32, layers=3, mtp=False)
        for v1 in (False,):
            cfg = drafter_config(hidden=32, inter=64, vocab=64, heads=2, kv_heads=1, head_dim=16, taps=(0, 2),
                                 num_target_layers=3, block_size=6, top_k=4, rank=16)
            path = write_hf_drafter(root / f"dflash2-{v1}", cfg, seed=4, v1=v1)
            eng = Engine.build(target, "dflash2", drafter_path=path, device="cpu", context=96)
            ids = eng.tokenizer.encode("hello there, general kenobi").ids
            dr = eng.drafter
            for min_p in (0.2,):
                dr.graphs = None
                ref = eng.generate(ids, max_new_tokens=14, spec_min_p=min_p, stop_ids=set())
                k_ref = dr.cache.k[:, :, : dr.cache.length].clone()
                v_ref = dr.cache.v[:, :, : dr.cache.length].clone()
                dr.graphs = DFlash2Graphs(dr)
                assert dr.graphs.fast
                got = eng.generate(ids, max_new_tokens=14, spec_min_p=min_p, stop_ids=set())
                assert dr.graphs.enabled and dr.graphs.fast and not dr.graphs.errors, dr.graphs.errors
                assert dr.graphs.replays == 0   # CPU: the functions ran eagerly, through the fast path
                assert got.token_ids == ref.token_ids
                assert (got.stats["accepted"], got.stats["windows"]) == (ref.stats["accepted"], ref.stats["windows"])
                n = dr.cache.length
                assert torch.allclose(dr.cache.k[:, :, :n], k_ref, atol=1e-5)
                assert torch.allclose(dr.cache.v[:, :, :n], v_ref, atol=1e-5)
                # one proposal, directly: the fast draft against the eager draft at the end state
                anchor, pos = got.token_ids[-1], n
                graphs, dr.graphs = dr.graphs, None
                eager = dr.propose(anchor, pos, 5, min_p=0.0)
                dr.graphs = graphs
                fast = graphs.propose(anchor, pos, 5, 0.0)
                assert torch.equal(fast.tokens, eager.tokens), (fast.tokens, eager.tokens)
                assert torch.allclose(fast.confidence, eager.confidence, atol=1e-5)
                # sampled through the fast path: a draw from its q rows; row 0's q is the eager walk's
                from runtime.sampling import SamplingParams

                sp = SamplingParams(temperature=0.8, seed=2)
                out = eng.generate(ids, max_new_tokens=14, sampling=sp, stop_ids=set())
                assert len(out.token_ids) == 14 and dr.graphs.fast and not dr.graphs.errors, dr.graphs.errors
                n = dr.cache.length
                anchor = out.token_ids[-1]
                s_fast = graphs.propose(anchor, n, 5, 0.0, sp, torch.Generator().manual_seed(0))
                dr.graphs = None
                s_eager = dr.propose(anchor, n, 5, min_p=0.0, sampling=sp, generator=torch.Generator().manual_seed(0))
                dr.graphs = graphs
                assert torch.allclose(s_fast.q.sum(-1), torch.ones(5), atol=1e-5)
                assert bool((s_fast.q.gather(-1, s_fast.tokens[:, None]) > 0).all())
                assert torch.allclose(s_fast.q[0], s_eager.q[0], atol=1e-5)


def check_lattice_walk() -> None:
    """The one-launch selector chain equals the torch chain (tokens exactly, confidences to rounding), ties too."""
    from runtime.drafters.dflash2.contract import DFlash2Geometry
    from runtime.drafters.dflash2.model import CandidateSelector, lattice_walk
    from tests.runtime.drafters.dflash2.helpers import drafter_config

    sel = CandidateSelector(DFlash2Geometry.from_config(drafter_config(hidden=16, vocab=40, top_k=16, rank=8)))
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in sel.parameters():
                p.copy_(torch.randint(-1, 2, p.shape, generator=g).float() if seed % 2 else torch.randn(p.shape,
                                                                                                  generator=g))
        hs = torch.randn(7, 16, generator=g)
        logits = torch.randint(0, 2, (7, 40), generator=g).float() if seed % 2 else torch.randn(7, 40, generator=g)
        anchor = torch.tensor([seed + 3])
        ref = lattice_walk(sel, hs, logits, anchor)
        got = lattice_walk(sel, hs, logits, anchor, kernel=dflash2_kernels.lattice_walk)
        assert torch.equal(got[0], ref[0]), (got[0], ref[0])
        assert torch.allclose(got[1], ref[1], rtol=1e-5, atol=1e-7)


def check_one_row_chunks(dt: torch.dtype) -> None:
    """A one-row window over a compute-dtype cache splits by its row's length (runtime/kv.py ONE_ROW_CHUNKS, here a
    small layout: about 4 chunks of 16 to 64 positions): the same bits as the same row under one chunk size
    everywhere of `one_row_chunk(pos + 1)` (the same boundaries, the same walk and reduction), the reference up to
    rounding, the same bits on a larger cache and in the step's preallocated scratch. A q8_0 cache's one-row window
    takes ONE_ROW_CHUNKS_Q8 where set (checked with the same small layout), else the tiers."""
    from runtime import kv as kv_mod

    g = torch.Generator().manual_seed(7)
    nh, nkv, hd, S = 4, 2, 64, 300
    saved = kv_mod.ONE_ROW_CHUNKS, kv_mod.ONE_ROW_CHUNKS_Q8
    kv_mod.ONE_ROW_CHUNKS = kv_mod.ONE_ROW_CHUNKS_Q8 = (4, 16, 64)
    try:
        kc, vc, ks, vs, _, _ = cache(nkv, S, hd, dt, True, g)         # no q8_0 layout: the tiers
        q, pos = torch.randn(1, nh, hd, generator=g).to(dt), torch.tensor([299], dtype=torch.int32)
        kv_mod.ONE_ROW_CHUNKS_Q8 = None
        tiers = attention_kernels.attention(q, kc, vc, pos, hd ** -0.5, ks=ks, vs=vs, tiers=kv_mod.KV_TIERS)
        assert torch.equal(attention_kernels.attention(q, kc, vc, pos, hd ** -0.5, ks=ks, vs=vs), tiers)
        kv_mod.ONE_ROW_CHUNKS_Q8 = (4, 16, 64)
        for q8 in (False, True):
            kc, vc, ks, vs, keys, vals = cache(nkv, S, hd, dt, q8, g)
            extra = cache(nkv, 200, hd, dt, q8, g)
            big = [torch.cat([a, b], 1) if a is not None else None for a, b in zip((kc, vc, ks, vs), extra[:4],
                                                                                    strict=True)]
            part = attention_kernels.split_scratch(1, nh, S, hd, "cpu")
            for p in (0, 16, 65, 256, 299):
                q = torch.randn(1, nh, hd, generator=g).to(dt)
                pos = torch.tensor([p], dtype=torch.int32)
                o = attention_kernels.attention(q, kc, vc, pos, hd ** -0.5, ks=ks, vs=vs)
                lay = {"chunk": kv_mod.one_row_chunk(p + 1)}
                same = attention_kernels.attention(q, kc, vc, pos, hd ** -0.5, ks=ks, vs=vs, **lay)
                assert torch.equal(o, same), (q8, p)
                ref = ref_attention(q, keys, vals, pos)
                assert rel(o[0], ref[0]) < (1e-5 if dt == torch.float32 else 3e-3), (q8, p, rel(o[0], ref[0]))
                assert torch.equal(attention_kernels.attention(q, *big[:2], pos, hd ** -0.5, ks=big[2], vs=big[3]), o)
                assert torch.equal(attention_kernels.attention(q, kc, vc, pos, hd ** -0.5, ks=ks, vs=vs, part=part), o)
            pad = attention_kernels.attention(torch.randn(1, nh, hd, generator=g).to(dt), kc, vc,
                                              torch.tensor([-1], dtype=torch.int32), hd ** -0.5, ks=ks, vs=vs)
            assert float(pad.abs().max()) == 0.0
    finally:
        kv_mod.ONE_ROW_CHUNKS, kv_mod.ONE_ROW_CHUNKS_Q8 = saved


def check_attention_all() -> None:
    for dt in (torch.float32, torch.float16):
        check_attention(dt)
        check_split_attention(dt)
        check_one_row_chunks(dt)
        check_kv_q8(dt)
        check_qkv_post_rows(dt)
        check_qkv_post_rope_off(dt)
    check_dense_step_q8()


def check_fused_step_kquant_mix(mix: str = "q4_k_m", path: str = "gemv") -> None:
    """A target quantized the way llama-quantize's Q4_K_M (or Q5_K_M) quantizes (bench/quant_target.py
    `tensor_format`: Q4_K (Q5_K), with a Q6_K v and Q6_K experts' down in some layers, a Q6_K head) through the
    fused step, against the plain forward: a layer whose v has another format than its q and k stacks q and k alone
    (`qk_blocks`). path "dot": the mix's main format takes no matrix-vector tiles (the dequantized scratch and the
    tl.dot expert kernels, the path a format without GEMV code would take)."""
    from bench.quant_target import build_on_gpu
    from runtime.gpu import moe_gemv
    from tests.runtime.tiny import tiny_config

    if path == "dot":
        moe_gemv.DECODE_GEMV[mix[:4]] = None

    # two layers (the interpreter is slow): the rule gives the second the Q6_K v and experts' down
    cfg = tiny_config(vocab=64, hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, experts=4, top_k=2,
                      moe_inter=256, mtp=False)
    model = build_on_gpu(cfg, mix, device="cpu", dtype=torch.float32)
    a0, a1 = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    assert a0.qkv_blocks is not None and a1.qkv_blocks is None and a1.qk_blocks is not None and a1.has_qkv
    more = "q5_k" if mix == "q3_k_m" else "q6_k"
    assert a1.v_proj.qtype == more and model.model.layers[1].mlp.fmt == (mix[:4], more)
    _fused_step_matches_forward(model, mix)


if __name__ == "__main__":
    if sys.argv[1:] == ["attention"]:   # its own run (tests/runtime/test_static_step.py): no MoE kernel needed
        check_attention_all()
        print("attention ok")
        sys.exit(0)
    if sys.argv[1:] == ["moe"]:         # its own run (tests/runtime/test_moe_kernels.py)
        check_dequant()
        for dt in (torch.float32, torch.float16):
            check_route(dt)
            check_moe_slots(dt)
            check_moe_quant(dt, () if dt == torch.float32 else ("q4_0", "q4_k"))
            check_moe_prefill(dt)
        check_fused_step_quant()
        print("moe kernels ok")
        sys.exit(0)
    if sys.argv[1:2] == ["moe_gemv"]:   # its own runs (tests/runtime/test_moe_kernels.py): moe_gemv [0|1]
        half = int(sys.argv[2]) if len(sys.argv) > 2 else None
        check_moe_gemv(half)
        if half != 1:         # one-step tiles with half 0, the R1 check with half 1: the halves take alike on two cores
            check_gemv_one_step(torch.float16)
        if half != 0:
            check_r1_q4k()
        for dt in (torch.float32, torch.float16):
            if half is None or half == (dt == torch.float16):      # one dtype a half: the halves take alike
                check_quant_norm_gemv(dt)
        print("moe gemv kernels ok")
        sys.exit(0)
    if sys.argv[1:] == ["moe_row"]:      # its own run (tests/runtime/test_moe_row.py)
        for dt in (torch.float32, torch.float16):
            check_moe_row(dt)
        check_fused_step_moe_row()
        print("moe row ok")
        sys.exit(0)
    if sys.argv[1:] == ["moe_split"]:    # its own run (tests/runtime/test_moe_split.py)
        for dt in (torch.float32, torch.float16):
            check_moe_split(dt)
        check_fused_step_moe_split()
        print("moe split ok")
        sys.exit(0)
    if sys.argv[1:] == ["gguf"]:         # its own run (tests/runtime/test_loading_gguf.py)
        check_fused_step_gguf()
        print("gguf step ok")
        sys.exit(0)
    if sys.argv[1:2] == ["kquant_mix"]:  # its own runs (tests/runtime/test_loading_gguf.py): kquant_mix MIX [dot]
        check_fused_step_kquant_mix(*sys.argv[2:4])
        print("gguf step ok")
        sys.exit(0)
    if sys.argv[1:] == ["dflash2"]:     # its own run (tests/runtime/drafters/dflash2/test_graphs.py): the interpreter is slow
        check_lattice_walk()
        check_dflash2_graphs()
        print("dflash2 graphs ok")
        sys.exit(0)
    for dt in (torch.float32, torch.float16):     # the long attention checks run in their own process (above)
        check_attention(dt)
        check_moe(dt)
        check_quant(dt)
        check_dyn_conv(dt)
    check_step_inputs()
    check_fused_step()
    check_fused_step("q8_0")
    check_fused_step(width=1)
    check_prefill_chunk()
    check_prefill_chunk("q8_0")
    check_mtp_graphs()
    print("kernels ok")
