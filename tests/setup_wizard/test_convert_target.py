"""setup_wizard/convert_target.py: a qwen3_moe checkpoint -> llama.cpp's qwen3moe GGUF (docs/formats.md,
"Converted target GGUF"), checked against a file written independently with gguf-py's own writer and quantizer."""

from __future__ import annotations

import json
import re

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from runtime.errors import ConfigError, ContractError, LoadError, UsageError
from runtime.formats import target_gguf as TG
from runtime.formats.gguf_meta import metadata, open_gguf
from runtime.formats.gguf_tokenizer import pre_type, tokenizer_from_metadata
from setup_wizard.convert_target import (
    CONVERTER_VERSION,
    check_target_gguf,
    convert_target,
    convert_target_to_store,
    validate_source,
)
from setup_wizard.store import Store
from tests.setup_wizard.target_gguf_helpers import BUNDLED, corpus, llamacpp_style_gguf, make_bpe_target

QUANTS = ("bf16", "q8_0", "q4_0")


def _tensors(path) -> dict[str, tuple[str, bytes]]:
    r = open_gguf(path)
    return {t.name: (t.tensor_type.name, np.asarray(t.data).tobytes()) for t in r.tensors}


def _leftovers(folder) -> list:
    return [p for p in folder.rglob("*") if p.name.endswith(".tmp")]


@pytest.fixture(scope="module")
def gpt2_target(tmp_path_factory):
    return make_bpe_target(tmp_path_factory.mktemp("src"), "gpt2-target", style="gpt-2")


@pytest.mark.parametrize("style", ["gpt-2", "qwen2"])
@pytest.mark.parametrize("quant", QUANTS)
def test_same_file_as_gguf_py_writer(tmp_path, style, quant):
    """Every tensor (name, type, bytes) and every metadata key but strata.* equal a file made the way llama.cpp's
    converter makes it, with gguf-py's TensorNameMap, writer and reference quantizer."""
    src = make_bpe_target(tmp_path, style=style, mtp=True, tie=(quant == "q4_0"))
    ref = llamacpp_style_gguf(src, tmp_path / "ref.gguf", quant, pre=style)
    ours = convert_target(src, quant, tmp_path / "out" / "model.gguf")
    assert _tensors(ours.path) == _tensors(ref)
    mo, mr = metadata(open_gguf(ours.path)), metadata(open_gguf(ref))
    assert {k: v for k, v in mo.items() if not k.startswith("strata.")} == mr
    assert mo["strata.quantization"] == quant and mo["strata.converter_version"] == CONVERTER_VERSION
    assert mo[TG.KEY_MTP_FILE] == TG.MTP_FILE and ours.mtp_path == ours.path.with_name(TG.MTP_FILE)
    assert ours.sha256 and not _leftovers(tmp_path)


def test_sharded_equals_single(tmp_path):
    a = make_bpe_target(tmp_path, "single", seed=3)
    b = make_bpe_target(tmp_path, "sharded", seed=3, sharded=True)
    ra = convert_target(a, "q8_0", tmp_path / "a" / "model.gguf")
    rb = convert_target(b, "q8_0", tmp_path / "b" / "model.gguf")
    assert _tensors(ra.path) == _tensors(rb.path)
    assert _tensors(ra.mtp_path) == _tensors(rb.mtp_path)


def test_mtp_file_layout(tmp_path, gpt2_target):
    """The MTP head's tensors go to mtp.gguf with gguf-py's NextN names at block L (docs/formats.md)."""
    res = convert_target(gpt2_target, "q8_0", tmp_path / "model.gguf")
    cfg = json.loads((gpt2_target / "config.json").read_text())
    L = cfg["num_hidden_layers"]
    r = open_gguf(res.mtp_path)
    names = {t.name: t.tensor_type.name for t in r.tensors}
    T = gguf.MODEL_TENSOR

    def n(kind):
        return gguf.TENSOR_NAMES[kind].format(bid=L) + ".weight"

    assert names[n(T.NEXTN_EH_PROJ)] == "Q8_0"
    for k in (T.NEXTN_ENORM, T.NEXTN_HNORM, T.NEXTN_SHARED_HEAD_NORM, T.ATTN_NORM, T.FFN_NORM, T.FFN_GATE_INP):
        assert names[n(k)] == "F32"
    for k in (T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.ATTN_OUT, T.FFN_GATE_EXP, T.FFN_UP_EXP, T.FFN_DOWN_EXP):
        assert names[n(k)] == "Q8_0"
    assert all(re.match(rf"blk\.{L}\.", k) for k in names)
    meta = metadata(r)
    assert meta["qwen3moe.block_count"] == L + 1 and meta["qwen3moe.nextn_predict_layers"] == 1
    tmeta = metadata(open_gguf(res.path))
    for k in ("strata.source.sha256", "strata.quantization", "strata.converter_version"):
        assert meta[k] == tmeta[k]
    # the eh_proj keeps the checkpoint's input order (embedding half, then hidden half)
    st = load_file(str(gpt2_target / "model.safetensors"))
    eh = next(t for t in r.tensors if t.name == n(T.NEXTN_EH_PROJ))
    got = gguf.quants.dequantize(np.asarray(eh.data), gguf.GGMLQuantizationType.Q8_0)
    want = gguf.quants.dequantize(gguf.quants.quantize(st["mtp.fc.weight"].float().numpy(),
                                                       gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(got, want)


def test_no_mtp_file_without_head(tmp_path):
    src = make_bpe_target(tmp_path, mtp=False)
    stale = tmp_path / "out" / TG.MTP_FILE
    stale.parent.mkdir()
    stale.write_bytes(b"old")
    res = convert_target(src, "bf16", tmp_path / "out" / "model.gguf")
    assert res.mtp_path is None and not stale.exists()
    assert TG.KEY_MTP_FILE not in metadata(open_gguf(res.path))


@pytest.mark.parametrize("style", ["gpt-2", "qwen2"])
def test_tokenizer_round_trip(tmp_path, style):
    """The tokenizer rebuilt from the GGUF metadata encodes and decodes as tokenizer.json does."""
    src = make_bpe_target(tmp_path, style=style)
    res = convert_target(src, "q8_0", tmp_path / "out" / "model.gguf")
    meta = metadata(open_gguf(res.path), "tokenizer.")
    assert meta["tokenizer.ggml.pre"] == style
    ours = tokenizer_from_metadata(meta)
    ref = Tokenizer.from_file(str(src / "tokenizer.json"))
    texts = corpus() + ["x = 12345\n\n\n  y<|endoftext|>z", "  é ü 😀 \r\n\t\t tabs", "I'll DON'T 3.14159"]
    for t in texts:
        a, b = ours.encode(t).ids, ref.encode(t).ids
        assert a == b
        assert ours.decode(a, skip_special_tokens=True) == ref.decode(b, skip_special_tokens=True)
    types = meta["tokenizer.ggml.token_type"]
    assert types[0] == gguf.TokenType.CONTROL and types[-1] == gguf.TokenType.UNUSED   # special; [PAD] rows
    assert meta["tokenizer.ggml.tokens"][-1].startswith("[PAD")


def test_bundled_pack_is_gpt2_not_qwen2():
    """Why the bundled pack is written with pre-type "gpt-2": its tokenizer.json splits with GPT-2's regex, and
    Qwen2's split (one digit at a time, newlines apart) tokenizes its code differently."""
    tj = json.loads((BUNDLED / "tokenizer.json").read_text())
    assert pre_type(tj) == "gpt-2"
    ref = Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    tokens = sorted(ref.get_vocab().items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    as_qwen2 = tokenizer_from_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": [t for t, _ in tokens], "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": [3 if t.startswith("<|") else 1 for t, _ in tokens]})
    code = corpus()[0]
    assert as_qwen2.encode(code).ids != ref.encode(code).ids


def test_unknown_pre_tokenizer_refused(tmp_path):
    src = make_bpe_target(tmp_path)
    tj = json.loads((src / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = {"type": "Whitespace"}
    (src / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(UsageError, match="pre-tokenizer that llama.cpp"):
        validate_source(src, "q8_0")


def test_refusals_leave_nothing(tmp_path):
    # a row length that Q8_0 cannot block (moe_intermediate 24): refused before writing, bf16 is fine
    src = make_bpe_target(tmp_path, "odd", moe_inter=24)
    with pytest.raises(ContractError, match=r"down_proj.*not a multiple of 32.*bf16"):
        convert_target(src, "q8_0", tmp_path / "o1" / "model.gguf")
    assert not (tmp_path / "o1" / "model.gguf").exists()
    convert_target(src, "bf16", tmp_path / "o2" / "model.gguf")
    # a dense layer: llama.cpp's qwen3moe has no place for it
    dense = make_bpe_target(tmp_path, "dense", mlp_only_layers=(0,))
    with pytest.raises(ConfigError, match="dense MLP"):
        validate_source(dense, "bf16")
    with pytest.raises(UsageError, match="unknown target quantization"):
        validate_source(src, "q5_0")
    # a NaN in a weight: found while writing, the temporary file removed
    nan = make_bpe_target(tmp_path, "nan")
    st = load_file(str(nan / "model.safetensors"))
    st["model.layers.1.self_attn.o_proj.weight"][0, 0] = float("nan")
    save_file(st, str(nan / "model.safetensors"))
    with pytest.raises(ContractError, match="o_proj.*NaN"):
        convert_target(nan, "q4_0", tmp_path / "o3" / "model.gguf")
    assert not (tmp_path / "o3" / "model.gguf").exists() and not _leftovers(tmp_path)
    # an unexpected tensor
    extra = make_bpe_target(tmp_path, "extra")
    st = load_file(str(extra / "model.safetensors"))
    st["model.layers.0.mlp.shared_expert.weight"] = torch.zeros(4, 64, dtype=torch.bfloat16)
    save_file(st, str(extra / "model.safetensors"))
    with pytest.raises(LoadError, match="unexpected tensor model.layers.0.mlp.shared_expert.weight"):
        validate_source(extra, "bf16")


def test_read_back_check_finds_damage(tmp_path, gpt2_target):
    res = convert_target(gpt2_target, "q8_0", tmp_path / "model.gguf")
    src = validate_source(gpt2_target, "q8_0")
    assert check_target_gguf(res.path, src, "q8_0", res.source_sha256, mtp=False) == []
    assert check_target_gguf(res.mtp_path, src, "q8_0", res.source_sha256, mtp=True) == []
    assert check_target_gguf(res.path, src, "q4_0", res.source_sha256, mtp=False)      # wrong quantization
    assert check_target_gguf(res.path, src, "q8_0", "0" * 64, mtp=False)               # wrong source
    assert check_target_gguf(res.mtp_path, src, "q8_0", res.source_sha256, mtp=False)  # the wrong file
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(res.path.read_bytes()[:-100])
    assert check_target_gguf(cut, src, "q8_0", res.source_sha256, mtp=False)


def test_store_cache_reuse_and_repair(tmp_path, gpt2_target):
    store = Store(tmp_path / "home")
    a = convert_target_to_store(gpt2_target, "q4_0", store, source_name="tiny")
    assert not a.reused and a.mtp_path is not None and a.path.parent.name.endswith(f"-q4_0-c{CONVERTER_VERSION}")
    b = convert_target_to_store(gpt2_target, "q4_0", store, source_name="tiny")
    assert b.reused and (b.sha256, b.mtp_sha256) == (a.sha256, a.mtp_sha256)
    item = next(store.items())
    assert store.verify_item(item) == [] and item.size == a.size + a.mtp_size
    # a same-size edit of the MTP file is caught by its hash: the pair is rebuilt
    raw = bytearray(a.mtp_path.read_bytes())
    raw[-1] ^= 0xFF
    a.mtp_path.write_bytes(bytes(raw))
    assert store.verify_item(next(store.items()))
    c = convert_target_to_store(gpt2_target, "q4_0", store, source_name="tiny")
    assert not c.reused and c.mtp_sha256 == a.mtp_sha256
    # another quantization is another item
    d = convert_target_to_store(gpt2_target, "q8_0", store, source_name="tiny")
    assert d.path.parent != a.path.parent and len(list(store.items())) == 2
