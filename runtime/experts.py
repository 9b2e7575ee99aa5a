"""Expert cache: a fixed number of routed-expert slots on the device; the rest are served from CPU memory.

Policy (simple and static, so memory is exactly what the budget says): the slots are spread evenly over the MoE
layers and, within a layer, go to the lowest expert ids (a calibrated routing histogram can later choose them).
A non-resident expert is computed on the CPU: its rows are copied to the host, run through the CPU copy of the
expert, and the result is copied back (no weight traffic, only activations). On a machine without a GPU every
expert is resident. Hits (resident) and misses (CPU-served) count (token, expert) pairs: rows x top_k per MoE layer.
The stacked Triton paths (fully resident layers) never tell the host which experts they used, but every real row
there is a hit, so they report `count_rows(layer, n)` from the host (no sync).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from runtime.errors import UsageError
from runtime.models.layers import SparseMoe


def _nbytes(m: nn.Module) -> int:
    """Weight bytes of a module: parameters, and ggml blocks of a quantized expert (`QuantLinear.blocks`)."""
    return (sum(p.numel() * p.element_size() for p in m.parameters())
            + sum(b.numel() * b.element_size() for n, b in m.named_buffers() if n.endswith("blocks")))


def _where(m: nn.Module) -> tuple[torch.device, torch.dtype | None]:
    """Device of an expert's weights and the dtype to feed it (None: its input's own, for ggml blocks)."""
    p = next(m.parameters(), None)
    if p is not None:
        return p.device, p.dtype
    return next(m.buffers()).device, None


class ExpertCache:
    def __init__(self, model: nn.Module, device: torch.device, slots: int | None = None,
                 enforce_on_cpu: bool = False) -> None:
        """slots=None: all resident. On a CPU device the limit is ignored (everything is in RAM anyway) unless
        `enforce_on_cpu` (tests: exercises the CPU-served path and the counters without a GPU)."""
        self.device = device
        self.blocks: dict[int, SparseMoe] = {
            i: layer.mlp for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoe)
        }
        n_exp = next(iter(self.blocks.values())).n_exp if self.blocks else 0
        self.total = n_exp * len(self.blocks)
        if slots is not None and slots < 0:
            raise UsageError(f"expert_slots must be >= 0, got {slots}.")
        if (device.type != "cuda" and not enforce_on_cpu) or slots is None or slots >= self.total:
            slots = self.total
        self.slots = slots
        self.resident: set[tuple[int, int]] = set()
        layers = sorted(self.blocks)
        for j, li in enumerate(layers):
            share = slots // len(layers) + (1 if j < slots % len(layers) else 0)
            self.resident.update((li, e) for e in range(min(share, n_exp)))
        self.hits = 0
        self.misses = 0
        for blk in self.blocks.values():
            blk.runner = self.run
            blk.counter = self.count_rows

    def place(self, model: nn.Module) -> None:
        """Move the model to the device, leaving non-resident experts in CPU memory."""
        offloaded = {id(p) for li, blk in self.blocks.items() for e, ex in enumerate(blk.experts)
                     if (li, e) not in self.resident for p in ex.parameters()}
        for p in model.parameters():
            if id(p) not in offloaded:
                p.data = p.data.to(self.device)
        # experts held as ggml blocks (a quantized GGUF target) move as stacks: `SparseMoe.place_blocks`
        blocked = [m for m in model.modules() if isinstance(m, SparseMoe) and m.fmt is not None]
        inside = {id(x) for m in blocked for x in m.experts.modules()}
        for mod in model.modules():
            if id(mod) in inside:
                continue
            for name, b in list(mod.named_buffers(recurse=False)):
                setattr(mod, name, b.to(self.device))
        mtp_blk = getattr(getattr(model, "mtp", None), "layers", [None])[0]
        for m in blocked:
            if m is getattr(mtp_blk, "mlp", None):
                m.place_blocks(self.device, set(range(m.n_exp)))     # drafter weights, always on the device
            else:
                m.place_blocks(self.device, {e for (li, e) in self.resident if li == m.layer_idx})
        if self.device.type == "cuda":
            # layers whose experts are all resident: stacked, for the grouped Triton kernel (same bytes)
            for li, blk in self.blocks.items():
                if all((li, e) in self.resident for e in range(blk.n_exp)):
                    blk.stack_experts()
            mtp = getattr(model, "mtp", None)
            if mtp is not None and isinstance(mtp.layers[0].mlp, SparseMoe):
                mtp.layers[0].mlp.stack_experts()     # drafter weights, always on the device

    def run(self, layer: int, e: int, rows: Tensor) -> Tensor:
        expert = self.blocks[layer].experts[e]
        if (layer, e) in self.resident:
            self.hits += rows.shape[0]
            return expert(rows)
        self.misses += rows.shape[0]
        dev, dt = _where(expert)
        y = expert(rows.to(dev, dt or rows.dtype))
        return y.to(rows.device, rows.dtype)

    def count_rows(self, layer: int, n: int) -> None:
        """`n` real rows went through layer `layer` on the stacked (all-resident) path: n x top_k hits."""
        blk = self.blocks.get(layer)
        if blk is not None:
            self.hits += int(n) * blk.top_k

    @property
    def resident_nbytes(self) -> int:
        """Bytes of the expert weights held in device slots (on CPU-only machines: all experts)."""
        return sum(_nbytes(self.blocks[li].experts[e]) for li, e in self.resident)

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one routed expert (the budget's unit)."""
        blk = next(iter(self.blocks.values()), None)
        return _nbytes(blk.experts[0]) if blk is not None else 0

    def stats(self) -> dict[str, int | float]:
        calls = self.hits + self.misses
        return {"slots": self.slots, "experts": self.total, "hits": self.hits, "misses": self.misses,
                "hit_rate": (self.hits / calls) if calls else 1.0}

    def reset_counters(self) -> None:
        self.hits = self.misses = 0
