"""The target's RMSNorm (runtime/models/layers.py): in fp32 one fused op, with the bits of transformers' order
(normalise, then scale by the weight); in bf16 the normalised row is rounded before the scale, as transformers
rounds it."""

import torch
import torch.nn.functional as F

from runtime.models.cpu_rows import ln_weight, rms_ln
from runtime.models.layers import RMSNorm


def _transformers_order(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def test_fp32_norm_is_one_op_with_the_bits_of_normalise_then_scale():
    g = torch.Generator().manual_seed(7)
    for shape in ((1, 1, 256), (1, 5, 256), (1, 3, 4, 64), (2, 382, 64)):
        n = RMSNorm(shape[-1], 1e-6)
        with torch.no_grad():
            n.weight.copy_(torch.randn(shape[-1], generator=g))
        for scale in (1e-3, 1.0, 30.0):
            x = torch.randn(*shape, generator=g) * scale
            two_ops = n.weight * F.rms_norm(x, (shape[-1],), eps=1e-6)
            assert torch.equal(n(x), two_ops), (shape, scale)
            assert torch.allclose(n(x), _transformers_order(x, n.weight, 1e-6), rtol=1e-5, atol=1e-6)


def test_bf16_norm_rounds_before_the_scale():
    g = torch.Generator().manual_seed(8)
    n = RMSNorm(64, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        n.weight.copy_(torch.randn(64, generator=g))
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    assert n(x).dtype == torch.bfloat16
    assert torch.equal(n(x), n.weight * F.rms_norm(x.float(), (64,), eps=1e-6).to(torch.bfloat16))


def test_layer_norm_form_is_rmsnorm_row_by_row():
    """`rms_ln` (the CPU step's norm: one layer_norm over [x, -x]) is RMSNorm within fp32 rounding, with the
    weight or without, and a row's bits are those it gets alone, at any row of any batch (row invariance)."""
    g = torch.Generator().manual_seed(9)
    for shape in ((1, 1, 256), (1, 5, 256), (4, 6, 64), (2, 382, 64)):
        n = RMSNorm(shape[-1], 1e-6)
        with torch.no_grad():
            n.weight.copy_(torch.randn(shape[-1], generator=g))
        for scale in (1e-3, 1.0, 30.0):
            x = torch.randn(*shape, generator=g) * scale
            y = rms_ln(x, ln_weight(n), 1e-6)
            torch.testing.assert_close(y, n(x), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(rms_ln(x, None, 1e-6), F.rms_norm(x, (shape[-1],), eps=1e-6),
                                       rtol=1e-5, atol=1e-6)
            rows = x.reshape(-1, shape[-1])
            for i in (0, rows.shape[0] - 1):
                assert torch.equal(rms_ln(rows[i:i + 1], ln_weight(n), 1e-6)[0], y.reshape(-1, shape[-1])[i])
    b = RMSNorm(64, 1e-6).to(torch.bfloat16)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    torch.testing.assert_close(rms_ln(x, ln_weight(b), 1e-6).float(), b(x).float(), rtol=2 ** -7, atol=1e-2)


def test_layer_norm_form_follows_a_changed_weight():
    """`ln_weight` is remade when the norm's weight changes in place or is replaced (no stale copy)."""
    n = RMSNorm(16, 1e-6)
    x = torch.randn(2, 16)
    with torch.no_grad():
        rms_ln(x, ln_weight(n), 1e-6)
        n.weight.mul_(3.0)
        torch.testing.assert_close(rms_ln(x, ln_weight(n), 1e-6), n(x), rtol=1e-5, atol=1e-6)
        n.weight.data = torch.randn(16)
        torch.testing.assert_close(rms_ln(x, ln_weight(n), 1e-6), n(x), rtol=1e-5, atol=1e-6)
    assert ln_weight(n, torch.bfloat16).dtype == torch.bfloat16
