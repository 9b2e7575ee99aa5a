"""Calibration results: the JSON record kept per key, the store of those records, and the result object.

One JSON file per key under `$STRATA_HOME/calibration/` (injectable): `<sha256 of the key>.json` holding
`{key, settings, per-task medians, accepted/proposed, seconds, date, ...}`. A record is reused only when the whole
key stored inside it equals the requested key; a damaged file is ignored (recalibrated), never trusted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from calibrate.key import CalibrationKey
from runtime.fileio import atomic_write_text
from runtime.paths import strata_home

RECORD_VERSION = 1


def default_store_dir() -> Path:
    return strata_home() / "calibration"


class ResultStore:
    """Calibration records by key, written atomically (temp name, verify, rename)."""

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_store_dir()

    def path_for(self, key: CalibrationKey) -> Path:
        return self.root / f"{key.digest}.json"

    def load(self, key: CalibrationKey) -> dict[str, Any] | None:
        """The stored record for exactly this key, or None (missing, unreadable, or a different key inside)."""
        p = self.path_for(key)
        try:
            rec = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(rec, dict) or rec.get("record_version") != RECORD_VERSION:
            return None
        if rec.get("key") != key.to_dict():
            return None
        if not isinstance(rec.get("settings"), dict):
            return None
        return rec

    def save(self, key: CalibrationKey, record: dict[str, Any]) -> Path:
        rec = {**record, "record_version": RECORD_VERSION, "key": key.to_dict(), "key_id": key.digest}
        blob = json.dumps(rec, indent=1, sort_keys=True, default=_jsonable)
        dest = self.path_for(key)

        def intact(tmp: Path) -> None:
            if json.loads(tmp.read_text(encoding="utf-8")) != json.loads(blob):
                raise OSError(f"the calibration record written to {tmp} did not read back intact")

        atomic_write_text(dest, blob, verify=intact)
        return dest


def _jsonable(x: Any) -> Any:
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON-able: {type(x).__name__}")


def drop_none(x: Any) -> Any:
    """TOML has no null: drop None values (recursively) so the dict can go straight into the config."""
    if isinstance(x, dict):
        return {k: drop_none(v) for k, v in x.items() if v is not None}
    if isinstance(x, list | tuple):
        return [drop_none(v) for v in x if v is not None]
    return x


@dataclass
class CalibrationResult:
    """What `calibrate_for_config` hands the wizard.

    `block`/`spec_min_p` are the settings to run with (None when there is no drafter); `source` is the value for the
    config's `[speculative] source`: "calibrated" when a measurement (now or a reused one) decided, "default" when
    nothing could be measured (no drafter, or the budget ran out first). `to_dict()` is the `[calibration]` table.
    """

    block: int | None
    spec_min_p: float | None
    source: str
    decision: str
    reason: str
    reused: bool = False
    key: CalibrationKey | None = None
    record: dict[str, Any] = field(default_factory=dict)
    path: str | None = None
    routing_profile: str | None = None   # the routing profile file that placed the expert slots (offloaded setups)

    @property
    def seconds(self) -> float | None:
        return self.record.get("seconds")

    @property
    def draft_temp_scale(self) -> float | None:
        """The sampled drafts' temperature scale the record measured (calibrate/draft_temperature.py), or None
        where nothing was measured (another drafter, an older record)."""
        dt = self.record.get("draft_temperature") or {}
        return float(dt["scale"]) if "overlap" in dt else None

    def to_dict(self) -> dict[str, Any]:
        """The config's `[calibration]` table (TOML-safe: no None anywhere)."""
        r = self.record
        out: dict[str, Any] = {
            "block": self.block, "spec_min_p": self.spec_min_p, "source": self.source,
            "decision": self.decision, "reason": self.reason, "reused": self.reused,
            "key": self.key.to_dict() if self.key else None, "key_id": self.key.digest if self.key else None,
            "results_file": self.path, "date": r.get("date"), "seconds": r.get("seconds"),
            "budget_s": r.get("budget_s"), "new_tokens": r.get("new_tokens"),
            "per_task_tok_s": r.get("per_task_tok_s") or None, "geomean_tok_s": r.get("geomean_tok_s"),
            "accepted": r.get("accepted"), "proposed": r.get("proposed"),
            "default": r.get("default"), "winner": r.get("winner"), "gain": r.get("gain"),
            "target_only_tok_s": r.get("target_only_tok_s") or None,
            "arms_measured": len(r["arms"]) if "arms" in r else None, "grid_size": r.get("grid_size"),
            "routing_profile": self.routing_profile, "draft_temp_scale": self.draft_temp_scale,
        }
        return drop_none(out)

    def to_json(self) -> dict[str, Any]:
        """Everything, for `--json` (the full record including the sweep)."""
        return {**self.to_dict(), "record": self.record}

    @classmethod
    def from_record(cls, key: CalibrationKey, record: dict[str, Any], *, reused: bool, path: str | None
                    ) -> CalibrationResult:
        s = record["settings"]
        return cls(block=int(s["block"]), spec_min_p=float(s["spec_min_p"]), source=str(record.get("source",
                   "calibrated")), decision=str(record.get("decision", "")), reason=str(record.get("reason", "")),
                   reused=reused, key=key, record=record, path=path)
