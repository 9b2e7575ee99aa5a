"""Verified downloads through huggingface_hub against the loopback Hub."""

from __future__ import annotations

import hashlib

import pytest

from setup_wizard.catalog import load_catalog
from setup_wizard.hub import ChecksumError, DownloadError, HeaderCheckError, UnpinnedError, pull
from setup_wizard.store import MANIFEST, Store
from tests.setup_wizard.hub_helpers import REPO, REV


def _pull(name="tiny-head", **kw):
    return pull(name, **kw)


def test_pinned_download_lands_verified_and_is_reused(tiny_repo, hub, home):
    res = _pull()
    assert not res.reused
    for rel, data in tiny_repo["files"].items():
        assert (res.path / rel).read_bytes() == data
    assert res.path == home / "downloads" / "tiny-org--tiny-dflash2" / REV
    m = Store().read_manifest(res.path)
    assert m["verified"] and m["revision"] == REV and m["files"]["model.safetensors"]["size"] == len(
        tiny_repo["files"]["model.safetensors"])
    assert not list(res.path.rglob("*.part"))
    # the header was read with ranged requests before the weights came as a whole
    gets = hub.gets("model.safetensors")
    assert gets[0] is not None and gets[0].startswith("bytes=0-") and None in gets
    n = len(hub.log)
    again = _pull()
    assert again.reused and again.path == res.path and len(hub.log) == n  # no network at all


def test_tampered_file_is_refused_and_nothing_usable_is_left(tiny_repo, hub, home):
    good = tiny_repo["files"]["model.safetensors"]
    bad = bytearray(good)
    bad[-1] ^= 0xFF
    hub.tamper[(REPO, "model.safetensors")] = bytes(bad)
    with pytest.raises(ChecksumError) as ei:
        _pull()
    msg = str(ei.value)
    assert "model.safetensors" in msg
    assert hashlib.sha256(bad).hexdigest() in msg and hashlib.sha256(good).hexdigest() in msg
    assert "strata-setup models pull tiny-head" in msg
    d = home / "downloads" / "tiny-org--tiny-dflash2" / REV
    assert not (d / "model.safetensors").exists() and not (d / "model.safetensors.part").exists()
    assert not (d / MANIFEST).exists()
    # the fixed server then works, and the result is verified
    hub.tamper.clear()
    assert _pull().path == d


def test_missing_revision_and_missing_file_are_clear_errors(tiny_repo, hub, home, tmp_path, monkeypatch):
    from tests.setup_wizard.hub_helpers import toml_catalog

    pins = tiny_repo["pins"]
    cat = tmp_path / "cat2.toml"
    cat.write_text(toml_catalog([
        {"name": "tiny-target", "kind": "target", "source": "hf"},
        {"name": "bad-rev", "kind": "dflash2", "source": "hf", "repo": REPO, "revision": "f" * 40,
         "fits": ["tiny-target"], "file": pins},
        {"name": "bad-file", "kind": "dflash2", "source": "hf", "repo": REPO, "revision": REV,
         "fits": ["tiny-target"], "file": pins + [{"path": "extra.bin", "sha256": "0" * 64, "size": 1}]},
        {"name": "bad-repo", "kind": "dflash2", "source": "hf", "repo": "nobody/nothing", "revision": REV,
         "fits": ["tiny-target"], "file": pins},
    ]))
    monkeypatch.setenv("STRATA_CATALOG", str(cat))
    with pytest.raises(DownloadError, match=f"no revision {'f' * 40} of {REPO}"):
        _pull("bad-rev")
    with pytest.raises(DownloadError, match="no file extra.bin"):
        _pull("bad-file")
    with pytest.raises(DownloadError, match="no repository nobody/nothing"):
        _pull("bad-repo")


def test_connection_dropped_mid_file_resumes_with_range(tiny_repo, hub, home, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16384)  # real files stream in many chunks; so does this
    size = len(tiny_repo["files"]["model.safetensors"])
    hub.drop[(REPO, "model.safetensors")] = size // 2
    res = _pull()
    assert (res.path / "model.safetensors").read_bytes() == tiny_repo["files"]["model.safetensors"]
    gets = hub.gets("model.safetensors")
    resumed = [g for g in gets if g and not g.startswith("bytes=0-")]
    assert gets.count(None) == 1 and len(resumed) == 1  # one whole GET, cut; then only the rest was asked for
    assert 0 < int(resumed[0][6:-1]) <= size // 2


def test_part_file_from_an_earlier_run_is_resumed(tiny_repo, hub, home):
    data = tiny_repo["files"]["model.safetensors"]
    d = home / "downloads" / "tiny-org--tiny-dflash2" / REV
    d.mkdir(parents=True)
    half = len(data) // 3
    (d / "model.safetensors.part").write_bytes(data[:half])
    res = _pull()
    assert (res.path / "model.safetensors").read_bytes() == data
    assert hub.gets("model.safetensors")[-1] == f"bytes={half}-"
    assert None not in hub.gets("model.safetensors")  # never fetched whole


def test_offline_serves_only_what_is_verified(tiny_repo, hub, home, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DownloadError, match="offline"):
        _pull()
    assert hub.log == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    first = _pull()
    hub.stop()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = _pull()
    assert again.reused and again.path == first.path
    # a damaged store file is not served offline
    (first.path / "config.json").write_text("{}")
    with pytest.raises(DownloadError, match="offline"):
        _pull()


def test_header_check_refuses_contract_breaking_weights_without_downloading(tmp_path, hub, home, monkeypatch):
    import torch

    from tests.setup_wizard.hub_helpers import file_pins, tiny_tensors, toml_catalog, write_checkpoint

    t = tiny_tensors()
    t["layers.0.self_attn.q_proj.weight"] = torch.zeros(64, 32, dtype=torch.bfloat16)  # wrong shape
    src = write_checkpoint(tmp_path / "broken", tensors=t)
    hub.add("x/broken", REV, {p.name: p.read_bytes() for p in src.iterdir()})
    cat = tmp_path / "c.toml"
    cat.write_text(toml_catalog([
        {"name": "tiny-target", "kind": "target", "source": "hf"},
        {"name": "broken", "kind": "dflash2", "source": "hf", "repo": "x/broken", "revision": REV,
         "fits": ["tiny-target"], "file": file_pins(src)}]))
    monkeypatch.setenv("STRATA_CATALOG", str(cat))
    with pytest.raises(HeaderCheckError, match="layers.0.self_attn.q_proj.weight"):
        _pull("broken")
    assert None not in hub.gets("model.safetensors")  # only ranged header reads
    assert not list((home / "downloads").rglob("model.safetensors*"))


def test_unpinned_entries_are_refused_with_a_message(home):
    cat = load_catalog()
    for name in ("qwen3.8-flash-next-dflash2", "turbo-brilliance", "qwen3.8-flash-next"):
        with pytest.raises(UnpinnedError, match="not pinned"):
            _pull(name, catalog=cat)


def test_bundled_source_goes_through_the_same_checks(tmp_path, home):
    from setup_wizard.catalog import CatalogEntry, CatalogFile
    from setup_wizard.hub import download_entry
    from tests.setup_wizard.hub_helpers import file_pins, write_checkpoint

    root = tmp_path / "bundled"
    src = write_checkpoint(root / "tiny-pack")
    files = tuple(CatalogFile(**p) for p in file_pins(src))
    e = CatalogEntry("tiny-pack", "dflash2", "bundled", "tiny-pack", None, files, ("t",))
    res = download_entry(e, bundled_dir=root, offline=True)
    assert (res.path / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert Store().read_manifest(res.path)["verified"]
    bad = CatalogEntry("tiny-pack2", "dflash2", "bundled", "tiny-pack", None,
                       (files[0], CatalogFile("model.safetensors", "a" * 64, files[1].size)), ("t",))
    with pytest.raises(ChecksumError, match="model.safetensors"):
        download_entry(bad, bundled_dir=root)


def test_hf_token_is_sent(tiny_repo, hub, home, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test_token_123")
    _pull()
    hub_side = [a for p, a in hub.auth if not p.startswith("/cdn/")]
    cdn_side = [a for p, a in hub.auth if p.startswith("/cdn/")]
    assert hub_side and all(a == "Bearer hf_test_token_123" for a in hub_side)
    assert cdn_side and all(a is None for a in cdn_side)  # the token never leaves the Hub for the CDN
    assert hub.redirects  # the weights came the LFS way: 302 from resolve to the CDN


def test_disk_space_is_checked_before_any_byte_moves(tiny_repo, hub, home, monkeypatch):
    from setup_wizard.store import StoreError

    monkeypatch.setattr(Store, "free_bytes", lambda self, where=None: 1000)
    with pytest.raises(StoreError, match="Not enough disk space"):
        _pull()
    assert hub.log == []
