"""`strata-run`: generate from a strata-setup config (docs/commands.md). Streams text (ending with a newline), then a
one-line stats summary on stderr; `--json` prints one JSON object instead. Exit 0 ok, 1 failure of the work, 2 bad
usage or input, 130 Ctrl-C (one line, nothing else)."""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import typer

from runtime.errors import EXIT_INTERRUPTED, exit_code, message
from runtime.version import __version__

DEFAULT_NEW_TOKENS = 128

app = typer.Typer(name="strata-run", help="Run a model set up by strata-setup.")


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
    drafter = stats["drafter"] + (" (compiled chain)" if stats.get("drafter_compiled") else "")
    step = ", compiled step" if stats.get("target_compiled") else ""
    return (f"[{drafter} on {stats['device']}{step}] prompt {stats['prompt_tokens']} tok, "
            f"generated {stats['generated_tokens']} tok in {stats['decode_s']:.2f} s "
            f"({stats['decode_tok_s']:.1f} tok/s), windows {stats['windows']}, "
            f"accepted {stats['accepted']}/{stats['proposed']} ({mean:.2f} per window)")


@app.command()
def run(
    name: str = typer.Argument(None, metavar="NAME", help="A config strata-setup wrote, by name "
                               "($STRATA_HOME/configs/NAME.toml), as `ollama run NAME`."),
    config: str = typer.Option(None, "--config", metavar="PATH", help="strata-setup config (TOML path, or its "
                               "name); required unless NAME is given."),
    prompt: str = typer.Option(None, "--prompt", metavar="TEXT", help="Prompt text, or - to read it from standard "
                               "input; required unless --prompt-file or --chat."),
    prompt_file: Path = typer.Option(None, "--prompt-file", metavar="PATH", help="Read the prompt from this file."),
    max_new_tokens: int = typer.Option(None, "--max-new-tokens", help="Most tokens to generate (default 128, or what "
                                       "the context leaves room for; in --chat, up to the context)."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 = off."),
    seed: int = typer.Option(None, "--seed", help="Sampling seed."),
    block: int = typer.Option(None, "--block", help="Verify window width (overrides the config)."),
    spec_min_p: float = typer.Option(None, "--spec-min-p", help="Draft confidence floor (overrides the config)."),
    draft_temp_scale: float = typer.Option(
        None, "--draft-temp-scale", help="When sampling, the drafter draws at the temperature times this (the output "
        "stays the target's; default: the config's, which calibration measures)."),
    no_draft: bool = typer.Option(False, "--no-draft", help="Run the target alone."),
    threads: int = typer.Option(None, "--threads", help="CPU threads for torch (default on a CPU: measured here, "
                                "from the CPUs this process may use and how busy they are)."),
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
    if prompt is not None and prompt_file is not None:
        _fail("give the prompt either as --prompt or as --prompt-file, not both.", 2, False)
    if chat and (prompt is not None or prompt_file is not None or as_json):
        _fail("--chat is interactive; leave out --prompt, --prompt-file and --json.", 2, False)
    if prompt is None and prompt_file is None and not chat:
        _fail("--prompt is required; pass --prompt TEXT, --prompt - (standard input), --prompt-file PATH, or --chat "
              "to talk.", 2, False)
    if max_new_tokens is not None and max_new_tokens < 0:
        _fail(f"--max-new-tokens must be >= 0, got {max_new_tokens}.", 2, False)
    if block is not None and block < 1:
        _fail(f"--block must be >= 1, got {block}.", 2, False)
    if spec_min_p is not None and not 0 <= spec_min_p <= 1:
        _fail(f"--spec-min-p must be between 0 and 1, got {spec_min_p}.", 2, False)
    if draft_temp_scale is not None and not 0 < draft_temp_scale <= 4:
        _fail(f"--draft-temp-scale must be above 0 and at most 4, got {draft_temp_scale}.", 2, False)
    if threads is not None and threads < 1:
        _fail(f"--threads must be >= 1, got {threads}.", 2, False)
    if vram_limit_mib is not None and vram_limit_mib < 1:
        _fail(f"--vram-limit-mib must be a positive number of MiB, got {vram_limit_mib}.", 2, False)
    out = _Stdout()
    try:
        if not chat:
            prompt = _read_prompt(prompt, prompt_file)
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
        if draft_temp_scale is not None:
            over["draft_temp_scale"] = draft_temp_scale
        engine = Engine.from_config(path, **over)
        engine.compile_missing(lambda m: typer.echo(f"strata-run: {m}", err=True))
        if threads is None and engine.device.type == "cpu":
            torch.set_num_threads(engine.choose_threads().threads)
        if chat:
            raise typer.Exit(_chat(engine, path.stem, max_new_tokens, sampling, block=block,
                                   spec_min_p=spec_min_p, draft=not no_draft))
        if max_new_tokens is None:       # the default never exceeds the room the context leaves
            engine.check_room(prompt, 0)
            max_new_tokens = min(DEFAULT_NEW_TOKENS, engine.room(len(engine.encode(prompt))))
        else:                            # a number the context cannot hold is refused up front (exit 2)
            engine.check_room(prompt, max_new_tokens, flag="--max-new-tokens")
        res = engine.generate(prompt, max_new_tokens=max_new_tokens, sampling=sampling, block=block,
                              spec_min_p=spec_min_p, draft=not no_draft, on_text=None if as_json else out.write)
    except typer.Exit:
        raise
    except KeyboardInterrupt:
        out.end_line()
        _fail("interrupted (Ctrl-C); nothing was saved.", EXIT_INTERRUPTED, False)
    except Exception as e:  # one sentence and the code runtime/errors.py gives it; traceback only with --debug
        out.end_line()
        code = exit_code(e)
        _fail(message(e) if code is not None else f"generation failed: {type(e).__name__}: {e}", code or 1, debug)
    if as_json:
        res.stats["threads"] = torch.get_num_threads()
        typer.echo(json.dumps({"text": res.text, "token_ids": res.token_ids, "stats": res.stats}))
    else:
        out.end_line()
        typer.echo(_summary(res.stats), err=True)


class _Stdout:
    """Streamed text on stdout, remembering whether the last character was a newline, so that the output always
    ends with exactly one (after the text, an interruption or an error) and never with a blank line."""

    def __init__(self) -> None:
        self.open = False

    def write(self, piece: str) -> None:
        if piece:
            sys.stdout.write(piece)
            sys.stdout.flush()
            self.open = not piece.endswith("\n")

    def end_line(self) -> None:
        if self.open:
            sys.stdout.write("\n")
            sys.stdout.flush()
            self.open = False


def _read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    """The prompt text: --prompt as given, `--prompt -` from standard input, or --prompt-file's contents."""
    from runtime.errors import UsageError

    if prompt_file is not None:
        try:
            text = prompt_file.expanduser().read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise UsageError(f"--prompt-file {prompt_file} is not UTF-8 text; pass a text file.") from None
        except OSError as e:
            raise UsageError(f"cannot read --prompt-file {prompt_file} ({e.strerror or e}); check the path.") from None
        where = f"--prompt-file {prompt_file}"
    elif prompt == "-":
        text = sys.stdin.read()
        where = "standard input (--prompt -)"
    else:
        return str(prompt)
    if not text.strip():
        raise UsageError(f"the prompt from {where} is empty; give some text.")
    return text


def _chat(engine, title: str, max_new_tokens: int | None, sampling, **generate_kwargs) -> int:
    from runtime.chat import ChatSession, chat_loop
    from runtime.chat_template import require_chat_template

    session = ChatSession(engine, require_chat_template(engine.target_dir), max_new_tokens=max_new_tokens,
                          sampling=sampling, **generate_kwargs)
    return chat_loop(session, report=_summary, title=title)


def main() -> None:
    app()
