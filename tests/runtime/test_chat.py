"""`strata-run --chat` (history, the template, Ctrl-C stops an answer and not the conversation) and
`strata-run NAME` (a config strata-setup wrote, by name)."""

import io
import json
import os
import signal

import pytest
from typer.testing import CliRunner

from runtime.chat import ChatSession, chat_loop
from runtime.chat_template import load_chat_template
from runtime.cli import app
from runtime.engine import Engine
from runtime.paths import ConfigNameError, config_by_name, resolve_config
from tests.runtime.test_serve import TEMPLATE
from tests.runtime.tiny import make_tiny_target, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    root = tmp_path_factory.mktemp("home")
    folder = make_tiny_target(root, seed=4, scale=2.0)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": "<unk>"}))
    plain = make_tiny_target(root, name="plain", seed=5)
    (root / "configs").mkdir()
    for name, f in (("tiny-mtp", folder), ("plain-none", plain)):
        (root / "configs" / f"{name}.toml").write_text(
            f'schema = 1\n[target]\npath = "{f}"\n[drafter]\nkind = "mtp"\n[memory]\ncontext = 256\n'
            f'[device]\ntype = "cpu"\n')
    return root


@pytest.fixture(scope="module")
def engine(home):
    return Engine.from_config(home / "configs" / "tiny-mtp.toml")


def _run(home, *args, input=None):
    return CliRunner(env={"STRATA_HOME": str(home)}).invoke(app, list(args), input=input)


def test_run_by_name_equals_run_by_path(home):
    by_name = _run(home, "tiny-mtp", "--prompt", "abc", "--max-new-tokens", "8", "--json")
    by_path = _run(home, "--config", str(home / "configs" / "tiny-mtp.toml"), "--prompt", "abc",
                   "--max-new-tokens", "8", "--json")
    assert by_name.exit_code == 0 and json.loads(by_name.stdout)["token_ids"] == json.loads(by_path.stdout)["token_ids"]
    also = _run(home, "--config", "tiny-mtp", "--prompt", "abc", "--max-new-tokens", "8", "--json")
    assert json.loads(also.stdout)["token_ids"] == json.loads(by_path.stdout)["token_ids"]


@pytest.mark.parametrize("args, msg", [
    (["nope", "--prompt", "a"], "no config named 'nope'"),
    (["tiny-mtp", "--config", "x.toml", "--prompt", "a"], "either as NAME or as --config"),
    (["tiny-mtp", "--chat", "--prompt", "a"], "--chat is interactive"),
    (["plain-none", "--chat"], "has no chat template"),
])
def test_name_and_chat_errors_are_one_sentence(home, args, msg):
    r = _run(home, *args)
    assert r.exit_code == 2 and msg in r.stderr and "Traceback" not in r.output
    assert len(r.stderr.strip().splitlines()) == 1
    if "nope" in args:
        assert "known names: plain-none, tiny-mtp" in r.stderr


def test_paths_resolve_names_and_paths(home, monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_HOME", str(home))
    assert config_by_name("tiny-mtp") == home / "configs" / "tiny-mtp.toml"
    assert resolve_config("./tiny-mtp.toml").name == "tiny-mtp.toml"       # a path stays a path
    with pytest.raises(ConfigNameError, match=r"no config named '\.\./x'"):
        config_by_name("../x")
    monkeypatch.setenv("STRATA_HOME", str(tmp_path))
    with pytest.raises(ConfigNameError, match="none is set up yet; run strata-setup first"):
        resolve_config("tiny-mtp")


def test_chat_keeps_history_through_the_template(engine, home):
    tpl = load_chat_template(home / "tiny-target")
    s = ChatSession(engine, tpl, max_new_tokens=6)
    first = s.turn("hi", lambda t: None, lambda: False)
    s.turn("more", lambda t: None, lambda: False)
    assert [m["role"] for m in s.messages] == ["user", "assistant", "user", "assistant"]
    assert s.messages[1]["content"] == first.text
    prompt = tpl.render(s.messages[:3], add_generation_prompt=True)
    assert prompt.startswith("<unk>user: hi\nassistant: " + first.text + "\nuser: more\n")
    s.clear()
    assert s.messages == []


def test_chat_drops_the_oldest_turns_when_the_context_is_full(engine, home):
    s = ChatSession(engine, load_chat_template(home / "tiny-target"), max_new_tokens=4)
    for i in range(6):
        s.turn(chr(ord("a") + i) * 60, lambda t: None, lambda: False)
    assert len(s.messages) < 12 and s.messages[0]["role"] == "user" and s.messages[-2]["content"] == "f" * 60
    with pytest.raises(ValueError, match="more than the context of 256"):
        s.turn("x" * 300, lambda t: None, lambda: False)
    assert s.messages[-1]["role"] == "assistant"


def test_chat_command_streams_answers_until_exit(engine, home):
    tpl = load_chat_template(home / "tiny-target")
    fresh = ChatSession(engine, tpl, max_new_tokens=10).turn("abc", lambda t: None, lambda: False)
    r = _run(home, "tiny-mtp", "--chat", "--max-new-tokens", "10", input="hi there\n/clear\nabc\n/exit\n")
    assert r.exit_code == 0, r.output
    assert "Chatting with tiny-mtp" in r.stderr and "(conversation cleared)" in r.stderr
    assert fresh.text in r.stdout and r.stderr.count("tok/s") == 2
    assert _run(home, "tiny-mtp", "--chat", input="").exit_code == 0            # Ctrl-D at the prompt


def test_ctrl_c_stops_the_answer_not_the_conversation(engine, home):
    engine.stop_ids = set()
    lines = iter(["tell me a long story", "abc", "/exit"])
    out, err = io.StringIO(), io.StringIO()

    class Interrupting(io.StringIO):
        """The terminal: the user presses Ctrl-C once the first answer has started."""
        def write(self, s):
            if not hasattr(self, "pressed") and s.strip():
                self.pressed = True
                os.kill(os.getpid(), signal.SIGINT)
            return out.write(s)

        def flush(self):
            pass

    before = signal.getsignal(signal.SIGINT)
    s = ChatSession(engine, load_chat_template(home / "tiny-target"), max_new_tokens=200)
    try:
        code = chat_loop(s, read=lambda p: next(lines), out=Interrupting(), err=err)
    finally:
        engine.stop_ids = {1}
    assert code == 0 and signal.getsignal(signal.SIGINT) is before
    assert err.getvalue().count("(answer stopped)") == 1
    assert len(s.messages) == 4 and len(s.messages[1]["content"]) < 100     # the stopped answer is kept, short
    assert s.messages[2]["content"] == "abc" and s.messages[3]["content"]   # and the conversation went on
