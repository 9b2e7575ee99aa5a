"""CPU weight layout (runtime/cpu_layout.py): float linear weights held input-major without a second copy, views
into stacked matrices kept shared, tied embeddings left alone, and the engine's outputs unchanged in value."""

import pytest
import torch
from torch import nn

import runtime.experts as experts_mod
from runtime.cpu_layout import input_major, relayout
from runtime.engine import Engine
from tests.runtime.tiny import make_tiny_target, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


def _storages(model: nn.Module) -> dict[int, int]:
    out = {}
    for p in model.parameters():
        s = p.untyped_storage()
        out[s.data_ptr()] = s.nbytes()
    return out


def test_input_major_keeps_values_and_shape():
    w = torch.randn(6, 4)
    v = input_major(w)
    assert v.shape == w.shape and torch.equal(v, w) and v.stride() == (1, 6)
    assert v.t().is_contiguous()


@pytest.mark.parametrize("tie", [False, True])
def test_engine_on_cpu_holds_linear_weights_input_major(tmp_path, monkeypatch, tie):
    folder = make_tiny_target(tmp_path, seed=4, tie=tie)
    monkeypatch.setattr(experts_mod, "CPU_INPUT_MAJOR", False)
    ref = Engine.build(folder, "mtp", device="cpu", context=64, block=4)
    monkeypatch.setattr(experts_mod, "CPU_INPUT_MAJOR", True)
    eng = Engine.build(folder, "mtp", device="cpu", context=64, block=4)
    m = eng.model
    assert sum(_storages(m).values()) == sum(_storages(ref.model).values())     # no second copy of anything
    layer = m.model.layers[0]
    a = layer.self_attn
    assert a.qkv_weight.stride() == (1, a.qkv_weight.shape[0])
    for p in (a.q_proj, a.k_proj, a.v_proj):                     # still views of the stacked matrix
        assert p.weight.untyped_storage().data_ptr() == a.qkv_weight.untyped_storage().data_ptr()
    assert a.o_proj.weight.stride() == (1, a.o_proj.weight.shape[0])
    mlp = layer.mlp
    if mlp.dense_gu is not None:
        assert mlp.experts[1].gate_proj.weight.untyped_storage().data_ptr() == mlp.dense_gu.untyped_storage().data_ptr()
    head = m.lm_head.weight
    if tie:          # the head is the embedding table: left as it is (an embedding reads rows)
        assert head.data_ptr() == m.model.embed_tokens.weight.data_ptr() and head.is_contiguous()
    else:
        assert head.stride() == (1, head.shape[0])
    for (name, p), (_, q) in zip(m.named_parameters(), ref.model.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    # the same logits up to rounding (another operand order may round apart), and drafted = alone bit for bit
    ids = [5, 9, 11, 2, 7, 30, 12]
    with torch.no_grad():
        torch.testing.assert_close(m(torch.tensor([ids])).logits, ref.model(torch.tensor([ids])).logits,
                                   rtol=0, atol=1e-5)
    alone = eng.generate(ids, max_new_tokens=12, stop_ids=set(), draft=False).token_ids
    assert eng.generate(ids, max_new_tokens=12, stop_ids=set(), draft=True).token_ids == alone


def test_relayout_twice_moves_nothing(tmp_path, monkeypatch):
    eng = Engine.build(make_tiny_target(tmp_path, seed=5), "none", device="cpu", context=32)
    before = _storages(eng.model)
    assert relayout(eng.model) == 0
    assert _storages(eng.model) == before
