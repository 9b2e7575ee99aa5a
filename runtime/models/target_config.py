"""The Qwen3-MoE target's config.json, read without torch (docs/models.md, "Qwen3-MoE target").

The runtime builds its modules from it and the setup budget derives its geometry from it, so both read one
definition of what a config means (defaults, transformers 4.x and 5.x spellings, unsupported features refused).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from runtime.errors import ConfigError

__all__ = ["ConfigError", "Qwen3MoeConfig", "TargetGeometry"]


_INT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings", "num_experts", "num_local_experts",
             "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step", "num_nextn_predict_layers",
             "mtp_num_hidden_layers")


@dataclass
class Qwen3MoeConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_params: dict[str, Any] = field(default_factory=dict)
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    mtp_layers: int = 0          # 0 or 1: an MTP head (`mtp.*`) is present
    mtp_sparse: bool = True      # the MTP decoder layer is MoE (else dense)
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Qwen3MoeConfig:
        """Read a Hub config.json dict (transformers 4.x or 5.x spelling)."""
        mt = d.get("model_type", "qwen3_moe")
        if mt not in ("qwen3_moe",):
            raise ConfigError(f"config.json has model_type {mt!r}; this runtime runs qwen3_moe targets only.")
        need = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"]
        missing = [k for k in need if k not in d]
        if missing:
            raise ConfigError(f"config.json lacks {', '.join(missing)}; it is not a complete qwen3_moe config.")
        if d.get("use_sliding_window"):
            raise ConfigError("config.json enables use_sliding_window, which this runtime does not support.")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config.json uses hidden_act {act!r}; only silu is supported.")
        bad = [k for k in _INT_KEYS if k in d and d[k] is not None
               and (isinstance(d[k], bool) or not isinstance(d[k], int) or d[k] < 0)]
        if bad:
            raise ConfigError(f"config.json key '{bad[0]}' must be a non-negative integer, not {d[bad[0]]!r}.")
        heads = int(d["num_attention_heads"])
        head_dim = d.get("head_dim") or int(d["hidden_size"]) // heads
        rp = dict(d.get("rope_parameters") or {})
        rs = d.get("rope_scaling") or {}
        rp = {**rs, **rp}
        theta = float(rp.get("rope_theta", d.get("rope_theta", 10000.0)))
        rtype = rp.get("rope_type", rp.get("type", "default")) or "default"
        if rtype not in ("default", "linear", "yarn"):
            raise ConfigError(f"config.json asks for rope type {rtype!r}; supported: default, linear, yarn.")
        if float(rp.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ConfigError("config.json sets partial_rotary_factor != 1, which qwen3_moe does not use.")
        eos = d.get("eos_token_id")
        eos_list = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        n_mtp = int(d.get("num_nextn_predict_layers", d.get("mtp_num_hidden_layers", 0)) or 0)
        if n_mtp > 1:
            raise ConfigError(f"config.json asks for {n_mtp} MTP layers; this runtime supports one.")
        n_exp = int(d.get("num_experts", d.get("num_local_experts", 0)) or 0)
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d.get("intermediate_size", 0)),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_type=rtype,
            rope_params=rp,
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            attention_bias=bool(d.get("attention_bias", False)),
            num_experts=n_exp,
            num_experts_per_tok=int(d.get("num_experts_per_tok", 1)),
            moe_intermediate_size=int(d.get("moe_intermediate_size", 0)),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            decoder_sparse_step=int(d.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=[int(i) for i in (d.get("mlp_only_layers") or [])],
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            hidden_act=act,
            mtp_layers=n_mtp,
            mtp_sparse=bool(d.get("mtp_sparse", n_exp > 0)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos_list,
        )

    def is_sparse(self, layer_idx: int) -> bool:
        """transformers' rule: MoE unless listed in mlp_only_layers or off the decoder_sparse_step grid."""
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


@dataclass(frozen=True)
class TargetGeometry:
    """Element counts of a Qwen3-MoE target by part (dense, one routed expert, MTP head): what the memory budget
    multiplies by bytes (docs/budget.md)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int  # dense MLP width (layers in mlp_only_layers or off the sparse step)
    moe_intermediate: int
    experts: int  # routed experts per sparse layer
    top_k: int
    sparse_layers: tuple[int, ...]
    tie_embeddings: bool
    attention_bias: bool = False
    max_position: int = 32768
    has_mtp: bool = False
    mtp_sparse: bool = True  # the MTP decoder layer has a MoE block (else a dense MLP)
    # exact element counts from a tensor inventory (see `with_inventory`), preferred over the config arithmetic
    dense_count: int | None = None
    mtp_count: int | None = None
    # how the weights are stored (docs/budget.md): "bf16" = floats in the runtime dtype (a folder, a BF16 GGUF); a
    # block format name = a quantized GGUF, whose matrices stay ggml blocks while norms and the router are floats
    quant: str = "bf16"
    # exact (block bytes, float elements) from a GGUF tensor table (`runtime/formats/target_gguf.py`): the dense
    # part, one expert (of the layer whose experts are largest) and the MTP head
    gguf_dense: tuple[int, int] | None = None
    gguf_expert: tuple[int, int] | None = None
    gguf_mtp: tuple[int, int] | None = None
    # the vocabulary head is held as floats (a folder; a GGUF whose output, or tied token_embd, is F32/F16/BF16):
    # on a CPU the MTP chain then keeps an int8 copy of it (runtime/drafters/head8.py)
    float_head: bool = True

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], *, has_mtp: bool | None = None) -> TargetGeometry:
        """From a Hugging Face `config.json` of `qwen3_moe`, read by `Qwen3MoeConfig` (MTP presence from its
        `num_nextn_predict_layers`/`mtp_*` keys unless `has_mtp` is given: the tensor inventory is the better
        witness)."""
        return cls.from_target_config(Qwen3MoeConfig.from_dict(dict(cfg)), has_mtp=has_mtp)

    @classmethod
    def from_target_config(cls, c: Qwen3MoeConfig, *, has_mtp: bool | None = None) -> TargetGeometry:
        return cls(
            hidden=c.hidden_size,
            layers=c.num_hidden_layers,
            heads=c.num_attention_heads,
            kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            vocab=c.vocab_size,
            intermediate=c.intermediate_size,
            moe_intermediate=c.moe_intermediate_size,
            experts=c.num_experts,
            top_k=c.num_experts_per_tok,
            sparse_layers=tuple(i for i in range(c.num_hidden_layers) if c.is_sparse(i)),
            tie_embeddings=c.tie_word_embeddings,
            attention_bias=c.attention_bias,
            max_position=c.max_position_embeddings,
            has_mtp=bool(c.mtp_layers) if has_mtp is None else bool(has_mtp),
            mtp_sparse=c.num_experts > 0,
        )

    def with_inventory(self, inventory: Mapping[str, int]) -> TargetGeometry:
        """Exact counts from the checkpoint's tensor names → element counts (the safetensors header): routed
        experts are `model.layers.N.mlp.experts.*`, the MTP head is `mtp.*`, everything else is dense."""
        dense = mtp = 0
        mtp_sparse = False
        for name, n in inventory.items():
            if name.startswith("mtp."):
                mtp += n
                mtp_sparse = mtp_sparse or ".mlp.experts." in name
            elif not (name.startswith("model.layers.") and ".mlp.experts." in name):
                dense += n
        return replace(self, dense_count=dense, mtp_count=mtp, has_mtp=mtp > 0, mtp_sparse=mtp_sparse)

    # --- element counts -------------------------------------------------------------------------------------
    def attention_elems(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        n = h * q + 2 * h * kv + q * h + 2 * self.head_dim  # q,k,v,o + q_norm,k_norm
        if self.attention_bias:
            n += q + 2 * kv + h
        return n

    def expert_elems(self) -> int:
        """One routed expert: gate, up and down projections."""
        return 3 * self.hidden * self.moe_intermediate

    def layer_dense_elems(self, sparse: bool) -> int:
        """A decoder layer without its routed experts (norms, attention, router or dense MLP)."""
        n = 2 * self.hidden + self.attention_elems()
        n += self.experts * self.hidden if sparse else 3 * self.hidden * self.intermediate
        return n

    def dense_elems(self) -> int:
        """The target without routed experts and without `mtp.*`."""
        if self.dense_count is not None:
            return self.dense_count
        n = self.vocab * self.hidden * (1 if self.tie_embeddings else 2) + self.hidden
        for i in range(self.layers):
            n += self.layer_dense_elems(i in self.sparse_layers)
        return n

    def mtp_elems(self) -> int:
        """All `mtp.*` tensors (docs/models.md, "MTP head"): two pre-fc norms, fc [H, 2H], one decoder layer, final norm."""
        if not self.has_mtp:
            return 0
        if self.mtp_count is not None:
            return self.mtp_count
        h = self.hidden
        n = 2 * h + 2 * h * h + h + self.layer_dense_elems(self.mtp_sparse)
        if self.mtp_sparse:
            n += self.experts * self.expert_elems()
        return n

    @property
    def total_experts(self) -> int:
        return len(self.sparse_layers) * self.experts

    # --- bytes as the runtime holds them (`wb`: bytes of the runtime's float dtype) ------------------------------
    def with_quant(self, quant: str) -> TargetGeometry:
        """The same model stored as `quant` (a conversion the setup would make)."""
        from runtime.formats.registry import block_format

        return replace(self, quant=block_format(quant).name, gguf_dense=None, gguf_expert=None, gguf_mtp=None)

    def _blocked(self) -> bool:
        from runtime.formats.registry import block_format

        return block_format(self.quant).quantized

    def matrix_bytes(self, rows: int, cols: int, wb: int) -> int:
        """One [rows, cols] weight matrix: ggml blocks when the target is quantized, else floats."""
        from runtime.formats.registry import row_bytes

        return rows * row_bytes(cols, self.quant) if self._blocked() else rows * cols * wb

    def layer_dense_bytes(self, sparse: bool, wb: int) -> int:
        """`layer_dense_elems` in bytes: matrices per `matrix_bytes`, norms and router as floats."""
        h, q, kv, hd = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.head_dim
        n = self.matrix_bytes(q, h, wb) + 2 * self.matrix_bytes(kv, h, wb) + self.matrix_bytes(h, q, wb)
        n += (2 * h + 2 * hd) * wb + ((q + 2 * kv + h) * wb if self.attention_bias else 0)
        if sparse:
            return n + self.experts * h * wb
        return n + 2 * self.matrix_bytes(self.intermediate, h, wb) + self.matrix_bytes(h, self.intermediate, wb)

    def dense_bytes(self, wb: int) -> int:
        """The dense part (`dense_elems`) in bytes."""
        if self.gguf_dense is not None:
            return self.gguf_dense[0] + self.gguf_dense[1] * wb
        if not self._blocked():
            return self.dense_elems() * wb
        n = self.matrix_bytes(self.vocab, self.hidden, wb) * (1 if self.tie_embeddings else 2) + self.hidden * wb
        return n + sum(self.layer_dense_bytes(i in self.sparse_layers, wb) for i in range(self.layers))

    def expert_bytes(self, wb: int) -> int:
        """One routed expert in bytes (the expert cache's unit)."""
        if self.gguf_expert is not None:
            return self.gguf_expert[0] + self.gguf_expert[1] * wb
        if not self._blocked():
            return self.expert_elems() * wb
        h, mi = self.hidden, self.moe_intermediate
        return 2 * self.matrix_bytes(mi, h, wb) + self.matrix_bytes(h, mi, wb)

    def mtp_bytes(self, wb: int) -> int:
        """The MTP head (`mtp_elems`) in bytes."""
        if not self.has_mtp:
            return 0
        if self.gguf_mtp is not None:
            return self.gguf_mtp[0] + self.gguf_mtp[1] * wb
        if not self._blocked():
            return self.mtp_elems() * wb
        h = self.hidden
        n = 3 * h * wb + self.matrix_bytes(h, 2 * h, wb) + self.layer_dense_bytes(self.mtp_sparse, wb)
        return n + (self.experts * self.expert_bytes(wb) if self.mtp_sparse else 0)
