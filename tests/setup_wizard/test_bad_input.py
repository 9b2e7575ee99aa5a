"""Review findings: a --config-out that cannot be a config file is refused up front (exit 2), before any work."""

from __future__ import annotations

from typer.testing import CliRunner

from setup_wizard.cli import app


def _one_sentence(res, *needles):
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and "Errno" not in res.output
    lines = [x for x in res.output.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.output
    for n in needles:
        assert n in lines[0], lines[0]


def test_config_out_that_is_a_folder_is_bad_input(machine, home, tmp_path):
    folder = tmp_path / "somewhere"
    folder.mkdir()
    res = CliRunner().invoke(app, ["--yes", "--no-calibrate", "--config-out", str(folder)])
    _one_sentence(res, "--config-out", "folder")
    assert not (home / "configs").exists() and list(folder.iterdir()) == []


def test_config_out_under_a_file_is_bad_input(machine, home, tmp_path):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file, not a folder")
    res = CliRunner().invoke(app, ["--yes", "--no-calibrate", "--config-out", str(blocker / "sub" / "c.toml")])
    _one_sentence(res, "--config-out", "writable")
    assert not (home / "configs").exists() and blocker.read_text() == "a file, not a folder"


def test_config_write_failure_is_one_sentence_and_leaves_the_old_file(tmp_path, monkeypatch):
    import os

    import pytest

    from setup_wizard import config as C

    path = tmp_path / "c.toml"
    C.write_config(path, {"schema": 1, "target": {"path": "t"}, "memory": {"context": 2}})
    before = path.read_bytes()

    def full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(C.ConfigWriteError, match=r"Cannot write the config .*No space left on device.*--config-out"):
        C.write_config(path, {"schema": 1, "target": {"path": "t"}, "memory": {"context": 3}})
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml"]


def _damaged_copy(pack, tmp_path, name, write):
    import shutil

    d = tmp_path / name
    shutil.copytree(pack["nano"], d)
    for p in d.glob("*.safetensors*"):
        p.unlink()
    write(d)
    return d


def test_damaged_local_target_weights_are_bad_input_not_a_crash(machine, home, pack, tmp_path):
    import struct

    hdr = b'{"w": 1}'
    cases = {
        "short": lambda d: (d / "model.safetensors").write_bytes(b"abc"),
        "index-not-json": lambda d: (d / "model.safetensors.index.json").write_text("not json"),
        "index-no-map": lambda d: (d / "model.safetensors.index.json").write_text('{"metadata": {}}'),
        "header-not-json": lambda d: (d / "model.safetensors").write_bytes(struct.pack("<Q", 4) + b"nope"),
        "header-bad-entry": lambda d: (d / "model.safetensors").write_bytes(struct.pack("<Q", len(hdr)) + hdr),
    }
    for name, write in cases.items():
        d = _damaged_copy(pack, tmp_path, name, write)
        res = CliRunner().invoke(app, ["--yes", "--target", str(d), "--dry-run"])
        _one_sentence(res, str(d))
        assert "Unexpected" not in res.output, (name, res.output)


def test_answers_file_that_is_a_folder_is_bad_input(machine, home, tmp_path):
    res = CliRunner().invoke(app, ["--answers", str(tmp_path)])
    _one_sentence(res, "answers file", "cannot be read")


def test_hand_edited_config_with_wrong_types_is_bad_input(machine, home, tmp_path):
    import tomli_w

    base = {"schema": 1, "target": {"path": str(tmp_path)}, "drafter": {"kind": "none"},
            "memory": {"context": 4096, "reserve_mib": 0}}
    cases = [("memory", "context", "big"), ("memory", "reserve_mib", "x"), ("memory", "context", True),
             ("target", "path", 5), ("drafter", "path", ["a"])]
    for table, key, value in cases:
        doc = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
        doc[table][key] = value
        cfg = tmp_path / f"{table}-{key}.toml"
        cfg.write_text(tomli_w.dumps(doc))
        res = CliRunner().invoke(app, ["budget", "--config", str(cfg)])
        _one_sentence(res, f"{table}.{key}")
        assert "Unexpected" not in res.output
