"""runtime/models/cpu_rows.py's pieces against the module path they replace on a CPU: RoPE as matrices, q/k/v with
the scale in q, routing by the top-k's softmax, and the packed experts (the norms: test_layers_norm.py)."""

import torch

from runtime.loading import load_target
from runtime.models import cpu_rows
from runtime.models.layers import apply_rope, project_qkv
from tests.runtime.tiny import make_tiny_target


def test_rope_matrices_are_rope():
    g = torch.Generator().manual_seed(1)
    for hd in (16, 64):
        pos = torch.tensor([0, 3, 17, 4095])
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        f = pos[:, None].float() * inv
        cos, sin = torch.cat((f, f), -1).cos(), torch.cat((f, f), -1).sin()
        x = torch.randn(4, 3, hd, generator=g)                     # rows, heads, head_dim
        ref = apply_rope(x.transpose(0, 1)[None], cos[None], sin[None])[0].transpose(0, 1)
        got = torch.bmm(x, cpu_rows.rope_matrices(cos, sin))
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_qkv_route_and_experts_match_the_modules(tmp_path):
    m = load_target(make_tiny_target(tmp_path, seed=2, scale=2.0))
    layer = m.model.layers[0]
    a, mlp = layer.self_attn, layer.mlp
    a.stack_qkv()
    g = torch.Generator().manual_seed(2)
    h = torch.randn(5, m.cfg.hidden_size, generator=g)
    pos = torch.arange(7, 12)
    with torch.no_grad():
        cos, sin = m.rotary(pos[None], h.dtype)
        q, k, v = project_qkv(a, h[None], cos, sin)
        q2, k2, v2 = cpu_rows.qkv(a, h, cpu_rows.rope_matrices(cos[0], sin[0]))
        torch.testing.assert_close(q2, q[0].transpose(0, 1) * a.scale, rtol=1e-5, atol=1e-5)   # q carries the scale
        torch.testing.assert_close(k2, k[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v2, v, rtol=0, atol=0)
        w, idx = mlp.route(h)
        w2, idx2 = cpu_rows.route(mlp, h)
        assert torch.equal(idx2, idx)
        torch.testing.assert_close(w2, w, rtol=1e-6, atol=1e-7)
        ref = h + mlp(h)
        assert mlp.pack_dense()
        torch.testing.assert_close(cpu_rows.dense_experts(mlp, h, w2, idx2, h), ref, rtol=1e-5, atol=1e-5)
        for r in range(h.shape[0]):          # one row: its k experts through their packed rows
            got = cpu_rows.routed_experts(mlp, h[r:r + 1], w2[r:r + 1], idx2[r:r + 1], h[r:r + 1])
            torch.testing.assert_close(got, ref[r:r + 1], rtol=1e-5, atol=1e-5)


def test_derived_follows_its_sources():
    lin = torch.nn.Linear(4, 3)
    calls = []

    def make() -> torch.Tensor:
        calls.append(1)
        return lin.weight.detach() * 2

    a = cpu_rows.derived(lin, "_twice", (lin.weight,), make)
    assert cpu_rows.derived(lin, "_twice", (lin.weight,), make) is a and len(calls) == 1
    with torch.no_grad():
        lin.weight.add_(1.0)                  # changed in place: made again
    torch.testing.assert_close(cpu_rows.derived(lin, "_twice", (lin.weight,), make), lin.weight.detach() * 2)
    lin.weight.data = torch.zeros(3, 4)       # replaced: made again
    assert torch.equal(cpu_rows.derived(lin, "_twice", (lin.weight,), make), torch.zeros(3, 4))
    assert len(calls) == 3
    assert "_twice" not in lin.state_dict()
