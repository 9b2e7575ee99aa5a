"""Fixtures of the setup_wizard tests: a private STRATA_HOME, a loopback Hub, a tiny pinned DFlash2 repo, and for the
wizard a tiny pack made once per session and fakes of the machine and of the services."""

from __future__ import annotations

import pytest

from tests.setup_wizard.hub_helpers import REPO, REV, file_pins, toml_catalog, write_checkpoint
from tests.setup_wizard.hub_server import FakeHub
from tests.setup_wizard.wizard_fakes import FakeServices, fake_gpu, make_pack


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


@pytest.fixture(scope="session")
def pack(tmp_path_factory):
    return make_pack(tmp_path_factory.mktemp("pack"))


@pytest.fixture
def services(pack, home):
    return FakeServices(pack=pack, store=home / "store")


@pytest.fixture
def machine(monkeypatch, services):
    """Point the CLI's seams at the fakes; returns a dict the test may change (hardware, services)."""
    from setup_wizard import cli

    state = {"hw": fake_gpu(), "services": services}
    monkeypatch.setattr(cli, "get_hardware", lambda: state["hw"])
    monkeypatch.setattr(cli, "get_services", lambda *a: state["services"])
    monkeypatch.setattr(cli, "is_interactive", lambda: False)
    return state
