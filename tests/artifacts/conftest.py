"""Fixtures for the artifact tests: a loopback Hub, a private STRATA_HOME, a tiny pinned DFlash2 repo."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from artifacts_helpers import REPO, REV, file_pins, toml_catalog, write_checkpoint  # noqa: E402,F401
from hub_server import FakeHub  # noqa: E402


@pytest.fixture()
def home(tmp_path, monkeypatch):
    h = tmp_path / "strata-home"
    monkeypatch.setenv("STRATA_HOME", str(h))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.delenv("STRATA_CATALOG", raising=False)
    return h


@pytest.fixture()
def hub(monkeypatch):
    srv = FakeHub().start()
    monkeypatch.setenv("HF_ENDPOINT", srv.url)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield srv
    srv.stop()


@pytest.fixture()
def tiny_repo(tmp_path, hub, home, monkeypatch):
    """A tiny DFlash2 repo on the fake Hub and a STRATA_CATALOG pinning it as `tiny-head` (fits `tiny-target`)."""
    src = write_checkpoint(tmp_path / "src")
    files = {p.name: p.read_bytes() for p in src.iterdir()}
    hub.add(REPO, REV, files)
    pins = file_pins(src)
    cat = tmp_path / "catalog.toml"
    cat.write_text(toml_catalog([
        {"name": "tiny-target", "kind": "target", "source": "hf"},
        {"name": "tiny-head", "kind": "dflash2", "source": "hf", "repo": REPO, "revision": REV,
         "fits": ["tiny-target"], "default": True, "file": pins},
    ]))
    monkeypatch.setenv("STRATA_CATALOG", str(cat))
    return {"src": src, "files": files, "pins": pins, "catalog": cat}
