"""`strata-run`'s manners: where the prompt comes from, how the output ends, Ctrl-C, a length that does not fit,
the thread choice, and help pages rendered by typer (flags as flags, required arguments by name)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from runtime.cli import app
from runtime.engine import Engine
from runtime.hostinfo import ThreadChoice
from tests.runtime.tiny import make_tiny_target, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    root = tmp_path_factory.mktemp("runcli")
    make_tiny_target(root, seed=4, scale=2.0)
    path = root / "config.toml"
    path.write_text('schema = 1\n[target]\nname = "tiny"\npath = "tiny-target"\n[drafter]\nkind = "mtp"\n'
                    '[memory]\ncontext = 64\nkv_dtype = "fp32"\n[device]\ntype = "cpu"\n')
    full = root / "full.toml"           # the context is the model's maximum (tiny targets allow 4096)
    full.write_text(path.read_text().replace("context = 64", "context = 4096"))
    return path, full


def _run(*args, **kw):
    return CliRunner().invoke(app, [str(a) for a in args], **kw)


def _ids(r):
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)["token_ids"]


def test_prompt_from_stdin_and_from_a_file(cfg, tmp_path):
    path, _ = cfg
    base = ["--config", path, "--max-new-tokens", "6", "--json", "--threads", "1"]
    want = _ids(_run(*base, "--prompt", "def f(x):\n    return"))
    assert _ids(_run(*base, "--prompt", "-", input="def f(x):\n    return")) == want
    f = tmp_path / "p.txt"
    f.write_text("def f(x):\n    return", encoding="utf-8")
    assert _ids(_run(*base, "--prompt-file", f)) == want


@pytest.mark.parametrize("args, kw, msg", [
    (["--prompt", "a", "--prompt-file", "x.txt"], {}, "either as --prompt or as --prompt-file"),
    (["--prompt-file", "/nonexistent/p.txt"], {}, "cannot read --prompt-file /nonexistent/p.txt"),
    (["--prompt", "-"], {"input": "  \n"}, "the prompt from standard input (--prompt -) is empty"),
    (["--max-new-tokens", "500", "--prompt", "hello"], {}, "leaves room for"),
])
def test_prompt_and_length_errors_are_one_sentence(cfg, args, kw, msg):
    r = _run("--config", cfg[0], "--threads", "1", *args, **kw)
    assert r.exit_code == 2, r.output
    assert msg in r.stderr and "Traceback" not in r.output and len(r.stderr.strip().splitlines()) == 1


def test_too_many_new_tokens_are_refused_up_front_with_advice_that_fits(cfg, monkeypatch):
    path, full = cfg

    def never(*a, **k):
        raise AssertionError("generate ran although the length does not fit")

    monkeypatch.setattr(Engine, "generate", never)
    ids = Engine.from_config(path).encode("hello")
    r = _run("--config", path, "--prompt", "hello", "--max-new-tokens", "500", "--threads", "1")
    room = 64 - len(ids) + 1
    assert r.exit_code == 2 and r.stdout == ""
    assert "--max-new-tokens 500 does not fit" in r.stderr and f"room for {room} new tokens" in r.stderr
    assert f"pass --max-new-tokens {room} or less" in r.stderr and "raise [memory] context" in r.stderr
    r = _run("--config", full, "--prompt", "hello", "--max-new-tokens", "5000", "--threads", "1")
    assert r.exit_code == 2 and "already this model's maximum context" in r.stderr and "raise" not in r.stderr
    monkeypatch.undo()
    r = _run("--config", path, "--prompt", "hello", "--max-new-tokens", str(room), "--json", "--threads", "1")
    assert r.exit_code == 0 and len(json.loads(r.stdout)["token_ids"]) <= room      # exactly the room fits


def test_streamed_output_ends_with_one_newline(cfg, monkeypatch):
    path, _ = cfg
    r = _run("--config", path, "--prompt", "abc", "--max-new-tokens", "5", "--threads", "1")
    assert r.exit_code == 0 and r.stdout.endswith("\n") and not r.stdout.endswith("\n\n")
    text = r.stdout[:-1]

    assert "tok/s" not in text and "tok/s" in r.stderr        # the summary goes to stderr

    def ends_in_newline(self, prompt, **kw):      # a text that ends with its own newline gets no second one
        from runtime.engine import GenerateResult

        kw["on_text"]("line\n")
        stats = {"drafter": "mtp", "device": "cpu", "prompt_tokens": 1, "generated_tokens": 2, "decode_s": 0.1,
                 "decode_tok_s": 10.0, "windows": 1, "accepted": 0, "proposed": 0, "accepted_per_window": [0]}
        return GenerateResult(token_ids=[1, 2], text="line\n", stats=stats)

    monkeypatch.setattr(Engine, "generate", ends_in_newline)
    r = _run("--config", path, "--prompt", "abc", "--threads", "1")
    assert r.exit_code == 0 and r.stdout == "line\n"


def test_ctrl_c_prints_one_line_and_exits_130(cfg, monkeypatch):
    path, _ = cfg

    def interrupted(self, prompt, **kw):
        kw["on_text"]("partial text")
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "generate", interrupted)
    r = _run("--config", path, "--prompt", "abc", "--threads", "1")
    assert r.exit_code == 130
    assert r.stdout == "partial text\n"                      # the line is ended, nothing else on stdout
    assert r.stderr.strip().splitlines() == ["strata-run: interrupted (Ctrl-C); nothing was saved."]
    assert "Aborted" not in r.output and "Traceback" not in r.output


def test_threads_are_measured_on_a_cpu_unless_given(cfg, monkeypatch):
    path, _ = cfg
    calls = []

    def fake(engine):
        calls.append(engine.model.cfg.hidden_size)
        return ThreadChoice(threads=2, usable=4, idle=3, load=1.0, probe_s={1: 0.2, 2: 0.1}, reason="test")

    monkeypatch.setattr(Engine, "choose_threads", fake)
    before = torch.get_num_threads()
    try:
        r = _run("--config", path, "--prompt", "abc", "--max-new-tokens", "3", "--json")
        assert r.exit_code == 0 and calls == [32] and json.loads(r.stdout)["stats"]["threads"] == 2
        r = _run("--config", path, "--prompt", "abc", "--max-new-tokens", "3", "--json", "--threads", "1")
        assert calls == [32] and json.loads(r.stdout)["stats"]["threads"] == 1      # given: not measured
    finally:
        torch.set_num_threads(before)


def test_help_pages_render_flags_as_flags():
    from setup_wizard.cli import app as setup_app

    wide = {"COLUMNS": "200"}
    pages = [_run("--help", env=wide)]
    for sub in ([], ["models", "show"], ["models", "rm"], ["models", "list"], ["budget"], ["calibrate"],
                ["convert"]):
        pages.append(CliRunner().invoke(setup_app, [*sub, "--help"], env=wide))
    for r in pages:
        assert r.exit_code == 0, r.output
        assert "<bool>" not in r.output and "<str>" not in r.output and "{" not in r.output, r.output
    run_help = pages[0].output
    assert "--install-completion" in run_help and "--install-completion" in pages[1].output
    assert "required unless NAME is given" in run_help and "required unless --prompt-file or --chat" in run_help
    assert "--prompt-file" in run_help and "--threads" in pages[1].output
    assert "NAME" in pages[2].output and "[required]" in pages[2].output          # models show NAME
