"""The calibration search: which (block, spec_min_p) decodes fastest, measured, pruned, under a time budget.

Engine-agnostic: it drives a `Runner` (one greedy generation of one task's prompt for one arm, or for the target
alone) and a clock, so the tests can replace both with deterministic fakes. Every speculative run is checked
against the target-only greedy token ids: speculation must never change greedy output, so a mismatch is a
runtime bug and raises `LosslessError` naming the arm and the prompt; such an arm is never picked. Where the step's
width follows the block (the runner says `width_sensitive`), an arm's reference is the target alone at the arm's
width when it differs from the width-1 one (BF16 rounds a 1-row and a k-row step differently: docs/models.md,
"Numerics").

Stages (all timed runs in interleaved order so drift hits every arm alike; median per task, geometric mean
across tasks):
  1. references: target alone, a warm-up run then a reference run per task (they must agree);
  2. warm-up: one untimed run per distinct block size (kernels for each window width); where the target's
     fixed-width step follows the block (a GPU), also the target alone at each of those widths: the step's cost
     by width (`step_cost`, 1.0 at width 1) and each width's own greedy reference;
  3. coarse: blocks on a coarse ladder (2, 3, 4, 6, 8, 12, 16, ... and the ends) x every floor, one repeat;
  4. refine: fill in the block sizes between the ladder rungs next to the best few coarse arms, except a block
     that could not win even with every proposal accepted and a free drafter (target tok/s x block / step cost
     at that width, below the best measured);
  5. halving: the best arms get more repeats, keep the top half, again;
  6. confirm: the winner against the default head to head (alternating order); the default is kept unless the
     winner is faster by more than `min_gain` (3%);
  7. pays: the chosen arm against the target alone head to head (alternating order), for the speed-up the
     report states: the references of stage 1 ran first, on a machine whose speed may drift since.
Before every run the remaining budget is checked against a conservative estimate of that run; time for the
confirmation and for one head-to-head run with the target alone is reserved up front, so the whole search honours
`max_seconds`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from runtime.errors import WorkError

FLOORS: tuple[float, ...] = (0.0, 0.3, 0.5, 0.7)
MIN_GAIN = 0.03
# stage 7: below this speed-up over the target alone (head to head) the config drafts nothing (block 1): a drafter
# that loses more than run-to-run noise would only slow the default run down (docs/calibration.md, "target_alone")
PAYS_MIN = 0.95


class LosslessError(WorkError, RuntimeError):
    """A speculative arm changed the greedy output: a runtime bug, never a calibration choice."""


class TimeBudgetSpent(Exception):
    """Raised internally when the next run would not fit the remaining time budget."""


@dataclass(frozen=True, order=True)
class Arm:
    """One candidate setting: verify-window width (anchor + proposals) and confidence floor."""

    block: int
    spec_min_p: float

    @property
    def label(self) -> str:
        return f"block={self.block} spec_min_p={self.spec_min_p:g}"

    def to_dict(self) -> dict[str, Any]:
        return {"block": self.block, "spec_min_p": self.spec_min_p}


@dataclass
class RunOutcome:
    """What the runner reports for one generation."""

    token_ids: list[int]
    tok_s: float          # decode tokens per second (the engine's decode_tok_s)
    decode_s: float
    accepted: int = 0
    proposed: int = 0
    windows: int = 0
    cancelled: bool = False   # stopped early by the runner's `should_stop` (the budget ran out mid-run)


class Runner(Protocol):
    """One greedy generation of `task`'s prompt: `arm=None` means the target alone (no drafter), at width 1.

    Optional: `width_sensitive` (True where the target's fixed-width step follows the block, so a block's windows
    cost what that width costs and greedy bits can differ between widths), `target_at(width, task)`, the target
    alone through the step of that width, and `should_stop`: the search sets its deadline there (asked between
    windows), so a run that takes far longer than its estimate cannot carry the search past its budget."""

    def __call__(self, arm: Arm | None, task: str) -> RunOutcome: ...


@dataclass
class Sample:
    phase: str
    arm: Arm | None
    task: str
    tok_s: float
    decode_s: float
    wall_s: float
    accepted: int
    proposed: int
    windows: int
    timed: bool


@dataclass
class ArmStats:
    """All timed samples of one arm, by task."""

    arm: Arm
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    phase: str = "coarse"          # the furthest stage this arm reached

    def add(self, s: Sample) -> None:
        self.samples.setdefault(s.task, []).append(s)

    def median(self, task: str) -> float | None:
        xs = [s.tok_s for s in self.samples.get(task, [])]
        return statistics.median(xs) if xs else None

    def medians(self, tasks: Sequence[str]) -> dict[str, float | None]:
        return {t: self.median(t) for t in tasks}

    def geomean(self, tasks: Sequence[str]) -> float | None:
        return geomean_of(self.medians(tasks).values())

    def repeats(self) -> int:
        return min((len(v) for v in self.samples.values()), default=0)

    def accepted_proposed(self) -> tuple[int, int]:
        acc = sum(s.accepted for v in self.samples.values() for s in v)
        prop = sum(s.proposed for v in self.samples.values() for s in v)
        return acc, prop


def geomean_of(values: Iterable[float | None]) -> float | None:
    """Geometric mean; None if any value is missing or not positive (an incomplete arm is not ranked)."""
    vals = list(values)
    if not vals or any(v is None or not v > 0 for v in vals):
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))  # type: ignore[arg-type]


def block_ladder(lo: int, hi: int) -> list[int]:
    """The coarse block sizes in [lo, hi]: 2, 3, 4, 6, 8, 12, 16, 24, 32, ... plus both ends."""
    rungs = {lo, hi}
    b = 2
    while b <= hi:
        for r in (b, b + b // 2):
            if lo <= r <= hi:
                rungs.add(r)
        b *= 2
    return sorted(rungs)


def candidate_arms(max_block: int, floors: Iterable[float] = FLOORS, extra: Iterable[Arm] = ()) -> list[Arm]:
    """The full grid: blocks 2..max_block x floors, plus any extra arms (the current and default settings)."""
    if max_block < 2:
        return []
    fl = sorted({round(float(f), 6) for f in floors})
    arms = {Arm(b, f) for b in range(2, max_block + 1) for f in fl}
    for a in extra:
        if 2 <= a.block <= max_block:
            arms.add(Arm(a.block, round(float(a.spec_min_p), 6)))
    return sorted(arms)


@dataclass
class Plan:
    """Knobs of the pruned search (defaults sized for the bundled pack on a GPU in under two minutes)."""

    coarse_repeats: int = 1
    refine_top: int = 3            # best coarse arms whose neighbouring block sizes get filled in
    halving: tuple[int, ...] = (4, 2)   # survivors entering each halving round
    halving_repeats: int = 2       # extra repeats per task per halving round
    confirm_repeats: int = 3       # head-to-head repeats per task (winner vs default)
    pays_repeats: int = 2          # head-to-head repeats per task (the chosen arm vs the target alone); 0: none
    min_gain: float = MIN_GAIN
    warmup: bool = True
    safety: float = 1.15           # run-time estimates are inflated by this factor
    chunk: int = 8                 # arms per interleaved chunk of the coarse/refine passes


@dataclass
class SearchResult:
    """Everything the search measured and decided (JSON-able through `to_dict`)."""

    tasks: list[str]
    default: Arm
    chosen: Arm
    winner: Arm | None
    decision: str                  # "winner" | "kept_default" | "default_is_best" | "target_alone" | "budget"
    reason: str
    arms: dict[Arm, ArmStats]
    confirm: dict[Arm, ArmStats]
    target_tok_s: dict[str, float]
    samples: list[Sample]
    seconds: float
    budget_s: float | None
    budget_hit: bool
    grid_size: int
    step_cost: dict[int, float] = field(default_factory=dict)   # target step time by width, width 1 = 1.0
    pruned: list[Arm] = field(default_factory=list)              # refine arms the cost bound ruled out
    pays: dict[Arm | None, ArmStats] = field(default_factory=dict)   # stage 7: the chosen arm and None (the target)
    # stage 7 found the target alone clearly faster (`PAYS_MIN`): the settings draft nothing (block 1), and `chosen`
    # stays the best drafted arm measured
    draft_off: bool = False

    @property
    def settings(self) -> Arm:
        """What the config gets: the chosen arm, or block 1 (no drafting) when drafting did not pay."""
        return Arm(block=1, spec_min_p=self.chosen.spec_min_p) if self.draft_off else self.chosen

    @property
    def gain(self) -> float | None:
        """Winner over default in the head-to-head confirmation (fraction), if it ran."""
        if self.winner is None or self.winner not in self.confirm or self.default not in self.confirm:
            return None
        w = self.confirm[self.winner].geomean(self.tasks)
        d = self.confirm[self.default].geomean(self.tasks)
        return None if w is None or d is None else w / d - 1.0

    def _head_to_head(self) -> dict[str, Any] | None:
        """Stage 7's figures: the chosen arm and the target alone, timed alternately (None if it did not run)."""
        a, t = self.pays.get(self.chosen), self.pays.get(None)
        ga = a.geomean(self.tasks) if a else None
        gt = t.geomean(self.tasks) if t else None
        if ga is None or gt is None:
            return None
        return {"repeats": min(a.repeats(), t.repeats()), "geomean_tok_s": _r(ga), "target_only_geomean_tok_s": _r(gt),
                "per_task_tok_s": {k: _r(v) for k, v in a.medians(self.tasks).items()},
                "target_only_per_task_tok_s": {k: _r(v) for k, v in t.medians(self.tasks).items()},
                "speedup": _r(ga / gt, 4)}

    def timed_runs(self, phase: str | None = None) -> int:
        return sum(1 for s in self.samples if s.arm is not None and s.timed and (phase is None or s.phase == phase))

    def measured_arms(self) -> list[Arm]:
        return sorted(a for a, st in self.arms.items() if st.samples)

    def ranked(self) -> list[tuple[Arm, float]]:
        """Measured arms with a full set of task medians, fastest first."""
        out = [(a, g) for a, st in self.arms.items() if (g := st.geomean(self.tasks)) is not None]
        return sorted(out, key=lambda x: (-x[1], x[0]))

    def chosen_stats(self) -> ArmStats | None:
        return self.confirm.get(self.chosen) or self.arms.get(self.chosen)

    def arm_row(self, arm: Arm, st: ArmStats) -> dict[str, Any]:
        acc, prop = st.accepted_proposed()
        return {**arm.to_dict(), "phase": st.phase, "repeats": st.repeats(),
                "per_task_tok_s": {t: _r(m) for t, m in st.medians(self.tasks).items()},
                "geomean_tok_s": _r(st.geomean(self.tasks)), "accepted": acc, "proposed": prop}

    def to_dict(self) -> dict[str, Any]:
        def side(arm: Arm | None) -> dict[str, Any] | None:
            if arm is None:
                return None
            st = self.confirm.get(arm)
            sweep = self.arms.get(arm)
            return {**arm.to_dict(),
                    "confirm_geomean_tok_s": _r(st.geomean(self.tasks)) if st else None,
                    "confirm_per_task_tok_s": {t: _r(m) for t, m in st.medians(self.tasks).items()} if st else None,
                    "sweep_geomean_tok_s": _r(sweep.geomean(self.tasks)) if sweep else None}

        ch = self.chosen_stats()
        acc, prop = ch.accepted_proposed() if ch else (0, 0)
        return {
            "settings": self.settings.to_dict(),
            "drafted_settings": self.chosen.to_dict() if self.draft_off else None,
            "decision": self.decision,
            "reason": self.reason,
            "default": side(self.default),
            "winner": side(self.winner),
            "gain": _r(self.gain, 5),
            "per_task_tok_s": {t: _r(m) for t, m in ch.medians(self.tasks).items()} if ch else {},
            "geomean_tok_s": _r(ch.geomean(self.tasks)) if ch else None,
            "accepted": acc,
            "proposed": prop,
            "target_only_tok_s": {t: _r(v) for t, v in self.target_tok_s.items()},
            "target_only_geomean_tok_s": _r(geomean_of(self.target_tok_s.get(t) for t in self.tasks)),
            "head_to_head": self._head_to_head(),
            "arms": [self.arm_row(a, self.arms[a]) for a in self.measured_arms()],
            "grid_size": self.grid_size,
            "step_cost_by_width": {str(w): _r(c) for w, c in sorted(self.step_cost.items())},
            "pruned_by_cost_bound": [a.to_dict() for a in self.pruned],
            "timed_runs": self.timed_runs(),
            "runs": len(self.samples),
            "seconds": round(self.seconds, 3),
            "budget_s": self.budget_s,
            "budget_hit": self.budget_hit,
        }


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(float(x), nd)


ProgressFn = Callable[[str, int, int], None]   # (message, runs done, runs planned so far)


class Search:
    """One calibration search; construct, then `run()`."""

    def __init__(self, runner: Runner, tasks: Sequence[str], grid: Sequence[Arm], default: Arm, *,
                 references: dict[str, list[int]] | None = None, max_seconds: float | None = None,
                 plan: Plan | None = None, clock: Callable[[], float] = time.perf_counter,
                 progress: ProgressFn | None = None) -> None:
        if not tasks:
            raise ValueError("calibration needs at least one task prompt")
        self.runner = runner
        self.tasks = list(tasks)
        self.grid = sorted(set(grid))
        self.default = default
        if default not in self.grid:
            self.grid = sorted({*self.grid, default})
        self.plan = plan or Plan()
        self.max_seconds = max_seconds
        self.clock = clock
        self.progress = progress
        self.refs: dict[str, list[int]] = dict(references or {})
        self.arms: dict[Arm, ArmStats] = {}
        self.confirm: dict[Arm, ArmStats] = {}
        self.samples: list[Sample] = []
        self.target_tok_s: dict[str, float] = {}
        self._t0 = 0.0
        self._planned = 0
        self._reserve = 0.0           # seconds kept back for the confirmation while sweeping
        self.budget_hit = False
        self.width_sensitive = bool(getattr(runner, "width_sensitive", False))
        self.width_refs: dict[tuple[str, int], list[int]] = {}
        self.step_cost: dict[int, float] = {}
        self.pruned: list[Arm] = []

    # ---- time ---------------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return self.clock() - self._t0

    def _walls(self, task: str, spec: bool) -> list[float]:
        return [x.wall_s for x in self.samples if x.task == task and (x.arm is not None) == spec]

    def _spec_ratio(self, agg: Callable[[Iterable[float]], float]) -> float:
        """How much slower a speculative run is than a target-alone run of the same task (seen so far)."""
        rs = [statistics.median(sp) / statistics.median(tg) for t in self.tasks
              if (sp := self._walls(t, True)) and (tg := self._walls(t, False)) and statistics.median(tg) > 0]
        return agg(rs) if rs else 1.0

    def estimate(self, task: str) -> float:
        """Conservative wall seconds of the next run of `task`: the slowest run of it seen so far; a task with no
        speculative run yet is scaled by the worst speculative/target-alone ratio seen on the other tasks."""
        spec, tgt = self._walls(task, True), self._walls(task, False)
        seen = spec + tgt
        if tgt and not spec:
            seen.append(max(tgt) * max(1.0, self._spec_ratio(max)))
        if not seen:    # a task not run yet: the slowest run of any task
            seen = [x.wall_s for x in self.samples]
        return max(seen, default=0.0) * self.plan.safety

    def typical(self, task: str) -> float:
        """Planning estimate of one speculative run of `task`: the median of its speculative runs so far, else
        its target-alone runs scaled by the median speculative/target-alone ratio of the other tasks."""
        spec, tgt = self._walls(task, True), self._walls(task, False)
        if spec:
            return statistics.median(spec) * self.plan.safety
        if tgt:
            return statistics.median(tgt) * self._spec_ratio(statistics.median) * self.plan.safety
        return self.estimate(task)

    def fits(self, seconds: float, reserve: float = 0.0) -> bool:
        if self.max_seconds is None:
            return True
        return self.elapsed() + seconds + reserve <= self.max_seconds

    # ---- one run ------------------------------------------------------------------------------------
    def _run(self, arm: Arm | None, task: str, phase: str, *, timed: bool, reserve: float = 0.0) -> Sample:
        if not self.fits(self.estimate(task), reserve):
            self.budget_hit = True
            raise TimeBudgetSpent(phase)
        t = self.clock()
        out = self.runner(arm, task)
        wall = self.clock() - t
        if out.cancelled:                 # past the deadline mid-run: nothing measured, nothing recorded
            self.budget_hit = True
            raise TimeBudgetSpent(phase)
        if arm is not None:
            self._check(arm, task, out.token_ids)
        return self._note(arm, task, phase, out, wall, timed=timed)

    def _width_ref(self, task: str, width: int, reserve: float = 0.0) -> list[int]:
        """The target alone at `width` (untimed; cached): the reference of that width's arms, and its speed."""
        if (task, width) not in self.width_refs:
            if not self.fits(self.estimate(task), reserve):
                self.budget_hit = True
                raise TimeBudgetSpent("reference")
            t = self.clock()
            out = self.runner.target_at(width, task)  # type: ignore[attr-defined]
            if out.cancelled:
                self.budget_hit = True
                raise TimeBudgetSpent("reference")
            self._note(None, task, f"reference-w{width}", out, self.clock() - t, timed=False)
            self.width_refs[(task, width)] = list(out.token_ids)
            if task == self.tasks[0] and out.tok_s > 0 and self.target_tok_s.get(task):
                self.step_cost[width] = self.target_tok_s[task] / out.tok_s
        return self.width_refs[(task, width)]

    def _check(self, arm: Arm, task: str, ids: Sequence[int]) -> None:
        ref = self.refs[task]
        got = list(ids)
        if got == ref:
            return
        if self.width_sensitive and arm.block > 1:
            ref = self._width_ref(task, arm.block)
            if got == ref:
                return
        i = next((k for k, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), min(len(ref), len(got)))
        want = ref[i] if i < len(ref) else "end of output"
        have = got[i] if i < len(got) else "end of output"
        raise LosslessError(
            f"arm {arm.label} changed the greedy output of the '{task}' prompt at generated token {i} "
            f"(target alone: {want}, speculative: {have}); speculation must never change greedy output, "
            f"so this is a runtime bug — report it with this arm and prompt.")

    # ---- stages -------------------------------------------------------------------------------------
    def _measure(self, arms: Sequence[Arm], repeats: int, phase: str, *, reserve: float = 0.0,
                 store: dict[Arm, ArmStats] | None = None, rotate: bool = True) -> None:
        """`repeats` timed runs of every arm on every task, interleaved: repeat -> task -> arms (rotated)."""
        store = self.arms if store is None else store
        for a in arms:
            st = store.setdefault(a, ArmStats(a))
            st.phase = phase
        self._planned += repeats * len(self.tasks) * len(arms)
        n = len(arms)
        for r in range(repeats):
            for ti, task in enumerate(self.tasks):
                k = (r + ti) % n if rotate and n else 0
                order = list(arms[k:]) + list(arms[:k])
                for a in order:
                    store[a].add(self._run(a, task, phase, timed=True, reserve=reserve))

    def _measure_chunked(self, arms: Sequence[Arm], repeats: int, phase: str) -> None:
        """`_measure` in chunks of `plan.chunk` arms: interleaved within a chunk, and a budget cut (estimates can be
        wrong) costs at most the arms of the chunk in flight, never the whole stage."""
        k = max(1, self.plan.chunk)
        for i in range(0, len(arms), k):
            self._measure(arms[i:i + k], repeats, phase, reserve=self._reserve)

    def _affordable(self, arms: list[Arm], repeats: int, reserve: float) -> list[Arm]:
        """The longest prefix of `arms` whose runs (typical cost) fit the budget left after `reserve`."""
        if self.max_seconds is None:
            return arms
        per_arm = repeats * sum(self.typical(t) for t in self.tasks)
        left = self.max_seconds - self.elapsed() - reserve
        if per_arm <= 0:
            return arms
        k = max(0, min(len(arms), int(left // per_arm)))
        if k < len(arms):
            self.budget_hit = True
        return arms[:k]

    def confirm_cost(self, repeats: int) -> float:
        return 2 * repeats * sum(self.estimate(t) for t in self.tasks)

    def pays_cost(self, repeats: int = 1) -> float:
        """Stage 7's time: the chosen arm and the target alone, `repeats` runs each per task (the search keeps one
        repeat's worth back; more run when the budget leaves them)."""
        return 2 * min(repeats, self.plan.pays_repeats) * sum(self.estimate(t) for t in self.tasks)

    def _pays(self, arm: Arm) -> dict[Arm | None, ArmStats]:
        """Stage 7: `arm` and the target alone head to head, alternating which runs first, as many repeats as the
        budget leaves (none: the report falls back on stage 1's references)."""
        store: dict[Arm | None, ArmStats] = {}
        reps = self.plan.pays_repeats
        while reps > 0 and not self.fits(self.pays_cost(reps)):
            reps -= 1
        if reps == 0:
            return store
        try:
            self._measure([arm, None], reps, "pays", store=store)  # type: ignore[list-item]
        except TimeBudgetSpent:
            pass
        return store

    def run(self) -> SearchResult:
        self._t0 = self.clock()
        hook = hasattr(self.runner, "should_stop")
        if hook:       # a hard deadline inside each run: the overshoot is at most one window, whatever the estimates
            self.runner.should_stop = (None if self.max_seconds is None else   # type: ignore[attr-defined]
                                       (lambda: self.elapsed() > self.max_seconds))
        try:
            res = self._run_stages()
            if res.decision != "budget" and self.plan.pays_repeats > 0:
                res.pays = self._pays(res.chosen)
                res.seconds, res.budget_hit = self.elapsed(), self.budget_hit
                h = res._head_to_head()
                if h is not None and h["speedup"] < PAYS_MIN:
                    res.draft_off, res.decision = True, "target_alone"
                    res.reason = (f"the target alone decoded {1 / h['speedup'] - 1:.0%} faster than the best drafted "
                                  f"setting (block={res.chosen.block} spec_min_p={res.chosen.spec_min_p:g}) head to "
                                  f"head ({h['target_only_geomean_tok_s']:.1f} vs {h['geomean_tok_s']:.1f} tok/s "
                                  f"geomean), so the config drafts nothing (block 1); strata-run --block "
                                  f"{res.chosen.block} drafts anyway")
            return res
        finally:
            if hook:
                self.runner.should_stop = None   # type: ignore[attr-defined]

    def measured(self) -> str:
        """What was measured so far, in words (for a search the budget cut short)."""
        done = [t for t in self.tasks if t in self.target_tok_s]
        parts = []
        if done:
            geo = geomean_of(self.target_tok_s[t] for t in done)
            parts.append(f"the target alone on {len(done)} of {len(self.tasks)} prompts ({geo:.1f} tok/s geomean)")
        spec = [x for x in self.samples if x.arm is not None and x.timed]
        if spec:
            arms = {x.arm for x in spec}
            full = sum(1 for a in arms if self.arms.get(a) and self.arms[a].geomean(self.tasks) is not None)
            parts.append(f"{len(spec)} speculative run{'s' * (len(spec) != 1)} of {len(arms)} "
                         f"arm{'s' * (len(arms) != 1)} ({full} measured on every prompt)")
        return "measured " + " and ".join(parts) if parts else "nothing was measured"

    def _run_stages(self) -> SearchResult:
        p = self.plan
        decision, reason, winner = "budget", "", None
        chosen = self.default
        try:
            self._reference_pass()
        except TimeBudgetSpent:
            reason = (f"the {self.max_seconds:.3g} s budget ran out while measuring the target alone "
                      f"({self.measured()}); kept the default {self.default.label}")
            return self._result(chosen, None, decision, reason)
        try:
            winner = self._sweep()
        except TimeBudgetSpent:
            winner = self._best()
        if winner is None:
            reason = (f"the {self.max_seconds:.3g} s budget ran out before any arm was measured on every prompt "
                      f"({self.measured()}); kept the default {self.default.label}")
            return self._result(chosen, None, "budget", reason)
        if winner == self.default:
            d = self.arms[self.default].geomean(self.tasks)
            n = len(self._top(len(self.arms)))
            cut = "; the budget cut the sweep short" if self.budget_hit else ""
            reason = (f"the default {self.default.label} was the fastest of the {n} arms measured "
                      f"({d:.2f} tok/s geomean{cut})")
            return self._result(self.default, winner, "default_is_best", reason)
        # head to head: winner vs default, alternating order, as many repeats as fit (at least one)
        reps = p.confirm_repeats
        while reps > 1 and not self.fits(self.confirm_cost(reps), self.pays_cost()):
            reps -= 1
        try:
            self._measure([winner, self.default], reps, "confirm", store=self.confirm)
        except TimeBudgetSpent:
            pass
        w = self.confirm.get(winner, ArmStats(winner)).geomean(self.tasks)
        d = self.confirm.get(self.default, ArmStats(self.default)).geomean(self.tasks)
        if w is None or d is None:
            reason = (f"the {self.max_seconds:.3g} s budget ran out before {winner.label} could be confirmed against "
                      f"the default ({self.measured()}); kept the default {self.default.label}")
            return self._result(self.default, winner, "budget", reason)
        gain = w / d - 1.0
        if gain > p.min_gain:
            reason = (f"{winner.label} decoded {gain:.1%} faster than the default {self.default.label} head to head "
                      f"({w:.2f} vs {d:.2f} tok/s geomean), above the {p.min_gain:.0%} bar")
            return self._result(winner, winner, "winner", reason)
        reason = (f"{winner.label} was only {gain:+.1%} against the default {self.default.label} head to head "
                  f"({w:.2f} vs {d:.2f} tok/s geomean), not above the {p.min_gain:.0%} bar: kept the default")
        return self._result(self.default, winner, "kept_default", reason)

    def _reference_pass(self) -> None:
        """Target alone, twice per task: a warm-up, then the timed reference; both must agree."""
        self._planned += 2 * len(self.tasks)
        for task in self.tasks:
            outs = []
            for timed in (False, True):
                if not self.fits(self.estimate(task)):
                    self.budget_hit = True
                    raise TimeBudgetSpent("reference")
                t = self.clock()
                out = self.runner(None, task)
                if out.cancelled:
                    self.budget_hit = True
                    raise TimeBudgetSpent("reference")
                self._note(None, task, "reference", out, self.clock() - t, timed=timed)
                outs.append(list(out.token_ids))
            if outs[0] != outs[1]:
                raise LosslessError(
                    f"the target alone gave two different greedy outputs for the '{task}' prompt; calibration needs "
                    f"a deterministic target (a runtime bug or a nondeterministic kernel).")
            if task in self.refs and self.refs[task] != outs[0]:
                raise LosslessError(f"the target alone does not reproduce the given reference of the '{task}' prompt.")
            self.refs[task] = outs[0]
            self.target_tok_s[task] = float(self.samples[-1].tok_s)

    def _note(self, arm: Arm | None, task: str, phase: str, out: RunOutcome, wall: float, *, timed: bool) -> Sample:
        s = Sample(phase, arm, task, float(out.tok_s), float(out.decode_s), wall, int(out.accepted),
                   int(out.proposed), int(out.windows), timed)
        self.samples.append(s)
        if self.progress:
            self.progress(f"{phase}: {arm.label if arm else 'target alone'} [{task}]", len(self.samples),
                          max(self._planned, len(self.samples)))
        return s

    def _best(self, pool: Iterable[Arm] | None = None) -> Arm | None:
        pool = set(self.arms) if pool is None else set(pool)
        ranked = [(g, a) for a in pool if a in self.arms and (g := self.arms[a].geomean(self.tasks)) is not None]
        if not ranked:
            return None
        return sorted(ranked, key=lambda x: (-x[0], x[1]))[0][1]

    def _top(self, k: int, pool: Iterable[Arm] | None = None) -> list[Arm]:
        pool = self.arms if pool is None else pool
        ranked = [(g, a) for a in pool if (g := self.arms[a].geomean(self.tasks)) is not None]
        return [a for _, a in sorted(ranked, key=lambda x: (-x[0], x[1]))[:k]]

    def _sweep(self) -> Arm | None:
        p = self.plan
        blocks = sorted({a.block for a in self.grid})
        ladder = block_ladder(blocks[0], blocks[-1])
        ladder = sorted(set(ladder) | {self.default.block})
        coarse = [a for a in self.grid if a.block in ladder]
        # default first so it is measured even when the budget cuts the coarse pass short
        coarse = [self.default] + [a for a in _spread(coarse) if a != self.default]

        # warm-up: one untimed run per block size (on the first task), before any timing; where the step's width
        # follows the block, the target alone at that width too (its cost and its reference)
        if p.warmup:
            self._planned += len(ladder) * (2 if self.width_sensitive else 1)
            for b in ladder:
                arm = next(a for a in coarse if a.block == b)
                self._run(arm, self.tasks[0], "warmup", timed=False, reserve=self.confirm_cost(1))
                if self.width_sensitive:
                    self._width_ref(self.tasks[0], b, reserve=self.confirm_cost(1))

        # budget plan: the whole coarse pass plus as many confirmation repeats as fit; else cut the coarse pass
        coarse_cost = len(coarse) * p.coarse_repeats * sum(self.typical(t) for t in self.tasks)
        reps = p.confirm_repeats
        while reps > 1 and not self.fits(coarse_cost, self.confirm_cost(reps)):
            reps -= 1
        self._reserve = self.confirm_cost(reps) + self.pays_cost()
        todo = self._affordable(coarse, p.coarse_repeats, self._reserve)
        self._measure_chunked(todo, p.coarse_repeats, "coarse")
        if len(todo) < len(coarse):
            return self._best()

        # refine: the block sizes between the ladder rungs next to the best coarse arms, same floor
        new: list[Arm] = []
        for a in self._top(p.refine_top):
            i = ladder.index(a.block)
            lo = ladder[i - 1] if i > 0 else a.block
            hi = ladder[i + 1] if i + 1 < len(ladder) else a.block
            for b in range(lo + 1, hi):
                cand = Arm(b, a.spec_min_p)
                if cand in self.grid and cand not in self.arms and cand not in new:
                    if self._cannot_win(cand):
                        self.pruned.append(cand)
                        continue
                    new.append(cand)
        if new:
            todo = self._affordable(new, p.coarse_repeats, self._reserve)
            for b in sorted({a.block for a in todo} - set(ladder)):      # warm up window widths not seen yet
                if p.warmup:
                    self._planned += 1
                    self._run(next(a for a in todo if a.block == b), self.tasks[0], "warmup", timed=False,
                              reserve=self._reserve)
            self._measure_chunked(todo, p.coarse_repeats, "refine")
            if len(todo) < len(new):
                return self._best()

        # successive halving: more repeats for the best few; each round keeps the top of the survivors
        survivors = self._top(p.halving[0] if p.halving else 1)
        for i, keep in enumerate(p.halving):
            if i > 0:
                survivors = self._top(keep, survivors)
            if len(survivors) <= 1:
                break
            todo = self._affordable(survivors, p.halving_repeats, self._reserve)
            if len(todo) < 2:
                break
            self._measure(todo, p.halving_repeats, "halving", reserve=self._reserve)
            survivors = todo
        return self._best(survivors)

    def cost_at(self, width: int) -> float | None:
        """The target step's cost at `width` relative to width 1, interpolated between measured widths."""
        pts = sorted({1: 1.0, **self.step_cost}.items())
        if len(pts) < 2 or width > pts[-1][0]:
            return None
        for (w0, c0), (w1, c1) in zip(pts, pts[1:], strict=False):
            if w0 <= width <= w1:
                return c0 + (c1 - c0) * (width - w0) / (w1 - w0)
        return None

    def _cannot_win(self, arm: Arm) -> bool:
        """True when even a perfect drafter (every proposal accepted, drafting free) at this block could not beat
        the best arm measured: the target's tok/s x block / the step's cost at that width."""
        c = self.cost_at(arm.block)
        tgt = geomean_of(self.target_tok_s.get(t) for t in self.tasks)
        best = self._best()
        if c is None or tgt is None or best is None:
            return False
        g = self.arms[best].geomean(self.tasks)
        return g is not None and tgt * arm.block / c < g

    def _result(self, chosen: Arm, winner: Arm | None, decision: str, reason: str) -> SearchResult:
        return SearchResult(tasks=self.tasks, default=self.default, chosen=chosen, winner=winner, decision=decision,
                            reason=reason, arms=self.arms, confirm=self.confirm, target_tok_s=self.target_tok_s,
                            samples=self.samples, seconds=self.elapsed(), budget_s=self.max_seconds,
                            budget_hit=self.budget_hit, grid_size=len(self.grid), step_cost=dict(self.step_cost),
                            pruned=list(self.pruned))


def _spread(arms: Sequence[Arm]) -> list[Arm]:
    """Order arms so that any prefix covers the blocks and floors evenly (matters only when the budget cuts)."""
    blocks = _bisect_order(sorted({a.block for a in arms}))
    floors = sorted({a.spec_min_p for a in arms})
    present = set(arms)
    out: list[Arm] = []
    for j in range(len(floors)):            # round j: one arm per block, floors rotating across blocks
        for i, b in enumerate(blocks):
            a = Arm(b, floors[(i + j) % len(floors)])
            if a in present and a not in out:
                out.append(a)
    return out + [a for a in arms if a not in out]


def _bisect_order(xs: Sequence[int]) -> list[int]:
    """Ends first, then the midpoints of the gaps, breadth first: any prefix spans the range."""
    xs = list(xs)
    if len(xs) <= 2:
        return xs
    out, queue = [xs[0], xs[-1]], [(0, len(xs) - 1)]
    while queue:
        lo, hi = queue.pop(0)
        if hi - lo < 2:
            continue
        m = (lo + hi) // 2
        out.append(xs[m])
        queue += [(lo, m), (m, hi)]
    return out


def exhaustive(runner: Runner, tasks: Sequence[str], grid: Sequence[Arm], references: dict[str, list[int]], *,
               repeats: int = 3, warmup: bool = True, clock: Callable[[], float] = time.perf_counter,
               progress: ProgressFn | None = None) -> tuple[dict[Arm, ArmStats], list[Sample], float]:
    """Every arm of `grid`, `repeats` interleaved timed repeats per task (lossless-checked), no pruning, no budget."""
    s = Search(runner, tasks, grid, grid[0], references=references, clock=clock, progress=progress)
    s._t0 = clock()
    if warmup:
        for b in sorted({a.block for a in grid}):
            s._planned += 1
            s._run(next(a for a in grid if a.block == b), tasks[0], "warmup", timed=False)
    s._measure(sorted(grid), repeats, "grid")
    return s.arms, s.samples, s.elapsed()
