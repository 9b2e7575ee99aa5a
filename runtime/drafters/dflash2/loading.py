"""Load a DFlash2 drafter (HF folder or converted GGUF) and wrap it as a `runtime.drafters.base.Drafter`.

    drafter = load_dflash2_drafter(path, target_model, device=None, dtype=None, context=4096)

`path`: a Hugging Face folder (config.json + model.safetensors, docs/formats.md, "DFlash2 checkpoint") or a `.gguf` file written by the
converter (docs/formats.md, "Converted DFlash2 GGUF"). BF16 tensors keep their bits (widened to `dtype` for compute); Q8_0/Q5_0/Q4_0 backbone
matrices stay as ggml blocks in a `QuantLinear` (dequantized per call). The target's `embed_tokens` and `lm_head`
are shared, never copied. Every problem with the file or the pairing raises `ContractError` (one sentence).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from runtime.drafters.base import Proposal
from runtime.drafters.dflash2.contract import (
    DFlash2Geometry,
    check_inventory,
    expected_tensors,
    gguf_to_hf,
    pairing_problem,
)
from runtime.drafters.dflash2.model import (
    ContextCache,
    DFlash2Model,
    Rotary,
    argmax_walk,
    cut_walk,
    lattice_walk,
    select_walk,
)
from runtime.errors import ContractError, QuantFormatError
from runtime.formats.gguf_meta import metadata, open_gguf
from runtime.formats.quant_linear import QuantLinear
from runtime.formats.registry import by_tensor_type
from runtime.formats.safetensors_files import checkpoint_files
from runtime.sampling import SamplingParams

__all__ = ["DFlash2Drafter", "load_dflash2_drafter", "read_dflash2"]



# ----------------------------------------------------------------------------------------------------- reading

def read_dflash2(path: str | Path) -> tuple[DFlash2Geometry, str, dict[str, tuple[str, Callable[[], Tensor]]]]:
    """Read and check a drafter file without building modules: (geometry, layout "v2"|"v1", tensors) where
    tensors maps HF name -> (dtype, load) and load() gives a torch.bfloat16 tensor in HF shape ("BF16") or the
    uint8 blocks [rows, row_bytes] ("Q8_0"/"Q5_0"/"Q4_0"). Loading is lazy so that one tensor at a time is copied."""
    p = Path(path)
    if p.is_dir():
        return _read_hf(p)
    if p.is_file() and p.suffix.lower() == ".gguf":
        return _read_gguf(p)
    if p.is_file() and p.name.endswith(".safetensors"):
        return _read_hf(p.parent, p)
    raise ContractError(f"{p} is neither a drafter folder (config.json + model.safetensors) nor a .gguf file.")


def _read_hf(folder: Path, single: Path | None = None) -> tuple[DFlash2Geometry, str, dict]:
    from safetensors import safe_open

    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ContractError(f"{folder} has no config.json; point to a DFlash2 drafter folder.")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ContractError(f"{cfg_path} is not valid JSON ({e}).") from None
    geom = DFlash2Geometry.from_config(cfg)
    files = [single] if single is not None else checkpoint_files(folder, error=ContractError)[0]
    handles = []
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    where: dict[str, Any] = {}
    for f in files:
        try:
            h = safe_open(str(f), "pt")
        except Exception as e:  # safetensors raises its own error types for a corrupt header
            raise ContractError(f"{f} is not a readable safetensors file ({e}).") from None
        handles.append(h)
        for name in h.keys():
            if name in found:
                raise ContractError(f"tensor {name!r} appears twice in the drafter's safetensors files.")
            sl = h.get_slice(name)
            found[name] = (tuple(sl.get_shape()), str(sl.get_dtype()).upper())
            where[name] = h
    layout = check_inventory(found, geom, allow_v1=True)
    tensors = {name: ("BF16", partial(where[name].get_tensor, name)) for name in found}
    return geom, layout, tensors


def _read_gguf(path: Path) -> tuple[DFlash2Geometry, str, dict]:
    reader = open_gguf(path, error=ContractError)
    meta = metadata(reader)
    geom = DFlash2Geometry.from_gguf_metadata(meta)
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    raw: dict[str, Any] = {}
    for t in reader.tensors:
        name = gguf_to_hf(t.name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        found[name] = (shape, t.tensor_type.name)
        raw[name] = t
    layout = check_inventory(found, geom, allow_v1=True, allow_quantized=True)
    tensors = {name: (found[name][1], partial(_gguf_tensor, raw[name], *found[name])) for name in raw}
    return geom, layout, tensors


def _gguf_tensor(t: Any, shape: tuple[int, ...], dtype: str) -> Tensor:
    data = np.array(t.data, copy=True)   # off the read-only memory map
    if dtype == "BF16":
        return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16).reshape(shape)
    return torch.from_numpy(data.reshape(shape[0], -1))


# ----------------------------------------------------------------------------------------------------- building

def _check_finite(name: str, kind: str, t: Tensor) -> None:
    if kind == "BF16":
        flat = t.reshape(-1)
        step = 1 << 24      # chunks keep the temporary mask small for the official 221M-element fc.weight
        ok = all(bool(torch.isfinite(flat[i:i + step]).all()) for i in range(0, flat.numel(), step))
    else:
        # a block's values are d * integer, so they are finite exactly when the f16 scale d of every block is
        size = by_tensor_type(kind).block_bytes
        d = t.reshape(-1, size)[:, :2].contiguous().view(torch.float16)
        ok = bool(torch.isfinite(d).all())
    if not ok:
        raise ContractError(f"drafter tensor {name!r} holds non-finite values (NaN or Inf); the file is damaged.")


def _check_pairing(geom: DFlash2Geometry, target: nn.Module) -> None:
    cfg = target.cfg
    problem = pairing_problem(geom, cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers)
    if problem is not None:
        raise ContractError(f"{problem}; choose a drafter made for this target.")


def build_model(geom: DFlash2Geometry, layout: str, tensors: dict[str, tuple[str, Callable[[], Tensor]]], *,
                device: torch.device, dtype: torch.dtype) -> DFlash2Model:
    """Modules from checked tensors (`read_dflash2`'s loaders, one tensor in memory at a time): floats cast to
    `dtype`, quantized matrices kept as blocks in a `QuantLinear`."""
    with torch.device("meta"):
        model = DFlash2Model(geom, v1=layout == "v1")
    for name, (kind, load) in tensors.items():
        t = load()
        _check_finite(name, kind, t)
        owner, _, attr = name.rpartition(".")
        mod = model.get_submodule(owner)
        if kind == "BF16":
            setattr(mod, attr, nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False))
        else:
            in_features = expected_tensors(geom, v1=layout == "v1")[name][0][1]
            try:
                q = QuantLinear.from_blocks(t, by_tensor_type(kind).name, in_features).to(device)
            except QuantFormatError as e:
                raise ContractError(f"drafter tensor {name!r} cannot be read as {kind} blocks ({e}).") from None
            parent, _, child = owner.rpartition(".")
            setattr(model.get_submodule(parent), child, q)
    model.rotary = Rotary(geom).to(device)
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if left:  # check_inventory makes this unreachable; kept as a guard against a contract/module drift
        raise ContractError(f"drafter tensor {left[0]!r} was not loaded.")
    return model.eval().requires_grad_(False)


def load_dflash2_drafter(path: str | Path, target_model: nn.Module, *, device: torch.device | str | None = None,
                         dtype: torch.dtype | None = None, context: int = 4096) -> DFlash2Drafter:
    """Load and validate a DFlash2 drafter for `target_model` (a `Qwen3MoeModel`); see the module docstring.

    device defaults to the target's lm_head device; dtype to fp32 on CPU and BF16 on CUDA (compute and draft KV).
    `context` is the draft KV capacity in positions (the engine's context length).
    """
    head_w = target_model.model.norm.weight     # where the target lives (its lm_head may hold ggml blocks)
    dev = torch.device(device) if device is not None else head_w.device
    dt = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    geom, layout, tensors = read_dflash2(path)
    _check_pairing(geom, target_model)
    model = build_model(geom, layout, tensors, device=dev, dtype=dt)
    return DFlash2Drafter(model, target_model.model.embed_tokens, target_model.lm_head, context=context,
                          kv_dtype=dt)


# ----------------------------------------------------------------------------------------------------- drafter

class DFlash2Drafter:
    """The Drafter protocol over a `DFlash2Model`: `observe` appends committed taps to the private context KV;
    `propose` drafts one window [anchor, mask...] and walks the selector (argmax rows for the v1 layout)."""

    kind = "dflash2"

    def __init__(self, model: DFlash2Model, embed: nn.Module, lm_head: nn.Module, *, context: int,
                 kv_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.geom = model.geom
        self._shared = (embed, lm_head)   # a tuple: not registered, never copied or moved
        self.max_block = self.geom.block_size
        self.chunk = 512
        self.tap_layers = tuple(self.geom.target_layer_ids)
        dev = model.norm.weight.device
        self.cache = ContextCache(model, context, device=dev, dtype=kv_dtype or model.dtype)
        self.logits_buf = torch.zeros(self.max_block, self.geom.vocab_size, dtype=torch.float32, device=dev)
        self.graphs = None   # runtime.drafters.dflash2.graphs.DFlash2Graphs, set by the engine on CUDA (greedy windows)
        self.ahead: tuple[int, Proposal] | None = None   # (position, proposal) drafted ahead (`draft_ahead`)
        # the floor cut on the host (a free read on a CPU), else on the device (`Proposal.keep`: no host read)
        self.host_cut = dev.type == "cpu"

    @property
    def layout(self) -> str:
        return "v1" if self.model.v1 else "v2"

    def reset(self) -> None:
        self.cache.truncate(0)
        self.ahead = None

    def observe(self, tokens: Tensor, hidden: Tensor, taps: Tensor | None, start: int) -> None:
        if taps is None:
            raise ValueError("the DFlash2 drafter needs the target's tap features; pass taps for its tap_layers.")
        self.ahead = None
        rows = taps.reshape(-1, taps.shape[-1])
        if self.graphs is not None and self.graphs.observe(rows, start):
            return
        for s in range(0, max(int(rows.shape[0]), 1), self.chunk):   # chunks: a bounded transient for a long prompt
            self.cache.append(self.model, rows[s:s + self.chunk], start + s)

    @torch.no_grad()
    def propose(self, anchor: int, pos: int, n: int, *, min_p: float = 0.0, sampling: SamplingParams | None = None,
                generator: torch.Generator | None = None) -> Proposal:
        n = min(int(n), self.max_block - 1)
        dev = self.logits_buf.device
        sampled = sampling is not None and not sampling.greedy
        if n <= 0:
            return Proposal(tokens=torch.zeros(0, dtype=torch.long, device=dev),
                            q=torch.zeros(0, self.geom.vocab_size, device=dev) if sampled else None,
                            confidence=torch.zeros(0, device=dev))
        if pos != self.cache.length:
            raise RuntimeError(
                f"DFlash2 drafter asked to draft at position {pos}, its context holds {self.cache.length} positions.")
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[0] == pos and ahead[1].tokens.shape[0] == n:
            return ahead[1]                           # drafted before the last window's read (`draft_ahead`)
        if self.graphs is not None:
            prop = self.graphs.propose(int(anchor), pos, n, min_p, sampling if sampled else None, generator)
            if prop is not None:
                return prop
        embed, lm_head = self._shared
        hs = self.model.draft_hidden(int(anchor), pos, n + 1, self.cache, embed)
        logits = self.logits_buf[:n]
        logits.copy_(self.model.compute_logits(hs, lm_head))
        if self.model.candidate_selector is None:
            walk = argmax_walk(logits, min_p=min_p, sampling=sampling if sampled else None, generator=generator,
                               cut=self.host_cut)
        elif not sampled:        # greedy: the lattice form of the walk, a handful of ops instead of ~8 per row
            anchor_t = torch.full((1,), int(anchor), dtype=torch.long, device=dev)
            toks, conf = lattice_walk(self.model.candidate_selector, hs, logits, anchor_t)
            walk = cut_walk(toks, conf, None, min_p, self.host_cut)
        else:
            walk = select_walk(self.model.candidate_selector, hs, logits, int(anchor), min_p=min_p,
                               temperature=sampling.temperature if sampled else 0.0, generator=generator,
                               cut=self.host_cut)
        return Proposal(tokens=walk.tokens, q=walk.q, confidence=walk.confidence, keep=walk.keep)

    def draft_ahead(self, window: Tensor, hidden: Tensor, taps: Tensor | None, pos: int, acc: Tensor,
                    anchor: Tensor, n: int, *, min_p: float = 0.0, sampling: SamplingParams | None = None,
                    generator: torch.Generator | None = None) -> bool:
        """Queue the window's observation and the next block before the loop's read (`DFlash2Graphs.ahead`);
        False when only the after-read path can (no graphs, capacity)."""
        self.ahead = None
        if self.graphs is None or taps is None:
            return False
        n = min(int(n), self.max_block - 1)
        sampled = sampling is not None and not sampling.greedy
        prop = self.graphs.ahead(taps.reshape(-1, taps.shape[-1]), pos, acc, anchor, n, min_p,
                                 sampling if sampled else None, generator)
        if prop is None:
            return False
        self.ahead = (pos, prop)
        return True

    def settle(self, acc: int) -> None:
        """The host's side of a window observed ahead: acc + 1 rows committed."""
        pos, prop = self.ahead
        self.cache.length = pos + acc + 1
        self.ahead = (self.cache.length, prop)

    def make_graphs(self):
        """The CUDA graph runner for greedy windows (the engine attaches it on CUDA)."""
        from runtime.drafters.dflash2.graphs import DFlash2Graphs

        return DFlash2Graphs(self)

    def memory_report(self) -> dict[str, int]:
        """Persistent buffers by budget name: drafter weights (as stored), draft context KV, drafter logits."""
        w = sum(t.numel() * t.element_size()
                for t in list(self.model.parameters()) + list(self.model.buffers(recurse=True))
                if t is not self.model.rotary.inv_freq)
        return {"drafter_weights": w, "drafter_kv": self.cache.nbytes,
                "logits": self.logits_buf.numel() * self.logits_buf.element_size()}
