"""The calibration entry points the wizard calls: `calibrate_for_config` (keyed, stored, reused) and
`calibrate_engine` (one measured search on an engine you already have).

    from calibrate.api import calibrate_for_config
    res = calibrate_for_config(config_dict)          # -> CalibrationResult
    config["speculative"].update(block=res.block, spec_min_p=res.spec_min_p, source=res.source)
    config["calibration"] = res.to_dict()
"""

from __future__ import annotations

import datetime as dt
import inspect
import time
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calibrate import draft_temperature
from calibrate.fixtures import (
    NEW_TOKENS,
    TASKS,
    EncodedPrompt,
    encode_prompts,
    load_prompts,
    prompt_set_sha256,
)
from calibrate.key import CalibrationConfigError, CalibrationKey, drafter_kind, key_for_config
from calibrate.results import CalibrationResult, ResultStore
from calibrate.routing import offloads, profile_for_config
from calibrate.search import FLOORS, Arm, Plan, RunOutcome, Search, SearchResult, candidate_arms
from runtime.progress import ProgressFn

DEFAULT_MAX_SECONDS = 110.0       # the bundled pack calibrates in under two minutes on a GPU
METHOD = "coarse-to-fine + successive halving, head-to-head confirmation, 3% bar"


@dataclass
class EngineSettings:
    """What calibration needs to know about the engine's drafter."""

    kind: str
    max_block: int
    default: Arm           # what the runtime uses when uncalibrated
    current: Arm | None    # what the config says now (a candidate too)
    default_from: str      # where `default` was read from


class EngineRunner:
    """Adapts `Engine.generate` to the search's `Runner`: greedy, fixed new tokens, token ids in, stats out."""

    def __init__(self, engine: Any, prompts: dict[str, EncodedPrompt], new_tokens: int) -> None:
        self.engine = engine
        self.prompts = prompts
        self.new_tokens = new_tokens
        self.sampling = _greedy()
        self.should_stop: Callable[[], bool] | None = None     # the search's deadline, asked between windows
        # an engine whose fixed-width step can follow the block: each arm runs at its own width (what it will cost
        # once chosen), the target alone at width 1; the widths' greedy bits may differ
        try:
            self.widths = "width" in inspect.signature(engine.generate).parameters
        except (TypeError, ValueError):
            self.widths = False
        # the CPU's fixed-width step is row-invariant within a width, not across widths (a 1-row and a k-row
        # product round apart), so there too an arm is checked against the target alone at its own width
        self.width_sensitive = self.widths

    def __call__(self, arm: Arm | None, task: str) -> RunOutcome:
        # no stop tokens: every run generates exactly `new_tokens`, so runs and arms are comparable
        kw: dict[str, Any] = {"max_new_tokens": self.new_tokens, "stop_ids": set()}
        if self.sampling is not None:
            kw["sampling"] = self.sampling
        if arm is None:
            kw["draft"] = False
        else:
            kw.update(draft=True, block=arm.block, spec_min_p=arm.spec_min_p)
        if self.widths:
            kw["width"] = 1 if arm is None else arm.block
        if self.should_stop is not None:
            kw["cancel"] = self.should_stop
        return self._outcome(self.engine.generate(list(self.prompts[task].ids), **kw))

    def target_at(self, width: int, task: str) -> RunOutcome:
        """The target alone through the fixed step of `width` rows."""
        kw: dict[str, Any] = {"max_new_tokens": self.new_tokens, "stop_ids": set(), "draft": False, "width": width}
        if self.sampling is not None:
            kw["sampling"] = self.sampling
        if self.should_stop is not None:
            kw["cancel"] = self.should_stop
        return self._outcome(self.engine.generate(list(self.prompts[task].ids), **kw))

    @staticmethod
    def _outcome(res: Any) -> RunOutcome:
        st = res.stats
        n = len(res.token_ids)
        decode_s = float(st.get("decode_s") or 0.0)
        tok_s = float(st.get("decode_tok_s") or (n / decode_s if decode_s > 0 else 0.0))
        return RunOutcome(token_ids=list(res.token_ids), tok_s=tok_s, decode_s=decode_s,
                          accepted=int(st.get("accepted", 0) or 0), proposed=int(st.get("proposed", 0) or 0),
                          windows=int(st.get("windows", 0) or 0), cancelled=st.get("stop_reason") == "cancelled")


def _greedy() -> Any:
    try:
        from runtime.engine import SamplingParams
    except ImportError:       # the engine's own default is greedy
        return None
    return SamplingParams(temperature=0.0)


def _first(*vals: Any) -> Any:
    return next((v for v in vals if v is not None), None)


def engine_settings(engine: Any, config: dict[str, Any] | None = None) -> EngineSettings:
    """The drafter's block range and the uncalibrated default (block, floor) to beat.

    The default is, in order: what the engine exposes (`default_block`/`default_spec_min_p` on the engine or its
    drafter); the config's `[speculative]` when its source is "default" (what setup writes before calibrating);
    the default an earlier calibration recorded in `[calibration]` (so a forced rerun beats the same default);
    the runtime's own fallbacks (MTP: `runtime.engine.MTP_DEFAULT_BLOCK`, DFlash2: the trained block size; floor 0,
    which is what the engine uses when given none)."""
    spec = (config or {}).get("speculative") or {}
    drafter = getattr(engine, "drafter", None)
    kind = str(_first(getattr(drafter, "kind", None), getattr(engine, "drafter_kind", None),
                      ((config or {}).get("drafter") or {}).get("kind"), "none"))
    max_block = _first(getattr(drafter, "max_block", None), getattr(engine, "max_block", None))
    if drafter is None or max_block is None:
        return EngineSettings(kind, 1, Arm(1, 0.0), None, "no drafter")
    max_block = int(max_block)
    eb = _first(getattr(engine, "default_block", None), getattr(drafter, "default_block", None))
    ep = _first(getattr(engine, "default_spec_min_p", None), getattr(drafter, "default_spec_min_p", None))
    if eb is not None and ep is not None:
        block, floor, src = int(eb), float(ep), "engine"
    elif spec.get("source", "default") == "default" and spec.get("block") is not None \
            and spec.get("spec_min_p") is not None:
        block, floor, src = int(spec["block"]), float(spec["spec_min_p"]), "config (uncalibrated)"
    elif (prev := _previous_default(config or {})) is not None:
        block, floor, src = prev[0], prev[1], "config (previous calibration)"
    else:
        block, floor, src = _runtime_default_block(kind, max_block), 0.0, "runtime fallback"
    block = min(max(block, 2), max_block)
    current = None
    if spec.get("block") is not None and spec.get("spec_min_p") is not None:
        current = Arm(min(max(int(spec["block"]), 2), max_block), round(float(spec["spec_min_p"]), 6))
    return EngineSettings(kind, max_block, Arm(block, round(floor, 6)), current, src)


def _previous_default(config: dict[str, Any]) -> tuple[int, float] | None:
    cal = config.get("calibration") or {}
    for table in (cal, cal.get("results") or {}):
        d = table.get("default") if isinstance(table, dict) else None
        if isinstance(d, dict) and d.get("block") is not None and d.get("spec_min_p") is not None:
            return int(d["block"]), float(d["spec_min_p"])
    return None


def _runtime_default_block(kind: str, max_block: int) -> int:
    if kind == "mtp":
        try:
            from runtime.engine import MTP_DEFAULT_BLOCK
        except ImportError:
            return min(4, max_block)
        return int(MTP_DEFAULT_BLOCK)
    return max_block


def candidate_grid(es: EngineSettings, floors: tuple[float, ...] = FLOORS) -> list[Arm]:
    """Blocks 2..max_block x (the floors + the current and default floors), plus the default and current arms."""
    extra = [es.default] + ([es.current] if es.current else [])
    return candidate_arms(es.max_block, [*floors, *(a.spec_min_p for a in extra)], extra)


# at most this share of the search's budget goes to measuring the draft temperature (no prompt is started after it)
DRAFT_TEMP_SHARE = 0.15


def calibrate_engine(engine: Any, *, config: dict[str, Any] | None = None, prompts: dict[str, str] | None = None,
                     new_tokens: int = NEW_TOKENS, max_seconds: float | None = DEFAULT_MAX_SECONDS,
                     plan: Plan | None = None, floors: tuple[float, ...] = FLOORS,
                     clock: Callable[[], float] = time.perf_counter, progress: Any = None,
                     context: int | None = None) -> tuple[SearchResult, dict[str, Any]]:
    """Run the measured search on `engine`; returns the search result and facts for the record."""
    es = engine_settings(engine, config)
    if es.max_block < 2:
        raise CalibrationConfigError("this engine has no drafter: there is nothing to calibrate.")
    texts = prompts if prompts is not None else load_prompts()
    if context is None:
        context = _first(((config or {}).get("memory") or {}).get("context"),
                         getattr(getattr(engine, "kv", None), "capacity", None))
    enc = encode_prompts(engine.tokenizer, texts, context=int(context) if context else None,
                         new_tokens=new_tokens, max_block=es.max_block)
    grid = candidate_grid(es, floors)

    tasks = [t for t in TASKS if t in enc] + [t for t in enc if t not in TASKS]
    if plan is None and getattr(getattr(engine, "device", None), "type", None) == "cpu":
        # no kernels to compile or graphs to capture on the CPU: per-width warm-up runs would only eat the budget
        plan = Plan(warmup=False)
    if progress is not None:
        progress("draft temperature", 0, 1)
    t_dt = time.perf_counter()
    try:        # sampled drafts' temperature (calibrate/draft_temperature.py): one forward per prompt, no decoding
        drafts_temp = draft_temperature.measure(engine, [e.ids for e in enc.values()], max_seconds=None if max_seconds
                                                 is None else DRAFT_TEMP_SHARE * max_seconds)
    except (RuntimeError, ValueError, TypeError, AttributeError) as exc:
        drafts_temp = {"scale": 1.0, "why_not": f"could not be measured ({exc})"}
    if max_seconds is not None:
        max_seconds = max(0.0, max_seconds - (time.perf_counter() - t_dt))
    runner = EngineRunner(engine, enc, new_tokens)
    search = Search(runner, tasks, grid, es.default, max_seconds=max_seconds,
                    plan=plan, clock=clock, progress=progress)
    result = search.run()
    facts = {
        "drafter_kind": es.kind, "max_block": es.max_block, "default_from": es.default_from,
        "current": es.current.to_dict() if es.current else None, "new_tokens": new_tokens,
        "floors": sorted({a.spec_min_p for a in grid}), "method": METHOD, "prompt_set_sha256": prompt_set_sha256(texts),
        "prompts": {t: {"tokens": len(e.ids), "full_tokens": e.full_tokens, "truncated": e.truncated}
                    for t, e in enc.items()},
        "draft_temperature": drafts_temp,
        "references": search.refs,      # not stored: the target-only ids, for a later grid on the same engine
        "_runner": runner,
    }
    return result, facts


def _load_config(config: dict[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(config, dict):
        return config
    p = Path(config)
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise CalibrationConfigError(f"cannot read the config {p} ({e.strerror}); check the path.") from None
    except tomllib.TOMLDecodeError as e:
        raise CalibrationConfigError(f"the config {p} is not valid TOML ({e}); fix it or re-run strata-setup.") from None


def calibrate_for_config(config: dict[str, Any] | str | Path, *, engine: Any = None, force: bool = False,
                         max_seconds: float | None = DEFAULT_MAX_SECONDS, on_progress: ProgressFn | None = None,
                         store_dir: str | Path | None = None, device: tuple[str, int] | None = None,
                         prompts: dict[str, str] | None = None, new_tokens: int = NEW_TOKENS,
                         plan: Plan | None = None, clock: Callable[[], float] = time.perf_counter,
                         threads: int | None = None) -> CalibrationResult:
    """Calibrate (block, spec_min_p) for a strata-setup config on this machine, or reuse the stored result.

    `max_seconds` bounds the whole calibration, loading the engine included (the search gets what is left and
    stops mid-run at its deadline). On a CPU it runs with `threads` torch threads, or with the count measured
    here (`Engine.choose_threads`); the choice is in the record.

    Progress goes to `on_progress("calibrating: ...", runs done, runs planned)`; nothing is printed (the caller
    shows `report.sweep_table(result.record)` and `report.summary_lines(result)`). Raises `CalibrationConfigError`
    (bad input, exit 2) and `calibrate.search.LosslessError` (a runtime bug: an arm changed greedy output, exit 1).
    """
    cfg = _load_config(config)
    source = config if not isinstance(config, dict) else cfg     # a path: relative paths resolve against it
    kind = drafter_kind(cfg)
    offload = offloads(cfg)
    nothing = CalibrationResult(block=None, spec_min_p=None, source="default", decision="nothing_to_calibrate",
                                reason="the config has no drafter (kind none): there is nothing to calibrate.")
    if kind == "none" and not offload:
        return nothing
    key = key_for_config(cfg, device=device) if kind != "none" else None
    store = ResultStore(store_dir)
    if key is not None and not force:
        rec = store.load(key)
        if rec is not None and (not offload or _profile_file(rec)):
            res = CalibrationResult.from_record(key, rec, reused=True, path=str(store.path_for(key)))
            res.routing_profile = _profile_file(rec)
            return res
    t0 = time.perf_counter()
    if engine is None:
        from runtime.engine import Engine

        engine = Engine.from_config(source)
    build_s = time.perf_counter() - t0
    compile_s = _compile_steps(engine, on_progress)
    t0 += compile_s               # once per machine, and not what the budget is for: it starts after
    with _cpu_threads(engine, threads) as thread_facts:
        res = _calibrate_built(engine, cfg, kind, key, store, t0, build_s, max_seconds=max_seconds,
                               on_progress=on_progress, store_dir=store_dir, force=force, prompts=prompts,
                               new_tokens=new_tokens, plan=plan, clock=clock, offload=offload, nothing=nothing,
                               thread_facts=thread_facts)
    return res


def _compile_steps(engine: Any, on_progress: ProgressFn | None) -> float:
    """On a CPU: the target's compiled steps (runtime/target_compiled.py) and the drafter's
    (runtime/drafters/mtp_compiled.py), built into the store when this machine has none yet, so that calibration
    measures the steps strata-run will run. Returns the seconds it took (a build: about 20 a step; a load:
    milliseconds)."""
    if getattr(getattr(engine, "device", None), "type", None) != "cpu" or not hasattr(engine, "compile_drafter"):
        return 0.0
    todo = []
    if hasattr(engine, "compile_target") and engine.target_why.startswith("not built"):
        todo.append(("compiling the target's CPU steps (once per machine)", engine.compile_target))
    if not engine.drafter_compiled:            # attached when the engine was built: nothing to build or load
        todo.append(("compiling the drafter's CPU step (once per machine)", engine.compile_drafter))
    t0 = time.perf_counter()
    for what, fn in todo:
        if on_progress is not None:
            on_progress(what, 0, 1)
        fn(build=True)
        if on_progress is not None:
            on_progress(what, 1, 1)
    return time.perf_counter() - t0


@contextmanager
def _cpu_threads(engine: Any, threads: int | None) -> Iterator[dict[str, Any] | None]:
    """On a CPU engine: torch runs with `threads` (given) or the measured choice while calibrating; restored
    after. Yields what was chosen, for the record (None off the CPU)."""
    if getattr(getattr(engine, "device", None), "type", None) != "cpu":
        yield None
        return
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        facts: dict[str, Any] = {"threads": int(threads), "reason": "given (--threads)"}
    elif hasattr(engine, "choose_threads"):
        facts = engine.choose_threads().to_dict()
    else:
        facts = {"threads": before, "reason": "torch's default"}
    torch.set_num_threads(int(facts["threads"]))
    try:
        yield facts
    finally:
        torch.set_num_threads(before)


def _calibrate_built(engine: Any, cfg: dict[str, Any], kind: str, key: Any, store: ResultStore, t0: float,
                     build_s: float, *, max_seconds: float | None, on_progress: ProgressFn | None,
                     store_dir: str | Path | None, force: bool, prompts: dict[str, str] | None, new_tokens: int,
                     plan: Plan | None, clock: Callable[[], float], offload: bool, nothing: CalibrationResult,
                     thread_facts: dict[str, Any] | None) -> CalibrationResult:
    prof = None
    if offload:           # the slots go to the experts this model uses on these prompts, before anything is timed
        if on_progress is not None:
            on_progress("calibrating: routing profile", 0, 1)
        context = ((cfg.get("memory") or {}).get("context"))
        prof = profile_for_config(cfg, engine, store_dir=store_dir, force=force, prompts=prompts,
                                  context=int(context) if context else None)
        engine.use_routing_profile(prof.profile)
        if kind == "none":
            nothing.routing_profile = str(prof.path)
            nothing.reason = "the config has no drafter: only the routing profile was recorded."
            return nothing

    def bar(message: str, done: int, planned: int) -> None:
        if on_progress is not None:
            on_progress(f"calibrating: {message}", done, max(planned, done, 1))

    # the budget covers the whole calibration: the search gets what loading the engine (and profiling) left
    left = None if max_seconds is None else max(0.0, max_seconds - (time.perf_counter() - t0))
    sr, facts = calibrate_engine(engine, config=cfg, prompts=prompts, new_tokens=new_tokens, max_seconds=left,
                                 plan=plan, clock=clock, progress=bar, context=key.context)
    facts["engine_build_s"] = round(build_s, 3)
    facts["total_s"] = round(time.perf_counter() - t0, 3)
    facts["budget_s"] = max_seconds
    facts["search_budget_s"] = None if left is None else round(left, 3)
    if thread_facts is not None:
        facts["threads"] = thread_facts
    if hasattr(engine, "compile_drafter") and kind != "none":
        facts["drafter_step"] = {"compiled": bool(engine.drafter_compiled), "why_not": engine.compiled_why or None,
                                 "compile_s": round(float(getattr(engine, "compile_s", 0.0)), 2)}
    if hasattr(engine, "compile_target") and getattr(getattr(engine, "device", None), "type", None) == "cpu":
        facts["target_step"] = {"compiled": sorted(engine.target_packages), "why_not": engine.target_why or None,
                                "compile_s": round(float(engine.target_compile_s), 2),
                                "attention_op_why_not": getattr(engine, "attention_why", "") or None}
    if prof is not None:
        facts["routing_profile"] = {"path": str(prof.path), "reused": prof.reused, "key": prof.key,
                                    "expected_hit_rate": engine.experts.expected_hit_rate()}
    res = result_from_search(key, sr, facts)
    res.routing_profile = str(prof.path) if prof is not None else None
    if res.source == "calibrated":
        res.path = str(store.save(key, res.record))
    return res


def _profile_file(record: dict[str, Any]) -> str | None:
    """The routing profile a stored record used, when its file is still there."""
    p = (record.get("routing_profile") or {}).get("path")
    return p if p and Path(p).is_file() else None


def result_from_search(key: CalibrationKey | None, sr: SearchResult, facts: dict[str, Any]) -> CalibrationResult:
    """The stored record and the result object for one finished search."""
    body = sr.to_dict()
    decided = sr.decision in ("winner", "kept_default", "default_is_best", "target_alone")
    facts = {k: v for k, v in facts.items() if k != "references" and not k.startswith("_")}
    record = {**body, **facts, "source": "calibrated" if decided else "default",
              "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
    return CalibrationResult(block=sr.settings.block, spec_min_p=sr.settings.spec_min_p, source=record["source"],
                             decision=sr.decision, reason=sr.reason, reused=False, key=key, record=record)
