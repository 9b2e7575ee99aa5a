"""A routing profile: per MoE layer, how often the router chose each expert over some prompts (docs/budget.md,
"Expert cache"). It decides which experts get the device slots (the most chosen ones) and predicts the hit rate.

Recorded from real engine runs (calibration records it on its prompts and stores it with its result); the runtime
only reads it. Counts, not probabilities, so two profiles can be merged and a profile says how much it saw.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from runtime.errors import ConfigError
from runtime.fileio import atomic_write_text

PROFILE_VERSION = 1


@dataclass
class RoutingProfile:
    """`counts[j][e]`: how many (token, top-k choice) pairs of MoE layer `layers[j]` went to expert `e`."""

    layers: list[int]
    counts: list[list[int]]
    tokens: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.layers) != len(self.counts):
            raise ConfigError(f"routing profile: {len(self.layers)} layers but {len(self.counts)} count rows.")
        widths = {len(r) for r in self.counts}
        if len(widths) > 1:
            raise ConfigError("routing profile: every layer must count the same number of experts.")

    @property
    def n_experts(self) -> int:
        return len(self.counts[0]) if self.counts else 0

    def frequencies(self) -> Tensor:
        """[L, E] float64: each layer's counts as fractions of its (token, choice) pairs; a layer that saw nothing
        is uniform (no evidence: every expert alike)."""
        c = torch.tensor(self.counts, dtype=torch.float64)
        tot = c.sum(dim=1, keepdim=True)
        uni = torch.full_like(c, 1.0 / max(1, c.shape[1]))
        return torch.where(tot > 0, c / tot.clamp_min(1), uni)

    def ranking(self) -> list[tuple[int, int]]:
        """Every (layer, expert), best first: higher frequency first; ties by rank within the layer, then layer
        order, so that without evidence the slots spread evenly over the layers, lowest expert ids first."""
        f = self.frequencies()
        out = []
        for j, li in enumerate(self.layers):
            order = sorted(range(f.shape[1]), key=lambda e, r=f[j]: (-float(r[e]), e))
            out += [(-float(f[j, e]), rank, j, li, e) for rank, e in enumerate(order)]
        out.sort()
        return [(li, e) for *_, li, e in out]

    def placement(self, slots: int) -> dict[int, list[int]]:
        """The `slots` most chosen experts, as {layer: sorted expert ids} (every layer present, maybe empty)."""
        chosen: dict[int, list[int]] = {li: [] for li in self.layers}
        for li, e in self.ranking()[:max(0, slots)]:
            chosen[li].append(e)
        return {li: sorted(v) for li, v in chosen.items()}

    def expected_hit_rate(self, slots: int) -> float:
        """The fraction of (token, expert) pairs that find their expert in the `slots` chosen by `placement`,
        if routing goes as profiled (static slots only; recently fetched experts can add hits)."""
        if not self.layers:
            return 1.0
        f = self.frequencies()
        pos = {li: j for j, li in enumerate(self.layers)}
        got = sum(float(f[pos[li], e]) for li, e in self.ranking()[:max(0, slots)])
        return got / len(self.layers)

    def distinct_per_layer(self) -> float:
        """Mean number of experts each layer used at least once (how spread the routing was)."""
        if not self.layers:
            return 0.0
        return sum(sum(1 for c in row if c > 0) for row in self.counts) / len(self.layers)

    # ------------------------------------------------------------------------------------------- persistence
    def to_dict(self) -> dict[str, Any]:
        return {"version": PROFILE_VERSION, "layers": list(self.layers), "tokens": int(self.tokens),
                "counts": [list(map(int, r)) for r in self.counts], "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "routing profile") -> RoutingProfile:
        if not isinstance(d, dict) or d.get("version") != PROFILE_VERSION:
            raise ConfigError(f"{where} is not a version-{PROFILE_VERSION} routing profile; record it again "
                              f"(strata-setup calibrate).")
        try:
            layers = [int(x) for x in d["layers"]]
            counts = [[int(c) for c in row] for row in d["counts"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{where} is damaged ({e}); record it again (strata-setup calibrate).") from None
        if any(c < 0 for row in counts for c in row):
            raise ConfigError(f"{where} has negative counts; record it again (strata-setup calibrate).")
        return cls(layers, counts, int(d.get("tokens", 0)), dict(d.get("meta") or {}))

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        blob = json.dumps(self.to_dict(), separators=(",", ":"))

        def intact(tmp: Path) -> None:
            if json.loads(tmp.read_text(encoding="utf-8")) != json.loads(blob):
                raise OSError(f"the routing profile written to {tmp} did not read back intact")

        atomic_write_text(p, blob, verify=intact)
        return p

    @classmethod
    def load(cls, path: str | Path) -> RoutingProfile:
        p = Path(path)
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
        except OSError as e:
            raise ConfigError(f"cannot read the routing profile {p} ({e.strerror}); record it again "
                              f"(strata-setup calibrate) or remove it from the config.") from None
        except ValueError:
            raise ConfigError(f"the routing profile {p} is not valid JSON; record it again "
                              f"(strata-setup calibrate).") from None
        return cls.from_dict(d, where=f"the routing profile {p}")

    def matches(self, layers: list[int], n_experts: int) -> bool:
        return list(self.layers) == list(layers) and self.n_experts == n_experts


def uniform_profile(layers: list[int], n_experts: int) -> RoutingProfile:
    """No evidence: every expert alike (placement spreads the slots evenly, lowest ids first)."""
    return RoutingProfile(list(layers), [[0] * n_experts for _ in layers])


class RoutingRecorder:
    """Counts router choices on the device while it is on: `add(layer, idx)` with idx [..., k] expert ids (an id
    >= E marks a padded row and lands in a spare column). Shape-static, so it can sit inside a CUDA graph."""

    def __init__(self, layers: list[int], n_experts: int, device: torch.device, top_k: int) -> None:
        self.layers = list(layers)
        self.row = {li: j for j, li in enumerate(self.layers)}
        self.E, self.top_k = n_experts, top_k
        self.counts = torch.zeros(len(self.layers), n_experts + 1, dtype=torch.int64, device=device)

    def add(self, layer: int, idx: Tensor) -> None:
        j = self.row.get(layer)
        if j is None:
            return
        flat = idx.reshape(-1).long().clamp(max=self.E)
        self.counts[j].scatter_add_(0, flat, torch.ones_like(flat))

    def profile(self, meta: dict[str, Any] | None = None) -> RoutingProfile:
        c = self.counts[:, :self.E].cpu().tolist()
        tokens = sum(c[0]) // max(1, self.top_k) if c else 0
        return RoutingProfile(self.layers, c, tokens, dict(meta or {}))

    def reset(self) -> None:
        self.counts.zero_()
