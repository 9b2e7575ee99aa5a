"""The memory budget: every persistent allocation, itemised, before the expert cache is sized.

Pure arithmetic on geometry dicts (a target's `config.json`, a DFlash2 `config.json` or GGUF metadata), so it can be
tested by hand and reused by `strata-setup budget`. Names follow docs/INTERFACES.md ("Memory names"); the runtime
reports the same names from `Engine.memory_report()` and a test compares the two.

What is counted (bytes):
- `target_dense_weights`: every target tensor except routed experts and `mtp.*`, at the runtime dtype.
- `drafter_weights`: MTP = the `mtp.*` tensors at the runtime dtype; DFlash2 = as stored (45 norm/conv/selector tensors
  BF16, 36 backbone matrices BF16 or in Q8_0/Q5_0/Q4_0 blocks); none = 0. On CPU the runtime widens the BF16
  tensors to its fp32 dtype, so there they count 4 B/element (quantized blocks stay as stored).
- `target_kv = n_layers * 2 * n_kv_heads * head_dim * kv_bytes * context`.
- `drafter_kv`: DFlash2 `L * 2 * nkv * hd * kv_bytes * context`; MTP `1 * 2 * nkv * hd * kv_bytes * context`.
- `logits = block * vocab * 4` for the verify window, the same again for a drafter that makes logits.
- `scratch`: the largest transient forward (see `scratch_bytes`).
- `headroom`: elastic growth and allocator slack on a GPU (see `headroom_bytes`); `reserve`: the user's reserve.
On a GPU three more items make the prediction one of *reserved* memory (`torch.cuda.max_memory_reserved`):
- `workspace`: cuBLAS workspaces, one per stream that runs matmuls (the default stream and, with CUDA graphs, the
  capture stream), each `cublas_workspace_bytes(capability)` (torch's default: 32 MiB on sm90, else 8 MiB + 128 KiB).
- `graph_pool`: the CUDA graphs' private pools (one per captured graph) and the capture stream's warm-up segments.
- `allocator`: the caching allocator's rounding of every persistent and transient allocation into segments
  (see `segment_bytes`: 2 MiB segments for requests <= 1 MiB, 20 MiB for < 10 MiB, else rounded up to 2 MiB).
Then `expert_cache` slots = remaining // bytes of one expert, capped at the number of experts, never negative.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MIB = 1 << 20

# bytes per 32-element block of each DFlash2 backbone storage type (ggml: Q8_0 = f16 scale + 32 int8, ...)
QUANT_BLOCK_BYTES = {"q8_0": 34, "q5_0": 22, "q4_0": 18}
QUANTS = ("bf16", "q8_0", "q5_0", "q4_0")
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
DRAFTERS = ("mtp", "dflash2", "none")

ITEM_ORDER = (
    "target_dense_weights",
    "drafter_weights",
    "target_kv",
    "drafter_kv",
    "logits",
    "scratch",
    "workspace",
    "graph_pool",
    "allocator",
    "headroom",
    "reserve",
)

# torch's CUDACachingAllocator (c10/cuda/CUDACachingAllocator.cpp): kMinBlockSize, kSmallSize, kSmallBuffer,
# kLargeBuffer, kMinLargeAlloc, kRoundLarge
ALLOC_ROUND = 512
SMALL_SIZE = 1 * MIB
SMALL_SEGMENT = 2 * MIB
LARGE_SEGMENT = 20 * MIB
MIN_LARGE_ALLOC = 10 * MIB
ROUND_LARGE = 2 * MIB
# graphs the drafter's own graph runner captures in a short generation (runtime/drafter_graphs.py), as counted on
# the H200 (bench/results/h200_budget: one private pool per graph, beside the target step's)
DRAFTER_GRAPHS = {"none": 0, "mtp": 2, "dflash2": 3}


class BudgetError(ValueError):
    """A geometry or setting the budget cannot work with (the message says which key)."""


def _int(cfg: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise BudgetError(f"The model config has no '{key}'; it is needed to compute the memory budget.")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BudgetError(f"The model config key '{key}' must be a non-negative integer, not {value!r}.")
    return value


@dataclass(frozen=True)
class TargetGeometry:
    """The shapes of a Qwen3-MoE target that the budget needs."""

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

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], *, has_mtp: bool | None = None) -> TargetGeometry:
        """From a Hugging Face `config.json` of `qwen3_moe` (MTP presence from `num_nextn_predict_layers`/`mtp_*`
        keys unless `has_mtp` is given: the tensor inventory is the better witness)."""
        hidden = _int(cfg, "hidden_size")
        layers = _int(cfg, "num_hidden_layers")
        heads = _int(cfg, "num_attention_heads")
        kv_heads = _int(cfg, "num_key_value_heads", heads)
        head_dim = cfg.get("head_dim") or (hidden // heads if heads else 0)
        experts = _int(cfg, "num_experts", 0)
        step = _int(cfg, "decoder_sparse_step", 1) or 1
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        sparse = tuple(i for i in range(layers) if experts > 0 and i not in mlp_only and (i + 1) % step == 0)
        if has_mtp is None:
            has_mtp = bool(cfg.get("num_nextn_predict_layers") or cfg.get("mtp_num_hidden_layers"))
        return cls(
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=int(head_dim),
            vocab=_int(cfg, "vocab_size"),
            intermediate=_int(cfg, "intermediate_size", 0),
            moe_intermediate=_int(cfg, "moe_intermediate_size", 0),
            experts=experts,
            top_k=_int(cfg, "num_experts_per_tok", 0),
            sparse_layers=sparse,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            max_position=_int(cfg, "max_position_embeddings", 32768),
            has_mtp=bool(has_mtp),
            mtp_sparse=experts > 0,
        )

    def with_inventory(self, inventory: Mapping[str, int]) -> TargetGeometry:
        """Exact counts from the checkpoint's tensor names → element counts (the safetensors header): routed
        experts are `model.layers.N.mlp.experts.*`, the MTP head is `mtp.*`, everything else is dense."""
        from dataclasses import replace

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
        """All `mtp.*` tensors (ARTIFACTS.md §1): two pre-fc norms, fc [H, 2H], one decoder layer, final norm."""
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


@dataclass(frozen=True)
class DFlash2Geometry:
    """The shapes of a DFlash2 drafter (ARTIFACTS.md §2), from its config.json or its GGUF metadata."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    taps: int
    conv_kernel: int = 2
    conv_group: int = 16
    selector_rank: int = 256
    block_size: int = 16

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> DFlash2Geometry:
        """Accepts the HF `config.json` (keys in `dflash_config` win) or GGUF metadata (`dflash2.*` keys)."""
        if any(str(k).startswith("dflash2.") for k in cfg):
            g = {k.removeprefix("dflash2."): v for k, v in cfg.items() if str(k).startswith("dflash2.")}
            taps = g.get("target_layers")
            return cls(
                hidden=_int(g, "embedding_length"),
                intermediate=_int(g, "feed_forward_length"),
                layers=_int(g, "block_count"),
                heads=_int(g, "attention.head_count"),
                kv_heads=_int(g, "attention.head_count_kv"),
                head_dim=_int(g, "attention.key_length"),
                vocab=_int(g, "vocab_size"),
                taps=len(taps) if taps is not None else _int(g, "target_layer_count"),
                conv_kernel=_int(g, "conv_kernel_size", 2),
                conv_group=_int(g, "conv_group_size", 16),
                selector_rank=_int(g, "selector_rank", 256),
                block_size=_int(g, "block_size", 16),
            )
        merged = {**cfg, **(cfg.get("dflash_config") or {})}
        heads = _int(merged, "num_attention_heads")
        hidden = _int(merged, "hidden_size")
        taps = merged.get("target_layer_ids")
        if taps is None:
            raise BudgetError("The DFlash2 config has no 'dflash_config.target_layer_ids'.")
        return cls(
            hidden=hidden,
            intermediate=_int(merged, "intermediate_size"),
            layers=_int(merged, "num_hidden_layers"),
            heads=heads,
            kv_heads=_int(merged, "num_key_value_heads", heads),
            head_dim=int(merged.get("head_dim") or hidden // max(heads, 1)),
            vocab=_int(merged, "vocab_size"),
            taps=len(taps),
            conv_kernel=_int(merged, "conv_kernel_size", 2),
            conv_group=_int(merged, "conv_group_size", 16),
            selector_rank=_int(merged, "selector_rank", 256),
            block_size=_int(merged, "block_size", 16),
        )

    def backbone_shapes(self) -> list[tuple[int, int]]:
        """The 36 (for L=5) quantizable matrices as [rows, row_length]: fc + q,k,v,o,gate,up,down per layer."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        per_layer = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]
        return [(h, self.taps * h)] + per_layer * self.layers

    def bf16_elems(self) -> int:
        """The 45 (for L=5) tensors that always stay BF16: norms, convolutions, selector."""
        h, hd, k, g, r, v = self.hidden, self.head_dim, self.conv_kernel, self.conv_group, self.selector_rank, self.vocab
        per_layer = 2 * h + 2 * hd + 2 * (2 * k * h) + 2 * ((2 * k * h // g) * h)
        return 2 * h + self.layers * per_layer + r * h + 2 * v * r

    def weight_bytes(self, quant: str, float_bytes: int = 2) -> int:
        """Bytes as held: the float tensors at `float_bytes` per element (BF16 = 2, as stored; the CPU runtime
        widens them to fp32 = 4), quantized backbone rows at the quant's block size per 32 elements."""
        if quant not in QUANTS:
            raise BudgetError(f"Unknown DFlash2 quantization '{quant}'; use one of {', '.join(QUANTS)}.")
        total = float_bytes * self.bf16_elems()
        for rows, cols in self.backbone_shapes():
            if quant == "bf16":
                total += float_bytes * rows * cols
            else:
                if cols % 32:
                    raise BudgetError(f"A DFlash2 row of {cols} elements is not a multiple of 32 and cannot be {quant}.")
                total += rows * (cols // 32) * QUANT_BLOCK_BYTES[quant]
        return total


@dataclass(frozen=True)
class BudgetInputs:
    """Everything the budget depends on besides geometry."""

    context: int
    block: int
    device_type: str  # "cuda" | "cpu"
    available_bytes: int  # what this process may use: free VRAM on a GPU, available RAM on CPU
    total_bytes: int
    reserve_bytes: int = 0
    weight_bytes: int = 2  # runtime dtype of the target (bf16 on CUDA, fp32 on CPU)
    kv_bytes: int = 2
    prefill_chunk: int = 512
    headroom_bytes: int | None = None  # None: headroom_bytes(device_type, total_bytes)
    capability: tuple[int, int] | None = None  # CUDA compute capability; None: assume sm90's larger workspace
    cublas_workspace_config: str | None = None  # the CUBLAS_WORKSPACE_CONFIG value the runtime will see, if any
    graphs: bool = True  # the runtime captures CUDA graphs (a second stream, graph pools)


@dataclass
class Budget:
    """The itemised outcome. `fits` is False with a `reason` when the fixed items leave no room."""

    items: dict[str, int]
    available_bytes: int
    total_bytes: int
    device_type: str
    expert_bytes: int
    total_experts: int
    expert_cache_slots: int
    remaining_bytes: int  # after the fixed items and the expert cache
    fits: bool
    reason: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def expert_cache_bytes(self) -> int:
        return self.expert_cache_slots * self.expert_bytes

    @property
    def fixed_bytes(self) -> int:
        return sum(self.items.values())

    def table(self) -> dict[str, int]:
        """Names → bytes in the INTERFACES.md order, with the expert cache after the fixed items."""
        out = {k: self.items[k] for k in ITEM_ORDER if k in self.items}
        out["expert_cache"] = self.expert_cache_bytes
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "items": self.table(),
            "available_bytes": self.available_bytes,
            "total_bytes": self.total_bytes,
            "device_type": self.device_type,
            "expert_bytes": self.expert_bytes,
            "total_experts": self.total_experts,
            "expert_cache_slots": self.expert_cache_slots,
            "remaining_bytes": self.remaining_bytes,
            "fits": self.fits,
            "reason": self.reason,
            "notes": list(self.notes),
        }


def headroom_bytes(device_type: str, total_bytes: int) -> int:
    """Allocator slack and elastic pool growth on a GPU: 2% of the device, at least 64 MiB, at most 1 GiB.
    On CPU nothing grows that the OS cannot page, so 0."""
    if device_type != "cuda":
        return 0
    return int(min(max(total_bytes * 0.02, 64 * MIB), 1024 * MIB))


def scratch_bytes(t: TargetGeometry, *, context: int, block: int, prefill_chunk: int, act_bytes: int,
                  flash: bool = False) -> int:
    """The largest transient forward the runtime runs: `rows = max(prefill_chunk, block)` rows through one layer.
    Attention scores `rows * heads * context * 4` (fp32 softmax; none with `flash`, the CUDA path, which keeps only
    a `rows * heads * 4` log-sum-exp) plus the activations of one layer
    `rows * (4*hidden + (heads + 2*kv_heads)*head_dim + 3*max(intermediate, top_k*moe_intermediate)) * act_bytes`."""
    rows = max(min(prefill_chunk, context), block, 1)
    scores = rows * t.heads * (4 if flash else context * 4)
    width = 4 * t.hidden + (t.heads + 2 * t.kv_heads) * t.head_dim
    width += 3 * max(t.intermediate, t.top_k * t.moe_intermediate)
    return scores + rows * width * act_bytes


def cublas_workspace_bytes(capability: tuple[int, int] | None = None, config: str | None = None) -> int:
    """One cuBLAS workspace as torch sizes it (at::cuda `getChosenWorkspaceSize`): `CUBLAS_WORKSPACE_CONFIG`
    ":SIZE_KiB:COUNT[:SIZE_KiB:COUNT...]" when set (sum of SIZE*COUNT KiB), else 4096 KiB * 8 = 32 MiB on sm90 and
    4096 KiB * 2 + 16 KiB * 8 elsewhere. Unknown capability: the sm90 size (the larger)."""
    if config:
        parts = [p for p in config.split(":") if p]
        if len(parts) % 2 == 0 and parts and all(p.isdigit() for p in parts):
            return sum(int(parts[i]) * int(parts[i + 1]) * 1024 for i in range(0, len(parts), 2))
    if capability is None or tuple(capability) == (9, 0):
        return 4096 * 1024 * 8
    return 4096 * 1024 * 2 + 16 * 1024 * 8


def alloc_size(n: int) -> int:
    """A request as the caching allocator rounds it (multiples of 512 B, at least 512 B)."""
    return max(ALLOC_ROUND, -(-n // ALLOC_ROUND) * ALLOC_ROUND)


def segment_bytes(sizes: list[int]) -> int:
    """Reserved bytes for allocations on one stream, all alive at once, packed the way the caching allocator does:
    requests <= 1 MiB share 2 MiB segments, requests < 10 MiB share 20 MiB segments (best fit, first the largest),
    larger ones get their own segment rounded up to 2 MiB."""
    small = sum(alloc_size(n) for n in sizes if 0 < n <= SMALL_SIZE)
    total = -(-small // SMALL_SEGMENT) * SMALL_SEGMENT
    free: list[int] = []
    for n in sorted((alloc_size(n) for n in sizes if SMALL_SIZE < n < MIN_LARGE_ALLOC), reverse=True):
        fit = [i for i, f in enumerate(free) if f >= n]
        if fit:
            i = min(fit, key=lambda j: free[j])
            free[i] -= n
        else:
            free.append(LARGE_SEGMENT - n)
            total += LARGE_SEGMENT
    total += sum(-(-n // ROUND_LARGE) * ROUND_LARGE for n in sizes if n >= MIN_LARGE_ALLOC)
    return total


def persistent_tensors(t: TargetGeometry, drafter: str, wb: int, kb: int, context: int, block: int,
                       dflash2: DFlash2Geometry | None = None, quant: str = "bf16") -> list[int]:
    """Byte sizes of the runtime's persistent tensors one by one (what the allocator is asked for): embeddings,
    lm_head, each layer's stacked q/k/v, o_proj, norms, router, stacked experts (gate_up, down), K and V caches,
    logits buffers, the drafter's matrices and its cache. Their sum is close to the exact items; the list is what
    `segment_bytes` rounds."""
    h, q, kv = t.hidden, t.heads * t.head_dim, t.kv_heads * t.head_dim
    out = [t.vocab * h * wb] * (1 if t.tie_embeddings else 2) + [h * wb]
    for i in range(t.layers):
        sparse = i in t.sparse_layers
        out += [(q + 2 * kv) * h * wb, q * h * wb, h * wb, h * wb, t.head_dim * wb, t.head_dim * wb]
        if sparse:
            out += [t.experts * h * wb, t.experts * 2 * t.moe_intermediate * h * wb,
                    t.experts * h * t.moe_intermediate * wb]
        else:
            out += [t.intermediate * h * wb] * 3
    out += [t.layers * kv * context * kb] * 2
    out.append(block * t.vocab * 4)
    if drafter == "mtp":
        out += [h * wb] * 3 + [2 * h * h * wb, (q + 2 * kv) * h * wb, q * h * wb, h * wb, h * wb]
        out += [t.head_dim * wb] * 2
        if t.mtp_sparse:
            out += [t.experts * h * wb, t.experts * 2 * t.moe_intermediate * h * wb,
                    t.experts * h * t.moe_intermediate * wb]
        out += [kv * context * kb] * 2 + [block * t.vocab * 4]
    elif drafter == "dflash2" and dflash2 is not None:
        d = dflash2
        mats = [rows * cols * wb if quant == "bf16" else rows * (cols // 32) * QUANT_BLOCK_BYTES[quant]
                for rows, cols in d.backbone_shapes()]
        sel = [d.selector_rank * d.hidden * wb, d.vocab * d.selector_rank * wb, d.vocab * d.selector_rank * wb]
        rest = d.weight_bytes(quant, float_bytes=wb) - sum(mats) - sum(sel)   # norms and convolutions, per layer
        out += mats + sel + [rest // (d.layers + 1)] * d.layers + [rest - d.layers * (rest // (d.layers + 1))]
        out += [d.layers * d.kv_heads * d.head_dim * context * kb] * 2 + [block * t.vocab * 4]
    return out


def transient_tensors(t: TargetGeometry, rows: int, wb: int, dflash2: DFlash2Geometry | None = None) -> list[int]:
    """The tensors alive at the peak of one prefill chunk of `rows` rows (flash attention: no score matrix).
    Either inside one target layer: residual, normed input, q/k/v (and their roped copies), attention output, router
    logits (fp32 softmax), the gathered rows of the MoE loop and their expert activations, the MoE output; or, with
    DFlash2, after the chunk, while the drafter observes it (the target's layer temporaries are freed by then): the
    chunk's hidden and taps, the fused context and one drafter layer's activations. The larger set is the peak."""
    h, q, kv = t.hidden, t.heads * t.head_dim, t.kv_heads * t.head_dim
    out = [rows * h * wb] * 4 + [rows * q * wb] * 3 + [rows * kv * wb] * 4
    out += [rows * t.experts * 4] * 2 + [rows * t.top_k * 8] * 2
    if t.experts:
        out += [rows * h * wb] * 2 + [rows * t.moe_intermediate * wb] * 3
    else:
        out += [rows * t.intermediate * wb] * 3
    if dflash2 is not None:
        d = dflash2
        obs = [rows * d.taps * h * wb, rows * h * wb, rows * d.taps * h * wb, rows * d.hidden * wb * 3,
               rows * d.intermediate * wb * 3, rows * (d.heads + 2 * d.kv_heads) * d.head_dim * wb]
        if sum(obs) > sum(out):
            return obs
    return out


def graph_pool_bytes(t: TargetGeometry, drafter: str, width: int, wb: int) -> int:
    """Each captured graph keeps a private pool of its step's intermediates (width `width` rows), and the warm-up on
    the capture stream leaves its own segments: one `segment_bytes` of a step's tensors per graph, plus one."""
    h, q, kv = t.hidden, t.heads * t.head_dim, t.kv_heads * t.head_dim
    step = [width * t.vocab * 4, width * h * wb * 4, width * (q + 2 * kv) * wb * 2, width * t.top_k * 16]
    n = 1 + DRAFTER_GRAPHS.get(drafter, 0)
    return (n + 1) * segment_bytes(step)


def kv_bytes(layers: int, kv_heads: int, head_dim: int, kv_dtype_bytes: int, context: int) -> int:
    """`layers * 2 * kv_heads * head_dim * bytes * context` (K and V)."""
    return layers * 2 * kv_heads * head_dim * kv_dtype_bytes * context


def compute_budget(
    target: TargetGeometry,
    drafter: str,
    inputs: BudgetInputs,
    *,
    dflash2: DFlash2Geometry | None = None,
    quant: str = "bf16",
) -> Budget:
    """Itemise every fixed allocation, then give the rest to the expert cache."""
    if drafter not in DRAFTERS:
        raise BudgetError(f"Unknown drafter '{drafter}'; use one of {', '.join(DRAFTERS)}.")
    if inputs.context <= 0:
        raise BudgetError(f"The context length must be a positive number of tokens, not {inputs.context}.")
    if inputs.block <= 0:
        raise BudgetError(f"The block size must be positive, not {inputs.block}.")
    if inputs.reserve_bytes < 0:
        raise BudgetError("The memory reserve cannot be negative.")
    if drafter == "dflash2" and dflash2 is None:
        raise BudgetError("A DFlash2 budget needs the drafter's geometry (its config.json or GGUF metadata).")
    if drafter == "mtp" and not target.has_mtp:
        raise BudgetError("This target has no MTP head (no mtp.* tensors); choose --drafter dflash2 or none.")

    wb, kb, ctx = inputs.weight_bytes, inputs.kv_bytes, inputs.context
    block = inputs.block if drafter != "none" else 1
    items: dict[str, int] = {"target_dense_weights": target.dense_elems() * wb}
    if drafter == "mtp":
        items["drafter_weights"] = target.mtp_elems() * wb
    elif drafter == "dflash2":
        assert dflash2 is not None
        items["drafter_weights"] = dflash2.weight_bytes(quant, float_bytes=wb)
    else:
        items["drafter_weights"] = 0
    items["target_kv"] = kv_bytes(target.layers, target.kv_heads, target.head_dim, kb, ctx)
    if drafter == "mtp":
        items["drafter_kv"] = kv_bytes(1, target.kv_heads, target.head_dim, kb, ctx)
    elif drafter == "dflash2":
        assert dflash2 is not None
        items["drafter_kv"] = kv_bytes(dflash2.layers, dflash2.kv_heads, dflash2.head_dim, kb, ctx)
    else:
        items["drafter_kv"] = 0
    items["logits"] = block * target.vocab * 4 * (2 if drafter != "none" else 1)
    cuda = inputs.device_type == "cuda"
    items["scratch"] = scratch_bytes(
        target, context=ctx, block=block, prefill_chunk=inputs.prefill_chunk, act_bytes=wb, flash=cuda
    )
    if cuda:
        ws = cublas_workspace_bytes(inputs.capability, inputs.cublas_workspace_config)
        items["workspace"] = ws * (2 if inputs.graphs else 1)
        items["graph_pool"] = graph_pool_bytes(target, drafter, block, wb) if inputs.graphs else 0
        rows = max(min(inputs.prefill_chunk, ctx), block, 1)
        pers = persistent_tensors(target, drafter, wb, kb, ctx, block, dflash2, quant)
        trans = transient_tensors(target, rows, wb, dflash2 if drafter == "dflash2" else None)
        # transients share the persistent tensors' segments (the free tail of the last 2 MiB small segment, the
        # 20 MiB large ones) before new ones are made: one packing of both
        items["allocator"] = max(segment_bytes(pers + trans) - sum(pers) - items["scratch"], 0)
    hr = inputs.headroom_bytes
    items["headroom"] = headroom_bytes(inputs.device_type, inputs.total_bytes) if hr is None else hr
    items["reserve"] = inputs.reserve_bytes

    expert = target.expert_elems() * wb
    fixed = sum(items.values())
    room = inputs.available_bytes - fixed
    if expert > 0 and room > 0:
        slots = min(room // expert, target.total_experts)
    else:
        slots = 0
    remaining = room - slots * expert
    notes: list[str] = []
    fits, reason = True, ""
    where = "GPU memory" if inputs.device_type == "cuda" else "RAM"
    if room < 0:
        fits = False
        reason = (
            f"Does not fit: the fixed items need {_mib(fixed)} but only {_mib(inputs.available_bytes)} of {where} "
            f"is available; lower the context or the reserve, or pick a smaller drafter quantization."
        )
    elif inputs.device_type != "cuda" and slots < target.total_experts:
        fits = False
        reason = (
            f"Does not fit: on CPU every expert must be in RAM, but only {slots} of {target.total_experts} "
            f"experts fit in {_mib(room)}; lower the context or pick a smaller model."
        )
    elif slots < target.total_experts:
        notes.append(
            f"{slots} of {target.total_experts} experts stay on the GPU; the others are served from CPU memory."
        )
    return Budget(
        items=items,
        available_bytes=inputs.available_bytes,
        total_bytes=inputs.total_bytes,
        device_type=inputs.device_type,
        expert_bytes=expert,
        total_experts=target.total_experts,
        expert_cache_slots=max(int(slots), 0),
        remaining_bytes=int(remaining),
        fits=fits,
        reason=reason,
        notes=notes,
    )


CONTEXT_CHOICES = (2048, 4096, 8192, 16384, 32768)


def recommend_context(
    target: TargetGeometry,
    drafter: str,
    inputs: BudgetInputs,
    *,
    dflash2: DFlash2Geometry | None = None,
    quant: str = "bf16",
    keep_fraction: float = 0.9,
) -> tuple[int, str]:
    """The largest standard context (≤ the model's limit) that fits and keeps at least `keep_fraction` of the
    expert slots the smallest context would get: longer contexts cost experts, and experts cost speed."""
    choices = [c for c in CONTEXT_CHOICES if c <= target.max_position] or [min(target.max_position, 2048)]

    def at(c: int) -> Budget:
        return compute_budget(
            target, drafter, _replace(inputs, context=c), dflash2=dflash2, quant=quant
        )

    base = at(choices[0])
    if not base.fits:
        return choices[0], f"even {choices[0]} tokens do not fit; {base.reason}"
    best = choices[0]
    for c in choices[1:]:
        b = at(c)
        if not b.fits or b.expert_cache_slots < keep_fraction * base.expert_cache_slots:
            break
        best = c
    why = f"the longest context that keeps {int(keep_fraction * 100)}% of the expert cache"
    if best == choices[-1]:
        why = "the longest context offered; everything still fits"
    return best, why


def _replace(inputs: BudgetInputs, **kw: Any) -> BudgetInputs:
    from dataclasses import replace

    return replace(inputs, **kw)


def _mib(n: int) -> str:
    return f"{n / MIB:,.1f} MiB"
