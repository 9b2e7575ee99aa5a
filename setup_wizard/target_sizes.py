"""The target's "Which size?" (docs/commands.md): BF16, Q8_0 or Q4_0, each with what it costs (download, disk,
memory), whether it fits this machine with the chosen context and drafter (the budget), and which one to take.

The checkpoint is downloaded in BF16 whatever the size (Strata converts it locally, setup_wizard/convert_target.py),
so the sizes differ in disk (the converted file comes on top) and in memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.formats.target_gguf import TARGET_QUANTS
from runtime.models.target_config import TargetGeometry
from setup_wizard.budget import MIB, Budget

# Next-token top-1 agreement with BF16 of the bundled pack converted to each size, on the held-out calibration
# prompts (bench/quant_target.py --part agreement; bench/results/quant_target.json, fp32 CPU). A quality note for the
# size question, not a promise for other models: larger models usually lose less to the same format.
AGREEMENT = {"q8_0": 0.991, "q4_0": 0.895}

LABELS = {
    "bf16": "BF16 — the original weights",
    "q8_0": "Q8_0 — about half the memory of BF16",
    "q4_0": "Q4_0 — about a quarter of the memory of BF16",
}
# bytes per weight relative to BF16 (ggml block sizes: 34 B per 32 values, 18 B per 32 values): for estimates made
# before the checkpoint's config is here
RATIO = {"bf16": 1.0, "q8_0": 34 / 64, "q4_0": 18 / 64}


def quality_note(quant: str) -> str:
    a = AGREEMENT.get(quant)
    if a is None:
        return "exact"
    return f"{100 * a:.1f}% same next token as BF16 on the bundled pack"


@dataclass(frozen=True)
class SizeOption:
    quant: str
    download_bytes: int          # what setup still has to fetch (the BF16 checkpoint; 0 when it is here)
    disk_bytes: int              # the checkpoint plus the converted file(s) in the store
    memory_bytes: int            # the weights the runtime holds (dense, every expert, the MTP head when used)
    budget: Budget | None        # None: the model's config is not here yet (sizes estimated)
    context: int

    @property
    def exact(self) -> bool:
        return self.budget is not None

    @property
    def fits(self) -> bool | None:
        """None before the download; else whether the budget fits (experts that do not fit on the GPU stream from
        host memory, quantized ones too: runtime/experts.py)."""
        b = self.budget
        if b is None:
            return None
        return b.fits

    def fit(self) -> str:
        b = self.budget
        if b is None:
            return "fit known after download"
        if not self.fits:
            return "does not fit"
        where = "GPU" if b.device_type == "cuda" else "RAM"
        if b.expert_cache_slots >= b.total_experts:
            return f"fits ({where}, all experts resident, {self.context} tokens)"
        return f"fits ({b.expert_cache_slots} of {b.total_experts} experts on the GPU, {self.context} tokens)"

    def line(self, recommended: bool = False) -> str:
        est = "" if self.exact else "~"
        dl = f"download {_size(self.download_bytes)}" if self.download_bytes else "downloaded"
        mark = "  (recommended)" if recommended else ""
        return (f"{LABELS[self.quant]}: {dl}, disk {est}{_size(self.disk_bytes)}, memory {est}"
                f"{_size(self.memory_bytes)}; {self.fit()}; {quality_note(self.quant)}{mark}")


def _size(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / MIB:.1f} MiB"


def weights_bytes(geo: TargetGeometry, wb: int, *, with_mtp: bool) -> int:
    """Every weight as held (`wb`: the runtime's float bytes; the converted file stores floats as F32, 4)."""
    return (geo.dense_bytes(wb) + geo.total_experts * geo.expert_bytes(wb)
            + (geo.mtp_bytes(wb) if with_mtp else 0))


def option(quant: str, geo: TargetGeometry | None, budget: Budget | None, *, context: int, wb: int,
           checkpoint_bytes: int, here: bool, with_mtp: bool) -> SizeOption:
    """One line of the question. `geo` is the checkpoint's geometry (BF16) or None before it is downloaded, when
    the sizes are estimated from `checkpoint_bytes` by the formats' bytes per weight."""
    download = 0 if here else checkpoint_bytes
    if geo is None:
        est = int(checkpoint_bytes * RATIO[quant])
        disk = checkpoint_bytes + (est if quant != "bf16" else 0)
        mem = int(checkpoint_bytes * (RATIO[quant] if quant != "bf16" else wb / 2))
        return SizeOption(quant, download, disk, mem, None, context)
    g = geo.with_quant(quant)
    converted = weights_bytes(g, 4, with_mtp=True) if quant != "bf16" else 0
    disk = (checkpoint_bytes or weights_bytes(geo, 2, with_mtp=True)) + converted
    return SizeOption(quant, download, disk, weights_bytes(g, wb, with_mtp=with_mtp), budget, context)


def recommend(options: list[SizeOption]) -> tuple[str, str]:
    """The most precise size that keeps every expert resident (on CPU: that fits in RAM); else the one that keeps
    the most experts resident; else Q4_0, the smallest. Before the download: by the estimated memory against what
    this machine has (`SizeOption.budget` is None)."""
    by = {o.quant: o for o in options}
    exact = [o for o in options if o.budget is not None]
    if exact:
        for q in TARGET_QUANTS:
            o = by.get(q)
            if o is not None and o.budget is not None and o.fits and \
                    o.budget.expert_cache_slots >= o.budget.total_experts:
                return q, ("the original weights, and every expert fits" if q == "bf16"
                           else "the most precise size whose experts all fit")
        fitting = [o for o in exact if o.fits]
        if fitting:
            best = max(fitting, key=lambda o: (o.budget.expert_cache_slots / max(o.budget.total_experts, 1),  # type: ignore[union-attr]
                                               -TARGET_QUANTS.index(o.quant)))
            return best.quant, "keeps the most experts on the GPU"
        return "q4_0", "the smallest size (even it does not fit as chosen)"
    return "bf16", "the original weights (the size is checked again once the model's config is here)"


def recommend_estimated(options: list[SizeOption], available_bytes: int) -> tuple[str, str]:
    """Before the download: the most precise size whose estimated weights take at most 85% of the memory there is."""
    for o in options:
        if o.memory_bytes <= 0.85 * available_bytes:
            return o.quant, ("the original weights fit (estimated from the download size)" if o.quant == "bf16"
                             else "the most precise size that fits (estimated from the download size)")
    return "q4_0", "the smallest size (estimated from the download size)"
