"""--vram-limit-mib: the budget draws from the cap (and the config records it for strata-run); bad values and a
machine without a GPU are one sentence and exit 2. An offloaded plan says its slots, hit rate and decode estimate."""

from __future__ import annotations

import json
import tomllib

import pytest
from typer.testing import CliRunner

from runtime.models.target_config import TargetGeometry
from setup_wizard.budget import BudgetInputs, compute_budget, decode_estimate
from setup_wizard.cli import app
from tests.setup_wizard.wizard_fakes import fake_cpu

MIB = 1 << 20


def run(*args):
    return CliRunner().invoke(app, list(args))


def test_cap_is_what_the_budget_draws_from_and_the_config_keeps(machine, home, services, pack):
    res = run("--yes", "--dry-run", "--json", "--vram-limit-mib", "2048", "--drafter", "none")
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output[res.output.index("{"):])["plan"]
    assert plan["budget"]["total_bytes"] == plan["budget"]["available_bytes"] == 2048 * MIB
    assert plan["device"]["vram_limit_mib"] == 2048
    res = run("--yes", "--vram-limit-mib", "2048", "--drafter", "none")
    assert res.exit_code == 0, res.output
    doc = tomllib.loads((home / "configs" / "nano-none.toml").read_text())
    assert doc["device"]["vram_limit_mib"] == 2048 and doc["device"]["total_mib"] == 2048


@pytest.mark.parametrize("value,needle", [("0", "positive"), ("999999", "more than the GPU")])
def test_bad_caps_are_one_sentence(machine, home, value, needle):
    res = run("--yes", "--vram-limit-mib", value)
    assert res.exit_code == 2 and "Traceback" not in res.output and needle in res.output, res.output


def test_cap_without_a_gpu_is_refused(machine, home):
    machine["hw"] = fake_cpu()
    res = run("--yes", "--vram-limit-mib", "4096")
    assert res.exit_code == 2 and "no CUDA GPU" in res.output, res.output


GEO = {"model_type": "qwen3_moe", "vocab_size": 1000, "hidden_size": 512, "intermediate_size": 1024,
       "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
       "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 512, "max_position_embeddings": 4096}


def _partial_budget():
    t = TargetGeometry.from_config(GEO)
    full = compute_budget(t, "none", BudgetInputs(context=1024, block=1, device_type="cuda",
                                                  available_bytes=1 << 34, total_bytes=1 << 34, headroom_bytes=0))
    b = compute_budget(t, "none", BudgetInputs(context=1024, block=1, device_type="cuda", headroom_bytes=0,
                                               available_bytes=full.fixed_bytes + 20 * full.expert_bytes,
                                               total_bytes=1 << 34))
    assert b.fits and b.offloaded and 0 < b.expert_cache_slots < b.total_experts == 64
    return b


def test_offloaded_plan_shows_slots_hit_rate_and_estimate(machine, home, services, pack):
    from setup_wizard.wizard import offload_lines

    b = _partial_budget()
    assert b.dynamic_slots == 4                                   # a one-row window needs top_k experts at once
    lines = offload_lines(b, (3e12, 5e10))
    assert f"{b.expert_cache_slots} of 64 on the GPU" in lines[0]
    assert f"{100 * (b.expert_cache_slots - 4) / 64:.0f}%" in lines[0] and "no routing profile yet" in lines[0]
    assert "Decode estimate: about" in lines[1]
    assert "unknown" in offload_lines(b, None)[1]
    assert "from the profile" in offload_lines(b, None, 0.9, "from the profile")[0]
    res = run("--yes", "--dry-run", "--json", "--drafter", "none")    # the pack fits whole: nothing offloaded
    assert json.loads(res.output[res.output.index("{"):])["plan"]["offload"] is None


def test_decode_estimate_is_the_memory_traffic_bound():
    cfg = {"model_type": "qwen3_moe", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "max_position_embeddings": 4096}
    t = TargetGeometry.from_config(cfg)
    full = compute_budget(t, "none", BudgetInputs(context=1024, block=1, device_type="cuda",
                                                  available_bytes=1 << 30, total_bytes=1 << 30))
    assert not full.offloaded and full.experts_per_token == 2 * 2
    est = decode_estimate(full, 0.3, 1e12, 1e10)                        # nothing is missed when all is resident
    assert est.missed_bytes == 0
    assert est.tok_s == pytest.approx(1e12 / est.resident_bytes)
    b = compute_budget(t, "none", BudgetInputs(context=1024, block=1, device_type="cuda",
                                               available_bytes=full.fixed_bytes + 5 * full.expert_bytes,
                                               total_bytes=1 << 30, headroom_bytes=0))
    if b.offloaded:
        e = decode_estimate(b, 0.5, 1e12, 1e10)
        per = b.experts_per_token * b.expert_bytes
        assert e.missed_bytes == per // 2 and e.resident_bytes == b.dense_read_bytes + per // 2
        assert e.tok_s == pytest.approx(1 / (e.resident_bytes / 1e12 + e.missed_bytes / 1e10))
