"""Tiny DFlash2 checkpoints and catalogs for the artifact tests."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from runtime.drafters.dflash2.contract import DFlash2Geometry, expected_tensors

REPO = "tiny-org/tiny-dflash2"
REV = "0123456789abcdef0123456789abcdef01234567"

TINY_CONFIG = {
    "architectures": ["DFlash2DraftModel"],
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "vocab_size": 128,
    "num_target_layers": 4,
    "dflash_config": {"block_size": 8, "mask_token_id": 127, "target_layer_ids": [1, 3], "conv_kernel_size": 2,
                      "conv_group_size": 16, "selector_rank": 32, "selector_top_k": 4},
}


def tiny_tensors(config: dict | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    cfg = config or TINY_CONFIG
    geom = DFlash2Geometry.from_config(cfg)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, kind) in expected_tensors(geom).items():
        t = torch.randn(shape, generator=g) * (0.05 if kind == "backbone" else 0.5)
        if kind == "norm":
            t = 1 + t * 0.1
        out[name] = t.to(torch.bfloat16)
    return out


def write_checkpoint(folder: Path, config: dict | None = None, tensors: dict | None = None, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = copy.deepcopy(config or TINY_CONFIG)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(tensors if tensors is not None else tiny_tensors(cfg, seed), str(folder / "model.safetensors"))
    return folder


def file_pins(folder: Path, names=("config.json", "model.safetensors")) -> list[dict]:
    return [{"path": n, "sha256": hashlib.sha256((folder / n).read_bytes()).hexdigest(),
             "size": (folder / n).stat().st_size} for n in names]


def toml_catalog(entries: list[dict]) -> str:
    """A small TOML writer for [[entry]] / [[entry.file]] tables."""
    import tomli_w

    return tomli_w.dumps({"entry": [{k: v for k, v in e.items() if v is not None} for e in entries]})
