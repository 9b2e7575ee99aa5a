"""Plan → steps. Answers (flags, an answers file or the wizard) become one `Plan`; `execute` carries it out.

The other areas' functions (catalog, verified download, DFlash2 conversion, calibration) are reached only through
the `Services` seam below, so the plan can be tested with fakes and so the question layer never touches them.
Every step is idempotent: a verified download, a cached conversion or a calibration with a matching key is reused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from runtime.drafters.dflash2.contract import DFlash2Geometry
from runtime.drafters.registry import KINDS
from runtime.errors import ContractError, UsageError, WorkError
from runtime.formats.gguf_meta import read_metadata
from runtime.formats.registry import QTYPES
from runtime.formats.safetensors_files import inventory
from runtime.models.target_config import TargetGeometry
from runtime.version import __version__
from setup_wizard import budget as B
from setup_wizard.config import manifest_sha256, sha256_file, write_config
from setup_wizard.hardware import MIB, Hardware

QUANTS = QTYPES
DRAFTERS = tuple(KINDS)
TARGET_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                "model.safetensors.index.json")


class StepError(WorkError):
    """A step failed (network, checksum, conversion, does not fit): one sentence, exit code 1."""


def strata_home() -> Path:
    env = os.environ.get("STRATA_HOME")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_data_dir

    return Path(user_data_dir("strata"))


# ---------------------------------------------------------------------------------------------------------------
# The seam to the other areas


@dataclass(frozen=True)
class TargetOption:
    name: str
    source: str  # "bundled" | "hf" | "local"
    local_path: Path | None = None  # where it is when already here (bundled, downloaded or a local folder)
    pinned: bool = True
    size_bytes: int = 0
    has_mtp: bool | None = None
    description: str = ""

    @property
    def available(self) -> bool:
        return self.local_path is not None


@dataclass(frozen=True)
class HeadOption:
    name: str
    default: bool = False
    pinned: bool = True
    size_bytes: int = 0
    local_path: Path | None = None
    description: str = ""


@dataclass(frozen=True)
class Artifact:
    """A verified file or folder in the store with what the config records about it."""

    path: Path
    sha256: str
    size: int = 0
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # folder artifacts: rel path → sha256, size
    revision: str | None = None
    reused: bool = False  # True when nothing had to be fetched or built
    source_sha256: str | None = None  # converted artifacts: the sha256 of what they were converted from
    repo: str | None = None


class Services(Protocol):
    def targets(self) -> list[TargetOption]: ...
    def heads(self, target: str) -> list[HeadOption]: ...
    def fetch(self, name: str, *, offline: bool) -> Artifact: ...
    def convert(self, head_dir: Path, quant: str, *, source: Artifact) -> Artifact: ...
    def calibrate(self, config_path: Path, *, force: bool, max_seconds: float | None) -> dict[str, Any]: ...


# ---------------------------------------------------------------------------------------------------------------
# Reading a target folder without loading it


def safetensors_inventory(folder: Path) -> dict[str, int]:
    """Tensor name → element count, from the safetensors headers only (no weights read)."""
    return {name: ref.numel for name, ref in inventory(Path(folder), error=UsageError).items()}


def target_geometry(folder: Path) -> TargetGeometry:
    """The budget geometry of a target folder: config.json arithmetic, made exact by the tensor inventory."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise UsageError(f"{folder} has no config.json; point --target at a Hugging Face model folder.")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UsageError(f"{cfg_path} is not valid JSON; the target folder is damaged.") from None
    try:
        geo = TargetGeometry.from_config(cfg)
    except B.BudgetError as exc:
        raise UsageError(str(exc)) from None
    return geo.with_inventory(safetensors_inventory(folder))


def folder_files(folder: Path) -> list[str]:
    """The files of a target folder that matter to the runtime (config, tokenizer, weights)."""
    folder = Path(folder)
    names = [n for n in TARGET_FILES if (folder / n).is_file()]
    names += sorted(p.name for p in folder.glob("*.safetensors"))
    return names


def hash_folder(folder: Path, on_file: Callable[[str], None] | None = None) -> Artifact:
    """sha256 and size of every runtime file of a local target folder, and the manifest hash over them."""
    files = {}
    for rel in folder_files(folder):
        if on_file:
            on_file(rel)
        p = Path(folder) / rel
        files[rel] = {"sha256": sha256_file(p), "size": p.stat().st_size}
    return Artifact(path=Path(folder).resolve(), sha256=manifest_sha256(files), files=files,
                    size=sum(f["size"] for f in files.values()))


# ---------------------------------------------------------------------------------------------------------------
# Choices and the plan


@dataclass
class Choices:
    """What the user (or a script) said. None = take the recommendation."""

    target: str | None = None
    drafter: str | None = None
    dflash2_head: str | None = None
    dflash2_quant: str | None = None
    context: int | None = None
    vram_reserve_mib: int | None = None
    calibrate: bool | None = None
    offline: bool = False
    config_out: Path | None = None
    # why an answer was given, when the wizard's user took its recommendation (shown in the summary)
    notes: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        """The checks that need no machine or catalog (one sentence each)."""
        if self.drafter is not None and self.drafter not in DRAFTERS:
            raise UsageError(f"Unknown drafter '{self.drafter}'; use --drafter mtp, dflash2 or none.")
        if self.dflash2_quant is not None and self.dflash2_quant not in QUANTS:
            raise UsageError(f"Unknown DFlash2 quantization '{self.dflash2_quant}'; use --dflash2-quant "
                             "bf16, q8_0, q5_0 or q4_0.")
        if self.drafter in ("mtp", "none") and (self.dflash2_head or self.dflash2_quant):
            raise UsageError(f"--drafter {self.drafter} cannot be combined with --dflash2-head/--dflash2-quant; "
                             "pass --drafter dflash2 or drop the DFlash2 flags.")
        if self.context is not None and self.context <= 0:
            raise UsageError(f"--context must be a positive number of tokens, not {self.context}.")
        if self.vram_reserve_mib is not None and self.vram_reserve_mib < 0:
            raise UsageError(f"--vram-reserve-mib cannot be negative ({self.vram_reserve_mib}).")
        if self.config_out is not None:
            check_config_out(Path(self.config_out).expanduser())


def check_config_out(path: Path) -> None:
    """Refuse a --config-out that can never be written, before anything is downloaded or converted."""
    if path.is_dir():
        raise UsageError(f"--config-out {path} is a folder; pass a file path such as {path / 'strata.toml'}.")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--config-out {path} is not in a writable folder ({parent} is not one); "
                         f"pass a path you can write to.")


ANSWER_KEYS = {f: f for f in ("target", "drafter", "dflash2_head", "dflash2_quant", "context", "vram_reserve_mib",
                              "calibrate", "offline", "config_out")}


def load_answers(path: Path) -> Choices:
    """An answers file: TOML with the flag names as keys (`dflash2-quant` or `dflash2_quant`)."""
    import tomllib

    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"The answers file {path} does not exist; pass the path of a TOML answers file.") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"The answers file {path} is not valid TOML ({exc}).") from None
    except OSError as exc:
        raise UsageError(f"The answers file {path} cannot be read ({exc.strerror or exc}); pass a readable TOML "
                         f"file.") from None
    out = Choices()
    for key, value in raw.items():
        k = key.replace("-", "_")
        if k not in ANSWER_KEYS:
            raise UsageError(f"The answers file has an unknown key '{key}'; allowed: "
                             f"{', '.join(sorted(ANSWER_KEYS))}.")
        want = {"context": int, "vram_reserve_mib": int, "calibrate": bool, "offline": bool}.get(k, str)
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise UsageError(f"The answers file key '{key}' must be {want.__name__}, not {value!r}.")
        setattr(out, k, Path(value).expanduser() if k == "config_out" else value)
    return out


def merge_choices(base: Choices, override: Choices) -> Choices:
    """Flags win over the answers file."""
    out = replace(base)
    for k in ANSWER_KEYS:
        v = getattr(override, k)
        if v is not None and not (k == "offline" and v is False):
            setattr(out, k, v)
    return out


@dataclass
class Plan:
    """Everything decided; `execute` only carries it out."""

    target: TargetOption
    drafter: str
    head: HeadOption | None
    quant: str | None
    context: int
    reserve_mib: int
    calibrate: bool
    offline: bool
    config_path: Path
    hardware: Hardware
    why: dict[str, str] = field(default_factory=dict)  # answer → why it was recommended
    budget: B.Budget | None = None  # known when the target (and drafter geometry) is already here
    context_given: bool = True  # False: recommend it again once the model's geometry is known

    def steps(self) -> list[str]:
        s = []
        if self.target.source != "local":
            s.append(f"download {self.target.name}" + (" (verified, here)" if self.target.available else ""))
        else:
            s.append(f"hash local target {self.target.local_path}")
        if self.drafter == "dflash2" and self.head and self.head.description == "local folder":
            s.append(f"use local DFlash2 head {self.head.local_path}")
        elif self.drafter == "dflash2" and self.head:
            s.append(f"download {self.head.name}" + (" (verified, here)" if self.head.local_path else ""))
        if self.drafter == "dflash2" and self.head:
            s.append(f"convert {self.head.name} → GGUF {self.quant}")
        s.append("budget memory and size the expert cache")
        if self.calibrate and self.drafter != "none":
            s.append("calibrate block and spec_min_p")
        s.append(f"write config {self.config_path}")
        return s

    def download_bytes(self) -> int:
        n = 0 if self.target.available else self.target.size_bytes
        if self.drafter == "dflash2" and self.head and not self.head.local_path:
            n += self.head.size_bytes  # a local head folder downloads nothing
        return n

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target.name,
            "target_source": self.target.source,
            "drafter": self.drafter,
            "dflash2_head": self.head.name if self.head else None,
            "dflash2_quant": self.quant,
            "context": self.context,
            "vram_reserve_mib": self.reserve_mib,
            "calibrate": self.calibrate,
            "offline": self.offline,
            "config_path": str(self.config_path),
            "steps": self.steps(),
            "download_bytes": self.download_bytes(),
            "device": self.hardware.to_dict(),
            "why": dict(self.why),
            "budget": self.budget.to_dict() if self.budget else None,
        }


def _is_local_path(value: str) -> bool:
    return value.startswith((".", "/", "~")) or os.sep in value or Path(value).expanduser().is_dir()


def resolve_target(value: str | None, options: list[TargetOption]) -> tuple[TargetOption, str]:
    explicit_path = value is not None and (value.startswith((".", "/", "~")) or os.sep in value)
    if value and not explicit_path and any(o.name == value for o in options):
        return next(o for o in options if o.name == value), "you chose it"
    if value and _is_local_path(value):
        p = Path(value).expanduser()
        if not (p / "config.json").is_file():
            raise UsageError(f"--target {value} is not a model folder (no config.json); pass a catalog name or a "
                             "Hugging Face model folder.")
        p = p.resolve()
        return TargetOption(name=p.name, source="local", local_path=p), "a local folder you named"
    if value:
        for o in options:
            if o.name == value:
                return o, "you chose it"
        names = ", ".join(o.name for o in options) or "none"
        raise UsageError(f"Unknown target '{value}'; choose one of: {names} (or a local folder path).")
    if not options:
        raise UsageError("The catalog offers no target; pass --target with a local model folder.")
    return recommended_target(options)


def recommended_target(options: list[TargetOption]) -> tuple[TargetOption, str]:
    """A downloaded (non-bundled) target first, else the bundled pack (works offline), else the first pinned."""
    here = [o for o in options if o.available and o.source != "bundled"]
    if here:
        return here[0], "already downloaded and verified"
    bundled = [o for o in options if o.source == "bundled"]
    if bundled:
        return bundled[0], "ships with strata-setup, works offline"
    pinned = [o for o in options if o.pinned]
    return (pinned or options)[0], "the first pinned catalog entry"


def resolve(choices: Choices, hw: Hardware, services: Services) -> Plan:
    """Fill every unanswered choice with its recommendation and check the combination. UsageError on bad input."""
    choices.validate()
    target, why_t = resolve_target(choices.target, services.targets())
    why = {"target": why_t}
    geo: TargetGeometry | None = None
    if target.local_path is not None:
        geo = target_geometry(target.local_path)
        target = replace(target, has_mtp=geo.has_mtp)

    drafter = choices.drafter
    if drafter is None:
        if choices.dflash2_head or choices.dflash2_quant:
            drafter, why["drafter"] = "dflash2", "DFlash2 flags were given"
        elif target.has_mtp is not False:
            drafter, why["drafter"] = "mtp", "the target has an MTP head: the default, well-tested drafter"
        else:
            heads = services.heads(target.name) if target.source != "local" else []
            if heads:
                drafter, why["drafter"] = "dflash2", "the target has no MTP head; a DFlash2 head fits it"
            else:
                drafter, why["drafter"] = "none", "the target has no MTP head and no DFlash2 head fits it"
    else:
        why["drafter"] = "you chose it"
    if drafter == "mtp" and target.has_mtp is False:
        raise UsageError(f"The target {target.name} has no MTP head; pass --drafter dflash2 or --drafter none.")

    head: HeadOption | None = None
    quant: str | None = None
    if drafter == "dflash2":
        heads = services.heads(target.name)
        if choices.dflash2_head:
            if _is_local_path(choices.dflash2_head):
                hp = Path(choices.dflash2_head).expanduser().resolve()
                if not (hp / "config.json").is_file():
                    raise UsageError(f"--dflash2-head {choices.dflash2_head} is not a DFlash2 folder (no config.json).")
                head = HeadOption(name=hp.name, local_path=hp, description="local folder")
                why["dflash2_head"] = "a local folder you named"
            else:
                match = [h for h in heads if h.name == choices.dflash2_head]
                if not match:
                    names = ", ".join(h.name for h in heads) or "none"
                    raise UsageError(f"Unknown DFlash2 head '{choices.dflash2_head}' for {target.name}; "
                                     f"choose one of: {names}.")
                head, why["dflash2_head"] = match[0], "you chose it"
        else:
            if not heads:
                raise UsageError(f"No DFlash2 head in the catalog fits {target.name}; pass --dflash2-head with a "
                                 "local folder or choose --drafter mtp or none.")
            defaults = [h for h in heads if h.default]
            head = (defaults or heads)[0]
            why["dflash2_head"] = "the official head (catalog default)" if defaults else "the only head that fits"
        if not head.pinned and head.local_path is None:
            raise UsageError(f"The DFlash2 head {head.name} is listed but not pinned (no full revision and "
                             "hashes), so it cannot be downloaded; choose another head.")
        quant = choices.dflash2_quant or "bf16"
        why["dflash2_quant"] = "you chose it" if choices.dflash2_quant else "original weights; Q8_0/Q4_0 save memory"
    if not target.pinned and target.local_path is None:
        raise UsageError(f"The target {target.name} is listed but not pinned (no full revision and hashes), so it "
                         "cannot be downloaded; choose another target or a local folder.")
    if choices.offline and not target.available:
        raise UsageError(f"--offline was given but {target.name} is not downloaded yet; run without --offline "
                         f"once, or `strata-setup models pull {target.name}`.")

    reserve = choices.vram_reserve_mib
    if reserve is None:
        reserve = 512 if hw.device_type == "cuda" else 0
        why["vram_reserve_mib"] = ("room for other programs and the CUDA context" if reserve
                                   else "CPU only: nothing to keep back")
    else:
        why["vram_reserve_mib"] = "you chose it"
    if reserve * MIB >= hw.total_bytes:
        where = "GPU memory" if hw.device_type == "cuda" else "RAM"
        raise UsageError(f"--vram-reserve-mib {reserve} is larger than this machine's {where} "
                         f"({hw.total_bytes // MIB} MiB); pass a smaller reserve.")

    plan = Plan(target=target, drafter=drafter, head=head, quant=quant, context=choices.context or 0,
                reserve_mib=reserve, calibrate=True if choices.calibrate is None else choices.calibrate,
                offline=choices.offline, config_path=Path(), hardware=hw, why=why)
    why["calibrate"] = "you chose it" if choices.calibrate is not None else "measures the best block and floor here"
    if drafter == "none":
        plan.calibrate = False
        why["calibrate"] = "no drafter: nothing to calibrate"

    dgeo = drafter_geometry(head) if head and head.local_path else None
    if geo is not None and choices.context is not None and choices.context > geo.max_position:
        raise UsageError(f"--context {choices.context} is longer than the model's limit of {geo.max_position} "
                         "tokens; pass a smaller --context.")
    if choices.context is None:
        if geo is not None and (drafter != "dflash2" or dgeo is not None):
            plan.context, why["context"] = B.recommend_context(
                geo, drafter, budget_inputs(plan, hw, 0, dgeo), dflash2=dgeo, quant=quant or "bf16")
        else:
            plan.context, why["context"] = 4096, "a safe default until the model's size is known"
    else:
        why["context"] = "you chose it"
    plan.context_given = choices.context is not None
    if geo is not None and (drafter != "dflash2" or dgeo is not None):
        plan.budget = compute(plan, geo, dgeo)
        plan.context_given = True  # the recommendation above already saw the geometry
    plan.config_path = Path(choices.config_out).expanduser() if choices.config_out else default_config_path(
        target.name, drafter, quant)
    for k, note in choices.notes.items():
        if why.get(k) == "you chose it":
            why[k] = note
    return plan


def default_config_path(target: str, drafter: str, quant: str | None = None) -> Path:
    """`$STRATA_HOME/configs/<target>-<drafter>.toml` (the model manager reads `$STRATA_HOME/configs/*.toml`)."""
    return strata_home() / "configs" / f"{target}-{drafter}.toml"


def drafter_geometry(head: HeadOption | Artifact | Path | None) -> DFlash2Geometry | None:
    path = head if isinstance(head, Path) else getattr(head, "local_path", None) or getattr(head, "path", None)
    if path is None:
        return None
    path = Path(path)
    cfg = path / "config.json" if path.is_dir() else path
    if cfg.suffix == ".json" and cfg.is_file():
        try:
            return DFlash2Geometry.from_config(json.loads(cfg.read_text()))
        except (json.JSONDecodeError, ContractError) as exc:
            raise StepError(f"The DFlash2 config {cfg} cannot be read ({exc}).") from None
    if path.suffix == ".gguf" and path.is_file():
        return DFlash2Geometry.from_gguf_metadata(read_metadata(path, error=StepError))
    return None


def budget_inputs(plan: Plan, hw: Hardware, context: int, dgeo: DFlash2Geometry | None, *,
                  dtype: str | None = None, kv_dtype: str | None = None,
                  prefill_chunk: int | None = None) -> B.BudgetInputs:
    """bf16 on CUDA, fp32 on CPU, unless a config says otherwise (`dtype`, `kv_dtype` incl. "q8_0",
    `prefill_chunk`)."""
    dtype_bytes = B.DTYPE_BYTES.get(dtype or "", 2 if hw.device_type == "cuda" else 4)
    kv_dtype_bytes = B.DTYPE_BYTES.get(kv_dtype or "", dtype_bytes)
    kv_quant = kv_dtype if kv_dtype in B.KV_QUANTS else None     # 8-bit target cache; the drafters' stay at dtype
    block = KINDS[plan.drafter].max_block(dgeo, None) if (dgeo is not None or plan.drafter != "dflash2") else 1
    return B.BudgetInputs(context=context, block=block, device_type=hw.device_type,
                          available_bytes=hw.free_bytes, total_bytes=hw.total_bytes,
                          reserve_bytes=plan.reserve_mib * MIB, weight_bytes=dtype_bytes, kv_bytes=kv_dtype_bytes,
                          kv_quant=kv_quant, prefill_chunk=prefill_chunk)


def compute(plan: Plan, geo: TargetGeometry, dgeo: DFlash2Geometry | None) -> B.Budget:
    return B.compute_budget(geo, plan.drafter, budget_inputs(plan, plan.hardware, plan.context, dgeo),
                            dflash2=dgeo, quant=plan.quant or "bf16")


# ---------------------------------------------------------------------------------------------------------------
# Execution


@dataclass
class Result:
    config_path: Path
    doc: dict[str, Any]
    budget: B.Budget
    steps: list[dict[str, Any]]

    def run_command(self, prompt: str = "Hello") -> str:
        import shlex

        return f"strata-run --config {shlex.quote(str(self.config_path))} --prompt {shlex.quote(prompt)}"


Reporter = Callable[[str, str], None]  # (step, status) status in start|done|skipped


def execute(plan: Plan, services: Services, *, report: Reporter | None = None, force_calibration: bool = False,
            max_calibration_seconds: float | None = None) -> Result:
    """Run the steps in order. An interruption leaves only complete, verified results behind (each step writes
    atomically), so a rerun resumes where this one stopped."""
    say = report or (lambda step, status: None)
    steps: list[dict[str, Any]] = []

    def mark(step: str, status: str, **extra: Any) -> None:
        say(step, status)
        if status != "start":
            steps.append({"step": step, "status": status, **extra})

    # 1. target
    if plan.target.source == "local":
        step = "hash target"
        mark(step, "start")
        target = hash_folder(plan.target.local_path)  # type: ignore[arg-type]
        mark(step, "done", path=str(target.path))
    else:
        step = f"download {plan.target.name}"
        mark(step, "start")
        target = services.fetch(plan.target.name, offline=plan.offline)
        mark(step, "skipped" if target.reused else "done", path=str(target.path))
    geo = target_geometry(target.path)
    if plan.drafter == "mtp" and not geo.has_mtp:
        raise StepError(f"The target {plan.target.name} has no MTP head (no mtp.* tensors); rerun with "
                        "--drafter dflash2 or none.")

    # 2. drafter
    drafter_art: Artifact | None = None
    head_art: Artifact | None = None
    dgeo: DFlash2Geometry | None = None
    if plan.drafter == "dflash2":
        assert plan.head is not None and plan.quant is not None
        if plan.head.local_path is not None and plan.head.description == "local folder":
            head_art = Artifact(path=plan.head.local_path, sha256=_head_source_sha(plan.head.local_path),
                                reused=True)
        else:
            step = f"download {plan.head.name}"
            mark(step, "start")
            head_art = services.fetch(plan.head.name, offline=plan.offline)
            mark(step, "skipped" if head_art.reused else "done", path=str(head_art.path))
        step = f"convert {plan.head.name} to {plan.quant}"
        mark(step, "start")
        drafter_art = services.convert(head_art.path, plan.quant, source=head_art)
        mark(step, "skipped" if drafter_art.reused else "done", path=str(drafter_art.path))
        dgeo = drafter_geometry(head_art.path) or drafter_geometry(drafter_art.path)

    # 3. budget (the context is recommended now if it could not be before the download)
    step = "budget"
    mark(step, "start")
    if not plan.context_given:
        plan.context, plan.why["context"] = B.recommend_context(
            geo, plan.drafter, budget_inputs(plan, plan.hardware, 0, dgeo), dflash2=dgeo, quant=plan.quant or "bf16")
    elif plan.context > geo.max_position:
        raise UsageError(f"--context {plan.context} is longer than the model's limit of {geo.max_position} tokens; "
                         "pass a smaller --context.")
    budget = compute(plan, geo, dgeo)
    if not budget.fits:
        raise StepError(budget.reason)
    mark(step, "done", expert_cache_slots=budget.expert_cache_slots)

    # 4. config (written before calibration so calibration reads it; rewritten with the results after)
    doc = build_doc(plan, target, drafter_art, head_art, budget, dgeo)
    previous = _read_previous(plan.config_path)
    reuse = _reusable_calibration(previous, doc)
    if reuse:
        doc["speculative"] = reuse[0]
        doc["calibration"] = reuse[1]
    step = "write config"
    mark(step, "start")
    write_config(plan.config_path, doc)
    mark(step, "done", path=str(plan.config_path))

    # 5. calibration
    if plan.calibrate and plan.drafter != "none":
        step = "calibrate"
        if reuse and not force_calibration:
            mark(step, "start")
            mark(step, "skipped", reason="a calibration with the same key is in the config")
        else:
            mark(step, "start")
            results = services.calibrate(plan.config_path, force=force_calibration,
                                         max_seconds=max_calibration_seconds)
            apply_calibration(doc, results)
            write_config(plan.config_path, doc)
            mark(step, "done", block=doc["speculative"]["block"], spec_min_p=doc["speculative"]["spec_min_p"])
    return Result(config_path=plan.config_path, doc=doc, budget=budget, steps=steps)


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


def apply_calibration(doc: dict[str, Any], results: Mapping[str, Any]) -> None:
    """Put the calibration's block and floor into `[speculative]` (with their provenance) and its record, as the
    calibration area returns it (`calibrate.api.calibrate_config`: block, spec_min_p, source, decision, key, ...),
    into `[calibration]`. A result without settings (nothing measured) leaves `[speculative]` as it was."""
    settings = results.get("settings") if isinstance(results.get("settings"), Mapping) else results
    block = settings.get("block")
    floor = settings.get("spec_min_p")
    source = str(results.get("source") or "calibrated")
    if source not in ("calibrated", "default", "user"):
        source = "calibrated"
    if block is not None and floor is not None:
        doc["speculative"] = {"block": int(block), "spec_min_p": float(floor), "source": source}
    cal = _tomlable(dict(results))
    if "key" not in cal and isinstance(doc.get("calibration"), Mapping) and "key" in doc["calibration"]:
        cal["key"] = doc["calibration"]["key"]
    cal["status"] = "calibrated" if block is not None and source == "calibrated" else "uncalibrated"
    doc["calibration"] = cal


def _tomlable(value: Any) -> Any:
    """TOML has no null and needs string keys: drop None, stringify keys."""
    if isinstance(value, Mapping):
        return {str(k): _tomlable(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_tomlable(v) for v in value if v is not None]
    if isinstance(value, Path):
        return str(value)
    return value


def build_doc(plan: Plan, target: Artifact, drafter: Artifact | None, head: Artifact | None,
              budget: B.Budget, dgeo: DFlash2Geometry | None = None) -> dict[str, Any]:
    """The schema-1 document (docs/INTERFACES.md "Config")."""
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
            "files": target.files,
        },
        "drafter": {"kind": plan.drafter},
        "speculative": {"block": block, "spec_min_p": floor, "source": "default"},
        "memory": {
            "context": plan.context,
            "dtype": dtype,
            "kv_dtype": dtype,
            "reserve_mib": plan.reserve_mib,
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
    if hw.gpus:
        doc["device"]["capability"] = f"{hw.gpus[0].capability[0]}.{hw.gpus[0].capability[1]}"
    if plan.drafter == "mtp":
        doc["drafter"].update({"path": doc["target"]["path"], "sha256": target.sha256})
    elif plan.drafter == "dflash2" and drafter is not None:
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
    files = {rel: dict(meta) for rel, meta in (doc["target"].get("files") or {}).items()}
    for rel, meta in files.items():
        f = tpath / rel
        if f.is_file():
            meta["mtime_ns"] = f.stat().st_mtime_ns
    doc["target"]["files"] = files
    d = doc.get("drafter") or {}
    if d.get("kind") == "dflash2" and d.get("path") and Path(d["path"]).is_file():
        d["mtime_ns"] = Path(d["path"]).stat().st_mtime_ns


def calibration_key_for(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The calibration key of PRODUCT.md for this config (the calibration area's own function when present)."""
    try:
        from calibrate.key import key_for_config

        dev = doc["device"]
        return key_for_config(dict(doc), device=(dev["name"], dev["total_mib"])).to_dict()
    except ImportError:  # pragma: no cover - the calibration area ships with the package
        d = doc["drafter"]
        return {
            "device_name": doc["device"]["name"], "device_total_mib": doc["device"]["total_mib"],
            "target_sha256": doc["target"]["sha256"], "drafter_kind": d["kind"],
            "drafter_sha256": d.get("sha256", ""), "quantization": d.get("quantization", ""),
            "context": doc["memory"]["context"], "runtime_version": __version__,
        }


def budget_for_doc(doc: Mapping[str, Any], hw: Hardware) -> B.Budget:
    """Recompute a written config's budget on this machine (for `strata-setup budget`)."""
    target = doc["target"]
    drafter = doc["drafter"]
    mem = doc["memory"]
    geo = target_geometry(Path(target["path"]))
    kind = drafter["kind"]
    dgeo = None
    if kind == "dflash2":
        src = drafter.get("source_path")
        dgeo = drafter_geometry(Path(src)) if src and Path(src).exists() else None
        dgeo = dgeo or drafter_geometry(Path(drafter["path"]))
        if dgeo is None:
            raise StepError(f"The DFlash2 drafter {drafter.get('path')} cannot be read; rerun strata-setup.")
    dev_type = (doc.get("device") or {}).get("type")
    if dev_type == "cpu" and hw.gpus:
        hw = replace(hw, gpus=())  # the config runs on the CPU: budget against RAM
    elif dev_type == "cuda" and not hw.gpus:
        raise UsageError("The config is for a CUDA GPU but this machine has none usable; rerun strata-setup here.")
    plan = Plan(target=TargetOption(name=target.get("name", ""), source=target.get("source", "local")),
                drafter=kind, head=None, quant=drafter.get("quantization"), context=int(mem["context"]),
                reserve_mib=int(mem.get("reserve_mib", 0)), calibrate=False, offline=True,
                config_path=Path(), hardware=hw)
    inputs = budget_inputs(plan, hw, plan.context, dgeo, dtype=mem.get("dtype"), kv_dtype=mem.get("kv_dtype"),
                           prefill_chunk=mem.get("prefill_chunk"))
    return B.compute_budget(geo, kind, inputs, dflash2=dgeo, quant=plan.quant or "bf16")


# ---------------------------------------------------------------------------------------------------------------
# The real services: the artifact and calibration areas' functions, imported when called


class RealServices:
    """Catalog, verified download, conversion and calibration, by the areas that own them. `console` is where
    their progress bars go (stderr under --json)."""

    def __init__(self, console: Any = None, progress: bool = True) -> None:
        self.console = console
        self.progress = progress

    def targets(self) -> list[TargetOption]:
        cat = _optional("setup_wizard.catalog")
        if cat is None:
            return []
        return _catalog_targets(cat)

    def heads(self, target: str) -> list[HeadOption]:
        cat = _optional("setup_wizard.catalog")
        if cat is None:
            return []
        return _catalog_heads(cat, target)

    def fetch(self, name: str, *, offline: bool) -> Artifact:
        hub = _optional("setup_wizard.hub")
        if hub is None:
            raise StepError("Downloading catalog models is not available in this build; pass --target with a "
                            "local model folder.")
        pulled = hub.pull(name, offline=True if offline else None, console=self.console, progress=self.progress)
        cat = _optional("setup_wizard.catalog")
        repo = cat.load_catalog().get(name).repo if cat is not None else None    # recorded in the GGUF
        return Artifact(path=Path(pulled.path), sha256=pulled.sha256, size=pulled.size, files=dict(pulled.files),
                        revision=pulled.revision, reused=pulled.reused, repo=repo)

    def convert(self, head_dir: Path, quant: str, *, source: Artifact) -> Artifact:
        conv = _optional("setup_wizard.convert")
        if conv is None:
            raise StepError("The DFlash2 converter is not available in this build; choose --drafter mtp or none.")
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn(f"convert → {quant}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                      TimeElapsedColumn(), console=self.console, transient=True, disable=not self.progress) as bar:
            task = bar.add_task("", total=None)

            def on_tensor(name: str, i: int, n: int) -> None:
                bar.update(task, completed=i, total=n, description=name)

            res = conv.convert_to_store(head_dir, quant, source_repo=source.repo or "",
                                        source_revision=source.revision or "", on_tensor=on_tensor)
        return Artifact(path=Path(res.path), sha256=res.sha256, size=res.size, reused=res.reused,
                        source_sha256=res.source_sha256)

    def calibrate(self, config_path: Path, *, force: bool, max_seconds: float | None) -> dict[str, Any]:
        api = _optional("calibrate.api")
        if api is None:
            raise StepError("Calibration is not available in this build; rerun with --no-calibrate.")
        return api.calibrate_config(config_path, force=force, max_seconds=max_seconds, progress=self.progress)


def _optional(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return None
        raise


def _local_copy(entry) -> Path | None:
    """Where a catalog entry already is: the store's verified copy (by pinned revision), or the bundled folder
    shipped with the package (the download step copies and verifies it into the store)."""
    hub = _optional("setup_wizard.hub")
    if hub is not None and entry.pinned:
        try:
            pulled = hub.verified_entry(entry)
        except Exception:  # a store that cannot answer means "not here"; the download step will say why
            pulled = None
        if pulled is not None:
            return Path(pulled.path)
    if entry.source == "bundled" and entry.repo:
        from setup_wizard.catalog import bundled_root, safe_join

        folder = safe_join(bundled_root(), entry.repo, f"catalog entry {entry.name!r} repo")
        if folder.is_dir() and all((folder / f.path).is_file() for f in entry.files):
            return folder
    return None


def _catalog_targets(cat) -> list[TargetOption]:
    out = []
    for e in cat.load_catalog().targets():
        out.append(TargetOption(name=e.name, source=e.source, local_path=_local_copy(e), pinned=e.pinned,
                                size_bytes=e.size, has_mtp=e.mtp, description=e.description))
    return out


def _catalog_heads(cat, target: str) -> list[HeadOption]:
    out = []
    for e in cat.load_catalog().heads(target):
        out.append(HeadOption(name=e.name, default=e.default, pinned=e.pinned, size_bytes=e.size,
                              local_path=_local_copy(e), description=e.description))
    return out


