"""Shared fixtures of the wizard tests: a tiny pack made once per session, a fresh STRATA_HOME per test."""

from __future__ import annotations

import pytest

from tests.wizard.wizard_fakes import FakeServices, fake_gpu, make_pack


@pytest.fixture(scope="session")
def pack(tmp_path_factory):
    return make_pack(tmp_path_factory.mktemp("pack"))


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    monkeypatch.setenv("STRATA_HOME", str(h))
    return h


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
