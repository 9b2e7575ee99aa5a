"""The MTP drafter's CPU rows (`MTPDrafter._rows_cpu`: fewer ops, norms as layer_norms, a window's rows attending
by batched products, a small layer's experts all at once) compute what the head's module path computes, and write
the same cache entries: on the model as loaded and as a CPU engine holds it (experts packed, q/k/v stacked, weights
input-major)."""

import pytest
import torch

from runtime.cpu_layout import relayout
from runtime.drafters.mtp import MTPDrafter
from runtime.loading import load_target
from tests.runtime.tiny import make_tiny_target, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("placed", [False, True])
@pytest.mark.parametrize("n", [1, 3, 16, 20])
def test_cpu_rows_equal_the_module_path(tmp_path, n, placed):
    model = load_target(make_tiny_target(tmp_path, seed=11, scale=2.0))
    if placed:                               # what ExpertCache.place does on a CPU with every expert resident
        assert model.mtp.layers[0].mlp.pack_dense(hot=True)
        model.mtp.layers[0].self_attn.stack_qkv()
        assert relayout(model) > 0
    d = MTPDrafter(model, 64, max_block=16)
    torch.manual_seed(0)
    with torch.no_grad():
        d.kv.k.normal_()                      # 9 committed entries already there (any values)
        d.kv.v.normal_()
        d.kv.length = 9
        tok = torch.randint(0, model.cfg.vocab_size, (n,))
        g = torch.randn(n, model.cfg.hidden_size)
        pos = torch.arange(10, 10 + n)[None]
        fast = d._rows_cpu(tok, g, 10)
        k_fast, v_fast = d.kv.k[0, 0, :, :9 + n].clone(), d.kv.v[0, 0, :, :9 + n].clone()
        emb = model.model.embed_tokens(tok)[None]
        ref = model.mtp(emb, g[None], pos, model.rotary, (d.kv.layer(0), 9))[0]
    torch.testing.assert_close(fast, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(d.kv.k[0, 0, :, :9 + n], k_fast, rtol=0, atol=1e-6)
    torch.testing.assert_close(d.kv.v[0, 0, :, :9 + n], v_fast, rtol=0, atol=1e-6)
    # a row attends to the keys up to its own position only: a later row's key leaves it alone
    if n > 1:
        with torch.no_grad():
            d.kv.length = 9
            first = d._rows_cpu(tok[:1], g[:1], 10)
        torch.testing.assert_close(fast[:1], first, rtol=0, atol=1e-5)
