"""The DFlash2 checkpoint contract (docs/formats.md, "DFlash2 checkpoint" and "Converted DFlash2 GGUF"), pure Python with no torch.

One place that says what a DFlash2 drafter checkpoint must hold, so the converter, the hub header check and the
runtime loader agree:

- `DFlash2Geometry.from_config(config_json)` reads and validates `config.json` (`dflash_config` keys win over
  top-level keys of the same name);
- `expected_tensors(geom)` is the tensor inventory: name -> (shape, kind), kind in backbone/norm/conv/selector;
- `check_inventory(found, geom)` compares what a file holds against it and raises `ContractError` with one sentence;
- `hf_to_gguf(name)` / `gguf_to_hf(name)` map tensor names (§4);
- `gguf_metadata(geom)` / `DFlash2Geometry.from_gguf_metadata(meta)` are the `dflash2.*` GGUF keys.

Shapes are always given in Hugging Face / PyTorch order ([out, in] for matrices); GGUF stores them reversed.

Choices the contract leaves open (reference: z-lab/dflash `dflash/model.py`, whose config is transformers'
`Qwen3Config`; docs/models.md, "Masks"):
- `block_size` defaults to 16, `output_multiplier` and `input_embedding_scale` to 1.0, no softcap; a softcap <= 0
  is none.
- `rope_theta` is read from `rope_theta`, else `rope_parameters.rope_theta` (transformers 5 style), else 10000.
  Rope types "default" and "linear" are supported; any other is refused.
- Attention per layer, as the reference: `use_sliding_window` defaults to false, and false clears
  `sliding_window`; without `layer_types`, layers from `max_window_layers` (default 28) on are "sliding_attention"
  when a window is left; a sliding layer's window is `sliding_window` (None when cleared). `is_causal` absent
  (`DFlash2Geometry.is_causal` None) makes exactly the sliding layers causal; present, it applies to every layer.
  In the block, a window is two-sided unless the layer is causal, as in the reference's `_attention_mask`. GGUF has
  one window and one causal flag for all layers, so heads whose layers attend differently cannot be converted.
- The v1 layout (plain z-lab DFlash) is the same inventory without the convolution and selector tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from runtime.errors import ContractError
from runtime.formats.gguf_meta import (  # noqa: F401  (re-exported: the drafter's keys)
    KEY_CONVERTER_VERSION,
    KEY_QUANTIZATION,
    KEY_SOURCE_REPO,
    KEY_SOURCE_REVISION,
    KEY_SOURCE_SHA256,
)
from runtime.formats.registry import FORMATS, block_format, row_bytes

__all__ = [
    "ARCH",
    "BACKBONE_DTYPES",
    "FLOAT_DTYPE",
    "KINDS",
    "ContractError",
    "DFlash2Geometry",
    "check_inventory",
    "expected_tensors",
    "gguf_metadata",
    "gguf_to_hf",
    "hf_to_gguf",
    "is_v2_only",
    "pairing_problem",
    "tensor_count",
    "weight_bytes",
]

ARCH = "dflash2"
KINDS = ("backbone", "norm", "conv", "selector")
FLOAT_DTYPE = "BF16"
BACKBONE_DTYPES = tuple(f.tensor_type for f in FORMATS.values() if f.writable)   # what a backbone matrix may be stored as
ALIGNMENT = 32

# GGUF metadata key names (docs/formats.md, "Converted DFlash2 GGUF").
KEY_ARCHITECTURE = "general.architecture"
KEY_FILE_TYPE = "general.file_type"
KEY_ALIGNMENT = "general.alignment"
# strata.* provenance keys: runtime/formats/gguf_meta.py (shared with the target's files)
# Extra keys of ours, written only when a rope scaling is set (docs/formats.md leaves it open on rope scaling).
KEY_ROPE_SCALING_TYPE = "dflash2.rope.scaling.type"
KEY_ROPE_SCALING_FACTOR = "dflash2.rope.scaling.factor"


# ---------------------------------------------------------------------------------------------------------------
# Geometry
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DFlash2Geometry:
    """Everything the contract needs to know about one drafter, validated."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[str, float] | None = None   # ("linear", factor) or None
    num_target_layers: int | None = None
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0
    is_causal: bool | None = None                      # None: the sliding layers are causal (the reference's rule)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = field(default=())   # per layer: "full_attention" | "sliding_attention"

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        self.validate()

    # -- derived sizes ------------------------------------------------------------------------------------------
    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def conv_projection_rows(self) -> int:
        """Rows of a `kernel_projection` matrix: 2 * K * H / G."""
        return 2 * self.conv_kernel_size * self.hidden_size // self.conv_group_size

    def layer_window(self, i: int) -> int | None:
        """The sliding window of draft layer i, or None (a full layer, or a sliding one whose window is off)."""
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    def layer_causal(self, i: int) -> bool:
        """Whether block rows of draft layer i see only keys at or before their own position."""
        return self.layer_types[i] == "sliding_attention" if self.is_causal is None else self.is_causal

    # -- validation ---------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ContractError for values that cannot describe a working drafter."""
        positive = {
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "vocab_size": self.vocab_size,
            "block_size": self.block_size, "conv_kernel_size": self.conv_kernel_size,
            "conv_group_size": self.conv_group_size, "selector_rank": self.selector_rank,
            "selector_top_k": self.selector_top_k,
        }
        for key, value in positive.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ContractError(f"drafter config value {key} must be a positive integer, got {value!r}.")
        if self.num_heads % self.num_kv_heads:
            raise ContractError(
                f"drafter config num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads}).")
        if self.head_dim % 2:
            raise ContractError(f"drafter config head_dim ({self.head_dim}) must be even for rotary embeddings.")
        if self.hidden_size % self.conv_group_size:
            raise ContractError(
                f"drafter config conv_group_size ({self.conv_group_size}) must divide hidden_size "
                f"({self.hidden_size}).")
        if self.block_size < 2:
            raise ContractError(f"drafter config block_size must be at least 2, got {self.block_size}.")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ContractError(
                f"drafter mask_token_id {self.mask_token_id} is out of range for vocab_size {self.vocab_size}.")
        if self.selector_top_k > self.vocab_size:
            raise ContractError(
                f"drafter selector_top_k ({self.selector_top_k}) exceeds vocab_size ({self.vocab_size}).")
        if not self.target_layer_ids:
            raise ContractError("drafter config dflash_config.target_layer_ids must list at least one layer.")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids) or min(self.target_layer_ids) < 0:
            raise ContractError(
                f"drafter target_layer_ids {list(self.target_layer_ids)} must be distinct non-negative layer ids.")
        if self.num_target_layers is not None and max(self.target_layer_ids) >= self.num_target_layers:
            raise ContractError(
                f"drafter target_layer_ids {list(self.target_layer_ids)} reach past num_target_layers "
                f"({self.num_target_layers}).")
        if len(self.layer_types) != self.num_layers:
            raise ContractError(
                f"drafter config layer_types has {len(self.layer_types)} entries for {self.num_layers} layers.")
        for t in self.layer_types:
            if t not in ("full_attention", "sliding_attention"):
                raise ContractError(f"drafter config layer type {t!r} is not supported (full or sliding only).")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ContractError(f"drafter config sliding_window must be a positive integer, got {self.sliding_window!r}.")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ContractError("drafter config rms_norm_eps and rope_theta must be positive.")
        if self.final_logit_softcapping is not None and self.final_logit_softcapping <= 0:
            raise ContractError("drafter final_logit_softcapping must be positive (or absent for none).")
        if self.rope_scaling is not None and (self.rope_scaling[0] != "linear" or self.rope_scaling[1] <= 0):
            raise ContractError(f"drafter rope scaling {self.rope_scaling!r} is not supported.")

    # -- readers ------------------------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config_json: Mapping[str, Any]) -> DFlash2Geometry:
        """Read a drafter `config.json` dict; `dflash_config` keys win over top-level keys of the same name."""
        if not isinstance(config_json, Mapping):
            raise ContractError("drafter config.json must be a JSON object.")
        archs = config_json.get("architectures")
        if archs is not None and not {"DFlash2DraftModel", "DFlashDraftModel"} & set(archs or ()):
            raise ContractError(
                f"drafter config.json architectures {archs!r} is not DFlash2DraftModel (or DFlashDraftModel).")
        sub = config_json.get("dflash_config") or {}
        if not isinstance(sub, Mapping):
            raise ContractError("drafter config.json dflash_config must be a JSON object.")

        def get(key: str, default: Any = None, required: bool = False) -> Any:
            if key in sub and sub[key] is not None:
                return sub[key]
            if key in config_json and config_json[key] is not None:
                return config_json[key]
            if required:
                raise ContractError(f"drafter config.json lacks the required key {key!r}.")
            return default

        try:
            hidden = _int(get("hidden_size", required=True), "hidden_size")
            heads = _int(get("num_attention_heads", required=True), "num_attention_heads")
            head_dim = get("head_dim")
            head_dim = _int(head_dim, "head_dim") if head_dim is not None else hidden // max(heads, 1)
            num_layers = _int(get("num_hidden_layers", required=True), "num_hidden_layers")
            rope_theta, rope_scaling = _rope(config_json, sub)
            # transformers' Qwen3Config, which the reference reads: no window unless use_sliding_window (default
            # false); without layer_types, the layers from max_window_layers (default 28) on slide when one is left
            sliding = get("sliding_window") if get("use_sliding_window", False) else None
            layer_types = get("layer_types")
            if layer_types is None:
                mwl = _int(get("max_window_layers", 28), "max_window_layers")
                layer_types = tuple("sliding_attention" if sliding is not None and i >= mwl else "full_attention"
                                    for i in range(num_layers))
            causal = get("is_causal")
            softcap = get("final_logit_softcapping")
            softcap = float(softcap) if softcap is not None and float(softcap) > 0 else None
            ntl = get("num_target_layers")
            return cls(
                hidden_size=hidden,
                intermediate_size=_int(get("intermediate_size", required=True), "intermediate_size"),
                num_layers=num_layers,
                num_heads=heads,
                num_kv_heads=_int(get("num_key_value_heads", heads), "num_key_value_heads"),
                head_dim=head_dim,
                vocab_size=_int(get("vocab_size", required=True), "vocab_size"),
                target_layer_ids=tuple(_int(i, "target_layer_ids") for i in get("target_layer_ids", required=True)),
                mask_token_id=_int(get("mask_token_id", required=True), "mask_token_id"),
                block_size=_int(get("block_size", 16), "block_size"),
                rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                num_target_layers=_int(ntl, "num_target_layers") if ntl is not None else None,
                conv_kernel_size=_int(get("conv_kernel_size", 2), "conv_kernel_size"),
                conv_group_size=_int(get("conv_group_size", 16), "conv_group_size"),
                selector_rank=_int(get("selector_rank", 256), "selector_rank"),
                selector_top_k=_int(get("selector_top_k", 16), "selector_top_k"),
                output_multiplier=float(get("output_multiplier", 1.0)),
                final_logit_softcapping=softcap,
                input_embedding_scale=float(get("input_embedding_scale", 1.0)),
                is_causal=None if causal is None else bool(causal),
                sliding_window=_int(sliding, "sliding_window") if sliding is not None else None,
                layer_types=tuple(str(t) for t in layer_types),
            )
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ContractError):
                raise
            raise ContractError(f"drafter config.json has a malformed value ({exc}).") from None

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> DFlash2Geometry:
        """Read the `dflash2.*` keys of a converted file (values as plain Python numbers / lists)."""
        arch = meta.get(KEY_ARCHITECTURE)
        if arch != ARCH:
            raise ContractError(f"GGUF general.architecture is {arch!r}, expected {ARCH!r}.")

        def get(key: str, default: Any = None, required: bool = True) -> Any:
            full = f"{ARCH}.{key}"
            if full in meta:
                return meta[full]
            if required:
                raise ContractError(f"GGUF file lacks the metadata key {full!r}.")
            return default

        n_layers = int(get("block_count"))
        ntl = get("num_target_layers", None, required=False)
        window = int(get("attention.sliding_window", 0, required=False))
        softcap = float(get("final_logit_softcapping", 0.0, required=False))
        scaling = None
        if KEY_ROPE_SCALING_TYPE in meta:
            scaling = (str(meta[KEY_ROPE_SCALING_TYPE]), float(meta[KEY_ROPE_SCALING_FACTOR]))
        return cls(
            hidden_size=int(get("embedding_length")),
            intermediate_size=int(get("feed_forward_length")),
            num_layers=n_layers,
            num_heads=int(get("attention.head_count")),
            num_kv_heads=int(get("attention.head_count_kv")),
            head_dim=int(get("attention.key_length")),
            vocab_size=int(get("vocab_size")),
            target_layer_ids=tuple(int(i) for i in get("target_layers")),
            mask_token_id=int(get("mask_token_id")),
            block_size=int(get("block_size")),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base")),
            rope_scaling=scaling,
            num_target_layers=int(ntl) if ntl is not None else None,
            conv_kernel_size=int(get("conv_kernel_size")),
            conv_group_size=int(get("conv_group_size")),
            selector_rank=int(get("selector_rank")),
            selector_top_k=int(get("selector_top_k")),
            output_multiplier=float(get("output_multiplier", 1.0, required=False)),
            final_logit_softcapping=softcap if softcap > 0 else None,
            input_embedding_scale=float(get("input_embedding_scale", 1.0, required=False)),
            is_causal=None if (causal := get("attention.causal", None, required=False)) is None else bool(causal),
            sliding_window=window if window > 0 else None,
            layer_types=(("sliding_attention" if window > 0 else "full_attention"),) * n_layers,
        )


def _int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise ContractError(f"drafter config value {key} must be an integer, got {value!r}.")
    return int(value)


def _rope(config_json: Mapping[str, Any], sub: Mapping[str, Any]) -> tuple[float, tuple[str, float] | None]:
    params = config_json.get("rope_parameters") or {}
    theta = sub.get("rope_theta", config_json.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = config_json.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type == "linear":
        return float(theta), ("linear", float(scaling["factor"]))
    raise ContractError(f"drafter rope type {rope_type!r} is not supported (default or linear only).")


# ---------------------------------------------------------------------------------------------------------------
# Tensor inventory
# ---------------------------------------------------------------------------------------------------------------

_LAYER_CONV = ("attention_conv", "mlp_conv")


def expected_tensors(geom: DFlash2Geometry, *, v1: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:
    """The tensors a checkpoint must hold: name -> (shape in HF order, kind). 15*L + 6 names (v1: 11*L + 3)."""
    H, I, hd = geom.hidden_size, geom.intermediate_size, geom.head_dim  # noqa: E741
    q_rows, kv_rows = geom.num_heads * hd, geom.num_kv_heads * hd
    out: dict[str, tuple[tuple[int, ...], str]] = {
        "fc.weight": ((H, geom.num_taps * H), "backbone"),
        "hidden_norm.weight": ((H,), "norm"),
        "norm.weight": ((H,), "norm"),
    }
    for i in range(geom.num_layers):
        p = f"layers.{i}."
        out[p + "input_layernorm.weight"] = ((H,), "norm")
        out[p + "post_attention_layernorm.weight"] = ((H,), "norm")
        out[p + "self_attn.q_proj.weight"] = ((q_rows, H), "backbone")
        out[p + "self_attn.k_proj.weight"] = ((kv_rows, H), "backbone")
        out[p + "self_attn.v_proj.weight"] = ((kv_rows, H), "backbone")
        out[p + "self_attn.o_proj.weight"] = ((H, q_rows), "backbone")
        out[p + "self_attn.q_norm.weight"] = ((hd,), "norm")
        out[p + "self_attn.k_norm.weight"] = ((hd,), "norm")
        out[p + "mlp.gate_proj.weight"] = ((I, H), "backbone")
        out[p + "mlp.up_proj.weight"] = ((I, H), "backbone")
        out[p + "mlp.down_proj.weight"] = ((H, I), "backbone")
        if not v1:
            for conv in _LAYER_CONV:
                out[p + conv + ".base_kernel"] = ((2, geom.conv_kernel_size, H), "conv")
                out[p + conv + ".kernel_projection.weight"] = ((geom.conv_projection_rows, H), "conv")
    if not v1:
        out["candidate_selector.hidden_projection.weight"] = ((geom.selector_rank, H), "selector")
        out["candidate_selector.predecessor_codebook"] = ((geom.vocab_size, geom.selector_rank), "selector")
        out["candidate_selector.successor_codebook"] = ((geom.vocab_size, geom.selector_rank), "selector")
    return out


def weight_bytes(geom: DFlash2Geometry, quant: str, *, float_bytes: int = 2, v1: bool = False) -> int:
    """Bytes of a drafter's weights as the runtime holds them: backbone matrices in `quant` (docs/formats.md, "Block
    formats"), the norm, convolution and selector tensors as floats of `float_bytes` (BF16 = 2 as stored; the CPU
    runtime widens them to fp32 = 4). QuantFormatError when a row cannot be stored in `quant`."""
    fmt = block_format(quant)
    total = 0
    for shape, kind in expected_tensors(geom, v1=v1).values():
        numel = math.prod(shape)
        if kind == "backbone" and fmt.quantized:
            total += shape[0] * row_bytes(shape[-1], fmt.name)
        else:
            total += numel * float_bytes
    return total


def tensor_count(num_layers: int, *, v1: bool = False) -> int:
    """81 for the official L = 5 (15*L + 6); 11*L + 3 for the v1 layout."""
    return 11 * num_layers + 3 if v1 else 15 * num_layers + 6


def check_inventory(
    found: Mapping[str, tuple[tuple[int, ...], str]],
    geom: DFlash2Geometry,
    *,
    allow_v1: bool = False,
    allow_quantized: bool = False,
) -> str:
    """Check a file's tensors {name: (shape in HF order, dtype)} against the contract; return "v2" or "v1".

    dtype strings are safetensors/ggml names ("BF16", "Q8_0", ...). Norm, convolution and selector tensors must be
    BF16; backbone matrices BF16, or Q8_0/Q5_0/Q4_0 when `allow_quantized` (a converted GGUF). The first problem is
    raised as a ContractError naming the tensor (and how many more problems there are).
    """
    v1 = False
    if allow_v1 and not any(is_v2_only(n) for n in found):
        v1 = True
    expected = expected_tensors(geom, v1=v1)
    problems: list[str] = []
    for name in expected:
        if name not in found:
            problems.append(f"drafter checkpoint is missing tensor {name!r}")
    for name in found:
        if name not in expected:
            problems.append(f"drafter checkpoint has unexpected tensor {name!r}")
    for name, (shape, kind) in expected.items():
        if name not in found:
            continue
        fshape, dtype = found[name]
        if tuple(int(s) for s in fshape) != shape:
            problems.append(
                f"drafter tensor {name!r} has shape {list(fshape)}, expected {list(shape)}")
        dtype = str(dtype).upper()
        allowed = BACKBONE_DTYPES if (kind == "backbone" and allow_quantized) else (FLOAT_DTYPE,)
        if dtype not in allowed:
            problems.append(
                f"drafter tensor {name!r} has dtype {dtype}, expected {' or '.join(allowed)}")
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise ContractError(problems[0] + more + "; this file does not follow the DFlash2 checkpoint contract.")
    return "v1" if v1 else "v2"


def pairing_problem(geom: DFlash2Geometry, hidden_size: int, vocab_size: int, num_layers: int) -> str | None:
    """Why a drafter cannot draft for a target of this hidden size, vocabulary and layer count (None: it fits).
    The loader refuses such a pair; the catalog lists a head only for the targets it fits."""
    if geom.hidden_size != hidden_size:
        return f"drafter hidden_size {geom.hidden_size} does not match the target's {hidden_size}"
    if geom.vocab_size != vocab_size:
        return f"drafter vocab_size {geom.vocab_size} does not match the target's {vocab_size}"
    bad = [i for i in geom.target_layer_ids if i >= num_layers]
    if bad:
        return f"drafter taps target layers {bad} but the target has only {num_layers} layers"
    if geom.num_target_layers is not None and geom.num_target_layers != num_layers:
        return (f"drafter was made for a target with {geom.num_target_layers} layers, this target has "
                f"{num_layers}")
    return None


def is_v2_only(name: str) -> bool:
    """A tensor the v1 (plain DFlash) layout does not have: a convolution or the candidate selector."""
    return name.startswith("candidate_selector.") or any(f".{c}." in name for c in _LAYER_CONV)


# ---------------------------------------------------------------------------------------------------------------
# HF <-> GGUF names (docs/formats.md, "Converted DFlash2 GGUF")
# ---------------------------------------------------------------------------------------------------------------

_GLOBAL_NAMES = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "hidden_norm.weight",
    "norm.weight": "output_norm.weight",
    "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
    "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
    "candidate_selector.successor_codebook": "selector_successor.weight",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "attention_conv.base_kernel": "attn_conv_base",
    "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
    "mlp_conv.base_kernel": "ffn_conv_base",
    "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight",
}
_GLOBAL_BACK = {v: k for k, v in _GLOBAL_NAMES.items()}
_LAYER_BACK = {v: k for k, v in _LAYER_NAMES.items()}


def hf_to_gguf(name: str) -> str:
    """HF checkpoint tensor name -> GGUF tensor name; ContractError for a name outside the contract."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    layer, rest = _split_layer(name, "layers.")
    if layer is not None and rest in _LAYER_NAMES:
        return f"blk.{layer}.{_LAYER_NAMES[rest]}"
    raise ContractError(f"tensor {name!r} is not part of the DFlash2 checkpoint contract.")


def gguf_to_hf(name: str) -> str:
    """GGUF tensor name -> HF checkpoint tensor name; ContractError for a name outside the contract."""
    if name in _GLOBAL_BACK:
        return _GLOBAL_BACK[name]
    layer, rest = _split_layer(name, "blk.")
    if layer is not None and rest in _LAYER_BACK:
        return f"layers.{layer}.{_LAYER_BACK[rest]}"
    raise ContractError(f"GGUF tensor {name!r} is not part of the DFlash2 file contract.")


def _split_layer(name: str, prefix: str) -> tuple[int | None, str]:
    if not name.startswith(prefix):
        return None, name
    idx, _, rest = name[len(prefix):].partition(".")
    if not idx.isdigit() or str(int(idx)) != idx:
        return None, name
    return int(idx), rest


# ---------------------------------------------------------------------------------------------------------------
# GGUF metadata (docs/formats.md, "Converted DFlash2 GGUF")
# ---------------------------------------------------------------------------------------------------------------

def gguf_metadata(geom: DFlash2Geometry) -> dict[str, tuple[str, Any]]:
    """The `dflash2.*` keys for a converted file: {key: (type, value)}, type in u32/f32/bool/u32[]/str.

    `general.*` and `strata.*` keys are the converter's to add (names: KEY_* constants, ids: runtime/formats/registry.py).
    """
    kinds = {(geom.layer_window(i), geom.layer_causal(i)) for i in range(geom.num_layers)}
    if len(kinds) > 1:
        raise ContractError(
            "this drafter's layers attend differently (sliding and full, or causal and not), which the GGUF format "
            "cannot express; use the Hugging Face folder instead.")
    window, causal = kinds.pop()
    window = window or 0
    a = ARCH
    meta: dict[str, tuple[str, Any]] = {
        f"{a}.embedding_length": ("u32", geom.hidden_size),
        f"{a}.block_count": ("u32", geom.num_layers),
        f"{a}.feed_forward_length": ("u32", geom.intermediate_size),
        f"{a}.attention.head_count": ("u32", geom.num_heads),
        f"{a}.attention.head_count_kv": ("u32", geom.num_kv_heads),
        f"{a}.attention.key_length": ("u32", geom.head_dim),
        f"{a}.attention.layer_norm_rms_epsilon": ("f32", geom.rms_norm_eps),
        f"{a}.rope.freq_base": ("f32", geom.rope_theta),
        f"{a}.vocab_size": ("u32", geom.vocab_size),
        f"{a}.block_size": ("u32", geom.block_size),
        f"{a}.mask_token_id": ("u32", geom.mask_token_id),
        f"{a}.target_layers": ("u32[]", list(geom.target_layer_ids)),
        f"{a}.conv_kernel_size": ("u32", geom.conv_kernel_size),
        f"{a}.conv_group_size": ("u32", geom.conv_group_size),
        f"{a}.selector_rank": ("u32", geom.selector_rank),
        f"{a}.selector_top_k": ("u32", geom.selector_top_k),
        f"{a}.output_multiplier": ("f32", geom.output_multiplier),
        f"{a}.final_logit_softcapping": ("f32", geom.final_logit_softcapping or 0.0),
        f"{a}.input_embedding_scale": ("f32", geom.input_embedding_scale),
        f"{a}.attention.causal": ("bool", causal),
        f"{a}.attention.sliding_window": ("u32", window),
    }
    if geom.num_target_layers is not None:      # optional: lets the loader refuse a head made for another depth
        meta[f"{a}.num_target_layers"] = ("u32", geom.num_target_layers)
    if geom.rope_scaling is not None:
        meta[KEY_ROPE_SCALING_TYPE] = ("str", geom.rope_scaling[0])
        meta[KEY_ROPE_SCALING_FACTOR] = ("f32", geom.rope_scaling[1])
    return meta


def write_gguf_metadata(writer: Any, geom: DFlash2Geometry) -> None:
    """Add `gguf_metadata(geom)` to a `gguf.GGUFWriter` (whose arch must be "dflash2")."""
    import gguf

    for key, (kind, value) in gguf_metadata(geom).items():
        if kind == "u32":
            writer.add_uint32(key, int(value))
        elif kind == "f32":
            writer.add_float32(key, float(value))
        elif kind == "bool":
            writer.add_bool(key, bool(value))
        elif kind == "str":
            writer.add_string(key, str(value))
        else:
            writer.add_key_value(key, [int(v) for v in value], gguf.GGUFValueType.ARRAY,
                                 sub_type=gguf.GGUFValueType.UINT32)
