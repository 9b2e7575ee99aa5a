"""The DFlash2 contract module: config reading, inventory, names, GGUF metadata."""

from __future__ import annotations

import pytest

from runtime.drafters.dflash2.contract import (
    DFlash2Geometry,
    check_inventory,
    expected_tensors,
    gguf_metadata,
    gguf_to_hf,
    hf_to_gguf,
    tensor_count,
)
from runtime.errors import ContractError

# The official head's config.json shape (incoai/Qwen3.8-Flash-Next-DFlash2 layout, transformers 5 style).
OFFICIAL = {
    "architectures": ["DFlash2DraftModel"],
    "hidden_size": 6656, "intermediate_size": 19968, "num_hidden_layers": 5, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5, "vocab_size": 202048,
    "num_target_layers": 52, "is_causal": False, "sliding_window": 2048, "use_sliding_window": True,
    "layer_types": ["sliding_attention"] * 5,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "dflash_config": {
        "block_size": 16, "conv_group_size": 16, "conv_kernel_size": 2, "final_logit_softcapping": 20.0,
        "mask_token_id": 201818, "output_multiplier": 0.19611613513818404, "selector_rank": 256,
        "selector_top_k": 16, "target_layer_ids": [1, 13, 25, 37, 49],
    },
}


def official() -> DFlash2Geometry:
    return DFlash2Geometry.from_config(OFFICIAL)


def inventory(geom, v1=False, dtype="BF16"):
    return {n: (s, dtype) for n, (s, _k) in expected_tensors(geom, v1=v1).items()}


def test_official_geometry_and_81_tensors():
    g = official()
    assert g.rope_theta == 500000.0 and g.final_logit_softcapping == 20.0 and g.sliding_window == 2048
    assert g.layer_window(0) == 2048 and not g.is_causal and g.target_layer_ids == (1, 13, 25, 37, 49)
    exp = expected_tensors(g)
    assert len(exp) == 81 == tensor_count(5)
    kinds = [k for _s, k in exp.values()]
    assert kinds.count("backbone") == 36 and len(kinds) - kinds.count("backbone") == 45
    assert exp["fc.weight"][0] == (6656, 5 * 6656)
    assert exp["layers.0.attention_conv.kernel_projection.weight"][0] == (1664, 6656)
    assert exp["layers.4.mlp_conv.base_kernel"][0] == (2, 2, 6656)
    assert exp["candidate_selector.successor_codebook"][0] == (202048, 256)
    assert len(expected_tensors(g, v1=True)) == tensor_count(5, v1=True) == 58
    assert check_inventory(inventory(g), g) == "v2"


def test_dflash_config_wins_and_defaults():
    cfg = {k: v for k, v in OFFICIAL.items() if k not in ("dflash_config", "layer_types", "rope_parameters")}
    cfg = {**cfg, "block_size": 8, "rope_theta": 1e6, "target_layer_ids": [0, 1],
           "dflash_config": {"block_size": 4, "mask_token_id": 7}}
    g = DFlash2Geometry.from_config(cfg)
    assert g.block_size == 4 and g.rope_theta == 1e6 and g.mask_token_id == 7 and g.target_layer_ids == (0, 1)
    assert (g.conv_kernel_size, g.conv_group_size, g.selector_rank, g.selector_top_k) == (2, 16, 256, 16)
    assert g.output_multiplier == 1.0 and g.final_logit_softcapping is None and g.layer_window(0) is None


@pytest.mark.parametrize(
    "patch, needle",
    [
        ({"dflash_config": {**OFFICIAL["dflash_config"], "mask_token_id": 202048}}, "mask_token_id 202048"),
        ({"num_key_value_heads": 7}, "multiple of num_key_value_heads"),
        ({"dflash_config": {**OFFICIAL["dflash_config"], "conv_group_size": 15}}, "conv_group_size (15)"),
        ({"dflash_config": {**OFFICIAL["dflash_config"], "target_layer_ids": [1, 52]}}, "num_target_layers"),
        ({"hidden_size": "big"}, "hidden_size"),
        ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ],
)
def test_bad_config_values(patch, needle):
    with pytest.raises(ContractError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        DFlash2Geometry.from_config({**OFFICIAL, **patch})


def test_missing_required_key():
    cfg = dict(OFFICIAL)
    del cfg["vocab_size"]
    with pytest.raises(ContractError, match="lacks the required key 'vocab_size'"):
        DFlash2Geometry.from_config(cfg)


def test_inventory_errors_name_the_tensor():
    g = official()
    inv = inventory(g)
    missing = dict(inv)
    del missing["layers.3.mlp.up_proj.weight"]
    with pytest.raises(ContractError, match=r"missing tensor 'layers.3.mlp.up_proj.weight'; this file"):
        check_inventory(missing, g)
    with pytest.raises(ContractError, match=r"unexpected tensor 'lm_head.weight'"):
        check_inventory({**inv, "lm_head.weight": ((202048, 6656), "BF16")}, g)
    with pytest.raises(ContractError, match=r"'fc.weight' has shape \[6656, 6656\], expected \[6656, 33280\]"):
        check_inventory({**inv, "fc.weight": ((6656, 6656), "BF16")}, g)
    with pytest.raises(ContractError, match=r"'norm.weight' has dtype F32, expected BF16"):
        check_inventory({**inv, "norm.weight": ((6656,), "F32")}, g)
    # quantized backbone only in a converted file, and never for the selector
    q = {**inv, "layers.0.self_attn.q_proj.weight": ((4096, 6656), "Q4_0")}
    with pytest.raises(ContractError, match="dtype Q4_0, expected BF16"):
        check_inventory(q, g)
    assert check_inventory(q, g, allow_quantized=True) == "v2"
    with pytest.raises(ContractError, match="selector_hidden|hidden_projection.weight' has dtype Q8_0"):
        check_inventory({**inv, "candidate_selector.hidden_projection.weight": ((256, 6656), "Q8_0")}, g,
                        allow_quantized=True)
    two = dict(missing)
    del two["norm.weight"]
    with pytest.raises(ContractError, match=r"\(and 1 more problems\)"):
        check_inventory(two, g)


def test_v1_layout():
    g = official()
    v1 = inventory(g, v1=True)
    with pytest.raises(ContractError, match="missing tensor 'layers.0.attention_conv.base_kernel'"):
        check_inventory(v1, g)
    assert check_inventory(v1, g, allow_v1=True) == "v1"
    partial = {**v1, "layers.0.mlp_conv.base_kernel": ((2, 2, 6656), "BF16")}
    with pytest.raises(ContractError, match="missing tensor"):
        check_inventory(partial, g, allow_v1=True)


def test_name_mapping_round_trip():
    g = official()
    names = set()
    for name in expected_tensors(g):
        gg = hf_to_gguf(name)
        assert gguf_to_hf(gg) == name
        names.add(gg)
    assert len(names) == 81
    assert hf_to_gguf("norm.weight") == "output_norm.weight"
    assert hf_to_gguf("layers.2.self_attn.o_proj.weight") == "blk.2.attn_output.weight"
    assert hf_to_gguf("layers.4.attention_conv.base_kernel") == "blk.4.attn_conv_base"
    assert hf_to_gguf("layers.0.mlp_conv.kernel_projection.weight") == "blk.0.ffn_conv_proj.weight"
    assert hf_to_gguf("candidate_selector.predecessor_codebook") == "selector_predecessor.weight"
    for bad in ("lm_head.weight", "layers.x.mlp.up_proj.weight", "layers.01.mlp.up_proj.weight"):
        with pytest.raises(ContractError, match="not part of the DFlash2"):
            hf_to_gguf(bad)
    with pytest.raises(ContractError, match="GGUF tensor 'token_embd.weight'"):
        gguf_to_hf("token_embd.weight")


def test_gguf_metadata_round_trip():
    g = official()
    meta = {k: v for k, (_t, v) in gguf_metadata(g).items()}
    assert meta["dflash2.final_logit_softcapping"] == 20.0 and meta["dflash2.attention.sliding_window"] == 2048
    assert meta["dflash2.num_target_layers"] == 52              # optional key: the loader checks the target depth
    back = DFlash2Geometry.from_gguf_metadata({"general.architecture": "dflash2", **meta})
    assert back.__dict__ == g.__dict__
    with pytest.raises(ContractError, match="general.architecture is 'llama'"):
        DFlash2Geometry.from_gguf_metadata({"general.architecture": "llama", **meta})
    del meta["dflash2.selector_rank"]
    with pytest.raises(ContractError, match="'dflash2.selector_rank'"):
        DFlash2Geometry.from_gguf_metadata({"general.architecture": "dflash2", **meta})
    mixed = {**OFFICIAL, "layer_types": ["sliding_attention"] * 4 + ["full_attention"]}
    with pytest.raises(ContractError, match="attend differently"):
        gguf_metadata(DFlash2Geometry.from_config(mixed))
    # a file without the optional key (older converters) still reads, with the depth unknown
    meta = {k: v for k, (_t, v) in gguf_metadata(g).items() if k != "dflash2.num_target_layers"}
    assert DFlash2Geometry.from_gguf_metadata({"general.architecture": "dflash2", **meta}).num_target_layers is None


BASE = {k: v for k, v in OFFICIAL.items() if k not in ("is_causal", "sliding_window", "use_sliding_window",
                                                        "layer_types")}


@pytest.mark.parametrize(("keys", "windows", "causal"), [
    # transformers' Qwen3Config (the reference's config): use_sliding_window defaults to false and clears the window
    ({}, [None] * 5, [False] * 5),
    ({"sliding_window": 64, "layer_types": ["sliding_attention"] * 5}, [None] * 5, [True] * 5),
    ({"sliding_window": 64, "use_sliding_window": True, "layer_types": ["sliding_attention"] * 5}, [64] * 5,
     [True] * 5),
    ({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 3}, [None] * 3 + [64] * 2,
     [False] * 3 + [True] * 2),
    ({"sliding_window": 64, "use_sliding_window": True}, [None] * 5, [False] * 5),     # max_window_layers 28
    ({"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 3, "is_causal": False},
     [None] * 3 + [64] * 2, [False] * 5),
    ({"is_causal": True}, [None] * 5, [True] * 5),
])
def test_attention_defaults_follow_the_reference(keys, windows, causal):
    """Without `is_causal`, exactly the sliding layers are causal; with it, every layer follows it."""
    g = DFlash2Geometry.from_config({**BASE, **keys})
    assert [g.layer_window(i) for i in range(5)] == windows
    assert [g.layer_causal(i) for i in range(5)] == causal
    if len({(w, c) for w, c in zip(windows, causal, strict=True)}) == 1:    # GGUF carries the effective values
        meta = {k: v for k, (_t, v) in gguf_metadata(g).items()}
        back = DFlash2Geometry.from_gguf_metadata({"general.architecture": "dflash2", **meta})
        assert [back.layer_window(i) for i in range(5)] == windows
        assert [back.layer_causal(i) for i in range(5)] == causal
    else:
        with pytest.raises(ContractError, match="attend differently"):
            gguf_metadata(g)
    with pytest.raises(ContractError, match="sliding_window must be a positive integer"):
        DFlash2Geometry.from_config({**BASE, "use_sliding_window": True, "sliding_window": -1})


def test_v1_style_config_without_layer_types():
    """z-lab v1 configs: block_size at top level, use_sliding_window without layer_types (Qwen3Config rule)."""
    cfg = {
        "architectures": ["DFlashDraftModel"], "hidden_size": 3072, "num_hidden_layers": 6, "vocab_size": 248320,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 9216,
        "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 10000000},
        "use_sliding_window": True, "sliding_window": 4096, "block_size": 16,
        "dflash_config": {"mask_token_id": 248077, "target_layer_ids": [1, 7, 14, 20, 26, 32, 39, 45]},
    }
    g = DFlash2Geometry.from_config(cfg)
    assert g.block_size == 16 and g.rope_theta == 1e7 and not g.is_causal
    assert all(g.layer_window(i) is None for i in range(6))
    g2 = DFlash2Geometry.from_config({**cfg, "max_window_layers": 4})
    assert [g2.layer_window(i) for i in range(6)] == [None] * 4 + [4096] * 2
    assert len(expected_tensors(g, v1=True)) == tensor_count(6, v1=True)
