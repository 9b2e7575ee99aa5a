"""Review findings: a tampered artifact in the store is never reused as 'verified'."""

from __future__ import annotations

from setup_wizard.convert import convert_to_store
from setup_wizard.store import Store, sha256_file
from tests.setup_wizard.hub_helpers import write_checkpoint


def test_converted_cache_rebuilds_a_same_size_tampered_file(tmp_path, home):
    ckpt = write_checkpoint(tmp_path / "ckpt")
    store = Store()
    a = convert_to_store(ckpt, "q8_0", store)
    good = a.path.read_bytes()
    bad = bytearray(good)
    bad[-100] ^= 0xFF  # one weight byte: header, tensor table and size all still check out
    a.path.write_bytes(bytes(bad))
    b = convert_to_store(ckpt, "q8_0", store)
    assert not b.reused
    assert b.path.read_bytes() == good and b.sha256 == a.sha256 == sha256_file(b.path)


def test_convert_to_a_folder_is_bad_input_before_any_work(tmp_path, home):
    from typer.testing import CliRunner

    from setup_wizard.cli import app

    ckpt = write_checkpoint(tmp_path / "ckpt")
    folder = tmp_path / "out"
    folder.mkdir()
    r = CliRunner().invoke(app, ["convert", str(ckpt), "--quant", "q8_0", "-o", str(folder)])
    assert r.exit_code == 2, r.output
    assert "Errno" not in r.output and "-o" in r.output and "folder" in r.output
    assert list(folder.iterdir()) == [] and not list(tmp_path.glob(".*tmp"))


def test_a_body_longer_than_the_pin_is_cut_off_and_discarded(tiny_repo, hub, home):
    import pytest

    from setup_wizard.hub import ChecksumError, pull
    from tests.setup_wizard.hub_helpers import REPO, REV

    size = len(tiny_repo["files"]["model.safetensors"])
    hub.pad[(REPO, "model.safetensors")] = b"\0" * (3 << 20)  # 3 MiB the pin does not allow
    with pytest.raises(ChecksumError, match="more than the"):
        pull("tiny-head")
    d = home / "downloads" / "tiny-org--tiny-dflash2" / REV
    assert not (d / "model.safetensors").exists()
    part = d / "model.safetensors.part"
    assert not part.exists() or part.stat().st_size <= size  # never more on disk than the pin allows
    hub.pad.clear()
    res = pull("tiny-head")
    assert (res.path / "model.safetensors").read_bytes() == tiny_repo["files"]["model.safetensors"]


def test_verify_tells_how_to_rebuild_a_failed_converted_file(tmp_path, home):
    from typer.testing import CliRunner

    from setup_wizard.cli import app

    a = convert_to_store(write_checkpoint(tmp_path / "ckpt"), "q8_0", Store())
    bad = bytearray(a.path.read_bytes())
    bad[-1] ^= 0xFF
    a.path.write_bytes(bytes(bad))
    r = CliRunner().invoke(app, ["models", "verify"])
    assert r.exit_code == 1 and "FAILED" in r.output
    flat = " ".join(r.output.split())
    assert "pull it again" not in flat and "rerun strata-setup" in flat, flat


def test_a_download_edited_after_its_check_is_not_served_as_verified(tiny_repo, hub, home):
    """The manifest records each file's mtime; a file touched since its check is hashed again before use."""
    import os

    from setup_wizard.catalog import load_catalog
    from setup_wizard.hub import pull, verified_entry

    res = pull("tiny-head")
    w = res.path / "model.safetensors"
    good = w.read_bytes()
    bad = bytearray(good)
    bad[-1] ^= 0xFF
    w.write_bytes(bytes(bad))  # same size: only the bytes changed
    st = w.stat()
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # an edit a second later
    entry = load_catalog().get("tiny-head")
    assert verified_entry(entry) is None
    import pytest

    from setup_wizard.hub import DownloadError

    with pytest.raises(DownloadError, match="offline"):  # offline mode does not serve it
        pull("tiny-head", offline=True)
    fixed = pull("tiny-head")  # online: fetched again, checked
    assert not fixed.reused and w.read_bytes() == good
    assert verified_entry(entry) is not None
