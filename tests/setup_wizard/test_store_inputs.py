"""Bad inputs are refused before anything is written, and every store failure is one true sentence with the right
exit code (docs/store.md, docs/commands.md "Exit codes")."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from setup_wizard import cli
from tests.setup_wizard.hub_helpers import REPO, REV, file_pins, tiny_tensors, toml_catalog, write_checkpoint
from tests.setup_wizard.wizard_fakes import fake_cpu


def setup_cmd(*args: str, **kw):
    return CliRunner().invoke(cli.app, list(args), **kw)


def one_sentence(res, code: int, *needles: str, absent: tuple[str, ...] = ()) -> str:
    assert res.exit_code == code, res.output
    lines = [x for x in res.output.strip().splitlines() if x.strip().startswith("Error:")]
    assert len(lines) == 1 and "Traceback" not in res.output, res.output
    flat = " ".join(res.output.split())
    for n in needles:
        assert n in flat, flat
    for n in ("Errno", *absent):
        assert n not in flat, flat
    return flat


def files_under(path: Path) -> list[str]:
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*")) if path.exists() else []


@pytest.fixture
def cpu(monkeypatch, home):
    monkeypatch.setattr(cli, "get_hardware", lambda: fake_cpu(ram_gib=8))
    monkeypatch.setattr(cli, "is_interactive", lambda: False)
    return home


# ------------------------------------------------------------------------------------------- a bad local target

def _damage(folder: Path, how: str) -> None:
    st = folder / "model.safetensors"
    if how == "truncated":
        with open(st, "r+b") as f:
            f.truncate(st.stat().st_size - 64)
        return
    t = load_file(str(st))
    name = "model.layers.1.self_attn.q_proj.weight"
    if how == "missing tensor":
        del t[name]
    elif how == "wrong shape":
        t[name] = torch.zeros(t[name].shape[0] + 1, t[name].shape[1])
    elif how == "NaN weights":
        t[name] = t[name].clone()
        t[name][3, 5] = float("nan")
    elif how == "inf weights":
        t[name] = t[name].clone()
        t[name][0, 0] = float("-inf")
    save_file(t, str(st))


@pytest.mark.parametrize("how, needle", [
    ("missing tensor", "lacks tensor model.layers.1.self_attn.q_proj.weight"),
    ("wrong shape", "tensor model.layers.1.self_attn.q_proj.weight has shape"),
    ("truncated", "truncated"),
    ("NaN weights", "NaN or infinite"),
    ("inf weights", "NaN or infinite"),
])
def test_a_bad_local_target_exits_2_and_writes_nothing(cpu, pack, tmp_path, how, needle):
    local = tmp_path / "mymodel"
    shutil.copytree(pack["nano"], local)
    _damage(local, how)
    cfg = tmp_path / "out.toml"
    res = setup_cmd("--yes", "--no-calibrate", "--target", str(local), "--context", "128", "--config-out", str(cfg))
    one_sentence(res, 2, needle)
    assert not cfg.exists() and files_under(cpu) == []


# ------------------------------------------------------------------------------------------------ DFlash2 heads

def _nan_head(tmp_path: Path) -> Path:
    t = tiny_tensors()
    name = "layers.0.mlp.down_proj.weight"
    t[name] = t[name].clone()
    t[name][1, 2] = float("inf")
    return write_checkpoint(tmp_path / "nan-head", tensors=t)


def test_a_non_finite_head_leaves_no_converted_folder(tmp_path, home):
    from runtime.errors import ContractError
    from setup_wizard.convert import convert_to_store

    with pytest.raises(ContractError, match="NaN or infinite"):
        convert_to_store(_nan_head(tmp_path), "q8_0")
    assert files_under(home / "converted") == []


def test_convert_creates_no_output_folder_when_it_fails(tmp_path, home, monkeypatch):
    out = tmp_path / "new" / "deeper" / "head.gguf"
    one_sentence(setup_cmd("convert", str(_nan_head(tmp_path)), "--quant", "q8_0", "-o", str(out)), 2,
                 "NaN or infinite")
    assert not (tmp_path / "new").exists()
    from setup_wizard.store import Store

    monkeypatch.setattr(Store, "free_bytes", lambda self, where=None: 1000)
    ckpt = write_checkpoint(tmp_path / "good")
    one_sentence(setup_cmd("convert", str(ckpt), "--quant", "q8_0", "-o", str(out)), 1, "Not enough disk space")
    assert not (tmp_path / "new").exists()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc")
def test_convert_to_an_unwritable_place_says_so(tmp_path, home):
    res = setup_cmd("convert", str(write_checkpoint(tmp_path / "good")), "--quant", "q8_0", "-o", "/proc/x.gguf")
    one_sentence(res, 2, "Cannot create files in /proc", absent=("disk space",))


def test_a_head_refused_on_its_remote_header_is_bad_input(tmp_path, hub, home, monkeypatch):
    t = tiny_tensors()
    t["layers.0.self_attn.q_proj.weight"] = torch.zeros(64, 32, dtype=torch.bfloat16)   # breaks the contract
    src = write_checkpoint(tmp_path / "broken", tensors=t)
    hub.add("x/broken", REV, {p.name: p.read_bytes() for p in src.iterdir()})
    cat = tmp_path / "c.toml"
    cat.write_text(toml_catalog([
        {"name": "tiny-target", "kind": "target", "source": "hf"},
        {"name": "broken", "kind": "dflash2", "source": "hf", "repo": "x/broken", "revision": REV,
         "fits": ["tiny-target"], "file": file_pins(src)}]))
    monkeypatch.setenv("STRATA_CATALOG", str(cat))
    one_sentence(setup_cmd("models", "pull", "broken"), 2, "layers.0.self_attn.q_proj.weight", "without downloading")


# ---------------------------------------------------------------------------------------------------- messages

class _ReadOnly:
    """Every write below `root` fails with EROFS, as on a read-only mount (os.open with a writing flag, os.mkdir)."""

    WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def __init__(self, monkeypatch, root: Path) -> None:
        self.root = str(root)
        self._open, self._mkdir = os.open, os.mkdir
        monkeypatch.setattr(os, "open", self.open)
        monkeypatch.setattr(os, "mkdir", self.mkdir)

    def _under(self, path, dir_fd) -> bool:
        p = os.fspath(path)
        if dir_fd is not None and not os.path.isabs(p):
            p = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), p)
        return os.path.abspath(p).startswith(self.root)

    def open(self, path, flags, mode=0o777, *, dir_fd=None):
        if flags & self.WRITE and self._under(path, dir_fd):
            raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))
        return self._open(path, flags, mode, dir_fd=dir_fd)

    def mkdir(self, path, mode=0o777, *, dir_fd=None):
        if self._under(path, dir_fd):
            raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))
        return self._mkdir(path, mode, dir_fd=dir_fd)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_a_read_only_store_is_one_sentence(cpu, monkeypatch):
    cpu.mkdir()
    _ReadOnly(monkeypatch, cpu)
    one_sentence(setup_cmd("models", "pull", "strata-nano"), 2, "Read-only file system", "STRATA_HOME")
    one_sentence(setup_cmd("--yes", "--no-calibrate"), 2, "Read-only file system", "STRATA_HOME")


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_a_read_only_store_still_serves_what_it_verified(cpu, tmp_path, monkeypatch):
    assert setup_cmd("models", "pull", "strata-nano").exit_code == 0
    _ReadOnly(monkeypatch, cpu)
    cfg = tmp_path / "ro.toml"
    res = setup_cmd("--yes", "--no-calibrate", "--context", "128", "--config-out", str(cfg))
    assert res.exit_code == 0, res.output
    assert cfg.is_file() and not (cpu / "config-registry.json").exists()


def test_a_full_disk_mid_download_says_so_and_resumes(tiny_repo, hub, home, monkeypatch):
    size = len(tiny_repo["files"]["model.safetensors"])
    real_write = os.write
    written: dict[int, int] = {}
    full = [True]

    def write(fd, data):
        if not full[0]:
            return real_write(fd, data)
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            name = ""
        if name.endswith("model.safetensors.part"):   # the disk fills up half-way: a short write, then ENOSPC
            room = size // 2 - written.get(fd, 0)
            if room <= 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            n = real_write(fd, bytes(data[:room]))
            written[fd] = written.get(fd, 0) + n
            return n
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    flat = one_sentence(setup_cmd("models", "pull", "tiny-head"), 1, "is full", "No space left on device",
                        "`strata-setup models pull tiny-head`", absent=("network",))
    assert "bytes are kept" in flat
    full[0] = False                                         # space was freed
    part = home / "downloads" / "tiny-org--tiny-dflash2" / REV / "model.safetensors.part"
    kept = part.stat().st_size
    assert kept == size // 2
    res = setup_cmd("models", "pull", "tiny-head")
    assert res.exit_code == 0, res.output
    assert hub.gets("model.safetensors")[-1] == f"bytes={kept}-"


def test_a_short_body_from_the_server_is_named_and_resumed(tiny_repo, hub, home):
    size = len(tiny_repo["files"]["model.safetensors"])
    hub.short[(REPO, "model.safetensors")] = size // 3
    one_sentence(setup_cmd("models", "pull", "tiny-head"), 1, f"sent only {size // 3} of the {size} bytes",
                 "`strata-setup models pull tiny-head`", absent=("force_download",))
    hub.short.clear()
    assert setup_cmd("models", "pull", "tiny-head").exit_code == 0
    assert hub.gets("model.safetensors")[-1] == f"bytes={size // 3}-"


def test_the_disk_margin_is_named(home, monkeypatch):
    from setup_wizard.store import Store

    monkeypatch.setattr(Store, "free_bytes", lambda self, where=None: 20 << 20)
    one_sentence(setup_cmd("models", "pull", "strata-nano"), 1, "MiB needed plus a", "safety margin (1% + 16 MiB)",
                 "20.0 MiB free")


def test_a_link_that_drops_every_700_kb_still_finishes(hub, home, tmp_path, monkeypatch):
    """huggingface_hub hands over 10 MiB pieces and loses a piece cut short; the store takes smaller steps."""
    import huggingface_hub.file_download as fd

    monkeypatch.setattr(fd.time, "sleep", lambda s: None)      # its retry pause; the retries themselves are real
    blob = os.urandom(3 << 20)
    hub.add("x/big", REV, {"weights.bin": blob})
    cat = tmp_path / "c.toml"
    cat.write_text(toml_catalog([{"name": "big", "kind": "target", "source": "hf", "repo": "x/big", "revision": REV,
                                  "file": [{"path": "weights.bin", "sha256": hashlib.sha256(blob).hexdigest(),
                                            "size": len(blob)}]}]))
    monkeypatch.setenv("STRATA_CATALOG", str(cat))
    hub.flaky[("x/big", "weights.bin")] = (700_000, 6)         # six cuts in a row: more than its five retries
    res = setup_cmd("models", "pull", "big", "--json")
    assert res.exit_code == 0, res.output
    path = Path(json.loads(res.stdout)["path"]) / "weights.bin"
    assert path.read_bytes() == blob
    gets = hub.gets("weights.bin")
    offsets = [int(g[6:-1]) for g in gets[1:]]
    assert gets[0] is None and len(gets) >= 6
    assert all(b > a for a, b in zip([0, *offsets], offsets, strict=False))   # every attempt kept its bytes


def test_a_server_that_ignores_range_restarts_the_file_cleanly(tiny_repo, hub, home):
    data = tiny_repo["files"]["model.safetensors"]
    d = home / "downloads" / "tiny-org--tiny-dflash2" / REV
    d.mkdir(parents=True)
    (d / "model.safetensors.part").write_bytes(data[:1000])
    hub.ignore_range = True
    res = setup_cmd("models", "pull", "tiny-head")
    assert res.exit_code == 0, res.output
    assert (d / "model.safetensors").read_bytes() == data and hub.gets("model.safetensors")[-1] == "bytes=1000-"
