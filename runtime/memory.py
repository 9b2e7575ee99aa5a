"""Memory accounting: what the runtime really holds, by the names of docs/INTERFACES.md, from the real tensors,
plus the formulas the budget uses to predict them (so prediction and report share one definition).
"""

from __future__ import annotations

from torch import nn

NAMES = ("target_dense_weights", "expert_cache", "drafter_weights", "target_kv", "drafter_kv", "logits", "scratch")


def is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name


def target_dense_bytes(model: nn.Module) -> int:
    """Target weights except routed experts and the MTP head (tied embeddings counted once)."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen or is_routed_expert(name) or name.startswith("mtp."):
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


def kv_bytes(n_layers: int, n_kv_heads: int, head_dim: int, context: int, elem_bytes: int) -> int:
    """`n_layers * 2 * n_kv_heads * head_dim * bytes * context` (INTERFACES.md)."""
    return n_layers * 2 * n_kv_heads * head_dim * elem_bytes * context


def logits_bytes(max_block: int, vocab: int) -> int:
    """One fp32 logits buffer for a window of `max_block` rows."""
    return max_block * vocab * 4


def buffers_bytes(model: nn.Module) -> int:
    """Persistent non-parameter buffers (rope tables): the runtime's scratch."""
    return sum(b.numel() * b.element_size() for b in model.buffers())


# Prompt tokens per prefill forward. Larger chunks run the prefill's matmuls (and the grouped experts) at a better
# rate; on CPU the attention's [chunk x context] fp32 scores grow with it (docs/budget.md, `scratch`).
PREFILL_CHUNK = {"cuda": 2048, "cpu": 512}


def default_prefill_chunk(device_type: str) -> int:
    return PREFILL_CHUNK.get(device_type, PREFILL_CHUNK["cpu"])
