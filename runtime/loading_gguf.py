"""Load a Qwen3-MoE target from a GGUF file in llama.cpp's `qwen3moe` layout (docs/formats.md, "Converted target
GGUF"): Strata's own conversion or a file llama.cpp's converter (and `llama-quantize`) wrote, in one file or in
split parts named by the first (docs/formats.md, "Split GGUF files").

The model is the same `Qwen3MoeModel` the Hugging Face loader builds, filled from the file as it says, tensor by
tensor (each tensor's type comes from the tensor table, never from `general.file_type`, since a llama.cpp `Q4_K_M`
file mixes types):
- F32, F16 and BF16 tensors become floats in the runtime dtype (BF16 on CUDA, fp32 on CPU), as from a folder;
- block-format matrices (Q8_0, Q5_0, Q4_0 and the read-only formats of the table: K-quants, IQ4) stay as ggml
  blocks: `QuantLinear` for dense matrices, `QuantEmbedding` for `token_embd`, and each MoE layer's experts as two
  stacked uint8 tensors (`SparseMoe.bind_blocks`) that the grouped kernels read (dequantized in registers) and the
  torch fallback dequantizes one expert at a time. There is never a float copy of the experts.
- The tokenizer comes from the file's own metadata (runtime/formats/gguf_tokenizer.py), so a GGUF file runs by
  itself; a converted file's tokenizer is the source folder's `tokenizer.json`, encoded identically.
- The MTP head, when the file names one (`strata.mtp.file`), is read from that file beside it; its provenance must
  be the target's (same source sha256, quantization and converter version).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from runtime.errors import LoadError
from runtime.formats import target_gguf as TG
from runtime.formats.gguf_meta import (
    KEY_CONVERTER_VERSION,
    KEY_QUANTIZATION,
    KEY_SOURCE_SHA256,
    metadata,
    open_gguf,
)
from runtime.formats.gguf_split import GGUFSet
from runtime.formats.quant_linear import QuantEmbedding, QuantLinear
from runtime.formats.registry import FORMATS, by_tensor_type
from runtime.models.layers import SparseMoe, rope_inv_freq
from runtime.models.qwen3_moe import Qwen3MoeModel
from runtime.models.target_config import Qwen3MoeConfig

_FLOAT_TYPES = ("F32", "F16", "BF16")
_BLOCK_TYPES = ", ".join(f.tensor_type for f in FORMATS.values() if f.quantized)    # "Q8_0, ..., IQ4_NL" (the table)


def is_gguf(path: str | Path) -> bool:
    """A target given as one .gguf file or the first part of a split one (else a Hugging Face folder)."""
    p = Path(path)
    if p.suffix.lower() == ".gguf":
        return True
    if not p.is_file():
        return False
    with open(p, "rb") as fh:
        return fh.read(4) == b"GGUF"


class _File:
    """One open GGUF file (or the parts of a split one, runtime/formats/gguf_split.py): metadata, tensors by name,
    torch-order shapes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        parts = GGUFSet(path)
        self.meta = parts.meta
        self.tensors = parts.tensors
        self.shapes = {n: tuple(int(d) for d in reversed(list(t.shape))) for n, t in self.tensors.items()}

    def kind(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def floats(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        t = self.tensors[name]
        kind = t.tensor_type.name
        raw = np.asarray(t.data)
        if kind == "F32":
            a = torch.from_numpy(np.array(raw, dtype=np.float32))
        elif kind == "F16":
            a = torch.from_numpy(np.array(raw, dtype=np.float16))
        else:   # BF16: the reader gives the bytes
            a = torch.from_numpy(np.array(raw).view(np.int16)).view(torch.bfloat16)
        return a.reshape(self.shapes[name]).to(dtype)

    def blocks(self, name: str) -> torch.Tensor:
        """uint8 [..., row_bytes] of a block-format tensor (a copy: the file stays read-only and may be closed)."""
        raw = np.asarray(self.tensors[name].data)
        return torch.from_numpy(np.array(raw, dtype=np.uint8))


def _check_name(value: Any, path: Path) -> str:
    if not isinstance(value, str) or not value or "/" in value or "\\" in value or value.startswith(".."):
        raise LoadError(f"{path} names its MTP file {value!r}, which is not a plain file name beside it.")
    return value


def _open_mtp(f: _File, cfg: Qwen3MoeConfig) -> _File | None:
    name = f.meta.get(TG.KEY_MTP_FILE)
    if name is None:
        return None
    p = f.path.parent / _check_name(name, f.path)
    if not p.is_file():
        raise LoadError(f"{f.path} names the MTP head {p.name}, which is missing beside it; convert the target "
                        f"again or run without the MTP drafter.")
    m = _File(p)
    for k in (KEY_SOURCE_SHA256, KEY_QUANTIZATION, KEY_CONVERTER_VERSION):
        if m.meta.get(k) != f.meta.get(k):
            raise LoadError(f"{p} was not converted with {f.path.name} ({k} differs); convert the target again.")
    if int(m.meta.get(TG.arch_key(TG.Keys.LLM.NEXTN_PREDICT_LAYERS), 0) or 0) != 1:
        raise LoadError(f"{p} is not an MTP head file (no {TG.ARCH}.nextn_predict_layers = 1).")
    return m


def read_target_config(path: str | Path, *, with_mtp: bool = True) -> Qwen3MoeConfig:
    """The config a GGUF target file describes (MTP flags from its MTP file), without reading weights."""
    f = _File(Path(path))
    cfg = TG.config_from_metadata(f.meta, f.shapes, source=f.path.name)
    m = _open_mtp(f, cfg) if with_mtp else None
    if m is not None:
        cfg.mtp_layers = 1
        cfg.mtp_sparse = TG.tensor_name(TG.T.FFN_GATE_INP, cfg.num_hidden_layers) in m.tensors
    return cfg


def _set_param(model: nn.Module, name: str, value: torch.Tensor) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    setattr(mod, attr, nn.Parameter(value, requires_grad=False))


def _set_module(model: nn.Module, name: str, value: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, value)


def check_target_gguf(path: str | Path, with_mtp: bool = True):
    """The file checked as `load_target_gguf` will load it, from its tensor table alone (no weight is read): a
    qwen3moe config in its metadata, every tensor the model needs present with its shape, nothing else, every type
    one Strata reads, the MTP file's provenance. Returns (config, model on the meta device, where each parameter
    comes from); LoadError (one sentence) otherwise. `models add` runs it on a header read from the Hub."""
    path = Path(path)
    if not path.is_file():
        raise LoadError(f"target file {path} does not exist.")
    f = _File(path)
    cfg = TG.config_from_metadata(f.meta, f.shapes, source=path.name)
    m = _open_mtp(f, cfg) if with_mtp else None
    if m is not None:
        cfg.mtp_layers = 1
        cfg.mtp_sparse = TG.tensor_name(TG.T.FFN_GATE_INP, cfg.num_hidden_layers) in m.tensors
    with torch.device("meta"):
        model = Qwen3MoeModel(cfg)
    expected = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)

    # where each parameter comes from: (file, gguf name, expert index)
    where: dict[str, tuple[_File, str, int | None]] = {}
    for name in expected:
        p = TG.place(name, cfg.num_hidden_layers)
        where[name] = (m if p.mtp else f, p.gguf, p.expert)  # type: ignore[assignment]
    for file in (f, m):
        if file is None:
            continue
        wanted = {g for fl, g, _ in where.values() if fl is file}
        missing = sorted(wanted - set(file.tensors))
        if missing:
            raise LoadError(f"{file.path.name} lacks tensor {missing[0]}; it does not match its own metadata.")
        extra = sorted(set(file.tensors) - wanted)
        if extra:
            raise LoadError(f"{file.path.name} has tensor {extra[0]}, which a {TG.ARCH} model of this shape does "
                            f"not have.")
    for name, (file, g, e) in where.items():
        want = tuple(expected[name].shape)
        got = file.shapes[g][1:] if e is not None else file.shapes[g]
        if got != want:
            raise LoadError(f"{file.path.name}: tensor {g} has shape {list(file.shapes[g])}, expected "
                            f"{list(want) if e is None else [cfg.num_experts, *want]}.")
        kind = file.kind(g)
        if kind not in _FLOAT_TYPES and by_tensor_type(kind) is None:
            raise LoadError(f"{file.path.name}: tensor {g} is stored as {kind}, which Strata does not read "
                            f"(it reads F32, F16, BF16, {_BLOCK_TYPES}); use a file of those types.")
    return cfg, model, where


def load_target_gguf(path: str | Path, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                     with_mtp: bool = True) -> Qwen3MoeModel:
    """Build the model from a qwen3moe GGUF file (see the module docstring). LoadError (one sentence) for a file
    that is not one, or whose tensors do not match its own metadata."""
    path = Path(path)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    dt = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    cfg, model, where = check_target_gguf(path, with_mtp)
    expected = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)

    # routed experts: one layer at a time, stacked
    moe = [(f"model.layers.{i}.mlp", layer.mlp) for i, layer in enumerate(model.model.layers)
           if isinstance(layer.mlp, SparseMoe)]
    if model.mtp is not None and isinstance(model.mtp.layers[0].mlp, SparseMoe):
        moe.append(("mtp.layers.0.mlp", model.mtp.layers[0].mlp))
    for prefix, blk in moe:
        _load_experts(blk, prefix, where, dt)
    # dense tensors
    done = {n for n in where if ".mlp.experts." in n}
    for name in where:
        if name in done:
            continue
        file, g, _ = where[name]
        kind = file.kind(g)
        if kind in _FLOAT_TYPES:
            _set_param(model, name, file.floats(g, dt))
            continue
        mod_name = name.rpartition(".")[0]
        fmt = by_tensor_type(kind).name
        blocks = file.blocks(g)
        if name == "model.embed_tokens.weight":
            _set_module(model, mod_name, QuantEmbedding.from_blocks(blocks, fmt, cfg.hidden_size, dt))
        else:
            _set_module(model, mod_name, QuantLinear.from_blocks(blocks, fmt, expected[name].shape[1]))
    if cfg.tie_word_embeddings:
        emb = model.model.embed_tokens
        if isinstance(emb, QuantEmbedding):
            model.lm_head = QuantLinear.from_blocks(emb.blocks, emb.qtype, cfg.hidden_size)
        else:
            model.lm_head.weight = emb.weight
    # non-persistent buffers (rope) come back from the meta device empty: rebuild them
    model.rotary.inv_freq = rope_inv_freq(cfg)[0]
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if left:
        raise LoadError(f"tensor {left[0]} was not loaded from {path.name}.")
    model.eval().requires_grad_(False)
    if dev.type != "cpu":
        from runtime.experts import ExpertCache

        ExpertCache(model, dev).place(model)   # every expert resident; block stacks move whole
    return model


def _load_experts(blk: SparseMoe, prefix: str, where: dict, dt: torch.dtype) -> None:
    """One MoE layer's experts from the stacked `ffn_{gate,up,down}_exps`: ggml blocks stay blocks (one uint8 stack
    for gate+up, one for down); float stacks become per-expert parameters as from a folder."""
    src = {proj: where[f"{prefix}.experts.0.{proj}_proj.weight"] for proj in ("gate", "up", "down")}
    file = src["gate"][0]
    kinds = {proj: file.kind(g) for proj, (file, g, _) in src.items()}
    gate_g, up_g, down_g = src["gate"][1], src["up"][1], src["down"][1]
    if all(k in _FLOAT_TYPES for k in kinds.values()):
        gate, up, down = (file.floats(g, dt) for g in (gate_g, up_g, down_g))
        for e, ex in enumerate(blk.experts):
            ex.gate_proj.weight = nn.Parameter(gate[e].clone(), requires_grad=False)
            ex.up_proj.weight = nn.Parameter(up[e].clone(), requires_grad=False)
            ex.down_proj.weight = nn.Parameter(down[e].clone(), requires_grad=False)
        return
    if kinds["gate"] != kinds["up"] or any(k in _FLOAT_TYPES for k in kinds.values()):
        raise LoadError(f"{file.path.name} stores the experts of {prefix} as {kinds['gate']}/{kinds['up']}/"
                        f"{kinds['down']}; Strata needs gate and up in one block format and down in a block format.")
    gate, up = file.blocks(gate_g), file.blocks(up_g)              # [E, I, row_bytes(H)]
    gate_up = torch.empty(gate.shape[0], 2 * gate.shape[1], gate.shape[2], dtype=torch.uint8)
    gate_up[:, :gate.shape[1]] = gate
    gate_up[:, gate.shape[1]:] = up
    del gate, up
    blk.bind_blocks(gate_up, file.blocks(down_g), (by_tensor_type(kinds["gate"]).name,
                                                   by_tensor_type(kinds["down"]).name))


def load_tokenizer_gguf(path: str | Path):
    """The tokenizer written in the file's metadata (runtime/formats/gguf_tokenizer.py)."""
    from runtime.formats.gguf_tokenizer import tokenizer_from_metadata

    path = Path(path)
    reader = open_gguf(path)
    return tokenizer_from_metadata(metadata(reader, "tokenizer."), source=path.name)
