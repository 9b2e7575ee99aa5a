"""Tiny byte-level BPE Qwen3-MoE checkpoints, and a GGUF writer independent of Strata's converter.

`llamacpp_style_gguf` writes a target GGUF the way llama.cpp's `convert_hf_to_gguf.py` does for `Qwen3MoeForCausalLM`
(names from gguf-py's `TensorNameMap`, experts stacked with numpy, `gguf.quants.quantize`, the `add_*` metadata
calls, the vocabulary through transformers' tokenizer and gguf-py's `SpecialVocab`), sharing no code with
setup_wizard/convert_target.py, so the tests can compare the two files byte for byte.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.runtime.tiny import random_state, tiny_config

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "calibrate" / "prompts"
BUNDLED = ROOT / "setup_wizard" / "bundled" / "strata-nano"
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")


def corpus() -> list[str]:
    return [(PROMPTS / n).read_text() for n in sorted(os.listdir(PROMPTS))]


def bpe_tokenizer(style: str, vocab: int = 320):
    """A byte-level BPE trained on the calibration prompts, pre-tokenized like GPT-2 ("gpt-2", as the bundled pack)
    or like Qwen2/Qwen3 ("qwen2": NFC, the Qwen regex split, ByteLevel without regex). Ids 0/1 are special."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if style == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    return tok


def make_bpe_target(root: str | Path, name: str = "bpe-target", *, style: str = "gpt-2", tok_vocab: int = 320,
                    dtype: torch.dtype = torch.bfloat16, sharded: bool = False, seed: int = 0, **cfg: Any) -> Path:
    """A tiny random qwen3_moe folder with a byte-level BPE tokenizer; rows are multiples of 32 by default."""
    kw: dict[str, Any] = dict(vocab=tok_vocab + 16, hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32,
                              experts=4, top_k=2, moe_inter=32, inter=64, eos_token_id=0)
    kw.update(cfg)
    conf = tiny_config(**kw)
    state = {k: v.to(dtype) for k, v in random_state(conf, seed=seed).items()}
    folder = Path(root) / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(conf, indent=1))
    if sharded:
        keys = sorted(state)
        parts = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
                 "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
        wm = {}
        for fn, ks in parts.items():
            save_file({k: state[k] for k in ks}, str(folder / fn))
            wm.update(dict.fromkeys(ks, fn))
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    else:
        save_file(state, str(folder / "model.safetensors"))
    bpe_tokenizer(style, tok_vocab).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
         "bos_token": None, "add_bos_token": False}))
    return folder


def copy_bundled(root: str | Path) -> Path:
    """The bundled pack's target, copied (tests may modify it)."""
    dst = Path(root) / "strata-nano"
    shutil.copytree(BUNDLED, dst)
    return dst


# ------------------------------------------------------------------------------------------------------------------
# the independent writer

_QT = {"bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
       "q4_0": gguf.GGMLQuantizationType.Q4_0}
_FT = {"bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
       "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}


def _hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _vocab(folder: Path, vocab_size: int) -> tuple[list[str], list[int]]:
    """llama.cpp converter's `get_vocab_base`, through transformers' tokenizer."""
    from transformers import PreTrainedTokenizerFast

    tk = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    reverse = {i: t for t, i in tk.get_vocab().items()}
    added = tk.get_added_vocab()
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif reverse[i] in added:
            t = reverse[i]
            special = tk.added_tokens_decoder[i].special or (t.startswith("<|") and t.endswith("|>"))
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
            tokens.append(t)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
    return tokens, types


def llamacpp_style_gguf(folder: str | Path, out: str | Path, ftype: str, *, pre: str, split_max_tensors: int = 0
                        ) -> Path:
    """Write `out` as llama.cpp's converter does for this checkpoint (the target only: llama.cpp drops nothing and
    refuses `mtp.*`, so the MTP tensors are skipped here). split_max_tensors: in parts of at most that many tensors,
    as `--split-max-tensors` writes them (`OUT-00001-of-0000N.gguf`, ...); returns the first part's path."""
    folder, out = Path(folder), Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    hp = json.loads((folder / "config.json").read_text())
    arch = gguf.MODEL_ARCH.QWEN3MOE
    n_layers = hp["num_hidden_layers"]
    tmap = gguf.get_tensor_name_map(arch, n_layers)
    w = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch], split_max_tensors=split_max_tensors)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(folder.name)
    w.add_block_count(n_layers)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_rope_freq_base(hp["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_expert_count(hp["num_experts"])
    w.add_expert_used_count(hp["num_experts_per_tok"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_file_type(_FT[ftype])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tokens, types = _vocab(folder, hp["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(w)

    st = _hf_tensors(folder)
    experts: dict[int, dict[str, np.ndarray]] = {}
    n_exp = hp["num_experts"]
    for name in sorted(st):
        if name.startswith("mtp."):
            continue
        data = st[name].to(torch.float32).numpy()
        bid = next((int(p) for p in name.split(".") if p.isdecimal()), None)
        if ".mlp.experts." in name:
            experts.setdefault(bid, {})[name] = data
            if len(experts[bid]) < 3 * n_exp:
                continue
            for w_name in ("down_proj", "gate_proj", "up_proj"):
                stacked = np.stack([experts[bid].pop(f"model.layers.{bid}.mlp.experts.{x}.{w_name}.weight")
                                    for x in range(n_exp)])
                _add(w, tmap.get_name(f"model.layers.{bid}.mlp.experts.{w_name}.weight", (".weight",)), stacked,
                     ftype, bid)
            continue
        _add(w, tmap.get_name(name, (".weight", ".bias")), data, ftype, bid)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(out)[0]


def _add(w, new_name: str, data: np.ndarray, ftype: str, bid: int | None) -> None:
    qt = _QT[ftype]
    gate_inp = bid is not None and new_name == gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_GATE_INP].format(bid=bid) + ".weight"
    if data.ndim <= 1 or new_name.endswith("_norm.weight") or gate_inp:
        qt = gguf.GGMLQuantizationType.F32
    with np.errstate(all="ignore"):
        q = gguf.quants.quantize(data, qt)
    w.add_tensor(new_name, q, raw_dtype=qt)


def random_blocks(rng, rows: int, cols: int, kind: str) -> np.ndarray:
    """uint8 [rows, row bytes] of random `kind` (a block type name: "Q4_K", "IQ4_NL") blocks with small f16 scales."""
    bv, bb = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, size=(rows * cols // bv, bb), dtype=np.uint8)
    small = np.array([0x1400], np.uint16).view(np.uint8)          # f16 scale 2**-10
    if kind in ("Q6_K", "Q3_K"):
        raw[:, bb - 2:bb] = small                                   # d last
    elif kind == "Q2_K":
        raw[:, 80:84] = np.tile(small, 2)                           # d, dmin last
    elif kind in ("IQ4_XS", "IQ3_XXS", "IQ4_NL"):
        raw[:, 0:2] = small                                         # d first
    else:
        raw[:, 0:2] = small
        raw[:, 2:4] = small
    return raw.reshape(rows, cols // bv * bb)


def llamacpp_block_gguf(tmp_path: Path, main: str, kind_of=None, split_max_tensors: int = 0
                        ) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """A llama.cpp-style bf16 file of a small random target (no MTP head) and its copy with every matrix in
    super-block blocks (random codes, small scales), as llama-quantize's Q4_K_M mixes them: Q6_K for the experts'
    down, v and the head, `main` elsewhere (`kind_of(name)` instead, where given). -> (that file (its first part
    when split in parts of `split_max_tensors`), the bf16 file, gguf-py's values of each block tensor)."""
    src = make_bpe_target(tmp_path, hidden=256, moe_inter=256, head_dim=128, heads=2, kv_heads=1, layers=2,
                          inter=256, mtp=False, tok_vocab=300)
    ref_path = llamacpp_style_gguf(src, tmp_path / "bf16.gguf", "bf16", pre="gpt-2")
    r = gguf.GGUFReader(ref_path)
    rng = np.random.default_rng(0)
    out = tmp_path / f"{main.lower()}_m.gguf"
    w = gguf.GGUFWriter(out, "qwen3moe", split_max_tensors=split_max_tensors)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vt = f.types[0]
        sub = f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), vt, sub_type=sub)
    deq: dict[str, np.ndarray] = {}
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed(list(t.shape)))
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            w.add_tensor(t.name, np.array(t.data))
            continue
        kind = "Q6_K" if ("down" in t.name or "attn_v" in t.name or t.name == "output.weight") else main
        kind = kind_of(t.name) if kind_of is not None else kind
        rows = int(np.prod(shape[:-1]))
        raw = random_blocks(rng, rows, shape[-1], kind).reshape(*shape[:-1], -1)
        qt = gguf.GGMLQuantizationType[kind]
        w.add_tensor(t.name, raw, raw_dtype=qt)
        deq[t.name] = gguf.quants.dequantize(raw, qt).reshape(shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(out)[0], ref_path, deq
