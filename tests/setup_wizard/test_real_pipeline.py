"""The real pipeline, offline: a pinned STRATA_CATALOG served by the loopback Hub, real download + verify, real
DFlash2 conversion into the store, the budget, the config, and strata-run generating from it."""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path

import pytest
import tomli_w
from typer.testing import CliRunner

from setup_wizard import cli
from tests.setup_wizard.hub_server import FakeHub
from tests.setup_wizard.wizard_fakes import fake_cpu

REV_T = "1" * 40
REV_H = "2" * 40


def _pins(folder: Path) -> list[dict]:
    return [{"path": p.name, "sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "size": p.stat().st_size}
            for p in sorted(folder.iterdir()) if p.is_file()]


@pytest.fixture
def real(pack, home, tmp_path, monkeypatch):
    hub = FakeHub().start()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    for repo, rev, folder in (("t/nano", REV_T, pack["nano"]), ("t/nano-head", REV_H, pack["official"])):
        hub.add(repo, rev, {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()})
    cat = tmp_path / "catalog.toml"
    cat.write_text(tomli_w.dumps({"entry": [
        {"name": "nano", "kind": "target", "source": "hf", "repo": "t/nano", "revision": REV_T, "mtp": True,
         "file": _pins(pack["nano"])},
        {"name": "nano-head", "kind": "dflash2", "source": "hf", "repo": "t/nano-head", "revision": REV_H,
         "fits": ["nano"], "default": True, "file": _pins(pack["official"])},
    ]}))
    monkeypatch.setenv("STRATA_CATALOG", str(cat))
    monkeypatch.setattr(cli, "get_hardware", lambda: fake_cpu(ram_gib=8))
    monkeypatch.setattr(cli, "is_interactive", lambda: False)
    yield hub
    hub.stop()


def test_scripted_setup_downloads_converts_and_runs(real, home):
    from runtime.cli import app as run_app

    args = ["--yes", "--target", "nano", "--drafter", "dflash2", "--dflash2-quant", "q4_0", "--no-calibrate",
            "--context", "256"]
    res = CliRunner().invoke(cli.app, args)
    assert res.exit_code == 0, res.output
    cfg = home / "configs" / "nano-dflash2-q4_0.toml"
    doc = tomllib.loads(cfg.read_text())
    assert Path(doc["target"]["path"]).is_relative_to(home) and Path(doc["drafter"]["path"]).is_relative_to(home)
    assert doc["drafter"]["path"].endswith(".gguf") and doc["drafter"]["quantization"] == "q4_0"
    assert doc["target"]["revision"] == REV_T
    # a rerun finds everything verified and downloads nothing more
    n_gets = len([x for x in real.log if x[0] == "GET"])
    res = CliRunner().invoke(cli.app, args)
    assert res.exit_code == 0, res.output
    assert res.output.count("already done") == 3  # target, head, conversion
    assert len([x for x in real.log if x[0] == "GET"]) == n_gets
    out = CliRunner().invoke(run_app, ["--config", str(cfg), "--prompt", "Hi", "--max-new-tokens", "8", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["stats"]["generated_tokens"] == 8


def test_tampered_download_fails_with_exit_1_and_no_config(real, home):
    real.tamper[("t/nano", "model.safetensors")] = b"\0" * (len(real.repos["t/nano"][REV_T]["model.safetensors"]))
    res = CliRunner().invoke(cli.app, ["--yes", "--target", "nano", "--no-calibrate", "--context", "256"])
    assert res.exit_code == 1, res.output
    assert "sha256" in res.output and "Traceback" not in res.output
    assert not (home / "configs").exists()


def test_local_target_and_local_head_use_the_real_converter(real, home, pack):
    args = ["--yes", "--target", str(pack["nano"]), "--dflash2-head", str(pack["turbo"]), "--dflash2-quant", "q8_0",
            "--no-calibrate", "--context", "128"]
    res = CliRunner().invoke(cli.app, args)
    assert res.exit_code == 0, res.output
    doc = tomllib.loads((home / "configs" / "nano-dflash2-q8_0.toml").read_text())
    assert doc["target"]["source"] == "local" and doc["drafter"]["head"] == "turbo"
    gguf_path = Path(doc["drafter"]["path"])
    assert gguf_path.is_file() and gguf_path.is_relative_to(home)  # converted into the store
    assert doc["drafter"]["source_sha256"] == hashlib.sha256((pack["turbo"] / "model.safetensors").read_bytes()
                                                             ).hexdigest()
    res = CliRunner().invoke(cli.app, args)
    assert "convert turbo to q8_0 (already done" in res.output.replace("\n", " ")


def test_context_is_recommended_after_the_download(real, home, monkeypatch):
    # 40 MiB of RAM: 4096 tokens of attention scratch do not fit, 2048 do; the geometry is known only after download
    monkeypatch.setattr(cli, "get_hardware", lambda: fake_cpu(ram_gib=40 / 1024))
    res = CliRunner().invoke(cli.app, ["--yes", "--target", "nano", "--no-calibrate", "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["plan"]["budget"] is None  # not downloaded yet: unknown, and said so
    res = CliRunner().invoke(cli.app, ["--yes", "--target", "nano", "--no-calibrate"])
    assert res.exit_code == 0, res.output
    doc = tomllib.loads((home / "configs" / "nano-mtp.toml").read_text())
    assert doc["memory"]["context"] == 2048
    res = CliRunner().invoke(cli.app, ["--yes", "--target", "nano", "--no-calibrate", "--context", "9000"])
    assert res.exit_code == 2 and "limit of 4096" in res.output
