"""Engine API, memory report, expert cache, and the `strata-run` command (stats contract, errors, exit codes)."""

import json

import pytest
import torch
from typer.testing import CliRunner

from runtime.cli import app
from runtime.engine import Engine, EngineConfigError, SamplingParams
from runtime.experts import ExpertCache
from runtime.loading import load_target
from runtime.memory import NAMES
from runtime.target_compiled import spare_slots
from tests.runtime.tiny import make_tiny_target, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")
STATS_KEYS = {"prompt_tokens", "generated_tokens", "windows", "proposed", "accepted", "accepted_per_window",
              "decode_s", "decode_tok_s", "drafter", "device", "draft_s", "verify_s"}


@pytest.fixture(scope="module")
def setup_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    make_tiny_target(root, seed=4, scale=2.0)
    (root / "config.toml").write_text(
        'schema = 1\nuser_key = "kept"\n[target]\nname = "tiny"\npath = "tiny-target"\n'
        '[drafter]\nkind = "mtp"\n[speculative]\nblock = 4\nspec_min_p = 0.0\nsource = "default"\n'
        '[memory]\ncontext = 256\nkv_dtype = "fp32"\n[device]\ntype = "cpu"\n')
    return root


@pytest.fixture(scope="module")
def engine(setup_dir):
    return Engine.from_config(setup_dir / "config.toml")


def test_generate_text_and_stats(engine):
    pieces = []
    res = engine.generate("hello world", max_new_tokens=12, on_text=pieces.append, stop_ids=set())
    assert len(res.token_ids) == 12 and res.text == engine.tokenizer.decode(res.token_ids)
    assert "".join(pieces) == res.text
    assert STATS_KEYS <= res.stats.keys() and res.stats["drafter"] == "mtp"
    plain = engine.generate("hello world", max_new_tokens=12, draft=False, stop_ids=set())
    assert plain.token_ids == res.token_ids and plain.stats["drafter"] == "none" and plain.stats["proposed"] == 0
    ids = engine.tokenizer.encode("hello world").ids
    assert engine.generate(ids, max_new_tokens=12, stop_ids=set()).token_ids == res.token_ids


def test_stats_carry_the_fast_paths_given_up(engine, monkeypatch):
    """A fast path given up (runtime/gpu/fallback.py, as a kernel that does not build would) is named in every later
    generation's stats, once however often it happens, so a slow run says why (`strata-run --json`, the server)."""
    from types import SimpleNamespace

    from runtime import openai_schema
    from runtime.gpu import fallback
    from runtime.serve import _strata_stats

    monkeypatch.setattr(fallback, "SEEN", [])
    assert engine.generate("hello", max_new_tokens=3, stop_ids=set()).stats["fallbacks"] == []
    err = RuntimeError("at 12:3: in the split kernel\nout of resource: shared memory")
    for _ in range(2):
        with pytest.warns(RuntimeWarning, match="the fused decode step failed here .*shared memory.*the module"):
            fallback.fell_back([], err, "the fused decode step", "the module forward")
    res = engine.generate("hello", max_new_tokens=3, stop_ids=set())
    assert res.stats["fallbacks"] == ["the fused decode step: RuntimeError: out of resource: shared memory"]
    st = _strata_stats(SimpleNamespace(stats=res.stats, queue_s=0.0, finish_reason="length"))
    assert openai_schema.StrataStats(**st).fallbacks == res.stats["fallbacks"]


def test_memory_report_is_real(engine):
    rep = engine.memory_report()
    assert set(NAMES) <= rep.keys()
    c = engine.model.cfg
    # a float CPU cache: the context and the compiled step's spare slots (runtime/target_compiled.py)
    assert rep["target_kv"] == c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4 * (256 + 256)
    assert spare_slots(256) == 256
    assert rep["drafter_kv"] == 1 * 2 * c.num_key_value_heads * c.head_dim * 4 * 256
    n_params = {id(p): p for p in engine.model.parameters()}
    total = sum(p.numel() * 4 for p in n_params.values())
    # on the CPU the MTP chain's head also lives in 8 bits (runtime/drafters/mtp.py `int8_head`): a drafter weight
    head8 = engine.drafter.head8
    assert head8 is not None and head8[0].dtype == torch.int8
    total += sum(t.numel() * t.element_size() for t in head8)
    assert rep["target_dense_weights"] + rep["expert_cache"] + rep["drafter_weights"] == total
    assert rep["logits"] == 2 * engine.drafter.max_block * c.vocab_size * 4


def test_expert_cache_cpu_served_experts_give_the_same_output(tmp_path):
    folder = make_tiny_target(tmp_path, mtp=False)
    full = load_target(folder)
    half = load_target(folder)
    cache = ExpertCache(half, torch.device("cpu"), slots=6, enforce_on_cpu=True)
    assert cache.slots == 6 and len(cache.resident) == 6 and cache.total == 12
    assert cache.resident_nbytes == 6 * cache.expert_nbytes
    ids = torch.randint(0, 64, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(half(ids).logits, full(ids).logits, rtol=0, atol=1e-6)
    st = cache.stats()
    assert st["hits"] > 0 and st["misses"] > 0 and 0 < st["hit_rate"] < 1
    everything = ExpertCache(load_target(folder), torch.device("cpu"), slots=3)   # CPU: all resident
    assert everything.slots == 12


def test_engine_bad_input(setup_dir, engine):
    with pytest.raises(EngineConfigError, match="does not exist"):
        Engine.from_config(setup_dir / "missing.toml")
    with pytest.raises(EngineConfigError, match="drafter kind"):
        Engine.build(setup_dir / "tiny-target", drafter_kind="eagle")
    with pytest.raises(EngineConfigError, match="no \\[target\\] path"):
        Engine.from_config({"schema": 1})
    with pytest.raises(EngineConfigError, match="empty"):
        engine.generate("", max_new_tokens=2)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def _invoke(*args):
    return CliRunner().invoke(app, list(args))


def test_cli_json_prints_the_stats_contract(setup_dir):
    r = _invoke("--config", str(setup_dir / "config.toml"), "--prompt", "hi there", "--max-new-tokens", "9",
                "--json", "--seed", "3", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9",
                "--block", "3", "--spec-min-p", "0.01")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert set(doc) >= {"text", "token_ids", "stats"} and STATS_KEYS <= set(doc["stats"])
    st = doc["stats"]
    assert st["generated_tokens"] == len(doc["token_ids"]) <= 9 and st["drafter"] == "mtp"
    assert st["prompt_tokens"] == 8 and st["block"] == 3 and isinstance(st["accepted_per_window"], list)
    r2 = _invoke("--config", str(setup_dir / "config.toml"), "--prompt", "hi there", "--max-new-tokens", "9",
                 "--json", "--no-draft")
    assert json.loads(r2.stdout)["stats"]["drafter"] == "none"


def test_cli_threads_sets_torch_threads_and_keeps_output(setup_dir):
    before = torch.get_num_threads()
    args = ["--config", str(setup_dir / "config.toml"), "--prompt", "abc", "--max-new-tokens", "6", "--json"]
    try:
        one = _invoke(*args, "--threads", "1")
        assert one.exit_code == 0 and torch.get_num_threads() == 1
        two = _invoke(*args, "--threads", "2")
        assert two.exit_code == 0 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert json.loads(one.stdout)["token_ids"] == json.loads(two.stdout)["token_ids"]


def test_cli_streams_then_summary(setup_dir):
    r = _invoke("--config", str(setup_dir / "config.toml"), "--prompt", "abc", "--max-new-tokens", "5")
    assert r.exit_code == 0
    assert "tok/s" in r.stderr and "accepted" in r.stderr


@pytest.mark.parametrize("args, code, msg", [
    ([], 2, "--config is required"),
    (["--config", "/nonexistent/x.toml", "--prompt", "a"], 2, "does not exist"),
    (["--config", "CFG", "--prompt", "a", "--block", "0"], 2, "--block"),
    (["--config", "CFG", "--prompt", "a", "--threads", "0"], 2, "--threads must be >= 1"),
    (["--config", "CFG", "--prompt", "a", "--vram-limit-mib", "0"], 2, "--vram-limit-mib must be a positive"),
    pytest.param(["--config", "CFG", "--prompt", "a", "--vram-limit-mib", "4096"], 2, "no CUDA GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the cap applies")),
    (["--config", "CFG", "--prompt", "a", "--temperature", "-2"], 2, "temperature"),
    (["--config", "CFG", "--prompt", "a", "--top-p", "0"], 2, "top_p"),
    (["--config", "BROKEN", "--prompt", "a"], 2, "lacks tensor"),
])
def test_cli_errors_are_one_sentence(setup_dir, tmp_path, args, code, msg):
    if "BROKEN" in args:
        folder = make_tiny_target(tmp_path)
        (folder / "model.safetensors").write_bytes(b"")
        from safetensors.torch import save_file
        save_file({"model.norm.weight": torch.ones(32)}, str(folder / "model.safetensors"))
        cfg = tmp_path / "c.toml"
        cfg.write_text(f'schema = 1\n[target]\npath = "{folder}"\n[device]\ntype = "cpu"\n')
        args = [str(cfg) if a == "BROKEN" else a for a in args]
    args = [str(setup_dir / "config.toml") if a == "CFG" else a for a in args]
    r = _invoke(*args)
    assert r.exit_code == code
    assert msg in r.stderr and "Traceback" not in r.output
    assert len(r.stderr.strip().splitlines()) == 1
