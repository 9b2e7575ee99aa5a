"""The config schema (runtime/config.py): every key's type and range, one sentence naming the key, exit code 2."""

import pytest
import tomli_w
from typer.testing import CliRunner

from runtime.cli import app
from runtime.config import parse
from runtime.errors import ConfigError, exit_code
from tests.runtime.tiny import make_tiny_target, single_thread  # noqa: F401

BASE = {"schema": 1, "target": {"path": "tiny-target"}, "drafter": {"kind": "none"}, "memory": {"context": 64},
        "device": {"type": "cpu"}}


def _with(table, key, value):
    doc = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    if table is None:
        doc[key] = value
    else:
        doc.setdefault(table, {})[key] = value
    return doc


@pytest.mark.parametrize("table,key,value,needle", [
    ("speculative", "block", "8", "'speculative.block' = '8', which is not a whole number"),
    ("memory", "context", 4096.5, "'memory.context' = 4096.5, which is not a whole number"),
    ("memory", "expert_cache_slots", "all", "'memory.expert_cache_slots' = 'all', which is not a whole number"),
    (None, "speculative", "x", "'speculative' = 'x', which is not a table"),
    ("speculative", "spec_min_p", 1.5, "'speculative.spec_min_p' = 1.5, which is not at most 1"),
    ("speculative", "block", 0, "'speculative.block' = 0, which is not at least 1"),
    ("memory", "context", 1, "'memory.context' = 1, which is not at least 2"),
    ("drafter", "kind", "eagle3", "unknown drafter kind 'eagle3'"),
    ("drafter", "quantization", "q3_k", "unknown drafter quantization 'q3_k'"),
    ("target", "has_mtp", "yes", "'target.has_mtp' = 'yes', which is not true or false"),
])
def test_bad_values_name_the_key(table, key, value, needle):
    with pytest.raises(ConfigError) as e:
        parse(_with(table, key, value), where="c.toml")
    assert needle in str(e.value) and str(e.value).count(". ") == 0 and exit_code(e.value) == 2


def test_round_trip_keeps_user_keys(tmp_path):
    doc = _with("memory", "my_note", "kept")
    doc["user_top"] = 3
    cfg = parse(doc, base=tmp_path)
    out = cfg.to_doc()
    assert out["memory"]["my_note"] == "kept" and out["user_top"] == 3 and out["memory"]["context"] == 64
    assert cfg.resolve("tiny-target") == tmp_path / "tiny-target"


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("table,key,value", [("speculative", "block", "8"), ("memory", "context", 4096.5),
                                             ("memory", "expert_cache_slots", "all"), (None, "speculative", "x"),
                                             ("memory", "context", 100_000)])
def test_strata_run_refuses_bad_configs_with_exit_2(tmp_path, table, key, value):
    make_tiny_target(tmp_path)
    p = tmp_path / "c.toml"
    p.write_text(tomli_w.dumps(_with(table, key, value)))
    r = CliRunner().invoke(app, ["--config", str(p), "--prompt", "hi"])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
    assert (key in r.output) or ("maximum" in r.output)
