"""Chunked-prefill attention over a cache prefix: the lower-right causal path equals the explicit boolean mask."""

import pytest
import torch
import torch.nn.functional as F

from runtime.models.layers import cached_attention


def _old(q, keys, vals, scale):
    """The previous implementation: a [T, S] boolean mask, row i sees keys 0..start+i."""
    T, S = q.shape[-2], keys.shape[-2]
    start = S - T
    mask = None
    if T > 1:
        rows = torch.arange(start, S)[:, None]
        mask = torch.arange(S)[None, :] <= rows
    return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=scale,
                                          enable_gqa=keys.shape[1] != q.shape[1])


def _manual(q, keys, vals, scale):
    """Softmax by hand, K/V heads repeated: independent of SDPA."""
    g = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(g, 1), vals.repeat_interleave(g, 1)
    T, S = q.shape[-2], k.shape[-2]
    s = (q @ k.transpose(-1, -2)) * scale
    allowed = torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("nh,nkv,T,S", [(4, 2, 7, 19), (4, 4, 5, 5), (4, 1, 1, 9), (2, 1, 16, 40), (4, 2, 3, 3)])
def test_cached_attention_matches_mask(nh, nkv, T, S):
    g = torch.Generator().manual_seed(T * 100 + S)
    q = torch.randn(1, nh, T, 16, generator=g)
    k = torch.randn(1, nkv, S, 16, generator=g)
    v = torch.randn(1, nkv, S, 16, generator=g)
    new = cached_attention(q, k, v, 0.25)
    assert new.shape == (1, nh, T, 16)
    torch.testing.assert_close(new, _old(q, k, v, 0.25), atol=1e-5, rtol=0)
    torch.testing.assert_close(new, _manual(q, k, v, 0.25), atol=1e-5, rtol=0)


def test_chunked_prefill_equals_one_pass():
    """The model's chunked prefill (which goes through cached_attention) gives the plain forward's logits."""
    from runtime.kv import KVCache
    from runtime.models.qwen3_moe import Qwen3MoeModel
    from runtime.models.target_config import Qwen3MoeConfig
    from tests.runtime.tiny import random_state, tiny_config

    d = tiny_config()
    model = Qwen3MoeModel(Qwen3MoeConfig.from_dict(d))
    model.load_state_dict(random_state(d), strict=False)
    model.eval()
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (1, 23))
    with torch.no_grad():
        full = model(ids).logits
        kv = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 32, dtype=torch.float32,
                     device="cpu")
        parts = [model(ids[:, s:s + 8], kv=kv).logits for s in range(0, 23, 8)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=0)
