"""Review fixes: the stats contract holds for target-only runs and for windows cut by a stop token, and a bad
device in the config is bad input (exit 2), not a failure."""

import pytest
from typer.testing import CliRunner

from runtime.cli import app
from runtime.engine import Engine, EngineConfigError
from runtime.kv import KVCache
from runtime.loading import load_target
from runtime.speculative import generate_ids
from tests.runtime.test_speculative_greedy import OracleDrafter
from tests.runtime.tiny import make_tiny_target, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")
PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_target(make_tiny_target(tmp_path_factory.mktemp("review"), seed=11, scale=2.0))


def _kv(model, cap=128):
    c = model.cfg
    return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, cap)


def _consistent(st, ids):
    assert st["generated_tokens"] == len(ids)
    assert st["windows"] == len(st["accepted_per_window"]) and sum(st["accepted_per_window"]) == st["accepted"]
    assert st["accepted"] <= st["proposed"]
    assert st["accepted"] <= st["generated_tokens"] - 1     # every accepted proposal is an emitted token


def test_target_only_windows_have_an_entry_each(model):
    res = generate_ids(model, _kv(model), PROMPT, max_new_tokens=10)
    assert res.stats["windows"] == 9 and res.stats["accepted_per_window"] == [0] * 9
    _consistent(res.stats, res.token_ids)


@pytest.mark.parametrize("stop_at", [1, 2, 4])
def test_stop_inside_accepted_run_counts_only_emitted_tokens(model, stop_at):
    ref = generate_ids(model, _kv(model), PROMPT, max_new_tokens=16).token_ids
    stop = ref[stop_at]
    cut = ref[: ref.index(stop) + 1]
    dr = OracleDrafter(PROMPT, ref, model.cfg.vocab_size)
    res = generate_ids(model, _kv(model), PROMPT, drafter=dr, block=8, max_new_tokens=16, stop_ids={stop})
    assert res.token_ids == cut and res.stop_reason == "stop"
    _consistent(res.stats, res.token_ids)
    assert res.stats["accepted"] == len(cut) - 1      # the oracle is always right: all emitted after the first


@pytest.mark.parametrize("device", ["tpu", "meta", "cuda:x"])
def test_unknown_device_is_bad_input(tmp_path, device):
    make_tiny_target(tmp_path, seed=4, scale=2.0)
    with pytest.raises(EngineConfigError, match="unknown device"):
        Engine.build(tmp_path / "tiny-target", device=device, context=32)
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'schema = 1\n[target]\npath = "tiny-target"\n[drafter]\nkind = "none"\n'
                   f'[memory]\ncontext = 32\n[device]\ntype = "{device}"\n')
    r = CliRunner().invoke(app, ["--config", str(cfg), "--prompt", "hi", "--json"])
    assert r.exit_code == 2 and "unknown device" in r.output and "Traceback" not in r.output
