"""The routing profile calibration records (docs/calibration.md, "Routing profile"): which experts every MoE layer's
router chose over the calibration prompts, counted in a real engine run (target only, greedy), so the expert cache
(runtime/experts.py) gives its GPU slots to the experts this model really uses.

Stored beside the calibration records (calibrate/results.py), one file per key of its own: the target's sha256, the
prompt set's sha256 and the runtime version. Routing does not depend on the drafter or the device, so one profile
serves every setup of a target; it is recorded only when the setup offloads experts (fewer slots than experts).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calibrate.fixtures import encode_prompts, load_prompts, prompt_set_sha256
from calibrate.key import CalibrationConfigError
from calibrate.results import ResultStore
from runtime.routing_profile import RoutingProfile
from runtime.version import __version__ as RUNTIME_VERSION

PROFILE_NEW_TOKENS = 32      # decoded tokens per prompt after its prefill (prefill rows count too)


@dataclass
class ProfileResult:
    path: Path
    profile: RoutingProfile
    reused: bool
    key: dict[str, str]


def profile_key(config: dict[str, Any], prompts: dict[str, str]) -> dict[str, str]:
    tsha = str((config.get("target") or {}).get("sha256") or "")
    if not tsha:
        raise CalibrationConfigError("the config has no [target] sha256; re-run strata-setup to record it.")
    return {"target_sha256": tsha, "prompt_set_sha256": prompt_set_sha256(prompts), "runtime_version": RUNTIME_VERSION}


def profile_path(store: ResultStore, key: dict[str, str]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return store.root / f"routing-{digest}.json"


def offloads(config: dict[str, Any]) -> bool:
    """Whether the config's expert cache holds fewer experts than the target has (then placement matters)."""
    mem = config.get("memory") or {}
    slots, total = mem.get("expert_cache_slots"), mem.get("total_experts")
    return slots is not None and total is not None and int(slots) < int(total)


def record_profile(engine: Any, prompts: dict[str, str], *, new_tokens: int = PROFILE_NEW_TOKENS,
                   context: int | None = None, meta: dict[str, Any] | None = None) -> RoutingProfile:
    """Generate on every prompt with `engine` (target only, greedy) while its router choices are counted."""
    enc = encode_prompts(engine.tokenizer, prompts, context=context, new_tokens=new_tokens, max_block=1)
    engine.record_routing(True)
    try:
        for e in enc.values():
            engine.generate(list(e.ids), max_new_tokens=new_tokens, draft=False, stop_ids=set())
        return engine.experts.routing_profile(dict(meta or {}, new_tokens=new_tokens, prompts=sorted(enc)))
    finally:
        engine.record_routing(False)


def profile_for_config(config: dict[str, Any], engine: Any, *, store_dir: str | Path | None = None,
                       force: bool = False, prompts: dict[str, str] | None = None,
                       context: int | None = None) -> ProfileResult:
    """The stored profile for this target and prompt set, or a new one recorded with `engine` and stored."""
    texts = prompts if prompts is not None else load_prompts()
    key = profile_key(config, texts)
    store = ResultStore(store_dir)
    path = profile_path(store, key)
    if not force and path.is_file():
        try:
            prof = RoutingProfile.load(path)
        except ValueError:          # damaged: record it again
            prof = None
        if prof is not None and prof.meta.get("key") == key and prof.matches(sorted(engine.experts.blocks),
                                                                              engine.experts.n_exp):
            return ProfileResult(path, prof, True, key)
    prof = record_profile(engine, texts, context=context, meta={"key": key})
    prof.save(path)
    return ProfileResult(path, prof, False, key)
