"""strata-serve on a loopback port, driven by the official `openai` client: completions and chat (streamed and not)
equal to strata-run, stop strings, cancellation on disconnect, 401, 503, oversized requests, no template, shutdown.
Nothing here binds or connects beyond 127.0.0.1."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
from typer.testing import CliRunner

from runtime.chat_template import ChatTemplate, load_chat_template
from runtime.cli import app as run_app
from runtime.engine import Engine, SamplingParams
from runtime.serve import StrataServer, bind, create_app, request_log_line, validation_message
from runtime.serve_queue import Outcome
from tests.runtime.tiny import make_tiny_target, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
            "{{ raise_exception('this template takes no tool messages') }}{% endif %}"
            "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
PROMPT = "hello world"


def _config(root: Path, folder: str, name: str) -> Path:
    cfg = root / f"{name}.toml"
    cfg.write_text(f'schema = 1\n[target]\npath = "{folder}"\n[drafter]\nkind = "mtp"\n[speculative]\nblock = 4\n'
                   f'[memory]\ncontext = 256\nkv_dtype = "fp32"\n[device]\ntype = "cpu"\n')
    return cfg


@pytest.fixture(scope="module")
def setup_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    folder = make_tiny_target(root, seed=4, scale=2.0)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": "<unk>", "eos_token": "<eos>"}))
    make_tiny_target(root, name="plain-target", seed=5, scale=2.0)   # no tokenizer_config.json: no template
    _config(root, "tiny-target", "tiny")
    _config(root, "plain-target", "plain")
    return root


class Instrumented:
    """The real engine, seen through what the server calls: a gate before each generation, an optional pause per
    window (to keep a request in flight), and every result it returned."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.gate = threading.Event()
        self.gate.set()
        self.pause = 0.0
        self.results = []
        self.entered = 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompt, cancel=None, **kw):
        self.entered += 1
        assert self.gate.wait(20)

        def slow_cancel():
            time.sleep(self.pause)
            return cancel()

        res = self.engine.generate(prompt, cancel=slow_cancel, **kw)
        self.results.append(res)
        return res


@pytest.fixture(scope="module")
def engine(setup_dir):
    return Instrumented(Engine.from_config(setup_dir / "tiny.toml"))


@contextmanager
def serving(app):
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = StrataServer(app, host="127.0.0.1", port=port, log_level="warning")
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and t.is_alive(), "the server did not start"
        time.sleep(0.01)
    try:
        yield port
    finally:
        server.stop()
        t.join(20)
        assert not t.is_alive()


@pytest.fixture(scope="module")
def port(engine):
    with serving(create_app(engine, model_name="tiny", max_queue=1, max_request_bytes=4096)) as p:
        yield p


@pytest.fixture(autouse=True)
def _reset(engine):
    engine.gate.set()
    engine.pause = 0.0
    engine.engine.stop_ids = {1}
    yield
    engine.gate.set()


def client(port, key="unused"):
    """The official client, straight to loopback (no proxy from the environment, no retries)."""
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=30,
                         http_client=openai.DefaultHttpxClient(trust_env=False))


def raw(port, path, body, method="POST", headers=()):
    """One HTTP/1.0 request on a raw socket (no chunked replies; the test decides when to read and hang up)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=20)
    head = [f"{method} {path} HTTP/1.0", "Host: 127.0.0.1", "Content-Type: application/json",
            f"Content-Length: {len(data)}", "Connection: close", *headers]
    s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + data)
    return s


def read_all(s) -> tuple[int, bytes]:
    buf = b""
    while chunk := s.recv(65536):
        buf += chunk
    s.close()
    return int(buf.split(b" ", 2)[1]), buf.split(b"\r\n\r\n", 1)[1]


def health(port):
    s = raw(port, "/health", b"", method="GET")
    return json.loads(read_all(s)[1])


def wait_for(cond, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def strata_run(setup_dir, *args):
    r = CliRunner().invoke(run_app, ["--config", str(setup_dir / "tiny.toml"), "--json", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


# ---------------------------------------------------------------------------------------------------- completions
def test_completions_equal_strata_run(setup_dir, port):
    ref = strata_run(setup_dir, "--prompt", PROMPT, "--max-new-tokens", "24")
    c = client(port)
    r = c.completions.create(model="anything", prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == ref["text"] and r.model == "tiny"
    assert r.usage.completion_tokens == len(ref["token_ids"]) and r.usage.prompt_tokens == len(PROMPT)
    st = r.model_extra["strata"]
    assert st["drafter"] == "mtp" and st["windows"] == ref["stats"]["windows"]
    assert st["accepted"] == ref["stats"]["accepted"] and st["proposed"] == ref["stats"]["proposed"]
    assert st["tokens_per_window"] == pytest.approx((st["generated_tokens"] - 1) / st["windows"])
    pieces, finals = [], []
    for chunk in c.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                      stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            if chunk.choices[0].finish_reason:
                finals.append(chunk)
        else:
            usage = chunk.usage
    assert "".join(pieces) == ref["text"] and len(pieces) > 2
    assert len(finals) == 1 and finals[0].model_extra["strata"]["windows"] == st["windows"]
    assert usage.completion_tokens == len(ref["token_ids"])
    by_ids = c.completions.create(model="tiny", prompt=[5, 2, 3], max_tokens=5, temperature=0)
    assert by_ids.usage.prompt_tokens == 3


def test_sampling_with_a_seed_equals_strata_run(setup_dir, port):
    ref = strata_run(setup_dir, "--prompt", PROMPT, "--max-new-tokens", "20", "--temperature", "0.9",
                     "--top-k", "30", "--top-p", "0.95", "--seed", "7")
    r = client(port).completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0.9, top_p=0.95,
                                        seed=7, extra_body={"top_k": 30})
    assert r.choices[0].text == ref["text"]


def test_stop_strings_are_cut_as_openai_does(engine, port):
    engine.engine.stop_ids = set()
    full = client(port).completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0)
    text = full.choices[0].text
    assert full.choices[0].finish_reason == "length" and len(text) >= 20
    stop = text[12:14]
    want = text[: text.index(stop)]
    r = client(port).completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0,
                                        stop=["never-there", stop])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.model_extra["strata"]["stop_reason"] == "stop_string"
    streamed = [c.choices[0].text for c in client(port).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stop=stop, stream=True)]
    assert "".join(streamed) == want


# ---------------------------------------------------------------------------------------------------- chat
def test_chat_uses_the_template_streamed_and_not(setup_dir, port):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    ref_engine = Engine.from_config(setup_dir / "tiny.toml")
    tpl = load_chat_template(setup_dir / "tiny-target")
    text = tpl.render(messages, add_generation_prompt=True)
    assert text == "<unk>system: be brief\nuser: hi there\nassistant: "
    ids = ChatTemplate.encode(ref_engine.tokenizer, text)
    ref = ref_engine.generate(ids, max_new_tokens=16, sampling=SamplingParams())
    c = client(port)
    r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref.token_ids)
    assert r.model_extra["strata"]["windows"] == ref.stats["windows"]
    chunks = list(c.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=16,
                                            temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") and "strata" in chunks[-1].model_extra
    with pytest.raises(openai.BadRequestError, match="this template takes no tool messages"):
        c.chat.completions.create(model="tiny", messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}])


def test_chat_without_a_template_is_a_clear_400(setup_dir):
    plain = Engine.from_config(setup_dir / "plain.toml")
    with serving(create_app(plain, model_name="plain")) as p:
        with pytest.raises(openai.BadRequestError, match="has no chat template") as e:
            client(p).chat.completions.create(model="plain", messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 400
        assert client(p).completions.create(model="plain", prompt="abc", max_tokens=3).usage.completion_tokens > 0


# ---------------------------------------------------------------------------------------------------- limits
def test_bad_requests_are_one_sentence(port):
    c = client(port)
    with pytest.raises(openai.BadRequestError, match="more than the context of 256 tokens"):
        c.completions.create(model="tiny", prompt="a" * 250, max_tokens=10)
    with pytest.raises(openai.APIStatusError, match="larger than 4096 bytes") as e:
        c.completions.create(model="tiny", prompt="a" * 5000, max_tokens=1)
    assert e.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="temperature: Input should be greater than or equal to 0"):
        c.completions.create(model="tiny", prompt="a", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        c.completions.create(model="tiny", prompt="a", n=2)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        c.completions.create(model="tiny", prompt=[5, 999], max_tokens=2)
    for body, msg in [(b"{oops", "not valid JSON"), (b"[1, 2]", "must be a JSON object"),
                      (b'{"prompt": 3}', "prompt: must be a string or a list of token ids"),
                      (b'{"max_tokens": 2}', "prompt is required")]:
        status, out = read_all(raw(port, "/v1/completions", body))
        assert status == 400 and msg in json.loads(out)["error"]["message"]
    status, out = read_all(raw(port, "/v2/nothing", b"", method="GET"))
    assert status == 404 and "/v1/completions" in json.loads(out)["error"]["message"]
    assert [m.id for m in c.models.list()] == ["tiny"]


def test_api_key(engine, setup_dir):
    with serving(create_app(engine, model_name="tiny", api_key="s3cret")) as p:
        with pytest.raises(openai.AuthenticationError, match="wrong API key") as e:
            client(p, key="nope").models.list()
        assert e.value.status_code == 401
        status, out = read_all(raw(p, "/v1/completions", {"prompt": "a"}))
        assert status == 401 and "no API key" in json.loads(out)["error"]["message"]
        assert health(p)["status"] == "ok"            # health stays open for probes
        assert client(p, key="s3cret").completions.create(model="tiny", prompt="ab", max_tokens=2).choices


def test_full_queue_is_503_and_the_queue_moves_on(engine, port):
    engine.gate.clear()
    first = raw(port, "/v1/completions", {"prompt": "abc", "max_tokens": 4, "stream": True})
    wait_for(lambda: health(port)["running"], "the first request to start")
    second = raw(port, "/v1/completions", {"prompt": "abd", "max_tokens": 4})
    wait_for(lambda: health(port)["waiting"] == 1, "the second request to queue")
    with pytest.raises(openai.APIStatusError, match="busy") as e:
        client(port).completions.create(model="tiny", prompt="abe", max_tokens=4)
    assert e.value.status_code == 503
    engine.gate.set()
    s1, b1 = read_all(first)
    s2, b2 = read_all(second)
    assert s1 == 200 and b1.rstrip().endswith(b"data: [DONE]") and s2 == 200 and json.loads(b2)["choices"]


def test_disconnect_cancels_the_generation(engine, port):
    engine.engine.stop_ids = set()
    engine.pause = 0.02
    n = len(engine.results)
    s = raw(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 200, "stream": True})
    buf = b""
    while b"data:" not in buf:
        buf += s.recv(4096)
    s.close()                                          # the client leaves mid-stream
    wait_for(lambda: len(engine.results) > n, "the generation to end")
    st = engine.results[-1].stats
    assert st["stop_reason"] == "cancelled" and st["generated_tokens"] < 100
    # a request that leaves while it waits in the queue never reaches the engine
    engine.gate.clear()
    before = engine.entered
    running = raw(port, "/v1/completions", {"prompt": "abc", "max_tokens": 3})
    # inside the engine, at the gate (the server says "running" a moment before its thread gets there)
    wait_for(lambda: health(port)["running"] and engine.entered == before + 1, "the running request")
    entered = engine.entered
    queued = raw(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 50})
    wait_for(lambda: health(port)["waiting"] == 1, "the queued request")
    queued.close()
    wait_for(lambda: health(port)["waiting"] == 0, "the server to see the queued client leave")
    engine.gate.set()
    assert read_all(running)[0] == 200
    wait_for(lambda: health(port)["waiting"] == 0 and not health(port)["running"], "the queue to drain")
    assert engine.entered == entered
    engine.pause = 0.0
    ok = client(port).completions.create(model="tiny", prompt="abc", max_tokens=3)     # and the queue moves on
    assert ok.choices[0].finish_reason == "length"


def test_stop_ends_generation_and_the_worker(engine):
    engine.engine.stop_ids = set()
    engine.pause = 0.02
    app = create_app(engine, model_name="tiny")
    n = len(engine.results)
    with serving(app) as p:
        s = raw(p, "/v1/completions", {"prompt": PROMPT, "max_tokens": 200, "stream": True})
        buf = b""
        while b"data:" not in buf:
            buf += s.recv(4096)
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 5 and not app.worker.alive
    rest = buf
    while chunk := s.recv(65536):
        rest += chunk
    assert b"shutting down" in rest and rest.rstrip().endswith(b"data: [DONE]")
    assert engine.results[n].stats["stop_reason"] == "cancelled"


def test_log_line_has_tokens_speed_and_acceptance():
    st = {"drafter": "mtp", "prompt_tokens": 7, "generated_tokens": 41, "windows": 10, "proposed": 30,
          "accepted": 24, "decode_tok_s": 123.4, "stop_reason": "length"}
    line = request_log_line("POST", "/v1/completions", 200, 0.5, Outcome("x", [1], "length", st, 0.25))
    assert line == ("POST /v1/completions 200 in 0.50 s | prompt 7 tok, generated 41 tok, 123.4 tok/s, "
                    "accepted 24/30 (80%), 4.00 tok/window, queued 0.25 s, length")
    assert validation_message([{"type": "missing", "loc": ("body", "messages"), "msg": "Field required"}]) == \
        "messages is required."


# ---------------------------------------------------------------------------------------------------- the command
def _start(cfg: Path, *args: str):
    exe = Path(sys.executable).parent / "strata-serve"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([str(exe), "--config", str(cfg), "--port", "0", "--threads", "1", *args],
                            stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "serving" in line:
            return proc, int(line.split("http://127.0.0.1:")[1].split("/")[0]), lines
    proc.wait(10)
    raise AssertionError("".join(lines))


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 0)])
def test_command_serves_and_stops_cleanly(setup_dir, sig, code):
    proc, p, _ = _start(setup_dir / "tiny.toml")
    try:
        r = client(p).completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0)
        assert r.usage.completion_tokens >= 1
        proc.send_signal(sig)
        rest = proc.stderr.read()
        assert proc.wait(15) == code
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "POST /v1/completions 200" in rest and "tok/s" in rest and "strata-serve: stopped." in rest
    assert "Traceback" not in rest


def test_command_errors_are_one_sentence(setup_dir, tmp_path):
    from runtime.serve import cli

    r = CliRunner().invoke(cli, [])
    assert r.exit_code == 2 and "pass a config NAME" in r.stderr
    r = CliRunner(env={"STRATA_HOME": str(tmp_path)}).invoke(cli, ["nope"])
    assert r.exit_code == 2 and "no config named 'nope'" in r.stderr and "run strata-setup first" in r.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        r = CliRunner().invoke(cli, ["--config", str(setup_dir / "tiny.toml"), "--port",
                                     str(busy.getsockname()[1])])
    assert r.exit_code == 2 and "cannot listen on 127.0.0.1" in r.stderr and "Traceback" not in r.output
