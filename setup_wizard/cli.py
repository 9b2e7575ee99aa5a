"""`strata-setup`: the typer application — the wizard (interactive or scripted) and its subcommands.

Exit codes (docs/commands.md): 0 success, 1 the work failed, 2 bad usage or input; 130 when the user pressed Ctrl-C.
Errors are one sentence on stderr; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from runtime.drafters.registry import KINDS
from runtime.errors import exit_code, message
from runtime.formats.registry import QTYPES
from runtime.version import __version__

app = typer.Typer(
    name="strata-setup",
    help="Set up a mixture-of-experts model with a speculative drafter, and manage local models.",
    no_args_is_help=False,
)

FLAGS_HINT = (
    "strata-setup needs a terminal to ask questions; pass --yes to take the recommended answers "
    "(with any of --target, --target-quant, --drafter, --dflash2-head, --dflash2-quant, --context, --kv-dtype, "
    "--vram-reserve-mib, --calibrate/--no-calibrate, --threads, --offline, --dry-run, --json, --config-out) or --answers FILE.toml."
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"strata-setup {__version__}")
        raise typer.Exit()


# Seams the tests replace: the machine, the other areas' functions, and whether a person is at the terminal.
def get_hardware():
    from runtime.paths import strata_home
    from setup_wizard.hardware import detect

    return detect(strata_home())


def get_services(on_progress=None, threads=None):
    from setup_wizard.services import RealServices

    return RealServices(on_progress, threads)


class _Relay:
    """A progress callback whose bars exist only while a step runs (never under a question on the terminal)."""

    sink = None

    def __call__(self, label: str, done: float, total: float | None, unit: str = "") -> None:
        if self.sink is not None:
            self.sink(label, done, total, unit)


def _print_calibration(result, console: Console) -> None:
    from calibrate.report import has_sweep, summary_lines, sweep_table

    if has_sweep(result.record) and not result.reused:     # never an empty table: the summary says what was done
        console.print(sweep_table(result.record, list(result.record.get("prompts") or [])))
    for line in summary_lines(result):
        console.print(line)


def is_interactive() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()


def _fail(message: str, code: int, debug: bool, exc: BaseException | None = None) -> None:
    if debug and exc is not None:
        raise exc
    Console(stderr=True).print(f"[red]Error:[/red] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _error_code(exc: BaseException) -> int | None:
    """2 for bad input, 1 for a failed step, None for anything unexpected (runtime/errors.py decides)."""
    return exit_code(exc)


@app.callback(invoke_without_command=True)
def main_callback(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
    yes: bool = typer.Option(False, "--yes", "-y", help="No questions: take the recommended answer for the rest."),
    target: str | None = typer.Option(None, help="Catalog name, a local model folder or a local qwen3moe .gguf file."),
    target_quant: str | None = typer.Option(
        None, "--target-quant", help="bf16 | q8_0 | q4_0: the target's size (default: recommended from the budget)."),
    drafter: str | None = typer.Option(None, help=" | ".join(KINDS) + " (default: mtp when the target has a head)."),
    dflash2_head: str | None = typer.Option(None, "--dflash2-head", help="DFlash2 head (catalog name or folder)."),
    dflash2_quant: str | None = typer.Option(None, "--dflash2-quant", help=" | ".join(QTYPES) + "."),
    context: int | None = typer.Option(None, help="Context length in tokens (default: recommended from the budget)."),
    kv_dtype: str | None = typer.Option(
        None, "--kv-dtype", help="The KV cache's format: bf16 | q8_0 on a GPU, fp32 | bf16 | q8_0 on a CPU "
        "(default: the compute dtype; q8_0 on a GPU where the bf16 cache does not fit the context)."),
    vram_reserve_mib: int | None = typer.Option(None, "--vram-reserve-mib", help="Memory to keep free, MiB."),
    vram_limit_mib: int | None = typer.Option(
        None, "--vram-limit-mib", help="Use at most this much GPU memory, MiB (a shared card, or to behave like a "
        "smaller one); recorded in the config, so strata-run keeps to it."),
    calibrate: bool | None = typer.Option(None, "--calibrate/--no-calibrate", help="Calibrate now (default yes)."),
    calibrate_seconds: float | None = typer.Option(
        None, "--calibrate-seconds", min=1.0, help="Time budget for calibration in seconds (default 110)."),
    offline: bool = typer.Option(False, "--offline", help="Use only what is already downloaded and verified."),
    threads: int | None = typer.Option(None, "--threads", help="CPU threads for calibration on a CPU (default: "
                                       "measured here, from the CPUs this process may use and how busy they are)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and budget; write nothing."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object (progress goes to stderr)."),
    config_out: Path | None = typer.Option(None, "--config-out", help="Where to write the config."),
    answers: Path | None = typer.Option(None, "--answers", help="Answer the questions from a TOML file."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Without a subcommand: the setup wizard (interactive with a terminal, scripted with --yes)."""
    if ctx.invoked_subcommand is not None:
        return
    from setup_wizard.choices import Choices, load_answers, merge_choices

    flags = Choices(target=target, drafter=drafter, dflash2_head=dflash2_head, dflash2_quant=dflash2_quant,
                      target_quant=target_quant, context=context, kv_dtype=kv_dtype,
                      vram_reserve_mib=vram_reserve_mib,
                      vram_limit_mib=vram_limit_mib, calibrate=calibrate, offline=offline,
                      config_out=config_out)
    try:
        if threads is not None and threads < 1:
            _fail(f"--threads must be >= 1, got {threads}.", 2, False)
        choices = merge_choices(load_answers(answers), flags) if answers else flags
        choices.validate()
        scripted = yes or answers is not None
        if not scripted and not is_interactive():
            _fail(FLAGS_HINT, 2, False)
        run_setup(choices, interactive=not scripted, dry_run=dry_run, json_out=json_out,
                  calibrate_seconds=calibrate_seconds, threads=threads)
    except typer.Exit:
        raise
    except KeyboardInterrupt:
        Console(stderr=True).print("\nCancelled; nothing half-written. Run strata-setup again to continue.")
        raise typer.Exit(130) from None
    except Exception as exc:  # one sentence, the right code
        code = _error_code(exc)
        if code is None:
            _fail(f"Unexpected error: {exc} (rerun with --debug for details).", 1, debug, exc)
        _fail(message(exc), code, debug, exc)


def run_setup(choices, *, interactive: bool, dry_run: bool, json_out: bool, input: Any = None,
              output: Any = None, calibrate_seconds: float | None = None, threads: int | None = None) -> int:
    """Questions (when interactive) → plan → summary → confirmation → steps → the strata-run and strata-serve
    commands."""
    from runtime.errors import WorkError
    from setup_wizard import wizard as W
    from setup_wizard.plan import resolve
    from setup_wizard.progress_view import progress_bars
    from setup_wizard.steps import execute

    out = Console(stderr=True) if json_out else Console()
    hw = get_hardware().with_vram_limit(choices.vram_limit_mib)
    if hw.gpus:                # for the decode estimate of an offloaded setup
        from dataclasses import replace

        from setup_wizard.hardware import measure_links

        hw = replace(hw, links=measure_links())
    relay = _Relay()
    services = get_services(relay, threads)
    if interactive:
        choices = W.ask(choices, hw, services, input=input, output=output)
    plan = resolve(choices, hw, services)
    if json_out and dry_run:
        print(json.dumps({"dry_run": True, "plan": plan.to_dict()}, indent=2))
        return 0
    W.show_plan(plan, out)
    if plan.budget is not None and not plan.budget.fits:
        raise WorkError(plan.budget.reason)
    if dry_run:
        out.print("[dim]Dry run: nothing was downloaded, converted or written.[/dim]")
        return 0
    if interactive and not W.confirm(input=input, output=output):
        out.print("Nothing was changed.")
        return 0

    def report(step: str, status: str) -> None:
        if status == "start":
            out.print(f"[cyan]…[/cyan] {step}")
        elif status == "skipped":
            out.print(f"[green]✓[/green] {step} [dim](already done, verified)[/dim]")
        else:
            out.print(f"[green]✓[/green] {step}")

    with progress_bars(Console(stderr=True)) as bars:
        relay.sink = bars
        result = execute(plan, services, report=report, max_calibration_seconds=calibrate_seconds)
    if result.calibration is not None:
        _print_calibration(result.calibration, Console(stderr=True))
    prof = result.doc.get("memory", {}).get("routing_profile")
    if prof and result.budget.offloaded:
        from runtime.routing_profile import RoutingProfile

        b = result.budget
        hit = RoutingProfile.load(Path(prof)).expected_hit_rate(b.expert_cache_slots - b.dynamic_slots)
        for line in W.offload_lines(b, hw.links, hit, "from the routing profile calibration recorded"):
            out.print(line)
    if plan.budget is None or plan.budget.table() != result.budget.table():
        out.print(W.budget_table(result.budget))  # known only now (after the download) or changed
    cmd, serve = result.run_command(), result.serve_command()
    if json_out:
        print(json.dumps({"config": str(result.config_path), "run": cmd, "serve": serve, "plan": plan.to_dict(),
                          "budget": result.budget.to_dict(), "steps": result.steps}, indent=2))
    else:
        out.print(f"\nConfig written to [bold]{result.config_path}[/bold]. Generate with:\n", soft_wrap=True)
        out.print(f"  {cmd}", highlight=False, soft_wrap=True)
        out.print("\nor serve it over an OpenAI-compatible API (http://127.0.0.1:8080/v1) with:\n", soft_wrap=True)
        out.print(f"  {serve}", highlight=False, soft_wrap=True)
    return 0


@app.command("budget")
def budget_cmd(
    config: Path = typer.Option(..., "--config", help="A config written by strata-setup."),
    json_out: bool = typer.Option(False, "--json", help="Print the budget as JSON."),
    vram_limit_mib: int | None = typer.Option(None, "--vram-limit-mib",
                                              help="Budget for at most this much GPU memory, MiB (default: the "
                                                   "config's limit, if any)."),
    update: bool = typer.Option(False, "--update", help="Write the recomputed budget into the config."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Recompute the memory budget of a setup on this machine and print it."""
    from setup_wizard import wizard as W
    from setup_wizard.config import load_config, stale_reasons, write_config
    from setup_wizard.steps import budget_for_doc

    try:
        doc = load_config(config)
        stale = stale_reasons(doc)
        if stale:
            _fail(f"The config {config} is stale: {stale[0]}; rerun strata-setup.", 2, False)
        budget = budget_for_doc(doc, get_hardware(), vram_limit_mib=vram_limit_mib)
        if update:
            mem = doc.setdefault("memory", {})
            mem.update({"expert_cache_slots": budget.expert_cache_slots, "total_experts": budget.total_experts,
                        "expert_bytes": budget.expert_bytes, "budget": budget.table()})
            write_config(config, doc)
            _register(config)
    except typer.Exit:
        raise
    except Exception as exc:
        code = _error_code(exc)
        _fail(message(exc) if code else f"Unexpected error: {exc} (rerun with --debug).", code or 1, debug, exc)
    if json_out:
        print(json.dumps({"config": str(config), **budget.to_dict()}, indent=2))
    else:
        Console().print(W.budget_table(budget))
        for note in budget.notes:
            Console().print(f"[dim]{note}[/dim]")
        if not budget.fits:
            Console().print(f"[red]{budget.reason}[/red]")
    if not budget.fits:
        raise typer.Exit(1)


@app.command("calibrate")
def calibrate_cmd(
    config: Path = typer.Option(..., "--config", help="A config written by strata-setup."),
    force: bool = typer.Option(False, "--force", help="Measure again even when a result with this key exists."),
    max_seconds: float | None = typer.Option(None, "--max-seconds", help="Time budget for the sweep."),
    threads: int | None = typer.Option(None, "--threads", help="CPU threads for calibration on a CPU (default: "
                                       "measured here, from the CPUs this process may use and how busy they are)."),
    json_out: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Calibrate block size and spec_min_p for a setup and write the result into its config."""
    from setup_wizard.config import load_config, stale_reasons, write_config
    from setup_wizard.steps import apply_calibration

    try:
        doc = load_config(config)
        if max_seconds is not None and max_seconds <= 0:
            _fail(f"--max-seconds must be positive, not {max_seconds}.", 2, False)
        if threads is not None and threads < 1:
            _fail(f"--threads must be >= 1, got {threads}.", 2, False)
        from calibrate.routing import offloads

        if doc["drafter"]["kind"] == "none" and not offloads(doc):
            _fail("This setup has no drafter and keeps every expert on the GPU, so there is nothing to calibrate.",
                  2, False)
        stale = stale_reasons(doc)
        if stale:
            _fail(f"The config {config} is stale: {stale[0]}; rerun strata-setup.", 2, False)
        from setup_wizard.progress_view import progress_bars

        with progress_bars(Console(stderr=True)) as bars:
            result = get_services(bars, threads).calibrate(doc, force=force, max_seconds=max_seconds)
        _print_calibration(result, Console(stderr=True))
        apply_calibration(doc, result)
        write_config(config, doc)
        _register(config)
    except typer.Exit:
        raise
    except KeyboardInterrupt:
        Console(stderr=True).print("\nCancelled; the config was not changed.")
        raise typer.Exit(130) from None
    except Exception as exc:
        code = _error_code(exc)
        _fail(message(exc) if code else f"Unexpected error: {exc} (rerun with --debug).", code or 1, debug, exc)
    spec = doc["speculative"]
    if json_out:
        print(json.dumps({"config": str(config), "speculative": spec, "calibration": doc.get("calibration"),
                          "routing_profile": doc["memory"].get("routing_profile")}, indent=2, default=str))
    else:
        Console().print(f"block {spec.get('block')}, spec_min_p {spec.get('spec_min_p')} ({spec.get('source')}); "
                        f"written to {config}")
        if doc["memory"].get("routing_profile"):
            Console().print(f"routing profile: {doc['memory']['routing_profile']}")


def _register(config: Path) -> None:
    """Record a config strata-setup (re)wrote in the store's registry, so gc keeps what it uses."""
    from runtime.paths import strata_home
    from setup_wizard.registry import register_config

    register_config(config, strata_home())


from setup_wizard.models_cli import convert_cmd, models_app  # noqa: E402

app.add_typer(models_app, name="models")
app.command("convert")(convert_cmd)


def main() -> None:
    app()
