"""Scripted setup on a tiny pack, then the runtime: it allocates what the budget says and strata-run generates."""

from __future__ import annotations

import json
import tomllib

import pytest
from typer.testing import CliRunner

from setup_wizard.cli import app
from tests.setup_wizard.wizard_fakes import fake_cpu

CASES = [
    ("mtp", []),
    ("none", []),
    ("dflash2", ["--dflash2-quant", "bf16"]),
    ("dflash2", ["--dflash2-quant", "q4_0", "--dflash2-head", "turbo"]),
]


@pytest.mark.parametrize("drafter, extra", CASES)
def test_runtime_allocates_what_the_budget_says(machine, home, drafter, extra):
    from runtime.engine import Engine

    machine["hw"] = fake_cpu(ram_gib=8)  # CPU: fp32 weights and KV, every expert in RAM
    res = CliRunner().invoke(app, ["--yes", "--no-calibrate", "--context", "256", "--drafter", drafter, *extra])
    assert res.exit_code == 0, res.output
    quant = extra[extra.index("--dflash2-quant") + 1] if "--dflash2-quant" in extra else None
    doc = tomllib.loads((home / "configs" / f"nano-{drafter}{'-' + quant if quant else ''}.toml").read_text())
    predicted = doc["memory"]["budget"]
    engine = Engine.from_config(doc)
    real = engine.memory_report()
    for name in ("target_dense_weights", "drafter_weights", "target_kv", "drafter_kv", "logits", "expert_cache"):
        assert real[name] == predicted[name], (name, real[name], predicted[name])
    # scratch: the budget covers the transient peak of the largest forward; the runtime reports persistent buffers
    assert predicted["scratch"] >= real["scratch"]


def test_scripted_setup_then_strata_run_generates(machine, home):
    from runtime.cli import app as run_app

    machine["hw"] = fake_cpu(ram_gib=8)
    res = CliRunner().invoke(app, ["--yes", "--no-calibrate", "--context", "256", "--drafter", "dflash2",
                                   "--dflash2-quant", "q8_0"])
    assert res.exit_code == 0, res.output
    cfg = home / "configs" / "nano-dflash2-q8_0.toml"
    assert f"strata-run --config {cfg} --prompt Hello" in res.output
    out = CliRunner().invoke(run_app, ["--config", str(cfg), "--prompt", "Hello", "--max-new-tokens", "12",
                                       "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["stats"]["drafter"] == "dflash2" and data["stats"]["generated_tokens"] == 12
    assert len(data["token_ids"]) == 12
    # same greedy output as the target alone (speculation never changes it)
    alone = CliRunner().invoke(run_app, ["--config", str(cfg), "--prompt", "Hello", "--max-new-tokens", "12",
                                         "--json", "--no-draft"])
    assert json.loads(alone.stdout)["token_ids"] == data["token_ids"]
