"""Rich output for calibration: a progress bar while measuring and a table of the sweep afterwards.

Everything goes to stderr so that `--json` on stdout stays one clean JSON object.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


def stderr_console() -> Console:
    return Console(stderr=True)


@contextmanager
def progress_bar(console: Console | None = None, enabled: bool = True) -> Iterator[Any]:
    """Yields a `(message, done, planned)` callback that drives a rich progress bar (or does nothing)."""
    if not enabled:
        yield None
        return
    console = console or stderr_console()
    with Progress(TextColumn("[bold]calibrating[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=console, transient=False) as prog:
        tid = prog.add_task("", total=1)

        def update(message: str, done: int, planned: int) -> None:
            prog.update(tid, completed=done, total=max(planned, done, 1), description=message)

        yield update


def _fmt(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def has_sweep(record: dict[str, Any]) -> bool:
    """Whether the record holds an arm measured on every prompt: only then is a sweep table worth printing (a
    search the budget cut short may hold none; its summary says what it measured instead)."""
    return any(r.get("geomean_tok_s") is not None for r in record.get("arms") or [])


def sweep_table(record: dict[str, Any], tasks: Sequence[str], *, title: str = "calibration sweep (decode tok/s)",
                grid: dict[str, Any] | None = None) -> Table:
    """One row per measured arm: per-task medians, geomean, acceptance, repeats; the default and choice marked."""
    t = Table(title=title, show_lines=False, pad_edge=False, collapse_padding=True)
    t.add_column("", no_wrap=True)
    t.add_column("blk", justify="right")
    t.add_column("p", justify="right")
    for task in tasks:
        t.add_column(task, justify="right")
    t.add_column("geo", justify="right", style="bold")
    t.add_column("acc", justify="right")
    t.add_column("n", justify="right")
    t.add_column("stage", no_wrap=True)
    if grid is not None:
        t.add_column("grid", justify="right")
    chosen = record.get("settings") or {}
    default = record.get("default") or {}
    rows = sorted(record.get("arms", []), key=lambda r: -(r.get("geomean_tok_s") or 0.0))
    for r in rows:
        is_chosen = r["block"] == chosen.get("block") and r["spec_min_p"] == chosen.get("spec_min_p")
        is_default = r["block"] == default.get("block") and r["spec_min_p"] == default.get("spec_min_p")
        mark = ("*" if is_chosen else "") + ("d" if is_default else "")
        acc, prop = r.get("accepted", 0), r.get("proposed", 0)
        cells = [mark, str(r["block"]), f"{r['spec_min_p']:g}"]
        cells += [_fmt((r.get("per_task_tok_s") or {}).get(task), 1) for task in tasks]
        cells += [_fmt(r.get("geomean_tok_s"), 1), f"{acc / prop:.2f}" if prop else "-", str(r.get("repeats", 0)),
                  r.get("phase", "")]
        if grid is not None:
            cells.append(_fmt(grid.get(f"{r['block']}/{r['spec_min_p']:g}"), 1))
        t.add_row(*cells, style="green" if is_chosen else None)
    t.caption = "tok/s medians per task, geo = geometric mean, acc = accepted/proposed, n = repeats; * chosen, d default"
    return t


def summary_lines(result: Any) -> list[str]:
    """Plain sentences for the end of a run: what was chosen and why."""
    if result.block is None:
        return [result.reason]
    lines = [f"block={result.block} spec_min_p={result.spec_min_p:g} ({result.decision}): {result.reason}"]
    sec = result.record.get("seconds")
    h2h = result.record.get("head_to_head")
    if h2h:             # the chosen setting and the target alone timed alternately (calibrate/search.py, stage 7)
        tgt, geo, how = h2h["target_only_geomean_tok_s"], h2h["geomean_tok_s"], "timed alternately"
    else:               # stage 7 did not run: the target's reference runs, timed before the sweep
        tgt, geo = result.record.get("target_only_geomean_tok_s"), result.record.get("geomean_tok_s")
        how = "the target alone timed before the sweep"
    if result.decision == "target_alone":
        pass            # the first line says it: the config drafts nothing
    elif tgt and geo and geo < tgt:
        lines.append(f"note: the target alone decoded faster ({tgt:.1f} vs {geo:.1f} tok/s geomean, {how}); this "
                     f"drafter does not pay off here (try --no-draft or another drafter)")
    elif tgt and geo:
        lines.append(f"speculation pays here: {geo / tgt:.2f}x the target alone ({geo:.1f} vs {tgt:.1f} tok/s "
                     f"geomean, {how})")
    dtemp = result.record.get("draft_temperature") or {}
    if "overlap" in dtemp:
        ov = dtemp["overlap"]
        scale = dtemp["scale"]
        lines.append(f"sampled drafts at {scale:g}x the request's temperature: a first proposal is accepted "
                     f"{ov[str(scale)]:.0%} of the time against {ov['1.0']:.0%} at 1x (teacher-forced on the "
                     f"calibration prompts, temperature 0.7 / top-p 0.9 and 1.0)")
    if result.reused:
        lines.append(f"reused the stored calibration from {result.record.get('date', '?')} ({result.path}); "
                     f"pass --force to measure again")
    elif sec is not None:
        rec = result.record
        total, budget, build = rec.get("total_s"), rec.get("budget_s"), rec.get("engine_build_s")
        parts = [f"{build:.1f} s loading the engine"] if build else []
        threads = (rec.get("threads") or {}).get("threads")
        if threads:
            parts.append(f"{threads} CPU thread{'s' if threads != 1 else ''}")
        took = total if total is not None else sec
        of = f" of its {budget:g} s budget" if budget is not None else ""
        lines.append(f"calibration took {took:.1f} s{of}" + (f" ({', '.join(parts)})" if parts else ""))
        step = rec.get("drafter_step") or {}
        if step.get("compiled"):
            lines.append(f"the drafter's chain ran compiled for this CPU (built or loaded in {step['compile_s']:.1f} s, "
                         f"outside the budget)")
        elif step.get("why_not") and step["why_not"] != "no compiled step for this drafter":
            lines.append(f"the drafter's chain ran eagerly (its compiled step: {step['why_not']})")
        tstep = rec.get("target_step") or {}
        if tstep.get("compiled"):
            lines.append(f"the target's step ran compiled for this CPU (packages {', '.join(tstep['compiled'])}, "
                         f"built or loaded in {tstep['compile_s']:.1f} s, outside the budget)")
        elif tstep.get("why_not"):
            lines.append(f"the target's step ran eagerly (its compiled step: {tstep['why_not']})")
        if result.decision == "budget" or rec.get("budget_hit"):
            lines.append("the budget cut calibration short; give it more time with --calibrate-seconds S "
                         "(or `strata-setup calibrate --config PATH --max-seconds S`)")
    return lines
