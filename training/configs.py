"""Model geometry and training settings of the strata-nano pack (and the toy size the CPU tests use).

The target is a `qwen3_moe` config.json dict (docs/models.md, "Qwen3-MoE target") with one MTP layer; the drafters are DFlash2
config.json dicts (docs/formats.md, "DFlash2 checkpoint"): the official geometry scaled down (5 layers, 128-wide heads, dynamic
convolution K=2 G=16, selector top-k 16 with a small rank, taps spread over the target's layers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from training.tok import EOS, MASK


@dataclass(frozen=True)
class Geometry:
    vocab: int = 4096
    hidden: int = 256
    layers: int = 6
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    experts: int = 8
    top_k: int = 2
    moe_inter: int = 64
    max_pos: int = 4096
    # DFlash2 heads
    d_layers: int = 5
    d_heads: int = 2
    d_kv_heads: int = 1
    d_head_dim: int = 128
    d_inter: int = 256
    d_rank: int = 32
    d_top_k: int = 16
    taps: tuple[int, ...] = (1, 3, 5)


@dataclass(frozen=True)
class StageSettings:
    """One training stage: batch geometry, optimiser and limits (whichever of steps/seconds ends first)."""

    batch: int
    seq: int
    lr: float
    steps: int
    seconds: float
    warmup: int = 50
    weight_decay: float = 0.1


@dataclass(frozen=True)
class DraftSettings(StageSettings):
    block: int = 8
    anchors: int = 16          # anchors drawn per sequence
    decay: float = 4.0         # position weight exp(-(k-1)/decay) for the k-th masked row
    selector_weight: float = 0.5


@dataclass(frozen=True)
class Preset:
    name: str
    geometry: Geometry
    target: StageSettings
    distill_prompts: int       # sequences the target continues greedily (drafter training data)
    distill_prompt_len: int
    distill_new: int
    mtp: StageSettings         # MTP fine-tune on the distilled continuations (target frozen)
    dflash: DraftSettings
    turbo: DraftSettings
    eval_tokens: int = 1 << 30  # held-out tokens scored for perplexity (all of them)
    extra: dict = field(default_factory=dict)


NANO = Preset(
    name="nano",
    geometry=Geometry(),
    target=StageSettings(batch=96, seq=512, lr=3e-3, steps=100000, seconds=150, warmup=100),
    distill_prompts=4096, distill_prompt_len=128, distill_new=256,
    mtp=StageSettings(batch=64, seq=384, lr=1e-3, steps=100000, seconds=25, warmup=20, weight_decay=0.0),
    dflash=DraftSettings(batch=64, seq=384, lr=2e-3, steps=100000, seconds=110, warmup=50, block=8, anchors=24,
                         decay=4.0),
    turbo=DraftSettings(batch=64, seq=384, lr=2e-3, steps=100000, seconds=140, warmup=50, block=16, anchors=16,
                        decay=7.0),
)

TOY = Preset(
    name="toy",
    geometry=Geometry(vocab=320, hidden=64, layers=3, heads=2, kv_heads=1, head_dim=32, experts=8, top_k=2,
                      moe_inter=32, max_pos=512, d_layers=5, d_heads=1, d_kv_heads=1, d_head_dim=128, d_inter=64,
                      d_rank=8, d_top_k=16, taps=(0, 1, 2)),
    target=StageSettings(batch=8, seq=64, lr=3e-3, steps=12, seconds=60, warmup=2),
    distill_prompts=8, distill_prompt_len=16, distill_new=24,
    mtp=StageSettings(batch=4, seq=32, lr=3e-3, steps=6, seconds=60, warmup=1, weight_decay=0.0),
    dflash=DraftSettings(batch=4, seq=40, lr=3e-3, steps=8, seconds=60, warmup=1, block=4, anchors=4),
    turbo=DraftSettings(batch=4, seq=40, lr=3e-3, steps=8, seconds=60, warmup=1, block=6, anchors=3),
    eval_tokens=512,
)

PRESETS = {p.name: p for p in (NANO, TOY)}


def target_config(g: Geometry) -> dict:
    """config.json of the target (qwen3_moe with one MTP layer, MoE like the target's layers)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": g.vocab,
        "hidden_size": g.hidden,
        "intermediate_size": 4 * g.hidden,   # unused: every layer is sparse
        "num_hidden_layers": g.layers,
        "num_attention_heads": g.heads,
        "num_key_value_heads": g.kv_heads,
        "head_dim": g.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": g.max_pos,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "num_experts": g.experts,
        "num_experts_per_tok": g.top_k,
        "moe_intermediate_size": g.moe_inter,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.01,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1,
        "bos_token_id": None,
        "eos_token_id": EOS,
        "pad_token_id": EOS,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
    }


def dflash_config(g: Geometry, block: int) -> dict:
    """config.json of a DFlash2 head for this target (docs/formats.md, "DFlash2 checkpoint")."""
    return {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "hidden_size": g.hidden,
        "intermediate_size": g.d_inter,
        "num_hidden_layers": g.d_layers,
        "num_attention_heads": g.d_heads,
        "num_key_value_heads": g.d_kv_heads,
        "head_dim": g.d_head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": g.max_pos,
        "vocab_size": g.vocab,
        "num_target_layers": g.layers,
        "is_causal": False,
        "layer_types": ["full_attention"] * g.d_layers,
        "tie_word_embeddings": False,
        "eos_token_id": EOS,
        "torch_dtype": "bfloat16",
        "dflash_config": {
            "block_size": block,
            "mask_token_id": MASK,
            "target_layer_ids": list(g.taps),
            "conv_kernel_size": 2,
            "conv_group_size": 16,
            "selector_rank": g.d_rank,
            "selector_top_k": g.d_top_k,
            "output_multiplier": 1.0,
            "input_embedding_scale": 1.0,
        },
    }
