"""The target's size in the wizard: "Which size?" (BF16 / Q8_0 / Q4_0 with download, disk, memory and fit), the
`--target-quant` flag, a local .gguf as --target, and what the config, budget and calibration key carry."""

from __future__ import annotations

import tomllib

import pytest
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput
from typer.testing import CliRunner

from runtime.engine import Engine
from runtime.formats.target_gguf import read_geometry
from setup_wizard import cli
from setup_wizard import target_sizes as TS
from setup_wizard.budget import Budget
from setup_wizard.choices import Choices
from setup_wizard.cli import app
from setup_wizard.plan import resolve
from setup_wizard.steps import budget_for_doc
from tests.setup_wizard.target_gguf_helpers import llamacpp_block_gguf, make_bpe_target
from tests.setup_wizard.wizard_fakes import FakeServices, fake_cpu, fake_gpu

ENTER, DOWN = "\r", "\x1b[B"


def run(*args):
    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return make_bpe_target(tmp_path_factory.mktemp("bpe"), "bpe-nano", style="qwen2", mtp=True)


@pytest.fixture
def qservices(pack, bpe, home):
    return FakeServices(pack={**pack, "bpe": bpe}, store=home / "store")


@pytest.fixture
def qmachine(machine, qservices):
    machine["services"] = qservices
    return machine


def test_sizes_offered_for_a_convertible_folder(bpe, qservices):
    plan = resolve(Choices(target=str(bpe), drafter="mtp"), fake_gpu(), qservices)
    assert [o.quant for o in plan.sizes] == ["bf16", "q8_0", "q4_0"]
    assert plan.target_quant == "bf16" and "every expert fits" in plan.why["target_quant"]
    by = {o.quant: o for o in plan.sizes}
    assert by["bf16"].memory_bytes > by["q8_0"].memory_bytes > by["q4_0"].memory_bytes
    assert by["bf16"].disk_bytes < by["q8_0"].disk_bytes    # the checkpoint stays; the GGUF comes on top
    line = by["q4_0"].line()
    assert "Q4_0" in line and "disk" in line and "memory" in line and "fits" in line
    assert f"{100 * TS.AGREEMENT['q4_0']:.1f}%" in line       # the quality note
    # the budget of each line is the target at that size
    assert by["q8_0"].budget.items["target_dense_weights"] < by["bf16"].budget.items["target_dense_weights"]


def test_only_bf16_for_a_folder_that_cannot_be_converted(pack, services):
    plan = resolve(Choices(target=str(pack["nano"]), drafter="mtp"), fake_gpu(), services)   # WordLevel tokenizer
    assert [o.quant for o in plan.sizes] == ["bf16"] and plan.target_quant == "bf16"
    assert "cannot be converted" in plan.why["target_quant"]


def _budget(fits: bool, slots: int, total: int = 10, device: str = "cuda") -> Budget:
    return Budget(items={}, available_bytes=1, total_bytes=1, device_type=device, expert_bytes=1, total_experts=total,
                  expert_cache_slots=slots, remaining_bytes=0, fits=fits)


@pytest.mark.parametrize("fits, want", [
    ({"bf16": (True, 10), "q8_0": (True, 10), "q4_0": (True, 10)}, "bf16"),
    ({"bf16": (True, 4), "q8_0": (True, 10), "q4_0": (True, 10)}, "q8_0"),
    ({"bf16": (False, 0), "q8_0": (True, 6), "q4_0": (True, 10)}, "q4_0"),
    # no size keeps every expert: the one that keeps the most (quantized experts stream too, runtime/experts.py)
    ({"bf16": (True, 2), "q8_0": (True, 5), "q4_0": (True, 9)}, "q4_0"),
    ({"bf16": (True, 2), "q8_0": (False, 0), "q4_0": (False, 0)}, "bf16"),
    ({"bf16": (False, 0), "q8_0": (False, 0), "q4_0": (False, 0)}, "q4_0"),
])
def test_recommendation(fits, want):
    opts = [TS.SizeOption(q, 0, 1, 1, _budget(*fits[q]), 4096) for q in ("bf16", "q8_0", "q4_0")]
    assert TS.recommend(opts)[0] == want


def test_estimated_before_download():
    opts = [TS.option(q, None, None, context=4096, wb=2, checkpoint_bytes=60 << 30, here=False, with_mtp=False)
            for q in ("bf16", "q8_0", "q4_0")]
    assert all(o.download_bytes == 60 << 30 and not o.exact for o in opts)
    assert TS.recommend_estimated(opts, 24 << 30)[0] == "q4_0"
    assert TS.recommend_estimated(opts, 48 << 30)[0] == "q8_0"
    assert TS.recommend_estimated(opts, 141 << 30)[0] == "bf16"
    assert "~" in opts[1].line() and "after download" in opts[1].line()


def test_scripted_q8_0_setup_runs_the_converted_file(qmachine, home, qservices, bpe):
    res = run("--yes", "--target", str(bpe), "--target-quant", "q8_0", "--drafter", "mtp", "--no-calibrate",
              "--context", "256")
    assert res.exit_code == 0, res.output
    cfg_path = home / "configs" / "bpe-nano-q8_0-mtp.toml"     # the target quantization is in the name
    doc = tomllib.loads(cfg_path.read_text())
    t = doc["target"]
    assert t["quantization"] == "q8_0" and t["path"].endswith("model.gguf")
    assert set(t["files"]) == {"model.gguf", "mtp.gguf"} and t["source_path"] == str(bpe.resolve())
    assert doc["calibration"]["key"]["target_quantization"] == "q8_0"
    assert ("convert_target", ("bpe-nano", "q8_0")) in qservices.calls
    # the budget in the config is the quantized one, and recomputing it from the config agrees
    assert budget_for_doc(doc, qmachine["hw"]).table() == doc["memory"]["budget"] | {
        "expert_cache": doc["memory"]["budget"]["expert_cache"]}
    eng = Engine.from_config(cfg_path, device="cpu", dtype="fp32", kv_dtype="fp32")
    assert eng.model.model.layers[0].mlp.fmt == "q8_0"
    out = eng.generate("def f(x):", max_new_tokens=8)
    assert len(out.token_ids) == 8 and out.stats["drafter"] == "mtp"
    # a rerun reuses the converted file
    res = run("--yes", "--target", str(bpe), "--target-quant", "q8_0", "--drafter", "mtp", "--no-calibrate",
              "--context", "256")
    assert res.exit_code == 0, res.output
    assert "convert bpe-nano to q8_0" in res.output


def test_local_gguf_target(qmachine, home, qservices, bpe, tmp_path):
    from setup_wizard.convert_target import convert_target

    gg = convert_target(bpe, "q4_0", tmp_path / "mine" / "model.gguf").path
    res = run("--yes", "--target", str(gg), "--drafter", "mtp", "--no-calibrate", "--context", "256",
              "--config-out", str(tmp_path / "c.toml"))
    assert res.exit_code == 0, res.output
    doc = tomllib.loads((tmp_path / "c.toml").read_text())
    assert doc["target"]["quantization"] == "q4_0" and doc["target"]["path"] == str(gg)
    assert not any(c[0] == "convert_target" for c in qservices.calls)
    assert Engine.from_config(tmp_path / "c.toml", device="cpu", dtype="fp32").generate("x", max_new_tokens=2)
    res = run("--yes", "--target", str(gg), "--target-quant", "q8_0", "--drafter", "mtp")
    assert res.exit_code == 2 and "stored as q4_0" in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("main", ["Q5_K", "IQ4_XS"])
def test_llamacpp_block_gguf_target(machine, home, tmp_path, main):
    """A file as llama-quantize's Q5_K_M (IQ4_XS) makes it, given as the target: set up as stored (its format named
    by the experts' bytes), budgeted from its tensor table, and it generates."""
    gg, _, _ = llamacpp_block_gguf(tmp_path, main)
    res = run("--yes", "--target", str(gg), "--drafter", "none", "--no-calibrate", "--context", "256",
              "--config-out", str(tmp_path / "c.toml"))
    assert res.exit_code == 0, res.output
    doc = tomllib.loads((tmp_path / "c.toml").read_text())
    assert doc["target"]["quantization"] == main.lower() and doc["target"]["path"] == str(gg)
    eng = Engine.from_config(tmp_path / "c.toml", device="cpu", dtype="fp32")
    assert eng.model.model.layers[0].mlp.fmt == (main.lower(), "q6_k")
    # the budget counts the file's block bytes as they are and its float tensors at the machine's dtype (the fake
    # GPU's BF16; the CPU engine here holds fp32)
    geo = read_geometry(gg)
    assert doc["memory"]["budget"]["target_dense_weights"] == geo.dense_bytes(2)
    assert eng.memory_report()["target_dense_weights"] == geo.dense_bytes(4)
    assert len(eng.generate("x", max_new_tokens=3).token_ids) == 3


def test_target_quant_refused_when_not_convertible(machine, pack):
    res = run("--yes", "--target", str(pack["nano"]), "--target-quant", "q4_0")
    assert res.exit_code == 2 and "not possible" in res.output and "Traceback" not in res.output
    res = run("--yes", "--target-quant", "q5_0")
    assert res.exit_code == 2 and "Unknown target quantization" in res.output


def test_which_size_question(qmachine, home, qservices, bpe, capsys):
    # drafter (mtp), size (Q4_0: two down), context, reserve, calibrate (no), go
    keys = ENTER + DOWN * 2 + ENTER + ENTER + ENTER + "n" + ENTER + ENTER
    with create_pipe_input() as inp:
        inp.send_text(keys)
        code = cli.run_setup(Choices(target=str(bpe)), interactive=True, dry_run=False, json_out=False, input=inp,
                             output=DummyOutput())
    assert code == 0
    doc = tomllib.loads((home / "configs" / "bpe-nano-q4_0-mtp.toml").read_text())    # the size chosen, named
    assert doc["target"]["quantization"] == "q4_0"


def test_cpu_budget_counts_blocks(bpe, qservices):
    hw = fake_cpu(ram_gib=8)
    plans = {q: resolve(Choices(target=str(bpe), drafter="mtp", target_quant=q, context=256), hw, qservices)
             for q in ("bf16", "q8_0", "q4_0")}
    dense = {q: p.budget.items["target_dense_weights"] for q, p in plans.items()}
    assert dense["bf16"] > dense["q8_0"] > dense["q4_0"]
    assert plans["q4_0"].budget.expert_bytes < plans["bf16"].budget.expert_bytes / 3   # fp32 on CPU vs 18 B / 32


def test_quality_note_is_the_measured_figure():
    """The size question quotes bench/quant_target.py's measurement (bench/results/quant_target.json)."""
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).resolve().parents[2] / "bench" / "results" / "quant_target.json").read_text())
    for q, a in TS.AGREEMENT.items():
        assert round(data["agreement"]["quants"][q]["top1"], 3) == a
