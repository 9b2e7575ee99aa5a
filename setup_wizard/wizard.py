"""The interactive questions (questionary) → `Choices`, and the summary the user confirms.

Only asks and calls: every answer lands in `Choices`, and `resolve` makes the recommendations, so
the scripted path (`--yes`, `--answers`) and this one produce the same plan. Questions already answered by a
flag are not asked. `input`/`output` are passed through to prompt_toolkit so tests can drive the flow.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import questionary
from rich.console import Console
from rich.table import Table

from runtime.drafters.registry import KINDS
from runtime.errors import UsageError
from runtime.formats.registry import FORMATS
from setup_wizard.budget import MIB, Budget
from setup_wizard.choices import Choices
from setup_wizard.hardware import Hardware
from setup_wizard.inspection import target_geometry
from setup_wizard.plan import KV_NOTES, Plan, kv_dtypes, recommended_target, resolve
from setup_wizard.services import Services

LOCAL = "__local__"
HUB = "__hub__"                    # "A model from the Hugging Face Hub…": a repository id typed in
SUGGESTED = "__hub__:"             # + a catalog name: an unpinned suggestion, pinned from its repository now
_REPO_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$"
RECOMMENDED_QUANT = "bf16"
QUANT_LABELS = {q: f.label + (" (recommended)" if q == RECOMMENDED_QUANT else "") for q, f in FORMATS.items()}


def _ask(question: questionary.Question) -> Any:
    """unsafe_ask: Ctrl-C raises KeyboardInterrupt (the caller writes nothing and exits)."""
    return question.unsafe_ask()


def _size(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    return f"{n / MIB:.1f} MiB"


def ask(choices: Choices, hw: Hardware, services: Services, *, input: Any = None,
        output: Any = None) -> Choices:
    """Ask what the flags left open, in this order: target, drafter, DFlash2 head and quantization, size, context,
    KV cache (long contexts only), reserve, calibration. Returns the completed choices (Ctrl-C raises KeyboardInterrupt)."""
    io = {"input": input, "output": output}
    ans = replace(choices)

    if ans.target is None:
        ans.target = _ask_target(ans, services, io)

    # what the plan would recommend from here on (also validates the target); a DFlash2 setup whose head is still to
    # be chosen (perhaps added from the Hub below) is probed without it
    probe = ans
    if not ans.dflash2_head and (ans.dflash2_quant or (ans.drafter and KINDS[ans.drafter].needs_file)):
        probe = replace(ans, drafter="none", dflash2_quant=None)
    draft = resolve(replace(probe), hw, services)
    target = draft.target
    heads = services.heads(target.name) if target.source != "local" else []

    if ans.drafter is None and not (ans.dflash2_head or ans.dflash2_quant):
        def why_not(kind) -> str | None:
            if kind.name == "mtp" and target.has_mtp is False:
                return "this target has no MTP head"
            if kind.needs_file and not heads and target.source == "local":
                return f"no {kind.name} head fits this target"
            return None     # without a head in the catalog, one can be added from the Hub

        items = [questionary.Choice(k.label, value=k.name, disabled=why_not(k)) for k in KINDS.values()]
        ans.drafter = _ask(questionary.select(
            "Which speculative drafter?", choices=items, default=draft.drafter,
            instruction=f"(recommended: {draft.drafter} — {draft.why.get('drafter', '')})", **io))
        _note(ans, "drafter", ans.drafter == draft.drafter, draft.why)
    elif ans.drafter is None:
        ans.drafter = "dflash2"

    if KINDS[ans.drafter].needs_file:
        if ans.dflash2_head is None:
            if not heads and target.source == "local":
                raise UsageError(f"No DFlash2 head in the catalog fits {target.name}; pass --dflash2-head with a "
                                 "local folder.")
            ans.dflash2_head = _ask_head(ans, target.name, heads, services, io)
        if ans.dflash2_quant is None:
            items = [questionary.Choice(QUANT_LABELS[q], value=q) for q, f in FORMATS.items() if f.offered]
            more = [q for q, f in FORMATS.items() if not f.offered and f.writable]
            ans.dflash2_quant = _ask(questionary.select(
                "DFlash2 weight format (converted locally to GGUF)?", choices=items, default=RECOMMENDED_QUANT,
                instruction=f"({', '.join(m.upper() for m in more)} available with --dflash2-quant)" if more else None,
                **io))
            if ans.dflash2_quant == RECOMMENDED_QUANT:
                ans.notes["dflash2_quant"] = "original weights; Q8_0/Q4_0 save memory"

    if ans.target_quant is None:
        rec = resolve(ans, hw, services)
        if not rec.target_is_gguf and len(rec.sizes) > 1:     # one possible size: nothing to ask
            items = [questionary.Choice(o.line(recommended=o.quant == rec.target_quant), value=o.quant)
                     for o in rec.sizes]
            ans.target_quant = _ask(questionary.select(
                "Which size?", choices=items, default=rec.target_quant,
                instruction=f"(recommended: {rec.target_quant} — {rec.why.get('target_quant', '')})", **io))
            _note(ans, "target_quant", ans.target_quant == rec.target_quant, rec.why)

    if ans.context is None:
        rec = resolve(ans, hw, services)  # recommended with the default (or given) reserve
        limit = _model_limit(rec)
        text = _ask(questionary.text(
            "Context length in tokens?", default=str(rec.context),
            instruction=f"(recommended {rec.context}: {rec.why.get('context', '')})",
            validate=lambda s: _valid_int(s, 1, limit), **io))
        ans.context = int(text)
        _note(ans, "context", ans.context == rec.context, rec.why)
    if ans.kv_dtype is None:
        rec = resolve(ans, hw, services)
        if kv_question_wanted(rec):
            dev = hw.device_type
            items = [questionary.Choice(f"{k}  — {KV_NOTES[(dev, k)]}", value=k) for k in kv_dtypes(rec)]
            ans.kv_dtype = _ask(questionary.select(
                "KV cache format?", choices=items, default=rec.kv_dtype,
                instruction=f"(recommended: {rec.kv_dtype} — {rec.why.get('kv_dtype', '')})", **io))
            _note(ans, "kv_dtype", ans.kv_dtype == rec.kv_dtype, rec.why)
    if ans.vram_reserve_mib is None:
        rec = resolve(ans, hw, services)
        where = "GPU memory" if hw.device_type == "cuda" else "RAM"
        text = _ask(questionary.text(
            f"Memory to keep free for other programs, in MiB ({where})?", default=str(rec.reserve_mib),
            instruction=f"(recommended {rec.reserve_mib}: {rec.why.get('vram_reserve_mib', '')})",
            validate=lambda s: _valid_int(s, 0, hw.total_bytes // MIB - 1), **io))
        ans.vram_reserve_mib = int(text)
        _note(ans, "vram_reserve_mib", ans.vram_reserve_mib == rec.reserve_mib, rec.why)

    if ans.calibrate is None:
        if ans.drafter == "none":
            ans.calibrate = False
        else:
            ans.calibrate = bool(_ask(questionary.confirm(
                "Calibrate the block size and confidence floor on this machine now? (takes a minute or two)",
                default=True, **io)))
            if ans.calibrate:
                ans.notes["calibrate"] = "measures the best block and floor here"
    return ans


def _ask_target(ans: Choices, services: Services, io: dict[str, Any]) -> str:
    """The target question: what is here, the bundled pack, what can be downloaded, suggestions that can be pinned
    from the Hub now, a local folder, or any Hub repository typed in. Asked again when an addition is declined."""
    while True:
        options = services.targets()
        rec, why = recommended_target(options) if options else (None, "")
        items = []
        # what is here first, then the bundled pack, then what can be downloaded; unpinned entries last
        options = sorted(options, key=lambda o: (not (o.available and o.source != "bundled"),
                                                 o.source != "bundled", not o.pinned))
        for o in options:
            state = "here" if o.available else (f"download {_size(o.size_bytes)}" if o.size_bytes else "download")
            value = o.name
            if not o.pinned and not o.available:
                state = "suggestion: pin it from the Hub now" if o.repo else "not pinned: cannot download"
                value = SUGGESTED + o.name if o.repo else o.name
            label = f"{o.name}  ({o.source}, {state})" + (f" — {o.description}" if o.description else "")
            items.append(questionary.Choice(label, value=value, disabled=None if (o.pinned or o.available or o.repo)
                                            else "not pinned"))
        items.append(questionary.Choice("A local model folder…", value=LOCAL))
        items.append(questionary.Choice("A model from the Hugging Face Hub (org/name)…", value=HUB))
        default = rec.name if rec and (rec.pinned or rec.available) else LOCAL
        picked = _ask(questionary.select(
            "Which model do you want to run?", choices=items, default=default,
            instruction=f"(recommended: {default} — {why})" if default != LOCAL else None, **io))
        if picked == default and rec is not None and picked != LOCAL:
            ans.notes["target"] = why
        if picked == LOCAL:
            picked = _ask(questionary.path(
                "Folder with config.json, safetensors and tokenizer.json:", only_directories=True,
                validate=lambda s: (Path(s).expanduser() / "config.json").is_file() or "No config.json there.",
                **io))
            return str(Path(picked).expanduser().resolve())
        if picked == HUB or picked.startswith(SUGGESTED):
            added = _add_from_hub(services, picked, options, "target", io)
            if added is None:
                continue
            ans.notes["target"] = "pinned from the Hub just now"
            return added
        return picked


def _ask_head(ans: Choices, target: str, heads: list, services: Services, io: dict[str, Any]) -> str:
    """The DFlash2 head question: the heads that fit, suggestions to pin from the Hub, or a Hub repository."""
    while True:
        default_head = next((h.name for h in heads if h.default), heads[0].name if heads else None)
        default = HUB
        items = []
        for h in heads:
            label = f"{h.name}" + (" (official, default)" if h.default else "") + (
                f" — {h.description}" if h.description else "")
            value = h.name
            disabled = None
            if not h.pinned and not h.local_path:
                if h.repo:
                    label, value = f"{label}  (suggestion: pin it from the Hub now)", SUGGESTED + h.name
                else:
                    disabled = "not pinned"
            if h.name == default_head and disabled is None:
                default = value
            items.append(questionary.Choice(label, value=value, disabled=disabled))
        items.append(questionary.Choice("A DFlash head from the Hugging Face Hub (org/name)…", value=HUB))
        picked = _ask(questionary.select(
            "Which DFlash2 head?", choices=items, default=default,
            instruction="(recommended: the official head)" if heads else None, **io))
        if picked == HUB or picked.startswith(SUGGESTED):
            added = _add_from_hub(services, picked, heads, "head", io, target=target)
            if added is None:
                heads = services.heads(target)
                continue
            ans.notes["dflash2_head"] = "pinned from the Hub just now"
            return added
        if picked == default_head:
            ans.notes["dflash2_head"] = "the official head (catalog default)"
        return picked


def _add_from_hub(services: Services, picked: str, options: list, kind: str, io: dict[str, Any], *,
                  target: str | None = None) -> str | None:
    """Pin a suggestion or a typed-in repository into the user catalog (the same function as `strata-setup models
    add`); the catalog name, or None when the user declined (or a head does not fit `target`)."""
    import re

    console = Console()
    if picked == HUB:
        repo = _ask(questionary.text(
            "Hugging Face repository id (org/name):",
            validate=lambda s: bool(re.match(_REPO_ID, s.strip())) or "Type it as org/name, e.g. Qwen/Qwen3-30B-A3B.",
            **io)).strip()
        name = None
    else:
        name = picked[len(SUGGESTED):]
        repo = next(o.repo for o in options if o.name == name)

    def show(found: Any) -> None:
        console.print("The Hub says:")
        for line in found.lines():
            console.print(line, highlight=False, soft_wrap=True)

    def confirm(found: Any) -> bool:
        if target is not None and target not in found.fits:
            console.print(f"{found.name} does not fit {target} (it fits {', '.join(found.fits)}); nothing was "
                          f"added.", highlight=False)
            return False
        return bool(_ask(questionary.confirm(f"Add {found.name} to your catalog ({found.catalog})?", default=True,
                                             **io)))

    def choose_file(files: list[tuple[str, int]]) -> str | None:
        """A llama.cpp repository: which of its GGUF files (one quantization each) to pin as the target; a split
        file by its first part, with all its parts' size."""
        from runtime.formats.gguf_split import part_of

        def label(n: str, size: int) -> str:
            p = part_of(n)
            return f"{n}  ({_size(size)}{f' in {p[2]} parts' if p else ''})"
        items = [questionary.Choice(label(n, size), value=n) for n, size in files]
        return _ask(questionary.select("Which GGUF file (quantization)?", choices=items, **io))

    found = services.add_from_hub(repo, name=name, kind=kind, show=show, confirm=confirm,
                                  choose_file=choose_file if kind == "target" else None)
    return None if found is None else found.name


# contexts from which the KV cache's format is asked: where its memory (a GPU) or its bytes a token (a CPU) start
# to count; shorter ones keep the compute dtype without a question
KV_QUESTION_CONTEXT = {"cuda": 16384, "cpu": 2048}


def kv_question_wanted(plan: Plan) -> bool:
    """Ask the KV cache question: a long context, or a recommendation other than the compute dtype (the compute
    dtype's cache does not fit)."""
    return plan.context >= KV_QUESTION_CONTEXT[plan.hardware.device_type] or plan.kv_dtype != plan.compute_dtype


def _note(ans: Choices, key: str, took_default: bool, why: dict[str, str]) -> None:
    if took_default and why.get(key):
        ans.notes[key] = why[key]


def _model_limit(plan: Plan) -> int | None:
    """The target's max_position_embeddings when its config is here (else no upper bound yet)."""
    if plan.target.local_path is None:
        return None
    try:
        return target_geometry(plan.target.local_path).max_position
    except UsageError:
        return None


def _valid_int(s: str, lo: int, hi: int | None) -> bool | str:
    try:
        v = int(s.strip())
    except ValueError:
        return "Please type a whole number."
    if v < lo:
        return f"Please type a number of at least {lo}."
    if hi is not None and v > hi:
        return f"Please type a number of at most {hi}."
    return True


def confirm(*, input: Any = None, output: Any = None) -> bool:
    return bool(_ask(questionary.confirm("Go ahead?", default=True, input=input, output=output)))


# ---------------------------------------------------------------------------------------------------------------
# Rendering (shared with `strata-setup budget` and `--dry-run`)


def budget_table(budget: Budget, title: str = "Memory budget") -> Table:
    where = "GPU" if budget.device_type == "cuda" else "RAM"
    t = Table(title=f"{title} ({where}: {_size(budget.available_bytes)} available of {_size(budget.total_bytes)})")
    t.add_column("item")
    t.add_column("MiB", justify="right")
    t.add_column("bytes", justify="right")
    for name, n in budget.table().items():
        label = name
        if name == "expert_cache":
            label = (f"expert_cache ({budget.expert_cache_slots} of {budget.total_experts} experts × "
                     f"{budget.expert_bytes / MIB:.2f} MiB)")
        t.add_row(label, f"{n / MIB:,.1f}", f"{n:,}")
    used = budget.fixed_bytes + budget.expert_cache_bytes
    t.add_section()
    t.add_row("total", f"{used / MIB:,.1f}", f"{used:,}")
    t.add_row("left over", f"{max(budget.remaining_bytes, 0) / MIB:,.1f}", f"{max(budget.remaining_bytes, 0):,}")
    return t


def summary_table(plan: Plan) -> Table:
    t = Table(title="Setup plan", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value", overflow="fold")
    t.add_column("why", style="dim")
    t.add_row("device", plan.hardware.describe(), "; ".join(plan.hardware.notes))
    t.add_row("target", f"{plan.target.name} ({plan.target.source})", plan.why.get("target", ""))
    size = plan.target_quant + ("" if plan.converts_target or plan.target_is_gguf else " (the folder as is)")
    t.add_row("size", size, plan.why.get("target_quant", ""))
    t.add_row("drafter", plan.drafter, plan.why.get("drafter", ""))
    if KINDS[plan.drafter].needs_file and plan.head:
        t.add_row("DFlash2 head", plan.head.name, plan.why.get("dflash2_head", ""))
        t.add_row("quantization", plan.quant or "", plan.why.get("dflash2_quant", ""))
    t.add_row("context", f"{plan.context} tokens", plan.why.get("context", ""))
    t.add_row("KV cache", plan.kv_dtype or plan.compute_dtype, plan.why.get("kv_dtype", ""))
    t.add_row("reserve", f"{plan.reserve_mib} MiB", plan.why.get("vram_reserve_mib", ""))
    t.add_row("calibrate", "yes" if plan.calibrate else "no", plan.why.get("calibrate", ""))
    dl = plan.download_bytes()
    t.add_row("download", _size(dl) if dl else "nothing", f"{_size(plan.hardware.disk_free_bytes)} free on disk")
    t.add_row("steps", "\n".join(plan.steps()), "")
    t.add_row("config", str(plan.config_path), "")
    return t


def offload_lines(budget: Budget, links: tuple[float, float] | None, hit_rate: float | None = None,
                  source: str = "") -> list[str]:
    """What an offloaded setup will do: slots, the expected hit rate and the decode estimate it allows."""
    if not budget.offloaded:
        return []
    from setup_wizard.budget import decode_estimate

    if hit_rate is None:
        hit_rate = budget.static_hit_rate()
        source = "no routing profile yet, so every expert counts alike; calibration records one"
    out = [f"Experts: {budget.expert_cache_slots} of {budget.total_experts} on the GPU "
           f"({budget.dynamic_slots} of those slots cache recently fetched experts); expected hit rate "
           f"{100 * hit_rate:.0f}% ({source})."]
    if links is None:
        out.append("Decode estimate: unknown (the GPU's bandwidths were not measured).")
    else:
        est = decode_estimate(budget, hit_rate, links[0], links[1])
        out.append(f"Decode estimate: about {est.tok_s:,.1f} tok/s target-only at most ({est.resident_bytes / 1e9:.2f} "
                   f"GB per token from GPU memory at {links[0] / 1e9:,.0f} GB/s, {est.missed_bytes / 1e9:.2f} GB from "
                   f"host memory at {links[1] / 1e9:,.1f} GB/s).")
    return out


def show_plan(plan: Plan, console: Console) -> None:
    console.print(summary_table(plan))
    if plan.budget is not None:
        console.print(budget_table(plan.budget))
        for note in plan.budget.notes:
            console.print(f"[dim]{note}[/dim]")
        for line in offload_lines(plan.budget, plan.hardware.links):
            console.print(line)
        if not plan.budget.fits:
            console.print(f"[red]{plan.budget.reason}[/red]")
    else:
        console.print("[dim]The memory budget is computed once the model is downloaded.[/dim]")
