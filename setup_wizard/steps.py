"""The plan carried out, step by step: target, drafter (download, convert), budget, calibration, config. Every step
is idempotent: a verified download, a cached conversion or a calibration with a matching key is reused, and an
interruption or a failure leaves only complete, verified results behind (each step writes atomically; the config is
written once, last)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from calibrate.key import key_for_config
from calibrate.results import CalibrationResult
from runtime.config import tomlable
from runtime.drafters.dflash2.contract import DFlash2Geometry
from runtime.drafters.registry import KINDS
from runtime.errors import UsageError, WorkError
from runtime.loading import check_target_tensors
from runtime.loading_gguf import check_target_gguf
from runtime.paths import strata_home
from runtime.target_compiled import may_fit
from runtime.version import __version__
from setup_wizard import budget as B
from setup_wizard.config import sha256_file, write_config
from setup_wizard.hardware import MIB, Hardware
from setup_wizard.inspection import drafter_geometry, hash_target, is_gguf_target, target_geometry
from setup_wizard.plan import (
    Plan,
    budget_inputs,
    choose_kv_dtype,
    choose_target_quant,
    compute,
    default_config_path,
    stored_geometry,
)
from setup_wizard.registry import register_config
from setup_wizard.services import Artifact, Services, TargetOption
from setup_wizard.store_locks import hold_locks


@dataclass
class Result:
    config_path: Path
    doc: dict[str, Any]
    budget: B.Budget
    steps: list[dict[str, Any]]
    calibration: CalibrationResult | None = None    # when this run calibrated

    def run_command(self, prompt: str = "Hello") -> str:
        import shlex

        return f"strata-run --config {shlex.quote(str(self.config_path))} --prompt {shlex.quote(prompt)}"

    def serve_command(self) -> str:
        """The same setup behind an OpenAI-compatible API on 127.0.0.1:8080 (docs/commands.md, strata-serve)."""
        import shlex

        return f"strata-serve --config {shlex.quote(str(self.config_path))}"


Reporter = Callable[[str, str], None]  # (step, status) status in start|done|skipped


def execute(plan: Plan, services: Services, *, report: Reporter | None = None, force_calibration: bool = False,
            max_calibration_seconds: float | None = None) -> Result:
    """Run the steps in order. An interruption or a failure leaves only complete, verified results behind (each step
    writes atomically, and the config is written once, last), so a rerun resumes where this one stopped. The store
    items this run uses stay locked until its config is written and registered (docs/store.md, "Locks")."""
    with hold_locks():
        return _execute(plan, services, report=report, force_calibration=force_calibration,
                        max_calibration_seconds=max_calibration_seconds)


def _execute(plan: Plan, services: Services, *, report: Reporter | None, force_calibration: bool,
             max_calibration_seconds: float | None) -> Result:
    say = report or (lambda step, status: None)
    steps: list[dict[str, Any]] = []

    def mark(step: str, status: str, **extra: Any) -> None:
        say(step, status)
        if status != "start":
            steps.append({"step": step, "status": status, **extra})

    # 1. target (a local folder is checked like a head: tensors and shapes against its config.json, every weight
    #    finite, in the same pass that hashes it; exit 2 before anything is written)
    if plan.target.source == "local":
        step = "check and hash target"
        mark(step, "start")
        target = hash_target(plan.target.local_path)  # type: ignore[arg-type]
        mark(step, "done", path=str(target.path))
    else:
        step = f"download {plan.target.name}"
        mark(step, "start")
        target = services.fetch(plan.target.name, offline=plan.offline)
        mark(step, "skipped" if target.reused else "done", path=str(target.path))
        if not is_gguf_target(target.path):
            check_target_tensors(target.path)
    if is_gguf_target(target.path):     # its tensor table, as strata-run will load it (no weight read)
        check_target_gguf(target.path)
    geo = target_geometry(target.path)
    if plan.drafter == "mtp" and not geo.has_mtp:
        raise WorkError(f"The target {plan.target.name} has no MTP head (no mtp.* tensors); rerun with "
                        "--drafter dflash2 or none.")

    # 2. drafter
    drafter_art: Artifact | None = None
    head_art: Artifact | None = None
    dgeo: DFlash2Geometry | None = None
    if KINDS[plan.drafter].needs_file:
        assert plan.head is not None and plan.quant is not None
        if plan.head.local_path is not None and plan.head.description == "local folder":
            head_art = Artifact(path=plan.head.local_path, sha256=_head_source_sha(plan.head.local_path),
                                reused=True, name=plan.head.name)
        else:
            step = f"download {plan.head.name}"
            mark(step, "start")
            head_art = services.fetch(plan.head.name, offline=plan.offline)
            mark(step, "skipped" if head_art.reused else "done", path=str(head_art.path))
        if not head_art.name:
            head_art = replace(head_art, name=plan.head.name)
        step = f"convert {plan.head.name} to {plan.quant}"
        mark(step, "start")
        drafter_art = services.convert(head_art.path, plan.quant, source=head_art)
        mark(step, "skipped" if drafter_art.reused else "done", path=str(drafter_art.path))
        dgeo = drafter_geometry(head_art.path) or drafter_geometry(drafter_art.path)

    # 2b. the target's size (recommended now if it could only be estimated before the download), and its conversion
    source_target: Artifact | None = None
    if not plan.target_quant_given:
        plan.target = replace(plan.target, local_path=Path(target.path))    # here now: its folder can be checked
        choose_target_quant(plan, geo, dgeo, given=None, context=plan.context if plan.context_given else None)
        if not plan.config_path_given:      # the default name carries the quantization chosen just now
            plan.config_path = default_config_path(plan.target.name, plan.drafter, plan.quant, plan.target_quant)
    if plan.converts_target:
        step = f"convert {plan.target.name} to {plan.target_quant}"
        mark(step, "start")
        source_target, target = target, services.convert_target(target.path, plan.target_quant, source=target)
        mark(step, "skipped" if target.reused else "done", path=str(target.path))
        geo = target_geometry(target.path)          # exact, from the converted file's tensor table

    # 3. budget (the context is recommended now if it could not be before the download)
    step = "budget"
    mark(step, "start")
    if not plan.context_given:
        plan.context, plan.why["context"] = B.recommend_context(
            stored_geometry(plan, geo), plan.drafter, budget_inputs(plan, plan.hardware, 0, dgeo), dflash2=dgeo,
            quant=plan.quant or "bf16")
    elif plan.context > geo.max_position:
        raise UsageError(f"--context {plan.context} is longer than the model's limit of {geo.max_position} tokens; "
                         "pass a smaller --context.")
    if not plan.kv_dtype_given:
        choose_kv_dtype(plan, geo, dgeo, given=None)
    budget = compute(plan, geo, dgeo)
    if not budget.fits:
        raise WorkError(budget.reason)
    if geo.quant != "bf16" and budget.expert_cache_slots < budget.total_experts:
        raise WorkError(f"Does not fit: a {geo.quant} target keeps all {budget.total_experts} experts on the GPU, "
                        f"but only {budget.expert_cache_slots} fit; choose a smaller --target-quant or --context.")
    mark(step, "done", expert_cache_slots=budget.expert_cache_slots)

    # 4. calibration, on the document in memory (a failed or interrupted calibration writes nothing)
    doc = build_doc(plan, target, drafter_art, head_art, budget, dgeo, source_target)
    previous = _read_previous(plan.config_path)
    reuse = _reusable_calibration(previous, doc)
    if reuse:
        doc["speculative"] = reuse[0]
        doc["calibration"] = reuse[1]
        kept = ((previous or {}).get("memory") or {}).get("routing_profile")
        if budget.offloaded and kept and Path(kept).is_file():
            doc["memory"]["routing_profile"] = kept
    if plan.compile_step:     # before calibrating: it measures the steps strata-run will run
        step = plan.compile_step
        mark(step, "start")
        why = may_fit(geo) or services.compile_steps(doc)
        mark(step, "skipped" if why else "done", **({"reason": why} if why else {}))
    calibrated: CalibrationResult | None = None
    profile_only = plan.drafter == "none" and budget.offloaded and plan.record_routing
    if (plan.calibrate and plan.drafter != "none") or profile_only:
        step = "record the routing profile" if profile_only else "calibrate"
        if reuse and not force_calibration and (not budget.offloaded or "routing_profile" in doc["memory"]):
            mark(step, "start")
            mark(step, "skipped", reason="a calibration with the same key is in the config")
        else:
            mark(step, "start")
            calibrated = services.calibrate(doc, force=force_calibration, max_seconds=max_calibration_seconds)
            apply_calibration(doc, calibrated)
            mark(step, "done", block=doc["speculative"]["block"], spec_min_p=doc["speculative"]["spec_min_p"],
                 routing_profile=doc["memory"].get("routing_profile"))

    # 5. config: written once, last, and recorded in the store's registry so gc keeps what it uses
    step = "write config"
    mark(step, "start")
    write_config(plan.config_path, doc)
    register_config(plan.config_path, strata_home())
    mark(step, "done", path=str(plan.config_path))
    return Result(config_path=plan.config_path, doc=doc, budget=budget, steps=steps, calibration=calibrated)


def _head_source_sha(folder: Path) -> str:
    st = Path(folder) / "model.safetensors"
    return sha256_file(st) if st.is_file() else ""


def _read_previous(path: Path) -> dict[str, Any] | None:
    import tomllib

    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return None


def _reusable_calibration(previous: Mapping[str, Any] | None, doc: Mapping[str, Any]):
    """The previous config's calibrated settings when its calibration key equals the one this run would use."""
    if not previous:
        return None
    cal = previous.get("calibration") or {}
    spec = previous.get("speculative") or {}
    if cal.get("status") != "calibrated" or spec.get("source") != "calibrated":
        return None
    if cal.get("key") != doc.get("calibration", {}).get("key"):
        return None
    return dict(spec), dict(cal)


def apply_calibration(doc: dict[str, Any], result: CalibrationResult) -> None:
    """Put the calibration's block and floor into `[speculative]` (with their provenance) and its record into
    `[calibration]`. A result without settings (nothing measured) leaves `[speculative]` as it was."""
    source = result.source if result.source in ("calibrated", "default", "user") else "calibrated"
    measured = result.block is not None and result.spec_min_p is not None
    if measured:
        doc["speculative"] = {"block": int(result.block), "spec_min_p": float(result.spec_min_p), "source": source}
        if result.draft_temp_scale is not None:       # how hot sampled drafts are drawn (docs/calibration.md)
            doc["speculative"]["draft_temp_scale"] = result.draft_temp_scale
    cal = tomlable(result.to_dict())
    if "key" not in cal and isinstance(doc.get("calibration"), Mapping) and "key" in doc["calibration"]:
        cal["key"] = doc["calibration"]["key"]
    none = (doc.get("drafter") or {}).get("kind", "none") == "none"
    cal["status"] = "calibrated" if measured and source == "calibrated" else ("not applicable" if none
                                                                              else "uncalibrated")
    doc["calibration"] = cal
    if result.routing_profile:        # the slots are placed by it from the next run on (runtime/experts.py)
        doc.setdefault("memory", {})["routing_profile"] = str(result.routing_profile)


def build_doc(plan: Plan, target: Artifact, drafter: Artifact | None, head: Artifact | None,
              budget: B.Budget, dgeo: DFlash2Geometry | None = None,
              source_target: Artifact | None = None) -> dict[str, Any]:
    """The schema-1 document (docs/INTERFACES.md "Config"). A converted target's `path` is its GGUF file, its
    `files` the GGUF files (relative to their folder) and `source_sha256`/`source_path` the checkpoint's."""
    hw = plan.hardware
    kind = KINDS[plan.drafter]   # uncalibrated: the kind's defaults (DFlash2: the head's own block_size)
    block, floor = kind.default_block(dgeo), kind.default_spec_min_p
    dtype = "bf16" if hw.device_type == "cuda" else "fp32"
    doc: dict[str, Any] = {
        "schema": 1,
        "created_by": f"strata-setup {__version__}",
        "target": {
            "name": plan.target.name,
            "source": plan.target.source,
            "path": str(Path(target.path).resolve()),
            "sha256": target.sha256,
            "revision": target.revision,
            "has_mtp": bool(plan.target.has_mtp) if plan.target.has_mtp is not None else None,
            "quantization": plan.target_quant,
            "files": target.files,
        },
        "drafter": {"kind": plan.drafter},
        "speculative": {"block": block, "spec_min_p": floor, "source": "default"},
        "memory": {
            "context": plan.context,
            "dtype": dtype,
            "kv_dtype": plan.kv_dtype or dtype,
            "reserve_mib": plan.reserve_mib,
            "prefill_chunk": plan.prefill_chunk,
            "expert_cache_slots": budget.expert_cache_slots,
            "total_experts": budget.total_experts,
            "expert_bytes": budget.expert_bytes,
            "budget": budget.table(),
        },
        "device": {
            "type": hw.device_type,
            "name": hw.device_name,
            "total_mib": hw.total_bytes // MIB,
            "free_mib": hw.free_bytes // MIB,
            "dtype": dtype,
        },
    }
    if source_target is not None:
        doc["target"]["source_sha256"] = source_target.sha256
        doc["target"]["source_path"] = str(Path(source_target.path).resolve())
    if hw.gpus:
        doc["device"]["capability"] = f"{hw.gpus[0].capability[0]}.{hw.gpus[0].capability[1]}"
    if hw.vram_limit_mib is not None:
        doc["device"]["vram_limit_mib"] = hw.vram_limit_mib
    if plan.drafter == "mtp":
        doc["drafter"].update({"path": doc["target"]["path"], "sha256": target.sha256})
    elif KINDS[plan.drafter].needs_file and drafter is not None:
        doc["drafter"].update({
            "head": plan.head.name if plan.head else None,
            "path": str(Path(drafter.path).resolve()),
            "sha256": drafter.sha256,
            "size": drafter.size,
            "quantization": plan.quant,
            "source_sha256": drafter.source_sha256 or (head.sha256 if head else None),
            "source_path": str(head.path) if head else None,
        })
    _record_mtimes(doc)
    doc["calibration"] = {"key": calibration_key_for(doc), "status": "uncalibrated"}
    if plan.drafter == "none":
        doc["calibration"]["status"] = "not applicable"
    return doc


def _record_mtimes(doc: dict[str, Any]) -> None:
    """Record each verified file's modification time: strata-run trusts an unchanged file by size and time and
    re-hashes one whose time moved (runtime/artifact_check.py)."""
    tpath = Path(doc["target"]["path"])
    if is_gguf_target(tpath):
        tpath = tpath.parent            # a GGUF target's files are named relative to its folder
    files = {rel: dict(meta) for rel, meta in (doc["target"].get("files") or {}).items()}
    for rel, meta in files.items():
        f = tpath / rel
        if f.is_file():
            meta["mtime_ns"] = f.stat().st_mtime_ns
    doc["target"]["files"] = files
    d = doc.get("drafter") or {}
    if KINDS[d.get("kind", "none")].needs_file and d.get("path") and Path(d["path"]).is_file():
        d["mtime_ns"] = Path(d["path"]).stat().st_mtime_ns


def calibration_key_for(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The calibration key (docs/calibration.md) of this config, for the device the config names."""
    dev = doc["device"]
    return key_for_config(dict(doc), device=(dev["name"], dev["total_mib"])).to_dict()


def budget_for_doc(doc: Mapping[str, Any], hw: Hardware, *, vram_limit_mib: int | None = None) -> B.Budget:
    """Recompute a written config's budget on this machine (for `strata-setup budget`), under `vram_limit_mib`
    or else the config's own `[device] vram_limit_mib`."""
    target = doc["target"]
    drafter = doc["drafter"]
    mem = doc["memory"]
    geo = target_geometry(Path(target["path"]))
    kind = drafter["kind"]
    dgeo = None
    if KINDS[kind].needs_file:
        src = drafter.get("source_path")
        dgeo = drafter_geometry(Path(src)) if src and Path(src).exists() else None
        dgeo = dgeo or drafter_geometry(Path(drafter["path"]))
        if dgeo is None:
            raise WorkError(f"The DFlash2 drafter {drafter.get('path')} cannot be read; rerun strata-setup.")
    dev_type = (doc.get("device") or {}).get("type")
    if dev_type == "cpu" and hw.gpus:
        hw = replace(hw, gpus=())  # the config runs on the CPU: budget against RAM
    elif dev_type == "cuda" and not hw.gpus:
        raise UsageError("The config is for a CUDA GPU but this machine has none usable; rerun strata-setup here.")
    limit = vram_limit_mib if vram_limit_mib is not None else (doc.get("device") or {}).get("vram_limit_mib")
    if limit is not None and hw.gpus:
        hw = hw.with_vram_limit(int(limit))
    plan = Plan(target=TargetOption(name=target.get("name", ""), source=target.get("source", "local")),
                drafter=kind, head=None, quant=drafter.get("quantization"), context=int(mem["context"]),
                reserve_mib=int(mem.get("reserve_mib", 0)), calibrate=False, offline=True,
                config_path=Path(), hardware=hw, target_quant=geo.quant)
    inputs = budget_inputs(plan, hw, plan.context, dgeo, dtype=mem.get("dtype"), kv_dtype=mem.get("kv_dtype"),
                           prefill_chunk=mem.get("prefill_chunk"))
    return B.compute_budget(geo, kind, inputs, dflash2=dgeo, quant=plan.quant or "bf16")
