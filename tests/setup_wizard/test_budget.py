"""The memory budget against hand-computed figures and its invariants."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.drafters.dflash2.contract import DFlash2Geometry, expected_tensors, weight_bytes
from runtime.errors import QuantFormatError
from runtime.models.target_config import TargetGeometry
from setup_wizard.budget import (
    LARGE_SEGMENT,
    MIB,
    BudgetError,
    BudgetInputs,
    compute_budget,
    kv_bytes,
    recommend_context,
)

TINY = {
    "model_type": "qwen3_moe",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 100,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
    "max_position_embeddings": 4096,
}

DF = {
    "architectures": ["DFlash2DraftModel"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 1000,
    "dflash_config": {"block_size": 8, "target_layer_ids": [0, 1, 2], "conv_kernel_size": 2, "mask_token_id": 999,
                      "conv_group_size": 16, "selector_rank": 8},
}


def test_seed_figure_dflash2_private_kv_is_20_kib_per_position_fp16():
    # official geometry: 5 layers, 32 query heads, 8 KV heads of 128
    assert kv_bytes(5, 8, 128, 2, 1) == 20 * 1024
    g = DFlash2Geometry.from_config({**DF, "num_hidden_layers": 5, "num_attention_heads": 32,
                                     "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 4096})
    t = TargetGeometry.from_config({**TINY, "hidden_size": 4096}, has_mtp=False)
    b = compute_budget(t, "dflash2", BudgetInputs(context=8192, block=4, device_type="cuda",
                                                  available_bytes=1 << 40, total_bytes=1 << 40), dflash2=g)
    assert b.items["drafter_kv"] == 20 * 1024 * 8192


def _backbone_shapes(g):
    return [shape for shape, kind in expected_tensors(g).values() if kind == "backbone"]


def _float_elems(g):
    return sum(math.prod(shape) for shape, kind in expected_tensors(g).values() if kind != "backbone")


def test_official_inventory_counts():
    g = DFlash2Geometry.from_config({**DF, "num_hidden_layers": 5})
    assert len(_backbone_shapes(g)) == 36  # 15*L + 6 = 81 tensors, 45 of them stay BF16


def test_dflash2_weight_bytes_by_hand():
    g = DFlash2Geometry.from_config(DF)
    # BF16 tensors: 2H + L*(2H + 2hd + 2*2KH + 2*(2KH/G)*H) + rH + 2Vr = 128 + 2*2720 + 512 + 16000 = 22080
    assert _float_elems(g) == 22080
    # backbone: fc 64*192 + 2 * (4096 + 2048 + 2048 + 4096 + 3 * 8192) = 86016 elements = 2688 blocks of 32
    assert sum(r * c for r, c in _backbone_shapes(g)) == 86016
    assert weight_bytes(g, "bf16") == 2 * 22080 + 2 * 86016
    assert weight_bytes(g, "q8_0") == 2 * 22080 + 2688 * 34
    assert weight_bytes(g, "q5_0") == 2 * 22080 + 2688 * 22
    assert weight_bytes(g, "q4_0") == 2 * 22080 + 2688 * 18


def test_dflash2_geometry_from_gguf_metadata_equals_config():
    meta = {
        "general.architecture": "dflash2", "dflash2.mask_token_id": 999, "dflash2.selector_top_k": 16,
        "dflash2.attention.layer_norm_rms_epsilon": 1e-6, "dflash2.rope.freq_base": 10000.0,
        "dflash2.embedding_length": 64, "dflash2.feed_forward_length": 128, "dflash2.block_count": 2,
        "dflash2.attention.head_count": 4, "dflash2.attention.head_count_kv": 2,
        "dflash2.attention.key_length": 16, "dflash2.vocab_size": 1000, "dflash2.target_layers": [0, 1, 2],
        "dflash2.conv_kernel_size": 2, "dflash2.conv_group_size": 16, "dflash2.selector_rank": 8,
        "dflash2.block_size": 8,
    }
    assert DFlash2Geometry.from_gguf_metadata(meta) == DFlash2Geometry.from_config(DF)


def test_quant_row_not_multiple_of_32_is_refused():
    g = DFlash2Geometry.from_config({**DF, "hidden_size": 48})   # fc rows of 3 * 48 values
    with pytest.raises(QuantFormatError, match="multiple of 32"):
        weight_bytes(g, "q4_0")


def test_target_items_by_hand_cpu_fp32():
    t = TargetGeometry.from_config(TINY, has_mtp=True)
    # attention 3*32*32 + 2*32*16... = 3088; layer = 2H + attn + router E*H = 3280; +2VH + H
    assert t.dense_elems() == 12992
    assert t.expert_elems() == 1536 and t.total_experts == 8
    assert t.mtp_elems() == 64 + 2048 + 32 + 3280 + 4 * 1536
    inp = BudgetInputs(context=128, block=4, device_type="cpu", available_bytes=10 * MIB, total_bytes=10 * MIB,
                       weight_bytes=4, kv_bytes=4, prefill_chunk=64)
    b = compute_budget(t, "mtp", inp)
    assert b.items["target_dense_weights"] == 12992 * 4
    # + the chain's int8 copy of the float head on a CPU: a byte per weight, a bf16 scale per row
    assert b.items["drafter_weights"] == t.mtp_elems() * 4 + 100 * 32 + 2 * 100
    # + the compiled step's spare slots past the context (ceil((128 + 16) / 128) * 128 + 128 - 128 = 256)
    assert b.items["target_kv"] == 2 * 2 * 2 * 8 * 4 * (128 + 256)
    assert b.items["drafter_kv"] == 1 * 2 * 2 * 8 * 4 * 128
    assert b.items["logits"] == 2 * 4 * 100 * 4
    assert b.items["headroom"] == 0 and b.items["reserve"] == 0
    assert b.expert_cache_slots == 8 and b.fits
    assert list(b.table())[-1] == "expert_cache"


def test_a_compiled_chain_counts_its_bf16_cache(monkeypatch):
    """Where the MTP chain's CPU step is compiled its own cache is bf16 beside fp32 weights (runtime/drafters/mtp.py
    `use_compiled`): 2 bytes a value; with compiling off, the weights' 4."""
    t = TargetGeometry.from_config(TINY, has_mtp=True)
    inp = BudgetInputs(context=128, block=4, device_type="cpu", available_bytes=10 * MIB, total_bytes=10 * MIB,
                       weight_bytes=4, kv_bytes=4, prefill_chunk=64)
    monkeypatch.setenv("STRATA_COMPILE", "1")
    assert compute_budget(t, "mtp", inp).items["drafter_kv"] == 1 * 2 * 2 * 8 * 2 * 128
    monkeypatch.setenv("STRATA_COMPILE", "0")
    assert compute_budget(t, "mtp", inp).items["drafter_kv"] == 1 * 2 * 2 * 8 * 4 * 128


@pytest.mark.parametrize("kw", [dict(mlp_only_layers=(1,)), dict(decoder_sparse_step=2, tie=True), dict()])
def test_config_arithmetic_matches_a_real_checkpoint_inventory(tmp_path, kw):
    """Element counts from config.json equal the tensors of a real tiny checkpoint (MTP head included)."""
    from setup_wizard.inspection import safetensors_inventory
    from tests.runtime.tiny import make_tiny_target

    folder = make_tiny_target(tmp_path, mtp=True, **kw)
    cfg = json.loads((folder / "config.json").read_text())
    inv = safetensors_inventory(folder)
    t = TargetGeometry.from_config(cfg)
    assert t.has_mtp
    exact = t.with_inventory(inv)
    assert exact.dense_elems() == t.dense_elems()
    assert exact.mtp_elems() == t.mtp_elems()
    routed = sum(v for k, v in inv.items() if k.startswith("model.layers.") and ".mlp.experts." in k)
    assert routed == t.total_experts * t.expert_elems()


def test_dflash2_arithmetic_matches_the_contract_inventory():
    cfg = {**DF, "num_hidden_layers": 5}
    tensors = expected_tensors(DFlash2Geometry.from_config(cfg))
    assert len(tensors) == 81
    g = DFlash2Geometry.from_config(cfg)
    numel = {k: int(__import__("math").prod(shape)) for k, (shape, _) in tensors.items()}
    backbone = [k for k, (_, kind) in tensors.items() if kind == "backbone"]
    assert len(backbone) == 36
    assert sum(numel[k] for k in backbone) == sum(r * c for r, c in _backbone_shapes(g))
    assert sum(v for k, v in numel.items() if k not in backbone) == _float_elems(g)


def test_gpu_partial_cache_and_does_not_fit():
    t = TargetGeometry.from_config(TINY, has_mtp=True)
    base = dict(context=128, block=4, device_type="cuda", weight_bytes=2, kv_bytes=2, headroom_bytes=0)
    b0 = compute_budget(t, "none", BudgetInputs(available_bytes=1 << 30, total_bytes=1 << 30, **base))
    fixed = b0.fixed_bytes
    # fewer slots than experts: the offloaded layout (one slot pool instead of stacked layers) moves the allocator's
    # share (here by a 2 MiB segment or two, far more than these 3 KiB experts), and the slots are settled for it
    partial = 0
    for mib in range(5):
        for k in range(9):
            avail = fixed + k * b0.expert_bytes + 5 + mib * (1 << 20)
            b = compute_budget(t, "none", BudgetInputs(available_bytes=avail, total_bytes=1 << 30, **base))
            if not b.fits:
                continue
            assert b.remaining_bytes == avail - b.fixed_bytes - b.expert_cache_slots * b.expert_bytes >= 0
            if b.offloaded:
                partial += 1
                assert 0 <= b.remaining_bytes < b.expert_bytes
                assert b.dynamic_slots == min(4 * t.top_k, t.experts, b.expert_cache_slots)
    assert partial > 0
    bad = compute_budget(t, "none", BudgetInputs(available_bytes=fixed - 1, total_bytes=1 << 30, **base))
    assert not bad.fits and bad.expert_cache_slots == 0 and "Does not fit" in bad.reason


def test_mtp_refused_without_head():
    t = TargetGeometry.from_config(TINY, has_mtp=False)
    with pytest.raises(BudgetError, match="no MTP head"):
        compute_budget(t, "mtp", BudgetInputs(context=16, block=2, device_type="cpu", available_bytes=1 << 30,
                                              total_bytes=1 << 30))


@settings(max_examples=60, deadline=None)
@given(
    c1=st.integers(1, 1 << 16), c2=st.integers(1, 1 << 16), avail=st.integers(0, 1 << 34),
    drafter=st.sampled_from(["mtp", "dflash2", "none"]), quant=st.sampled_from(["bf16", "q8_0", "q5_0", "q4_0"]),
    dev=st.sampled_from(["cpu", "cuda"]), reserve=st.integers(0, 1 << 30), block=st.integers(1, 16),
)
def test_monotone_in_context_and_never_negative(c1, c2, avail, drafter, quant, dev, reserve, block):
    lo, hi = sorted((c1, c2))
    t = TargetGeometry.from_config(TINY, has_mtp=True)
    g = DFlash2Geometry.from_config({**DF, "hidden_size": 32})
    kw = dict(block=block, device_type=dev, available_bytes=avail, total_bytes=1 << 34, reserve_bytes=reserve)
    a = compute_budget(t, drafter, BudgetInputs(context=lo, **kw), dflash2=g, quant=quant)
    b = compute_budget(t, drafter, BudgetInputs(context=hi, **kw), dflash2=g, quant=quant)
    for x in (a, b):
        assert 0 <= x.expert_cache_slots <= x.total_experts
        assert all(v >= 0 for v in x.items.values())
        if x.fits:
            assert x.fixed_bytes + x.expert_cache_bytes <= avail
    # On CUDA the budget predicts *reserved* memory, packed into the caching allocator's segments as it does;
    # that packing (like the real allocator) can shrink by less than one 20 MiB segment when a growing tensor
    # moves to another size class. Everything else only grows with the context.
    slack = LARGE_SEGMENT if dev == "cuda" else 0
    assert b.fixed_bytes >= a.fixed_bytes - slack
    assert b.expert_cache_slots <= a.expert_cache_slots
    assert not (b.fits and not a.fits)


def test_recommend_context_prefers_long_when_everything_fits():
    t = TargetGeometry.from_config(TINY, has_mtp=True)
    inp = BudgetInputs(context=1, block=4, device_type="cpu", available_bytes=1 << 33, total_bytes=1 << 33,
                       weight_bytes=4, kv_bytes=4)
    ctx, why = recommend_context(t, "mtp", inp)
    assert ctx == 4096 and why  # capped by max_position_embeddings


def test_gpu_scratch_counts_the_dequantized_matrix_of_a_quantized_target():
    """A block-format target on a GPU dequantizes one matrix at a time for windows of 2+ rows
    (runtime/gpu/dense_kernels.py `quant_linear`): the scratch grows by the largest such matrix in the compute dtype
    (here the stacked q/k/v, (128 + 2 * 64) x 64, larger than o_proj 64 x 128 and the vocabulary head 100 x 64); a
    BF16 target, or a CPU, needs none."""
    from dataclasses import replace

    t = TargetGeometry.from_config({**TINY, "hidden_size": 64, "head_dim": 32, "moe_intermediate_size": 32},
                                   has_mtp=False)
    base = dict(context=128, block=4, weight_bytes=2, kv_bytes=2, headroom_bytes=0, available_bytes=1 << 30,
                total_bytes=1 << 30)
    for dev in ("cuda", "cpu"):
        plain = compute_budget(t, "none", BudgetInputs(device_type=dev, **base)).items["scratch"]
        quant = compute_budget(replace(t, quant="q4_0"), "none", BudgetInputs(device_type=dev, **base)).items["scratch"]
        assert quant - plain == (256 * 64 * 2 if dev == "cuda" else 0), dev
