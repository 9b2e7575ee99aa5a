"""The memory budget: every persistent allocation, itemised, before the expert cache is sized.

Pure arithmetic on geometry dicts (a target's `config.json`, a DFlash2 `config.json` or GGUF metadata), so it can be
tested by hand and reused by `strata-setup budget`. Names follow docs/INTERFACES.md ("Memory names"); the runtime
reports the same names from `Engine.memory_report()` and a test compares the two.

What is counted (bytes):
- `target_dense_weights`: every target tensor except routed experts and `mtp.*`, at the runtime dtype; for a
  quantized target (Q8_0/Q4_0 GGUF) its matrices as ggml blocks and its norms and router at the runtime dtype.
- `drafter_weights`: MTP = the `mtp.*` tensors, stored as the target is, and on a CPU an int8 copy of a float
  vocabulary head for the chain (`vocab * hidden + 2 * vocab`, runtime/drafters/head8.py); DFlash2 = as stored (45 norm/conv/selector tensors
  BF16, 36 backbone matrices BF16 or in Q8_0/Q5_0/Q4_0 blocks); none = 0. On CPU the runtime widens the BF16
  tensors to its fp32 dtype, so there they count 4 B/element (quantized blocks stay as stored).
- `target_kv = n_layers * 2 * n_kv_heads * head_dim * kv_bytes * context`; with `kv_quant = "q8_0"` each head
  vector takes `head_dim + 2 * head_dim / 32` bytes (int8 values, a float16 scale per 32).
- `drafter_kv`: DFlash2 `L * 2 * nkv * hd * kv_bytes * context`; MTP `1 * 2 * nkv * hd * kv_bytes * context`.
- `logits = block * vocab * 4` for the verify window, the same again for a drafter that makes logits.
- `scratch`: the largest transient forward (see `scratch_bytes`) plus the attention's own buffers (see
  `attention_scratch_tensors`: the split decode attention's partials, a q8_0 cache's prefill dequantization) and,
  for block-format weights on a GPU, the one matrix they are dequantized into for wider windows
  (`dequant_scratch_tensors`).
- `headroom`: elastic growth and allocator slack on a GPU (see `headroom_bytes`); `reserve`: the user's reserve.
On a GPU three more items make the prediction one of *reserved* memory (`torch.cuda.max_memory_reserved`):
- `workspace`: cuBLAS workspaces, one per stream that runs matmuls (the default stream and, with CUDA graphs, the
  capture stream), each `cublas_workspace_bytes(capability)` (torch's default: 32 MiB on sm90, else 8 MiB + 128 KiB).
- `graph_pool`: the CUDA graphs' private pools (one per captured graph) and the capture stream's warm-up segments.
- `sampling_graphs`: the sampled acceptance's CUDA graphs (see `sampling_graph_bytes`).
- `allocator`: the caching allocator's rounding of every persistent and transient allocation into segments
  (see `segment_bytes`: 2 MiB segments for requests <= 1 MiB, 20 MiB for < 10 MiB, else rounded up to 2 MiB).
Then `expert_cache` slots = remaining // bytes of one expert, capped at the number of experts, never negative.
When fewer slots than experts fit on a GPU the runtime offloads (runtime/experts.py): the slots become one pool of
two planes shared by all MoE layers (`pool_tensors`), `min(block * top_k, experts)` of them dynamic (what one verify
window may need at once), so the allocator is recomputed for that layout and the slots once more.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runtime import aoti, target_compiled
from runtime.drafters import head8, mtp_compiled
from runtime.drafters.dflash2.contract import DFlash2Geometry, expected_tensors
from runtime.drafters.registry import KINDS, kv_cache_bytes
from runtime.errors import UsageError
from runtime.formats.registry import QTYPES, block_format, row_bytes
from runtime.gpu.capture import SAMPLED_SETTINGS_KEPT
from runtime.kv import KV_QUANTS, Q8_BLOCK, kv_row_bytes, split_partials_bytes
from runtime.memory import default_prefill_chunk
from runtime.models.target_config import TargetGeometry
from runtime.sampling import RULE_GRAPHS_KEPT

MIB = 1 << 20
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}

ITEM_ORDER = (
    "target_dense_weights",
    "drafter_weights",
    "target_kv",
    "drafter_kv",
    "logits",
    "scratch",
    "workspace",
    "graph_pool",
    "sampling_graphs",
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


class BudgetError(UsageError):
    """A geometry or setting the budget cannot work with (the message says which key)."""


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
    kv_bytes: int = 2  # the compute dtype's bytes when kv_quant is set (the drafters' caches stay there)
    kv_quant: str | None = None  # "q8_0": the target's KV cache in 8 bits (runtime/kv.py)
    prefill_chunk: int | None = None  # None: the runtime's default for the device (runtime/memory.py)
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
    dynamic_slots: int = 0  # offloaded: slots that hold recently fetched experts (the rest: the profile's hottest)
    dense_read_bytes: int = 0  # one decode token reads: dense weights but one embedding row, KV at half the context
    experts_per_token: int = 0  # routed experts one decode token uses (MoE layers x top_k)

    @property
    def offloaded(self) -> bool:
        return self.device_type == "cuda" and self.expert_cache_slots < self.total_experts

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
            "dynamic_slots": self.dynamic_slots,
            "dense_read_bytes": self.dense_read_bytes,
            "experts_per_token": self.experts_per_token,
        }

    def static_hit_rate(self) -> float:
        """Hit rate with no routing profile (every expert alike): the static slots over the experts."""
        return min(1.0, (self.expert_cache_slots - self.dynamic_slots) / max(1, self.total_experts))


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


def attention_scratch_tensors(t: TargetGeometry, drafter: str, *, context: int, block: int, wb: int, cuda: bool,
                              kv_quant: str | None = None, dflash2: DFlash2Geometry | None = None,
                              graphs: bool = True) -> list[int]:
    """The attention's buffers, one allocation each (docs/budget.md `scratch`):
    - CUDA: the split decode attention's fp32 partials of the target's fixed-width step, `block * heads * chunks *
      (head_dim + 2) * 4` with `chunks` the chunks covering the context (runtime/kv.py `split_chunks`), and the same for the drafter's
      graphs (their heads and head_dim; `block` rows) when graphs are on;
    - a q8_0 cache: the prefill dequantizes one layer's prefix into two `kv_heads * context * head_dim * wb`
      buffers, plus (CPU, torch) two fp32 temporaries `kv_heads * context * head_dim * 4` while doing it."""
    out: list[int] = []
    if cuda:
        out.append(split_partials_bytes(block, t.heads, context, t.head_dim))
        if graphs and drafter == "mtp":
            out.append(split_partials_bytes(block, t.heads, context, t.head_dim))
        elif graphs and drafter == "dflash2" and dflash2 is not None:
            out.append(split_partials_bytes(block, dflash2.num_heads, context, dflash2.head_dim))
    if kv_quant is not None:
        n = t.kv_heads * context * t.head_dim
        out += [n * wb, n * wb] + ([] if cuda else [n * 4, n * 4])
    return out


def dequant_scratch_tensors(t: TargetGeometry, drafter: str, *, wb: int, cuda: bool, quant: str = "bf16",
                            dflash2: DFlash2Geometry | None = None) -> list[int]:
    """The scratch a quantized matrix is dequantized into for windows of 2+ rows (CUDA; one allocation, reused):
    the largest block-format matrix of at most `DEQUANT_MAX_VALUES` values in the compute dtype (runtime/gpu/
    dense_kernels.py `quant_linear`): the target's stacked q/k/v, o_proj, dense MLP, vocabulary head and MTP fc when
    its weights are blocks, the DFlash2 backbone's when the drafter is quantized."""
    from runtime.gpu.dense_kernels import DEQUANT_MAX_VALUES

    if not cuda:
        return []
    sizes: list[int] = []
    if t.quant != "bf16":
        h, q, kv = t.hidden, t.heads * t.head_dim, t.kv_heads * t.head_dim
        sizes += [h * (q + 2 * kv), q * h, t.vocab * h]
        if len(t.sparse_layers) < t.layers:
            sizes.append(h * t.intermediate)
        if t.has_mtp:
            sizes.append(2 * h * h)
    if drafter == "dflash2" and dflash2 is not None and quant != "bf16":
        d = dflash2
        q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        sizes += [d.hidden_size * (q + 2 * kv), q * d.hidden_size, d.hidden_size * d.intermediate_size]
    fit = [n for n in sizes if n <= DEQUANT_MAX_VALUES]
    return [max(fit) * wb] if fit else []


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


def pool_tensors(t: TargetGeometry, slots: int, dynamic: int, wb: int) -> tuple[list[int], list[int]]:
    """The offloaded layout's device tensors (runtime/expert_pool.py): the two slot planes (gate_up, down: the
    expert cache), then the table and LRU state (a few KiB, counted under `allocator`)."""
    L, E = len(t.sparse_layers), t.experts
    planes = [slots * t.matrix_bytes(2 * t.moe_intermediate, t.hidden, wb),
              slots * t.matrix_bytes(t.hidden, t.moe_intermediate, wb)]
    state = [(L * (E + 1) + 1) * 4, dynamic * 8, (dynamic + 1) * 8, (dynamic + 1) * 8, (slots + 1) * 8, 8, 3 * 8,
             E * 8]
    return planes, state


def persistent_tensors(t: TargetGeometry, drafter: str, wb: int, kb: int, context: int, block: int,
                       dflash2: DFlash2Geometry | None = None, quant: str = "bf16",
                       kv_quant: str | None = None, pool: tuple[int, int] | None = None) -> list[int]:
    """Byte sizes of the runtime's persistent tensors one by one (what the allocator is asked for): embeddings,
    lm_head, each layer's stacked q/k/v, o_proj, norms, router, stacked experts (gate_up, down) or, offloaded
    (`pool` = (slots, dynamic slots)), the slot pool and its table, K and V caches, logits buffers, the drafter's
    matrices and its cache. Their sum is close to the exact items; the list is what `segment_bytes` rounds."""
    h, q, kv = t.hidden, t.heads * t.head_dim, t.kv_heads * t.head_dim
    mi = t.moe_intermediate

    def mat(rows: int, cols: int) -> int:      # floats, or ggml blocks for a quantized target
        return t.matrix_bytes(rows, cols, wb)

    out = [mat(t.vocab, h)] * (1 if t.tie_embeddings else 2) + [h * wb]
    for i in range(t.layers):
        sparse = i in t.sparse_layers
        out += [mat(q + 2 * kv, h), mat(h, q), h * wb, h * wb, t.head_dim * wb, t.head_dim * wb]
        if sparse:
            out += [t.experts * h * wb]
            if pool is None:
                out += [t.experts * mat(2 * mi, h), t.experts * mat(h, mi)]
        else:
            out += [mat(t.intermediate, h)] * 2 + [mat(h, t.intermediate)]
    if pool is not None:
        planes, state = pool_tensors(t, pool[0], pool[1], wb)
        out += planes + state
    if kv_quant is None:
        out += [t.layers * kv * context * kb] * 2
    else:   # int8 values and float16 scales (one per 32 values), K and V each
        out += [t.layers * kv * context] * 2 + [t.layers * kv // Q8_BLOCK * 2 * context] * 2
    out.append(block * t.vocab * 4)
    if drafter == "mtp":
        out += [h * wb] * 3 + [mat(h, 2 * h), mat(q + 2 * kv, h), mat(h, q), h * wb, h * wb]
        out += [t.head_dim * wb] * 2
        if t.mtp_sparse:
            out += [t.experts * h * wb, t.experts * mat(2 * mi, h), t.experts * mat(h, mi)]
        out += [kv * context * kb] * 2 + [block * t.vocab * 4]
    elif drafter == "dflash2" and dflash2 is not None:
        d = dflash2
        fmt = block_format(quant)
        for shape, kind in expected_tensors(d).values():   # one allocation per tensor, as the loader makes them
            if kind == "backbone" and fmt.quantized:
                out.append(shape[0] * row_bytes(shape[-1], fmt.name))
            else:
                out.append(_numel(shape) * wb)
        out += [d.num_layers * d.num_kv_heads * d.head_dim * context * kb] * 2 + [block * t.vocab * 4]
    return out


def transient_tensors(t: TargetGeometry, rows: int, wb: int, dflash2: DFlash2Geometry | None = None,
                      offload: bool = False) -> list[int]:
    """The tensors alive at the peak of one prefill chunk of `rows` rows (flash attention: no score matrix).
    Either inside one target layer: residual, normed input, q/k/v (and their roped copies), attention output, router
    logits (fp32 softmax), the gathered rows of the MoE loop and their expert activations, the MoE output (offloaded:
    plus every (row, choice)'s contribution, held until they are added in expert order); or, with DFlash2, after
    the chunk, while the drafter observes it (the target's layer temporaries are freed by then): the chunk's hidden
    and taps, the fused context and one drafter layer's activations. The larger set is the peak."""
    h, q, kv = t.hidden, t.heads * t.head_dim, t.kv_heads * t.head_dim
    out = [rows * h * wb] * 4 + [rows * q * wb] * 3 + [rows * kv * wb] * 4
    out += [rows * t.experts * 4] * 2 + [rows * t.top_k * 8] * 2
    if t.experts:
        out += [rows * h * wb] * 2 + [rows * t.moe_intermediate * wb] * 3
        if offload:
            out += [rows * t.top_k * h * wb]
    else:
        out += [rows * t.intermediate * wb] * 3
    if dflash2 is not None:
        d = dflash2
        obs = [rows * d.num_taps * h * wb, rows * h * wb, rows * d.num_taps * h * wb, rows * d.hidden_size * wb * 3,
               rows * d.intermediate_size * wb * 3, rows * (d.num_heads + 2 * d.num_kv_heads) * d.head_dim * wb]
        if sum(obs) > sum(out):
            return obs
    return out


def drafter_graphs(drafter: str, width: int) -> int:
    """The graphs a drafter's graph set may hold: its `graph_sets`, plus a proposal graph for each shorter draft
    (the last windows of a generation draft fewer rows: width - 2 more lengths) and, for sampled requests, a
    proposal graph per length for each of SAMPLED_SETTINGS_KEPT sampling settings (runtime/gpu/capture.py)."""
    g = KINDS[drafter].graph_sets
    if g == 0 or width < 2:
        return g
    return g + (width - 2) + SAMPLED_SETTINGS_KEPT * (width - 1)


def graph_pool_bytes(t: TargetGeometry, drafter: str, width: int, wb: int, offload: bool = False) -> int:
    """Each captured graph keeps a private pool of its step's intermediates (width `width` rows), and the warm-up on
    the capture stream leaves its own segments: one `segment_bytes` of a step's tensors per graph (the target's
    step and the drafter's graphs, `drafter_graphs`), plus one. Offloaded, a step also holds one layer's fp32 pair
    buffer and expert activations."""
    h, q, kv = t.hidden, t.heads * t.head_dim, t.kv_heads * t.head_dim
    step = [width * t.vocab * 4, width * h * wb * 4, width * (q + 2 * kv) * wb * 2, width * t.top_k * 16]
    if offload:
        step += [width * t.top_k * h * 4, width * t.top_k * t.moe_intermediate * wb]
    n = 1 + drafter_graphs(drafter, width)
    return (n + 1) * segment_bytes(step)


def sampling_graph_bytes(t: TargetGeometry, block: int) -> int:
    """The sampled acceptance's CUDA graphs (runtime/speculative.py `_SampledRule`), made once a request samples:
    at most RULE_GRAPHS_KEPT, each a private pool holding a window's rule at up to `block` rows: its static logits
    and draft distributions, the temperature-scaled rows, the softmax, top-p's sorted rows with their int64
    indices, cumulative sums and masks, the renormalised rows, and the Gumbel draw's row of uniforms and scores."""
    r, v = max(int(block), 1), t.vocab
    rule = [r * v * 4] * 8 + [r * v * 8] + [r * v] * 2 + [v * 4] * 4 + [(r + v) * 4]
    return RULE_GRAPHS_KEPT * segment_bytes(rule)


kv_bytes = kv_cache_bytes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def compute_budget(
    target: TargetGeometry,
    drafter: str,
    inputs: BudgetInputs,
    *,
    dflash2: DFlash2Geometry | None = None,
    quant: str = "bf16",
) -> Budget:
    """Itemise every fixed allocation, then give the rest to the expert cache."""
    if drafter not in KINDS:
        raise BudgetError(f"Unknown drafter '{drafter}'; use one of {', '.join(KINDS)}.")
    if quant not in QTYPES:
        raise BudgetError(f"Unknown DFlash2 quantization '{quant}'; use one of {', '.join(QTYPES)}.")
    if inputs.kv_quant is not None and inputs.kv_quant not in KV_QUANTS:
        raise BudgetError(f"Unknown KV cache format '{inputs.kv_quant}'; use one of {', '.join(KV_QUANTS)}.")
    chunk = inputs.prefill_chunk or default_prefill_chunk(inputs.device_type)
    if chunk < 1:
        raise BudgetError(f"The prefill chunk must be at least 1 token, not {chunk}.")
    if inputs.context <= 0:
        raise BudgetError(f"The context length must be a positive number of tokens, not {inputs.context}.")
    if inputs.block <= 0:
        raise BudgetError(f"The block size must be positive, not {inputs.block}.")
    if inputs.reserve_bytes < 0:
        raise BudgetError("The memory reserve cannot be negative.")
    kind = KINDS[drafter]
    if kind.needs_file and dflash2 is None:
        raise BudgetError("A DFlash2 budget needs the drafter's geometry (its config.json or GGUF metadata).")
    if drafter == "mtp" and not target.has_mtp:
        raise BudgetError("This target has no MTP head (no mtp.* tensors); choose --drafter dflash2 or none.")

    wb, kb, ctx = inputs.weight_bytes, inputs.kv_bytes, inputs.context
    block = inputs.block if drafter != "none" else 1
    items: dict[str, int] = {"target_dense_weights": target.dense_bytes(wb)}
    if inputs.device_type == "cpu" and inputs.kv_quant is None and aoti.wanted() and wb == 4 \
            and target_compiled.may_fit(target) is None:
        # the compiled CPU step's bf16 copies of its products' weights (runtime/target_compiled.py `_copies`)
        items["target_dense_weights"] += target_compiled.copies_bytes_for(target)
    items["drafter_weights"] = kind.weight_bytes(target, dflash2, quant, wb)
    if drafter == "mtp" and inputs.device_type == "cpu" and target.float_head:
        # the chain's int8 head (runtime/drafters/head8.py), and its layer's int8 matrices where the chain's step
        # is compiled (runtime/drafters/mtp_compiled.py: its package takes them)
        items["drafter_weights"] += head8.nbytes(target.vocab, target.hidden)
        if aoti.wanted():
            items["drafter_weights"] += head8.dense_nbytes(
                target.hidden, target.heads * target.head_dim, target.kv_heads * target.head_dim,
                target.experts if target.sparse_layers else 0, target.moe_intermediate)
    # a float CPU cache holds the compiled step's spare slots past the context (runtime/target_compiled.py)
    slots = ctx + (target_compiled.spare_slots(ctx) if inputs.device_type == "cpu" and inputs.kv_quant is None else 0)
    items["target_kv"] = target.layers * 2 * target.kv_heads * kv_row_bytes(target.head_dim, kb, inputs.kv_quant) * slots
    # the MTP chain's own cache is bf16 beside fp32 weights where its step is compiled (runtime/drafters/mtp.py
    # `use_compiled`)
    mtp16 = drafter == "mtp" and inputs.device_type == "cpu" and target.float_head and aoti.wanted() and kb == 4 \
        and mtp_compiled.BF16_CACHE and target_compiled.may_fit(target) is None
    items["drafter_kv"] = kind.kv_bytes(target, dflash2, 2 if mtp16 else kb, ctx)
    items["logits"] = block * target.vocab * 4 * (2 if kind.makes_logits else 1)
    cuda = inputs.device_type == "cuda"
    attn = attention_scratch_tensors(target, drafter, context=ctx, block=block, wb=wb, cuda=cuda,
                                     kv_quant=inputs.kv_quant, dflash2=dflash2, graphs=inputs.graphs)
    attn += dequant_scratch_tensors(target, drafter, wb=wb, cuda=cuda, quant=quant, dflash2=dflash2)
    items["scratch"] = scratch_bytes(
        target, context=ctx, block=block, prefill_chunk=chunk, act_bytes=wb, flash=cuda
    ) + sum(attn)
    if cuda:
        ws = cublas_workspace_bytes(inputs.capability, inputs.cublas_workspace_config)
        items["workspace"] = ws * (2 if inputs.graphs else 1)
        items["graph_pool"] = graph_pool_bytes(target, drafter, block, wb) if inputs.graphs else 0
        items["sampling_graphs"] = sampling_graph_bytes(target, block) if inputs.graphs else 0
        rows = max(min(chunk, ctx), block, 1)
        pers = persistent_tensors(target, drafter, wb, kb, ctx, block, dflash2, quant, inputs.kv_quant)
        trans = transient_tensors(target, rows, wb, dflash2 if drafter == "dflash2" else None) + attn
        # transients share the persistent tensors' segments (the free tail of the last 2 MiB small segment, the
        # 20 MiB large ones) before new ones are made: one packing of both
        items["allocator"] = max(segment_bytes(pers + trans) - sum(pers) - items["scratch"], 0)
    hr = inputs.headroom_bytes
    items["headroom"] = headroom_bytes(inputs.device_type, inputs.total_bytes) if hr is None else hr
    items["reserve"] = inputs.reserve_bytes

    expert = target.expert_bytes(wb)
    fixed = sum(items.values())
    room = inputs.available_bytes - fixed
    if expert > 0 and room > 0:
        slots = min(room // expert, target.total_experts)
    else:
        slots = 0
    dynamic = 0
    if cuda and 0 < slots < target.total_experts:
        # offloaded: the slot pool's layout, not the stacked one. Its fixed items depend on the slots a little (the
        # allocator's rounding of the two planes), so take the most slots whose layout fits (fixed + slots is
        # nondecreasing in the slots: a binary search)
        trans = transient_tensors(target, rows, wb, dflash2 if drafter == "dflash2" else None, offload=True) + attn
        gp = graph_pool_bytes(target, drafter, block, wb, offload=True) if inputs.graphs else 0

        def layout(n: int) -> dict[str, int]:
            dyn = min(block * target.top_k, target.experts, n)
            pers = persistent_tensors(target, drafter, wb, kb, ctx, block, dflash2, quant, inputs.kv_quant,
                                      pool=(n, dyn))
            state = sum(pool_tensors(target, n, dyn, wb)[1])
            alloc = max(segment_bytes(pers + trans) - (sum(pers) - state) - items["scratch"], 0)
            return {**items, "allocator": alloc, "graph_pool": gp}

        lo, hi, best = 0, target.total_experts - 1, 0
        while lo <= hi:
            mid = (lo + hi) // 2
            if sum(layout(mid).values()) + mid * expert <= inputs.available_bytes:
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        slots = best
        items = layout(slots)
        fixed = sum(items.values())
        room = inputs.available_bytes - fixed
        dynamic = min(block * target.top_k, target.experts, slots)
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
            f"{slots} of {target.total_experts} experts fit on the GPU ({dynamic} of those slots cache recently "
            f"fetched experts); all experts stay in host memory, the routing profile picks which ones the GPU holds."
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
        dynamic_slots=int(dynamic),
        dense_read_bytes=int(target.dense_bytes(wb) - target.matrix_bytes(target.vocab, target.hidden, wb)
                             + target.matrix_bytes(1, target.hidden, wb) + items["target_kv"] // 2),
        experts_per_token=len(target.sparse_layers) * target.top_k,
    )


@dataclass(frozen=True)
class DecodeEstimate:
    """What memory traffic allows a target-only decode token (docs/budget.md, "Decode estimate")."""

    hit_rate: float
    tok_s: float
    resident_bytes: int     # per token, read from device memory
    missed_bytes: int       # per token, brought over the host link
    hbm_Bps: float
    link_Bps: float


def decode_estimate(b: Budget, hit_rate: float, hbm_Bps: float, link_Bps: float) -> DecodeEstimate:
    """Per token: the dense weights (one embedding row), the KV cache at half the context and the hit experts read
    from device memory at `hbm_Bps`, the missed experts moved from host memory at `link_Bps` (PCIe, or the CPU's
    expert throughput when misses are computed there): tok/s = 1 / (resident / hbm + missed / link). A bound, not
    a promise: kernel launches, attention and the miss path's bookkeeping come on top."""
    hit = min(max(hit_rate, 0.0), 1.0)
    experts = b.experts_per_token * b.expert_bytes
    resident = b.dense_read_bytes + int(experts * hit)
    missed = int(experts * (1 - hit)) if b.offloaded else 0
    t = resident / hbm_Bps + (missed / link_Bps if missed else 0.0)
    return DecodeEstimate(hit, 1.0 / t if t > 0 else float("inf"), resident, missed, hbm_Bps, link_Bps)


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
