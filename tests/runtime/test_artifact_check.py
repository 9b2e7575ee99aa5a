"""strata-run refuses artifacts that are gone or changed since strata-setup verified them."""

import hashlib
import os

import pytest
import tomli_w
from typer.testing import CliRunner

from runtime.artifact_check import check_config_artifacts
from runtime.cli import app
from runtime.config import parse
from runtime.errors import CorruptArtifactError, StaleArtifactError
from tests.runtime.tiny import make_tiny_target, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


def _pins(folder):
    out = {}
    for f in sorted(folder.iterdir()):
        st = f.stat()
        out[f.name] = {"sha256": hashlib.sha256(f.read_bytes()).hexdigest(), "size": st.st_size,
                       "mtime_ns": st.st_mtime_ns}
    return out


@pytest.fixture()
def setup(tmp_path):
    folder = make_tiny_target(tmp_path, seed=5)
    doc = {"schema": 1, "target": {"name": "tiny", "path": str(folder), "files": _pins(folder)},
           "drafter": {"kind": "none"}, "memory": {"context": 64, "kv_dtype": "fp32"}, "device": {"type": "cpu"}}
    cfg = tmp_path / "config.toml"
    cfg.write_text(tomli_w.dumps(doc))
    return folder, doc, cfg


def _flip_one_byte(path, keep_mtime=False):
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def test_unchanged_artifacts_pass(setup):
    folder, doc, _ = setup
    check_config_artifacts(parse(doc, base=folder.parent))


def test_same_size_edit_is_caught_by_its_new_time(setup):
    folder, doc, _ = setup
    _flip_one_byte(folder / "model.safetensors")
    with pytest.raises(CorruptArtifactError, match="model.safetensors changed since strata-setup verified it"):
        check_config_artifacts(parse(doc, base=folder.parent))


def test_without_recorded_times_the_files_are_hashed(setup):
    folder, doc, _ = setup
    for meta in doc["target"]["files"].values():
        del meta["mtime_ns"]
    check_config_artifacts(parse(doc, base=folder.parent))
    _flip_one_byte(folder / "config.json", keep_mtime=True)
    with pytest.raises(CorruptArtifactError, match="sha256 differs"):
        check_config_artifacts(parse(doc, base=folder.parent))


def test_missing_and_resized_files(setup):
    folder, doc, _ = setup
    with open(folder / "tokenizer.json", "ab") as f:
        f.write(b" ")
    with pytest.raises(CorruptArtifactError, match="tokenizer.json changed size"):
        check_config_artifacts(parse(doc, base=folder.parent))
    (folder / "tokenizer.json").unlink()
    with pytest.raises(StaleArtifactError, match="tokenizer.json is missing"):
        check_config_artifacts(parse(doc, base=folder.parent))


def test_strata_run_refuses_a_tampered_target_in_one_sentence(setup):
    folder, _, cfg = setup
    args = ["--config", str(cfg), "--prompt", "ab", "--max-new-tokens", "3", "--json"]
    assert CliRunner().invoke(app, args).exit_code == 0
    _flip_one_byte(folder / "model.safetensors")
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 1   # a checksum failure (docs/commands.md, "Exit codes"), with the repair in the sentence
    assert "changed since strata-setup verified it" in r.stderr and "Traceback" not in r.output
    assert f"rerun strata-setup --target {folder}" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    (folder / "model.safetensors").unlink()
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2 and "is missing" in r.stderr
