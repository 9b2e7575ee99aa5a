"""The KV cache's format in the setup: `--kv-dtype`, the answers file, the recommendation where the compute dtype's
cache does not fit, the question for long contexts, and what the config and the budget carry."""

from __future__ import annotations

import json
import tomllib

import pytest
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput
from typer.testing import CliRunner

from setup_wizard import cli
from setup_wizard.choices import Choices
from setup_wizard.cli import app
from tests.runtime.tiny import make_tiny_target
from tests.setup_wizard.test_cli_flags import one_sentence_error
from tests.setup_wizard.wizard_fakes import fake_cpu, fake_gpu

GIB = 1 << 30
ENTER, DOWN = "\r", "\x1b[B"


def run(*args):
    return CliRunner().invoke(app, list(args))


@pytest.fixture
def target32(tmp_path):
    """A local tiny target whose heads are 32 wide (a q8_0 cache needs a multiple of 32; the pack's are 16)."""
    return make_tiny_target(tmp_path / "models", "wide-heads", hidden=64, heads=4, kv_heads=2, head_dim=32,
                            vocab=80, layers=3, mtp=True)


def dry_plan(*args) -> dict:
    res = run("--yes", "--dry-run", "--json", "--vram-reserve-mib", "0", *args)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)["plan"]


def test_flag_reaches_config_and_halves_the_target_cache(machine, home, target32):
    bf16 = dry_plan("--target", str(target32), "--drafter", "none", "--context", "4096")
    q8 = dry_plan("--target", str(target32), "--drafter", "none", "--context", "4096", "--kv-dtype", "q8_0")
    assert bf16["kv_dtype"] == "bf16" and q8["kv_dtype"] == "q8_0"
    # 3 layers x K and V x 2 heads x 32 values a token: 2 bytes each in bf16, 34 bytes a 32-value q8_0 block
    tokens, vectors = 4096, 3 * 2 * 2
    assert bf16["budget"]["items"]["target_kv"] == tokens * vectors * 32 * 2
    assert q8["budget"]["items"]["target_kv"] == tokens * vectors * 34
    res = run("--yes", "--no-calibrate", "--target", str(target32), "--drafter", "none", "--context", "4096",
              "--kv-dtype", "q8_0", "--config-out", str(home / "q8.toml"))
    assert res.exit_code == 0, res.output
    doc = tomllib.loads((home / "q8.toml").read_text())
    assert doc["memory"]["kv_dtype"] == "q8_0" and doc["memory"]["dtype"] == "bf16"
    assert doc["memory"]["budget"]["target_kv"] == q8["budget"]["items"]["target_kv"]


def test_default_is_the_compute_dtype(machine, home):
    assert dry_plan()["kv_dtype"] == "bf16"
    machine["hw"] = fake_cpu()
    assert dry_plan()["kv_dtype"] == "fp32"


def test_cpu_takes_bf16_beside_fp32_weights(machine, home):
    machine["hw"] = fake_cpu()
    res = run("--yes", "--no-calibrate", "--kv-dtype", "bf16")
    assert res.exit_code == 0, res.output
    doc = tomllib.loads((home / "configs" / "nano-mtp.toml").read_text())
    assert doc["memory"]["kv_dtype"] == "bf16" and doc["memory"]["dtype"] == "fp32"
    fp32 = dry_plan("--kv-dtype", "fp32")["budget"]["items"]["target_kv"]
    assert fp32 > 4096 * 3 * 2 * 2 * 16 * 4             # the pack: 3 layers, K and V, 2 heads of 16 (+ spare rows)
    assert doc["memory"]["budget"]["target_kv"] * 2 == fp32


@pytest.mark.parametrize("hw, args, needles", [
    ("gpu", ["--kv-dtype", "int4"], ["Unknown KV cache format 'int4'", "fp32, bf16 or q8_0"]),
    ("gpu", ["--kv-dtype", "fp32"], ["not offered on a GPU", "bf16 or q8_0"]),
    ("gpu", ["--kv-dtype", "q8_0"], ["multiple of 32", "has 16", "--kv-dtype bf16"]),
    ("cpu", ["--kv-dtype", "q8_0"], ["multiple of 32", "--kv-dtype fp32"]),
])
def test_bad_kv_dtype_is_one_sentence(machine, home, hw, args, needles):
    if hw == "cpu":
        machine["hw"] = fake_cpu()
    one_sentence_error(run("--yes", *args), *needles)
    assert not (home / "configs").exists()


def test_answers_file_takes_kv_dtype(machine, home, tmp_path):
    machine["hw"] = fake_cpu()
    ans = tmp_path / "a.toml"
    ans.write_text('kv-dtype = "bf16"\ncalibrate = false\n')
    assert run("--answers", str(ans)).exit_code == 0
    assert tomllib.loads((home / "configs" / "nano-mtp.toml").read_text())["memory"]["kv_dtype"] == "bf16"


def _smallest_fit_mib(machine, target, kv: str) -> int:
    """The least free GPU memory (MiB) at which a 4096-token setup of `target` with this cache fits."""
    lo, hi = 0, 1024
    while hi - lo > 1:
        mid = (lo + hi) // 2
        machine["hw"] = fake_gpu(total_gib=1, free_gib=mid / 1024)
        res = run("--yes", "--dry-run", "--json", "--vram-reserve-mib", "0", "--target", str(target), "--drafter",
                  "none", "--context", "4096", "--kv-dtype", kv)
        fits = res.exit_code == 0 and json.loads(res.stdout)["plan"]["budget"]["fits"]
        lo, hi = (lo, mid) if fits else (mid, hi)
    return hi


def test_q8_0_recommended_where_bf16_does_not_fit(machine, home, tmp_path):
    # a target whose 4096-token bf16 cache is tens of MiB, so that the two thresholds are MiB apart
    big = make_tiny_target(tmp_path / "models", "long-cache", hidden=64, heads=8, kv_heads=8, head_dim=64,
                           vocab=80, layers=8, mtp=False)
    need_q8, need_bf16 = _smallest_fit_mib(machine, big, "q8_0"), _smallest_fit_mib(machine, big, "bf16")
    assert need_q8 + 8 < need_bf16
    machine["hw"] = fake_gpu(total_gib=1, free_gib=(need_q8 + need_bf16) / 2 / 1024)
    plan = dry_plan("--target", str(big), "--drafter", "none", "--context", "4096")
    assert plan["kv_dtype"] == "q8_0" and plan["budget"]["fits"]
    assert "does not fit" in plan["why"]["kv_dtype"]
    # given, bf16 is kept and the setup says it does not fit
    res = run("--yes", "--vram-reserve-mib", "0", "--target", str(big), "--drafter", "none", "--context", "4096",
              "--kv-dtype", "bf16", "--no-calibrate")
    assert res.exit_code == 1 and "Does not fit" in res.output
    # with room, the compute dtype again
    machine["hw"] = fake_gpu(total_gib=1, free_gib=(need_bf16 + 8) / 1024)
    assert dry_plan("--target", str(big), "--drafter", "none", "--context", "4096")["kv_dtype"] == "bf16"


def drive(keys: str, choices: Choices) -> int:
    with create_pipe_input() as inp:
        inp.send_text(keys)
        return cli.run_setup(choices, interactive=True, dry_run=False, json_out=False, input=inp,
                             output=DummyOutput())


def test_wizard_asks_for_long_contexts_only(machine, home, services, capsys):
    machine["hw"] = fake_cpu()
    base = Choices(target="nano", drafter="none", vram_reserve_mib=0)
    # CPU, 4096 tokens: asked; the second line is bf16
    assert drive(DOWN + ENTER + ENTER, Choices(**{**base.__dict__, "context": 4096})) == 0
    shown = capsys.readouterr().out
    assert "KV cache" in shown and "bf16" in shown
    assert tomllib.loads((home / "configs" / "nano-none.toml").read_text())["memory"]["kv_dtype"] == "bf16"
    # CPU, 1024 tokens: not asked (the one ENTER confirms the plan), the compute dtype
    assert drive(ENTER, Choices(**{**base.__dict__, "context": 1024})) == 0
    assert tomllib.loads((home / "configs" / "nano-none.toml").read_text())["memory"]["kv_dtype"] == "fp32"
    # GPU, 4096 tokens: not asked
    machine["hw"] = fake_gpu()
    assert drive(ENTER, Choices(**{**base.__dict__, "context": 4096})) == 0
    assert tomllib.loads((home / "configs" / "nano-none.toml").read_text())["memory"]["kv_dtype"] == "bf16"
