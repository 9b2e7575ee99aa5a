"""The 8-bit-activation block products (runtime/gpu/int8_gemv.py) under the Triton CPU interpreter: the packed
activation codes, scales and Q4_0 offsets are exactly the reference quantization's; each product equals exact
(float64) math on the quantized activations to fp32 rounding, and float32 math on the raw activations to the
activation rounding; experts, per-pair rows and routing weights land where they should."""

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import numpy as np, torch
    from gguf.quants import dequantize
    from runtime.formats.blocks import quantize
    from runtime.formats.registry import FORMATS
    from runtime.gpu import int8_gemv as ig

    g = torch.Generator().manual_seed(0)

    def blocks(E, rows, cols, fmt):
        raw = quantize((torch.randn(E * rows, cols, generator=g) * 0.1).numpy(), fmt)
        vals = dequantize(raw, FORMATS[fmt].ggml).reshape(E, rows, cols)
        return torch.from_numpy(np.ascontiguousarray(raw)).view(E, rows, -1), torch.from_numpy(vals.copy()).double()

    # the quantizer: codes unpacked from their words in the documented order, scales, offsets
    x = torch.randn(3, 96, generator=g) * torch.tensor([1.0, 1e-3, 30.0])[:, None]
    x[1, 32:64] = 0.0                                          # an all-zero block: scale 0, codes 0
    x = x.to(torch.bfloat16)
    q, d, b = ig.quantize_rows(x)
    qr, dr = ig.quantize_reference(x)
    assert torch.equal(d, dr), (d, dr)
    assert int(qr.abs().max()) == 127 and bool((d[1, 1] == 0) & (qr[1, 32:64] == 0).all())
    by = torch.stack([(q >> (8 * k)) & 255 for k in range(4)], -1).reshape(3, 3, 2, 4, 2, 2)    # blk, h, l, qd, p
    by = torch.where(by > 127, by - 256, by)
    val = by.permute(0, 1, 2, 4, 3, 5).reshape(3, 96)    # value index 16 h + 8 qd + 2 l + p
    assert torch.equal(val, qr), "packing"
    s = qr.reshape(3, 3, 2, 2, 4, 2).sum((2, 3, 5))      # blk, (h, qd), l, p -> per blk and l
    assert torch.equal(b.reshape(3, 3, 4), -8 * s), "offsets"

    def exact(qx, dx, wv):                               # float64: d_w * code * dx * q, summed
        return torch.einsum("pk,pnk->pn", (qx.double().reshape(qx.shape[0], -1, 32) * dx.double()[..., None]
                                           ).reshape(qx.shape[0], -1), wv)

    for fmt in ("q4_0", "q8_0"):
        E, N, K = 5, 20, 96                              # 20 rows in tiles of 8: rows past N read, never stored
        wb, wv = blocks(E, 2 * N, K, fmt)
        xs = (torch.randn(1, K, generator=g) * 0.5).to(torch.bfloat16)
        act = ig.quantize_rows(xs)
        qx, dx = ig.quantize_reference(xs)
        ex = torch.tensor([3, 0, 4], dtype=torch.int32)
        for kv in (32, 512):                             # three steps of one block, or the row in one step
            h = ig.gemv(act, wb, ex, fmt, torch.empty(3, N), up=True, x_per_pair=False, bn=8, kv=kv)
            gu = exact(qx.expand(3, K), dx.expand(3, -1), wv[ex.long()])
            ref = torch.nn.functional.silu(gu[:, :N]) * gu[:, N:]
            assert ((h.double() - ref).abs().max() / ref.abs().max()) < 1e-5, (fmt, kv, "up")
            raw = xs.double() @ wv[ex.long()].transpose(1, 2)
            ref_raw = torch.nn.functional.silu(raw[:, 0, :N]) * raw[:, 0, N:]
            assert ((h.double() - ref_raw).abs().max() / ref_raw.abs().max()) < 3e-2, (fmt, kv, "raw")
        # down: a row per pair, routing weights, one expert twice
        hx = (torch.randn(3, K, generator=g)).to(torch.bfloat16)
        act = ig.quantize_rows(hx)
        qh, dh = ig.quantize_reference(hx)
        ex = torch.tensor([1, 1, 2], dtype=torch.int32)
        wt = torch.tensor([0.5, 0.25, 2.0])
        y = ig.gemv(act, wb, ex, fmt, torch.empty(3, 2 * N), up=False, x_per_pair=True, weights=wt, bn=16)
        ref = exact(qh, dh, wv[ex.long()]) * wt.double()[:, None]
        assert ((y.double() - ref).abs().max() / ref.abs().max()) < 1e-5, (fmt, "down")
        # a dense matrix (no expert axis), one row
        y = ig.gemv(ig.quantize_rows(xs), wb[2], torch.zeros(1, dtype=torch.int32), fmt, torch.empty(1, 2 * N),
                    up=False, x_per_pair=False, bn=4)
        ref = exact(qx, dx, wv[2:3])
        assert ((y.double() - ref).abs().max() / ref.abs().max()) < 1e-5, (fmt, "dense")
    print("ok")
""")


@pytest.mark.timeout(660)     # the interpreter is slow; two CI cores share the work
def test_int8_activation_products_in_interpreter():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600,
                       env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]
