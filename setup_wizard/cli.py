"""`strata-setup`: the typer application (the wizard and its subcommands hang off this)."""

from __future__ import annotations

import typer

from runtime.version import __version__

app = typer.Typer(
    name="strata-setup",
    help="Set up a mixture-of-experts model with a speculative drafter, and manage local models.",
    no_args_is_help=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"strata-setup {__version__}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def main_callback(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """The wizard runs when no subcommand is given."""
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())


def main() -> None:
    app()
