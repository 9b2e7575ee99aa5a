"""The calibration search against a deterministic fake engine whose speed is a known function of the settings."""

from __future__ import annotations

import itertools

import pytest

from calibrate.api import calibrate_engine
from calibrate.search import Arm, LosslessError, Plan, block_ladder, candidate_arms
from tests.calibrate.calib_fakes import FAKE_PROMPTS, TASKS, FakeClock, FakeEngine, bowl_speed


def run(engine: FakeEngine, clock: FakeClock, **kw):
    kw.setdefault("max_seconds", None)
    return calibrate_engine(engine, prompts=FAKE_PROMPTS, new_tokens=32, clock=clock, **kw)[0]


def flat_with_bump(bump_arm: tuple[int, float], factor: float, base: float = 100.0):
    """Every arm decodes at `base`, one arm at base * factor."""
    def speed(block: int, p: float, task: str) -> float:
        return base * factor if (block, p) == bump_arm else base
    return speed


@pytest.mark.parametrize("best", [(5, 0.3), (2, 0.0), (8, 0.7), (7, 0.5)])
def test_finds_the_optimum_and_beats_the_default(best):
    clock = FakeClock()
    eng = FakeEngine(bowl_speed(*best), clock, max_block=8)
    sr = run(eng, clock)
    assert (sr.chosen.block, sr.chosen.spec_min_p) == best
    assert sr.decision == "winner" and sr.winner == sr.chosen
    assert sr.default == Arm(4, 0.5)              # read from the engine's default_block / default_spec_min_p
    assert sr.gain is not None and sr.gain > 0.03
    d = sr.to_dict()
    assert d["settings"] == {"block": best[0], "spec_min_p": best[1]}
    assert d["default"]["block"] == 4 and d["winner"]["block"] == best[0]
    assert set(d["per_task_tok_s"]) == set(TASKS) and d["proposed"] > 0


def test_finds_the_optimum_with_noise():
    clock = FakeClock()
    eng = FakeEngine(bowl_speed(6, 0.3), clock, max_block=16, noise=0.02)
    sr = run(eng, clock)
    true = bowl_speed(6, 0.3)
    best = max(true(b, p, "code") for b, p in itertools.product(range(2, 17), (0.0, 0.3, 0.5, 0.7)))
    assert true(sr.chosen.block, sr.chosen.spec_min_p, "code") >= 0.97 * best


@pytest.mark.parametrize("factor,decision", [(1.02, "kept_default"), (1.029, "kept_default"), (1.05, "winner")])
def test_three_percent_rule(factor, decision):
    clock = FakeClock()
    eng = FakeEngine(flat_with_bump((6, 0.7), factor), clock, max_block=8)
    sr = run(eng, clock)
    assert sr.winner == Arm(6, 0.7)               # the sweep finds the bump...
    assert sr.decision == decision                # ...but only a >3% head-to-head gain replaces the default
    assert sr.chosen == (Arm(6, 0.7) if decision == "winner" else Arm(4, 0.5))
    assert sr.gain == pytest.approx(factor - 1, abs=1e-9)
    assert "3%" in sr.reason
    # both arms were measured head to head, alternating which one runs first
    conf = [s for s in sr.samples if s.phase == "confirm"]
    assert {s.arm for s in conf} == {Arm(6, 0.7), Arm(4, 0.5)}
    firsts = [conf[i].arm for i in range(0, len(conf), 2)]
    assert len(set(firsts)) == 2


def test_default_is_best_needs_no_confirmation():
    clock = FakeClock()
    eng = FakeEngine(bowl_speed(4, 0.5), clock, max_block=8)
    sr = run(eng, clock)
    assert sr.decision == "default_is_best" and sr.chosen == Arm(4, 0.5)
    assert not [s for s in sr.samples if s.phase == "confirm"]


def test_prunes_the_grid():
    clock = FakeClock()
    eng = FakeEngine(bowl_speed(5, 0.3), clock, max_block=16)
    sr = run(eng, clock)
    grid = candidate_arms(16, extra=[Arm(4, 0.5)])
    assert sr.grid_size == len(grid) == 60
    measured = sr.measured_arms()
    assert len(measured) <= 34                    # 7 ladder blocks x 4 floors + the refined neighbours
    assert {a.block for a in measured} >= set(block_ladder(2, 16))
    spec_timed = sr.timed_runs()
    assert spec_timed < len(grid) * len(TASKS) * 1.0    # fewer timed runs than ONE pass over the whole grid
    # repeats go to the leaders: the chosen arm has more samples than a pruned one
    st = sr.arms
    assert st[sr.chosen].repeats() >= 3
    assert min(st[a].repeats() for a in measured) == 1
    # every measured arm ran every task (median per task, geomean across tasks)
    assert all(set(st[a].samples) == set(TASKS) for a in measured)


def test_interleaved_order():
    """Within a chunk of arms, one task runs every arm back to back (so drift hits every arm alike), the arm order
    rotates between tasks, and every coarse arm runs every task exactly once."""
    clock = FakeClock()
    eng = FakeEngine(bowl_speed(5, 0.3), clock, max_block=8)
    sr = run(eng, clock, plan=Plan(chunk=8))
    coarse = [s for s in sr.samples if s.phase == "coarse"]
    groups = [list(g) for _, g in itertools.groupby(coarse, key=lambda s: s.task)]
    assert [g[0].task for g in groups] == list(TASKS) * (len(groups) // len(TASKS))
    assert all(len({s.arm for s in g}) == len(g) <= 8 for g in groups)
    for i in range(0, len(groups), len(TASKS)):          # one chunk: the same arms on every task, rotated
        chunk = groups[i:i + len(TASKS)]
        assert all(sorted(s.arm for s in g) == sorted(s.arm for s in chunk[0]) for g in chunk)
        assert chunk[0][0].arm != chunk[1][0].arm
    arms = {s.arm for s in coarse}
    assert len(coarse) == len(arms) * len(TASKS) == 20 * len(TASKS)


def test_warmup_runs_are_not_timed_and_references_come_first():
    clock = FakeClock()
    eng = FakeEngine(bowl_speed(5, 0.3), clock, max_block=8)
    sr = run(eng, clock)
    assert [s.phase for s in sr.samples[:8]] == ["reference"] * 8
    assert all(s.arm is None for s in sr.samples[:8])
    warm = [s for s in sr.samples if s.phase == "warmup"]
    assert warm and not any(s.timed for s in warm)
    assert {s.arm.block for s in warm} >= set(block_ladder(2, 8))
    assert all(s.arm not in sr.arms or s not in sum(sr.arms[s.arm].samples.values(), []) for s in warm)


@pytest.mark.parametrize("budget", [0.3, 0.5, 3.0, 8.0, 15.0, 25.0, 40.0])
def test_honours_the_time_budget(budget):
    clock = FakeClock()
    eng = FakeEngine(bowl_speed(5, 0.3), clock, max_block=8)
    unlimited = run(FakeEngine(bowl_speed(5, 0.3), FakeClock(), max_block=8), FakeClock())
    sr = run(eng, clock, max_seconds=budget)
    if eng.cancelled:       # a run stopped at the deadline: past it by at most one window (2 tokens here)
        assert clock.t - 1000.0 <= budget + 2 / 30.0 + 1e-9 and sr.budget_hit
    else:
        assert clock.t - 1000.0 <= budget + 1e-9
    assert sr.seconds <= budget + 2 / 30.0 + 1e-9
    if budget < 0.5 * 32 / 40 + 0.01:     # not even the first target-only run fits: nothing was measured
        assert sr.samples == [] and sr.decision == "budget" and "nothing was measured" in sr.reason
    if budget < unlimited.seconds:
        assert sr.budget_hit
    if sr.decision == "budget":
        assert sr.chosen == sr.default          # never a choice that was not confirmed
    if sr.decision == "winner":
        assert sr.gain > 0.03


@pytest.mark.parametrize("slow_after", [1, 4, 7, 12])
def test_overshoot_stays_within_a_tenth_of_the_budget_when_runs_get_slower(slow_after):
    """Estimates come from runs measured so far; when the machine turns 30x slower mid-search (another program
    starts), a whole run would overshoot by far more than planned. The deadline inside each run keeps the overshoot
    under 10% of the budget (here one window of this fake is 1.5 s slow), and the result says what was measured."""
    budget = 20.0
    clock = FakeClock()
    eng = FakeEngine(bowl_speed(5, 0.3), clock, max_block=8, slow_after=slow_after, slowdown=30.0)
    sr = run(eng, clock, max_seconds=budget)
    assert clock.t - 1000.0 <= 1.1 * budget and sr.seconds <= 1.1 * budget
    assert eng.cancelled >= 1 and sr.budget_hit
    if sr.decision == "budget":
        assert sr.chosen == sr.default and "measured" in sr.reason
        assert "nothing was measured" in sr.reason or "the target alone on" in sr.reason
    # without the deadline (a runner that does not take it) the same slowdown overshoots by a whole slow run
    from calibrate.search import RunOutcome, Search

    clock2 = FakeClock()
    eng2 = FakeEngine(bowl_speed(5, 0.3), clock2, max_block=8, slow_after=slow_after, slowdown=30.0)

    def plain(arm, task):
        kw = {"draft": arm is not None, "max_new_tokens": 32}
        if arm is not None:
            kw.update(block=arm.block, spec_min_p=arm.spec_min_p)
        res = eng2.generate(FAKE_PROMPTS[task], **kw)
        return RunOutcome(token_ids=res.token_ids, tok_s=res.stats["decode_tok_s"], decode_s=res.stats["decode_s"])

    grid = candidate_arms(8)
    Search(plain, list(TASKS), grid, Arm(4, 0.5), max_seconds=budget, clock=clock2).run()
    assert clock2.t - 1000.0 > 1.1 * budget          # the case the deadline exists for


def test_budget_spent_in_the_head_to_head_says_what_it_measured():
    """The budget can also run out between the sweep and the head-to-head confirmation (here the machine turns 30x
    slower after the 20th run): the default is kept, and the reason names the arm left unconfirmed and what was
    measured, as every other way of running out does."""
    clock = FakeClock()
    eng = FakeEngine(bowl_speed(5, 0.3), clock, max_block=8, slow_after=20, slowdown=30.0)
    sr = run(eng, clock, max_seconds=30.0)
    assert sr.decision == "budget" and sr.chosen == sr.default == Arm(4, 0.5) and sr.budget_hit
    assert f"before {sr.winner.label} could be confirmed" in sr.reason
    assert "measured the target alone on 4 of 4 prompts" in sr.reason and "30 s budget" in sr.reason


def test_budget_too_small_for_anything_keeps_the_default():
    clock = FakeClock()
    eng = FakeEngine(bowl_speed(5, 0.3), clock, max_block=8, prefill_s=1.0)
    sr = run(eng, clock, max_seconds=2.0)
    assert sr.decision == "budget" and sr.chosen == Arm(4, 0.5) and "budget" in sr.reason
    assert clock.t - 1000.0 <= 2.0


def test_generous_budget_matches_unlimited():
    a = run(FakeEngine(bowl_speed(5, 0.3), c1 := FakeClock(), max_block=8), c1)
    b = run(FakeEngine(bowl_speed(5, 0.3), c2 := FakeClock(), max_block=8), c2, max_seconds=10_000)
    assert a.chosen == b.chosen and len(a.samples) == len(b.samples) and not b.budget_hit


@pytest.mark.parametrize("broken", [(4, 0.5, "code"), (6, 0.3, "long"), (2, 0.7, "math")])
def test_a_non_lossless_arm_fails_loudly(broken):
    clock = FakeClock()
    eng = FakeEngine(bowl_speed(5, 0.3), clock, max_block=8, broken=broken)
    with pytest.raises(LosslessError) as e:
        run(eng, clock)
    msg = str(e.value)
    assert f"block={broken[0]} spec_min_p={broken[1]:g}" in msg
    assert f"'{broken[2]}' prompt" in msg and "generated token 3" in msg and "runtime bug" in msg


def test_a_nondeterministic_target_is_reported():
    clock = FakeClock()
    eng = FakeEngine(bowl_speed(5, 0.3), clock, max_block=8)
    orig = eng.generate
    n = {"k": 0}

    def flaky(prompt, **kw):
        res = orig(prompt, **kw)
        if not kw.get("draft", True):
            n["k"] += 1
            if n["k"] == 2:
                res.token_ids[0] += 1
        return res

    eng.generate = flaky
    with pytest.raises(LosslessError, match="target alone gave two different greedy outputs"):
        run(eng, clock)


def test_candidates_include_current_and_default():
    arms = candidate_arms(4, extra=[Arm(3, 0.45), Arm(9, 0.5)])
    assert Arm(3, 0.45) in arms and Arm(9, 0.5) not in arms
    assert {a.block for a in arms} == {2, 3, 4} and {a.spec_min_p for a in arms} == {0.0, 0.3, 0.45, 0.5, 0.7}
    assert candidate_arms(1) == []
    assert block_ladder(2, 16) == [2, 3, 4, 6, 8, 12, 16] and block_ladder(2, 7) == [2, 3, 4, 6, 7]


def test_plan_knobs_change_the_work():
    clock = FakeClock()
    eng = FakeEngine(bowl_speed(5, 0.3), clock, max_block=8)
    sr = run(eng, clock, plan=Plan(halving=(), confirm_repeats=1, warmup=False))
    assert not [s for s in sr.samples if s.phase in ("halving", "warmup")]
    assert len([s for s in sr.samples if s.phase == "confirm"]) == 2 * len(TASKS)


def test_current_floor_is_crossed_with_every_block():
    from calibrate.api import candidate_grid, engine_settings

    clock = FakeClock()
    eng = FakeEngine(bowl_speed(5, 0.3), clock, max_block=6)
    cfg = {"speculative": {"block": 3, "spec_min_p": 0.45, "source": "user"}}
    es = engine_settings(eng, cfg)
    assert es.current == Arm(3, 0.45) and es.default == Arm(4, 0.5) and es.default_from == "engine"
    grid = candidate_grid(es)
    assert {a for a in grid if a.spec_min_p == 0.45} == {Arm(b, 0.45) for b in range(2, 7)}
    assert len(grid) == 5 * 5


def test_default_comes_from_engine_then_uncalibrated_config_then_runtime():
    from types import SimpleNamespace

    from calibrate.api import engine_settings

    bare = SimpleNamespace(drafter=SimpleNamespace(kind="dflash2", max_block=8))
    uncal = {"speculative": {"block": 3, "spec_min_p": 0.5, "source": "default"}}
    cal = {"speculative": {"block": 6, "spec_min_p": 0.7, "source": "calibrated"}}
    assert engine_settings(bare, uncal).default == Arm(3, 0.5)
    es = engine_settings(bare, cal)
    assert es.default == Arm(8, 0.0) and es.default_from == "runtime fallback" and es.current == Arm(6, 0.7)
    # after a calibration the wizard keeps our table under [calibration.results]: a forced rerun beats the same default
    recal = {**cal, "calibration": {"results": {"default": {"block": 3, "spec_min_p": 0.5}}}}
    assert engine_settings(bare, recal).default == Arm(3, 0.5)
    mtp = SimpleNamespace(drafter=SimpleNamespace(kind="mtp", max_block=16))
    assert engine_settings(mtp, cal).default == Arm(4, 0.0)        # runtime.engine.MTP_DEFAULT_BLOCK
    none = SimpleNamespace(drafter=None)
    assert engine_settings(none, {}).max_block == 1


def test_a_cut_short_calibration_prints_what_it_measured_and_no_empty_table():
    """The command line's report of a search the budget stopped before any arm was measured on every prompt: no
    sweep table (its rows would be dashes), a sentence of what was measured, the budget and the way to give more."""
    import io

    from rich.console import Console

    from calibrate.api import result_from_search
    from calibrate.report import has_sweep
    from setup_wizard.cli import _print_calibration

    clock = FakeClock()         # the machine turns 30x slower after 16 runs: the sweep stops mid-chunk
    eng = FakeEngine(bowl_speed(5, 0.3), clock, max_block=8, slow_after=16, slowdown=30.0)
    sr, facts = calibrate_engine(eng, prompts=FAKE_PROMPTS, new_tokens=32, clock=clock, max_seconds=30.0)
    assert sr.decision == "budget" and sr.arms and not has_sweep(sr.to_dict())   # arms partly measured only
    facts.update(total_s=31.3, budget_s=31.5, engine_build_s=0.2, threads={"threads": 1})
    res = result_from_search(None, sr, facts)
    buf = io.StringIO()
    _print_calibration(res, Console(file=buf, width=200))
    out = buf.getvalue()
    assert "calibration sweep" not in out and "tok/s medians" not in out
    assert "measured the target alone on 4 of 4 prompts" in out and "speculative runs of" in out
    assert "calibration took 31.3 s of its 31.5 s budget (0.2 s loading the engine, 1 CPU thread)" in out
    assert "--calibrate-seconds" in out
    # with an arm measured on every prompt the table is printed
    sr2, facts2 = calibrate_engine(FakeEngine(bowl_speed(5, 0.3), c2 := FakeClock(), max_block=8),
                                   prompts=FAKE_PROMPTS, new_tokens=32, clock=c2, max_seconds=None)
    buf = io.StringIO()
    _print_calibration(result_from_search(None, sr2, facts2), Console(file=buf, width=200))
    assert "calibration sweep" in buf.getvalue()


def test_each_arm_runs_at_its_own_width_and_is_checked_against_that_width():
    """On a GPU-like engine the target alone runs at width 1 and each arm at its block; an arm whose greedy ids
    differ from width 1's but equal the target alone at its own width is lossless (BF16 width rounding), and the
    step's cost by width is recorded from the target-alone runs."""
    from tests.calibrate.calib_fakes import WidthFakeEngine

    clock = FakeClock()
    eng = WidthFakeEngine(bowl_speed(5, 0.3), clock, max_block=8, step_cost=lambda w: 1 + 0.1 * (w - 1), flips=(6,))
    sr = run(eng, clock)
    assert (sr.chosen.block, sr.chosen.spec_min_p) == (5, 0.3)
    assert (False, 1) in eng.widths_seen                                      # the target alone at width 1
    assert {w for d, w in eng.widths_seen if d} == {a.block for a in sr.arms}   # every arm at its own block
    cost = sr.to_dict()["step_cost_by_width"]
    assert cost["4"] == pytest.approx(1.3, abs=1e-3) and cost["8"] == pytest.approx(1.7, abs=1e-3)


def test_an_arm_matching_no_reference_still_fails_on_a_width_sensitive_engine():
    from tests.calibrate.calib_fakes import WidthFakeEngine

    clock = FakeClock()
    eng = WidthFakeEngine(bowl_speed(5, 0.3), clock, max_block=8, flips=(6,), broken=(4, 0.5, "code"))
    with pytest.raises(LosslessError, match="block=4"):
        run(eng, clock)


def test_blocks_that_cannot_pay_for_their_width_are_not_refined():
    """A step whose cost grows as fast as the block (cost = width) caps any arm at the target's own speed, so once
    a measured arm beats that, no block between the ladder rungs is worth a run."""
    from tests.calibrate.calib_fakes import WidthFakeEngine

    clock = FakeClock()
    eng = WidthFakeEngine(bowl_speed(5, 0.3, peak=100.0), clock, max_block=16, step_cost=lambda w: float(w))
    sr = run(eng, clock)
    assert sr.pruned and all(a.block not in block_ladder(2, 16) for a in sr.pruned)
    assert not any(s.phase == "refine" for s in sr.samples)
    assert sr.to_dict()["pruned_by_cost_bound"]


def _summary(sr) -> list[str]:
    from types import SimpleNamespace

    from calibrate.report import summary_lines

    rec = {**sr.to_dict(), "seconds": None}
    return summary_lines(SimpleNamespace(block=sr.chosen.block, spec_min_p=sr.chosen.spec_min_p,
                                         decision=sr.decision, reason=sr.reason, record=rec, reused=False, path=None))


def test_the_reported_speedup_is_head_to_head_with_the_target_alone():
    """Stage 7 times the chosen arm and the target alone alternately: on a machine that turns 2x slower after the
    8 reference runs, the report states the true speed-up, not the half of it the early references would give."""
    clock = FakeClock()
    eng = FakeEngine(bowl_speed(5, 0.3), clock, max_block=8, slow_after=8, slowdown=2.0)
    sr = run(eng, clock)
    pays = [s for s in sr.samples if s.phase == "pays"]
    assert {s.arm for s in pays} == {sr.chosen, None} and len(pays) == 2 * Plan().pays_repeats * len(TASKS)
    assert len({pays[i].arm for i in range(0, len(pays), 2)}) == 2          # which one runs first alternates
    d = sr.to_dict()
    true = bowl_speed(5, 0.3)(sr.chosen.block, sr.chosen.spec_min_p, "code") / eng.target_speed
    assert d["head_to_head"]["speedup"] == pytest.approx(true, rel=1e-3)
    assert d["geomean_tok_s"] / d["target_only_geomean_tok_s"] == pytest.approx(true / 2, rel=1e-3)
    assert f"speculation pays here: {true:.2f}x the target alone" in "\n".join(_summary(sr))
    assert "timed alternately" in "\n".join(_summary(sr))


def test_without_the_head_to_head_the_report_says_what_it_compared():
    clock = FakeClock()
    eng = FakeEngine(bowl_speed(5, 0.3, peak=30.0), clock, max_block=8)      # slower than the target alone
    sr = run(eng, clock, plan=Plan(pays_repeats=0))
    assert not [s for s in sr.samples if s.phase == "pays"] and sr.to_dict()["head_to_head"] is None
    text = "\n".join(_summary(sr))
    assert "the target alone decoded faster" in text and "timed before the sweep" in text


def test_a_drafter_that_loses_head_to_head_is_turned_off():
    """Stage 7 finds the target alone clearly faster (a drafter at 30 tok/s at best against 40): the settings draft
    nothing (block 1, decision target_alone), the best drafted arm stays in the record, and the summary says how to
    draft anyway. At 0.97x (within noise) drafting stays on."""
    from calibrate.api import result_from_search
    from calibrate.report import summary_lines
    from calibrate.search import PAYS_MIN

    clock = FakeClock()
    sr = run(FakeEngine(bowl_speed(5, 0.3, peak=30.0), clock, max_block=8), clock)
    d = sr.to_dict()
    assert d["head_to_head"]["speedup"] == pytest.approx(0.75, rel=1e-3) and 0.75 < PAYS_MIN
    assert sr.decision == "target_alone" and sr.draft_off
    assert d["settings"] == {"block": 1, "spec_min_p": sr.chosen.spec_min_p}
    assert d["drafted_settings"] == sr.chosen.to_dict() and sr.chosen.block > 1
    res = result_from_search(None, sr, {})
    assert (res.block, res.source, res.decision) == (1, "calibrated", "target_alone")
    text = "\n".join(summary_lines(res))
    assert "the target alone decoded 33% faster" in text and "drafts nothing (block 1)" in text
    assert f"strata-run --block {sr.chosen.block} drafts anyway" in text
    clock = FakeClock()
    near = run(FakeEngine(bowl_speed(5, 0.3, peak=38.8), clock, max_block=8), clock)
    assert near.to_dict()["head_to_head"]["speedup"] == pytest.approx(0.97, rel=1e-3)
    assert not near.draft_off and near.settings == near.chosen
