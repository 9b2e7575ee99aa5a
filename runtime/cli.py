"""`strata-run`: generate from a strata-setup config."""

from __future__ import annotations

import typer

from runtime.version import __version__

app = typer.Typer(name="strata-run", help="Run a model set up by strata-setup.", add_completion=False)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"strata-run {__version__}")
        raise typer.Exit()


@app.command()
def run(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Generate text with speculative decoding."""
    typer.echo("strata-run: the engine is not built yet.")
    raise typer.Exit(1)


def main() -> None:
    app()
