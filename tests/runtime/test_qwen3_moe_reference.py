"""The target equals transformers' Qwen3MoeForCausalLM (same random weights, fp32): prefill, step decode, taps."""

import pytest
import torch

from runtime.kv import KVCache
from runtime.loading import load_target
from runtime.models.target_config import Qwen3MoeConfig
from tests.runtime.tiny import make_tiny_target, single_thread, to_transformers  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")
TOL = 1e-4

CASES = {
    "norm_topk": dict(norm_topk_prob=True),
    "no_norm_topk": dict(norm_topk_prob=False),
    "mlp_only_layers": dict(mlp_only_layers=(0, 2), norm_topk_prob=True),
    "sparse_step2_tied": dict(decoder_sparse_step=2, tie=True, scale=0.3),
    "mha_yarn": dict(kv_heads=4, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                                  "original_max_position_embeddings": 64}),
    "linear_rope": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    folder = make_tiny_target(tmp_path_factory.mktemp(request.param), seed=7, **CASES[request.param])
    return load_target(folder), to_transformers(folder)


def test_prefill_logits_and_taps_match(pair):
    ours, ref = pair
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = ours(ids, taps=(1, 0, 2))
        b = ref(ids, output_hidden_states=True)
    assert (a.logits - b.logits).abs().max().item() <= TOL
    assert a.logits.abs().max().item() > 0.1          # not a degenerate comparison
    H = ours.cfg.hidden_size
    assert (a.taps[..., :H] - b.hidden_states[2]).abs().max().item() <= TOL        # layer 1 output
    assert (a.taps[..., H:2 * H] - b.hidden_states[1]).abs().max().item() <= TOL   # layer 0 output
    # transformers reports the last layer after the final norm; our tap is before it (docs/models.md, "Taps")
    assert (ours.model.norm(a.taps[..., 2 * H:]) - b.hidden_states[3]).abs().max().item() <= TOL
    assert (a.hidden - b.hidden_states[3]).abs().max().item() <= TOL
    # hidden is after the final norm: lm_head(hidden) == logits
    assert (ours.lm_head(a.hidden) - a.logits).abs().max().item() <= TOL


def test_cached_step_decode_matches(pair):
    ours, ref = pair
    cfg = ours.cfg
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = ref(ids).logits[0]
        kv = KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 32)
        rows = [ours(ids[:, :5], kv=kv).logits[0]]           # prefill chunk
        rows.append(ours(ids[:, 5:9], kv=kv).logits[0])      # a second chunk (chunked prefill / verify window)
        for t in range(9, 16):                               # one token at a time
            rows.append(ours(ids[:, t:t + 1], kv=kv).logits[0])
    assert kv.length == 16
    assert (torch.cat(rows) - full).abs().max().item() <= TOL


def test_training_forward_has_gradients_and_mtp(tmp_path):
    folder = make_tiny_target(tmp_path, mtp=True)
    model = load_target(folder)
    model.train()
    ids = torch.randint(0, model.cfg.vocab_size, (2, 9))
    out = model(ids)
    mtp_logits = model.mtp_logits(ids, out.hidden)
    assert mtp_logits.shape == (2, 8, model.cfg.vocab_size)
    loss = out.logits.logsumexp(-1).mean() + mtp_logits.logsumexp(-1).mean()
    loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
    assert model.mtp.fc.weight.grad is not None
    assert any(p.grad is not None for p in model.model.layers[0].mlp.experts.parameters())


def test_config_reads_hub_spellings():
    cfg = Qwen3MoeConfig.from_dict({
        "model_type": "qwen3_moe", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_local_experts": 4, "eos_token_id": [3, 4], "rope_theta": 5.0,
    })
    assert cfg.num_experts == 4 and cfg.head_dim == 4 and cfg.eos_token_id == [3, 4] and cfg.rope_theta == 5.0
    assert cfg.num_key_value_heads == 2 and cfg.mtp_layers == 0


@pytest.mark.parametrize("bad, msg", [
    ({"model_type": "llama"}, "qwen3_moe"),
    ({"use_sliding_window": True}, "sliding"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope type"),
    ({"hidden_act": "gelu"}, "silu"),
])
def test_config_refuses_unsupported(bad, msg):
    base = {"model_type": "qwen3_moe", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 2,
            "num_attention_heads": 2}
    with pytest.raises(ValueError, match=msg):
        Qwen3MoeConfig.from_dict({**base, **bad})
