"""Memory accounting: what the runtime really holds, by the names of docs/INTERFACES.md, from the real tensors,
plus the formulas the budget uses to predict them (so prediction and report share one definition).
"""

from __future__ import annotations

from torch import nn

NAMES = ("target_dense_weights", "expert_cache", "drafter_weights", "target_kv", "drafter_kv", "logits", "scratch")


def is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name


def is_block_weight(name: str) -> bool:
    """A weight held as ggml blocks (`QuantLinear`/`QuantEmbedding` buffer `blocks`): a weight, not scratch."""
    return name == "blocks" or name.endswith(".blocks")


def weight_tensors(model: nn.Module):
    """(name, tensor) of every weight: parameters and block buffers, each storage counted once (tied embeddings,
    q/k/v views of one stacked matrix)."""
    seen: set[tuple[int, int]] = set()
    for name, t in list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if is_block_weight(n)]:
        key = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.device.type != "meta" else (id(t), 0)
        if key in seen:
            continue
        seen.add(key)
        yield name, t


def target_dense_bytes(model: nn.Module) -> int:
    """Target weights except routed experts and the MTP head (tied embeddings counted once)."""
    return sum(t.numel() * t.element_size() for name, t in weight_tensors(model)
               if not (is_routed_expert(name) or name.startswith("mtp.")))


def kv_bytes(n_layers: int, n_kv_heads: int, head_dim: int, context: int, elem_bytes: int) -> int:
    """`n_layers * 2 * n_kv_heads * head_dim * bytes * context` (INTERFACES.md)."""
    return n_layers * 2 * n_kv_heads * head_dim * elem_bytes * context


def logits_bytes(max_block: int, vocab: int) -> int:
    """One fp32 logits buffer for a window of `max_block` rows."""
    return max_block * vocab * 4


def buffers_bytes(model: nn.Module) -> int:
    """Persistent non-parameter buffers (rope tables): the runtime's scratch (block weights are weights)."""
    return sum(b.numel() * b.element_size() for n, b in model.named_buffers() if not is_block_weight(n))


# Prompt tokens per prefill forward. Larger chunks run the prefill's matmuls (and the grouped experts) at a better
# rate; on CPU the attention's [chunk x context] fp32 scores grow with it (docs/budget.md, `scratch`).
PREFILL_CHUNK = {"cuda": 2048, "cpu": 512}


def default_prefill_chunk(device_type: str) -> int:
    return PREFILL_CHUNK.get(device_type, PREFILL_CHUNK["cpu"])
MIB = 1 << 20


def cap_device_memory(limit_mib: int | None, device: int = 0) -> int | None:
    """`--vram-limit-mib`: cap what this process may reserve on the GPU, for a shared card or to behave like a
    smaller one; returns the cap in bytes (None: no cap).

    How: `torch.cuda.set_per_process_memory_fraction`, which makes torch's caching allocator itself refuse (an
    out-of-memory error) any new segment that would take its reservation past the cap. That is the quantity the
    budget predicts (`torch.cuda.max_memory_reserved`: every tensor, cuBLAS workspace and CUDA-graph pool of this
    runtime goes through that allocator), it is enforced on every allocation at no cost, and it needs no code of
    ours on the allocation path, which a hand-written check would. Outside the cap, as on a real card: the CUDA
    context (a few hundred MiB) and the Triton kernels' code."""
    if limit_mib is None:
        return None
    from runtime.errors import UsageError

    if int(limit_mib) <= 0:
        raise UsageError(f"--vram-limit-mib must be a positive number of MiB, got {limit_mib}.")
    import torch

    if not torch.cuda.is_available():
        raise UsageError("--vram-limit-mib caps GPU memory, but no CUDA GPU is usable here; drop the flag.")
    total = torch.cuda.get_device_properties(device).total_memory
    limit = int(limit_mib) * MIB
    if limit > total:
        raise UsageError(f"--vram-limit-mib {limit_mib} is more than this GPU's {total // MIB} MiB; pass at most "
                         f"{total // MIB}.")
    torch.cuda.set_per_process_memory_fraction(limit / total, device)
    return limit
