"""Choices → one `Plan`: every unanswered choice filled with its recommendation (and why), the combination checked,
the budget computed when the model is already here. `setup_wizard/steps.py` carries the plan out."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from runtime import aoti
from runtime.drafters.dflash2.contract import DFlash2Geometry
from runtime.drafters.registry import KINDS
from runtime.errors import UsageError, one_of
from runtime.kv import Q8_BLOCK
from runtime.models.target_config import TargetGeometry
from runtime.paths import strata_home
from setup_wizard import budget as B
from setup_wizard import target_sizes as TS
from setup_wizard.choices import Choices
from setup_wizard.hardware import MIB, Hardware
from setup_wizard.inspection import drafter_geometry, is_gguf_target, target_geometry
from setup_wizard.services import HeadOption, Services, TargetOption


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
    prefill_chunk: int | None = None  # chosen with the budget on a GPU (None: the runtime's default)
    config_path_given: bool = True  # False: the default name, which follows the target quantization chosen later
    record_routing: bool = True  # offloaded experts: record the routing profile that places them (--no-calibrate: no)
    target_quant: str = "bf16"  # how the target is stored: bf16 (the folder as is), q8_0/q4_0 (converted to GGUF)
    target_quant_given: bool = True  # False: recommend it again once the model's geometry is known
    sizes: list[TS.SizeOption] = field(default_factory=list)  # the "Which size?" lines (with their budgets)
    kv_dtype: str = ""  # the target's KV cache: fp32 / bf16 / q8_0 ("": the compute dtype, until chosen)
    kv_dtype_given: bool = True  # False: recommend it again once the model's geometry is known

    @property
    def compute_dtype(self) -> str:
        """What the weights compute in here: bf16 on a GPU, fp32 on a CPU."""
        return "bf16" if self.hardware.device_type == "cuda" else "fp32"

    @property
    def target_is_gguf(self) -> bool:
        """The target is a GGUF file (named, or a GGUF catalog entry): used as it is stored (no conversion)."""
        return self.target.gguf or (self.target.local_path is not None and is_gguf_target(self.target.local_path))

    @property
    def converts_target(self) -> bool:
        return self.target_quant != "bf16" and not self.target_is_gguf

    def steps(self) -> list[str]:
        s = []
        if self.target.source != "local":
            s.append(f"download {self.target.name}" + (" (verified, here)" if self.target.available else ""))
        else:
            s.append(f"check and hash local target {self.target.local_path}")
        if self.converts_target:
            s.append(f"convert {self.target.name} → GGUF {self.target_quant}")
        if KINDS[self.drafter].needs_file and self.head and self.head.description == "local folder":
            s.append(f"use local DFlash2 head {self.head.local_path}")
        elif KINDS[self.drafter].needs_file and self.head:
            s.append(f"download {self.head.name}" + (" (verified, here)" if self.head.local_path else ""))
        if KINDS[self.drafter].needs_file and self.head:
            s.append(f"convert {self.head.name} → GGUF {self.quant}")
        s.append("budget memory and size the expert cache")
        offloaded = self.budget is not None and self.budget.offloaded
        if offloaded and self.record_routing:
            s.append("record the routing profile (which experts the GPU slots hold)")
        if self.compile_step:
            s.append(self.compile_step)
        if self.calibrate and self.drafter != "none":
            s.append("calibrate block and spec_min_p")
        s.append(f"write config {self.config_path}")
        return s

    @property
    def compile_step(self) -> str | None:
        """The step that builds the compiled CPU steps (runtime/target_compiled.py) before calibrating, so that
        calibration and the first run find them: a CPU setup with float target weights; None otherwise."""
        if self.hardware.device_type != "cpu" or not aoti.wanted() or self.target_quant != "bf16" \
                or self.target_is_gguf or self.kv_dtype == "q8_0":
            return None
        what = "the target's steps" + (" and the MTP drafter's" if self.drafter == "mtp" else "")
        return f"compile {what} for this CPU (once per machine; reused after)"

    def download_bytes(self) -> int:
        n = 0 if self.target.available else self.target.size_bytes
        if KINDS[self.drafter].needs_file and self.head and not self.head.local_path:
            n += self.head.size_bytes  # a local head folder downloads nothing
        return n

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target.name,
            "target_source": self.target.source,
            "target_quant": self.target_quant,
            "drafter": self.drafter,
            "dflash2_head": self.head.name if self.head else None,
            "dflash2_quant": self.quant,
            "context": self.context,
            "kv_dtype": self.kv_dtype or self.compute_dtype,
            "vram_reserve_mib": self.reserve_mib,
            "calibrate": self.calibrate,
            "offline": self.offline,
            "config_path": str(self.config_path),
            "steps": self.steps(),
            "download_bytes": self.download_bytes(),
            "device": self.hardware.to_dict(),
            "why": dict(self.why),
            "budget": self.budget.to_dict() if self.budget else None,
            "offload": self._offload(),
        }

    def _offload(self) -> dict[str, Any] | None:
        """Slots, expected hit rate (no profile yet: every expert alike) and decode estimate of an offloaded setup."""
        b = self.budget
        if b is None or not b.offloaded:
            return None
        hit = b.static_hit_rate()
        out: dict[str, Any] = {"slots": b.expert_cache_slots, "dynamic_slots": b.dynamic_slots,
                               "total_experts": b.total_experts, "expected_hit_rate": hit,
                               "hit_rate_source": "uniform (no routing profile yet)"}
        if self.hardware.links is not None:
            est = B.decode_estimate(b, hit, *self.hardware.links)
            out.update(decode_estimate_tok_s=est.tok_s, hbm_Bps=est.hbm_Bps, link_Bps=est.link_Bps)
        return out


def _is_local_path(value: str) -> bool:
    return value.startswith((".", "/", "~")) or os.sep in value or Path(value).expanduser().is_dir()


def resolve_target(value: str | None, options: list[TargetOption]) -> tuple[TargetOption, str]:
    explicit_path = value is not None and (value.startswith((".", "/", "~")) or os.sep in value)
    if value and not explicit_path and any(o.name == value for o in options):
        return next(o for o in options if o.name == value), "you chose it"
    if value and _is_local_path(value) and is_gguf_target(Path(value).expanduser()):
        p = Path(value).expanduser().resolve()
        return TargetOption(name=p.stem if p.stem != "model" else p.parent.name, source="local", local_path=p), \
            "a local GGUF file you named"
    if value and _is_local_path(value):
        p = Path(value).expanduser()
        if not (p / "config.json").is_file():
            raise UsageError(f"--target {value} is not a model folder (no config.json) or a .gguf file; pass a "
                             "catalog name, a Hugging Face model folder or a qwen3moe GGUF file.")
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
    if not target.pinned and target.local_path is None:
        how = f"pin it first with `strata-setup models add {target.repo}`, or choose" if target.repo else "choose"
        raise UsageError(f"The target {target.name} is listed but not pinned (no full revision and hashes), so it "
                         f"cannot be downloaded; {how} another target or a local folder.")
    geo: TargetGeometry | None = None
    if target.local_path is not None:
        geo = target_geometry(target.local_path)
        target = replace(target, has_mtp=geo.has_mtp)
    elif target.gguf and not choices.offline:   # a GGUF file not here yet: its header on the Hub says it exactly
        geo = services.remote_geometry(target.name)
    local_gguf = target.local_path is not None and is_gguf_target(target.local_path)
    if (local_gguf or target.gguf) and choices.target_quant:
        stored = geo.quant if geo is not None else target.quant
        what = "the GGUF file you named" if target.source == "local" else f"{target.name}, a GGUF file"
        if choices.target_quant != stored:
            raise UsageError(f"--target-quant {choices.target_quant} does not match {what}, which is stored as "
                             f"{stored or 'it was published'}; drop --target-quant"
                             + (" or convert the model again." if target.source == "local" else "."))

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
    if KINDS[drafter].needs_file:
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
            how = f"pin it first with `strata-setup models add {head.repo}`, or choose" if head.repo else "choose"
            raise UsageError(f"The DFlash2 head {head.name} is listed but not pinned (no full revision and "
                             f"hashes), so it cannot be downloaded; {how} another head.")
        quant = choices.dflash2_quant or "bf16"
        why["dflash2_quant"] = "you chose it" if choices.dflash2_quant else "original weights; Q8_0/Q4_0 save memory"
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
                offline=choices.offline, config_path=Path(), hardware=hw, why=why,
                record_routing=choices.calibrate is not False,
                kv_dtype=choices.kv_dtype or "")    # the sizes below are budgeted with the cache given
    why["calibrate"] = "you chose it" if choices.calibrate is not None else "measures the best block and floor here"
    if drafter == "none":
        plan.calibrate = False
        why["calibrate"] = "no drafter: nothing to calibrate"

    dgeo = drafter_geometry(head) if head and head.local_path else None
    if geo is not None and choices.context is not None and choices.context > geo.max_position:
        raise UsageError(f"--context {choices.context} is longer than the model's limit of {geo.max_position} "
                         "tokens; pass a smaller --context.")
    choose_target_quant(plan, geo, dgeo, given=choices.target_quant, context=choices.context)
    if choices.context is None:
        if geo is not None and (not KINDS[drafter].needs_file or dgeo is not None):
            plan.context, why["context"] = B.recommend_context(
                stored_geometry(plan, geo), drafter, budget_inputs(plan, hw, 0, dgeo), dflash2=dgeo,
                quant=quant or "bf16")
        else:
            plan.context, why["context"] = 4096, "a safe default until the model's size is known"
    else:
        why["context"] = "you chose it"
    plan.context_given = choices.context is not None
    choose_kv_dtype(plan, geo, dgeo, given=choices.kv_dtype)
    if geo is not None and (not KINDS[drafter].needs_file or dgeo is not None):
        plan.budget = compute(plan, geo, dgeo)
        plan.context_given = True  # the recommendation above already saw the geometry
    plan.config_path = Path(choices.config_out).expanduser() if choices.config_out else default_config_path(
        target.name, drafter, quant, plan.target_quant)
    plan.config_path_given = choices.config_out is not None
    for k, note in choices.notes.items():
        if why.get(k) == "you chose it":
            why[k] = note
    return plan


def stored_geometry(plan: Plan, geo: TargetGeometry) -> TargetGeometry:
    """The target's geometry as the runtime will hold it: a GGUF file as it is, a folder at the planned size."""
    if plan.target_is_gguf or geo.quant == plan.target_quant:
        return geo
    return geo.with_quant(plan.target_quant)


def size_options(plan: Plan, geo: TargetGeometry | None, dgeo: DFlash2Geometry | None,
                 context: int | None) -> list[TS.SizeOption]:
    """The "Which size?" lines: each size with its own budget at `context` (None: the context the budget recommends
    for that size), or estimates from the catalog's download size before the model is here."""
    hw = plan.hardware
    wb = 2 if hw.device_type == "cuda" else 4
    here = plan.target.available
    opts = []
    quants = TS.TARGET_QUANTS if conversion_problem(plan) is None else ("bf16",)
    for q in quants:
        p = replace(plan, target_quant=q, sizes=[])
        if geo is None or (KINDS[plan.drafter].needs_file and dgeo is None):
            opts.append(TS.option(q, None, None, context=context or 4096, wb=wb,
                                  checkpoint_bytes=plan.target.size_bytes, here=here,
                                  with_mtp=plan.drafter == "mtp"))
            continue
        p.context = context or B.recommend_context(stored_geometry(p, geo), plan.drafter,
                                                   budget_inputs(p, hw, 0, dgeo), dflash2=dgeo,
                                                   quant=plan.quant or "bf16")[0]
        opts.append(TS.option(q, geo, compute(p, geo, dgeo), context=p.context, wb=wb,
                              checkpoint_bytes=plan.target.size_bytes, here=here, with_mtp=plan.drafter == "mtp"))
    return opts


def conversion_problem(plan: Plan) -> str | None:
    """Why the target folder cannot become a Q8_0/Q4_0 GGUF (llama.cpp's qwen3moe layout: MoE layers only, rows
    a multiple of 32, a byte-level BPE tokenizer), or None. Unknown until the folder is here (None then)."""
    folder = plan.target.local_path
    if folder is None or plan.target_is_gguf:
        return None
    cfg = Path(folder) / "config.json"
    return _conversion_problem(str(folder), cfg.stat().st_mtime_ns if cfg.is_file() else 0)


@functools.lru_cache(maxsize=8)
def _conversion_problem(folder: str, _mtime: int) -> str | None:
    """(cached: the wizard plans several times; the check reads headers, the tokenizer and builds a meta model)"""
    from runtime.errors import StrataError, message
    from setup_wizard.convert_target import validate_source

    try:
        validate_source(Path(folder), "q4_0")
    except StrataError as exc:
        return message(exc).rstrip(".")
    return None


def choose_target_quant(plan: Plan, geo: TargetGeometry | None, dgeo: DFlash2Geometry | None, *,
                        given: str | None, context: int | None) -> None:
    """Fill `plan.target_quant` (and `plan.sizes`): a GGUF file's own, the user's, or the recommendation
    (setup_wizard/target_sizes.py). Before the download the recommendation is an estimate, made again once the
    model's config is here (`target_quant_given` False)."""
    if plan.target_is_gguf:
        plan.sizes = []
        if geo is not None:
            plan.target_quant, plan.target_quant_given = geo.quant, True
            plan.why["target_quant"] = ("the GGUF file you named is stored so" if plan.target.source == "local"
                                        else "the GGUF file is stored so")
        else:       # a GGUF entry not downloaded yet: as its entry records it, read again from the file once here
            plan.target_quant, plan.target_quant_given = plan.target.quant or "gguf", False
            plan.why["target_quant"] = "the GGUF file is stored so (read from its header when it was added)"
        return
    plan.sizes = size_options(plan, geo, dgeo, context)
    problem = conversion_problem(plan)
    if given and given != "bf16" and problem is not None:
        raise UsageError(f"--target-quant {given} is not possible for {plan.target.name}: {problem}")
    if problem is not None and not given:
        plan.target_quant, plan.why["target_quant"], plan.target_quant_given = "bf16", \
            f"the only size: it cannot be converted ({problem})", True
        return
    if given:
        plan.target_quant, plan.why["target_quant"], plan.target_quant_given = given, "you chose it", True
        return
    exact = bool(plan.sizes) and plan.sizes[0].exact
    if exact:
        plan.target_quant, plan.why["target_quant"] = TS.recommend(plan.sizes)
    elif plan.target.size_bytes:
        plan.target_quant, plan.why["target_quant"] = TS.recommend_estimated(plan.sizes, plan.hardware.free_bytes)
    else:
        plan.target_quant, plan.why["target_quant"] = "bf16", "the original weights until the model's size is known"
    plan.target_quant_given = exact


# what each KV cache format does to a run, as measured (docs/config.md, `kv_dtype`); shown beside the choice
KV_NOTES = {
    ("cuda", "bf16"): "the compute dtype: the fastest decode",
    ("cuda", "q8_0"): "half the cache's memory; decodes 5-31% slower than bf16 on an H200 (more the longer the "
                      "context)",
    ("cpu", "fp32"): "the compute dtype: output bit for bit as the model computes it",
    ("cpu", "bf16"): "half the cache's memory and faster at long contexts (1.35x at 3k tokens on the bundled pack); "
                     "greedy output leaves fp32's after some tokens",
    ("cpu", "q8_0"): "a quarter of fp32's memory; runs the uncompiled steps, so it decodes slower",
}


def kv_dtypes(plan: Plan) -> tuple[str, ...]:
    """The KV cache formats this device offers, the compute dtype first (a GPU computes in bf16: no fp32 cache)."""
    return ("bf16", "q8_0") if plan.hardware.device_type == "cuda" else ("fp32", "bf16", "q8_0")


def choose_kv_dtype(plan: Plan, geo: TargetGeometry | None, dgeo: DFlash2Geometry | None, *,
                    given: str | None) -> None:
    """Fill `plan.kv_dtype`: the user's, else the compute dtype, or q8_0 on a GPU where the compute dtype's cache
    does not fit at the planned context and q8_0's does (docs/budget.md). Before the model's geometry is known the
    choice is made again once it is (`kv_dtype_given` False)."""
    offered, device = kv_dtypes(plan), plan.hardware.device_type
    q8_ok = geo is None or geo.head_dim % Q8_BLOCK == 0
    if given:
        if given not in offered:
            raise UsageError(f"--kv-dtype {given} is not offered on a {'GPU' if device == 'cuda' else 'CPU'}, "
                             f"which computes in {plan.compute_dtype}; use --kv-dtype {one_of(offered)}.")
        if given == "q8_0" and not q8_ok:
            raise UsageError(f"--kv-dtype q8_0 needs a head size that is a multiple of {Q8_BLOCK}, and "
                             f"{plan.target.name} has {geo.head_dim}; use --kv-dtype {plan.compute_dtype}.")
        plan.kv_dtype, plan.why["kv_dtype"], plan.kv_dtype_given = given, "you chose it", True
        return
    plan.kv_dtype = plan.compute_dtype
    plan.why["kv_dtype"] = KV_NOTES[(device, plan.kv_dtype)]
    plan.kv_dtype_given = geo is not None and (not KINDS[plan.drafter].needs_file or dgeo is not None)
    if not plan.kv_dtype_given or device != "cuda" or not q8_ok or compute(plan, geo, dgeo).fits:
        return
    q8 = replace(plan, kv_dtype="q8_0", sizes=[])
    if compute(q8, geo, dgeo).fits:
        plan.kv_dtype = "q8_0"
        plan.why["kv_dtype"] = (f"a bf16 cache of {plan.context} tokens does not fit; q8_0 halves it (and decodes "
                                f"5-31% slower)")


def default_config_path(target: str, drafter: str, quant: str | None = None, target_quant: str = "bf16") -> Path:
    """`$STRATA_HOME/configs/<target>[-<target quant>]-<drafter>[-<drafter quant>].toml` (the model manager reads
    `$STRATA_HOME/configs/*.toml`): the quantizations are part of the name (the target's when it is converted), so a
    second setup of the same pair with another one gets its own config instead of silently replacing the first."""
    name = target + (f"-{target_quant}" if target_quant and target_quant != "bf16" else "") + f"-{drafter}"
    name += f"-{quant}" if quant else ""
    return strata_home() / "configs" / f"{name}.toml"


def budget_inputs(plan: Plan, hw: Hardware, context: int, dgeo: DFlash2Geometry | None, *,
                  dtype: str | None = None, kv_dtype: str | None = None,
                  prefill_chunk: int | None = None) -> B.BudgetInputs:
    """bf16 on CUDA, fp32 on CPU, unless a config says otherwise (`dtype`, `kv_dtype` incl. "q8_0",
    `prefill_chunk`); the plan's `kv_dtype` where no config names one."""
    kv_dtype = kv_dtype or plan.kv_dtype or None
    dtype_bytes = B.DTYPE_BYTES.get(dtype or "", 2 if hw.device_type == "cuda" else 4)
    kv_dtype_bytes = B.DTYPE_BYTES.get(kv_dtype or "", dtype_bytes)
    kv_quant = kv_dtype if kv_dtype in B.KV_QUANTS else None     # 8-bit target cache; the drafters' stay at dtype
    block = KINDS[plan.drafter].max_block(dgeo, None) if (dgeo is not None or not KINDS[plan.drafter].needs_file) else 1
    return B.BudgetInputs(context=context, block=block, device_type=hw.device_type,
                          available_bytes=hw.free_bytes, total_bytes=hw.total_bytes,
                          reserve_bytes=plan.reserve_mib * MIB, weight_bytes=dtype_bytes, kv_bytes=kv_dtype_bytes,
                          kv_quant=kv_quant, prefill_chunk=prefill_chunk)


# prompt tokens per prefill forward on a GPU, longest first: 8192 ran prefill 1.7x faster than 2048 on the H200
# (bench/results/h200_session3/prefill_chunks.json) and costs about 0.25 GiB more scratch on the A3B shape
GPU_PREFILL_CHUNKS = (8192, 2048)


def compute(plan: Plan, geo: TargetGeometry, dgeo: DFlash2Geometry | None) -> B.Budget:
    """The budget of the plan, the target at its planned size. On a GPU it also picks the prefill chunk
    (`plan.prefill_chunk`): the longest that still keeps every expert resident, else the shortest (an offloaded
    model keeps its slots for decode)."""
    chunks = GPU_PREFILL_CHUNKS if plan.hardware.device_type == "cuda" else (None,)
    for chunk in chunks:
        budget = B.compute_budget(stored_geometry(plan, geo), plan.drafter,
                                  budget_inputs(plan, plan.hardware, plan.context, dgeo, prefill_chunk=chunk),
                                  dflash2=dgeo, quant=plan.quant or "bf16")
        plan.prefill_chunk = chunk
        if budget.fits and budget.expert_cache_slots >= budget.total_experts:
            break
    return budget
