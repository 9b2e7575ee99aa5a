"""`strata-setup models ...` and `strata-setup convert` through the real typer app."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from setup_wizard.cli import app

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, list(args), catch_exceptions=False)


def _json(*args):
    r = _run(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_list_pull_verify_rm_gc(tiny_repo, hub, home):
    rows = {r["name"]: r for r in _json("models", "list")["models"]}
    assert rows["tiny-head"]["state"] == "not downloaded" and rows["tiny-head"]["pinned"]
    assert rows["turbo-brilliance"]["state"] == "unpinned" and rows["turbo-brilliance"]["revision"] is None
    pulled = _json("models", "pull", "tiny-head")
    assert pulled["reused"] is False
    row = {r["name"]: r for r in _json("models", "list")["models"]}["tiny-head"]
    assert row["state"] == "verified" and row["size"] == sum(p["size"] for p in tiny_repo["pins"])
    assert row["revision"] == "0123456789abcdef0123456789abcdef01234567" and row["quant"] == "bf16"
    # a config that uses it
    (home / "configs").mkdir(parents=True)
    cfg = home / "configs" / "setup.toml"
    cfg.write_text(f'schema = 1\n[drafter]\nkind = "dflash2"\npath = "{pulled["path"]}/model.safetensors"\n')
    row = {r["name"]: r for r in _json("models", "list")["models"]}["tiny-head"]
    assert row["used_by"] == [str(cfg)]
    v = _json("models", "verify")
    assert v["ok"] and v["results"][0]["name"] == "tiny-head"
    r = _run("models", "rm", "tiny-head")
    assert r.exit_code == 2 and "setup.toml" in r.output and "--force" in r.output
    gc = _json("models", "gc", "--dry-run")
    assert gc["removed"] == []  # in use
    cfg.unlink()
    gc = _json("models", "gc", "--dry-run")
    assert [x["name"] for x in gc["removed"]] == ["tiny-head"] and gc["dry_run"]
    assert (home / "downloads").exists() and list((home / "downloads").rglob("model.safetensors"))
    gc = _json("models", "gc")
    assert not list((home / "downloads").rglob("model.safetensors"))


def test_verify_catches_a_damaged_file_and_marks_it(tiny_repo, hub, home):
    p = _json("models", "pull", "tiny-head")
    f = home / "downloads" / "tiny-org--tiny-dflash2" / p["revision"] / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[100] ^= 1
    f.write_bytes(bytes(data))
    r = _run("models", "verify", "tiny-head")
    assert r.exit_code == 1 and "FAILED" in r.output and "model.safetensors has sha256" in r.output
    row = {r["name"]: r for r in _json("models", "list")["models"]}["tiny-head"]
    assert row["state"] != "verified"
    again = _json("models", "pull", "tiny-head")  # pulls a good copy again
    assert again["reused"] is False and f.read_bytes() == tiny_repo["files"]["model.safetensors"]


def test_errors_are_one_sentence_with_the_right_code(home, tiny_repo):
    r = _run("models", "pull", "qwen3.8-flash-next-dflash2")
    assert r.exit_code == 2 and "not pinned" in r.output and "Traceback" not in r.output
    r = _run("models", "show", "nope")
    assert r.exit_code == 2 and "neither a catalog entry" in r.output
    r = _run("models", "pull", "tiny-head", "--offline")
    assert r.exit_code == 1 and "offline" in r.output


def test_convert_command(tiny_repo, tmp_path, home):
    out = tmp_path / "o" / "head.gguf"
    doc = _json("convert", str(tiny_repo["src"]), "--quant", "q5_0", "-o", str(out))
    assert out.is_file() and doc["quant"] == "q5_0" and doc["size"] == out.stat().st_size
    r = _run("convert", str(tiny_repo["src"] / "model.safetensors"), "--quant", "q4_0", "-o", str(tmp_path / "b.gguf"))
    assert r.exit_code == 0 and (tmp_path / "b.gguf").is_file()
    r = _run("convert", str(tmp_path / "missing"), "--quant", "q8_0", "-o", str(tmp_path / "c.gguf"))
    assert r.exit_code == 2 and "does not exist" in r.output and not (tmp_path / "c.gguf").exists()
    r = _run("convert", str(tiny_repo["src"]), "--quant", "q3_k", "-o", str(tmp_path / "d.gguf"))
    assert r.exit_code == 2 and "unknown quantization" in r.output
