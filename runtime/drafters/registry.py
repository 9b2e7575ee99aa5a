"""The one table of drafter kinds: what each kind is called, how it is loaded, its default settings, its largest
window and its memory terms (docs/budget.md). The engine, the budget, the wizard, calibration and the CLI help read
`KINDS`; adding a kind is a module in runtime/drafters/ plus a row here.

This module imports no torch: the setup budget reads the memory terms on machines where the runtime never loads.
Loaders import their kind's module when called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.drafters.dflash2.contract import DFlash2Geometry
from runtime.drafters.dflash2.contract import weight_bytes as dflash2_weight_bytes
from runtime.errors import UsageError
from runtime.models.target_config import TargetGeometry

if TYPE_CHECKING:  # pragma: no cover
    from runtime.drafters.base import Drafter

# the MTP drafter's window buffers hold at least this many rows, so one engine serves every calibrated block
MTP_MAX_BLOCK = 16


@dataclass(frozen=True)
class LoadRequest:
    """What a loader gets: the loaded target, where the drafter's own file is (None for a head inside the target)
    and the engine's settings."""

    target: Any                  # runtime.models.qwen3_moe.Qwen3MoeModel
    path: Path | None
    device: Any                  # torch.device
    dtype: Any                   # torch.dtype
    kv_dtype: Any                # torch.dtype
    context: int
    block: int | None


@dataclass(frozen=True)
class DrafterKind:
    """One kind of drafter. Geometry `g` is the kind's own (DFlash2Geometry) or None for kinds that live in the
    target; `t` is the target's TargetGeometry."""

    name: str
    label: str                                   # one line for help texts and the wizard
    needs_file: bool                             # a separate artifact (`[drafter] path`) besides the target
    experimental: bool
    default_spec_min_p: float                    # the floor an uncalibrated setup uses
    default_block: Callable[[DFlash2Geometry | None], int]
    max_block: Callable[[DFlash2Geometry | None, int | None], int]   # rows of the engine's window buffers
    weight_bytes: Callable[[TargetGeometry, DFlash2Geometry | None, str, int], int]
    kv_bytes: Callable[[TargetGeometry, DFlash2Geometry | None, int, int], int]   # (t, g, elem bytes, context)
    makes_logits: bool                           # has its own logits buffer of max_block rows
    graph_sets: int                              # CUDA graphs its runner captures in a generation (budget)
    load: Callable[[LoadRequest], Drafter | None]


def kv_cache_bytes(layers: int, kv_heads: int, head_dim: int, elem_bytes: int, context: int) -> int:
    """`layers * 2 * kv_heads * head_dim * bytes * context` (K and V)."""
    return layers * 2 * kv_heads * head_dim * elem_bytes * context


def _load_none(req: LoadRequest) -> None:
    return None


def _load_mtp(req: LoadRequest) -> Drafter:
    from runtime.drafters.mtp import MTPDrafter

    if req.target.mtp is None:
        raise UsageError("the target has no MTP head (no mtp.* tensors); choose --drafter dflash2 or none.")
    return MTPDrafter(req.target, req.context, max_block=max(MTP_MAX_BLOCK, int(req.block or 0)),
                      kv_dtype=req.kv_dtype)


def _load_dflash2(req: LoadRequest) -> Drafter:
    from runtime.drafters.dflash2.loading import load_dflash2_drafter

    if req.path is None:
        raise UsageError("a dflash2 drafter needs its artifact path (drafter.path in the config).")
    return load_dflash2_drafter(req.path, req.target, device=req.device, dtype=req.dtype, context=req.context)


KINDS: dict[str, DrafterKind] = {k.name: k for k in (
    DrafterKind(
        name="mtp", label="MTP — the target's own draft head (default, well tested)",
        needs_file=False, experimental=False, default_spec_min_p=0.5,
        default_block=lambda g: 4,
        max_block=lambda g, block: max(MTP_MAX_BLOCK, int(block or 0)),
        weight_bytes=lambda t, g, quant, wb: t.mtp_bytes(wb),      # stored as the target is
        kv_bytes=lambda t, g, kb, ctx: kv_cache_bytes(1, t.kv_heads, t.head_dim, kb, ctx),
        makes_logits=True, graph_sets=2, load=_load_mtp),
    DrafterKind(
        name="dflash2", label="DFlash2 — block-diffusion drafter (experimental)",
        needs_file=True, experimental=True, default_spec_min_p=0.5,
        default_block=lambda g: g.block_size if g is not None else 4,
        max_block=lambda g, block: g.block_size if g is not None else int(block or 1),
        weight_bytes=lambda t, g, quant, wb: dflash2_weight_bytes(g, quant, float_bytes=wb),
        kv_bytes=lambda t, g, kb, ctx: kv_cache_bytes(g.num_layers, g.num_kv_heads, g.head_dim, kb, ctx),
        makes_logits=True, graph_sets=3, load=_load_dflash2),
    DrafterKind(
        name="none", label="None — run the target alone",
        needs_file=False, experimental=False, default_spec_min_p=0.0,
        default_block=lambda g: 1, max_block=lambda g, block: 1,
        weight_bytes=lambda t, g, quant, wb: 0, kv_bytes=lambda t, g, kb, ctx: 0,
        makes_logits=False, graph_sets=0, load=_load_none),
)}
NAMES: tuple[str, ...] = tuple(KINDS)


def drafter_kind(name: str) -> DrafterKind:
    """The kind called `name`, or one sentence naming the choices."""
    k = KINDS.get(str(name))
    if k is None:
        raise UsageError(f"unknown drafter kind {name!r}; use one of {', '.join(NAMES)}.")
    return k
