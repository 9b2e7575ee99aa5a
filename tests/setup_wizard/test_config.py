"""Config: atomic write with one backup in the store, user keys survive a rerun, clear load errors, staleness."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest

from setup_wizard import config as cfgmod
from setup_wizard.config import ConfigError, load_config, manifest_sha256, stale_reasons, write_config


def _doc(tmp: Path, **over):
    f = tmp / "tgt" / "model.safetensors"
    f.parent.mkdir(exist_ok=True)
    f.write_bytes(b"x" * 10)
    files = {"model.safetensors": {"sha256": cfgmod.sha256_file(f), "size": 10}}
    doc = {
        "schema": 1,
        "target": {"name": "t", "path": str(f.parent), "sha256": manifest_sha256(files), "files": files},
        "drafter": {"kind": "none"},
        "speculative": {"block": 1, "spec_min_p": 0.0, "source": "default"},
        "memory": {"context": 128, "budget": {"target_kv": 5}},
    }
    doc.update(over)
    return doc


def test_write_keeps_one_backup_in_the_store_and_user_keys(tmp_path, monkeypatch):
    from setup_wizard.config import backup_path

    monkeypatch.setenv("STRATA_HOME", str(tmp_path / "home"))
    p = tmp_path / "c" / "x.toml"
    write_config(p, _doc(tmp_path))
    # a user adds keys at top level and inside our tables, and edits one of ours
    d = tomllib.loads(p.read_text())
    d["note"] = "mine"
    d["extra"] = {"a": 1}
    d["memory"]["my_key"] = 7
    d["memory"]["context"] = 999
    import tomli_w
    p.write_text(tomli_w.dumps(d))
    before = p.read_text()
    write_config(p, _doc(tmp_path, memory={"context": 256, "budget": {"target_kv": 9}}))
    new = tomllib.loads(p.read_text())
    assert new["note"] == "mine" and new["extra"] == {"a": 1} and new["memory"]["my_key"] == 7
    assert new["memory"]["context"] == 256 and new["memory"]["budget"] == {"target_kv": 9}
    bak = backup_path(p)
    assert bak.read_text() == before and bak.parent == tmp_path / "home" / "backups"
    assert [x.name for x in p.parent.iterdir()] == ["x.toml"]          # nothing beside the config
    write_config(p, _doc(tmp_path, memory={"context": 512}))
    assert [x.name for x in bak.parent.iterdir()] == [bak.name]         # still one backup, the last config
    assert tomllib.loads(bak.read_text())["memory"]["context"] == 256
    # a config in $STRATA_HOME/configs keeps its own name there
    q = tmp_path / "home" / "configs" / "nano-mtp.toml"
    write_config(q, _doc(tmp_path))
    write_config(q, _doc(tmp_path, memory={"context": 512}))
    assert backup_path(q) == tmp_path / "home" / "backups" / "nano-mtp.toml" and backup_path(q).is_file()
    assert sorted(x.name for x in q.parent.iterdir()) == ["nano-mtp.toml"]


def test_owned_key_that_disappears_is_dropped(tmp_path):
    p = tmp_path / "x.toml"
    write_config(p, _doc(tmp_path, drafter={"kind": "dflash2", "head": "h", "quantization": "q4_0"}))
    write_config(p, _doc(tmp_path, drafter={"kind": "mtp"}))
    assert tomllib.loads(p.read_text())["drafter"] == {"kind": "mtp"}


def test_interrupted_write_leaves_old_file(tmp_path, monkeypatch):
    p = tmp_path / "x.toml"
    write_config(p, _doc(tmp_path))
    old = p.read_text()

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(KeyboardInterrupt):
        write_config(p, _doc(tmp_path, memory={"context": 4}))
    assert p.read_text() == old
    assert sorted(x.name for x in tmp_path.iterdir() if x.is_file()) == ["x.toml"]


def test_load_errors_are_one_sentence(tmp_path):
    with pytest.raises(ConfigError, match="No config at"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("schema = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    bad.write_text("schema = 9\n")
    with pytest.raises(ConfigError, match="schema 9"):
        load_config(bad)
    bad.write_text("schema = 1\n[target]\npath='x'\n")
    with pytest.raises(ConfigError, match=r"no \[drafter\]"):
        load_config(bad)


def test_staleness(tmp_path):
    doc = _doc(tmp_path)
    assert stale_reasons(doc, deep=True) == []
    f = Path(doc["target"]["path"]) / "model.safetensors"
    f.write_bytes(b"y" * 10)  # same size, other bytes
    assert stale_reasons(doc) == []
    assert "sha256 differs" in stale_reasons(doc, deep=True)[0]
    f.write_bytes(b"y")
    assert "changed size" in stale_reasons(doc)[0]
    f.unlink()
    assert "missing" in stale_reasons(doc)[0]
    d2 = _doc(tmp_path, drafter={"kind": "dflash2", "path": str(tmp_path / "nope.gguf")})
    assert any("DFlash2 drafter" in r for r in stale_reasons(d2))


def test_manifest_hash_depends_on_every_file():
    a = {"a": {"sha256": "0" * 64, "size": 1}, "b": {"sha256": "1" * 64, "size": 2}}
    b = {"a": {"sha256": "0" * 64, "size": 1}, "b": {"sha256": "2" * 64, "size": 2}}
    assert manifest_sha256(a) != manifest_sha256(b)
    assert manifest_sha256(a) == manifest_sha256(dict(reversed(list(a.items()))))
