"""The store never loses a user's model, never writes outside itself, and never trusts a changed file
(docs/store.md). Each test reproduces one finding of a fault campaign on the store and checks its fix."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from runtime.cli import app as run_app
from setup_wizard import cli
from setup_wizard.store import MANIFEST, Store
from tests.setup_wizard.hub_helpers import REV
from tests.setup_wizard.wizard_fakes import fake_cpu

NANO_DIR = "downloads/bundled--strata-nano"


def setup_cmd(*args: str):
    return CliRunner().invoke(cli.app, list(args))


def run_cmd(config: Path | str, n: int = 3):
    return CliRunner().invoke(run_app, ["--config", str(config), "--prompt", "def read_config(path):",
                                        "--max-new-tokens", str(n), "--json", "--threads", "1"])


def gc_json(*extra: str) -> dict:
    r = setup_cmd("models", "gc", "--json", *extra)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def flip_keep_mtime(path: Path, at: int = -1) -> None:
    """A same-size change with the modification time put back (bit rot, or a careless edit)."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture
def cpu(monkeypatch, home):
    monkeypatch.setattr(cli, "get_hardware", lambda: fake_cpu(ram_gib=8))
    monkeypatch.setattr(cli, "is_interactive", lambda: False)
    return home


# ---------------------------------------------------------------------------------------------------- data loss

def test_readme_quick_start_survives_gc(cpu, tmp_path, monkeypatch):
    """README's first command writes ./strata-nano.toml (outside STRATA_HOME/configs); gc and rm keep its model
    (the README also calibrates; that changes nothing here), and the store forgets the config once it is gone."""
    monkeypatch.chdir(tmp_path)
    r = setup_cmd("--yes", "--no-calibrate", "--config-out", "strata-nano.toml")
    assert r.exit_code == 0, r.output
    cfg = tmp_path / "strata-nano.toml"
    gc = gc_json()
    assert gc["removed"] == [] and [k["name"] for k in gc["kept"]] == ["strata-nano"]
    assert gc["kept"][0]["used_by"] == [str(cfg)]
    out = run_cmd("strata-nano.toml")
    assert out.exit_code == 0, out.output
    r = setup_cmd("models", "rm", "strata-nano")
    assert r.exit_code == 2 and "strata-nano.toml" in r.output and "--force" in r.output
    assert (cpu / NANO_DIR).is_dir()
    # a config that no longer names the store, or is gone, is pruned from the registry; then gc collects
    doc = tomllib.loads(cfg.read_text())
    cfg.unlink()
    gc = gc_json()
    assert [x["name"] for x in gc["removed"]] == ["strata-nano"] and not (cpu / NANO_DIR).exists()
    assert json.loads((cpu / "config-registry.json").read_text())["configs"] == []
    assert doc["target"]["path"].startswith(str(cpu))


def test_a_half_edited_config_still_protects_its_models(cpu, tmp_path):
    """A registered config that no longer parses (a user mid-edit) keeps every store path written in it."""
    cfg = tmp_path / "mine.toml"
    assert setup_cmd("--yes", "--no-calibrate", "--config-out", str(cfg)).exit_code == 0
    cfg.write_text(cfg.read_text() + "\n[[[ not toml\n")
    assert gc_json()["removed"] == []
    # a config rewritten to name only a folder outside the store is pruned, and gc then collects the model
    cfg.write_text(f'schema = 1\n[target]\npath = "{tmp_path}"\n')
    assert [x["name"] for x in gc_json()["removed"]] == ["strata-nano"]


def test_gc_lists_and_asks_on_a_terminal(cpu, monkeypatch):
    from setup_wizard import models_cli

    assert setup_cmd("models", "pull", "strata-nano").exit_code == 0   # in the store, no config uses it
    monkeypatch.setattr(models_cli, "_interactive", lambda: True)
    r = CliRunner().invoke(cli.app, ["models", "gc"], input="n\n")
    assert r.exit_code == 0, r.output
    assert "will remove strata-nano" in r.output and "Nothing was removed" in r.output
    assert (cpu / NANO_DIR).is_dir()
    r = CliRunner().invoke(cli.app, ["models", "gc"], input="y\n")
    assert r.exit_code == 0 and "removed strata-nano" in r.output and not (cpu / NANO_DIR).exists()


def test_partial_folders_and_stray_links_are_collected(cpu, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.bin").write_bytes(b"x" * 10)
    part = cpu / "downloads" / "org--model" / ("a" * 40)
    part.mkdir(parents=True)
    (part / "config.json").write_text("{}")              # an interrupted download: no manifest, only config.json
    conv = cpu / "converted" / "0123456789abcdef-q8_0-c1"
    conv.mkdir(parents=True)
    (conv / ".model.gguf.4242.tmp").write_bytes(b"\0" * 100)
    (cpu / "downloads" / "evil--link").symlink_to(outside)
    gc = gc_json()
    assert sorted(x["path"] for x in gc["removed"]) == sorted([str(part), str(conv)])
    assert gc["strays"] == [str(cpu / "downloads" / "evil--link")]
    assert not part.exists() and not conv.exists() and not (cpu / "downloads" / "evil--link").is_symlink()
    assert (outside / "keep.bin").read_bytes() == b"x" * 10     # the link went, not what it pointed at


# ------------------------------------------------------------------------------------------ writes outside the store

def test_a_linked_part_file_is_never_written_through(tiny_repo, hub, home, tmp_path):
    from setup_wizard.hub import pull

    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious")
    d = home / "downloads" / "tiny-org--tiny-dflash2" / REV
    d.mkdir(parents=True)
    (d / "model.safetensors.part").symlink_to(victim)
    try:
        res = pull("tiny-head")
    finally:
        assert victim.read_bytes() == b"precious"
    for rel, data in tiny_repo["files"].items():
        p = res.path / rel
        assert not p.is_symlink() and p.read_bytes() == data
    assert Store().read_manifest(res.path)["verified"]


def test_a_linked_bundled_copy_is_never_written_through_or_marked_verified(home, tmp_path):
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious")
    d = home / NANO_DIR / _nano_rev()
    d.mkdir(parents=True)
    (d / "model.safetensors.part").symlink_to(victim)
    r = setup_cmd("models", "pull", "strata-nano", "--json")
    assert r.exit_code == 0, r.output
    assert victim.read_bytes() == b"precious" and not (d / "model.safetensors").is_symlink()
    # a file replaced by a link (even to identical bytes) fails verification and is marked
    copy = tmp_path / "copy.json"
    copy.write_bytes((d / "tokenizer.json").read_bytes())
    (d / "tokenizer.json").unlink()
    (d / "tokenizer.json").symlink_to(copy)
    r = setup_cmd("models", "verify", "strata-nano")
    assert r.exit_code == 1 and "symbolic link" in r.output
    assert Store().read_manifest(d)["verify_failed"]
    # a link where a final file belongs is replaced by the checked copy, never written through
    assert setup_cmd("models", "pull", "strata-nano").exit_code == 0
    assert not (d / "tokenizer.json").is_symlink() and copy.read_bytes() == (d / "tokenizer.json").read_bytes()


def test_a_linked_store_folder_is_refused_in_one_sentence(tiny_repo, hub, home, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (home / "downloads").mkdir(parents=True)
    (home / "downloads" / "tiny-org--tiny-dflash2").symlink_to(outside)
    r = setup_cmd("models", "pull", "tiny-head")
    assert r.exit_code == 1 and "symbolic link" in r.output and "Traceback" not in r.output
    assert list(outside.rglob("*")) == []


def _nano_rev() -> str:
    from setup_wizard.catalog import load_catalog

    return load_catalog().get("strata-nano").revision


# ------------------------------------------------------------------------------------------------ changed bytes

def test_changed_download_is_rehashed_by_setup_and_a_verify_mark_stops_strata_run(cpu, tmp_path):
    cfg = tmp_path / "nano.toml"
    args = ("--yes", "--no-calibrate", "--context", "256", "--config-out", str(cfg))
    assert setup_cmd(*args).exit_code == 0
    weights = Path(tomllib.loads(cfg.read_text())["target"]["path"]) / "model.safetensors"
    good = weights.read_bytes()
    flip_keep_mtime(weights)
    # strata-run stays fast: size, time and the mark only (docs/store.md, "Trust"); setup re-hashes what it reuses
    r = setup_cmd(*args)
    assert r.exit_code == 0, r.output
    assert "download strata-nano (already done" not in " ".join(r.output.split())
    assert weights.read_bytes() == good
    # `models verify` finds a change setup has not seen yet, marks it, and strata-run refuses it
    flip_keep_mtime(weights)
    assert setup_cmd("models", "verify", "strata-nano").exit_code == 1
    out = run_cmd(cfg)
    assert out.exit_code == 1, out.output
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "`strata-setup models pull strata-nano`" in lines[0] and "verify" in lines[0]
    assert setup_cmd("models", "pull", "strata-nano").exit_code == 0       # the repair the sentence names
    assert weights.read_bytes() == good
    assert run_cmd(cfg).exit_code == 0


def test_a_changed_size_at_run_time_is_a_checksum_failure_naming_the_pull(cpu, tmp_path):
    cfg = tmp_path / "nano.toml"
    assert setup_cmd("--yes", "--no-calibrate", "--context", "256", "--config-out", str(cfg)).exit_code == 0
    tok = Path(tomllib.loads(cfg.read_text())["target"]["path"]) / "tokenizer.json"
    with open(tok, "ab") as f:
        f.write(b" ")
    out = run_cmd(cfg)
    assert out.exit_code == 1 and "changed size" in out.stderr
    assert "strata-setup models pull strata-nano" in out.stderr


def test_converted_drafters_are_found_by_their_head_name(cpu, tmp_path):
    cfg = tmp_path / "d.toml"
    r = setup_cmd("--yes", "--no-calibrate", "--drafter", "dflash2", "--dflash2-quant", "q8_0", "--context", "256",
                  "--config-out", str(cfg))
    assert r.exit_code == 0, r.output
    head = tomllib.loads(cfg.read_text())["drafter"]["head"]
    shown = json.loads(setup_cmd("models", "show", head, "--json").stdout)
    drafter = tomllib.loads(cfg.read_text())["drafter"]["path"]
    assert [c["path"] for c in shown["converted"]] == [drafter]
    r = setup_cmd("models", "rm", head)
    assert r.exit_code == 2 and str(cfg) in " ".join(r.output.split())
    manifest = json.loads((Path(drafter).parent / MANIFEST).read_text())
    assert manifest["source_name"] == head and manifest["name"] == f"{head}:q8_0"


def test_temp_files_of_a_killed_run_do_not_survive_a_rerun(tiny_repo, hub, home, tmp_path):
    """A run killed while writing a GGUF or a manifest leaves `.model.gguf.<pid>.tmp` / `..strata-manifest.json.*.tmp`;
    the next run that takes the item removes them, whether it rebuilds or reuses."""
    from setup_wizard.convert import convert_to_store
    from setup_wizard.hub import pull

    pulled = pull("tiny-head")
    conv = convert_to_store(pulled.path, "q8_0")
    planted = [conv.path.parent / ".model.gguf.4242.tmp", conv.path.parent / f"..{MANIFEST}.0a1b2c3d.tmp",
               pulled.path / f"..{MANIFEST}.deadbeef.tmp"]
    for p in planted:
        p.write_bytes(b"\0" * 1000)
    assert pull("tiny-head").reused and convert_to_store(pulled.path, "q8_0").reused
    assert [p for p in planted if p.exists()] == []
