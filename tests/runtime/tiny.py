"""Tiny random Qwen3-MoE folders for tests (config.json + safetensors + tokenizer.json), reusable by any area.

    from tests.runtime.tiny import make_tiny_target
    folder = make_tiny_target(tmp_path, mtp=True)      # -> Path with config.json, model.safetensors, tokenizer.json
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

ALPHABET = string.ascii_lowercase + " .,!?" + string.digits + string.ascii_uppercase + "-:;'()"
SPECIALS = ["<unk>", "<eos>"]


@pytest.fixture(scope="module")
def single_thread():
    """Tiny models run far faster on one intra-op thread (and do not fight other tests for the CI cores).
    Use: `from tests.runtime.tiny import single_thread  # noqa: F401` and
    `pytestmark = pytest.mark.usefixtures("single_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_config(vocab: int = 64, hidden: int = 32, layers: int = 3, heads: int = 4, kv_heads: int = 2,
                head_dim: int = 16, experts: int = 4, top_k: int = 2, moe_inter: int = 24, inter: int = 48,
                norm_topk_prob: bool = True, mlp_only_layers: tuple[int, ...] = (), decoder_sparse_step: int = 1,
                tie: bool = False, mtp: bool = True, rope_theta: float = 10000.0, **extra: Any) -> dict:
    """A config.json dict of a tiny qwen3_moe target (eos = id 1)."""
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": 1e-6, "rope_theta": rope_theta, "max_position_embeddings": 4096,
        "num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": moe_inter,
        "norm_topk_prob": norm_topk_prob, "decoder_sparse_step": decoder_sparse_step,
        "mlp_only_layers": list(mlp_only_layers), "tie_word_embeddings": tie, "hidden_act": "silu",
        "attention_bias": False, "bos_token_id": None, "eos_token_id": 1, "torch_dtype": "float32",
    }
    if mtp:
        cfg["num_nextn_predict_layers"] = 1
    cfg.update(extra)
    return cfg


def random_state(cfg: dict, seed: int = 0, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Random weights with Hub names for `cfg` (norm weights perturbed around 1 so they matter)."""
    from runtime.models.qwen3_moe import Qwen3MoeModel
    from runtime.models.target_config import Qwen3MoeConfig

    torch.manual_seed(seed)
    model = Qwen3MoeModel(Qwen3MoeConfig.from_dict(cfg))
    state = {}
    for k, v in model.state_dict().items():
        if k.endswith("norm.weight") or "norm_" in k.split(".")[-2]:
            state[k] = 1.0 + 0.2 * torch.randn_like(v)
        else:
            state[k] = v.clone() * scale
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    return {k: v.contiguous() for k, v in state.items()}


def tiny_tokenizer(vocab: int):
    """A character-level WordLevel tokenizer: ids 0 <unk>, 1 <eos>, then single characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = list(ALPHABET[: max(0, vocab - len(SPECIALS))])
    vocab_map = {t: i for i, t in enumerate(SPECIALS + chars)}
    tok = Tokenizer(models.WordLevel(vocab_map, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    return tok


def make_tiny_target(root: str | Path, name: str = "tiny-target", *, seed: int = 0, sharded: bool = False,
                     scale: float = 1.0, **cfg_kwargs: Any) -> Path:
    """Write a tiny random target folder under `root` and return its path (kwargs go to `tiny_config`)."""
    folder = Path(root) / name
    folder.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(**cfg_kwargs)
    state = random_state(cfg, seed=seed, scale=scale)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    if sharded:
        keys = sorted(state)
        half = len(keys) // 2
        parts = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
        wm = {}
        for fn, ks in parts.items():
            save_file({k: state[k] for k in ks}, str(folder / fn))
            wm.update({k: fn for k in ks})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    else:
        save_file(state, str(folder / "model.safetensors"))
    tiny_tokenizer(cfg["vocab_size"]).save(str(folder / "tokenizer.json"))
    return folder


def to_transformers(folder: str | Path):
    """The same checkpoint as a transformers `Qwen3MoeForCausalLM` (fp32), for reference comparisons."""
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig as HFConfig
    from transformers import Qwen3MoeForCausalLM

    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k not in ("num_nextn_predict_layers", "architectures", "model_type")}
    hf_cfg = HFConfig(**cfg)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(123)
    hf = Qwen3MoeForCausalLM(hf_cfg).eval()
    st = load_file(str(folder / "model.safetensors"))
    new: dict[str, torch.Tensor] = {}
    n_exp = cfg["num_experts"]
    for k, v in st.items():
        if k.startswith("mtp.") or ".mlp.experts." in k:
            continue
        new[k] = v
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp."
        if f"{p}gate.weight" not in st:
            continue
        new[f"{p}gate.weight"] = st[f"{p}gate.weight"]
        new[f"{p}experts.gate_up_proj"] = torch.stack(
            [torch.cat([st[f"{p}experts.{e}.gate_proj.weight"], st[f"{p}experts.{e}.up_proj.weight"]], 0)
             for e in range(n_exp)])
        new[f"{p}experts.down_proj"] = torch.stack([st[f"{p}experts.{e}.down_proj.weight"] for e in range(n_exp)])
    missing, unexpected = hf.load_state_dict(new, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.get("tie_word_embeddings"))]
    assert not missing and not unexpected, (missing, unexpected)
    return hf
