"""Load a Hugging Face style Qwen3-MoE folder: config.json, safetensors (single or sharded), tokenizer.json.

Safetensors only (never pickles). Every expected tensor must be present with the right shape; extra tensors
other than known-harmless ones are refused, so a wrong checkpoint fails with a message naming the tensor.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from runtime.errors import ConfigError, LoadError
from runtime.formats.safetensors_files import inventory
from runtime.models.qwen3_moe import Qwen3MoeModel
from runtime.models.target_config import Qwen3MoeConfig


def default_dtype(device: torch.device) -> torch.dtype:
    """BF16 on CUDA, fp32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def read_config(folder: Path) -> dict:
    p = folder / "config.json"
    if not p.is_file():
        raise LoadError(f"{folder} has no config.json; point to a Hugging Face model folder.")
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoadError(f"{p} is not valid JSON ({e}).") from e


def weight_files(folder: Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file, from the index when sharded (headers checked, no weights read)."""
    return {name: ref.file for name, ref in inventory(folder, error=LoadError).items()}


def load_config(folder: Path, names: set[str] | None = None) -> Qwen3MoeConfig:
    """The config, with the MTP flags taken from the tensors when they are present."""
    try:
        cfg = Qwen3MoeConfig.from_dict(read_config(folder))
    except ConfigError as e:
        raise LoadError(str(e)) from e
    if names is not None:
        has_mtp = any(n.startswith("mtp.") for n in names)
        cfg.mtp_layers = 1 if has_mtp else 0
        if has_mtp:
            cfg.mtp_sparse = "mtp.layers.0.mlp.gate.weight" in names
    return cfg


def check_target_tensors(folder: str | Path, with_mtp: bool = True):
    """The checkpoint's tensors checked against what config.json says, from the safetensors headers alone (no
    weight is read): every expected tensor present with its shape and a floating-point dtype, nothing unexpected.
    Returns (config, {name: TensorRef}, the model built on the meta device). LoadError (one sentence) otherwise."""
    folder = Path(folder)
    if not folder.is_dir():
        raise LoadError(f"target folder {folder} does not exist.")
    config = read_config(folder)      # a missing config.json is the first thing to report
    refs = inventory(folder, error=LoadError)
    cfg, model = check_target_inventory(config, {k: (r.shape, r.dtype) for k, r in refs.items()},
                                        f"checkpoint in {folder}", with_mtp)
    return cfg, refs, model


def check_target_inventory(config: dict, found: Mapping[str, tuple[tuple[int, ...], str]], where: str,
                           with_mtp: bool = True):
    """`check_target_tensors` on a tensor table {name: (shape, safetensors dtype)}, wherever it was read (a folder's
    headers, or a Hub repository's headers read with ranged requests before anything is downloaded). `where`
    starts the message ("checkpoint in FOLDER"). Returns (config, the model built on the meta device)."""
    from runtime.formats.safetensors_files import DTYPE_BYTES

    try:
        cfg = Qwen3MoeConfig.from_dict(config)
    except ConfigError as e:
        raise LoadError(str(e)) from e
    has_mtp = any(n.startswith("mtp.") for n in found)
    cfg.mtp_layers = 1 if has_mtp and with_mtp else 0
    if has_mtp:
        cfg.mtp_sparse = "mtp.layers.0.mlp.gate.weight" in found
    with torch.device("meta"):
        model = Qwen3MoeModel(cfg)
    expected = {k: v for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = [k for k in expected if k not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise LoadError(f"{where} lacks tensor {missing[0]}{more}; it does not match config.json.")
    extra = [k for k in found if k not in expected and not (k.startswith("mtp.") and not with_mtp)
             and not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if extra:
        raise LoadError(f"{where} has unexpected tensor {extra[0]}; it does not match config.json.")
    for k, want in expected.items():
        shape, dtype = found[k]
        if tuple(shape) != tuple(want.shape):
            raise LoadError(f"tensor {k} has shape {tuple(shape)}, expected {tuple(want.shape)} from "
                            f"config.json.")
        if dtype not in DTYPE_BYTES or not dtype.startswith(("F", "BF")):
            raise LoadError(f"tensor {k} has dtype {dtype}; expected floating-point weights.")
    return cfg, model


def load_target(folder: str | Path, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                with_mtp: bool = True) -> Qwen3MoeModel:
    """Build the model and fill it from the folder's safetensors (shapes and inventory checked)."""
    folder = Path(folder)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    dt = dtype or default_dtype(dev)
    cfg, refs, model = check_target_tensors(folder, with_mtp)
    expected = {k: v for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    state: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for k in expected:
        by_file.setdefault(refs[k].file, []).append(k)
    for f, keys in by_file.items():
        with safe_open(str(f), "pt", device="cpu") as sf:
            for k in keys:
                t = sf.get_tensor(k)
                if tuple(t.shape) != tuple(expected[k].shape):
                    raise LoadError(f"tensor {k} has shape {tuple(t.shape)}, expected {tuple(expected[k].shape)} "
                                    f"from config.json.")
                if not t.is_floating_point():
                    raise LoadError(f"tensor {k} has dtype {t.dtype}; expected floating-point weights.")
                state[k] = t.to(dtype=dt)
    model = model.to_empty(device="cpu")
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # non-persistent buffers (rope) come back from the meta device empty: rebuild them
    from runtime.models.layers import rope_inv_freq

    model.rotary.inv_freq = rope_inv_freq(cfg)[0]
    model.eval()
    return model.to(dev)


def load_tokenizer(folder: str | Path):
    """tokenizer.json through `tokenizers` (no Python code from the repo is run)."""
    from tokenizers import Tokenizer

    p = Path(folder) / "tokenizer.json"
    if not p.is_file():
        raise LoadError(f"{folder} has no tokenizer.json.")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise LoadError(f"{p} is not a valid tokenizers file ({e}).") from e
