"""`strata-run`: generate from a strata-setup config (docs/commands.md). Streams text, then a one-line stats summary;
`--json` prints one JSON object instead. Exit 0 ok, 1 failure of the work, 2 bad usage or input."""

from __future__ import annotations

import json
import sys
import traceback

import typer

from runtime.errors import EXIT_INTERRUPTED, exit_code, message
from runtime.version import __version__

app = typer.Typer(name="strata-run", help="Run a model set up by strata-setup.", add_completion=False)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"strata-run {__version__}")
        raise typer.Exit()


def _fail(msg: str, code: int, debug: bool) -> None:
    if debug:
        traceback.print_exc()
    typer.echo(f"strata-run: {msg}", err=True)
    raise typer.Exit(code)


def _summary(stats: dict) -> str:
    apw = stats.get("accepted_per_window") or []
    mean = (sum(apw) / len(apw)) if apw else 0.0
    return (f"[{stats['drafter']} on {stats['device']}] prompt {stats['prompt_tokens']} tok, "
            f"generated {stats['generated_tokens']} tok in {stats['decode_s']:.2f} s "
            f"({stats['decode_tok_s']:.1f} tok/s), windows {stats['windows']}, "
            f"accepted {stats['accepted']}/{stats['proposed']} ({mean:.2f} per window)")


@app.command()
def run(
    name: str = typer.Argument(None, metavar="NAME", help="A config strata-setup wrote, by name "
                               "($STRATA_HOME/configs/NAME.toml), as `ollama run NAME`."),
    config: str = typer.Option(None, "--config", help="strata-setup config (TOML path, or its name)."),
    prompt: str = typer.Option(None, "--prompt", help="Prompt text."),
    max_new_tokens: int = typer.Option(None, "--max-new-tokens", help="Most tokens to generate (default 128; in "
                                       "--chat, up to the context)."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 = off."),
    seed: int = typer.Option(None, "--seed", help="Sampling seed."),
    block: int = typer.Option(None, "--block", help="Verify window width (overrides the config)."),
    spec_min_p: float = typer.Option(None, "--spec-min-p", help="Draft confidence floor (overrides the config)."),
    no_draft: bool = typer.Option(False, "--no-draft", help="Run the target alone."),
    threads: int = typer.Option(None, "--threads", help="CPU threads for torch (default: torch's choice; 1 is "
                                "fastest for small models on a busy machine)."),
    vram_limit_mib: int = typer.Option(None, "--vram-limit-mib", help="Cap the GPU memory this run may use, in MiB "
                                       "(a shared card, or to behave like a smaller one); default: the config's."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (text, token_ids, stats)."),
    chat: bool = typer.Option(False, "--chat", help="Talk with the model in the terminal (its chat template; "
                              "Ctrl-C stops an answer, Ctrl-D or /exit ends)."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Generate text with speculative decoding."""
    if name and config:
        _fail("give the config either as NAME or as --config, not both.", 2, False)
    if not (name or config):
        _fail("--config is required (the file strata-setup wrote); pass --config PATH or a config NAME.", 2, False)
    if chat and (prompt is not None or as_json):
        _fail("--chat is interactive; leave out --prompt and --json.", 2, False)
    if prompt is None and not chat:
        _fail("--prompt is required; pass --prompt TEXT (or --chat to talk).", 2, False)
    if max_new_tokens is not None and max_new_tokens < 0:
        _fail(f"--max-new-tokens must be >= 0, got {max_new_tokens}.", 2, False)
    if block is not None and block < 1:
        _fail(f"--block must be >= 1, got {block}.", 2, False)
    if spec_min_p is not None and not 0 <= spec_min_p <= 1:
        _fail(f"--spec-min-p must be between 0 and 1, got {spec_min_p}.", 2, False)
    if threads is not None and threads < 1:
        _fail(f"--threads must be >= 1, got {threads}.", 2, False)
    if vram_limit_mib is not None and vram_limit_mib < 1:
        _fail(f"--vram-limit-mib must be a positive number of MiB, got {vram_limit_mib}.", 2, False)
    try:
        import torch

        from runtime.engine import Engine, SamplingParams
        from runtime.paths import resolve_config

        if threads is not None:
            torch.set_num_threads(threads)
        if vram_limit_mib is not None and not torch.cuda.is_available():
            _fail("--vram-limit-mib caps GPU memory, but no CUDA GPU is usable here; drop the flag.", 2, False)

        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        path = resolve_config(name or config)
        over: dict = {"block": block} if block is not None else {}
        if vram_limit_mib is not None:
            over["vram_limit_mib"] = vram_limit_mib
        engine = Engine.from_config(path, **over)
        if chat:
            raise typer.Exit(_chat(engine, path.stem, max_new_tokens, sampling, block=block,
                                   spec_min_p=spec_min_p, draft=not no_draft))
        max_new_tokens = 128 if max_new_tokens is None else max_new_tokens
        stream = None if as_json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
        res = engine.generate(prompt, max_new_tokens=max_new_tokens, sampling=sampling, block=block,
                              spec_min_p=spec_min_p, draft=not no_draft, on_text=stream)
    except typer.Exit:
        raise
    except KeyboardInterrupt:
        _fail("interrupted.", EXIT_INTERRUPTED, False)
    except Exception as e:  # one sentence and the code runtime/errors.py gives it; traceback only with --debug
        code = exit_code(e)
        _fail(message(e) if code is not None else f"generation failed: {type(e).__name__}: {e}", code or 1, debug)
    if as_json:
        typer.echo(json.dumps({"text": res.text, "token_ids": res.token_ids, "stats": res.stats}))
    else:
        sys.stdout.write("\n")
        typer.echo(_summary(res.stats), err=True)


def _chat(engine, title: str, max_new_tokens: int | None, sampling, **generate_kwargs) -> int:
    from runtime.chat import ChatSession, chat_loop
    from runtime.chat_template import require_chat_template

    session = ChatSession(engine, require_chat_template(engine.target_dir), max_new_tokens=max_new_tokens,
                          sampling=sampling, **generate_kwargs)
    return chat_loop(session, report=_summary, title=title)


def main() -> None:
    app()
