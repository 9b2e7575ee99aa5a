"""`draft_temp_scale`: sampled drafts drawn at the request's temperature times a scale (runtime/speculative.py),
from the config, the engine and `strata-run`; greedy decoding never sees it. That the output stays the target's
in distribution is checked in tests/runtime/test_speculative_distribution.py."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from runtime.cli import app
from runtime.config import ConfigError, parse
from runtime.engine import Engine, EngineConfigError, SamplingParams
from runtime.errors import UsageError
from tests.runtime.tiny import make_tiny_target, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


def config_text(extra: str = "") -> str:
    return ('schema = 1\n[target]\nname = "tiny"\npath = "tiny-target"\n[drafter]\nkind = "mtp"\n'
            f'[speculative]\nblock = 4\nspec_min_p = 0.0\nsource = "default"\n{extra}'
            '[memory]\ncontext = 128\n[device]\ntype = "cpu"\n')


@pytest.fixture(scope="module")
def setup_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("dts")
    make_tiny_target(root, seed=4, scale=2.0)
    (root / "config.toml").write_text(config_text("draft_temp_scale = 1.5\n"))
    return root


class Spy:
    """Notes the sampling parameters each proposal is asked with."""

    def __init__(self, inner) -> None:
        self.inner, self.seen = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, anchor, pos, n, **kw):
        self.seen.append(kw.get("sampling"))
        return self.inner.propose(anchor, pos, n, **kw)


def test_the_config_scale_reaches_the_drafter_and_greedy_is_untouched(setup_dir):
    eng = Engine.from_config(setup_dir / "config.toml")
    assert eng.draft_temp_scale == 1.5
    spy = Spy(eng.drafter)
    eng.drafter = spy
    try:
        sp = SamplingParams(temperature=0.8, top_p=0.9, seed=3)
        res = eng.generate("hello world", max_new_tokens=12, sampling=sp, stop_ids=set())
        assert spy.seen and all(s.temperature == pytest.approx(1.2) and s.top_p == 0.9 for s in spy.seen)
        assert res.stats["draft_temp_scale"] == 1.5
        spy.seen.clear()
        res = eng.generate("hello world", max_new_tokens=12, sampling=sp, stop_ids=set(), draft_temp_scale=1.0)
        assert all(s.temperature == 0.8 for s in spy.seen)            # a run's own scale wins
        spy.seen.clear()
        greedy = eng.generate("hello world", max_new_tokens=12, stop_ids=set())
        assert spy.seen and all(s is None for s in spy.seen) and greedy.stats["draft_temp_scale"] is None
        plain = eng.generate("hello world", max_new_tokens=12, stop_ids=set(), draft_temp_scale=3.0)
        assert plain.token_ids == greedy.token_ids
    finally:
        eng.drafter = spy.inner


def test_bad_scales_are_one_sentence(setup_dir):
    with pytest.raises(EngineConfigError, match=r"draft_temp_scale must be in \(0, 4.0\], got 0"):
        Engine.from_config(setup_dir / "config.toml", draft_temp_scale=0)
    eng = Engine.from_config(setup_dir / "config.toml")
    with pytest.raises(UsageError, match=r"draft_temp_scale must be in \(0, 4.0\], got 5"):
        eng.generate("hi", max_new_tokens=2, sampling=SamplingParams(temperature=1.0), draft_temp_scale=5)
    import tomllib

    with pytest.raises(ConfigError, match="draft_temp_scale"):
        parse(tomllib.loads(config_text("draft_temp_scale = 0.0\n")))
    assert parse(tomllib.loads(config_text())).speculative.draft_temp_scale is None


def test_strata_run_flag(setup_dir):
    cfg = str(setup_dir / "config.toml")
    res = CliRunner().invoke(app, ["--config", cfg, "--prompt", "hi", "--draft-temp-scale", "0"])
    assert res.exit_code == 2 and "--draft-temp-scale must be above 0 and at most 4, got 0.0" in res.output
    assert "Traceback" not in res.output
    res = CliRunner().invoke(app, ["--config", cfg, "--prompt", "hi", "--max-new-tokens", "6", "--temperature",
                                   "0.9", "--seed", "1", "--draft-temp-scale", "2", "--json"])
    assert res.exit_code == 0, res.output
    import json

    assert json.loads(res.stdout)["stats"]["draft_temp_scale"] == 2.0
