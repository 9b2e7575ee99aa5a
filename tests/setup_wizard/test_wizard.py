"""The interactive wizard driven through prompt_toolkit pipe input (questionary's own testing approach)."""

from __future__ import annotations

import tomllib

import pytest
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from setup_wizard import cli
from setup_wizard.choices import Choices

ENTER, DOWN, CTRL_C = "\r", "\x1b[B", "\x03"


def drive(keys: str, choices: Choices | None = None) -> int:
    with create_pipe_input() as inp:
        inp.send_text(keys)
        return cli.run_setup(choices or Choices(), interactive=True, dry_run=False, json_out=False,
                             input=inp, output=DummyOutput())


def config(home, name):
    return tomllib.loads((home / "configs" / name).read_text())


def test_enter_everywhere_takes_the_defaults(machine, home, services, capsys):
    # target, drafter, context, reserve, calibrate, go ahead
    assert drive(ENTER * 6) == 0
    shown = capsys.readouterr().out
    assert "ships with strata-setup" in shown and "well-tested" in shown and "you chose it" not in shown
    doc = config(home, "nano-mtp.toml")
    assert doc["target"]["name"] == "nano" and doc["drafter"]["kind"] == "mtp"
    assert doc["memory"]["context"] == 4096 and doc["memory"]["reserve_mib"] == 512
    assert doc["speculative"]["source"] == "calibrated"


@pytest.mark.parametrize("head_keys, head", [(ENTER, "official"), (DOWN + ENTER, "turbo")])
@pytest.mark.parametrize("quant_keys, quant", [(ENTER, "bf16"), (DOWN + ENTER, "q8_0"), (DOWN * 2 + ENTER, "q4_0")])
def test_dflash2_each_head_and_quant(machine, home, services, head_keys, head, quant_keys, quant):
    keys = ENTER + DOWN + ENTER + head_keys + quant_keys + ENTER + ENTER + "n" + ENTER + ENTER
    assert drive(keys) == 0
    doc = config(home, f"nano-dflash2-{quant}.toml")
    assert doc["drafter"]["head"] == head and doc["drafter"]["quantization"] == quant
    assert doc["speculative"]["source"] == "default"  # calibration declined
    assert ("convert", (head, quant)) in services.calls


def test_q5_0_by_flag_skips_the_quant_question(machine, home):
    keys = ENTER + ENTER + ENTER + ENTER + "n" + ENTER + ENTER  # target, head, context, reserve, calibrate, go
    assert drive(keys, Choices(dflash2_quant="q5_0")) == 0
    assert config(home, "nano-dflash2-q5_0.toml")["drafter"]["quantization"] == "q5_0"


def test_none_asks_no_calibration(machine, home, services):
    keys = ENTER + DOWN * 2 + ENTER + ENTER + ENTER + ENTER  # target, drafter=none, context, reserve, go
    assert drive(keys) == 0
    assert config(home, "nano-none.toml")["drafter"] == {"kind": "none"}
    assert not any(c[0] == "calibrate" for c in services.calls)


def test_typed_values_and_validation(machine, home):
    # context: clear the default, type an invalid value and one over the model's limit (both rejected), then 1024;
    # reserve: 256
    bs = "\x7f" * 8
    keys = (ENTER + ENTER + bs + "abc" + ENTER + bs + "99999" + ENTER + bs + "1024" + ENTER + bs + "256" + ENTER
            + "n" + ENTER + ENTER)
    assert drive(keys) == 0
    doc = config(home, "nano-mtp.toml")
    assert doc["memory"]["reserve_mib"] == 256 and doc["memory"]["context"] == 1024


def test_declining_the_summary_writes_nothing(machine, home, services):
    assert drive(ENTER * 5 + "n" + ENTER) == 0
    assert not (home / "configs").exists() and services.calls == []


@pytest.mark.parametrize("at", [0, 1, 3, 5])
def test_ctrl_c_mid_flow_writes_nothing(machine, home, services, at):
    with pytest.raises(KeyboardInterrupt):
        drive(ENTER * at + CTRL_C)
    assert not home.exists() or list(home.rglob("*")) == []
    assert services.calls == []


def test_flags_skip_their_questions(machine, home):
    # everything answered by flags except the confirmation
    ch = Choices(target="nano", drafter="none", context=256, vram_reserve_mib=0, calibrate=False)
    assert drive(ENTER, ch) == 0
    assert config(home, "nano-none.toml")["memory"]["context"] == 256
