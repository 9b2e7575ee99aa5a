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


def test_list_never_breaks_a_name_and_show_prints_fields_not_reprs(tiny_repo, hub, home):
    """`models list` at any terminal width keeps every name whole on one line (a table when it fits, one block
    per model when it does not); `models show` prints a table of fields and the files, never Python reprs."""
    _json("models", "pull", "tiny-head")
    names = [r["name"] for r in _json("models", "list")["models"]]
    assert "tiny-head" in names and "qwen3.8-flash-next-dflash2" in names
    for width in (40, 60, 80, 120, 200):
        r = runner.invoke(app, ["models", "list"], env={"COLUMNS": str(width)})
        assert r.exit_code == 0, r.output
        lines = r.output.splitlines()
        for n in names:
            assert any(n in line for line in lines), (width, n, r.output)
        if width >= 200:
            assert "┃" not in r.output and " name " in r.output          # the table form
    shown = runner.invoke(app, ["models", "show", "tiny-head"], env={"COLUMNS": "100"})
    assert shown.exit_code == 0, shown.output
    out = shown.output
    for repr_bit in ("{'", "[]", "': ", "None", "True", "False"):
        assert repr_bit not in out, (repr_bit, out)
    pins = tiny_repo["pins"]
    for p in pins:      # every file whole: path, size, full sha256 on one line
        assert any(p["path"] in line and p["sha256"] in line for line in out.splitlines()), out
    assert "state" in out and "verified" in out and "pinned" in out and "yes" in out
    doc = _json("models", "show", "tiny-head")
    assert doc["name"] == "tiny-head" and doc["state"] == "verified" and len(doc["files"]) == len(pins)
