"""Locks (docs/store.md, "Locks"): two setups and a gc racing on one store all succeed and nothing live is
removed; two pulls of one entry never share a `.part`. The loopback Hub is slowed so the runs overlap; every wait
is bounded."""

from __future__ import annotations

import hashlib
import threading
import time
import tomllib
from pathlib import Path

import pytest
import tomli_w

from runtime.artifact_check import check_config_artifacts
from runtime.config import load
from setup_wizard.choices import Choices
from setup_wizard.models_cli import collect_garbage, verify_models
from setup_wizard.plan import resolve
from setup_wizard.services import RealServices
from setup_wizard.steps import execute
from tests.setup_wizard.hub_server import FakeHub
from tests.setup_wizard.wizard_fakes import fake_cpu

REV_T = "1" * 40
REV_H = "2" * 40
BOUND_S = 60


def _pins(folder: Path) -> list[dict]:
    return [{"path": p.name, "sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "size": p.stat().st_size}
            for p in sorted(folder.iterdir()) if p.is_file()]


@pytest.fixture
def slow_hub(pack, home, tmp_path, monkeypatch):
    """The tiny pack on the loopback Hub as pinned entries `nano` (target) and `nano-head` (DFlash2)."""
    hub = FakeHub().start()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    for repo, rev, folder in (("t/nano", REV_T, pack["nano"]), ("t/nano-head", REV_H, pack["official"])):
        hub.add(repo, rev, {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()})
    cat = tmp_path / "catalog.toml"
    cat.write_text(tomli_w.dumps({"entry": [
        {"name": "nano", "kind": "target", "source": "hf", "repo": "t/nano", "revision": REV_T, "mtp": True,
         "file": _pins(pack["nano"])},
        {"name": "nano-head", "kind": "dflash2", "source": "hf", "repo": "t/nano-head", "revision": REV_H,
         "fits": ["nano"], "default": True, "file": _pins(pack["official"])},
    ]}))
    monkeypatch.setenv("STRATA_CATALOG", str(cat))
    hub.delay = 0.02          # 20 ms per 64 KiB: each download takes a while, so the runs overlap
    yield hub
    hub.stop()


def _in_threads(*fns, timeout: float = BOUND_S) -> list:
    out: list = [None] * len(fns)

    def call(i, fn):
        try:
            out[i] = fn()
        except BaseException as exc:  # noqa: BLE001  (reported by the test)
            out[i] = exc

    threads = [threading.Thread(target=call, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0))
    assert not any(t.is_alive() for t in threads), "a run did not finish in time (a lock never released?)"
    return out


def _setup(config: Path, **choices):
    def run():
        c = Choices(target="nano", calibrate=False, context=256, config_out=config, **choices)
        return execute(resolve(c, fake_cpu(ram_gib=8), RealServices()), RealServices())
    return run


def test_two_pulls_of_one_entry_share_nothing(slow_hub, home):
    from setup_wizard.hub import pull

    a, b = _in_threads(lambda: pull("nano"), lambda: pull("nano"))
    assert not isinstance(a, BaseException) and not isinstance(b, BaseException), (a, b)
    assert sorted([a.reused, b.reused]) == [False, True]       # the second waited, then re-hashed the first's copy
    assert slow_hub.gets("model.safetensors").count(None) == 1 and not list(home.rglob("*.part"))


def test_two_setups_and_a_gc_racing_on_one_store(slow_hub, home, tmp_path):
    done = threading.Event()
    removed: list[str] = []

    def gc_loop():
        while not done.is_set():
            removed.extend(r["name"] for r in collect_garbage()["removed"])
            time.sleep(0.01)
        return True

    cfg_a, cfg_b = tmp_path / "a" / "dflash2.toml", tmp_path / "b" / "mtp.toml"   # both outside STRATA_HOME

    def both():
        try:
            return _in_threads(_setup(cfg_a, drafter="dflash2", dflash2_quant="q8_0"), _setup(cfg_b, drafter="mtp"))
        finally:
            done.set()

    setups, gc_ok = _in_threads(both, gc_loop)
    assert gc_ok is True
    for res in setups:
        assert not isinstance(res, BaseException), res
    for cfg in (cfg_a, cfg_b):
        check_config_artifacts(load(cfg))                      # everything each config names is there, unchanged
    assert all(r["ok"] for r in verify_models())
    assert collect_garbage()["removed"] == []                  # both configs are live
    # what gc removed during the race was only ever a partial item it held the lock of, never a used one
    assert set(removed) <= {"(partial) downloads/t--nano/" + REV_T, "(partial) downloads/t--nano-head/" + REV_H}
    doc = tomllib.loads(cfg_a.read_text())
    assert Path(doc["drafter"]["path"]).is_file() and Path(doc["target"]["path"]).is_dir()


def test_gc_in_the_middle_of_a_setup_keeps_its_items(slow_hub, home, tmp_path, monkeypatch):
    """The riskiest moment: everything downloaded and converted, the config not written yet (calibration runs)."""
    from calibrate.key import key_for_config
    from calibrate.results import CalibrationResult

    seen: dict = {}

    class GcWhileCalibrating(RealServices):
        def calibrate(self, doc, *, force, max_seconds):
            seen["gc"] = _in_threads(collect_garbage)[0]        # another process's gc, as a thread
            d = doc if isinstance(doc, dict) else tomllib.loads(Path(doc).read_text())
            key = key_for_config(d, device=(d["device"]["name"], d["device"]["total_mib"]))
            return CalibrationResult(block=3, spec_min_p=0.3, source="calibrated", decision="winner", reason="",
                                     key=key, record={})

    cfg = tmp_path / "mine.toml"
    c = Choices(target="nano", drafter="dflash2", dflash2_quant="q4_0", calibrate=True, context=256,
                config_out=cfg)
    try:
        execute(resolve(c, fake_cpu(ram_gib=8), GcWhileCalibrating()), GcWhileCalibrating())
    finally:
        gc = seen["gc"]
        assert gc["removed"] == [] and len(gc["busy"]) == 3   # target, head and converted drafter: all held
    check_config_artifacts(load(cfg))
    assert collect_garbage()["removed"] == []
