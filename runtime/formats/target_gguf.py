"""The target's GGUF layout: llama.cpp's own `qwen3moe` (docs/formats.md, "Converted target GGUF").

One definition for the converter (setup_wizard/convert_target.py), the loader (runtime/loading_gguf.py) and the
tests: which checkpoint tensor becomes which GGUF tensor, which tensors are stored as F32, which metadata keys carry
the config, and how a file's metadata becomes a `Qwen3MoeConfig` again. Every name comes from gguf-py's constants
(`MODEL_ARCH.QWEN3MOE`, `TENSOR_NAMES`, `Keys`), so the file is one llama.cpp's `convert_hf_to_gguf.py` could have
written for the same checkpoint, and files that converter wrote read back here.

The MTP head is not part of llama.cpp's `qwen3moe` (its converter refuses `mtp.*` tensors and llama.cpp refuses a
file with tensors it does not expect), so it goes into a second file beside the target, `mtp.gguf`, with gguf-py's
NextN names at block index L (the number of target layers); the target file names it in `strata.mtp.file`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gguf.constants import (
    GGML_QUANT_VERSION,
    MODEL_ARCH,
    MODEL_ARCH_NAMES,
    TENSOR_NAMES,
    GGUFType,
    Keys,
    RopeScalingType,
)
from gguf.constants import MODEL_TENSOR as T

from runtime.errors import ConfigError, LoadError
from runtime.models.target_config import Qwen3MoeConfig

ARCH = MODEL_ARCH_NAMES[MODEL_ARCH.QWEN3MOE]            # "qwen3moe"
TARGET_QUANTS = ("bf16", "q8_0", "q4_0")                 # what Strata converts a target to (--target-quant)
MTP_FILE = "mtp.gguf"
KEY_MTP_FILE = "strata.mtp.file"                         # in the target file: the MTP file beside it
# llama.cpp's qwen3moe always renormalises the top-k routing weights; a checkpoint that does not is written with
# this standard key (llama.cpp ignores it for qwen3moe, Strata reads it; absent = true).
KEY_EXPERT_WEIGHTS_NORM = Keys.LLM.EXPERT_WEIGHTS_NORM

# checkpoint suffix inside a decoder layer -> tensor kind (the MTP layer reuses these at block L)
_LAYER: dict[str, T] = {
    "input_layernorm.weight": T.ATTN_NORM,
    "self_attn.q_proj.weight": T.ATTN_Q,
    "self_attn.k_proj.weight": T.ATTN_K,
    "self_attn.v_proj.weight": T.ATTN_V,
    "self_attn.o_proj.weight": T.ATTN_OUT,
    "self_attn.q_norm.weight": T.ATTN_Q_NORM,
    "self_attn.k_norm.weight": T.ATTN_K_NORM,
    "post_attention_layernorm.weight": T.FFN_NORM,
    "mlp.gate.weight": T.FFN_GATE_INP,
    "mlp.gate_proj.weight": T.FFN_GATE,      # a dense MLP: only an MTP layer may have one here
    "mlp.up_proj.weight": T.FFN_UP,
    "mlp.down_proj.weight": T.FFN_DOWN,
}
_EXPERTS: dict[str, T] = {"gate_proj": T.FFN_GATE_EXP, "up_proj": T.FFN_UP_EXP, "down_proj": T.FFN_DOWN_EXP}
_TOP: dict[str, T] = {"model.embed_tokens.weight": T.TOKEN_EMBD, "model.norm.weight": T.OUTPUT_NORM,
                      "lm_head.weight": T.OUTPUT}
_MTP_TOP: dict[str, T] = {"mtp.fc.weight": T.NEXTN_EH_PROJ, "mtp.pre_fc_norm_embedding.weight": T.NEXTN_ENORM,
                          "mtp.pre_fc_norm_hidden.weight": T.NEXTN_HNORM, "mtp.norm.weight": T.NEXTN_SHARED_HEAD_NORM}
_LAYER_RE = re.compile(r"^(model\.layers\.(\d+)|mtp\.layers\.0)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def tensor_name(kind: T, bid: int | None = None) -> str:
    """gguf-py's name of a tensor kind (`blk.3.ffn_gate_exps.weight`)."""
    return TENSOR_NAMES[kind].format(bid=bid) + ".weight"


@dataclass(frozen=True)
class Placement:
    """Where one checkpoint tensor goes."""

    gguf: str                 # GGUF tensor name
    expert: int | None        # index in the stacked tensor for a routed expert
    mtp: bool                 # the tensor belongs to the MTP file


def place(hf_name: str, n_layers: int) -> Placement:
    """The GGUF name of a checkpoint tensor (docs/formats.md, "Converted target GGUF"); LoadError when the
    `qwen3moe` layout has no place for it."""
    if hf_name in _TOP:
        return Placement(tensor_name(_TOP[hf_name]), None, False)
    if hf_name in _MTP_TOP:
        return Placement(tensor_name(_MTP_TOP[hf_name], n_layers), None, True)
    m = _LAYER_RE.match(hf_name)
    if m:
        mtp = m.group(1).startswith("mtp.")
        bid = n_layers if mtp else int(m.group(2))
        rest = m.group(3)
        e = _EXPERT_RE.match(rest)
        if e:
            return Placement(tensor_name(_EXPERTS[e.group(2)], bid), int(e.group(1)), mtp)
        if rest in _LAYER and (mtp or _LAYER[rest] not in (T.FFN_GATE, T.FFN_UP, T.FFN_DOWN)):
            return Placement(tensor_name(_LAYER[rest], bid), None, mtp)
    raise LoadError(f"tensor {hf_name!r} has no place in llama.cpp's {ARCH} layout.")


def stored_as_f32(gguf_name: str, ndim: int) -> bool:
    """llama.cpp's converter rule: 1-D tensors, `*_norm.weight` and the router `ffn_gate_inp` are written as F32
    whatever the file type."""
    if ndim <= 1 or gguf_name.endswith("_norm.weight"):
        return True
    return bool(re.fullmatch(TENSOR_NAMES[T.FFN_GATE_INP].format(bid=r"\d+") + r"\.weight", gguf_name))


def is_expert_stack(gguf_name: str) -> bool:
    return any(re.fullmatch(TENSOR_NAMES[k].format(bid=r"\d+") + r"\.weight", gguf_name) for k in _EXPERTS.values())


# ---------------------------------------------------------------------------------------------------------------
# metadata

def check_writable(cfg: Qwen3MoeConfig) -> None:
    """Refuse a checkpoint that llama.cpp's `qwen3moe` would read differently (one sentence, ConfigError)."""
    if cfg.num_experts <= 0:
        raise ConfigError(f"config.json has no routed experts; llama.cpp's {ARCH} layout needs a MoE model.")
    dense = [i for i in range(cfg.num_hidden_layers) if not cfg.is_sparse(i)]
    if dense:
        raise ConfigError(f"layer {dense[0]} of this checkpoint is a dense MLP (mlp_only_layers/decoder_sparse_step); "
                          f"llama.cpp's {ARCH} layout has MoE layers only, so it cannot be converted.")
    if cfg.attention_bias:
        raise ConfigError(f"this checkpoint has attention biases, which llama.cpp's {ARCH} layout does not hold.")
    if cfg.rope_type == "yarn" and (cfg.rope_params.get("mscale") or cfg.rope_params.get("mscale_all_dim")
                                    or cfg.rope_params.get("truncate") is False):
        raise ConfigError("this checkpoint's YaRN settings (mscale, truncate) have no GGUF key; it cannot be "
                          "converted without changing its RoPE.")


def add_metadata(w: Any, cfg: Qwen3MoeConfig, *, file_type: int, name: str, mtp: bool = False) -> None:
    """The general.* and qwen3moe.* keys in llama.cpp converter's order, through gguf-py's `add_*` helpers. The MTP
    file counts its NextN layer in `block_count` and says so in `nextn_predict_layers`, as llama.cpp does."""
    w.add_type(GGUFType.MODEL)
    if name:
        w.add_name(name)
    w.add_block_count(cfg.num_hidden_layers + (1 if mtp else 0))
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    if cfg.intermediate_size:
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rp = cfg.rope_params
    if cfg.rope_type == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rp["factor"]))
    elif cfg.rope_type == "yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        factor = rp.get("factor") or cfg.max_position_embeddings / int(rp["original_max_position_embeddings"])
        w.add_rope_scaling_factor(float(factor))
        w.add_rope_scaling_orig_ctx_len(int(rp.get("original_max_position_embeddings") or cfg.max_position_embeddings))
        if rp.get("attention_factor") is not None:
            w.add_rope_scaling_yarn_attn_factor(float(rp["attention_factor"]))
        if rp.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(float(rp["beta_fast"]))
        if rp.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(float(rp["beta_slow"]))
    w.add_rope_freq_base(float(cfg.rope_theta))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_file_type(int(file_type))
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if not cfg.norm_topk_prob:
        w.add_expert_weights_norm(False)
    if mtp:
        w.add_nextn_predict_layers(1)
    w.add_quantization_version(GGML_QUANT_VERSION)


def arch_key(template: str) -> str:
    """A `{arch}` key of gguf-py's `Keys` for qwen3moe."""
    return template.format(arch=ARCH)


def config_from_metadata(meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], *,
                         source: str = "the GGUF file") -> Qwen3MoeConfig:
    """A `Qwen3MoeConfig` from a qwen3moe file's metadata and its tensor shapes (torch order): vocabulary size from
    `token_embd`, tied embeddings when there is no `output` tensor. LoadError (one sentence) otherwise."""
    arch = meta.get(Keys.General.ARCHITECTURE)
    if arch != ARCH:
        raise LoadError(f"{source} holds a {arch!r} model; Strata runs {ARCH} (Qwen3-MoE) targets only.")

    def need(template: str) -> Any:
        k = arch_key(template)
        if k not in meta:
            raise LoadError(f"{source} lacks the metadata key {k}; it is not a complete {ARCH} file.")
        return meta[k]

    def opt(template: str, default: Any = None) -> Any:
        return meta.get(arch_key(template), default)

    nextn = int(opt(Keys.LLM.NEXTN_PREDICT_LAYERS, 0) or 0)
    layers = int(need(Keys.LLM.BLOCK_COUNT)) - nextn
    heads = int(need(Keys.Attention.HEAD_COUNT))
    hidden = int(need(Keys.LLM.EMBEDDING_LENGTH))
    embd = shapes.get(tensor_name(T.TOKEN_EMBD))
    if embd is None:
        raise LoadError(f"{source} has no {tensor_name(T.TOKEN_EMBD)} tensor; it is not a complete {ARCH} file.")
    rtype = str(opt(Keys.Rope.SCALING_TYPE, RopeScalingType.NONE.value) or "none")
    rp: dict[str, Any] = {}
    if rtype == RopeScalingType.LINEAR.value:
        rope_type, rp = "linear", {"rope_type": "linear", "factor": float(need(Keys.Rope.SCALING_FACTOR))}
    elif rtype == RopeScalingType.YARN.value:
        rope_type = "yarn"
        rp = {"rope_type": "yarn", "factor": float(need(Keys.Rope.SCALING_FACTOR)),
              "original_max_position_embeddings": int(need(Keys.Rope.SCALING_ORIG_CTX_LEN))}
        for k, tk in (("attention_factor", Keys.Rope.SCALING_YARN_ATTN_FACTOR),
                      ("beta_fast", Keys.Rope.SCALING_YARN_BETA_FAST), ("beta_slow", Keys.Rope.SCALING_YARN_BETA_SLOW)):
            if opt(tk) is not None:
                rp[k] = float(opt(tk))
    elif rtype == RopeScalingType.NONE.value:
        rope_type = "default"
    else:
        raise LoadError(f"{source} asks for RoPE scaling {rtype!r}; supported: none, linear, yarn.")
    eos = [int(meta[k]) for k in (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID) if meta.get(k) is not None]
    bos = meta.get(Keys.Tokenizer.BOS_ID)
    head_dim = int(opt(Keys.Attention.KEY_LENGTH, hidden // heads))
    if int(opt(Keys.Attention.VALUE_LENGTH, head_dim)) != head_dim:
        raise LoadError(f"{source} has different key and value head sizes, which {ARCH} does not have.")
    return Qwen3MoeConfig(
        vocab_size=int(embd[0]),
        hidden_size=hidden,
        intermediate_size=int(opt(Keys.LLM.FEED_FORWARD_LENGTH, 0) or 0),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(opt(Keys.Attention.HEAD_COUNT_KV, heads)),
        head_dim=head_dim,
        rms_norm_eps=float(need(Keys.Attention.LAYERNORM_RMS_EPS)),
        rope_theta=float(opt(Keys.Rope.FREQ_BASE, 10000.0)),
        rope_type=rope_type,
        rope_params=rp,
        max_position_embeddings=int(opt(Keys.LLM.CONTEXT_LENGTH, 32768)),
        num_experts=int(need(Keys.LLM.EXPERT_COUNT)),
        num_experts_per_tok=int(need(Keys.LLM.EXPERT_USED_COUNT)),
        moe_intermediate_size=int(need(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)),
        norm_topk_prob=bool(opt(KEY_EXPERT_WEIGHTS_NORM, True)),
        tie_word_embeddings=tensor_name(T.OUTPUT) not in shapes,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=list(dict.fromkeys(eos)),
    )


# ---------------------------------------------------------------------------------------------------------------
# the budget's view of a file

_FLOAT_TENSORS = ("F32", "F16", "BF16")


def _parts(tensors: list[Any]) -> tuple[int, int]:
    """(block bytes, float elements) of some GGUF tensors."""
    blocks = sum(int(t.n_bytes) for t in tensors if t.tensor_type.name not in _FLOAT_TENSORS)
    floats = sum(int(t.n_elements) for t in tensors if t.tensor_type.name in _FLOAT_TENSORS)
    return blocks, floats


def file_quant(meta: Mapping[str, Any], tensors: list[Any]) -> str:
    """The target's storage label: Strata's `strata.quantization`, else the block format most of the expert bytes
    are in (a llama.cpp Q4_K_M file says "q4_k"), else "bf16" for a float file."""
    from runtime.formats.registry import by_tensor_type

    q = meta.get("strata.quantization")
    if isinstance(q, str) and q:
        return q
    by: dict[str, int] = {}
    for t in tensors:
        f = by_tensor_type(t.tensor_type.name)
        if is_expert_stack(t.name) and f is not None:
            by[f.name] = by.get(f.name, 0) + int(t.n_bytes)
    blocked = {k: v for k, v in by.items() if k != "bf16"}
    return max(blocked, key=blocked.__getitem__) if blocked else "bf16"


def read_geometry(path: Any):
    """The budget geometry of a qwen3moe GGUF target (every part of a split one, and its MTP file), exact from the
    tensor table: block tensors by their bytes, float tensors by their elements (the runtime holds those in its own
    dtype). Reads no weights."""
    from pathlib import Path

    from runtime.formats.gguf_meta import open_gguf
    from runtime.formats.gguf_split import GGUFSet
    from runtime.models.target_config import TargetGeometry

    path = Path(path)
    parts = GGUFSet(path)
    meta = parts.meta
    tensors = list(parts.tensors.values())
    shapes = {t.name: tuple(int(d) for d in reversed(list(t.shape))) for t in tensors}
    cfg = config_from_metadata(meta, shapes, source=path.name)
    experts = [t for t in tensors if is_expert_stack(t.name)]
    dense = [t for t in tensors if not is_expert_stack(t.name)]
    per_layer: dict[str, list[Any]] = {}
    for t in experts:
        per_layer.setdefault(t.name.split(".")[1], []).append(t)
    one = max((_parts(ts) for ts in per_layer.values()), key=lambda p: p[0] + 4 * p[1], default=(0, 0))
    e = max(cfg.num_experts, 1)
    mtp_parts = None
    mtp_name = meta.get(KEY_MTP_FILE)
    if isinstance(mtp_name, str) and "/" not in mtp_name and "\\" not in mtp_name and (path.parent / mtp_name).is_file():
        mtp_tensors = list(open_gguf(path.parent / mtp_name).tensors)
        mtp_parts = _parts(mtp_tensors)
        cfg.mtp_layers = 1
        cfg.mtp_sparse = any(t.name == tensor_name(T.FFN_GATE_INP, cfg.num_hidden_layers) for t in mtp_tensors)
    geo = TargetGeometry.from_target_config(cfg, has_mtp=mtp_parts is not None)
    from dataclasses import replace

    by_name = {t.name: t for t in tensors}
    head = by_name.get("output.weight") or by_name.get("token_embd.weight")      # tied: the embedding table
    float_head = head is not None and head.tensor_type.name in _FLOAT_TENSORS
    return replace(geo, mtp_sparse=cfg.mtp_sparse if mtp_parts else geo.mtp_sparse, quant=file_quant(meta, tensors),
                   gguf_dense=_parts(dense), gguf_expert=(one[0] // e, one[1] // e), gguf_mtp=mtp_parts,
                   float_head=float_head)
